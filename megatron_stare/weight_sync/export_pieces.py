"""The weight-sync export in pieces: HF buckets of at most ``bucket_bytes`` on ONE rank, with no
gather buffer and no conversion copies.

The whole-tensor export (``export.py``) all-gathers each canonical tensor over TP into a scratch
buffer, converts it to HF tensors (the QKV split and the gate/up split are copies) and copies
those into a bucket: besides its two bucket buffers, a rank holds the largest gathered tensor and
its HF copies, and a tensor larger than the bucket (the embedding, the LM head) makes a bucket
of its own size. Here nothing is materialised outside the bucket:

- **The plan** (``stage_pieces``): every HF tensor of this stage is described as *pieces*, each
  a contiguous run of rows of ONE TP rank's local parameter (``Piece.owner``). The mapping says
  which canonical rows make each HF tensor (``LlamaLikeMapping.hf_rows``: the QKV groups, gate
  and up, the vocabulary without its padding); ``sharding`` says which rank holds them: a dim-0
  split (QKV, gate/up per rank, embedding, LM head) is cut where the owner changes, a dim-1 split
  (``o_proj``, ``down_proj``) travels as one column block per rank, a replicated tensor (norms,
  everything at TP=1) is taken from the collector's own copy.
- **Experts** (a mixture-of-experts model, ``ExpertPlan``): each rank of an expert-parallel
  group holds whole experts (split over expert-tensor parallel, like TP). The collector needs
  every expert of its stage; each one travels as pieces from the rank of the collector's expert
  grid that holds it (which may sit in another data-parallel replica), point-to-point like the
  TP pieces: no all-gather of the experts, no rank but the collector ever holds another's.
- **The buckets** (``piece_buckets``): pieces are written straight into a bucket buffer from a
  two-slot ``StagingBuffer``: the collector's own pieces by one ``copy_`` (which also casts), the
  other TP ranks' pieces by point-to-point receives into the buffer, all of a bucket's posted
  at once (their owner sends its rows, cast first when ``dtype`` differs). A piece that does not fit in the space left is cut by rows:
  the rest opens the next bucket. Every TP rank runs the same arithmetic, so the senders know
  every cut without a message.

Peak extra memory on the collector: two bucket buffers (one in flight, one being filled), at
most ``bucket_bytes`` each, and nothing else (``tests/distributed/test_models_dist.py`` measures
it with the allocator's events). On a sending TP rank: its share of one bucket when it must be cast.

Receivers join pieces with ``weight_sync.Assembler`` (``ProcessGroupReceiver`` does it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_stare.models.sharding import (expert_index, full_shape, is_expert_param, is_glu_fc1, local_params,
                                            renumber_expert)
from megatron_stare.weight_sync import FlatBucket, Pending, StagingBuffer, TensorMeta, dtype_name
from megatron_stare.weight_sync.bucket import aligned


@dataclass(frozen=True)
class Piece:
    """Rows of one HF tensor that one rank holds contiguously.

    The piece is ``hf[start[0]:start[0]+shape[0], start[1]:start[1]+shape[1], ...]`` of the HF
    tensor ``name`` of shape ``full``; its bytes are ``src`` (this rank's rows of the local
    parameter) on the owner, ``None`` elsewhere. ``owner`` is the GLOBAL rank that holds them
    (a TP rank of the collector's stage; for an expert's rows, the rank of the collector's expert
    grid that holds that expert: ``ExpertPlan``), ``-1`` when this rank does not know (it takes no
    part in that tensor), or ``None`` when every TP rank holds the same rows (a replicated parameter).
    """

    name: str
    full: Tuple[int, ...]
    start: Tuple[int, ...]
    shape: Tuple[int, ...]
    dtype: torch.dtype
    owner: Optional[int]
    src: Optional[torch.Tensor]

    @property
    def whole(self) -> bool:
        return self.shape == self.full


@dataclass(frozen=True)
class ExpertPlan:
    """Where the experts of the collector's stage live: ``grid[(ep_rank, etp_rank)]`` is the
    global rank of the collector's expert grid (megatron's etp x ep block of its pipeline stage
    and expert-data-parallel index) that holds expert shard ``etp_rank`` of the experts
    ``ep_rank * num_local .. + num_local - 1``; ``ep_rank`` / ``etp_rank``: this rank's."""

    ep: int
    etp: int
    ep_rank: int
    etp_rank: int
    num_local: int
    grid: Dict[Tuple[int, int], int]
    """Empty on a rank outside the collector's grid (a TP peer of the collector: it sends none)."""


