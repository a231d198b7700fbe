"""Log-prob, entropy and entropy-sensitivity statistics over vocab-sharded logits.

Each tensor-parallel rank holds the logits of a contiguous vocab shard, ``[T, V/tp]``. For every
token ``t`` with target id ``y_t`` (a *global* vocab id) this module returns, for the distribution
``p = softmax(logits / temperature)`` over the whole (unpadded) vocabulary:

- ``logprobs[t] = log p[y_t]`` (with gradient),
- ``entropy[t] = -sum_j p_j log p_j`` (optionally with gradient),
- ``sum_p2[t] = sum_j p_j^2`` and ``sum_p2_logp[t] = sum_j p_j^2 log p_j`` (no gradient), the two
  reductions the entropy-sensitivity diagnostic needs (docs/algorithms.md).

Memory: the logits are processed in chunks of ``chunk_size`` rows; only one ``[chunk, V/tp]``
buffer in the compute dtype (fp32, or fp64 for fp64 logits) lives at a time, plus elementwise
temporaries of at most ``[chunk, 4096]``. The bf16 shard is never upcast whole. Backward
recomputes the softmax from the saved logits (a reference to the caller's tensor, not a copy) and
the per-token log-normaliser ``[T]``; when entropy is a metric only, nothing entropy-specific is
saved, and when no gradient is needed nothing at all is saved.

Communication per chunk: two all-reduces over ``tp_group``: the row max (MAX) and one SUM of the
stacked ``[chunk, 5]`` partial sums (target logit, sum exp, sum exp*z, sum exp^2, sum exp^2*z).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["LogProbOutput", "vocab_parallel_logprobs_entropy"]

# Width of the column blocks used for elementwise temporaries (exp, products) so that they stay
# much smaller than the [chunk, V/tp] buffer.
COL_BLOCK = 4096


@dataclass
class LogProbOutput:
    """Per-token results, all ``[T]`` in fp32 (fp64 when the inputs are fp64).

    ``entropy``, ``sum_p2`` and ``sum_p2_logp`` are None unless requested. ``entropy`` carries a
    gradient only with ``entropy_grad=True``; the sensitivity sums never do.
    """

    logprobs: Tensor
    entropy: Optional[Tensor] = None
    sum_p2: Optional[Tensor] = None
    sum_p2_logp: Optional[Tensor] = None

    @property
    def surprisal(self) -> Tensor:
        """``-logprobs``, detached: ``[T]``."""
        return -self.logprobs.detach()


@dataclass(frozen=True)
class VocabShard:
    """Where this rank's ``width`` columns sit in the global vocabulary.

    Padding is always at the end of the global vocabulary, so the real tokens of a shard are its
    first ``n_valid`` columns (possibly none).
    """

    group: Optional[dist.ProcessGroup]
    start: int
    width: int
    n_valid: int
    vocab_size: int

    def local_targets(self, targets: Tensor) -> Tuple[Tensor, Tensor]:
        """``(index [T] into this shard, clamped; hit [T] bool: target lives here)``."""
        local = targets - self.start
        hit = (local >= 0) & (local < self.n_valid)
        return local.clamp(0, max(self.n_valid - 1, 0)), hit


def resolve_shard(
    width: int,
    tp_group: Optional[dist.ProcessGroup],
    vocab_start: Optional[int],
    valid_vocab_size: Optional[int],
) -> VocabShard:
    """Validate the sharding arguments; ``vocab_start`` defaults to ``rank * width``."""
    tp = 1 if tp_group is None else dist.get_world_size(tp_group)
    rank = 0 if tp_group is None else dist.get_rank(tp_group)
    start = rank * width if vocab_start is None else int(vocab_start)
    total = tp * width if valid_vocab_size is None else int(valid_vocab_size)
    if start < 0:
        raise ValueError(f"vocab_start must be >= 0, got {start}")
    if total <= 0:
        raise ValueError(f"valid_vocab_size must be positive, got {total}")
    if vocab_start is None and total > tp * width:
        raise ValueError(
            f"valid_vocab_size={total} exceeds the sharded vocabulary tp*V/tp={tp}*{width}"
        )
    n_valid = min(max(total - start, 0), width)
    return VocabShard(tp_group, start, width, n_valid, total)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64 (for exact references); everything else is computed in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def all_reduce(t: Tensor, op, group: Optional[dist.ProcessGroup]) -> Tensor:
    """In-place all-reduce over ``group``; a no-op for ``group=None`` (single rank)."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def shifted_stats(z: Tensor, out: Tensor, need_entropy: bool, need_sens: bool) -> None:
    """Accumulate row sums of a max-shifted block ``z [R, n]`` (z <= 0) into ``out [R, 4]``.

    Columns of ``out``: ``sum e``, ``sum e*z``, ``sum e^2``, ``sum e^2*z`` with ``e = exp(z)``.
    ``z`` may be destroyed. Temporaries are at most ``[R, COL_BLOCK]``.
    """
    if not (need_entropy or need_sens):
        out[:, 0] += z.exp_().sum(1)
        return
    for c0 in range(0, z.shape[1], COL_BLOCK):
        zb = z[:, c0 : c0 + COL_BLOCK]
        e = zb.exp()
        out[:, 0] += e.sum(1)
        if need_sens:
            e2 = e.square()
            out[:, 2] += e2.sum(1)
            out[:, 3] += e2.mul_(zb).sum(1)
        if need_entropy:
            out[:, 1] += e.mul_(zb).sum(1)


