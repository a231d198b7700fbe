"""The one bucket format: HF-named tensors packed into one flat byte buffer plus a JSON header.

A weight sync moves a stream of ``(hf_name, tensor)`` pairs (from the Megatron streaming export,
or any state dict) to a rollout engine or a checkpoint writer. Moving them one by one costs one
collective per tensor; moving the whole model at once costs a model-sized staging copy. The
middle road, used everywhere in this project, is the *bucket* (``FlatBucket``): consecutive
tensors grouped until ``bucket_bytes`` is reached and copied into ONE contiguous ``uint8``
buffer ``[nbytes]``; every tensor starts at a multiple of ``ALIGN_BYTES``. Its header lists
``(name, dtype, shape, offset, nbytes)`` per tensor (``TensorMeta``) and is encoded as JSON
(``encode_header`` / ``decode_header``, versioned by ``HEADER_VERSION``; decoding validates
every field and fails in one line) - never pickle, so a header read off the wire cannot run
code.

Two ways to fill buckets:

* ``iter_buckets`` groups a stream lazily into lists of ``(name, tensor)`` (at most one bucket
  of producer output is held); ``FlatBucket.pack`` / ``iter_flat_buckets`` copy each list into
  a fresh buffer. For consumers that take lists (SGLang's ``update_weights_from_tensor``).
* ``pack_stream`` copies tensor by tensor into a buffer from a ``StagingBuffer`` (reused once
  the consumer dropped every view of the previous bucket), so no list of pending tensors is
  ever held: peak = one buffer + the tensor being produced. The Megatron export uses it.

A single tensor larger than ``bucket_bytes`` travels alone in a bucket of its own size - unless
the producer cuts it into *pieces*: a header entry may describe a rectangular block of a larger
tensor (``TensorMeta.full`` / ``start``: the whole tensor's shape and the block's offset in each
dim). The Megatron export does this for the weight sync (``iter_hf_buckets(pieces=True)``): every
TP rank's rows or column block of an HF tensor travels as its own piece, written straight into
the bucket buffer, and a tensor is cut wherever a bucket is full, so buckets are never larger
than ``bucket_bytes`` and the sender needs no gather buffer. A tensor's pieces are consecutive in
the stream (possibly across buckets); ``Assembler`` / ``assemble`` turn them back into whole
tensors on the receiving side.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["ALIGN_BYTES", "HEADER_VERSION", "Assembler", "FlatBucket", "StagingBuffer", "StreamCounts", "TensorMeta",
           "decode_header", "dtype_from_name", "dtype_name", "encode_header", "iter_buckets", "iter_flat_buckets",
           "assemble", "pack_stream"]

#: Every tensor starts at a multiple of this many bytes inside a flat buffer, so a typed view
#: of its bytes is legal for every dtype (and aligned for vectorised copies).
ALIGN_BYTES = 256

#: Version of the JSON header; a receiver refuses any other (both ends run the same code).
#: v2 added pieces (entries of 7 fields).
HEADER_VERSION = 2

_DTYPES: Dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
              torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
              torch.float8_e4m3fn, torch.float8_e5m2)
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the name used in bucket headers)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; ValueError for a dtype a bucket cannot carry."""
    try:
        return _DTYPES[name.removeprefix("torch.")]
    except (KeyError, AttributeError):
        raise ValueError(f"unsupported tensor dtype {name!r} in a weight bucket; "
                         f"supported: {sorted(_DTYPES)}") from None


