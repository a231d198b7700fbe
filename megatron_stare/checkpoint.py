"""Training checkpoints: everything needed to resume a run exactly, written atomically.

A checkpoint is a directory ``<dir>/step_<N>/``:

- ``model/``: the policy weights as a layout-independent megatron-core distributed checkpoint
  (``models.dist_ckpt``), loadable at any TP/PP/DP layout and by ``checkpoints_convert``;
- ``optimizer/``: Megatron's sharded optimizer state (Adam moments, fp32 main params of bf16
  weights, step) and the LR schedule, also a distributed checkpoint. The plain optimizer's state
  loads at any layout; the distributed optimizer's at any DP degree with the same TP/PP;
- ``rank_<r>.pt``: this rank's RNG states (torch CPU/CUDA, Python, NumPy, Megatron's tracker)
  and its layout. They are restored only at the saved layout (elsewhere the RNG streams differ
  by construction, and the run says so);
- ``trainer_state.json``: step, data cursor, STARE controller, GEPO history, counters;
- ``COMPLETE``: written last, holding the manifest (files and sizes).

Writers fill ``.step_<N>.partial/``; rank 0 renames it to ``step_<N>/`` only after every rank
has finished, so a crash at any point leaves either the previous checkpoint or a ``.partial``
directory that is ignored. ``latest_complete`` also skips a ``step_<N>`` whose manifest does
not match its files (a torn copy), warning about it, and resumes from the last good one.

Resume loads the weights, refreshes the optimizer's main params from them, then loads the
optimizer state (whose saved fp32 main params win where they exist): the first step after a
resume continues from the resumed weights and moments, never from the optimizer's init.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import numpy as np
import torch
import torch.distributed as dist

COMPLETE = "COMPLETE"
STATE = "trainer_state.json"
_STEP_RE = re.compile(r"^step_(\d+)$")
PathLike = Union[str, Path]


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; one line naming it and why."""


def rng_state() -> Dict[str, Any]:
    from megatron.core import tensor_parallel

    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": np.random.get_state(),
             "tracker": {k: v.clone() if isinstance(v, torch.Tensor) else v
                         for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _manifest(d: Path) -> Dict[str, int]:
    return {str(p.relative_to(d)): p.stat().st_size for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != COMPLETE}


def is_complete(d: Path) -> bool:
    """True when ``d`` has a COMPLETE marker whose manifest matches the files on disk."""
    marker = d / COMPLETE
    if not marker.is_file():
        return False
    try:
        expected = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError):
        return False
    actual = _manifest(d)
    return all(actual.get(name) == size for name, size in expected.items())


def list_checkpoints(root: PathLike) -> List[Path]:
    """``step_<N>`` directories under ``root``, oldest first (complete or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_RE.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest_complete(root: PathLike) -> Optional[Path]:
    """The newest complete checkpoint under ``root``; torn ones are reported and skipped."""
    for d in reversed(list_checkpoints(root)):
        if is_complete(d):
            return d
        warnings.warn(f"checkpoint {d} is incomplete or damaged (no valid {COMPLETE} manifest); "
                      f"falling back to an earlier one", stacklevel=2)
    return None


def save_checkpoint(root: PathLike, step: int, *, actor, groups, spec, trainer_state: Dict[str, Any],
                    keep_last: int = 3, hf_config: Optional[dict] = None) -> Path:
    """Save step ``step`` (collective over all ranks); prune to the newest ``keep_last``."""
    from megatron_stare.models.dist_ckpt import save_model, save_optimizer

    root = Path(root).absolute()
    final = root / f"step_{step:08d}"
    tmp = root / f".step_{step:08d}.partial"
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    dist.barrier()
    save_model(actor.model, groups, tmp / "model", spec, hf_config=hf_config)
    save_optimizer(actor.optimizer, actor.scheduler, actor.model, groups, tmp / "optimizer", spec)
    per_rank = {"rng": rng_state(), "layout": vars(groups.layout).copy()}
    part = tmp / f"rank_{dist.get_rank():05d}.pt"
    torch.save(per_rank, str(part) + ".tmp")
    os.replace(str(part) + ".tmp", part)
    dist.barrier()
    if dist.get_rank() == 0:
        (tmp / STATE).write_text(json.dumps(trainer_state, indent=1, default=_json_default))
        marker = tmp / (COMPLETE + ".tmp")
        marker.write_text(json.dumps({"step": step, "files": _manifest(tmp)}))
        os.replace(marker, tmp / COMPLETE)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def _json_default(x):
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def load_checkpoint(ckpt: PathLike, *, actor, groups, spec, load_optimizer: bool = True) -> Dict[str, Any]:
    """Restore weights and (``load_optimizer``) optimizer state and LR schedule, and at the saved
    layout the RNG states; returns the trainer state. Collective over all ranks.

    Weights load at any layout; optimizer state as ``models.dist_ckpt.load_optimizer`` allows.
    Without ``load_optimizer`` the optimizer keeps its fresh state but its main params follow the
    loaded weights.
    """
    from megatron_stare.models.dist_ckpt import load_model
    from megatron_stare.models.dist_ckpt import load_optimizer as load_optimizer_state
    from megatron_stare.models.dist_ckpt import reload_main_params

    d = Path(ckpt)
    if not d.is_dir():
        raise CheckpointError(f"checkpoint not found: {d}")
    if not is_complete(d):
        raise CheckpointError(f"checkpoint {d} is incomplete or damaged (no valid {COMPLETE} manifest)")
    load_model(actor.model, d / "model", spec)
    if not load_optimizer:
        if actor.optimizer is not None:
            reload_main_params(actor.optimizer)
        return json.loads((d / STATE).read_text())
    if not (d / "optimizer").is_dir():
        raise CheckpointError(f"checkpoint {d} has no optimizer/ state (an older format); resume "
                              f"the weights only (load_optimizer=False)")
    try:
        load_optimizer_state(actor.optimizer, actor.scheduler, actor.model, groups, d / "optimizer")
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    part = d / f"rank_{dist.get_rank():05d}.pt"
    per_rank = torch.load(part, weights_only=False) if part.is_file() else None
    if per_rank is not None and per_rank["layout"] == vars(groups.layout):
        set_rng_state(per_rank["rng"])
    elif dist.get_rank() == 0:
        print(f"[megatron-stare] checkpoint {d} was saved at another layout: weights and optimizer "
              f"state resumed, RNG streams start afresh", flush=True)
    return json.loads((d / STATE).read_text())