def finish_stats(m: Tensor, sums: Tensor, need_entropy: bool, need_sens: bool):
    """Turn the global row max ``m [R]`` and all-reduced ``sums [R, 5]`` into per-token results.

    ``sums`` columns: target logit minus ``m``, then the four columns of :func:`shifted_stats`.
    Returns ``(logprobs, lse, entropy, sum_p2, sum_p2_logp)``; unrequested entries are None.
    """
    zt, s, a, b, c = sums.unbind(1)
    log_s = s.log()
    logp = zt - log_s
    lse = m + log_s
    ent = log_s - a / s if need_entropy else None
    p2 = p2l = None
    if need_sens:
        p2 = b / s.square()
        p2l = c / s.square() - log_s * p2
    return logp, lse, ent, p2, p2l


def entropy_logit_grad(logp: Tensor, g_lp: Tensor, g_h: Optional[Tensor], h: Optional[Tensor]):
    """In place: ``logp [R, n]`` becomes ``-p * (g_lp + g_h * (logp + H))``.

    This is d(g_lp*logp_y + g_h*H)/dz without the one-hot term ``g_lp * e_y``, which the caller adds
    (it needs the target's position). ``g_lp, g_h, h``: ``[R]``.
    """
    if g_h is None:
        logp.exp_().mul_(-g_lp[:, None])
        return logp
    for c0 in range(0, logp.shape[1], COL_BLOCK):
        blk = logp[:, c0 : c0 + COL_BLOCK]
        p = blk.exp()
        blk.add_(h[:, None]).mul_(g_h[:, None]).add_(g_lp[:, None]).mul_(p).neg_()
    return logp


def _scaled_chunk(x: Tensor, n: int, temperature: float, cd: torch.dtype) -> Tensor:
    """A fresh ``[R, n]`` compute-dtype copy of the first ``n`` columns of ``x``, divided by T."""
    buf = torch.empty((x.shape[0], n), dtype=cd, device=x.device)
    buf.copy_(x[:, :n])
    if temperature != 1.0:
        buf.div_(temperature)
    return buf


def _forward(logits, targets, shard: VocabShard, temperature, need_entropy, need_sens, chunk):
    T = logits.shape[0]
    cd = compute_dtype(logits.dtype)
    new = lambda: torch.empty(T, dtype=cd, device=logits.device)  # noqa: E731
    logp, lse = new(), new()
    ent = new() if need_entropy else None
    p2 = new() if need_sens else None
    p2l = new() if need_sens else None
    for s in range(0, T, chunk):
        e = min(s + chunk, T)
        sums = torch.zeros((e - s, 5), dtype=cd, device=logits.device)
        if shard.n_valid > 0:
            z = _scaled_chunk(logits[s:e], shard.n_valid, temperature, cd)
            m = z.amax(1)
        else:  # a shard made only of padding contributes nothing
            z, m = None, torch.full((e - s,), float("-inf"), dtype=cd, device=logits.device)
        all_reduce(m, dist.ReduceOp.MAX, shard.group)
        if z is not None:
            z.sub_(m[:, None])
            idx, hit = shard.local_targets(targets[s:e])
            sums[:, 0] = torch.where(hit, z.gather(1, idx[:, None]).squeeze(1), 0.0)
            shifted_stats(z, sums[:, 1:], need_entropy, need_sens)
            del z
        all_reduce(sums, dist.ReduceOp.SUM, shard.group)
        r = finish_stats(m, sums, need_entropy, need_sens)
        for dst, src in zip((logp, lse, ent, p2, p2l), r):
            if dst is not None:
                dst[s:e] = src
    return logp, lse, ent, p2, p2l