def aligned(n: int) -> int:
    """``n`` rounded up to ``ALIGN_BYTES``."""
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def nbytes_of(t: Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class StreamCounts:
    """What passed one point of a weight stream: buckets, tensors (or pieces) and their payload
    bytes (alignment padding not counted). The exporter, the sender and the receivers count
    with the same two calls, so their figures compare."""

    num_buckets: int = 0
    num_tensors: int = 0
    bytes: int = 0

    def count_bucket(self, metas: Sequence["TensorMeta"]) -> None:
        """One bucket of ``metas`` went by."""
        self.num_buckets += 1
        self.num_tensors += len(metas)
        self.bytes += sum(m.nbytes for m in metas)

    def count_tensor(self, t: Tensor) -> None:
        """One whole tensor went by (a receiver's view, an in-process hand-off)."""
        self.num_tensors += 1
        self.bytes += nbytes_of(t)


class TensorMeta(NamedTuple):
    """Where one HF tensor (or one piece of it) lives inside a flat bucket buffer: bytes
    ``[offset, offset+nbytes)``, row-major, of ``shape``.

    A piece has ``full`` (the whole tensor's shape) and ``start`` (the block's first index in
    each dim): it is ``whole[start[0]:start[0]+shape[0], start[1]:start[1]+shape[1], ...]``.
    Both are None for a whole tensor.
    """

    name: str
    dtype: str
    shape: Tuple[int, ...]
    offset: int
    nbytes: int
    full: Optional[Tuple[int, ...]] = None
    start: Optional[Tuple[int, ...]] = None

    @property
    def is_piece(self) -> bool:
        return self.full is not None


def encode_header(metas: Sequence[TensorMeta]) -> bytes:
    """The header as compact JSON bytes: ``{"v": HEADER_VERSION, "tensors": [[name, dtype,
    shape, offset, nbytes(, full, start)], ...]}`` (the last two for pieces only)."""
    rows = []
    for m in metas:
        row = [m.name, m.dtype, list(m.shape), m.offset, m.nbytes]
        if m.full is not None:
            row += [list(m.full), list(m.start)]
        rows.append(row)
    return json.dumps({"v": HEADER_VERSION, "tensors": rows}, separators=(",", ":")).encode()


def decode_header(data: bytes, data_bytes: Optional[int] = None) -> List[TensorMeta]:
    """Parse and validate a header; ``data_bytes``: the buffer size every tensor must fit in.
    Raises ValueError in one line naming what is wrong."""
    def bad(why: str) -> ValueError:
        return ValueError(f"weight bucket header rejected: {why} (sender and receiver must run the "
                          f"same megatron_stare version, header v{HEADER_VERSION})")
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"not JSON ({e})") from None
    if not isinstance(obj, dict) or "v" not in obj:
        raise bad("no version field")
    if obj["v"] != HEADER_VERSION:
        raise bad(f"version {obj['v']!r}, expected {HEADER_VERSION}")
    metas, end = [], 0
    for i, row in enumerate(obj.get("tensors", [])):
        if not (isinstance(row, list) and len(row) in (5, 7) and isinstance(row[0], str)
                and all(isinstance(x, list) for x in (row[2], *row[5:]))
                and all(isinstance(v, int) and v >= 0 for v in (*row[2], row[3], row[4], *sum(row[5:], [])))):
            raise bad(f"entry {i} is not [name, dtype, shape, offset, nbytes] or a piece "
                      f"[name, dtype, shape, offset, nbytes, full shape, start]")
        name, dtype, shape, offset, nb = row[:5]
        full = start = None
        if len(row) == 7:
            full, start = tuple(row[5]), tuple(row[6])
            if not (len(full) == len(start) == len(shape)
                    and all(a + n <= f for a, n, f in zip(start, shape, full))):
                raise bad(f"{name!r}: piece of shape {shape} at {list(start)} does not lie inside {list(full)}")
        try:
            esize = torch.empty((), dtype=dtype_from_name(dtype)).element_size()
        except ValueError as e:
            raise bad(f"{name!r}: {e}") from None
        if nb != esize * _numel(shape):
            raise bad(f"{name!r}: {nb} bytes do not hold a {dtype} tensor of shape {shape}")
        if offset < end or (nb and offset % ALIGN_BYTES):
            raise bad(f"{name!r}: offset {offset} overlaps the previous tensor or is not {ALIGN_BYTES}-aligned")
        end = offset + nb
        if data_bytes is not None and end > data_bytes:
            raise bad(f"{name!r}: bytes [{offset}, {end}) lie outside the {data_bytes}-byte buffer")
        metas.append(TensorMeta(name, dtype, tuple(shape), offset, nb, full, start))
    return metas


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass
class FlatBucket:
    """Several HF tensors packed into one contiguous ``uint8`` buffer ``[nbytes]``.

    ``metas`` are in stream order, offsets increasing and ``ALIGN_BYTES``-aligned. Iterating
    yields ``(name, view)`` pairs, views into ``buffer`` (no copy): a consumer that keeps them
    keeps the whole buffer.
    """

    metas: List[TensorMeta]
    buffer: Tensor

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel())

    def __len__(self) -> int:
        return len(self.metas)

    def __iter__(self) -> Iterator[Tuple[str, Tensor]]:
        return self.tensors()

    def tensors(self) -> Iterator[Tuple[str, Tensor]]:
        """``(name, view)`` for every tensor, views into ``buffer`` with the original shape.
        A bucket holding pieces refuses (ValueError): read it with ``Assembler`` / ``assemble``."""
        if any(m.full is not None for m in self.metas):
            raise ValueError("this bucket holds pieces of tensors (a weight-sync export with pieces=True): "
                             "read it with weight_sync.assemble(buckets), not tensor by tensor")
        for m, view in self.entries():
            yield m.name, view

    def entries(self) -> Iterator[Tuple[TensorMeta, Tensor]]:
        """``(meta, view)`` for every entry, whole tensors and pieces alike (no copy)."""
        for m in self.metas:
            flat = self.buffer[m.offset:m.offset + m.nbytes]
            yield m, flat.view(dtype_from_name(m.dtype)).reshape(m.shape)

    def header(self) -> bytes:
        """``encode_header(self.metas)``: what a byte transport sends before the buffer."""
        return encode_header(self.metas)

    @classmethod
    def pack(cls, named: Sequence[Tuple[str, Tensor]], device: Optional[torch.device] = None,
             out: Optional[Tensor] = None) -> "FlatBucket":
        """Copy ``named`` tensors into ``out`` (uint8, at least ``layout``'s bytes) or a fresh
        buffer on ``device`` (default: the first tensor's)."""
        metas, nbytes = cls.layout(named)
        if out is None:
            device = device if device is not None else named[0][1].device
            out = torch.empty(nbytes, dtype=torch.uint8, device=device)
        buffer = out[:nbytes]
        for (_, t), m in zip(named, metas):
            copy_into(buffer, m.offset, t)
        return cls(metas, buffer)

    @staticmethod
    def layout(named: Sequence[Tuple[str, Tensor]]) -> Tuple[List[TensorMeta], int]:
        """``(metas, buffer bytes)`` that ``pack`` would produce, without allocating."""
        if not named:
            raise ValueError("cannot pack an empty bucket")
        metas, offset = [], 0
        for name, t in named:
            nb = nbytes_of(t)
            metas.append(TensorMeta(name, dtype_name(t.dtype), tuple(t.shape), offset, nb))
            offset = aligned(offset + nb)
        return metas, offset


