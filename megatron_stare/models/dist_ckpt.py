"""Distributed model checkpoints with megatron-core ``dist_checkpointing``: save at one TP/PP
layout, load at any other.

Layout independence comes from Megatron's sharded state dict: every tensor is saved with its
global shape and this rank's offset, so loading re-slices for the new layout (the vocabulary
padding, which depends on TP, is re-padded with zeros: Megatron marks embeddings
``allow_shape_mismatch``). The default strategy is ``torch_dist`` (torch.distributed.checkpoint),
wrapped in megatron-core's fully-parallel save wrapper so data-parallel replicas split the
writing; both work on CPU/gloo.

Atomicity: ranks write into ``<parent>/.<name>.partial``; after Megatron's final barrier rank 0
writes ``megatron_stare.json`` (spec, HF config, saved layout) and renames the directory to its
final name, then all ranks meet at a barrier. A directory without ``megatron_stare.json`` or
Megatron's ``metadata.json`` is a torn save and is refused on load with one clear error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch
import torch.distributed as dist

from megatron_stare.models.gpt import GPTSpec
from megatron_stare.models.sharding import unwrap
from megatron_stare.parallel import ParallelGroups

META_FILE = "megatron_stare.json"
MEGATRON_META = "metadata.json"
FORMAT_VERSION = 1
PathLike = Union[str, Path]


@dataclass
class CheckpointMeta:
    """What ``megatron_stare.json`` records beside the tensors."""

    spec: Dict[str, Any]
    hf_config: Optional[Dict[str, Any]] = None
    saved_layout: Dict[str, int] = field(default_factory=dict)
    extra: Dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def gpt_spec(self) -> GPTSpec:
        return GPTSpec(**self.spec)


def _partial_dir(out: Path) -> Path:
    return out.parent / f".{out.name}.partial"


def read_meta(ckpt_dir: PathLike) -> CheckpointMeta:
    """The ``CheckpointMeta`` of a complete checkpoint; ValueError for missing or torn ones."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        hint = (" (a save into it was interrupted: its partial directory exists)"
                if _partial_dir(d).exists() else "")
        raise ValueError(f"no checkpoint at {d}{hint}")
    if not (d / META_FILE).is_file() or not (d / MEGATRON_META).is_file():
        missing = [f for f in (META_FILE, MEGATRON_META) if not (d / f).is_file()]
        raise ValueError(f"checkpoint {d} is incomplete (missing {', '.join(missing)}): the save "
                         f"did not finish; use an earlier checkpoint")
    raw = json.loads((d / META_FILE).read_text())
    if raw.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"checkpoint {d} has format_version {raw.get('format_version')}, "
                         f"this code reads {FORMAT_VERSION}")
    return CheckpointMeta(**raw)


def save_sharded(sharded_state_dict: dict, out_dir: PathLike, groups: ParallelGroups,
                 meta: CheckpointMeta, *, overwrite: bool = False, fully_parallel: bool = True,
                 extra_files: Optional[Dict[str, PathLike]] = None) -> Path:
    """Save any Megatron sharded state dict atomically into ``out_dir`` (collective, all ranks).

    ``overwrite=False`` refuses an existing checkpoint at ``out_dir``. ``extra_files``
    (``{relative name: source path}``, e.g. tokenizer files) are copied in by rank 0 before
    the checkpoint is completed, so they are part of the atomic save.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    out = Path(out_dir).absolute()
    if out.exists() and not overwrite:
        raise ValueError(f"{out} already exists; choose a new directory or pass overwrite=True")
    tmp = _partial_dir(out)
    if dist.get_rank() == 0:
        if tmp.exists():
            shutil.rmtree(tmp)  # left by an interrupted save
        tmp.mkdir(parents=True)
    dist.barrier()
    strategy = get_default_save_sharded_strategy()
    if fully_parallel and groups.layout.dp > 1:
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelSaveStrategyWrapper,
        )

        strategy = FullyParallelSaveStrategyWrapper(strategy, groups.dp_group)
    dist_checkpointing.save(sharded_state_dict, str(tmp), sharded_strategy=strategy)
    if dist.get_rank() == 0:
        for name, src in (extra_files or {}).items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, tmp / name)
        (tmp / f"{META_FILE}.tmp").write_text(json.dumps(dataclasses.asdict(meta), indent=2))
        os.replace(tmp / f"{META_FILE}.tmp", tmp / META_FILE)
        if out.exists():
            old = out.parent / f".{out.name}.old"
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    dist.barrier()
    return out


def load_sharded(sharded_state_dict: dict, ckpt_dir: PathLike) -> dict:
    """Load a Megatron sharded state dict from a complete checkpoint (collective)."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    read_meta(ckpt_dir)
    try:
        return dist_checkpointing.load(sharded_state_dict, str(ckpt_dir))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - re-raised naming the directory
        raise ValueError(f"checkpoint {ckpt_dir} could not be read ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:300]}); it may be damaged") from e


def save_model(model: torch.nn.Module, groups: ParallelGroups, out_dir: PathLike, spec: GPTSpec, *,
               hf_config: Optional[dict] = None, extra: Optional[dict] = None,
               overwrite: bool = False, extra_files: Optional[Dict[str, PathLike]] = None) -> Path:
    """Save this layout's model stage(s) as one layout-independent checkpoint (collective)."""
    lay = groups.layout
    meta = CheckpointMeta(spec=dataclasses.asdict(spec), hf_config=hf_config,
                          saved_layout={"tp": lay.tp, "pp": lay.pp, "dp": lay.dp},
                          extra=dict(extra or {}))
    return save_sharded(unwrap(model).sharded_state_dict(), out_dir, groups, meta,
                        overwrite=overwrite, extra_files=extra_files)


def load_model(model: torch.nn.Module, ckpt_dir: PathLike, spec: Optional[GPTSpec] = None
               ) -> CheckpointMeta:
    """Load a checkpoint saved at any layout into this rank's model stage (collective).

    ``spec`` (optional) must describe the same model as the checkpoint's, apart from the
    vocabulary padding multiple; a mismatch names the differing fields.
    """
    meta = read_meta(ckpt_dir)
    if spec is not None:
        saved = meta.gpt_spec()
        skip = {"make_vocab_size_divisible_by", "extra", "max_position_embeddings"}
        diff = [f.name for f in dataclasses.fields(GPTSpec)
                if f.name not in skip and getattr(saved, f.name) != getattr(spec, f.name)]
        if diff:
            raise ValueError(f"checkpoint {ckpt_dir} holds a different model: fields {diff} differ "
                             f"({', '.join(f'{k}={getattr(saved, k)!r}' for k in diff)})")
    inner = unwrap(model)
    state = load_sharded(inner.sharded_state_dict(), ckpt_dir)
    inner.load_state_dict(state)
    return meta
