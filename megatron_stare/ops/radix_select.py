"""The machinery behind ``ops.selection``: order keys, and exact top-k problems driven to a result.

A problem is "find the ``need``-th best of ``n`` candidates spread over the ranks", in the total
order (value descending, then token key ascending). Values are compared as order-preserving
integer keys (:func:`order_keys`). A problem narrows its candidates by most-significant-digit
radix passes (global histograms, all-reduced) and finishes exactly once its candidates are few
enough to all-gather. :func:`run` drives several problems in lockstep so that they share every
collective. Everything here is deterministic given the global data, so every rank takes the same
branch and the collectives line up.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1


def order_keys(values: Tensor) -> Tuple[Tensor, int]:
    """Order-preserving integer keys ``[N]`` of float values and the key width (32 or 64 bits).

    fp64 uses its 64-bit pattern (int64 keys); every narrower float is exactly representable in
    fp32 and uses the 32-bit pattern (int32 keys: half the memory traffic). A non-negative float
    keeps its bits; a negative one with magnitude bits ``m`` gets ``-m``, so -0.0 and +0.0 both
    get 0 (they compare equal). NaN keys lie above +inf's or below -inf's.
    """
    if values.dtype == torch.float64:
        b = values.view(torch.int64)
        return torch.where(b >= 0, b, INT64_MIN - b), 64
    b = (values if values.dtype == torch.float32 else values.float()).view(torch.int32)
    return torch.where(b >= 0, b, -(1 << 31) - b), 32


def key_to_float(key: int, width: int) -> float:
    """Inverse of :func:`order_keys` for one key (Python ints, exact)."""
    low = -(1 << (width - 1))
    bits = key if key >= 0 else low - key
    return struct.unpack("<d" if width == 64 else "<f",
                         struct.pack("<q" if width == 64 else "<i", bits))[0]


def gather_rows(t: Tensor, group) -> Tensor:
    """``[world, *t.shape]``: ``t`` of every rank of ``group``, by rank, gathered straight into
    the rows of one tensor (no stacking copy); ``t[None]`` alone."""
    if group is None or dist.get_world_size(group) == 1:
        return t[None]
    out = t.new_empty((dist.get_world_size(group), *t.shape))
    dist.all_gather(list(out.unbind(0)), t, group=group)
    return out


def _unsigned(x: Tensor, off: int, width: int) -> Tensor:
    """A fresh ``x - off`` as a ``width``-bit pattern (read with ``>>`` and ``&``; may look
    negative). ``off`` is the type's minimum (then it is ``x ^ off``) or lies within the span."""
    return x ^ off if off == -(1 << (width - 1)) else x - off


def span(lo: int, hi: int, width: int) -> Tuple[int, int, int]:
    """``(off, bits, prefix)`` for ``width``-bit signed values in ``[lo, hi]``: ``u = x - off`` is
    in ``[0, 2**width)`` (``off = lo`` when the span fits, else the type's minimum), ``bits`` low
    bits of ``u`` vary, and every ``u`` has the bits ``prefix`` above them."""
    low = -(1 << (width - 1))
    off = lo if hi - lo < -low else low
    bits = ((lo - off) ^ (hi - off)).bit_length()
    return off, bits, ((lo - off) >> bits) << bits


def top_digits(okeys: Tensor, width: int, bits: int) -> Tensor:
    """The top ``bits`` of the unsigned order keys (sign, exponent, leading mantissa bits)."""
    u = _unsigned(okeys, -(1 << (width - 1)), width)
    u >>= width - bits
    u &= (1 << bits) - 1
    return u


