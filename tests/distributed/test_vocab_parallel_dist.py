"""Vocab-parallel log-prob / entropy at TP in {1, 2, 4} on gloo against a float64 reference.

One spawned run of 4 ranks covers every case: TP=1 (tp_group=None on each rank), TP=2 (two
sub-groups) and TP=4, for fp64, fp32 and bf16 logits, a padded vocabulary (at TP=4 the last shard
is padding only), temperature, entropy with gradient, the sensitivity sums, and the no-logits path.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_stare.ops.fused_linear import fused_linear_logprobs_entropy
from megatron_stare.ops.vocab_parallel import vocab_parallel_logprobs_entropy
from megatron_stare.testing.distributed import run_on_ranks

pytestmark = pytest.mark.distributed

T, V_PAD, VALID, H = 23, 52, 37, 6  # V_PAD divisible by 4; with TP=4 shard 3 is all padding


def _reference(logits, targets, temperature):
    lp = torch.log_softmax(logits[:, :VALID].double() / temperature, -1)
    p = lp.exp()
    return (lp.gather(1, targets[:, None]).squeeze(1), -(p * lp).sum(1), (p * p).sum(1),
            (p * p * lp).sum(1))


def _max_err(a, b):
    """Max abs error relative to the reference's scale (floored at 1)."""
    return (a.double() - b.double()).abs().max().item() / max(1.0, b.abs().max().item())


def _worker(rank, world_size):
    import megatron_stare.ops.vocab_parallel as vp

    # Tiles of 1-3 rows: several tiles per chunk of 5 rows, partial tiles, partial chunks.
    vp.TILE_ELEMS = 40
    g = torch.Generator().manual_seed(0)  # identical data on every rank
    logits64 = torch.randn(T, V_PAD, generator=g, dtype=torch.float64) * 3
    hidden64 = torch.randn(T, H, generator=g, dtype=torch.float64)
    weight64 = torch.randn(V_PAD, H, generator=g, dtype=torch.float64)
    targets = torch.randint(0, VALID, (T,), generator=g)
    g_lp, g_h = torch.randn(T, generator=g, dtype=torch.float64), torch.randn(T, generator=g,
                                                                              dtype=torch.float64)
    groups = {1: None, 4: dist.new_group([0, 1, 2, 3])}
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    groups[2] = pair[rank // 2]
    errors = {}
    for tp, group in groups.items():
        tp_rank = rank % tp
        width = V_PAD // tp
        cols = slice(tp_rank * width, (tp_rank + 1) * width)
        for dtype, temperature in ((torch.float64, 0.7), (torch.float32, 1.0),
                                   (torch.bfloat16, 1.3)):
            full = logits64.to(dtype)
            x = full[:, cols].clone().requires_grad_()
            out = vocab_parallel_logprobs_entropy(
                x, targets, tp_group=group, valid_vocab_size=VALID, temperature=temperature,
                entropy_grad=True, with_sensitivity=True, chunk_size=5)
            xr = full.double().requires_grad_()
            ref = _reference(xr, targets, temperature)
            names = ("logprobs", "entropy", "sum_p2", "sum_p2_logp")
            for name, want in zip(names, ref):
                errors[(tp, str(dtype), name)] = _max_err(getattr(out, name), want.detach())
            loss = (out.logprobs * g_lp.to(out.logprobs)).sum() + (out.entropy * g_h.to(
                out.entropy)).sum()
            (gx,) = torch.autograd.grad(loss, x)
            (rx,) = torch.autograd.grad((ref[0] * g_lp).sum() + (ref[1] * g_h).sum(), xr)
            errors[(tp, str(dtype), "grad")] = _max_err(gx, rx[:, cols])
            errors[(tp, str(dtype), "pad_grad_zero")] = float(
                gx[:, max(VALID - tp_rank * width, 0):].abs().max().item() if
                VALID < (tp_rank + 1) * width else 0.0)

        # The no-logits path: local hidden grads are summed over TP by the caller (here: us).
        for dtype in (torch.float64, torch.float32):
            h = hidden64.to(dtype).requires_grad_()
            w = weight64[cols].to(dtype).requires_grad_()
            out = fused_linear_logprobs_entropy(
                h, w, targets, tp_group=group, valid_vocab_size=VALID, temperature=0.9,
                entropy_grad=True, with_sensitivity=True, chunk_size=8, vocab_chunk_size=5)
            loss = (out.logprobs * g_lp.to(dtype)).sum() + (out.entropy * g_h.to(dtype)).sum()
            gh, gw = torch.autograd.grad(loss, (h, w))
            if group is not None:
                dist.all_reduce(gh, group=group)
            hr = hidden64.clone().requires_grad_()
            wr = weight64.clone().requires_grad_()
            ref = _reference(hr @ wr.T, targets, 0.9)
            rh, rw = torch.autograd.grad((ref[0] * g_lp).sum() + (ref[1] * g_h).sum(), (hr, wr))
            for name, want in zip(("logprobs", "entropy", "sum_p2", "sum_p2_logp"), ref):
                errors[(tp, "fused_" + str(dtype), name)] = _max_err(getattr(out, name),
                                                                     want.detach())
            errors[(tp, "fused_" + str(dtype), "grad_hidden")] = _max_err(gh, rh)
            errors[(tp, "fused_" + str(dtype), "grad_weight")] = _max_err(gw, rw[cols])
    return errors


# Errors are relative to each quantity's scale (floored at 1). bf16 logits are computed in fp32,
# so only their gradient (rounded once to bf16) gets bf16 resolution.
TOL = {"torch.float64": 1e-10, "torch.float32": 1e-6, "torch.bfloat16": 1e-6}


def test_tp_1_2_4_against_float64_reference():
    results = run_on_ranks(_worker, 4, timeout=300)
    for rank, errors in enumerate(results):
        assert len(errors) == 3 * (3 * 6 + 2 * 6)
        for (tp, kind, name), err in errors.items():
            if name == "pad_grad_zero":
                assert err == 0.0, (rank, tp, kind)
                continue
            tol = TOL[kind.removeprefix("fused_")]
            if kind == "torch.bfloat16" and name == "grad":
                tol = 4e-3
            assert err <= tol, f"rank {rank} tp={tp} {kind} {name}: error {err:.3g} > {tol}"
