"""Log-prob and entropy straight from hidden states and the output-layer weight, no logits.

The logits ``hidden @ weight.T`` (``[T, V/tp]``) are never materialised: they are produced one
``[chunk_size, vocab_chunk_size]`` tile at a time, folded into an online log-sum-exp / online
entropy state (per row: running max ``M`` and, relative to it, ``S = sum e``, ``A = sum e*(z-M)``,
``B = sum e^2``, ``C = sum e^2*(z-M)`` with ``e = exp(z-M)``), and recomputed tile by tile in
backward. Peak extra memory is a few tiles plus a ``[chunk_size, h]`` accumulator (and an fp32
``[V/tp, h]`` accumulator for the weight gradient when the weight is bf16/fp16).

Tensor parallelism: Megatron's output layer is column-parallel, so ``hidden`` is replicated on the
TP ranks and each rank holds a ``[V/tp, h]`` weight shard. The gradient this function returns for
``hidden`` is **this rank's partial contribution** (the sum over its vocab shard only). The caller
must wrap ``hidden`` in Megatron's ``copy_to_tensor_model_parallel_region`` (identity forward,
all-reduce backward) -- exactly what ``ColumnParallelLinear`` does -- so the partial gradients are
summed over TP. The weight gradient is local to the shard and needs no reduction.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_stare.ops.vocab_parallel import (
    GradCoefs,
    LogProbOutput,
    VocabShard,
    check_target_range,
    compute_dtype,
    forward_outputs,
    reduce_and_finish,
    rescale_stats,
    resolve_shard,
    shifted_stats,
    validate_common,
)

__all__ = ["fused_linear_logprobs_entropy"]


def _tile_logits(hc: Tensor, w_tile: Tensor, temperature: float, out: Tensor) -> Tensor:
    """``out [R, n]``: logits of one tile in the compute dtype (matmul in the input dtype)."""
    if hc.dtype == out.dtype:
        torch.matmul(hc, w_tile.T, out=out)
    else:
        out.copy_(hc @ w_tile.T)
    if temperature != 1.0:
        out.div_(temperature)
    return out


def _forward(hidden, weight, targets, shard: VocabShard, temperature, need_ent, need_sens, chunk,
             vchunk):
    T = hidden.shape[0]
    cd = compute_dtype(hidden.dtype)
    dev = hidden.device
    new = lambda: torch.empty(T, dtype=cd, device=dev)  # noqa: E731
    logp, lse = new(), new()
    ent = new() if need_ent else None
    p2 = new() if need_sens else None
    p2l = new() if need_sens else None
    # One set of tile buffers for the whole call (no fresh pages per tile).
    shape = (min(chunk, T), min(vchunk, max(shard.n_valid, 1)))
    zbuf = torch.empty(shape, dtype=cd, device=dev)
    work = torch.empty(shape, dtype=cd, device=dev) if need_ent or need_sens else None
    work2 = torch.empty(shape, dtype=cd, device=dev) if need_sens else None
    for s in range(0, T, chunk):
        e = min(s + chunk, T)
        hc = hidden[s:e]
        idx, hit = shard.local_targets(targets[s:e])
        m = torch.full((e - s,), float("-inf"), dtype=cd, device=dev)
        state = torch.zeros((e - s, 4), dtype=cd, device=dev)
        zt = torch.zeros(e - s, dtype=cd, device=dev)
        for v0 in range(0, shard.n_valid, vchunk):
            v1 = min(v0 + vchunk, shard.n_valid)
            z = _tile_logits(hc, weight[v0:v1], temperature, zbuf[: e - s, : v1 - v0])
            in_tile = hit & (idx >= v0) & (idx < v1)
            zt += torch.where(in_tile, z.gather(1, (idx - v0).clamp(0, v1 - v0 - 1)[:, None])
                              .squeeze(1), 0.0)
            m_tile = z.amax(1)
            m_new = torch.maximum(m, m_tile)
            tile = torch.zeros_like(state)
            shifted_stats(z.sub_(m_tile[:, None]), tile, need_ent, need_sens,
                          None if work is None else work[: e - s, : v1 - v0],
                          None if work2 is None else work2[: e - s, : v1 - v0])
            state = rescale_stats(state, m, m_new) + rescale_stats(tile, m_tile, m_new)
            m = m_new
        sums = torch.cat(((zt - m)[:, None], state), 1)
        r = reduce_and_finish(m, sums, hit, shard, need_ent, need_sens)
        for dst, src in zip((logp, lse, ent, p2, p2l), r):
            if dst is not None:
                dst[s:e] = src
    return logp, lse, ent, p2, p2l


def _backward(hidden, weight, targets, shard, temperature, lse, h, g_lp, g_h, chunk, vchunk,
              need_dh, need_dw):
    T = hidden.shape[0]
    cd = compute_dtype(hidden.dtype)
    dev = hidden.device
    same = hidden.dtype == cd  # fp32/fp64: matmuls accumulate straight into the gradients
    dh = torch.zeros_like(hidden) if need_dh else None
    # Accumulate the weight gradient over T-chunks in the compute dtype (fp32 for bf16 weights).
    dw = torch.zeros(weight.shape, dtype=cd, device=dev) if need_dw else None
    coefs = GradCoefs.build(T, cd, dev, temperature, g_lp, g_h, h)
    idx_all, hit_all = shard.local_targets(targets)
    onehot = torch.where(hit_all, coefs.onehot, 0.0)
    shape = (min(chunk, T), min(vchunk, max(shard.n_valid, 1)))
    gbuf = torch.empty(shape, dtype=cd, device=dev)
    work = None if coefs.c1 is None else torch.empty(shape, dtype=cd, device=dev)
    for s in range(0, T, chunk):
        e = min(s + chunk, T)
        rs = slice(s, e)
        hc = hidden[s:e]
        idx, hit = idx_all[rs], hit_all[rs]
        dhc = None
        if need_dh:
            dhc = dh[s:e] if same else torch.zeros(hc.shape, dtype=cd, device=dev)
        for v0 in range(0, shard.n_valid, vchunk):
            v1 = min(v0 + vchunk, shard.n_valid)
            w = weight[v0:v1]
            gz = _tile_logits(hc, w, temperature, gbuf[: e - s, : v1 - v0]).sub_(lse[rs, None])
            coefs.apply_(gz, rs, None if work is None else work[: e - s, : v1 - v0])
            in_tile = hit & (idx >= v0) & (idx < v1)
            gz.scatter_add_(1, (idx - v0).clamp(0, v1 - v0 - 1)[:, None],
                            torch.where(in_tile, onehot[rs], 0.0)[:, None])
            if same:
                if need_dh:
                    dhc.addmm_(gz, w)
                if need_dw:
                    dw[v0:v1].addmm_(gz.T, hc)
                continue
            gz = gz.to(hidden.dtype)  # matmuls run in the input dtype, accumulate in cd
            if need_dh:
                dhc += gz @ w
            if need_dw:
                dw[v0:v1] += gz.T @ hc
        if need_dh and not same:
            dh[s:e] = dhc
    return dh, None if dw is None else dw.to(weight.dtype)


class _FusedLinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, shard, temperature, need_ent, entropy_grad, need_sens,
                chunk, vchunk):
        logp, lse, ent, p2, p2l = _forward(hidden, weight, targets, shard, temperature, need_ent,
                                           need_sens, chunk, vchunk)
        ctx.save_for_backward(hidden, weight, targets, lse, ent if entropy_grad else None)
        ctx.cfg = (shard, temperature, chunk, vchunk)
        return forward_outputs(ctx, logp, ent, p2, p2l, need_ent, entropy_grad, need_sens)

    @staticmethod
    def backward(ctx, g_lp, g_h, _g_p2, _g_p2l):
        hidden, weight, targets, lse, h = ctx.saved_tensors
        shard, temperature, chunk, vchunk = ctx.cfg
        need_dh, need_dw = ctx.needs_input_grad[:2]
        if h is None:
            g_h = None
        if g_lp is None and g_h is None:
            return (None,) * 10
        dh, dw = _backward(hidden, weight, targets, shard, temperature, lse, h, g_lp, g_h, chunk,
                           vchunk, need_dh, need_dw)
        return (dh, dw) + (None,) * 8


def fused_linear_logprobs_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    vocab_start: Optional[int] = None,
    valid_vocab_size: Optional[int] = None,
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_grad: bool = False,
    with_sensitivity: bool = False,
    chunk_size: int = 1024,
    vocab_chunk_size: int = 1024,
) -> LogProbOutput:
    """Same results as :func:`vocab_parallel_logprobs_entropy` on ``hidden @ weight.T``.

    Args:
        hidden: ``[T, h]`` final hidden states, replicated on the TP ranks (see module docstring
            for how its gradient must be reduced).
        weight: ``[V/tp, h]`` this rank's output-layer (or tied embedding) shard; rows at global id
            >= ``valid_vocab_size`` are padding and are skipped.
        targets, tp_group, vocab_start, valid_vocab_size, temperature, with_entropy, entropy_grad,
        with_sensitivity: as for :func:`vocab_parallel_logprobs_entropy`.
        chunk_size: rows of ``hidden`` per tile; vocab_chunk_size: weight rows per tile (the
            defaults: 4 MiB fp32 tiles, measured as fast as larger ones, docs/performance.md).

    Returns:
        :class:`LogProbOutput` (``[T]`` tensors, fp32; fp64 for fp64 inputs). Gradients: ``hidden``
        gets this rank's partial sum (caller all-reduces over TP), ``weight`` its exact local grad;
        both in their own dtypes. Two all-reduces over ``tp_group`` per row chunk.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [T, h] and weight [V/tp, h], got {tuple(hidden.shape)} "
                         f"and {tuple(weight.shape)}")
    if not hidden.dtype.is_floating_point or hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight must share a floating dtype, got {hidden.dtype} and "
                         f"{weight.dtype}")
    validate_common(hidden.shape[0], targets, temperature, chunk_size)
    if vocab_chunk_size < 1:
        raise ValueError(f"vocab_chunk_size must be >= 1, got {vocab_chunk_size}")
    if entropy_grad and not with_entropy:
        raise ValueError("entropy_grad=True needs with_entropy=True")
    shard = resolve_shard(weight.shape[0], tp_group, vocab_start, valid_vocab_size)
    check_target_range(targets, shard)
    args = (shard, float(temperature), with_entropy, entropy_grad, with_sensitivity, chunk_size,
            vocab_chunk_size)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        logp, ent, p2, p2l = _FusedLinearLogProbs.apply(hidden, weight, targets, *args)
    else:
        logp, _, ent, p2, p2l = _forward(hidden.detach(), weight.detach(), targets, shard,
                                         float(temperature), with_entropy, with_sensitivity,
                                         chunk_size, vocab_chunk_size)
    return LogProbOutput(
        logprobs=logp,
        entropy=ent if with_entropy else None,
        sum_p2=p2 if with_sensitivity else None,
        sum_p2_logp=p2l if with_sensitivity else None,
    )