@dataclass
class Problem:
    """One exact top-k problem in flight: the ``need``-th best of the ``n`` global candidates.

    ``ok``/``keys``: this rank's candidates (order keys of the values; int64 token keys, or None
    for a value-only problem). The candidates are the items whose unsigned value ``ok - off_v``
    has the resolved ``prefix_v`` above its low ``bits_v`` bits and, in the key phase (all value
    bits resolved, a tie to break), whose ``~key - off_k`` has ``prefix_k`` above ``bits_k``.
    ``cap``: the most candidates any one rank can hold. ``k``/``n_total``: the original request.
    """

    ok: Tensor
    keys: Optional[Tensor]
    width: int
    k: int
    n_total: int
    need: int
    n: int
    cap: int
    off_v: int
    bits_v: int
    prefix_v: int = 0
    off_k: int = 0
    bits_k: int = 0
    prefix_k: int = 0
    key_phase: bool = False
    result: Optional[Tuple[int, int]] = None  # (order key, token key) of the threshold

    def settle(self) -> None:
        """Finish without communication when the value bits are resolved and no choice is left."""
        if self.result is not None or self.bits_v:
            return
        vkey = self.prefix_v + self.off_v
        if self.keys is None or (not self.key_phase and self.need == self.n):
            self.result = (vkey, INT64_MAX)  # every item tied at the value is in
            return
        self.key_phase = True  # the tie at the value must be broken by key
        if self.bits_k == 0:
            key = ~(self.prefix_k + self.off_k)
            if self.need < self.n:  # equal (value, key) pairs split by the threshold
                self.duplicates(self.n, vkey, key)
            self.result = (vkey, key)

    def duplicates(self, count: int, vkey: int, key: int):
        value = key_to_float(vkey, self.width)
        raise ValueError(f"topk_threshold: {count} items share value {value} and key {key} at the "
                         "threshold; token keys must be unique for an exact top-k")

    def digits(self, bits: int) -> Tuple[Tensor, int, int]:
        """``(digit [N_cand], digit width, shift)`` of the next radix pass."""
        if self.bits_v:
            d = min(bits, self.bits_v)
            shift = self.bits_v - d
            u = _unsigned(self.ok, self.off_v, self.width)
        else:
            d = min(bits, self.bits_k)
            shift = self.bits_k - d
            u = _unsigned(~self.keys, self.off_k, 64)
        if shift:
            u >>= shift
        u &= (1 << d) - 1
        return u, d, shift

    def advance(self, digit: Tensor, d: int, shift: int, hist: Tensor) -> int:
        """Keep the bin of the global histogram ``hist [2**d]`` that holds the ``need``-th best;
        returns the bin."""
        above = hist.flip(0).cumsum(0)  # above[j]: count in the top j+1 bins
        j = int(torch.searchsorted(above, torch.tensor([self.need], dtype=above.dtype)).item())
        b = (1 << d) - 1 - j
        self.need -= int(above[j]) - int(hist[b])
        self.n = int(hist[b])
        self.cap = min(self.cap, self.n)
        keep = digit == b
        self.ok = self.ok[keep]
        if self.keys is not None:
            self.keys = self.keys[keep]
        if self.bits_v:
            self.prefix_v |= b << shift
            self.bits_v = shift
        else:
            self.prefix_k |= b << shift
            self.bits_k = shift
        return b

    def payload_words(self) -> int:
        words = 2 + (0 if self.keys is None else 2 * self.cap) + self.width // 32 * self.cap
        return words + (words & 1)  # even: the next problem's payload stays int64-aligned

    def payload(self) -> Tensor:
        """int32 words: the local count (2 words), the token keys (2 words each), the order keys
        (1 word each for fp32, 2 for fp64), both zero-padded to ``cap`` slots. 12 bytes per fp32
        item, as for an all-gather of fp32 values and int64 keys."""
        out = torch.zeros(self.payload_words(), dtype=torch.int32, device=self.ok.device)
        m, at = self.ok.numel(), 2
        out[:2].view(torch.int64)[0] = m
        if self.keys is not None:
            out[at : at + 2 * self.cap].view(torch.int64)[:m] = self.keys
            at += 2 * self.cap
        out[at:].view(self.ok.dtype)[:m] = self.ok
        return out

    def finish_gathered(self, parts: List[Tensor]) -> None:
        """Resolve the threshold from every rank's :meth:`payload`."""
        oks, keys = [], []
        for part in parts:
            m, at = int(part[:2].view(torch.int64)[0]), 2
            if self.keys is not None:
                keys.append(part[at : at + 2 * self.cap].view(torch.int64)[:m])
                at += 2 * self.cap
            oks.append(part[at:].view(self.ok.dtype)[:m])
        self.finish(torch.cat(oks), torch.cat(keys) if self.keys is not None else None)

    def finish(self, ok: Array, keys: Optional[Array], vkey: Optional[int] = None) -> None:
        """Resolve the threshold from ALL ``n`` candidates: order keys ``ok`` and token keys
        ``keys``, host tensors or arrays of ``n`` items in any shape (exact); ``vkey``: their
        ``need``-th largest order key, when the caller has it already. Runs in numpy: at a few
        thousand items torch's per-call dispatch costs more than the work itself."""
        ok = host(ok)
        if vkey is None:
            vkey = kth_key(ok, self.need)
        if keys is None:
            self.result = (vkey, INT64_MAX)
            return
        # Outside the key phase the candidates hold every item at the value: when the need-th
        # best is the last item at or above it, every tied item is in (one count decides).
        if not self.key_phase and int(np.count_nonzero(ok >= vkey)) == self.need:
            self.result = (vkey, INT64_MAX)
            return
        keys = host(keys)
        tied = ok == vkey
        take = self.need - int(np.count_nonzero(ok > vkey))
        # The take-th smallest key among the tied items wins last; the others are masked to
        # INT64_MAX, which a real key ties only in a case settled by the exact count below.
        tk = np.where(tied, keys, INT64_MAX)
        key = int(np.partition(tk, take - 1)[take - 1])
        if key == INT64_MAX:
            tk = keys[tied]
        if int(np.count_nonzero(tk <= key)) != take:  # duplicates of that key, split
            self.duplicates(int(np.count_nonzero(tk == key)), vkey, key)
        self.result = (vkey, key)