def _dim0_runs(row: int, n: int, local_rows: int, tp: int, glu: bool) -> Iterator[Tuple[int, int, int, int]]:
    """``(offset in the run, owner, local row, count)`` covering canonical rows ``[row, row+n)``
    of a parameter split along dim 0 into ``tp`` shards of ``local_rows`` rows (SwiGLU fc1:
    each shard is ``[gate_r; up_r]``, so canonical ``[gate; up]`` is split half by half)."""
    half = local_rows // 2
    gate_rows = half * tp
    done = 0
    while done < n:
        x = row + done
        if glu:
            y = x if x < gate_rows else x - gate_rows
            owner, local = y // half, y % half + (0 if x < gate_rows else half)
            left = half - y % half
        else:
            owner, local = x // local_rows, x % local_rows
            left = local_rows - local
        m = min(n - done, left)
        yield done, owner, local, m
        done += m


def _param_pieces(out: List[Piece], mapping, canon: str, local: str, p, w, full, tp: int, owners, me: int,
                  glu: bool) -> None:
    """Append the pieces of one local parameter ``p`` (canonical ``canon`` of shape ``full``)
    split over ``tp`` shards; ``owners[r]``: the global rank holding shard ``r``, or None for a
    replicated parameter (unsplit at ``tp == 1`` when ``owners`` is None)."""
    split = tp > 1 and getattr(p, "tensor_model_parallel", False)
    dim = p.partition_dim if split else None
    for hf in mapping.hf_rows(canon, full):
        zeros = (0,) * (len(hf.shape) - 1)
        for hf_row, c_row, n in hf.runs:
            if dim is None:
                owner = None if owners is None else owners[0]
                out.append(Piece(hf.name, hf.shape, (hf_row,) + zeros, (n,) + tuple(hf.shape[1:]), p.dtype,
                                 owner, w[c_row:c_row + n] if owner is None or owner == me else None))
            elif dim == 1:
                cols = p.shape[1]
                for r in range(tp):
                    out.append(Piece(hf.name, hf.shape, (hf_row, r * cols) + zeros[1:],
                                     (n, cols) + tuple(hf.shape[2:]), p.dtype, owners[r],
                                     w[c_row:c_row + n] if owners[r] == me else None))
            elif dim == 0:
                for off, r, lrow, m in _dim0_runs(c_row, n, p.shape[0], tp, glu and is_glu_fc1(local)):
                    out.append(Piece(hf.name, hf.shape, (hf_row + off,) + zeros, (m,) + tuple(hf.shape[1:]),
                                     p.dtype, owners[r], w[lrow:lrow + m] if owners[r] == me else None))
            else:
                raise ValueError(f"{canon}: tensor-parallel split along dim {dim} is not supported by the "
                                 f"piece export")