def copy_into(buffer: Tensor, offset: int, t: Tensor) -> None:
    """Copy ``t``'s bytes (row-major) into ``buffer[offset:]``."""
    n = nbytes_of(t)
    if n:
        buffer[offset:offset + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))


class StagingBuffer:
    """``uint8`` buffers handed out again and again while nobody else holds a view of them.

    ``get(n)`` returns ``n`` bytes: a slice of a held buffer that is large enough and of which
    every view handed out earlier is gone (fresh pages cost ~1.7x in page faults on CPU);
    otherwise, once ``slots`` buffers are held, it drops its own reference to one FIRST (a free
    one, else the oldest: that one then dies with its consumer's last view) and allocates
    exactly ``n``. ``slots=2`` lets a consumer keep one bucket in flight (an async send) while
    the next is filled, without a fresh allocation per bucket. Peak: ``slots`` buffers, plus any
    a consumer still holds.
    """

    def __init__(self, device: torch.device, slots: int = 1):
        if slots < 1:
            raise ValueError(f"a StagingBuffer needs at least one slot, got {slots}")
        self.device, self.slots = device, slots
        self._bufs: List[Tensor] = []
        self.allocations = 0  # buffers allocated over this object's life (tests, benchmarks)

    def get(self, n: int) -> Tensor:
        free = [i for i, b in enumerate(self._bufs) if _sole_owner(b)]
        for i in free:
            if self._bufs[i].numel() >= n:
                return self._bufs[i][:n]
        if len(self._bufs) >= self.slots:
            del self._bufs[free[0] if free else 0]
        self.allocations += 1
        self._bufs.append(torch.empty(n, dtype=torch.uint8, device=self.device))
        return self._bufs[-1][:n]

    @property
    def held_bytes(self) -> int:
        return sum(int(b.numel()) for b in self._bufs)

    def release(self) -> None:
        self._bufs = []


