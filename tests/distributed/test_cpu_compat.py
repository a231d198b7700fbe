"""Each CPU patch of megatron_stare.compat.cpu is needed: leaving it out breaks the Megatron
path it exists for, and with all patches that same path works. Each case runs in a fresh
spawned process, since the patches are process-wide. The same holds for the sequence-parallel
norm of our layer spec (models/layer_specs.py): Megatron's torch norm refuses sequence
parallel, and a norm that does not mark its weights trains wrong numbers."""

import pytest
import torch

from megatron_stare.testing.distributed import run_on_ranks

pytestmark = pytest.mark.distributed

if torch.cuda.is_available():  # pragma: no cover - the layer is a no-op with CUDA
    pytest.skip("the CPU compatibility layer only applies without CUDA", allow_module_level=True)


def _train_one_step(rank, world, skip, pp, clip_grad):
    """Apply the layer minus ``skip``, then one Megatron training step; 'ok' or the error."""
    from megatron_stare.compat import cpu as cpu_compat

    cpu_compat.apply(skip=skip)
    try:
        from megatron_stare.runtime.parallel import ParallelLayout, init_distributed
        from megatron_stare.testing import megatron_tiny as mt

        groups = init_distributed(ParallelLayout.from_world(world, pp=pp))
        batches = mt.lm_batches(4, 8, mt.TINY_SPEC.vocab_size, 1)
        out = mt.train_lm_steps(groups, batches, 2, clip_grad=clip_grad)
        return "ok" if all(torch.isfinite(torch.tensor(out["loss"]))) else "nan"
    except Exception as e:  # noqa: BLE001 - the error is the result under test
        return f"{type(e).__name__}: {e}"


@pytest.mark.parametrize("skip,pp,clip", [
    ("current_device", 1, 1.0),
    ("rng", 1, 1.0),
    ("factories", 1, 0.0),
    ("clip_grads", 1, 1.0),
    ("synchronize", 2, 0.0),
])
def test_patch_is_needed(skip, pp, clip):
    broken = run_on_ranks(_train_one_step, pp, (skip,), pp, clip)
    assert any(r != "ok" for r in broken), f"training worked without the {skip!r} patch"
    fixed = run_on_ranks(_train_one_step, pp, (), pp, clip)
    assert fixed == ["ok"] * pp, fixed


def _streams(rank, world, skip):
    from megatron_stare.compat import cpu as cpu_compat

    cpu_compat.apply(skip=skip)
    try:
        # The calls newer megatron DDP makes around its gradient-reduction stream.
        stream = torch.cuda.Stream(device=torch.cuda.current_device())
        stream.wait_stream(torch.cuda.default_stream())
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.stream(stream):
            pass
        return "ok"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def test_streams_patch_is_needed():
    assert run_on_ranks(_streams, 1, ("streams",))[0] != "ok"
    assert run_on_ranks(_streams, 1, ())[0] == "ok"


def _rng_fork_semantics(rank, world):
    from megatron_stare.compat import cpu as cpu_compat

    cpu_compat.apply()
    from megatron.core import tensor_parallel

    from megatron_stare.runtime.parallel import ParallelLayout, init_distributed

    init_distributed(ParallelLayout.from_world(world), seed=7)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    mid = torch.get_rng_state()
    with tracker.fork():
        b = torch.rand(3)
    # Default stream untouched by forks; the named stream advances across forks.
    return torch.equal(before, mid), torch.equal(a, b), a, torch.equal(torch.get_rng_state(), before)


def test_rng_tracker_fork_semantics():
    untouched, repeated, a, after = run_on_ranks(_rng_fork_semantics, 1)[0]
    again = run_on_ranks(_rng_fork_semantics, 1)[0][2]
    assert untouched and after, "forking changed the default CPU generator"
    assert not repeated, "the named state did not advance between forks"
    assert torch.equal(a, again), "the named state is not reproducible from the seed"


def _tied_pp2(rank, world, skip):
    from megatron_stare.compat import cpu as cpu_compat

    cpu_compat.apply(skip=skip)
    try:
        import dataclasses

        from megatron_stare.models.provider import build_model_stage
        from megatron_stare.runtime.parallel import ParallelLayout, init_distributed
        from megatron_stare.testing.megatron_tiny import TINY_SPEC

        groups = init_distributed(ParallelLayout.from_world(world, pp=2))
        build_model_stage(dataclasses.replace(TINY_SPEC, tie_word_embeddings=True), groups)
        return "ok"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def test_tensor_cuda_patch_is_needed_for_tied_embeddings_across_stages():
    assert any(r != "ok" for r in run_on_ranks(_tied_pp2, 2, ("tensor_cuda",)))
    assert run_on_ranks(_tied_pp2, 2, ()) == ["ok", "ok"]


def _train_optimizer(rank, world, skip, distributed_optimizer, dtype):
    """One step with Megatron's DistributedOptimizer or its bf16 (Float16) optimizer."""
    from megatron_stare.compat import cpu as cpu_compat

    cpu_compat.apply(skip=skip)
    try:
        from megatron_stare.runtime.parallel import ParallelLayout, init_distributed
        from megatron_stare.testing import megatron_tiny as mt

        groups = init_distributed(ParallelLayout.from_world(world, distributed_optimizer=distributed_optimizer))
        batches = mt.lm_batches(4, 8, mt.TINY_SPEC.vocab_size, 1)
        out = mt.train_lm_steps(groups, batches, 2, dtype=getattr(torch, dtype))
        return "ok" if all(torch.isfinite(torch.tensor(out["loss"]))) else "nan"
    except Exception as e:  # noqa: BLE001 - the error is the result under test
        return f"{type(e).__name__}: {e}"