def stage_pieces(model, mapping, tp: int, tp_rank: int, glu: bool = True, *,
                 tp_ranks: Optional[List[int]] = None, me: Optional[int] = None,
                 experts: Optional[ExpertPlan] = None) -> List[Piece]:
    """This stage's HF tensors as pieces (see the module docstring), in export order: parameter
    by parameter, HF tensor by HF tensor, rows in order. Every rank that takes part gets the
    same list (with ``src`` only on the owner).

    ``tp_ranks``: the global ranks of the collector's TP group in TP-rank order (default
    ``range(tp)``); None with ``me`` set: this rank is outside it (an expert grid member of
    another data-parallel replica), so the dense pieces are none of its business (owner -1).
    ``me``: this rank's global rank (default ``tp_ranks[tp_rank]``). ``experts`` (a MoE model):
    each local expert tensor becomes the pieces of that expert on EVERY expert-parallel rank of
    the collector's grid (``ExpertPlan``), owned by the rank that holds it: whole experts go
    point-to-point from their owner, never gathered on every rank.
    """
    if tp_ranks is None and me is None:
        tp_ranks = list(range(tp))
    me = tp_ranks[tp_rank] if me is None else me
    dense_owners = list(tp_ranks) if tp_ranks is not None else [-1] * tp
    out: List[Piece] = []
    for local, canon, p in local_params(model):
        w = p.detach()
        if experts is not None and is_expert_param(p):
            x = experts
            j = expert_index(canon) - x.ep_rank * x.num_local
            split = x.etp > 1 and getattr(p, "tensor_model_parallel", False)
            for r in range(x.ep):
                # An unsplit expert tensor (etp 1, or replicated over etp) comes from etp rank 0 on every rank's plan.
                owners = [x.grid.get((r, k), -1) for k in (range(x.etp) if split else [0])]
                # Only this rank's own experts have bytes here; the same rows of the others' are theirs.
                _param_pieces(out, mapping, renumber_expert(canon, r * x.num_local + j), local, p,
                              w if r == x.ep_rank else None, full_shape(p, tp, x.etp), x.etp if split else 1,
                              owners, me if r == x.ep_rank else -2, glu)
            continue
        owners = dense_owners if tp > 1 and getattr(p, "tensor_model_parallel", False) else None
        _param_pieces(out, mapping, canon, local, p, w, full_shape(p, tp), tp, owners, me, glu)
    return out


class _Cut(NamedTuple):
    """Rows ``[r0, r0 + n)`` of a piece, at byte ``offset`` of its bucket."""

    piece: Piece
    r0: int
    n: int
    offset: int
    nbytes: int
    dtype: torch.dtype


def _cuts(pieces: List[Piece], bucket_bytes: int, dtype: Optional[torch.dtype]
          ) -> Iterator[Tuple[int, int, List[_Cut]]]:
    """``(buffer bytes, used bytes, cuts)`` per bucket: pieces placed in order, each cut by rows
    where the bucket is full. Pure arithmetic, so every TP rank gets the same cuts."""
    # ``remaining`` (the aligned bytes still to place, exact) bounds the last buffer, as in pack_stream.
    remaining = sum(aligned(_nbytes(pc, dtype)) for pc in pieces)
    cuts: List[_Cut] = []
    cap = used = 0
    for pc in pieces:
        odt = dtype if dtype is not None else pc.dtype
        rows, done = pc.shape[0], 0
        row_bytes = _nbytes(pc, dtype) // max(rows, 1)
        while row_bytes and done < rows:
            start = aligned(used)
            fit = (cap - start) // row_bytes if cap > start else 0
            if fit == 0:
                if cuts:
                    yield cap, used, cuts
                cap, start, cuts = max(min(bucket_bytes, remaining), row_bytes), 0, []
                fit = cap // row_bytes
            n = min(rows - done, fit)
            cuts.append(_Cut(pc, done, n, start, n * row_bytes, odt))
            # What is left of this piece travels as a piece of its own: its own alignment.
            remaining += aligned((rows - done - n) * row_bytes) - aligned((rows - done) * row_bytes)
            used, done = start + n * row_bytes, done + n
    if cuts:
        yield cap, used, cuts


