"""HF checkpoints of every family loaded into Megatron at (TP, PP) in {1,2}x{1,2} on gloo:

- Megatron logits equal transformers' logits (fp32, max abs diff <= 1e-5);
- the streaming export gives back every HF tensor bit-exactly (to all ranks, and to rank 0 only),
  in buckets bounded by the bucket size, without holding earlier buckets;
- a distributed checkpoint saved at one layout loads at another with identical logits
  (TP1xPP1 -> TP2xPP2 and back; the vocabulary padding differs between them);
- a damaged checkpoint is refused with a clear error.

Five spawns: world 1 (saves A), world 4 (loads A, saves B), world 2 twice (load B), world 1 (loads B).
"""

import shutil
import time
import weakref
from pathlib import Path

import pytest
import torch

from megatron_stare.testing.distributed import run_on_ranks
from megatron_stare.testing.hf_models import build_tiny_hf_model, hf_logits

pytestmark = pytest.mark.distributed

BUCKET = 48 << 10  # bytes; the tiny models are ~1.5 MB, so ~30+ buckets
VOCAB_MULTIPLE = 16  # padded vocab: 400 at TP1, 416 at TP2 (397 tokens)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
LAYOUTS = [(1, 1, 1), (4, 2, 2), (2, 2, 1), (2, 1, 2)]  # (world, tp, pp), run in this order


def _exact(got, ref):
    return sorted(got) == sorted(ref) and all(torch.equal(got[n], ref[n]) for n in ref)


def _still_alive(ref, wait_s=2.0):
    """True if the weakly referenced tensor outlives ``wait_s``: gloo's work objects may hold a
    sent buffer for a moment after the collective returns, which is not the exporter's doing."""
    deadline = time.monotonic() + wait_s
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.005)
    return ref() is not None


def _layout_worker(rank, world, tp, pp, models, tokens, ckpt_root, export, save, load_tag, damage):
    from safetensors.torch import load_file

    from megatron_stare.checkpoint.dist_ckpt import load_model, save_model
    from megatron_stare.weight_sync.export import ExportStats, iter_hf_buckets
    from megatron_stare.models.provider import build_from_hf, build_model_stage
    from megatron_stare.runtime.parallel import ParallelLayout, init_distributed
    from megatron_stare.testing.hf_models import megatron_logits

    groups = init_distributed(ParallelLayout.from_world(world, tp=tp, pp=pp))
    out = {}
    for fam, path in models.items():
        model, spec, _ = build_from_hf(path, groups, make_vocab_size_divisible_by=VOCAB_MULTIPLE)
        r = {"logits": megatron_logits(model, groups, spec, tokens)}
        if export:
            ref = load_file(str(Path(path) / "model.safetensors"))
            stats, got, prev, held = ExportStats(), {}, None, 0
            for b in iter_hf_buckets(model, groups, spec, BUCKET, dst="all", stats=stats):
                held += prev is not None and _still_alive(prev)
                got.update((n, t.clone()) for n, t in b)
                prev = weakref.ref(b.buffer)
                del b
            r.update(export_all=_exact(got, ref), stats=stats, held=held,
                     largest_param=max(p.numel() * p.element_size() for p in model.parameters()) * tp)
            got0 = {n: t.clone() for b in iter_hf_buckets(model, groups, spec, BUCKET, dst=0)
                    for n, t in b}
            r["export_dst0"] = _exact(got0, ref) if rank == 0 else not got0
            r["pieces"] = _piece_export(rank, model, groups, spec, ref)
        if save:
            save_model(model, groups, Path(ckpt_root) / f"{fam}_tp{tp}pp{pp}", spec)
        if load_tag is not None:
            m2, _ = build_model_stage(spec, groups)
            load_model(m2, Path(ckpt_root) / f"{fam}_{load_tag}", spec)
            r["ckpt_logits"] = megatron_logits(m2, groups, spec, tokens)
            if damage and rank == 0:
                bad = Path(ckpt_root) / f"{fam}_damaged"
                shutil.copytree(Path(ckpt_root) / f"{fam}_{load_tag}", bad)
                next(bad.glob("*.distcp")).unlink()
                try:
                    load_model(build_model_stage(spec, groups)[0], bad, spec)
                    r["damaged_error"] = None
                except ValueError as e:
                    r["damaged_error"] = str(e)
        out[fam] = r
    return out


