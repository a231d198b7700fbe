"""Causal attention in plain torch for context parallel and packed sequences, without
transformer-engine: a drop-in for megatron-core's ``core_attention``.

megatron-core's local ``DotProductAttention`` refuses context parallelism and packed sequences;
transformer-engine's does both but needs CUDA. ``TorchDotProductAttention`` does both anywhere
(CPU gloo ranks included), with the layouts TE receives from ``Attention.forward``:

- ``sbhd`` (no ``packed_seq_params``): query ``[s, b, np, hn]``, key/value ``[s, b, ng, hn]``,
  each row one sequence; returns ``[s, b, np*hn]``.
- ``thd`` (``packed_seq_params.qkv_format == "thd"``): query ``[t, np, hn]``, key/value
  ``[t, ng, hn]``, the sequences of ``cu_seqlens`` end to end; returns ``[t, np*hn]``.
  The slots of ``cu_seqlens_q_padded`` (``cu_seqlens_q`` without it), global (before the CP
  split) as TE takes them, place the sequences; a slot's tokens attend within the slot only.
  Padding at a slot's end comes after every real token, so causality already hides it.

Context parallel (Megatron's load-balanced split, ``SegmentLayout``): every sequence (a row
under sbhd; each packed sequence, padded to a multiple of ``2*cp``, under thd, as TE's THD
context parallel and ``thd_get_partitioned_indices``) is cut into ``2*cp`` chunks and CP rank
``r`` holds chunks ``r`` and ``2*cp-1-r``. Keys and values are all-gathered over the CP group
(the backward reduce-scatters their gradients) and put in global order; queries keep their
global positions, so the causal mask is the one of the whole sequence.

Memory: no ``[L, L]`` mask or score matrix over a row. The local queries are cut into blocks
(``plan_blocks``), each attending to one contiguous key range through torch's fused attention
(``scaled_dot_product_attention``: flash kernels on CPU and CUDA, which never store the
probabilities). A run of queries that starts its sequence is one plain causal block; a later
CP chunk attends to the keys from its sequence's start and needs a mask tile, cut to at most
``block_elements`` entries (per head); short sequences share one block-diagonal tile. Causal
blocks use the fused kernel's own backward; masked blocks recompute theirs block by block
(``_MaskedBlocks``), so activations stay ``O(t)``.

Grouped-query attention (``ng < np``): query head ``h`` uses key/value head ``h // (np/ng)``,
as ``repeat_interleave`` in megatron-core (``enable_gqa``). On CUDA, SDPA's flash kernel takes
no mask and its memory-efficient kernel no ``enable_gqa``, so a masked (or fp32) GQA block would
run on the math kernel (the ``[nq, nk]`` scores in memory): there the K/V heads are expanded
first (``_kv_for_sdpa``) and the memory-efficient kernel takes the mask; 16-bit causal blocks
keep ``enable_gqa`` (flash). The fused kernels keep the softmax in fp32 for 16-bit inputs.
Attention dropout must be 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from torch import Tensor
from megatron.core.process_groups_config import ProcessGroupCollection

#: Default budget of one mask tile, in entries times heads (64 MiB of fp32 scores if a kernel
#: without masked-softmax support materialises them).
BLOCK_ELEMENTS = 1 << 24
#: Short runs share one masked tile up to this many entries: below it a kernel call's overhead
#: outweighs the masked-out work; above it the causal kernel (which skips the upper triangle)
#: on each run is cheaper.
MERGE_ELEMENTS = 1 << 16


@dataclass(frozen=True)
class SegmentLayout:
    """Where the tokens of some sequences lie, globally and on this CP rank.

    ``slots[i]``: global length of sequence ``i``'s slot (its tokens, then any padding; a
    multiple of ``2*cp`` when cp > 1). Slots lie end to end in global order; this rank holds
    chunks ``cp_rank`` and ``2*cp-1-cp_rank`` of each slot, slot after slot. A token attends to
    the tokens of its own slot up to itself: padding at a slot's end is seen by no real token.
    """

    slots: Tuple[int, ...]
    cp: int = 1
    cp_rank: int = 0

    def __post_init__(self):
        if any(n < 0 for n in self.slots):
            raise ValueError(f"SegmentLayout: negative slot length in {self.slots}")
        if self.cp > 1 and any(n % (2 * self.cp) for n in self.slots):
            raise ValueError(f"SegmentLayout: slots {self.slots} are not all multiples of 2*cp = "
                             f"{2 * self.cp}; pad each sequence for context parallelism")

    @classmethod
    def rows(cls, batch: int, local_len: int, cp: int = 1, cp_rank: int = 0) -> "SegmentLayout":
        """``batch`` rows of ``local_len`` tokens each on this rank (sbhd): one sequence per row."""
        return cls((local_len * cp,) * batch, cp, cp_rank)

    @property
    def global_tokens(self) -> int:
        return sum(self.slots)

    @property
    def local_tokens(self) -> int:
        return self.global_tokens // self.cp

    def runs(self, cp_rank: Optional[int] = None) -> List[Tuple[int, int, int, int]]:
        """Contiguous runs of the rank's tokens: ``(local_start, n, global_start, slot_start)``."""
        r = self.cp_rank if cp_rank is None else cp_rank
        out, local, start = [], 0, 0
        for p in self.slots:
            if self.cp > 1:
                c = p // (2 * self.cp)
                offsets = (r * c, (2 * self.cp - 1 - r) * c)
            else:
                c, offsets = p, (0,)
            for off in offsets:
                if c:
                    out.append((local, c, start + off, start))
                local += c
            start += p
        return out

    def global_index(self, cp_rank: Optional[int] = None) -> Tensor:
        """``[local_tokens]`` int64: the global position of each of the rank's tokens."""
        parts = [torch.arange(g, g + n) for _, n, g, _ in self.runs(cp_rank)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


@dataclass(frozen=True)
class Block:
    """Local queries ``[q0, q1)`` attend within global keys ``[k0, k1)``. ``causal``: the mask is
    plain top-left causal (``q1-q0 == k1-k0``, the run starts its slot), no mask tensor needed."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


@dataclass(frozen=True)
class BlockPlan:
    """The query blocks of one layout and the index tensors they need, on the device."""

    blocks: Tuple[Block, ...]
    key_lo: Tensor
    """``[t]`` int64: the first global key a query may see (its slot's start)."""
    key_hi: Tensor
    """``[t]`` int64: the last global key a query may see (itself)."""
    gather_order: Optional[Tensor]
    """``[T]`` int64 (cp > 1): for each global position, its row in the CP all-gather."""

    def allowed(self, b: Block) -> Tensor:
        """``[q1-q0, k1-k0]`` bool: the causal, same-sequence mask of one (masked) block."""
        keys = torch.arange(b.k0, b.k1, device=self.key_lo.device)
        return (keys >= self.key_lo[b.q0:b.q1, None]) & (keys <= self.key_hi[b.q0:b.q1, None])


def plan_blocks(layout: SegmentLayout, heads: int, block_elements: int = BLOCK_ELEMENTS,
                device=None) -> BlockPlan:
    """Cut this rank's queries into blocks.

    A run that starts its slot (every sequence without CP; chunk 0 under CP) is one causal block
    of any length: the attention kernel needs no mask for it. Any other run (a later CP chunk)
    attends to keys from its slot's start and needs a mask tile: it is cut into blocks of at most
    ``block_elements`` mask entries per ``heads`` (a kernel without masked-softmax support makes
    scores of that size). Consecutive short runs share one masked block (block-diagonal) while
    its tile stays within ``MERGE_ELEMENTS``.
    """
    budget = max(block_elements // max(heads, 1), 1)
    blocks: List[list] = []
    cur = None  # [q0, q1, k0, k1, causal]
    for local, n, g0, start in layout.runs():
        if cur is not None:
            nq = cur[1] - cur[0] + n
            cost = nq * (g0 + n - cur[2])
            if cost <= min(budget, MERGE_ELEMENTS):
                cur[1], cur[3], cur[4] = cur[1] + n, g0 + n, False
                continue
            blocks.append(cur)
            cur = None
        if g0 == start:
            cur = [local, local + n, g0, g0 + n, True]
            continue
        a = 0
        while a < n:
            before = g0 + a - start  # keys of the slot before the block's first query
            m = int((-before + math.sqrt(before * before + 4 * budget)) // 2)
            m = min(max(m, 1), n - a)
            blk = [local + a, local + a + m, start, g0 + a + m, False]
            a += m
            if a < n:
                blocks.append(blk)
            else:
                cur = blk
    if cur is not None:
        blocks.append(cur)
    hi = layout.global_index()
    lo = torch.empty_like(hi)
    for local, n, _, start in layout.runs():
        lo[local:local + n] = start
    order = None
    if layout.cp > 1:
        # Row ``j * t + u`` of the all-gather is token ``u`` of CP rank ``j``.
        t = layout.local_tokens
        order = torch.empty(layout.global_tokens, dtype=torch.long)
        for j in range(layout.cp):
            order[layout.global_index(j)] = torch.arange(j * t, (j + 1) * t)
        order = order.to(device)
    return BlockPlan(blocks=tuple(Block(*b) for b in blocks), key_lo=lo.to(device),
                     key_hi=hi.to(device), gather_order=order)


@lru_cache(maxsize=16)
def _cached_plan(layout: SegmentLayout, heads: int, block_elements: int, device: torch.device) -> BlockPlan:
    return plan_blocks(layout, heads, block_elements, device)


def _kv_for_sdpa(qh: Tensor, kh: Tensor, vh: Tensor, masked: bool, cuda: Optional[bool] = None
                 ) -> Tuple[Tensor, Tensor, bool]:
    """(k, v, enable_gqa) for SDPA on heads-second ``[.., heads, len, hn]`` tensors. On CUDA a
    GQA call with a mask, or in fp32, has no fused kernel with ``enable_gqa``: expand the K/V
    heads (``repeat_interleave``, megatron-core's order) so the memory-efficient kernel runs."""
    rep = qh.shape[1] // kh.shape[1]
    if rep == 1:
        return kh, vh, False
    if (qh.is_cuda if cuda is None else cuda) and (masked or qh.dtype == torch.float32):
        return kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1), False
    return kh, vh, True


def _attend(q: Tensor, k: Tensor, v: Tensor, b: Block, plan: BlockPlan, scale: float) -> Tensor:
    """One block: ``q`` ``[nq, np, hn]``, ``k``/``v`` ``[nk, ng, hn]`` -> ``[nq, np, hn]``.

    torch's fused attention (flash on CPU and CUDA where it applies) keeps the softmax in fp32
    for 16-bit inputs and never stores the ``[nq, nk]`` probabilities.
    """
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    kh, vh, gqa = _kv_for_sdpa(qh, kh, vh, masked=not b.causal)
    kw = dict(scale=scale, enable_gqa=gqa)
    if b.causal:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, **kw)
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=plan.allowed(b), **kw)
    return out[0].transpose(0, 1)


class _MaskedBlocks(torch.autograd.Function):
    """The masked blocks of a plan, their outputs concatenated in order. torch's fused attention
    would save each block's mask for its backward (the whole masked area of a long CP chunk, so
    quadratic memory); this forward saves nothing per block and the backward recomputes block by
    block (activation checkpointing at block granularity), so memory stays linear."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, plan: BlockPlan, blocks: Tuple[Block, ...], scale: float):
        ctx.save_for_backward(q, k, v)
        ctx.plan, ctx.blocks, ctx.scale = plan, blocks, scale
        return torch.cat([_attend(q[b.q0:b.q1], k[b.k0:b.k1], v[b.k0:b.k1], b, plan, scale) for b in blocks])

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v = ctx.saved_tensors
        # Keys and values collect gradients from many blocks: accumulate 16-bit ones in fp32.
        acc = torch.float32 if k.dtype in (torch.float16, torch.bfloat16) else k.dtype
        dq = torch.zeros_like(q)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        row = 0
        for b in ctx.blocks:
            n = b.q1 - b.q0
            with torch.enable_grad():
                qb, kb, vb = (x.detach().requires_grad_() for x in
                              (q[b.q0:b.q1], k[b.k0:b.k1], v[b.k0:b.k1]))
                out = _attend(qb, kb, vb, b, ctx.plan, ctx.scale)
                gq, gk, gv = torch.autograd.grad(out, (qb, kb, vb), dout[row:row + n])
            dq[b.q0:b.q1] = gq
            dk[b.k0:b.k1] += gk
            dv[b.k0:b.k1] += gv
            row += n
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None


class _GatherFromContextParallel(torch.autograd.Function):
    """All-gather along dim 0 over the CP group; the backward reduce-scatters (sums) the
    gradient back to each rank's rows."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        out = x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))
        dist.all_gather_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        size = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // size,) + tuple(grad.shape[1:]))
        dist.reduce_scatter_single(out, grad.contiguous(), op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


def block_attention(q: Tensor, k: Tensor, v: Tensor, layout: SegmentLayout, *, scale: float,
                    block_elements: int = BLOCK_ELEMENTS) -> Tensor:
    """Causal attention of this rank's queries ``q`` ``[t, np, hn]`` over keys/values of the whole
    layout in global order, ``k``/``v`` ``[T, ng, hn]`` (``T = layout.global_tokens``); returns
    ``[t, np, hn]``. Differentiable in q, k and v."""
    if q.shape[0] != layout.local_tokens or k.shape[0] != layout.global_tokens:
        raise ValueError(f"block_attention: {q.shape[0]} queries / {k.shape[0]} keys for a layout of "
                         f"{layout.local_tokens} local / {layout.global_tokens} global tokens")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    plan = _cached_plan(layout, q.shape[1], block_elements, q.device)
    masked = tuple(b for b in plan.blocks if not b.causal)
    pieces = iter(_MaskedBlocks.apply(q, k, v, plan, masked, scale).split([b.q1 - b.q0 for b in masked])
                  if masked else ())
    # Causal blocks go straight through the fused kernel's own backward: it saves only the
    # block's output and log-sum-exp.
    outs = [_attend(q[b.q0:b.q1], k[b.k0:b.k1], v[b.k0:b.k1], b, plan, scale) if b.causal else next(pieces)
            for b in plan.blocks]
    return torch.cat(outs) if outs else q.new_zeros((0,) + tuple(q.shape[1:2]) + tuple(v.shape[2:]))


def context_parallel_attention(q: Tensor, k: Tensor, v: Tensor, layout: SegmentLayout, *,
                               scale: float, cp_group=None, block_elements: int = BLOCK_ELEMENTS) -> Tensor:
    """``block_attention`` from this rank's local ``q``/``k``/``v`` ``[t, h, hn]``: with cp > 1
    the keys and values are all-gathered over ``cp_group`` and put in global order first."""
    if layout.cp > 1:
        plan = _cached_plan(layout, q.shape[1], block_elements, q.device)
        k = _GatherFromContextParallel.apply(k, cp_group).index_select(0, plan.gather_order)
        v = _GatherFromContextParallel.apply(v, cp_group).index_select(0, plan.gather_order)
    return block_attention(q, k, v, layout, scale=scale, block_elements=block_elements)


@dataclass
class PackedRowParams(PackedSeqParams):
    """``PackedSeqParams`` (thd) of one packed row, plus its slot lengths on the host so that
    ``TorchDotProductAttention`` plans its blocks without a device sync. transformer-engine
    reads only the base class's fields."""

    slot_lengths: Optional[Tuple[int, ...]] = None

    @classmethod
    def of(cls, seq_lens: Sequence[int], slot_lens: Sequence[int], device) -> "PackedRowParams":
        """Sequences of ``seq_lens`` tokens in slots of ``slot_lens`` (global, before the CP split):
        ``cu_seqlens_*`` from the real lengths, ``cu_seqlens_*_padded`` from the slots, int32."""
        cu = torch.tensor([0] + list(seq_lens), dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
        cu_p = torch.tensor([0] + list(slot_lens), dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
        return cls(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_p,
                   cu_seqlens_kv_padded=cu_p, max_seqlen_q=max(slot_lens), max_seqlen_kv=max(slot_lens),
                   slot_lengths=tuple(slot_lens))


def layout_from_packed(packed_seq_params, cp: int, cp_rank: int) -> SegmentLayout:
    """``SegmentLayout`` of a thd ``PackedSeqParams``: the slots are ``cu_seqlens_q_padded``'s
    (``cu_seqlens_q``'s when there is no padded form), global as TE takes them. A
    ``slot_lengths`` attribute (``PackedRowParams``) gives them host-side, without a device sync."""
    slots = getattr(packed_seq_params, "slot_lengths", None)
    if slots is None:
        cu = packed_seq_params.cu_seqlens_q_padded
        cu = (packed_seq_params.cu_seqlens_q if cu is None else cu).tolist()
        slots = tuple(b - a for a, b in zip(cu[:-1], cu[1:]))
    return SegmentLayout(tuple(slots), cp, cp_rank)


def attention_reference(q: Tensor, k: Tensor, v: Tensor, slots: Sequence[int], scale: float) -> Tensor:
    """Dense reference (tests only: builds the ``[T, T]`` mask) over whole sequences in global
    order: ``q`` ``[T, np, hn]``, ``k``/``v`` ``[T, ng, hn]`` -> ``[T, np, hn]``."""
    lengths = torch.tensor(list(slots), dtype=torch.long)
    seg = torch.repeat_interleave(torch.arange(len(slots)), lengths)
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    pos = torch.arange(seg.numel())
    mask = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    p = torch.softmax(s.masked_fill(~mask.to(q.device), -math.inf), dim=-1)
    return torch.einsum("hqk,khd->qhd", p, vv)


def local_rows(x: Tensor, layout: SegmentLayout, cp_rank: Optional[int] = None) -> Tensor:
    """This CP rank's rows of a global-order tensor ``[T, ...]`` (tests, benchmarks)."""
    return x.index_select(0, layout.global_index(cp_rank).to(x.device))


class TorchDotProductAttention(MegatronModule):
    """megatron-core ``core_attention`` (the ``DotProductAttention`` signature) in plain torch,
    with context parallel and packed (thd) sequences; see the module docstring for layouts."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None,
                 block_elements: int = BLOCK_ELEMENTS):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"TorchDotProductAttention has no attention dropout (got {dropout}); "
                             f"set attention_dropout=0 or use the transformer-engine spec")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"TorchDotProductAttention is causal only, not {attn_mask_type.name}")
        if config.window_size is not None or getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError("TorchDotProductAttention supports neither sliding windows nor "
                             "softmax offsets; use the transformer-engine spec")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.cp_group = getattr(pg_collection, "cp", None)
        self.cp = dist.get_world_size(self.cp_group) if self.cp_group is not None else 1
        self.cp_rank = dist.get_rank(self.cp_group) if self.cp_group is not None else 0
        head_dim = config.kv_channels
        # Megatron's query-key layer scaling divides the scale by the layer number and its
        # softmax multiplies it back: the same attention, so only the plain scale is used.
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        self.block_elements = block_elements

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Optional[AttnMaskType] = None, attention_bias: Optional[Tensor] = None,
                packed_seq_params=None) -> Tensor:
        """sbhd: ``[s, b, np, hn]`` (key/value ``[s, b, ng, hn]``) -> ``[s, b, np*hn]``;
        thd: ``[t, np, hn]`` -> ``[t, np*hn]``."""
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("TorchDotProductAttention takes no attention mask or bias: the causal "
                             "mask comes from the layout, sequence boundaries from packed_seq_params")
        kw = dict(scale=self.softmax_scale, cp_group=self.cp_group, block_elements=self.block_elements)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            layout = layout_from_packed(packed_seq_params, self.cp, self.cp_rank)
            out = context_parallel_attention(query, key, value, layout, **kw)
            return out.reshape(out.shape[0], -1)
        s, b = query.shape[:2]
        if self.cp == 1:  # whole rows: one causal call of torch's fused attention for all of them
            qh, kh, vh = (x.permute(1, 2, 0, 3) for x in (query, key, value))
            kh, vh, gqa = _kv_for_sdpa(qh, kh, vh, masked=False)
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.softmax_scale,
                                                 enable_gqa=gqa)
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)
        layout = SegmentLayout.rows(b, s, self.cp, self.cp_rank)
        flat = lambda x: x.transpose(0, 1).reshape(b * s, x.shape[2], x.shape[3])  # noqa: E731
        out = context_parallel_attention(flat(query), flat(key), flat(value), layout, **kw)
        return out.view(b, s, -1).transpose(0, 1).contiguous()


__all__: Sequence[str] = ("BLOCK_ELEMENTS", "SegmentLayout", "BlockPlan", "PackedRowParams",
                          "TorchDotProductAttention",
                          "plan_blocks", "block_attention", "context_parallel_attention",
                          "layout_from_packed", "attention_reference", "local_rows")