Array = Union[Tensor, np.ndarray]


def host(x: Array) -> np.ndarray:
    """A flat numpy view (or copy, when strided) of a host tensor or array."""
    return (x.numpy() if isinstance(x, Tensor) else x).reshape(-1)


def kth_key(ok: Array, need: int) -> int:
    """The ``need``-th largest of the ``n`` order keys ``ok`` (``1 <= need <= n``; a host
    tensor or array)."""
    a = host(ok)
    i = a.size - need
    return int(np.partition(a, i)[i])


def run(problems: List[Problem], group, bits: int, gather_max: int) -> None:
    """Drive all problems to a result in lockstep. Per round: one all-gather of the candidates of
    every problem whose gather would receive at most ``gather_max`` item slots per rank, and one
    SUM all-reduce of the concatenated radix histograms (``2**bits`` bins) of the others."""
    world = 1 if group is None else dist.get_world_size(group)
    while True:
        for p in problems:
            p.settle()
        live = [p for p in problems if p.result is None]
        if not live:
            return
        small = [p for p in live if world * p.cap <= gather_max]
        radix = [p for p in live if world * p.cap > gather_max]
        if small:
            sizes = [p.payload_words() for p in small]
            rows = gather_rows(torch.cat([p.payload() for p in small]) if len(small) > 1
                               else small[0].payload(), group)
            if rows.device.type != "cpu":
                rows = rows.cpu()
            for p, block in zip(small, rows.split(sizes, dim=1)):
                p.finish_gathered(list(block.unbind(0)))
        if radix:
            passes = [p.digits(bits) for p in radix]
            sizes = [1 << d for _, d, _ in passes]
            # int32 counts halve the message whenever they cannot overflow.
            dtype = torch.int32 if max(p.n for p in radix) < 2 ** 31 else torch.int64
            hist = torch.cat([torch.bincount(digit, minlength=size).to(dtype)
                              for (digit, _, _), size in zip(passes, sizes)])
            if world > 1:
                dist.all_reduce(hist, group=group)
            for p, (digit, d, shift), h in zip(radix, passes, hist.cpu().split(sizes)):
                p.advance(digit, d, shift, h)
