"""Exact k-th largest value and top-k membership over values spread across the ranks of a group.

Used for the STARE / Clip-Cov / KL-Cov token selection with ``global`` scope: the threshold is the
exact k-th largest surprisal over the whole optimizer mini-batch, whatever the data-/context-
parallel layout and micro-batch split.

Algorithm: each float is mapped to an order-preserving integer key (its IEEE bits with the
magnitude bits flipped for negatives; -0.0 is first folded into +0.0). A most-significant-digit
radix select then fixes ``radix_bits`` bits per pass: every rank histograms the digit of its
still-candidate keys, the ``2**radix_bits`` histogram is all-reduced (SUM), every rank walks the
same global histogram from the top and keeps (compacts) only the keys in the chosen bin. Only the
bits in which the global min and max keys differ are resolved, so fp32 values take at most
``ceil(32 / radix_bits)`` passes (fp64: 64 bits). Message sizes are ``O(2**radix_bits)`` and
``O(world_size)``, independent of the number of tokens.

Ties. Exactly ``k`` items are selected. Among items with equal value, the one with the SMALLER
int64 token key wins (the key should be a layout-independent global id, e.g.
``sample_id * max_len + position``). The selected set is therefore a function of the multiset of
``(value, key)`` pairs only, identical for every distribution of tokens over ranks and
micro-batches.
When the tie must be broken, a second radix select runs over the keys of the tied items; if keys
tied at the threshold are duplicated the rule cannot give exactly ``k`` and a ValueError is raised.

Errors (NaN values, a local shape/dtype problem, ``k`` outside ``[0, n]``, ranks disagreeing on
``k`` or dtype) are detected after one small all-gather, so every rank raises the same ValueError
rather than some ranks deadlocking in a collective.

``group=None`` means a single process (no communication); pass ``dist.group.WORLD`` explicitly for
the default group.
"""

from __future__ import annotations

import operator
import struct
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["TopKThreshold", "kth_largest", "topk_mask", "topk_threshold"]

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1


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
        return (values > self.value) | ((values == self.value) & (keys <= self.key))


def _order_keys(values: Tensor) -> Tuple[Tensor, int]:
    """Order-preserving int64 keys ``[N]`` of float values and the key width (32 or 64 bits).

    fp64 uses its 64-bit pattern; every narrower float is exactly representable in fp32 and uses
    the 32-bit pattern (fewer radix passes). Requires no NaN.
    """
    if values.dtype == torch.float64:
        v = torch.where(values == 0, 0.0, values)  # fold -0.0 into +0.0: they compare equal
        b = v.view(torch.int64)
        return b ^ ((b >> 63) & INT64_MAX), 64
    v = values.to(torch.float32)
    v = torch.where(v == 0, 0.0, v)
    b = v.view(torch.int32).to(torch.int64)
    return b ^ ((b >> 31) & 0x7FFFFFFF), 32


def _key_to_float(key: int, width: int) -> float:
    """Inverse of :func:`_order_keys` for one key (Python ints, exact)."""
    if width == 64:
        bits = key ^ INT64_MAX if key < 0 else key
        return struct.unpack("<d", struct.pack("<q", bits))[0]
    bits = key ^ 0x7FFFFFFF if key < 0 else key
    return struct.unpack("<f", struct.pack("<i", bits))[0]


def _all_gather_rows(row: List[int], device, group) -> List[List[int]]:
    """All-gather one small int64 row per rank (``O(world)`` message); returns rows by rank."""
    t = torch.tensor(row, dtype=torch.int64, device=device)
    if group is None or dist.get_world_size(group) == 1:
        return [row]
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return [o.tolist() for o in out]