def _sole_owner(t: Tensor) -> bool:
    """True when ``t`` (held in one variable by the caller) is the only reference to its storage:
    no view of it survives anywhere. Conservative: False when the count cannot be read."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)  # noqa: SLF001 - no public API
    if use_count is None:
        return False
    # One reference from t itself, one from the temporary storage object made here.
    return use_count(t.untyped_storage()._cdata) <= 2


def iter_buckets(named_tensors: Iterable[Tuple[str, Tensor]], bucket_bytes: int
                 ) -> Iterator[List[Tuple[str, Tensor]]]:
    """Group a stream of ``(name, tensor)`` into consecutive lists of at most ``bucket_bytes``.

    Lazy: the producer is advanced only while the current bucket has room, so at most one
    bucket's worth of produced tensors is held here. A tensor larger than ``bucket_bytes`` is
    yielded alone. Byte counts include the ``ALIGN_BYTES`` padding a flat buffer would use, so
    ``FlatBucket.pack`` of a yielded list never exceeds ``max(bucket_bytes, largest tensor)``
    rounded up to the alignment.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: List[Tuple[str, Tensor]] = []
    size = 0
    seen = set()
    for name, t in named_tensors:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in one weight stream")
        seen.add(name)
        nb = aligned(nbytes_of(t))
        if bucket and size + nb > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nb
    if bucket:
        yield bucket


def iter_flat_buckets(named_tensors: Iterable[Tuple[str, Tensor]], bucket_bytes: int,
                      device: Optional[torch.device] = None) -> Iterator[FlatBucket]:
    """``iter_buckets`` followed by ``FlatBucket.pack``: one fresh flat buffer per bucket."""
    for bucket in iter_buckets(named_tensors, bucket_bytes):
        yield FlatBucket.pack(bucket, device)


