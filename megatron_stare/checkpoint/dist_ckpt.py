"""Distributed model checkpoints with megatron-core ``dist_checkpointing``: save at one TP/PP
layout, load at any other.

Layout independence comes from Megatron's sharded state dict: every tensor is saved with its
global shape and this rank's offset, so loading re-slices for the new layout (the vocabulary
padding, which depends on TP, is re-padded with zeros: Megatron marks embeddings
``allow_shape_mismatch``). The default strategy is ``torch_dist`` (torch.distributed.checkpoint),
wrapped in megatron-core's fully-parallel save wrapper over DP x CP so the replicas split the
writing; both work on CPU/gloo.

Optimizer state (``save_optimizer`` / ``load_optimizer``) goes through Megatron's sharded
optimizer state too, beside the LR schedule. Megatron's plain optimizers key every Adam moment
(and bf16's fp32 main params) by its model parameter, so their state loads at any TP/PP/DP layout.
The distributed optimizer saves in megatron-core's ``fully_reshardable`` format: each parameter's
fp32 main param and moments in model space (the parameter's own shape and TP/PP sharding), so
its state loads at any TP/PP/DP layout. The DP shards are gathered over the DP group before the
write (at DP1 no gather
and no copy: ``optimizer_dp1``) and the DP ranks split the writing. Across expert-parallel layouts
(EP2 <-> EP1) megatron-core keys and nests the experts' optimizer state differently;
``optimizer_reshard`` converts on load. Checkpoints of the earlier
``dp_reshardable`` format (one tensor per gradient bucket) still load at any DP degree with the
saved TP/PP. After loading
weights, ``load_optimizer`` and ``reload_main_params`` keep the fp32 main params in step with them.

Atomicity: ranks write into ``<parent>/.<name>.partial``; after Megatron's final barrier rank 0
writes ``megatron_stare.json`` (spec, HF config, saved layout) and renames the directory to its
final name, then all ranks meet at a barrier. A directory without ``megatron_stare.json`` or
Megatron's ``metadata.json`` is a torn save and is refused on load with one clear error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional, Union
from multiprocessing import resource_tracker
import signal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron_stare.checkpoint import optimizer_dp1, writer as checkpoint_writer
from megatron_stare.models.gpt import GPTSpec, MoESpec
from megatron_stare.models.sharding import unwrap
from megatron_stare.runtime.parallel import ParallelGroups
from megatron_stare.runtime.preemption import PREEMPTION_SIGNALS

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
        spec = dict(self.spec)
        if spec.get("moe") is not None:  # JSON holds the MoESpec as a dict, its tuple as a list
            moe = dict(spec["moe"], layer_pattern=tuple(spec["moe"]["layer_pattern"]))
            spec["moe"] = MoESpec(**moe)
        return GPTSpec(**spec)


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
    try:
        raw = json.loads((d / META_FILE).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"checkpoint file {d / META_FILE} cannot be read ({type(e).__name__}: {e})") from None
    if raw.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"checkpoint {d} has format_version {raw.get('format_version')}, "
                         f"this code reads {FORMAT_VERSION}")
    return CheckpointMeta(**raw)


def start_writer_results_queue() -> None:
    """Start megatron-core's checkpoint-writer results queue, deaf to preemption signals.

    megatron-core 0.16.1's ``FileSystemWriterAsync`` collects write results through a
    ``multiprocessing`` Manager: a spawned server process, made on the rank's first save and kept
    for the process's life (``filesystem_async._get_write_results_queue``). It lives in the rank's
    process group, where torchrun's ``killpg`` delivers the preemption signal (``preemption.py``),
    and its default action would end it: mid-start if the signal comes during the first save (the
    save then fails with ``EOFError``; seen in CI), or before the very save the signal asks for.

    So the server is started here with the preemption signals blocked: a spawned child inherits
    the blocked mask through ``exec``, so those signals stay pending there, never delivered. In
    this process they are only held back (not lost) and are delivered when the mask is restored.
    The Manager ends with this process (its finalizer) or with a SIGKILL. Idempotent.
    """

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is not None:
        return
    signals = set(PREEMPTION_SIGNALS)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        # The resource tracker (spawned first) unblocks SIGINT/SIGTERM in this thread when it
        # starts: start it first, then block again for the Manager.
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, signals)
        filesystem_async._get_write_results_queue()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def save_sharded(sharded_state_dict: dict, out_dir: PathLike, groups: ParallelGroups,
                 meta: CheckpointMeta, *, overwrite: bool = False, fully_parallel: bool = True,
                 extra_files: Optional[Dict[str, PathLike]] = None, background: bool = False):
    """Save any Megatron sharded state dict atomically into ``out_dir`` (collective, all ranks).

    ``overwrite=False`` refuses an existing checkpoint at ``out_dir``. ``extra_files``
    (``{relative name: source path}``, e.g. tokenizer files) are copied in by rank 0 before
    the checkpoint is completed, so they are part of the atomic save.

    ``background``: plan the save and write the small files now, and return ``(request,
    finish)`` instead of the path: megatron-core's ``AsyncRequest`` holding the tensor writes
    and its finalization (``metadata.json``), and ``finish()`` (collective), which completes and
    renames the directory after the request's finalization on every rank.
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
    start_writer_results_queue()
    checkpoint_writer.install()  # its workers hash as they write and die with their parent
    strategy = get_default_save_sharded_strategy()
    # Over DP x CP, as Megatron's own training does: context-parallel ranks hold replicas too.
    if fully_parallel and groups.layout.dp * groups.layout.cp > 1:
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (FullyParallelSaveStrategyWrapper)

        strategy = FullyParallelSaveStrategyWrapper(strategy, groups.dp_cp_group)
    request = dist_checkpointing.save(sharded_state_dict, str(tmp), sharded_strategy=strategy,
                                      async_sharded_save=background)
    finish = functools.partial(_finish_sharded, tmp, out, meta, extra_files)
    if background:  # the caller schedules the writes (``async_save.py``), then calls ``finish``
        return request, finish
    return finish()


