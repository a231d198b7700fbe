"""transformer-engine's attention with our packed rows (THD), against the torch attention
(skipped without CUDA, megatron-core or transformer-engine; the README lists this path as
unexecuted until a GPU with TE runs it).

The actor hands every layer a ``PackedRowParams`` (``cu_seqlens_q`` real lengths,
``cu_seqlens_q_padded`` slots, ``max_seqlen_q``), and under context parallel each rank holds
chunks r and 2*cp-1-r of every slot, as TE's ``thd_get_partitioned_indices``. These tests check
that TE reads them as the torch attention does: the same model in bf16 with TE's layer spec and
with the local spec + torch attention gives the same logits on padded rows and on a packed row;
the packed row's logits equal the padded rows'; with 2 GPUs, CP2 through TE equals one GPU; and
TE's own THD partitioning equals ``batching.slot_chunks``."""

import pytest
import torch

from megatron_stare.testing.distributed import run_on_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _te():
    pytest.importorskip("megatron.core", reason="needs megatron-core (scripts/gpu_check.sh installs it)")
    pytest.importorskip("transformer_engine", reason="needs transformer-engine (the TE/THD path)")


SEQ_LENS = [37, 5, 120, 64]
BF16_TOL = 5e-2  # logits of a 4-layer model in bf16, two attention kernels
#: TE's layer spec fuses the pre-norms into the next linear: seed them as the local spec's norms.
_TE_NORMS = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
             "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}


def _seeded(name, shape):
    from megatron_stare.testing.megatron_tiny import seeded_canonical

    for te, local in _TE_NORMS.items():
        name = name.replace(te, local)
    return seeded_canonical(name, shape).to(torch.bfloat16)


def _logits(rank, world, cp, attention):
    """Logits of SEQ_LENS through the tiny model (bf16) on this CP rank: padded rows (each row
    one sequence) and one packed row, both gathered back to ``{sequence: [n, V]}``."""
    import os

    from megatron_stare.actor.batching import slot_chunks
    from megatron_stare.models.provider import build_model_stage
    from megatron_stare.models.sharding import load_canonical
    from megatron_stare.models.torch_attention import PackedRowParams
    from megatron_stare.runtime.parallel import ParallelLayout, init_distributed
    from megatron_stare.testing.megatron_tiny import TINY_SPEC

    os.environ.setdefault("NVTE_FLASH_ATTN", "1")
    groups = init_distributed(ParallelLayout.from_world(world, cp=cp))
    model, _ = build_model_stage(TINY_SPEC, groups, dtype=torch.bfloat16, attention=attention)
    load_canonical(model, _seeded, 0, 1)
    model.eval()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, TINY_SPEC.vocab_size, (n,), generator=g) for n in SEQ_LENS]
    unit = 2 * cp if cp > 1 else 1
    slots = [-(-n // unit) * unit for n in SEQ_LENS]
    out = {"padded": {}, "packed": {}}
    with torch.no_grad():
        width = -(-max(slots) // unit) * unit
        rows = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            rows[i, :s.numel()] = s
        keep = slot_chunks(width, cp, groups.cp_rank)
        pos = torch.arange(width)[keep].expand(len(seqs), -1)
        logits = model(rows[:, keep].cuda(), pos.cuda(), None).float().cpu()
        for i, n in enumerate(SEQ_LENS):
            mine = keep < n
            out["padded"][i] = (keep[mine], logits[i, mine])
        ids, positions, where = [], [], []
        for i, (s, slot) in enumerate(zip(seqs, slots)):
            k = slot_chunks(slot, cp, groups.cp_rank)
            padded = torch.zeros(slot, dtype=torch.long)
            padded[:s.numel()] = s
            ids.append(padded[k]), positions.append(k), where.append((i, k))
        params = PackedRowParams.of(SEQ_LENS, slots, "cuda")
        logits = model(torch.cat(ids)[None].cuda(), torch.cat(positions)[None].cuda(), None,
                       packed_seq_params=params).float().cpu()[0]
        offset = 0
        for i, k in where:
            mine = k < SEQ_LENS[i]
            out["packed"][i] = (k[mine], logits[offset:offset + k.numel()][mine])
            offset += k.numel()
    return out


def _merge(ranks, mode):
    """{sequence: [n, V]} from every CP rank's (positions, logits) pieces."""
    full = {}
    for i, n in enumerate(SEQ_LENS):
        rows = torch.empty(n, ranks[0][mode][i][1].shape[-1])
        for r in ranks:
            pos, val = r[mode][i]
            rows[pos] = val
        full[i] = rows
    return full


def _close(a, b):
    return max(((a[i] - b[i]).abs().max() / b[i].abs().max()).item() for i in b) <= BF16_TOL


def _nccl_logits(world, cp, attention):
    """``_logits`` on ``world`` GPU ranks (NCCL), every rank's result."""
    import os

    os.environ["MEGATRON_STARE_TEST_BACKEND"] = "nccl"
    try:
        return run_on_ranks(_logits, world, cp, attention)
    finally:
        os.environ.pop("MEGATRON_STARE_TEST_BACKEND", None)


@needs_cuda
def test_te_reads_packed_rows_as_the_torch_attention_does():
    te, torch_attn = _nccl_logits(1, 1, "te"), _nccl_logits(1, 1, "torch")
    for mode in ("padded", "packed"):
        assert _close(_merge(te, mode), _merge(torch_attn, mode)), mode
    assert _close(_merge(te, "packed"), _merge(te, "padded"))


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="context parallel needs 2 GPUs")
def test_te_context_parallel_thd_equals_one_gpu():
    one, cp2 = _nccl_logits(1, 1, "te"), _nccl_logits(2, 2, "te")
    for mode in ("padded", "packed"):
        assert _close(_merge(cp2, mode), _merge(one, mode)), mode


@needs_cuda
def test_te_thd_partitioning_equals_ours():
    import transformer_engine_torch as tex

    from megatron_stare.actor.batching import slot_chunks

    cp, slots = 2, [8, 4, 20, 8]
    cu = torch.tensor([0] + slots, dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
    for rank in range(cp):
        te = tex.thd_get_partitioned_indices(cu, sum(slots), cp, rank).cpu()
        ours = torch.cat([start + slot_chunks(n, cp, rank) for start, n in
                          zip(torch.tensor([0] + slots).cumsum(0)[:-1].tolist(), slots)])
        assert torch.equal(te.long(), ours), (rank, te, ours)