def _piece_export(rank, model, groups, spec, ref):
    """The weight sync's export (``pieces=True``, dst rank 0, fp32 and bf16): rank 0 writes each
    piece into preallocated HF tensors (allocated before the measurement, so the allocator's
    peak is the exporter's own), every rank measures its peak extra memory."""
    from megatron_stare.weight_sync.export import ExportStats, iter_hf_buckets
    from megatron_stare.weight_sync import PeakMemory

    out = {}
    for dtype in (None, torch.bfloat16):
        want = {n: t.to(dtype or t.dtype) for n, t in ref.items()}
        got = {n: torch.full_like(t, float("nan")) for n, t in want.items()} if rank == 0 else {}
        sizes, n_pieces, stats = [], 0, ExportStats()
        with PeakMemory() as mem:
            for b in iter_hf_buckets(model, groups, spec, BUCKET, dst=0, dtype=dtype, stats=stats, pieces=True):
                sizes.append(b.nbytes)
                for m, view in b.entries():
                    n_pieces += m.is_piece
                    got[m.name][tuple(slice(a, a + k) for a, k in zip(m.start or (0,) * view.dim(), m.shape))] = view
                del b, m, view
        out[dtype] = {"exact": _exact(got, want) if rank == 0 else not got, "sizes": sizes,
                      "pieces": n_pieces, "peak": mem.peak_bytes}
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_hf")
    return {
        "qwen2": str(build_tiny_hf_model("qwen2", root / "qwen2", seed=1)),
        "llama": str(build_tiny_hf_model("llama", root / "llama", seed=2, rope_theta=10000.0,
                                         rope_scaling=LLAMA3_ROPE, max_position_embeddings=16384)),
        "qwen3": str(build_tiny_hf_model("qwen3", root / "qwen3", seed=3, head_dim=48,
                                         tie_word_embeddings=True)),
    }


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 397, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def reference(models, tokens):
    return {fam: hf_logits(path, tokens) for fam, path in models.items()}


