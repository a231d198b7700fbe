"""Exact k-th largest value and top-k membership over values spread across the ranks of a group.

Used for the STARE / Clip-Cov / KL-Cov token selection with ``global`` scope: the threshold is the
exact k-th largest surprisal over the whole optimizer mini-batch, whatever the data-/context-
parallel layout and micro-batch split.

Algorithm: each float is mapped to an order-preserving integer key (its IEEE bits when
non-negative, minus its magnitude bits when negative, so -0.0 and +0.0 both map to 0). Then, per
problem:

1. One all-gather carries every rank's stats (count, key range, k, errors), its best ``eager``
   items (all of them when it has no more) and a histogram of the top ``COARSE_BITS`` bits of its
   order keys. If the ``k``-th best of the gathered items is strictly above the value at which
   every truncated rank cut its list, no unsent item can reach it and it is the exact threshold:
   one collective (always the case when every rank has at most ``eager`` items, and for small
   ``k`` at any size).
2. Otherwise the summed histograms give the coarse bin that holds the threshold (a first radix
   pass, with exact per-rank counts). While a gather of the remaining candidates would receive
   more than ``gather_max`` items per rank, a most-significant-digit radix pass fixes
   ``radix_bits`` more bits: every rank histograms the digit of its candidates, the
   ``2**radix_bits`` histogram is all-reduced (SUM), every rank walks the same global histogram
   from the top and keeps only the candidates in the chosen bin.
3. The remaining candidates are all-gathered and resolved locally.

Messages are therefore ``O(eager + 2**COARSE_BITS + 2**radix_bits + gather_max)`` per rank,
independent of the number of tokens. Several problems (STARE C2's two thresholds:
:func:`topk_thresholds`) share every collective. The machinery is in ``ops.radix_select``.

Ties. Exactly ``k`` items are selected. Among items with equal value, the one with the SMALLER
int64 token key wins (the key should be a layout-independent global id, e.g.
``sample_id * max_len + position``). The selected set is therefore a function of the multiset of
``(value, key)`` pairs only, identical for every distribution of tokens over ranks and
micro-batches. When the tie must be broken, the radix continues over the bits of the tied items'
keys (or they are gathered); if keys tied at the threshold are duplicated the rule cannot give
exactly ``k`` and a ValueError is raised. Every path gives the same threshold, bit for bit.

Errors (NaN values, a local shape/dtype problem, ``k`` outside ``[0, n]``, ranks disagreeing on
``k`` or dtype) are detected after the first all-gather, so every rank raises the same ValueError
rather than some ranks deadlocking in a collective.

``group=None`` means a single process (no communication); pass ``dist.group.WORLD`` explicitly for
the default group.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_stare.ops.radix_select import (
    INT64_MAX,
    INT64_MIN,
    Problem,
    gather_rows,
    host,
    key_to_float,
    kth_key,
    order_keys,
    run,
    span,
    top_digits,
)

__all__ = ["KSpec", "TopKThreshold", "kth_largest", "local_topk_among", "selected_among", "topk_mask", "topk_threshold",
           "topk_thresholds"]

# Defaults chosen by measurement (benchmarks/bench_selection.py, docs/performance.md).
RADIX_BITS = 16
GATHER_MAX = 1 << 16  # item slots a gather may receive per rank (12 bytes each for fp32)
EAGER = 1 << 11  # best items per rank and problem sent with the first all-gather
COARSE_BITS = 10  # top bits of the order keys histogrammed in the first all-gather
N_STATS = 9  # per-rank stats of one problem (see _local)

KSpec = Union[int, Callable[[int], int]]


@dataclass(frozen=True)
class TopKThreshold:
    """The global top-k boundary: item ``(v, key)`` is selected iff
    ``v > value or (v == value and key <= key_threshold)``.

    ``k`` is the number of items selected globally out of ``n``. ``k == 0`` selects nothing (then
    ``value``/``key`` are meaningless). ``key == INT64_MAX`` means every item tied at ``value`` is
    in.
    Apply :meth:`select` to any subset (a micro-batch, one rank's shard): the union over a
    partition of the original items is exactly the top-k set.
    """

    value: float
    key: int
    k: int
    n: int

    def select(self, values: Tensor, keys: Tensor) -> Tensor:
        """``values [N]`` float, ``keys [N]`` int64 -> bool mask ``[N]`` of the selected items."""
        if values.shape != keys.shape:
            raise ValueError(f"values {tuple(values.shape)} and keys {tuple(keys.shape)} differ")
        if self.k == 0:
            return torch.zeros(values.shape, dtype=torch.bool, device=values.device)
        if self.key == INT64_MAX:  # no tie to break: the same set, in one pass
            return values >= self.value
        return torch.where(values == self.value, keys <= self.key, values > self.value)


@dataclass
class _Local:
    """This rank's part of one problem before the first all-gather."""

    okeys: Optional[Tensor]
    digit: Optional[Tensor]
    msg: Tensor


def _local(values: Tensor, keys: Optional[Tensor], k: KSpec, eager: int, world: int) -> _Local:
    """Local checks and the first message of one problem, int64 words: stats ``[n, problem, nan,
    width, k, key_min, key_max, cut, n_sent]``, ``eager`` order-key slots and (with keys) as many
    token-key slots, padded with INT64_MIN (below every order key), then the coarse histogram as
    int32 pairs. A rank with at most ``eager`` items sends them all and nothing else (the others
    derive its histogram and key range when they need them); a rank with more sends its best
    ``eager``, the order key ``cut`` of the worst of them, its key range and its histogram; none
    of its items when ``k`` exceeds what ``world`` ranks send (they cannot decide it then).
    The op count matters as much as the bytes for small inputs: every torch call costs
    microseconds, as much as the data itself at 1K values per rank."""
    n_bins = 1 << COARSE_BITS
    problem = 0
    if values.dim() != 1 or not values.dtype.is_floating_point:
        problem = 1
    elif keys is not None and (keys.shape != values.shape or keys.dtype != torch.int64):
        problem = 2
    elif values.numel() >= 2 ** 31:  # the histogram counts are int32
        problem = 3
    row = [0, problem, 0, 0, k if isinstance(k, int) else -1,  # a callable k: -1 on every rank
           INT64_MAX, INT64_MIN, INT64_MIN, 0]
    size = N_STATS + (1 if keys is None else 2) * eager + n_bins // 2
    msg = torch.full((size,), INT64_MIN, dtype=torch.int64, device=values.device)
    okeys = digit = None
    if problem == 0:
        row[0], row[2] = values.numel(), int(bool(values.isnan().any()))
    if problem == 0 and not row[2]:
        okeys, row[3] = order_keys(values)
        sent_ok, sent_keys = okeys, keys
        if okeys.numel() > eager:  # send the best `eager`; every unsent one is <= the cut
            row[7] = INT64_MAX
            sent_ok = sent_keys = okeys[:0]
            if eager and not (isinstance(k, int) and k > world * eager):
                top = torch.topk(okeys, eager, sorted=False)
                sent_ok, row[7] = top.values, int(top.values.min())
                sent_keys = None if keys is None else keys[top.indices]
            if keys is not None:
                row[5:7] = (int(x) for x in torch.aminmax(keys))
            digit = top_digits(okeys, row[3], COARSE_BITS)
            msg[size - n_bins // 2 :].view(torch.int32)[:] = torch.bincount(digit,
                                                                            minlength=n_bins)
        row[8] = m = sent_ok.numel()
        if m:
            # narrow + copy_: a tenth of the dispatch cost of slice assignment
            msg.narrow(0, N_STATS, m).copy_(sent_ok)
            if keys is not None:
                msg.narrow(0, N_STATS + eager, m).copy_(sent_keys)
    msg.narrow(0, 0, N_STATS).copy_(torch.tensor(row))  # Python ints: int64, no conversion
    return _Local(okeys, digit, msg)


def _check(rows: List[List[int]], keys: Optional[Tensor], k: KSpec, who: str) -> Tuple[int, int]:
    """Raise the same ValueError on every rank for a problem any rank has; ``(n, k)``."""
    ranks = lambda col: [r for r, row in enumerate(rows) if row[col]]  # noqa: E731
    if any(row[1] == 3 for row in rows):
        raise ValueError(f"{who}: more than 2**31 - 1 values on one rank; split the call")
    if ranks(1):
        raise ValueError(
            f"{who}: rank(s) {ranks(1)} passed bad inputs: values must be a 1-D float tensor"
            + ("" if keys is None else " and keys an int64 tensor of the same shape"))
    if ranks(2):
        raise ValueError(f"{who}: NaN values on rank(s) {ranks(2)}; selection needs non-NaN values")
    n = sum(row[0] for row in rows)
    if len({row[4] for row in rows}) > 1:
        raise ValueError(f"{who}: ranks passed different k: {[row[4] for row in rows]}")
    if len({row[3] for row in rows if row[0]}) > 1:
        raise ValueError(f"{who}: ranks passed values of different float widths (fp64 vs fp32)")
    k = operator.index(k if isinstance(k, int) else k(n))
    if not 0 <= k <= n:
        raise ValueError(f"{who}: k={k} must lie in [0, n={n}] (n = value count over the group)")
    return n, k


def _prologue(items: Sequence[Tuple[Tensor, Optional[Tensor], KSpec]], group, who: str,
              eager: int) -> List[Problem]:
    """The first all-gather, for all problems at once. Returns the problems: resolved when the
    gathered best items decide them, else narrowed to the coarse bin that holds the threshold."""
    world = 1 if group is None else dist.get_world_size(group)
    local = [_local(values, keys, k, eager, world) for values, keys, k in items]
    msg = local[0].msg if len(local) == 1 else torch.cat([loc.msg for loc in local])
    gathered = gather_rows(msg, group)
    if gathered.device.type != "cpu":
        gathered = gathered.cpu()
    blocks = [gathered] if len(local) == 1 else gathered.split(
        [loc.msg.numel() for loc in local], dim=1)  # per problem: [world, message]
    out = []
    for (_, keys, k), loc, block in zip(items, local, blocks):
        rows = block.narrow(1, 0, N_STATS).tolist()
        n, k = _check(rows, keys, k, who)
        width = max(max(row[3] for row in rows), 32)  # 0: no values anywhere (then k == 0)
        okeys, digit = loc.okeys, loc.digit
        if okeys is not None and width == 64 and okeys.dtype != torch.int64:
            okeys, digit = okeys.long(), None  # an empty fp32 shard among fp64 ones
        # Value bits are read from the order keys offset by the type's minimum (sign first).
        p = Problem(okeys, keys, width, k, n, need=k, n=n, cap=max(r[0] for r in rows),
                    off_v=-(1 << (width - 1)), bits_v=width)
        out.append(p)
        if k == 0:
            continue
        m = max(r[8] for r in rows)  # slots in use; the rest is INT64_MIN, never among the best
        ok = block.narrow(1, N_STATS, m)
        tk = None if keys is None else block.narrow(1, N_STATS + eager, m)
        if sum(r[8] for r in rows) >= k:
            flat = host(ok)
            vkey = kth_key(flat, k)
            if all(vkey > r[7] for r in rows if r[0] > r[8]):  # no unsent item reaches it
                p.finish(flat, tk, vkey)
                continue
        _coarse_pass(p, block, rows, ok, tk, digit)
    return out


def _coarse_pass(p: Problem, block: Tensor, rows: List[List[int]], ok: Tensor,
                 tk: Optional[Tensor], digit: Optional[Tensor]) -> None:
    """Narrow ``p`` to the coarse bin that holds its threshold (the first radix pass, with exact
    per-rank counts) and set its key range; what a complete rank did not send is derived from
    the items it sent."""
    n_bins = 1 << COARSE_BITS
    hists = []
    for r, row in enumerate(rows):
        if row[0] > row[8]:
            hists.append(block[r, -(n_bins // 2) :].view(torch.int32).long())
        else:
            sent = top_digits(ok[r, : row[8]], p.width, COARSE_BITS)
            hists.append(torch.bincount(sent, minlength=n_bins))
            if tk is not None and row[8]:
                row[5:7] = (int(x) for x in torch.aminmax(tk[r, : row[8]]))
    hists = torch.stack(hists)
    if p.keys is not None:
        # Key phase: the larger ~key is the better (the smaller key wins a tie).
        p.off_k, p.bits_k, p.prefix_k = span(~max(r[6] for r in rows),
                                             ~min(r[5] for r in rows), 64)
    if digit is None:
        digit = top_digits(p.ok, p.width, COARSE_BITS)
    b = p.advance(digit, COARSE_BITS, p.width - COARSE_BITS, hists.sum(0))
    p.cap = int(hists[:, b].max())


def _check_knobs(radix_bits: int, gather_max: int) -> None:
    if not 1 <= radix_bits <= 16:
        raise ValueError(f"radix_bits must be in [1, 16], got {radix_bits}")
    if gather_max < 0:
        raise ValueError(f"gather_max must be >= 0, got {gather_max}")


def topk_thresholds(items: Sequence[Tuple[Tensor, Tensor, KSpec]],
                    group: Optional[dist.ProcessGroup] = None, *, radix_bits: int = RADIX_BITS,
                    gather_max: int = GATHER_MAX, eager: int = EAGER) -> List[TopKThreshold]:
    """Several exact global top-k boundaries at once (e.g. STARE C2's L+ and L-).

    Same result as one :func:`topk_threshold` per item, but the problems share every collective
    (the first all-gather, then per round one all-reduce and one all-gather). ``items``:
    ``(values [N_local], keys [N_local], k)``; ``k`` may be a callable of the global value count
    ``n`` (then the caller needs no count all-reduce of its own). Collective over ``group``; every
    rank passes the same number of items.
    """
    _check_knobs(radix_bits, gather_max)
    items = [(v, kk, k if callable(k) else operator.index(k)) for v, kk, k in items]
    problems = _prologue(items, group, "topk_threshold", max(int(eager), 0))
    run([p for p in problems if p.k], group, radix_bits, gather_max)
    return [TopKThreshold(key_to_float(p.result[0], p.width), p.result[1], p.k, p.n_total)
            if p.k else TopKThreshold(float("inf"), INT64_MIN, 0, p.n_total) for p in problems]


def topk_threshold(values: Tensor, keys: Tensor, k: KSpec,
                   group: Optional[dist.ProcessGroup] = None, *, radix_bits: int = RADIX_BITS,
                   gather_max: int = GATHER_MAX, eager: int = EAGER) -> TopKThreshold:
    """The exact global top-``k`` boundary of ``values`` over ``group``.

    Args:
        values: ``[N_local]`` float (any float dtype, same on all ranks), no NaN; +-inf allowed;
            ``N_local`` may be 0.
        keys: ``[N_local]`` int64 layout-independent token ids; among equal values the smaller key
            wins.
        k: how many of the ``n = sum N_local`` values to select, ``0 <= k <= n``; same on all ranks;
            or a callable ``k(n)``.
        group: process group the values are spread over; None = this process only.
        radix_bits: bits resolved per radix pass (histograms of ``2**radix_bits`` counts).
        gather_max: the remaining candidates are all-gathered and resolved locally once that
            gather receives at most this many item slots per rank (12 bytes each for fp32).
        eager: the best items per rank sent with the first all-gather; they decide the threshold
            (one collective in all) when every rank has at most this many, or when the k-th best
            of them lies above every cut.

    Returns:
        :class:`TopKThreshold`, identical on all ranks. Collectives: one all-gather of
        ``9 + 2 * eager + 2**(COARSE_BITS - 1)`` int64 per rank; then, if needed, SUM all-reduces
        of ``2**radix_bits`` counts (radix passes over the value bits, then over the token-key
        bits when a tie at the threshold must be broken) and one all-gather of at most
        ``gather_max`` item slots per rank.
    """
    return topk_thresholds([(values, keys, k)], group, radix_bits=radix_bits,
                           gather_max=gather_max, eager=eager)[0]


def topk_mask(values: Tensor, keys: Tensor, k: KSpec, group: Optional[dist.ProcessGroup] = None,
              **knobs) -> Tensor:
    """Bool mask ``[N_local]``: this rank's share of the exact global top-``k`` (see
    :func:`topk_threshold`, which takes the same keyword knobs); exactly ``k`` True entries
    summed over ``group``."""
    return topk_threshold(values, keys, k, group, **knobs).select(values, keys)


def selected_among(thr: Optional[TopKThreshold], values: Tensor, keys: Tensor, cand: Tensor) -> Tensor:
    """Bool ``[B, T]``: the candidates (``cand``, ``[B, T]`` bool) that a global threshold
    (``thr``, found over the candidates' ``values`` and ``keys``, both ``[B, T]``) selects; none
    when ``thr`` is None (nothing to select anywhere)."""
    if thr is None:
        return torch.zeros_like(cand)
    return thr.select(values.reshape(-1), keys.reshape(-1)).reshape(cand.shape) & cand


def local_topk_among(values: Tensor, keys: Tensor, cand: Tensor, k: int) -> Tensor:
    """Bool ``[B, T]``: the top ``k`` of the candidates (``cand``) on this rank alone, ties
    broken by ``keys`` (the local selection scope)."""
    out = torch.zeros_like(cand)
    if k > 0:
        out[cand] = topk_mask(values[cand], keys[cand], k, group=None)
    return out


def kth_largest(values: Tensor, k: int, group: Optional[dist.ProcessGroup] = None, *,
                radix_bits: int = RADIX_BITS, gather_max: int = GATHER_MAX,
                eager: int = EAGER) -> float:
    """The exact ``k``-th largest (``1 <= k <= n``) of ``values [N_local]`` over ``group``."""
    _check_knobs(radix_bits, gather_max)
    k = operator.index(k)
    (p,) = _prologue([(values, None, k)], group, "kth_largest", max(int(eager), 0))
    if k == 0:
        raise ValueError("kth_largest: k must be >= 1")
    run([p], group, radix_bits, gather_max)
    return key_to_float(p.result[0], p.width)