def piece_buckets(pieces: List[Piece], bucket_bytes: int, *, dtype: Optional[torch.dtype],
                  me: int, collector: int, staging: StagingBuffer, stats=None) -> Iterator[FlatBucket]:
    """On global rank ``collector``: yield this stage's buckets (``FlatBucket``s of at most
    ``bucket_bytes``, pieces written in place). On the other ranks: send the pieces they own
    (``Piece.owner == me``) to the collector, bucket by bucket; yields nothing. Every owner of a
    piece must iterate to the end (point-to-point transfers inside). ``stats``: an
    ``export.ExportStats`` (the wait for other ranks' pieces counts as gather, local copies as pack).

    Per bucket, the collector posts a receive for every remote piece first, copies its own
    pieces while they arrive, then waits: the transfers overlap each other and the copies.
    """
    me_collects = me == collector
    for cap, used, cuts in _cuts(pieces, bucket_bytes, dtype):
        flat = staging.get(cap) if me_collects else None
        views = [flat[c.offset:c.offset + c.nbytes].view(c.dtype).view((c.n,) + c.piece.shape[1:])
                 for c in cuts] if me_collects else [None] * len(cuts)
        pending = []
        for c, dest in zip(cuts, views):
            owner = c.piece.owner
            if owner is None or owner == collector:
                continue
            if me_collects:
                pending.append(Pending(dest, lambda x, src=owner: dist.irecv(x, src=src)))
            elif me == owner:
                rows = c.piece.src[c.r0:c.r0 + c.n].to(c.dtype).contiguous()
                pending.append(Pending(rows, lambda x: dist.isend(x, dst=collector)))
                del rows
        t0 = time.perf_counter()
        if me_collects:
            for c, dest in zip(cuts, views):
                if c.piece.owner is None or c.piece.owner == collector:
                    dest.copy_(c.piece.src[c.r0:c.r0 + c.n])
        t1 = time.perf_counter()
        for p in pending:
            p.wait()
        dest = p = None  # no view of the buffer may outlive the bucket: it could not be reused
        del pending, views
        if stats is not None:
            stats.pack_seconds += t1 - t0
            stats.gather_seconds += time.perf_counter() - t1
        if not me_collects:
            continue
        metas = _merged([TensorMeta(c.piece.name, dtype_name(c.dtype), (c.n,) + c.piece.shape[1:], c.offset,
                                    c.nbytes, c.piece.full, (c.piece.start[0] + c.r0,) + c.piece.start[1:])
                         for c in cuts])
        bucket = FlatBucket(metas, flat[:used])
        flat = None
        _packed(stats, bucket, staging)
        yield bucket
        del bucket


def _merged(metas: List[TensorMeta]) -> List[TensorMeta]:
    """Join consecutive full-width row pieces of one tensor that lie back to back in the buffer
    (a dim-0 split's ranks, the QKV groups of one HF tensor) into one entry; an entry that covers
    its tensor becomes a whole tensor, which the receiver takes as a view without joining."""
    out: List[TensorMeta] = []
    for m in metas:
        prev = out[-1] if out else None
        if (prev is not None and prev.name == m.name and _full_width(prev) and _full_width(m)
                and prev.start[0] + prev.shape[0] == m.start[0] and prev.offset + prev.nbytes == m.offset):
            m = prev._replace(shape=(prev.shape[0] + m.shape[0],) + m.shape[1:], nbytes=prev.nbytes + m.nbytes)
            out.pop()
        out.append(m)
    return [m._replace(full=None, start=None) if m.shape == m.full else m for m in out]


def _full_width(m: TensorMeta) -> bool:
    return m.shape[1:] == m.full[1:] and not any(m.start[1:])


def _nbytes(pc: Piece, dtype: Optional[torch.dtype]) -> int:
    n = 1
    for s in pc.shape:
        n *= s
    return n * torch.empty((), dtype=dtype if dtype is not None else pc.dtype).element_size()


def _packed(stats, bucket: FlatBucket, staging: StagingBuffer) -> None:
    if stats is not None:
        stats.packed(bucket)
        stats.max_tensor_bytes = max(stats.max_tensor_bytes, max(m.nbytes for m in bucket.metas))
        stats.live(staging.held_bytes)


def find_collector(tp_group, tp: int, holds_dst: bool, device: torch.device) -> int:
    """The TP rank (of this stage) that collects its pieces: the one whose pipeline group holds
    the destination rank (one tiny all-gather over TP)."""
    if tp == 1:
        return 0
    flags = torch.zeros(tp, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(flags, torch.tensor([int(holds_dst)], dtype=torch.int64, device=device),
                                group=tp_group)
    hits = flags.nonzero().flatten().tolist()
    if len(hits) != 1:
        raise RuntimeError(f"weight export: {len(hits)} TP ranks of this stage share the destination's pipeline "
                           f"group (expected exactly 1)")
    return hits[0]
