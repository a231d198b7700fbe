"""Checkpoint manifests: each file's size and SHA-256, written and checked by all ranks together.

A checkpoint's ``COMPLETE`` marker holds the manifest ``{"step", "format": 2, "files": {name:
{"size", "sha256"}}}`` (format 1, from older saves, has sizes only and is checked by size).
Both directions are collective over the world and share the work: rank 0 lists the files (or
reads the manifest) and broadcasts it; each rank hashes a share of the files: the files it wrote
itself where the name says so (``rank_<r>.pt``, torch's ``__<r>_<n>.distcp``; their bytes are
still in its page cache after a save), the rest balanced by size; the ranks then exchange
digests (saving) or verdicts (loading).

The verdict is the same on every rank: the first damaged file in manifest order, or none. A
rank's own verdict could split the job (one rank resuming step N, another falling back to an
earlier one, each then waiting in a different collective).

Cost: SHA-256 (hashlib, SHA-NI) ran at ~800 MiB/s on one busy core of the project's CPU machine,
0.7x the time of writing the same bytes there (``benchmarks/bench_checkpoint_hash.py``); BLAKE2b
was slower (550 MiB/s). Saving, the tensor files (nearly all the bytes) are not read back: their
writer processes hashed the bytes as they wrote them (``checkpoint_writer``), in the background
with ``checkpoint.async_save``; only the small files are read. A resume reads everything once.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist

from megatron_stare.checkpoint.writer import HASH_SUFFIX, written_sha256

COMPLETE = "COMPLETE"
FORMAT = 2
#: Files a rank writes itself, by name: that rank hashes them (global rank in group 1).
_WRITER = (re.compile(r"(?:^|/)rank_(\d+)\.pt$"), re.compile(r"(?:^|/)__(\d+)_\d+\.distcp$"))


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _rank_world() -> Tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if _rank_world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _from_all(obj: Any) -> List[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    world = _rank_world()[1]
    if world == 1:
        return [obj]
    out: List[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def first_problem(problem: Optional[str]) -> Optional[str]:
    """Collective: the lowest rank's problem as ``"rank r: problem"``, or None; the same on
    every rank, so all raise the same error (or none) before the next collective."""
    for r, p in enumerate(_from_all(problem)):
        if p:
            return f"rank {r}: {p}"
    return None


def shares(sizes: Dict[str, int], world: int) -> List[List[str]]:
    """Which rank hashes which file: writers their own files, the rest largest first to the
    least-loaded rank (ties to the lower rank). Deterministic in ``sizes``."""
    out: List[List[str]] = [[] for _ in range(world)]
    load = [0] * world
    rest = []
    for name, size in sizes.items():
        owner = next((int(m.group(1)) for rx in _WRITER if (m := rx.search(name))), None)
        if owner is not None and owner < world:
            out[owner].append(name)
            load[owner] += size
        else:
            rest.append(name)
    for name in sorted(rest, key=lambda n: (-sizes[n], n)):
        r = min(range(world), key=lambda i: (load[i], i))
        out[r].append(name)
        load[r] += sizes[name]
    return out


def _listing(d: Path) -> Dict[str, int]:
    return {str(p.relative_to(d)): p.stat().st_size for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != COMPLETE and not p.name.endswith((".tmp", HASH_SUFFIX))}


def _digest(path: Path, read_back: List[int]) -> str:
    """The writer's digest of ``path`` (``checkpoint_writer``: computed as it wrote the bytes;
    its sidecar removed), else the file read back and hashed (its size added to ``read_back``)."""
    digest = written_sha256(path)
    Path(str(path) + HASH_SUFFIX).unlink(missing_ok=True)
    if digest is None:
        read_back[0] += path.stat().st_size
        digest = file_sha256(path)
    return digest


def write_manifest(d: Path, step: int) -> Dict[str, int]:
    """Collective: hash every file under ``d`` (each rank its share); rank 0 writes ``d/COMPLETE``
    atomically. Call when every rank has finished writing into ``d``. The tensor files come with
    the digest their writer computed as it wrote them: only the rest is read back. Returns
    ``{"bytes": all files, "read_back": bytes this rank read to hash them}``."""
    rank, world = _rank_world()
    sizes = from_rank0(_listing(d) if rank == 0 else None)
    read_back = [0]
    mine = {name: _digest(d / name, read_back) for name in shares(sizes, world)[rank]}
    digests: Dict[str, str] = {}
    for part in _from_all(mine):
        digests.update(part)
    if rank == 0:
        files = {name: {"size": sizes[name], "sha256": digests[name]} for name in sorted(sizes)}
        tmp = d / (COMPLETE + ".tmp")
        tmp.write_text(json.dumps({"step": step, "format": FORMAT, "files": files}))
        os.replace(tmp, d / COMPLETE)
    return {"bytes": sum(sizes.values()), "read_back": read_back[0]}


def _read_manifest(d: Path) -> Tuple[Optional[Dict[str, dict]], Optional[str]]:
    """``(files, None)``, or ``(None, problem)``; sizes-only entries become ``{"size": n}``."""
    marker = d / COMPLETE
    if not marker.is_file():
        return None, f"{marker} is missing (the save did not finish)"
    try:
        files = json.loads(marker.read_text())["files"]
        return {n: v if isinstance(v, dict) else {"size": int(v)} for n, v in files.items()}, None
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        return None, f"{marker} is not a valid manifest ({type(e).__name__}: {e})"


def _check(d: Path, name: str, entry: dict) -> Optional[str]:
    path = d / name
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    if size != entry["size"]:
        return f"{path} has {size} bytes, the manifest says {entry['size']} (cut short or replaced)"
    if "sha256" in entry and file_sha256(path) != entry["sha256"]:
        return f"{path} does not match its SHA-256 in the manifest (changed after the save)"
    return None


def verify(d: Path) -> Optional[str]:
    """Collective: None if ``d``'s files match its manifest in size and content, else one line
    naming the first damaged file (manifest order) and why. The same on every rank."""
    rank, world = _rank_world()
    files, problem = from_rank0(_read_manifest(d) if rank == 0 else None)
    if problem is not None:
        return problem
    found = {}
    for name in shares({n: e["size"] for n, e in files.items()}, world)[rank]:
        if (p := _check(d, name, files[name])) is not None:
            found[name] = p
    bad = {}
    for part in _from_all(found):
        bad.update(part)
    return bad[min(bad)] if bad else None


def manifest_step(d: Path) -> Optional[int]:
    """The step ``d``'s manifest records, or None (no manifest: the save did not finish, or an
    unreadable one). One process reads it; no collective, nothing verified."""
    try:
        return int(json.loads((Path(d) / COMPLETE).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None