def pack_stream(named_tensors: Iterable[Tuple[str, Tensor]], bucket_bytes: int, device: torch.device, *,
                size_bound: Optional[int] = None, staging: Optional[StagingBuffer] = None,
                on_copy: Optional[Callable[[int, int], None]] = None) -> Iterator[FlatBucket]:
    """Copy a stream tensor by tensor into flat buckets of at most ``max(bucket_bytes, largest
    tensor)`` bytes, buffers from one ``StagingBuffer`` (reused when the consumer let go).

    ``size_bound``: an upper bound of the stream's aligned bytes, so a small model never
    allocates a full ``bucket_bytes`` buffer. ``on_copy(tensor bytes, buffer bytes)`` is called
    after each copy (for memory accounting). ``staging``: where buffers come from (default: a
    one-slot ``StagingBuffer``; two slots for a consumer that sends a bucket while the next is
    packed).
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    # Without a bound, every buffer is a full bucket (not: the first one eats the budget).
    remaining = size_bound if size_bound is not None else float("inf")
    staging = staging if staging is not None else StagingBuffer(device)
    flat, metas, used = None, [], 0
    for name, t in named_tensors:
        n = nbytes_of(t)
        if flat is not None and used + n > flat.numel():
            bucket = FlatBucket(metas, flat[:used])
            flat, metas, used = None, [], 0
            yield bucket
            del bucket  # hold no view while the next buffer is requested
        if flat is None:
            flat = staging.get(int(max(min(bucket_bytes, remaining), n)))
        copy_into(flat, used, t)
        metas.append(TensorMeta(name, dtype_name(t.dtype), tuple(t.shape), used, n))
        remaining -= aligned(n)
        used = min(aligned(used + n), flat.numel())
        if on_copy is not None:
            on_copy(n, flat.numel())
        del t  # not held while the producer makes the next tensor
    if metas:
        bucket = FlatBucket(metas, flat[:used])
        flat = None
        yield bucket


class Assembler:
    """Whole tensors from a stream of bucket entries, pieces included.

    ``feed(bucket)`` yields ``(name, tensor)``: a whole tensor as the bucket's own view (no
    copy), a pieced one once its last piece arrived (its pieces must be consecutive in the
    stream, in any order, and cover it exactly once). Pieced tensors are joined in one buffer
    reused while the consumer keeps no view of the previous one (a consumer that keeps tensors
    gets fresh ones). Extra memory: the one tensor being assembled. ``close()`` fails if the
    stream ended inside a tensor.
    """

    def __init__(self):
        self._name: Optional[str] = None
        self._full: Optional[Tensor] = None
        self._left = 0
        self._staging: Optional[StagingBuffer] = None
        self.seconds = 0.0  # spent copying pieces into joined tensors

    def feed(self, bucket: "FlatBucket") -> Iterator[Tuple[str, Tensor]]:
        for m, view in bucket.entries():
            if m.full is None:
                self._expect_none(m.name)
                yield m.name, view
                continue
            if self._full is None:
                self._name, self._left = m.name, _numel(m.full)
                if self._staging is None or self._staging.device != view.device:
                    self._staging = StagingBuffer(view.device)
                nbytes = self._left * view.element_size()
                self._full = self._staging.get(nbytes).view(view.dtype).view(m.full)
            elif m.name != self._name or m.full != tuple(self._full.shape) or view.dtype != self._full.dtype:
                raise ValueError(f"weight stream: piece of {m.name!r} {m.dtype}{list(m.full)} arrived while "
                                 f"{self._name!r} was incomplete ({self._left} elements missing)")
            t0 = time.perf_counter()
            self._full[tuple(slice(a, a + n) for a, n in zip(m.start, m.shape))].copy_(view)
            self.seconds += time.perf_counter() - t0
            self._left -= view.numel()
            del view
            if self._left < 0:
                raise ValueError(f"weight stream: the pieces of {self._name!r} overlap (more elements than it has)")
            if self._left == 0:
                name, full = self._name, self._full
                self._name = self._full = None
                yield name, full
                del full

    def close(self) -> None:
        if self._full is not None:
            self._expect_none("the end of the stream")

    def _expect_none(self, what: str) -> None:
        if self._full is not None:
            raise ValueError(f"weight stream: {what} arrived while {self._name!r} was incomplete "
                             f"({self._left} elements missing)")


def assemble(buckets: Iterable) -> Iterator[Tuple[str, Tensor]]:
    """``(name, whole tensor)`` for every tensor of a stream of ``FlatBucket``s (pieces joined by
    an ``Assembler``; whole tensors are views into their bucket). Other buckets (iterables of
    ``(name, tensor)``) pass through."""
    asm = Assembler()
    for bucket in buckets:
        if isinstance(bucket, FlatBucket):
            yield from asm.feed(bucket)
        else:
            yield from bucket
        del bucket
    asm.close()