def _finish_sharded(tmp: Path, out: Path, meta: CheckpointMeta,
                    extra_files: Optional[Dict[str, PathLike]]) -> Path:
    """After every rank's writes and Megatron's metadata: rank 0 completes the directory and
    renames it to ``out``; then all ranks meet at a barrier."""
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

    read_meta(ckpt_dir)
    try:
        return dist_checkpointing.load(sharded_state_dict, str(ckpt_dir))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - re-raised naming the directory
        raise ValueError(f"checkpoint {ckpt_dir} could not be read ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:300]}); it may be damaged") from e


def save_model(model: torch.nn.Module, groups: ParallelGroups, out_dir: PathLike, spec: GPTSpec, *,
               hf_config: Optional[dict] = None, extra: Optional[dict] = None,
               overwrite: bool = False, extra_files: Optional[Dict[str, PathLike]] = None,
               background: bool = False):
    """Save this layout's model stage(s) as one layout-independent checkpoint (collective);
    ``background``: as in ``save_sharded``."""
    lay = groups.layout
    meta = CheckpointMeta(spec=dataclasses.asdict(spec), hf_config=hf_config,
                          saved_layout={"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "ep": lay.ep, "etp": lay.etp},
                          extra=dict(extra or {}))
    return save_sharded(unwrap(model).sharded_state_dict(), out_dir, groups, meta,
                        overwrite=overwrite, extra_files=extra_files, background=background)


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


#: The distributed optimizer's checkpoint format: model space, reshardable at any TP/PP/DP.
DISTRIBUTED_OPTIMIZER_SHARDING = "fully_reshardable"
#: Sharding types of older saves that load only at the saved TP/PP (any DP).
DP_ONLY_SHARDINGS = ("dp_reshardable",)


def optimizer_format(optimizer) -> str:
    """``distributed:<sharding type>`` for Megatron's DistributedOptimizer, else ``model_space``
    (plain Megatron optimizers key their state by model parameter)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    if any(isinstance(o, DistributedOptimizer) for o in subs):
        return f"distributed:{DISTRIBUTED_OPTIMIZER_SHARDING}"
    return "model_space"


def _optimizer_sharded_state_dict(optimizer, model: torch.nn.Module, is_loading: bool,
                                  sharding: str = DISTRIBUTED_OPTIMIZER_SHARDING) -> dict:
    model_sd = unwrap(model).sharded_state_dict()
    metadata = {"distrib_optim_sharding_type": sharding}
    if is_loading:
        return optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    with optimizer_dp1.dp1_fully_reshardable(optimizer):  # the same state, without the DP1 gather's copies
        return optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)


def save_optimizer(optimizer, scheduler, model: torch.nn.Module, groups: ParallelGroups,
                   out_dir: PathLike, spec: GPTSpec, background: bool = False):
    """Save the optimizer's state (Adam moments, main params, step) and the LR schedule as one
    Megatron distributed checkpoint (collective, all ranks). ``model`` is the DDP-wrapped or
    bare stage the optimizer was built over; ``background``: as in ``save_sharded``."""
    lay = groups.layout
    meta = CheckpointMeta(spec=dataclasses.asdict(spec),
                          saved_layout={"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "ep": lay.ep, "etp": lay.etp},
                          extra={"optimizer_format": optimizer_format(optimizer)})
    state = {"optimizer": _optimizer_sharded_state_dict(optimizer, model, is_loading=False),
             "scheduler": scheduler.state_dict()}
    return save_sharded(state, out_dir, groups, meta, background=background)


def check_optimizer_compatible(meta: CheckpointMeta, fmt: str, layout, where: PathLike) -> None:
    """ValueError (one line) when optimizer state saved as ``meta`` cannot load into an optimizer
    of format ``fmt`` (``optimizer_format``) at ``layout``."""
    saved = meta.extra.get("optimizer_format")
    if str(saved).split(":")[0] != fmt.split(":")[0]:
        raise ValueError(f"optimizer state in {where} was saved as {saved!r}, this run uses {fmt!r}; "
                         f"set parallel.distributed_optimizer as when it was saved")
    old = meta.saved_layout
    here = (layout.tp, layout.pp, getattr(layout, "ep", 1), getattr(layout, "etp", 1))
    if (saved_sharding(meta) in DP_ONLY_SHARDINGS
            and (old.get("tp"), old.get("pp"), old.get("ep", 1), old.get("etp", 1)) != here):
        raise ValueError(f"distributed-optimizer state in {where} was saved at tp={old.get('tp')} "
                         f"pp={old.get('pp')} ep={old.get('ep', 1)} etp={old.get('etp', 1)}; it loads at any "
                         f"DP degree but needs the same tp/pp/ep/etp (this run: tp={here[0]} pp={here[1]} "
                         f"ep={here[2]} etp={here[3]})")


def saved_sharding(meta: CheckpointMeta) -> Optional[str]:
    """The distributed optimizer's sharding type recorded in ``meta`` (None for plain ones)."""
    fmt = str(meta.extra.get("optimizer_format"))
    return fmt.split(":", 1)[1] if fmt.startswith("distributed:") else None


def reload_main_params(optimizer) -> None:
    """Copy the model's weights into the optimizer's fp32 main params (bf16 training keeps
    separate ones; a no-op for fp32 params). Call after loading weights into the model."""
    optimizer.reload_model_params()


def _torch_adams(optimizer):
    """The torch Adam optimizers inside Megatron's distributed optimizer(s) of ``optimizer``."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if isinstance(opt, DistributedOptimizer) and isinstance(inner, torch.optim.Adam):
            yield opt, inner


def _adam_kernels(optimizer, restore=None):
    """Each torch Adam param group's kernel flags (``fused``, ``foreach``), or, given ``restore``
    (an earlier result), set them back: which kernel runs is this run's choice
    (``optimizer.fused_adam``, ``actor/optim.py``), not the checkpoint's."""
    inners = [sub.optimizer for sub in getattr(optimizer, "chained_optimizers", [optimizer])
              if isinstance(getattr(sub, "optimizer", None), torch.optim.Adam)]
    if restore is None:
        return [[(g.get("fused"), g.get("foreach")) for g in inner.param_groups] for inner in inners]
    for inner, flags in zip(inners, restore):
        for g, (fused, foreach) in zip(inner.param_groups, flags):
            g["fused"], g["foreach"] = fused, foreach
    return restore


def _restore_adam_steps(optimizer) -> None:
    """Give every parameter its own, loaded Adam ``step`` after a distributed-optimizer load.

    On megatron-core's torch-Adam path (no TE/Apex) the step count is saved in the param groups;
    ``DistributedOptimizer.load_state_dict`` then puts ONE step tensor into every parameter's
    state, and the ``dp_reshardable`` parameter-state load copies into it the loading side's own
    placeholder step (a non-persistent entry), i.e. 0. Left so, Adam's bias correction restarts
    after a resume, and torch's foreach Adam would increment the shared tensor once per
    parameter. Each parameter gets a fresh tensor (same dtype and device) holding the saved count.
    """
    for _, inner in _torch_adams(optimizer):
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                if p in inner.state:
                    old = inner.state[p].get("step")
                    where = ({"dtype": old.dtype, "device": old.device} if isinstance(old, torch.Tensor)
                             else {"dtype": torch.float32})
                    inner.state[p]["step"] = torch.tensor(float(group["step"]), **where)


def _allocate_torch_adam_state(optimizer) -> None:
    """Give a fresh DistributedOptimizer over torch's Adam its state, as a first step would.

    Without transformer-engine or Apex, megatron-core's distributed optimizer runs torch's Adam
    and its ``state_dict()`` reads Adam's per-parameter ``step``, which does not exist before the
    first step; the loading request (``sharded_state_dict(is_loading=True)``) calls it. The
    allocated zeros are all overwritten by the load.
    """
    for opt, inner in _torch_adams(optimizer):
        if len(inner.state) == 0 and opt.init_state_fn is not None:
            opt.init_state_fn(inner, opt.config)
            for group in inner.param_groups:
                for p in group["params"]:
                    inner.state[p].setdefault("step", torch.zeros((), dtype=torch.float32))


@contextlib.contextmanager
def _keep_adam_steps(optimizer):
    """Let megatron-core's ``fully_reshardable`` load run on the torch-Adam path.

    megatron-core 0.16.1's ``load_parameter_state_from_fully_reshardable`` hands
    ``_set_main_param_and_optimizer_states`` the loaded tensors without Adam's ``step`` (it is
    saved in the param groups), which then copies every entry of the parameter's state, ``step``
    included, and fails with ``KeyError: 'step'``. While loading, a missing ``step`` is the
    parameter's current one (copied onto itself); ``_restore_adam_steps`` then sets the saved count.
    """
    patched = []
    for opt, _ in _torch_adams(optimizer):
        original = opt._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, _opt=opt, _original=original):
            current = _opt._get_main_param_and_optimizer_states(model_param)
            if "step" in current and "step" not in tensors:
                tensors = {**tensors, "step": current["step"]}
            _original(model_param, tensors)

        opt._set_main_param_and_optimizer_states = set_states
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states  # back to the class's method


