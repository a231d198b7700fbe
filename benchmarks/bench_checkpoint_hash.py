"""What a content checksum adds to a checkpoint save: hashing vs writing the same files.

Writes a per-rank checkpoint share like the trainer's (``torch.save`` of fp32 optimizer-like
state: for ``--params-m`` million parameters, the fp32 main weights and Adam's two moments,
12 bytes per parameter, plus a bf16 copy of the weights), then times, side by side, writing it
(``torch.save`` + fsync), hashing it right after (the bytes are in the page cache, as in a save)
with SHA-256 and BLAKE2b (``hashlib.file_digest``), and re-reading it without hashing (the floor
of any verification). Prints medians of ``--repeats`` and each hash's cost relative to the write.

A 32B run at TP 8 x PP 2 with the optimizer sharded over 2 ranks holds ~2B parameters per rank:
~24 GB of optimizer state per rank per save; ``--params-m 2000`` measures that share (needs the
disk and ~30 GB of page cache to be representative); the default is a 1/10 slice of it.

Usage: ``python benchmarks/bench_checkpoint_hash.py [--params-m 200] [--repeats 3] [--dir /tmp]``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _write(path: Path, state: dict) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _hash(path: Path, algo: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, algo).hexdigest()


def _read(path: Path) -> int:
    n = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(1 << 20):
            n += len(chunk)
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params-m", type=float, default=200.0, help="millions of parameters in the share")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    n = int(args.params_m * 1e6)
    g = torch.Generator().manual_seed(0)
    state = {"param": torch.randn(n, generator=g), "exp_avg": torch.randn(n, generator=g),
             "exp_avg_sq": torch.rand(n, generator=g), "model_bf16": torch.randn(n, generator=g).bfloat16()}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = Path(d) / "rank_00000.pt"
        times = {"write": [], "sha256": [], "blake2b": [], "read": []}
        digests = set()
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            _write(path, state)
            times["write"].append(time.perf_counter() - t0)
            for algo in ("sha256", "blake2b"):
                t0 = time.perf_counter()
                digests.add((algo, _hash(path, algo)))
                times[algo].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            size = _read(path)
            times["read"].append(time.perf_counter() - t0)
        assert len(digests) == 2, "torch.save of the same state gave different bytes"
    mb = size / 2 ** 20
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"share: {mb:.0f} MiB ({args.params_m:g}M params), medians of {args.repeats}")
    for k in ("write", "sha256", "blake2b", "read"):
        rel = "" if k == "write" else f"  = {med[k] / med['write']:.2f} x the write"
        print(f"  {k:8s} {med[k]:7.2f} s  {mb / med[k]:8.0f} MiB/s{rel}")


if __name__ == "__main__":
    main()
