"""Bucketing of HF-named tensors into flat byte buffers, and per-tensor checksums.

A weight sync moves a stream of ``(hf_name, tensor)`` pairs (from the Megatron streaming export,
or any state dict) to a rollout engine. Moving them one by one costs one collective per tensor;
moving the whole model at once costs a model-sized staging copy. The middle road, used here, is
the *bucket*: consecutive tensors grouped until ``bucket_bytes`` is reached and, for transports
that move bytes, flattened into ONE contiguous ``uint8`` buffer plus a metadata list of
``(name, dtype, shape, offset)``.

``iter_buckets`` is lazy: it pulls tensors from the producer only as far as the bucket being
filled, so at most one bucket of producer output is alive at a time (plus the producer's own
state). A single tensor larger than ``bucket_bytes`` travels alone in a bucket of its size.

Checksums (``tensor_checksum``) let the trainer prove what an engine holds: a float64 sum and
sum of squares (comparable across dtypes and devices to round-off) and a BLAKE2b digest of the
raw bytes (exact).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = [
    "ALIGN_BYTES",
    "FlatBucket",
    "TensorChecksum",
    "TensorMeta",
    "compare_checksums",
    "iter_buckets",
    "iter_flat_buckets",
    "tensor_checksum",
]

#: Every tensor starts at a multiple of this many bytes inside a flat buffer, so a typed view
#: of its bytes is legal for every dtype (and aligned for vectorised copies).
ALIGN_BYTES = 256

_DTYPES: Dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
              torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
              torch.float8_e4m3fn, torch.float8_e5m2)
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the name used in bucket metadata)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; ValueError for a dtype a bucket cannot carry."""
    try:
        return _DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported tensor dtype {name!r} in a weight bucket; "
                         f"supported: {sorted(_DTYPES)}") from None


def _aligned(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


@dataclass(frozen=True)
class TensorMeta:
    """Where one HF tensor lives inside a flat bucket buffer: bytes ``[offset, offset+nbytes)``."""

    name: str
    dtype: str
    shape: Tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class FlatBucket:
    """Several HF tensors packed into one contiguous ``uint8`` buffer ``[nbytes]``.

    ``metas`` are in stream order, offsets increasing and ``ALIGN_BYTES``-aligned. ``tensors()``
    returns views into ``buffer`` (no copy): a consumer that keeps them keeps the whole buffer.
    """

    metas: List[TensorMeta]
    buffer: Tensor

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel())

    @classmethod
    def pack(cls, named: Sequence[Tuple[str, Tensor]], device: Optional[torch.device] = None
             ) -> "FlatBucket":
        """Copy ``named`` tensors into one fresh buffer on ``device`` (default: the first's)."""
        metas, nbytes = cls.layout(named)
        device = device if device is not None else named[0][1].device
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        for (_, t), m in zip(named, metas):
            if m.nbytes:
                src = t.detach().contiguous().reshape(-1).view(torch.uint8)
                buffer[m.offset:m.offset + m.nbytes].copy_(src)
        return cls(metas, buffer)

    @staticmethod
    def layout(named: Sequence[Tuple[str, Tensor]]) -> Tuple[List[TensorMeta], int]:
        """``(metas, buffer bytes)`` that ``pack`` would produce, without allocating."""
        if not named:
            raise ValueError("cannot pack an empty bucket")
        metas, offset = [], 0
        for name, t in named:
            nb = t.numel() * t.element_size()
            metas.append(TensorMeta(name, dtype_name(t.dtype), tuple(t.shape), offset, nb))
            offset = _aligned(offset + nb)
        return metas, offset

    def tensors(self) -> Iterator[Tuple[str, Tensor]]:
        """``(name, view)`` for every tensor, views into ``buffer`` with the original shape."""
        for m in self.metas:
            flat = self.buffer[m.offset:m.offset + m.nbytes]
            yield m.name, flat.view(dtype_from_name(m.dtype)).reshape(m.shape)

    def metadata_bytes(self) -> bytes:
        """The metadata list as compact JSON bytes (what a byte transport sends first)."""
        return json.dumps([[m.name, m.dtype, list(m.shape), m.offset, m.nbytes]
                           for m in self.metas], separators=(",", ":")).encode()

    @staticmethod
    def metas_from_bytes(data: bytes) -> List[TensorMeta]:
        return [TensorMeta(n, d, tuple(s), o, b) for n, d, s, o, b in json.loads(data)]


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


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
        nb = _aligned(_nbytes(t))
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


@dataclass(frozen=True)
class TensorChecksum:
    """Checksum of one tensor as an engine or trainer holds it.

    ``sum`` / ``sumsq``: float64 sum and sum of squares of the values (agree to round-off
    across dtypes, devices and reduction orders). ``digest``: BLAKE2b-128 of the raw bytes in
    row-major order (exact; equal only for the same dtype and values). ``source`` says where an
    engine read it: ``"live"`` (the parameter it computes with) or ``"received"`` (recorded when
    the bytes were loaded, for parameters the engine cannot read back, e.g. repacked or fused).
    """

    sum: float
    sumsq: float
    digest: str
    shape: Tuple[int, ...]
    dtype: str
    source: str = "live"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "TensorChecksum":
        return cls(**{**d, "shape": tuple(d["shape"])})


@torch.no_grad()
def tensor_checksum(t: Tensor, source: str = "live") -> TensorChecksum:
    """The :class:`TensorChecksum` of ``t`` (any device; the digest reads bytes on CPU)."""
    t = t.detach()
    x = t.to(torch.float64)
    raw = t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes() if t.numel() else b""
    return TensorChecksum(
        sum=float(x.sum()), sumsq=float((x * x).sum()),
        digest=hashlib.blake2b(raw, digest_size=16).hexdigest(),
        shape=tuple(t.shape), dtype=dtype_name(t.dtype), source=source,
    )


def compare_checksums(expected: Dict[str, TensorChecksum], got: Dict[str, Optional[TensorChecksum]],
                      *, exact: bool = True, rtol: float = 1e-6) -> List[str]:
    """Names whose checksum differs (or is missing in ``got``); empty list means all match.

    ``exact``: compare digests (same dtype required). Otherwise compare shape and sum / sumsq
    to relative tolerance ``rtol`` (for an engine running in another dtype).
    """
    bad = []
    for name, e in expected.items():
        g = got.get(name)
        if g is None or tuple(g.shape) != tuple(e.shape):
            bad.append(name)
        elif exact:
            if g.digest != e.digest:
                bad.append(name)
        elif (abs(g.sum - e.sum) > rtol * max(1.0, abs(e.sum))
              or abs(g.sumsq - e.sumsq) > rtol * max(1.0, abs(e.sumsq))):
            bad.append(name)
    return bad