@pytest.fixture(scope="module")
def runs(models, tokens, tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    res = {}
    for world, tp, pp in LAYOUTS:
        load = {(2, 2): "tp1pp1", (2, 1): "tp2pp2", (1, 2): "tp2pp2"}.get((tp, pp))
        save = (tp, pp) in ((1, 1), (2, 2))
        res[(tp, pp)] = run_on_ranks(_layout_worker, world, tp, pp, models, tokens, ckpt, True, save,
                                     load, False)
    # TP2xPP2 -> TP1xPP1, and a damaged copy of that checkpoint
    res[(1, 1, "load")] = run_on_ranks(_layout_worker, 1, 1, 1, models, tokens, ckpt, False, False,
                                       "tp2pp2", True)
    return res


IDS = [f"tp{tp}pp{pp}" for _, tp, pp in LAYOUTS]


@pytest.mark.parametrize("tp,pp", [(tp, pp) for _, tp, pp in LAYOUTS], ids=IDS)
def test_logits_match_transformers(runs, reference, tp, pp):
    for rank, per_fam in enumerate(runs[(tp, pp)]):
        for fam, r in per_fam.items():
            diff = (r["logits"] - reference[fam]).abs().max().item()
            assert diff <= 1e-5, f"{fam} rank {rank}: logits differ from transformers by {diff}"


@pytest.mark.parametrize("tp,pp", [(tp, pp) for _, tp, pp in LAYOUTS], ids=IDS)
def test_export_round_trip_is_bit_exact(runs, tp, pp):
    for rank, per_fam in enumerate(runs[(tp, pp)]):
        for fam, r in per_fam.items():
            assert r["export_all"], f"{fam} rank {rank}: dst='all' export differs from the HF input"
            assert r["export_dst0"], f"{fam} rank {rank}: dst=0 export wrong (or data off rank 0)"


@pytest.mark.parametrize("tp,pp", [(tp, pp) for _, tp, pp in LAYOUTS], ids=IDS)
def test_export_memory_is_bounded_by_the_bucket(runs, tp, pp):
    for rank, per_fam in enumerate(runs[(tp, pp)]):
        for fam, r in per_fam.items():
            s = r["stats"]
            assert s.bytes > 10 * BUCKET  # this rank's stage: the bound is not vacuous
            assert s.max_bucket_bytes <= max(BUCKET, s.max_tensor_bytes), (fam, s)
            # one bucket buffer + the tensor in flight (canonical + its HF pieces)
            assert s.peak_live_bytes <= max(BUCKET, s.max_tensor_bytes) + 2 * r["largest_param"], (fam, s)
            assert r["held"] == 0, f"{fam}: the exporter kept a bucket alive after yielding the next"


@pytest.mark.parametrize("tp,pp", [(tp, pp) for _, tp, pp in LAYOUTS], ids=IDS)
def test_piece_export_is_exact_in_buckets_of_at_most_the_bucket_size(runs, tp, pp):
    """The weight sync's export (pieces written straight into the buckets): every HF tensor
    bit-exact on rank 0 (fp32, and cast to bf16), no bucket above the bucket size although the
    embedding is larger, and no exporter memory beyond its bucket buffers: rank 0, which drops
    each bucket before asking for the next, holds one bucket at a time (nothing else: no gather
    buffer, no HF copies); a stage that hands its buckets to rank 0 keeps one in flight (two)."""
    for rank, per_fam in enumerate(runs[(tp, pp)]):
        for fam, r in per_fam.items():
            for dtype, x in r["pieces"].items():
                where = f"{fam} rank {rank} {dtype}"
                assert x["exact"], f"{where}: piece export differs from the HF input (or data off rank 0)"
                if rank == 0:
                    assert x["pieces"] > 0 and len(x["sizes"]) > 10, where  # not vacuous
                    assert max(x["sizes"]) <= BUCKET, (where, max(x["sizes"]))
                assert x["peak"] <= (1 if rank == 0 else 2) * BUCKET + (16 << 10), (where, x["peak"])


@pytest.mark.parametrize("tp,pp,src", [(2, 2, "tp1pp1"), (2, 1, "tp2pp2"), (1, 2, "tp2pp2"),
                                       (1, 1, "tp2pp2")])
def test_dist_checkpoint_loads_at_another_layout(runs, tp, pp, src):
    key = (tp, pp, "load") if (tp, pp) == (1, 1) else (tp, pp)
    for rank, per_fam in enumerate(runs[key]):
        for fam, r in per_fam.items():
            # same layout, same weights: the logits must be identical, not merely close
            assert torch.equal(r["ckpt_logits"], r["logits"]), (fam, rank, src)


def test_damaged_checkpoint_is_refused(runs):
    for fam, r in runs[(1, 1, "load")][0].items():
        assert r["damaged_error"] and "damaged" in r["damaged_error"], r["damaged_error"]


def _linear_rope_worker(rank, world, path, tokens):
    from megatron_stare.models.provider import build_from_hf
    from megatron_stare.runtime.parallel import ParallelLayout, init_distributed
    from megatron_stare.testing.hf_models import megatron_logits

    groups = init_distributed(ParallelLayout.from_world(world, tp=world))
    model, spec, _ = build_from_hf(path, groups)
    return megatron_logits(model, groups, spec, tokens)


def test_linear_rope_scaling_matches_transformers(tmp_path):
    # Megatron interpolates positions where HF divides frequencies: same angles, other rounding.
    path = build_tiny_hf_model("llama", tmp_path / "lin", seed=4, rope_theta=10000.0,
                               rope_scaling={"rope_type": "linear", "factor": 4.0})
    tokens = torch.randint(0, 397, (1, 48), generator=torch.Generator().manual_seed(1))
    got = run_on_ranks(_linear_rope_worker, 1, str(path), tokens)[0]
    diff = (got - hf_logits(path, tokens)).abs().max().item()
    assert diff <= 1e-5, diff


def _dp2_worker(rank, world, path, ckpt, tokens):
    from safetensors.torch import load_file

    from megatron_stare.checkpoint.dist_ckpt import load_model, save_model
    from megatron_stare.weight_sync.export import iter_hf_buckets
    from megatron_stare.models.provider import build_from_hf, build_model_stage
    from megatron_stare.runtime.parallel import ParallelLayout, init_distributed
    from megatron_stare.testing.hf_models import megatron_logits

    groups = init_distributed(ParallelLayout.from_world(world))  # dp = 2
    model, spec, _ = build_from_hf(path, groups)
    ref = load_file(str(Path(path) / "model.safetensors"))
    to_all = {n: t.clone() for b in iter_hf_buckets(model, groups, spec, BUCKET) for n, t in b}
    to_1 = {n: t.clone() for b in iter_hf_buckets(model, groups, spec, BUCKET, dst=1) for n, t in b}
    save_model(model, groups, ckpt, spec)  # fully-parallel: the replicas split the writing
    m2, _ = build_model_stage(spec, groups)
    load_model(m2, ckpt, spec)
    same = torch.equal(megatron_logits(m2, groups, spec, tokens), megatron_logits(model, groups, spec, tokens))
    return {"all": _exact(to_all, ref), "dst1": _exact(to_1, ref) if rank == 1 else not to_1,
            "ckpt": same, "files": sorted(p.name for p in Path(ckpt).glob("*.distcp"))}


def test_data_parallel_replicas_export_and_save(tmp_path):
    path = build_tiny_hf_model("qwen2", tmp_path / "m", seed=9)
    tokens = torch.randint(0, 397, (1, 8), generator=torch.Generator().manual_seed(2))
    res = run_on_ranks(_dp2_worker, 2, str(path), str(tmp_path / "ckpt"), tokens)
    for rank, r in enumerate(res):
        assert r["all"] and r["dst1"] and r["ckpt"], (rank, r)
    assert any(f.startswith("__1_") for f in res[0]["files"])  # rank 1 wrote part of it


def _cp2_save_worker(rank, world, path, ckpt):
    from megatron_stare.checkpoint.dist_ckpt import load_model, save_model
    from megatron_stare.models.provider import build_from_hf, build_model_stage
    from megatron_stare.runtime.parallel import ParallelLayout, init_distributed

    groups = init_distributed(ParallelLayout.from_world(world, cp=2))  # dp = 1
    model, spec, _ = build_from_hf(path, groups)
    save_model(model, groups, ckpt, spec)  # fully parallel over DP x CP: both CP ranks write
    m2, _ = build_model_stage(spec, groups)
    load_model(m2, ckpt, spec)
    a, b = model.state_dict(), m2.state_dict()
    same = all(torch.equal(t, b[k]) for k, t in a.items() if isinstance(t, torch.Tensor))
    return {"same": same, "sizes": {p.name: p.stat().st_size for p in Path(ckpt).glob("*.distcp")}}


def test_context_parallel_ranks_split_the_save(tmp_path):
    path = build_tiny_hf_model("qwen2", tmp_path / "m", seed=9)
    res = run_on_ranks(_cp2_save_worker, 2, str(path), str(tmp_path / "ckpt"))
    assert all(r["same"] for r in res)
    sizes = res[0]["sizes"]
    mine = lambda r: sum(s for n, s in sizes.items() if n.startswith(f"__{r}_"))  # noqa: E731
    assert min(mine(0), mine(1)) > 0.25 * (mine(0) + mine(1)), sizes  # both wrote a real share