def _backward(logits, targets, shard: VocabShard, temperature, lse, h, g_lp, g_h, chunk):
    T = logits.shape[0]
    cd = compute_dtype(logits.dtype)
    grad = torch.empty_like(logits)
    grad[:, shard.n_valid :].zero_()
    if shard.n_valid == 0:
        return grad
    for s in range(0, T, chunk):
        e = min(s + chunk, T)
        buf = _scaled_chunk(logits[s:e], shard.n_valid, temperature, cd).sub_(lse[s:e, None])
        if g_lp is None:
            gl = torch.zeros(e - s, dtype=cd, device=logits.device)
        else:
            gl = g_lp[s:e].to(cd)
        gh = None if g_h is None else g_h[s:e].to(cd)
        entropy_logit_grad(buf, gl, gh, None if h is None else h[s:e])
        idx, hit = shard.local_targets(targets[s:e])
        buf.scatter_add_(1, idx[:, None], torch.where(hit, gl, 0.0)[:, None])
        if temperature != 1.0:
            buf.div_(temperature)
        grad[s:e, : shard.n_valid].copy_(buf)
        del buf
    return grad


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, shard, temperature, need_entropy, entropy_grad, need_sens,
                chunk):
        logp, lse, ent, p2, p2l = _forward(
            logits, targets, shard, temperature, need_entropy, need_sens, chunk
        )
        # Only [T]-sized statistics are saved; `logits` is the caller's tensor, not a copy.
        ctx.save_for_backward(logits, targets, lse, ent if entropy_grad else None)
        ctx.cfg = (shard, temperature, chunk)
        empty = logp.new_empty(0)
        outs = [logp, ent if need_entropy else empty, p2 if need_sens else empty,
                p2l if need_sens else empty]
        ctx.mark_non_differentiable(*outs[2:])
        if not entropy_grad:
            ctx.mark_non_differentiable(outs[1])
        ctx.set_materialize_grads(False)
        return tuple(outs)

    @staticmethod
    def backward(ctx, g_lp, g_h, _g_p2, _g_p2l):
        logits, targets, lse, h = ctx.saved_tensors
        shard, temperature, chunk = ctx.cfg
        if g_lp is None and g_h is None:
            return (None,) * 8
        if h is None:
            g_h = None
        grad = _backward(logits, targets, shard, temperature, lse, h, g_lp, g_h, chunk)
        return (grad,) + (None,) * 7


def validate_common(n_tokens: int, targets: Tensor, temperature: float, chunk_size: int) -> None:
    """Checks shared by the logits path and the fused (no-logits) path."""
    if targets.dim() != 1 or targets.shape[0] != n_tokens:
        raise ValueError(f"targets must be [T={n_tokens}], got {tuple(targets.shape)}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer token ids, got {targets.dtype}")
    if not (temperature > 0.0 and temperature != float("inf")):
        raise ValueError(f"temperature must be positive and finite, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def check_target_range(targets: Tensor, shard: VocabShard) -> None:
    """Raise if a target id is outside ``[0, valid_vocab_size)`` (one host sync)."""
    if targets.numel() and bool(((targets < 0) | (targets >= shard.vocab_size)).any()):
        raise ValueError(
            f"target ids must lie in [0, valid_vocab_size={shard.vocab_size}); mask padded "
            "positions with a valid id (e.g. 0) and drop them in the loss"
        )


def vocab_parallel_logprobs_entropy(
    logits: Tensor,
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
) -> LogProbOutput:
    """Target log-prob (and entropy, sensitivity sums) of ``softmax(logits / temperature)``.

    Args:
        logits: ``[T, V/tp]`` this rank's vocab shard (fp32, bf16, fp16 or fp64), finite.
        targets: ``[T]`` global token ids in ``[0, valid_vocab_size)``; identical on all TP ranks.
        tp_group: the tensor-parallel group the vocabulary is sharded over; None = one rank.
        vocab_start: global id of this shard's first column; default ``rank * V/tp``.
        valid_vocab_size: true vocabulary size; columns at global id >= it are padding and are
            excluded (as if -inf). Default: ``tp * V/tp`` (no padding).
        temperature: logits are divided by it before the softmax.
        with_entropy: also return the full-vocabulary entropy.
        entropy_grad: the entropy carries a gradient (for an entropy bonus); otherwise it is a
            detached metric and backward costs nothing extra.
        with_sensitivity: also return ``sum_j p_j^2`` and ``sum_j p_j^2 log p_j`` (no gradient).
        chunk_size: rows per chunk; bounds the live fp32 buffer at ``[chunk_size, V/tp]``.

    Returns:
        :class:`LogProbOutput` with ``[T]`` tensors, identical on every rank of ``tp_group``.
        The gradient w.r.t. ``logits`` has the logits' dtype; padding columns get zero gradient.
        Sums over the vocabulary are all-reduced over ``tp_group`` (two all-reduces per chunk).
    """
    if logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be a floating [T, V/tp] tensor, got {tuple(logits.shape)} "
                         f"{logits.dtype}")
    validate_common(logits.shape[0], targets, temperature, chunk_size)
    if entropy_grad and not with_entropy:
        raise ValueError("entropy_grad=True needs with_entropy=True")
    shard = resolve_shard(logits.shape[1], tp_group, vocab_start, valid_vocab_size)
    check_target_range(targets, shard)
    temperature = float(temperature)
    if torch.is_grad_enabled() and logits.requires_grad:
        logp, ent, p2, p2l = _VocabParallelLogProbs.apply(
            logits, targets, shard, temperature, with_entropy, entropy_grad, with_sensitivity,
            chunk_size,
        )
    else:  # nothing is saved when no gradient is needed
        logp, _, ent, p2, p2l = _forward(
            logits.detach(), targets, shard, temperature, with_entropy, with_sensitivity, chunk_size
        )
    return LogProbOutput(
        logprobs=logp,
        entropy=ent if with_entropy else None,
        sum_p2=p2 if with_sensitivity else None,
        sum_p2_logp=p2l if with_sensitivity else None,
    )
