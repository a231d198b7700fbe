"""Training checkpoints: everything needed to resume a run exactly, written atomically.

A checkpoint is a directory ``<dir>/step_<N>/``:

- ``model/``: the policy weights as a layout-independent megatron-core distributed checkpoint
  (``models.dist_ckpt``), loadable at any TP/PP/DP layout and by ``checkpoints_convert``;
- ``optimizer/``: Megatron's sharded optimizer state (Adam moments, fp32 main params of bf16
  weights, step) and the LR schedule, also a distributed checkpoint. The plain optimizer's state
  loads at any layout; the distributed optimizer's too (megatron-core's ``fully_reshardable``
  format; older ``dp_reshardable`` saves at any DP degree with the saved TP/PP);
- ``rank_<r>.pt``: this rank's RNG states (torch CPU/CUDA, Python, NumPy, Megatron's tracker)
  and its layout. They are restored only at the saved layout (elsewhere the RNG streams differ
  by construction, and the run says so);
- ``trainer_state.json``: step, data cursor, STARE controller, GEPO history, counters;
- ``COMPLETE``: written last, holding the manifest: every file's size and SHA-256
  (``checkpoint_manifest``; the ranks hash it together).

Writers fill ``.step_<N>.partial/``; rank 0 renames it to ``step_<N>/`` only after every rank
has finished, so a crash at any point leaves either the previous checkpoint or a ``.partial``
directory that is ignored. ``latest_complete`` also skips a ``step_<N>`` whose files do not
match its manifest (torn, cut short, or changed in place at the same size), warning with the
first damaged file, and resumes from the last good one.

Every decision about a checkpoint is the same on every rank: which one to resume (verified
together, one verdict), and any error: a rank that cannot read its part makes every rank raise
the same ``CheckpointError`` line (naming the rank and the file) before the next collective,
where the others would otherwise wait for it.

Resume loads the weights, refreshes the optimizer's main params from them, then loads the
optimizer state (whose saved fp32 main params win where they exist): the first step after a
resume continues from the resumed weights and moments, never from the optimizer's init.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Union

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from megatron_stare.checkpoint.manifest import (COMPLETE, first_problem, from_rank0, manifest_step, verify,
                                                write_manifest)
from megatron_stare.errors import UserError
from megatron_stare.runtime import notices
from megatron_stare.checkpoint.dist_ckpt import (load_model, load_optimizer as load_optimizer_state, reload_main_params,
                                                 save_model, save_optimizer)
from megatron_stare.weight_sync.hf_export import side_files

STATE = "trainer_state.json"
_STEP_RE = re.compile(r"^step_(\d+)$")
PathLike = Union[str, Path]


class CheckpointError(UserError):
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


class CheckpointWarning(UserWarning):
    """A damaged checkpoint was skipped."""


def list_checkpoints(root: PathLike) -> List[Path]:
    """``step_<N>`` directories under ``root``, oldest first (complete or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_RE.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest_complete(root: PathLike) -> Optional[Path]:
    """Collective: the newest checkpoint under ``root`` whose files match its manifest, the same
    on every rank; each damaged one is reported by rank 0 (one line naming the file) and skipped."""
    for d in reversed(from_rank0(list_checkpoints(root) if _rank() == 0 else None)):
        problem = verify(d)
        if problem is None:
            return d
        if _rank() == 0:
            warnings.warn(f"checkpoint {d} is damaged: {problem}; falling back to an earlier one",
                          CheckpointWarning, stacklevel=2)
    return None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save_checkpoint(root: PathLike, step: int, *, actor, groups, spec, trainer_state: Dict[str, Any],
                    keep_last: int = 3, hf_config: Optional[dict] = None,
                    hf_dir: Optional[PathLike] = None, background=None) -> Optional[Path]:
    """Save step ``step`` (collective over all ranks); prune to the newest ``keep_last``.

    ``hf_dir``: the run's HF model directory; its tokenizer files, chat template and generation
    config are saved under ``model/hf/``, so ``megatron_to_hf`` writes a model that generates.

    ``background`` (an enabled ``async_save.BackgroundSaves``): after waiting for the save in
    flight, plan this one and write its small files, then leave the tensor writes to the
    background and return None; the directory becomes ``step_<N>`` (manifest, rename, prune) at
    the save's finalization, which ``background`` runs and reports."""
    bg = background is not None and background.enabled
    if bg:
        background.wait()  # never two in flight

    root = Path(root).absolute()
    final = root / f"step_{step:08d}"
    tmp = root / f".step_{step:08d}.partial"
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    dist.barrier()
    problem, parts = None, []
    try:
        parts.append(save_model(actor.model, groups, tmp / "model", spec, hf_config=hf_config, background=bg,
                                extra_files=side_files(hf_dir) if hf_dir is not None else None))
        parts.append(save_optimizer(actor.optimizer, actor.scheduler, actor.model, groups, tmp / "optimizer",
                                    spec, background=bg))
        per_rank = {"rng": rng_state(), "layout": vars(groups.layout).copy()}
        part = tmp / f"rank_{dist.get_rank():05d}.pt"
        torch.save(per_rank, str(part) + ".tmp")
        os.replace(str(part) + ".tmp", part)
        if dist.get_rank() == 0:
            (tmp / STATE).write_text(json.dumps(trainer_state, indent=1, default=_json_default))
    except SAVE_ERRORS as e:  # a full disk, a permission, a file-system error (megatron wraps them)
        problem = _cause(e, root)
    if bg:
        _save_agreed(problem, root, tmp, step)
        background.start(step, root, parts, lambda problem: _complete(root, tmp, final, step, keep_last, problem))
        return None
    return _complete(root, tmp, final, step, keep_last, problem)


def _complete(root: Path, tmp: Path, final: Path, step: int, keep_last: int, problem: Optional[str]) -> Path:
    """Collective, once every rank's files are in ``tmp``: agree on ``problem`` (any rank's),
    write the manifest, rename ``tmp`` to ``final``, prune to the newest ``keep_last``."""
    _save_agreed(problem, root, tmp, step)  # the barrier before the manifest, too
    try:
        write_manifest(tmp, step)  # every rank hashes its share; rank 0 writes COMPLETE
    except SAVE_ERRORS as e:
        problem = _cause(e, root)
    _save_agreed(problem, root, tmp, step)
    if dist.get_rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


#: What a failed write raises: ``OSError`` directly, ``RuntimeError``/``CheckpointException``
#: from megatron-core's writer workers ("Worker failure: [Errno 28] No space left on device").
SAVE_ERRORS = (OSError, RuntimeError, ValueError, CheckpointException)
_FIXES = {errno.ENOSPC: "free space on its file system or set checkpoint.dir to a larger disk",
          errno.EDQUOT: "free space within the disk quota or set checkpoint.dir to another disk",
          errno.EACCES: "make it writable by this user or set checkpoint.dir elsewhere",
          errno.EPERM: "make it writable by this user or set checkpoint.dir elsewhere",
          errno.EROFS: "set checkpoint.dir to a writable file system"}


def _cause(e: BaseException, root: Optional[Path] = None) -> str:
    """``Type: first line``, and the OS error inside (megatron-core's and torch's wrappers bury
    ``[Errno 28] No space left on device`` in a worker's traceback, the exception chain or a
    ``CheckpointException``'s per-rank failures). A full disk does not always surface as an
    errno (a zip writer reports ``unexpected pos ...``): with no errno found and the file system
    of ``root`` (nearly) full, the cause is named as ENOSPC, with the free bytes."""
    first = str(e).splitlines()[0][:200] if str(e) else ""
    chain, todo = [], [e]
    while todo and len(chain) < 32:
        x = todo.pop(0)
        chain.append(f"{type(x).__name__}: {x}")
        todo += [f[0] for f in (getattr(x, "failures", None) or {}).values() if isinstance(f, tuple) and f]
        todo += [c for c in (x.__cause__, x.__context__) if c is not None]
    found = re.search(r"\[Errno \d+\][^\n]*", "\n".join(chain))
    inner = found.group(0)[:200] if found and found.group(0) not in first else ""
    if not found and root is not None:
        try:
            usage = shutil.disk_usage(root)
        except OSError:
            usage = None
        if usage is not None and usage.free < max(64 << 20, usage.total // 1000):
            inner = f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}: {usage.free} bytes free on its file system"
    if not inner and len(chain) > 1:  # name what the wrapper wraps
        inner = chain[1].splitlines()[0][:200]
    return f"{type(e).__name__}: {first}" + (f" ({inner})" if inner else "")


#: How a background save's problem starts when a rank's writer process died (``async_save``).
WRITER_DIED = "background checkpoint writer died"


def _save_agreed(problem: Optional[str], root: Path, tmp: Path, step: int) -> None:
    """Collective: if any rank's save failed, every rank raises one ``CheckpointError`` line
    (rank 0 prints it) naming the directory, the cause, the fix and the checkpoint that stays
    the latest; the partial directory is removed (a full disk gets its space back)."""
    if (first := first_problem(problem)) is None:
        return
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    code = next((c for c in _FIXES if f"[Errno {c}]" in first or os.strerror(c) in first), None)
    fix = _FIXES.get(code, "check the file system of checkpoint.dir (or set checkpoint.dir elsewhere)")
    if (WRITER_DIED in first or "a file worker of rank" in first) and "SIGKILL" in first:
        fix = ("a SIGKILL is most often the kernel's out-of-memory killer (see `dmesg`): give the job more host "
               "memory" + (" or set checkpoint.async_save=false" if WRITER_DIED in first else ""))
    elif WRITER_DIED in first:
        fix = "see the rank's stderr for the writer's own error, or set checkpoint.async_save=false"
    previous = list_checkpoints(root)
    kept = f"{previous[-1]} stays the latest checkpoint" if previous else "no earlier checkpoint exists"
    raise CheckpointError(f"checkpoint.dir: saving step {step} into {root} failed ({first}); {fix}, then rerun "
                          f"the same command: {kept}")


def _json_default(x):
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def _read(path: Path, reader: Callable[[Path], Any]) -> Any:
    """``reader(path)``; any failure is a CheckpointError naming the file."""
    try:
        return reader(path)
    except Exception as e:  # noqa: BLE001 - re-raised as one line naming the file
        detail = str(e).splitlines()[0][:300] if str(e) else ""
        raise CheckpointError(f"checkpoint file {path} cannot be read ({type(e).__name__}: {detail})") from e


def _json(path: Path) -> Any:
    return json.loads(path.read_text())


def _torch(path: Path) -> Any:
    return torch.load(path, weights_only=False)


def _agreed(problem: Optional[str]) -> None:
    """Collective: raise the same CheckpointError on every rank if any rank has a problem."""
    if (first := first_problem(problem)) is not None:
        raise CheckpointError(first)


def load_checkpoint(ckpt: PathLike, *, actor, groups, spec, load_optimizer: bool = True,
                    verified: bool = False) -> Dict[str, Any]:
    """Restore weights and (``load_optimizer``) optimizer state and LR schedule, and at the saved
    layout the RNG states; returns the trainer state. Collective over all ranks.

    Weights load at any layout; optimizer state as ``models.dist_ckpt.load_optimizer`` allows.
    Without ``load_optimizer`` the optimizer keeps its fresh state but its main params follow the
    loaded weights. The files are verified against the manifest first (unless ``verified``: the
    caller just did, as ``latest_complete`` does), and every error is raised alike on every rank
    (a ``CheckpointError`` line naming the file).
    """

    d = Path(ckpt)
    if from_rank0(not d.is_dir()):
        raise CheckpointError(f"checkpoint not found: {d}")
    if not verified and (problem := verify(d)) is not None:
        raise CheckpointError(f"checkpoint {d} is damaged: {problem}")
    # This rank's own reads first, agreed on before any collective load.
    state = per_rank = problem = None
    try:
        state = _read(d / STATE, _json)
        part = d / f"rank_{dist.get_rank():05d}.pt"
        if load_optimizer and part.is_file():
            per_rank = _read(part, _torch)
        if load_optimizer and not (d / "optimizer").is_dir():
            raise CheckpointError(f"checkpoint {d} has no optimizer/ state (an older format); resume "
                                  f"the weights only (load_optimizer=False)")
    except CheckpointError as e:
        problem = str(e)
    _agreed(problem)
    try:
        load_model(actor.model, d / "model", spec)
        if not load_optimizer:
            if actor.optimizer is not None:
                reload_main_params(actor.optimizer)
            return state
        load_optimizer_state(actor.optimizer, actor.scheduler, actor.model, groups, d / "optimizer")
    except ValueError as e:  # dist_ckpt's one-line errors, the same on every rank (same files)
        raise CheckpointError(str(e)) from None
    if per_rank is not None and per_rank["layout"] == vars(groups.layout):
        set_rng_state(per_rank["rng"])
    elif dist.get_rank() == 0:
        notices.note(f"checkpoint {d} was saved at another layout: weights and optimizer "
                     f"state resumed, RNG streams start afresh")
    return state


def finished_checkpoint(resume: str, root: Optional[PathLike], total_steps: int) -> Optional[tuple]:
    """``(step, path)`` when the checkpoint a run would resume from (``checkpoint.resume``,
    ``checkpoint.dir``) is at or past ``total_steps`` and intact: the run is already complete.
    Before any process group: each process reads the manifests itself and verifies (hashes)
    only a candidate at ``total_steps`` or later; a damaged one is skipped like
    ``latest_complete`` skips it (which then warns, on the run's normal path)."""
    if resume == "never" or (resume == "auto" and not root):
        return None
    for d in reversed(list_checkpoints(root)) if resume == "auto" else [Path(resume)]:
        step = manifest_step(d)
        if step is None:
            continue
        if step < total_steps:
            return None
        if verify(d) is None:
            return step, d
    return None
