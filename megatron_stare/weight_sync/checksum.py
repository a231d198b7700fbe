"""Checksums of weights, so the trainer can prove what an engine holds.

``tensor_checksum``: a float64 sum and sum of squares (comparable across dtypes and devices to
round-off) and a BLAKE2b digest of the raw bytes (exact). ``compare_checksums`` lists the names
that differ.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor

from megatron_stare.weight_sync.bucket import Assembler, dtype_name

__all__ = ["TensorChecksum", "compare_checksums", "tensor_checksum"]


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


def update_verified(engine: Any, buckets: Iterable) -> int:
    """Stream ``buckets`` into ``engine`` (``update_weights_from_buckets``) while checksumming
    every tensor they carry (pieces joined first), then compare with the engine's own checksums
    of the same names. Returns the number of tensors that matched; a mismatch is one
    ``RuntimeError`` line naming the engine, the count and the first tensor."""
    expected: Dict[str, TensorChecksum] = {}
    joined = Assembler()

    def watched():
        for bucket in buckets:
            for name, tensor in joined.feed(bucket):
                expected[name] = tensor_checksum(tensor)
            yield bucket
        joined.close()

    engine.update_weights_from_buckets(watched())
    bad = compare_checksums(expected, engine.checksum(sorted(expected)))
    if bad:
        raise RuntimeError(f"weight sync: the {engine.name} engine does not hold the trainer's "
                           f"weights for {len(bad)} of {len(expected)} tensors (first: {bad[0]})")
    return len(expected)