def load_optimizer(optimizer, scheduler, model: torch.nn.Module, groups: ParallelGroups,
                   ckpt_dir: PathLike) -> CheckpointMeta:
    """Load the state ``save_optimizer`` wrote into ``optimizer`` and ``scheduler`` (collective).

    Load the weights into ``model`` first: the main params are refreshed from them, then
    overwritten by the saved fp32 main params where the format holds them.
    """
    meta = read_meta(ckpt_dir)
    check_optimizer_compatible(meta, optimizer_format(optimizer), groups.layout, ckpt_dir)
    reload_main_params(optimizer)
    _allocate_torch_adam_state(optimizer)
    sharding = saved_sharding(meta) or DISTRIBUTED_OPTIMIZER_SHARDING
    request = {"optimizer": _optimizer_sharded_state_dict(optimizer, model, is_loading=True,
                                                          sharding=sharding),
               "scheduler": scheduler.state_dict()}
    # Another EP layout nests and keys the expert state differently (``optimizer_reshard``; imported
    # here: it imports megatron-core, which the config checks that import this module must not).
    from megatron_stare.checkpoint import optimizer_reshard

    kernels = _adam_kernels(optimizer)  # the saved param groups carry the saving run's choice
    convert = optimizer_reshard.needs_conversion(request, optimizer, ckpt_dir)
    loaded = (optimizer_reshard.load_converted(request, ckpt_dir, load_sharded) if convert
              else load_sharded(request, ckpt_dir))
    # With fp32 params the distributed optimizer's main params are views of the (grad-requiring)
    # weights, which megatron-core's parameter-state loads copy into in place.
    with torch.no_grad(), _keep_adam_steps(optimizer):
        optimizer.load_state_dict(loaded["optimizer"])
    _restore_adam_steps(optimizer)
    _adam_kernels(optimizer, kernels)
    scheduler.load_state_dict(loaded["scheduler"])
    return meta