def _radix_kth(keys: Tensor, kmin: int, kmax: int, need: int, n_cand: int, group,
               bits: int) -> Tuple[int, int, int]:
    """The ``need``-th largest of int64 ``keys [N_local]`` over ``group`` (``1 <= need <= n_cand``).

    ``kmin``/``kmax``: global min/max of the keys; ``n_cand``: their global count. Returns
    ``(key, n_equal, n_take)``: the key, how many keys equal it, and how many of those the
    top-``need`` set takes.
    """
    u = keys
    # Work on u = key - base >= 0 so only the bits where kmin and kmax differ need resolving.
    # If kmax - kmin overflows int64 (fp64 values of both signs) use the sign-flipped bit pattern.
    if kmax - kmin <= INT64_MAX:
        base = kmin
        u = u - kmin
    else:
        base = INT64_MIN
        u = u ^ INT64_MIN
    umin, umax = kmin - base, kmax - base
    width = (umin ^ umax).bit_length()
    prefix = (umin >> width) << width  # bits shared by all candidates
    if width == 0:
        return kmin, n_cand, need
    nb = 1 << bits
    n_pass = -(-width // bits)
    remaining, n_equal = need, 0
    for i in range(n_pass):
        shift = bits * (n_pass - 1 - i)
        # The first digit may be narrower than `bits`: keep only bits below `width`.
        digit = (u >> shift) & ((1 << min(bits, width - shift)) - 1)
        hist = torch.zeros(nb, dtype=torch.int64, device=keys.device)
        hist.scatter_add_(0, digit, torch.ones_like(digit))
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(hist, group=group)
        h = hist.cpu()
        above = h.flip(0).cumsum(0)  # above[j]: count in the top j+1 bins
        j = int(torch.searchsorted(above, torch.tensor([remaining])).item())
        b = nb - 1 - j
        remaining -= int(above[j]) - int(h[b])
        n_equal = int(h[b])
        prefix |= b << shift
        if i + 1 < n_pass:
            u = u[digit == b]  # only keys with this digit stay candidates; the set shrinks
    return prefix + base, n_equal, remaining


def _prologue(values: Tensor, keys: Optional[Tensor], k: int, group, who: str):
    """Local checks plus one all-gather of per-rank stats; raises the same ValueError everywhere.

    Returns ``(order_keys [N], width, n_global, kmin, kmax)``.
    """
    problem = 0
    if values.dim() != 1 or not values.dtype.is_floating_point:
        problem = 1
    elif keys is not None and (keys.shape != values.shape or keys.dtype != torch.int64):
        problem = 2
    okeys, width, has_nan, kmin, kmax = None, 0, 0, INT64_MAX, INT64_MIN
    if problem == 0:
        has_nan = int(bool(values.isnan().any()))
        if not has_nan:
            okeys, width = _order_keys(values)
            if okeys.numel():
                kmin, kmax = (int(x) for x in torch.aminmax(okeys))
    rows = _all_gather_rows([values.numel() if problem == 0 else 0, problem, has_nan, width, k,
                             kmin, kmax], values.device, group)
    ranks = lambda col: [r for r, row in enumerate(rows) if row[col]]  # noqa: E731
    if ranks(1):
        raise ValueError(
            f"{who}: rank(s) {ranks(1)} passed bad inputs: values must be a 1-D float tensor"
            + ("" if keys is None else " and keys an int64 tensor of the same shape")
        )
    if ranks(2):
        raise ValueError(f"{who}: NaN values on rank(s) {ranks(2)}; selection needs non-NaN values")
    n = sum(row[0] for row in rows)
    if len({row[4] for row in rows}) > 1:
        raise ValueError(f"{who}: ranks passed different k: {[row[4] for row in rows]}")
    if len({row[3] for row in rows if row[0]}) > 1:
        raise ValueError(f"{who}: ranks passed values of different float widths (fp64 vs fp32)")
    if not 0 <= k <= n:
        raise ValueError(f"{who}: k={k} must lie in [0, n={n}] (n = value count over the group)")
    width = max(row[3] for row in rows)
    return okeys, width, n, min(row[5] for row in rows), max(row[6] for row in rows)


def topk_threshold(values: Tensor, keys: Tensor, k: int, group: Optional[dist.ProcessGroup] = None,
                   *, radix_bits: int = 8) -> TopKThreshold:
    """The exact global top-``k`` boundary of ``values`` over ``group``.

    Args:
        values: ``[N_local]`` float (any float dtype, same on all ranks), no NaN; +-inf allowed;
            ``N_local`` may be 0.
        keys: ``[N_local]`` int64 layout-independent token ids; among equal values the smaller key
            wins.
        k: how many of the ``n = sum N_local`` values to select, ``0 <= k <= n``; same on all ranks.
        group: process group the values are spread over; None = this process only.
        radix_bits: bits resolved per pass (histograms of ``2**radix_bits`` int64 counts).

    Returns:
        :class:`TopKThreshold`, identical on all ranks. Collectives: one all-gather of 7 ints per
        rank, then one SUM all-reduce per radix pass (plus one all-gather and more passes when a
        tie at the threshold must be broken by key).
    """
    if not 1 <= radix_bits <= 16:
        raise ValueError(f"radix_bits must be in [1, 16], got {radix_bits}")
    k = operator.index(k)
    okeys, width, n, kmin, kmax = _prologue(values, keys, k, group, "topk_threshold")
    if k == 0:
        return TopKThreshold(float("inf"), INT64_MIN, 0, n)
    vkey, n_equal, n_take = _radix_kth(okeys, kmin, kmax, k, n, group, radix_bits)
    value = _key_to_float(vkey, width)
    if n_take == n_equal:
        return TopKThreshold(value, INT64_MAX, k, n)
    # Break the tie: take the n_take smallest keys among the items equal to the threshold, i.e.
    # the n_take-th largest of ~key (bitwise not reverses int64 order without overflow).
    inv = ~keys[okeys == vkey]  # keys of the tied items, order reversed
    tmin = int(inv.min()) if inv.numel() else INT64_MAX
    tmax = int(inv.max()) if inv.numel() else INT64_MIN
    rows = _all_gather_rows([tmin, tmax], values.device, group)
    tmin, tmax = min(r[0] for r in rows), max(r[1] for r in rows)
    ikey, n_eq_key, n_take_key = _radix_kth(inv, tmin, tmax, n_take, n_equal, group,
                                            radix_bits)
    if n_eq_key != n_take_key:
        raise ValueError(
            f"topk_threshold: {n_eq_key} items share value {value} and key {~ikey} at the "
            "threshold; token keys must be unique for an exact top-k"
        )
    return TopKThreshold(value, ~ikey, k, n)


def topk_mask(values: Tensor, keys: Tensor, k: int, group: Optional[dist.ProcessGroup] = None,
              *, radix_bits: int = 8) -> Tensor:
    """Bool mask ``[N_local]``: this rank's share of the exact global top-``k`` (see
    :func:`topk_threshold`); exactly ``k`` True entries summed over ``group``."""
    return topk_threshold(values, keys, k, group, radix_bits=radix_bits).select(values, keys)


def kth_largest(values: Tensor, k: int, group: Optional[dist.ProcessGroup] = None, *,
                radix_bits: int = 8) -> float:
    """The exact ``k``-th largest (``1 <= k <= n``) of ``values [N_local]`` over ``group``."""
    if not 1 <= radix_bits <= 16:
        raise ValueError(f"radix_bits must be in [1, 16], got {radix_bits}")
    k = operator.index(k)
    okeys, width, n, kmin, kmax = _prologue(values, None, k, group, "kth_largest")
    if k == 0:
        raise ValueError("kth_largest: k must be >= 1")
    vkey, _, _ = _radix_kth(okeys, kmin, kmax, k, n, group, radix_bits)
    return _key_to_float(vkey, width)
