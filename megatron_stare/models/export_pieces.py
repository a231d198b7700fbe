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
from typing import Iterator, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_stare.models.sharding import full_shape, is_glu_fc1, local_params
from megatron_stare.weight_sync import FlatBucket, Pending, StagingBuffer, TensorMeta, dtype_name
from megatron_stare.weight_sync.bucket import aligned


@dataclass(frozen=True)
class Piece:
    """Rows of one HF tensor that one TP rank holds contiguously.

    The piece is ``hf[start[0]:start[0]+shape[0], start[1]:start[1]+shape[1], ...]`` of the HF
    tensor ``name`` of shape ``full``; its bytes are ``src`` (this rank's rows of the local
    parameter) on the owner, ``None`` elsewhere. ``owner`` is the TP rank that holds them, or
    ``None`` when every TP rank holds the same rows (a replicated parameter).
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


def stage_pieces(model, mapping, tp: int, tp_rank: int, glu: bool = True) -> List[Piece]:
    """This stage's HF tensors as pieces (see the module docstring), in export order: parameter
    by parameter, HF tensor by HF tensor, rows in order. Every TP rank gets the same list (with
    ``src`` only on the owner)."""
    out: List[Piece] = []
    for local, canon, p in local_params(model):
        w = p.detach()
        split = tp > 1 and getattr(p, "tensor_model_parallel", False)
        dim = p.partition_dim if split else None
        for hf in mapping.hf_rows(canon, full_shape(p, tp)):
            zeros = (0,) * (len(hf.shape) - 1)
            for hf_row, c_row, n in hf.runs:
                if dim is None:
                    out.append(Piece(hf.name, hf.shape, (hf_row,) + zeros, (n,) + tuple(hf.shape[1:]), p.dtype,
                                     None, w[c_row:c_row + n]))
                elif dim == 1:
                    cols = p.shape[1]
                    for r in range(tp):
                        out.append(Piece(hf.name, hf.shape, (hf_row, r * cols) + zeros[1:],
                                         (n, cols) + tuple(hf.shape[2:]), p.dtype, r,
                                         w[c_row:c_row + n] if r == tp_rank else None))
                elif dim == 0:
                    for off, owner, lrow, m in _dim0_runs(c_row, n, p.shape[0], tp, glu and is_glu_fc1(local)):
                        out.append(Piece(hf.name, hf.shape, (hf_row + off,) + zeros, (m,) + tuple(hf.shape[1:]),
                                         p.dtype, owner, w[lrow:lrow + m] if owner == tp_rank else None))
                else:
                    raise ValueError(f"{canon}: tensor-parallel split along dim {dim} is not supported by the "
                                     f"piece export")
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
                  tp_ranks: List[int], tp_rank: int, collector: int, staging: StagingBuffer,
                  stats=None) -> Iterator[FlatBucket]:
    """On TP rank ``collector``: yield this stage's buckets (``FlatBucket``s of at most
    ``bucket_bytes``, pieces written in place). On the other TP ranks: send the pieces they own
    to the collector, bucket by bucket; yields nothing. Every TP rank of the stage must iterate
    to the end (point-to-point transfers inside). ``tp_ranks``: the TP group's global ranks in
    TP-rank order. ``stats``: an ``export.ExportStats`` (the wait for other ranks' pieces counts
    as gather, local copies as pack).

    Per bucket, the collector posts a receive for every remote piece first, copies its own
    pieces while they arrive, then waits: the transfers overlap each other and the copies.
    """
    me_collects = tp_rank == collector
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
                pending.append(Pending(dest, lambda x, src=tp_ranks[owner]: dist.irecv(x, src=src)))
            elif tp_rank == owner:
                rows = c.piece.src[c.r0:c.r0 + c.n].to(c.dtype).contiguous()
                pending.append(Pending(rows, lambda x: dist.isend(x, dst=tp_ranks[collector])))
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
