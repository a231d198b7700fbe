"""Log-prob, entropy and entropy-sensitivity statistics over vocab-sharded logits.

Each tensor-parallel rank holds the logits of a contiguous vocab shard, ``[T, V/tp]``. For every
token ``t`` with target id ``y_t`` (a *global* vocab id) this module returns, for the distribution
``p = softmax(logits / temperature)`` over the whole (unpadded) vocabulary:

- ``logprobs[t] = log p[y_t]`` (with gradient),
- ``entropy[t] = -sum_j p_j log p_j`` (optionally with gradient),
- ``sum_p2[t] = sum_j p_j^2`` and ``sum_p2_logp[t] = sum_j p_j^2 log p_j`` (no gradient), the two
  reductions the entropy-sensitivity diagnostic needs (docs/algorithms.md).

Passes: the logits are read in row tiles of about ``TILE_ELEMS`` elements (a few rows of the
shard) that stay in the L2 cache: forward reads each tile once from memory (row max, shift, exp
and the sums then run on the cached tile, into two preallocated tile buffers); backward reads it
once more and writes the gradient once, computing fp32/fp64 gradients straight in their slice of
the result. fp32/fp64 logits at temperature 1 are not copied at all; bf16/fp16 tiles are upcast
into the tile buffer. Extra memory is the gradient plus at most three ``[rows, V/tp]`` tile
buffers in the compute dtype (fp32, or fp64 for fp64 logits); the bf16 shard is never upcast
whole. Backward recomputes the softmax from the saved logits (a reference to the caller's tensor,
not a copy) and the per-token log-normaliser ``[T]``; when entropy is a metric only, nothing
entropy-specific is saved, and when no gradient is needed nothing at all is saved.

Communication per chunk of ``chunk_size`` rows: two all-reduces over ``tp_group``: the row max
(MAX) and one SUM of the stacked ``[chunk, 5]`` partial sums (target logit, sum exp, sum exp*z,
sum exp^2, sum exp^2*z). Each rank first shifts by its own row max and rescales its sums to the
global max afterwards (the online log-sum-exp), so the logits are read once per pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["LogProbOutput", "vocab_parallel_logprobs_entropy"]

# Elements per row tile on CPU: the tile buffers (at most three of [rows, V/tp] in the compute
# dtype) then stay in the 1 MiB L2 / the L3 cache, so every pass after the first read of a tile hits
# the cache. Chosen by measurement (docs/performance.md, benchmarks/bench_vocab_parallel.py
# --tile-sweep). On accelerators a tile is a whole chunk: there, fewer and larger kernels win.
TILE_ELEMS = 1 << 18


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

    @property
    def multi_rank(self) -> bool:
        return self.group is not None and dist.get_world_size(self.group) > 1


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


def tile_rows(n_cols: int, chunk: int, device: torch.device) -> int:
    """Rows per tile: on CPU about ``TILE_ELEMS`` elements, at least 1; at most ``chunk``."""
    if device.type != "cpu":
        return chunk
    return max(1, min(chunk, TILE_ELEMS // max(n_cols, 1)))


def shifted_stats(z: Tensor, out: Tensor, need_entropy: bool, need_sens: bool,
                  work: Optional[Tensor] = None, work2: Optional[Tensor] = None) -> None:
    """Accumulate row sums of a max-shifted block ``z [R, n]`` (z <= 0) into ``out [R, 4]``.

    Columns of ``out``: ``sum e``, ``sum e*z``, ``sum e^2``, ``sum e^2*z`` with ``e = exp(z)``.
    ``z`` may be destroyed. ``work``/``work2``: optional ``[R, n]`` scratch in z's dtype (``work2``
    is used for the sensitivity sums only); without them temporaries are allocated.
    """
    if not (need_entropy or need_sens):
        out[:, 0] += z.exp_().sum(1)
        return
    e = z.exp() if work is None else torch.exp(z, out=work)
    out[:, 0] += e.sum(1)
    if need_sens:
        e2 = e.square() if work2 is None else torch.mul(e, e, out=work2)
        out[:, 2] += e2.sum(1)
        out[:, 3] += e2.mul_(z).sum(1)
    if need_entropy:
        out[:, 1] += e.mul_(z).sum(1)


def rescale_stats(state: Tensor, m_old: Tensor, m_new: Tensor) -> Tensor:
    """Re-express a ``[R, 4]`` (S, A, B, C) state relative to max ``m_old`` against ``m_new``.

    ``e^{z-m_new}(z-m_new) = r e^{z-m_old}((z-m_old) + d)`` with ``r = e^{m_old-m_new}``,
    ``d = m_old - m_new``; rows with ``m_old = -inf`` hold zeros and must stay zeros (d := 0).
    """
    d = m_old - m_new
    r = d.exp()
    d = torch.where(torch.isneginf(m_old), 0.0, d)
    s, a, b, c = state.unbind(1)
    r2 = r.square()
    return torch.stack((r * s, r * (a + d * s), r2 * b, r2 * (c + d * b)), 1)


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


def reduce_and_finish(m_local: Tensor, sums: Tensor, hit: Tensor, shard: VocabShard,
                      need_entropy: bool, need_sens: bool):
    """All-reduce one chunk's per-rank statistics and finish them (see :func:`finish_stats`).

    ``m_local [R]``: this rank's row max (-inf for a padding-only shard); ``sums [R, 5]``: target
    logit minus ``m_local`` and the :func:`shifted_stats` columns relative to ``m_local``; ``hit
    [R]``: the target lives on this rank. Two all-reduces over the shard's group (MAX, then SUM).
    """
    m = m_local
    if shard.multi_rank:
        m = all_reduce(m_local.clone(), dist.ReduceOp.MAX, shard.group)
        sums[:, 1:] = rescale_stats(sums[:, 1:], m_local, m)
        sums[:, 0] += m_local - m
    sums[:, 0] = torch.where(hit, sums[:, 0], 0.0)
    all_reduce(sums, dist.ReduceOp.SUM, shard.group)
    return finish_stats(m, sums, need_entropy, need_sens)


@dataclass
class GradCoefs:
    """Per-token ``[T]`` coefficients of ``d(g_lp * logp_y + g_h * H) / dx`` for ``z = x / temp``.

    With ``p = softmax(z)`` and ``logp = z - lse`` the gradient is
    ``(p * (c0 + c1 * logp) + onehot_y * g_lp) / temp`` where ``c0 = -(g_lp + g_h * H)`` and
    ``c1 = -g_h``; the ``1 / temp`` is folded into ``c0``, ``c1`` and ``onehot``. ``c1`` is None
    when the entropy carries no gradient.
    """

    c0: Tensor
    c1: Optional[Tensor]
    onehot: Tensor

    @staticmethod
    def build(n: int, cd, device, temperature: float, g_lp: Optional[Tensor],
              g_h: Optional[Tensor], h: Optional[Tensor]) -> "GradCoefs":
        gl = torch.zeros(n, dtype=cd, device=device) if g_lp is None else g_lp.to(cd)
        if g_h is None:
            c0, c1 = -gl, None
        else:
            gh = g_h.to(cd)
            c0, c1 = -(gl + gh * h), -gh
        if temperature != 1.0:
            c0, gl = c0 / temperature, gl / temperature
            c1 = None if c1 is None else c1 / temperature
        return GradCoefs(c0, c1, gl)

    def apply_(self, g: Tensor, rows: slice, work: Optional[Tensor] = None) -> Tensor:
        """In place: ``g [R, n]`` holding ``logp`` becomes the gradient without the one-hot term
        (the caller adds ``onehot[rows]`` at the target, which needs its position)."""
        c0 = self.c0[rows, None]
        if self.c1 is None:
            return g.exp_().mul_(c0)
        p = g.exp() if work is None else torch.exp(g, out=work)
        torch.addcmul(c0, g, self.c1[rows, None], out=g)
        return g.mul_(p)


def _tile_forward(src: Tensor, z: Tensor, work, work2, temperature: float, direct: bool,
                  idx: Tensor, sums: Tensor, need_entropy: bool, need_sens: bool) -> Tensor:
    """Row max ``[r]`` of one tile ``src [r, n]``; fills ``sums [r, 5]`` relative to it.

    ``z``, ``work``, ``work2``: ``[r, n]`` compute-dtype scratch (``work*`` may be None when not
    needed). ``direct``: ``src`` is already in the compute dtype at temperature 1 (no copy).
    """
    if direct:
        mt = src.amax(1)
        torch.sub(src, mt[:, None], out=z)
    else:
        z.copy_(src)
        if temperature != 1.0:
            z.div_(temperature)
        mt = z.amax(1)
        z.sub_(mt[:, None])
    sums[:, 0] = z.gather(1, idx[:, None]).squeeze(1)
    shifted_stats(z, sums[:, 1:], need_entropy, need_sens, work, work2)
    return mt


def _forward(logits, targets, shard: VocabShard, temperature, need_entropy, need_sens, chunk):
    T = logits.shape[0]
    n = shard.n_valid
    cd = compute_dtype(logits.dtype)
    dev = logits.device
    new = lambda: torch.empty(T, dtype=cd, device=dev)  # noqa: E731
    logp, lse = new(), new()
    ent = new() if need_entropy else None
    p2 = new() if need_sens else None
    p2l = new() if need_sens else None
    # fp32/fp64 logits at temperature 1 are read in place: no copy of the tile is made.
    direct = logits.dtype == cd and temperature == 1.0
    rows = tile_rows(n, chunk, dev)
    buf = lambda need=True: torch.empty((rows, n), dtype=cd, device=dev) if need else None  # noqa
    zbuf, work, work2 = buf(), buf(need_entropy or need_sens), buf(need_sens)
    cut = lambda t, r: None if t is None else t[:r]  # noqa: E731
    for s in range(0, T, chunk):
        e = min(s + chunk, T)
        idx, hit = shard.local_targets(targets[s:e])
        # A padding-only shard (n == 0) contributes nothing: max -inf, sums 0.
        m = torch.full((e - s,), float("-inf"), dtype=cd, device=dev)
        sums = torch.zeros((e - s, 5), dtype=cd, device=dev)
        for a in range(s, e, rows) if n else ():
            b = min(a + rows, e)
            lo, hi = a - s, b - s
            m[lo:hi] = _tile_forward(logits[a:b, :n], zbuf[: b - a], cut(work, b - a),
                                     cut(work2, b - a), temperature, direct, idx[lo:hi],
                                     sums[lo:hi], need_entropy, need_sens)
        r = reduce_and_finish(m, sums, hit, shard, need_entropy, need_sens)
        for dst, src in zip((logp, lse, ent, p2, p2l), r):
            if dst is not None:
                dst[s:e] = src
    return logp, lse, ent, p2, p2l


def _backward(logits, targets, shard: VocabShard, temperature, lse, h, g_lp, g_h, chunk):
    T = logits.shape[0]
    n = shard.n_valid
    cd = compute_dtype(logits.dtype)
    dev = logits.device
    grad = torch.empty_like(logits)
    grad[:, n:].zero_()
    if n == 0:
        return grad
    coefs = GradCoefs.build(T, cd, dev, temperature, g_lp, g_h, h)
    idx, hit = shard.local_targets(targets)
    onehot = torch.where(hit, coefs.onehot, 0.0)
    direct_in = logits.dtype == cd and temperature == 1.0
    # fp32/fp64 gradients are computed straight in their slice of `grad`; bf16/fp16 ones in an
    # fp32 tile rounded once into `grad`.
    direct_out = grad.dtype == cd
    rows = tile_rows(n, chunk, dev)
    gbuf = None if direct_out else torch.empty((rows, n), dtype=cd, device=dev)
    work = None if coefs.c1 is None else torch.empty((rows, n), dtype=cd, device=dev)
    for a in range(0, T, rows):
        b = min(a + rows, T)
        rs = slice(a, b)
        src = logits[a:b, :n]
        g = grad[a:b, :n] if direct_out else gbuf[: b - a]
        if direct_in:
            torch.sub(src, lse[rs, None], out=g)
        else:
            g.copy_(src)
            if temperature != 1.0:
                g.div_(temperature)
            g.sub_(lse[rs, None])
        coefs.apply_(g, rs, None if work is None else work[: b - a])
        g.scatter_add_(1, idx[rs, None], onehot[rs, None])
        if not direct_out:
            grad[a:b, :n].copy_(g)
    return grad


def forward_outputs(ctx, logp: Tensor, ent: Tensor, p2: Tensor, p2l: Tensor, need_entropy: bool,
                    entropy_grad: bool, need_sens: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The four outputs of a log-prob autograd function (this one and ``fused_linear.py``'s):
    ``[T]`` log-probs, entropy, and the sensitivity statistics (empty where not asked for); only
    the log-probs and, with ``entropy_grad``, the entropy carry gradients; gradients that do not
    arrive stay None (``set_materialize_grads(False)``)."""
    empty = logp.new_empty(0)
    outs = (logp, ent if need_entropy else empty, p2 if need_sens else empty, p2l if need_sens else empty)
    ctx.mark_non_differentiable(*outs[2:])
    if not entropy_grad:
        ctx.mark_non_differentiable(outs[1])
    ctx.set_materialize_grads(False)
    return outs


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
        return forward_outputs(ctx, logp, ent, p2, p2l, need_entropy, entropy_grad, need_sens)

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
        chunk_size: rows per chunk of communication (two all-reduces per chunk); the tile
            buffers have ``min(chunk_size, TILE_ELEMS // (V/tp))`` rows (at least one).

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