@pytest.mark.parametrize("world,distributed_optimizer,dtype", [(2, True, "float32"), (1, False, "bfloat16")],
                         ids=["distributed_optimizer", "bf16_main_params"])
def test_optimizer_type_check_patch_is_needed(world, distributed_optimizer, dtype):
    broken = run_on_ranks(_train_optimizer, world, ("optimizer_type_checks",), distributed_optimizer, dtype)
    assert all("torch.cuda.FloatTensor" in r for r in broken), broken
    assert run_on_ranks(_train_optimizer, world, (), distributed_optimizer, dtype) == ["ok"] * world


def _sequence_parallel(rank, world, norm):
    """Three Adam steps of the tiny model at TP=world with sequence parallel, built with our
    norm (``ours``), Megatron's torch norm (``megatron``) or ours without the marks (``unmarked``)."""
    from megatron_stare.models import layer_specs
    from megatron_stare.testing.megatron_tiny import run_layout

    if norm == "megatron":
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        layer_specs.TorchNorm = WrappedTorchNorm
    elif norm == "unmarked":
        ours = layer_specs.TorchNorm

        class Unmarked:
            def __new__(cls, config, hidden_size, **kw):
                out = ours(config, hidden_size, **kw)
                for p in out.parameters():
                    p.sequence_parallel = False
                return out

        layer_specs.TorchNorm = Unmarked
    try:
        return run_layout(rank, world, world, 1, 3, 2, sequence_parallel=world > 1)
    except Exception as e:  # noqa: BLE001 - the error is the result under test
        return f"{type(e).__name__}: {e}"


def test_sequence_parallel_needs_norms_marked_for_the_tp_all_reduce():
    ref = run_on_ranks(_sequence_parallel, 1, "ours")[0]
    refused = run_on_ranks(_sequence_parallel, 2, "megatron")
    assert all("sequence parallel not supported by torch" in r for r in refused), refused
    unmarked = run_on_ranks(_sequence_parallel, 2, "unmarked")[0]
    ours = run_on_ranks(_sequence_parallel, 2, "ours")[0]
    norm_diff = lambda got: max((got["weights"][n] - w).abs().max().item()  # noqa: E731
                                for n, w in ref["weights"].items() if "norm" in n)
    assert norm_diff(ours) <= 1e-6
    assert norm_diff(unmarked) > 1e-5, "norm weights trained right without the TP all-reduce"
    assert abs(ours["grad_norm"][0] - ref["grad_norm"][0]) <= 1e-5 * ref["grad_norm"][0]


def _moe_step(rank, world, skip):
    """One forward and backward of a tiny MoE model (SequentialMLP experts, alltoall dispatcher)
    at EP = world, with the layer minus ``skip``; 'ok' or the error."""
    from megatron_stare.compat import cpu as cpu_compat

    cpu_compat.apply(skip=skip)
    try:
        import dataclasses

        from megatron_stare.models.gpt import MoESpec
        from megatron_stare.models.provider import build_model_stage
        from megatron_stare.runtime.parallel import ParallelLayout, init_distributed
        from megatron_stare.testing.megatron_tiny import TINY_SPEC

        spec = dataclasses.replace(TINY_SPEC, num_layers=2, moe=MoESpec(num_experts=4, topk=2, ffn_hidden_size=32,
                                                                       layer_pattern=(1, 1)))
        groups = init_distributed(ParallelLayout.from_world(world, ep=world))
        model, _ = build_model_stage(spec, groups)
        tokens = torch.randint(0, 200, (2, 8), generator=torch.Generator().manual_seed(rank))
        out = model(tokens, torch.arange(8).unsqueeze(0).expand(2, 8), None)
        out.float().square().mean().backward()
        return "ok"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


@pytest.mark.parametrize("skip", ["moe_te_gemm", "moe_split_sizes", "streams", "current_device"])
def test_moe_patch_is_needed(skip):
    broken = run_on_ranks(_moe_step, 2, (skip,))
    assert any(r != "ok" for r in broken), f"the MoE step worked without the {skip!r} patch"


def test_moe_step_works_with_every_patch():
    assert run_on_ranks(_moe_step, 2, ()) == ["ok", "ok"]


def _uneven_gather(rank, world, skip):
    """megatron's sequence-parallel gather with unequal row counts per rank (what the alltoall
    dispatcher does at TP x ETP > 1) against the rows each rank holds."""
    from megatron_stare.compat import cpu as cpu_compat

    cpu_compat.apply(skip=skip)
    try:
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        from megatron_stare.runtime.parallel import ParallelLayout, init_distributed

        groups = init_distributed(ParallelLayout.from_world(world, tp=world))
        sizes = [3, 5]
        mine = torch.full((sizes[rank], 2), float(rank + 1))
        got = gather_from_sequence_parallel_region(mine, group=groups.tp_group, output_split_sizes=sizes)
        want = torch.cat([torch.full((n, 2), float(r + 1)) for r, n in enumerate(sizes)])
        return "ok" if torch.equal(got, want) else "wrong"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def test_uneven_gather_patch_is_needed():
    assert any(r != "ok" for r in run_on_ranks(_uneven_gather, 2, ("uneven_gather",)))
    assert run_on_ranks(_uneven_gather, 2, ()) == ["ok", "ok"]
