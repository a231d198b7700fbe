"""STARE training steps of the tiny actor with a checkpoint in the middle, for the resume tests.

``run_resume_case(rank, world, root, phase=...)`` on ``run_on_ranks``:

- ``phase="full"``: ``steps`` steps (fresh samples each step), saving a real training checkpoint
  (``checkpoint.save_checkpoint``) after step ``save_at``; returns every step's numbers, the final
  weights, and the optimizer state (canonical, ``testing.optimizer_state``) at the save.
- ``phase="resume"``: a fresh actor loads that checkpoint (``checkpoint.load_checkpoint``) and
  runs the remaining steps; returns the same record, with the optimizer state right after loading.

``break_load`` (test-only, in the spawned ranks) breaks the resume on purpose so that the tests
can show they catch it: ``"param_state"`` leaves the distributed optimizer's parameter state
(Adam moments and fp32 main params) out of the load, ``"main_params"`` skips refreshing the main
params from the loaded weights (which matters for the weights-only resume, ``load_optimizer=False``),
``"adam_steps"`` leaves Adam's step counts as megatron-core's torch-Adam load sets them,
``"adam_kernels"`` lets the checkpoint's param groups choose torch Adam's kernel (fused or loop).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from megatron_stare.algorithms.stare import StareController
from megatron_stare.testing.actor_case import MOE_SPEC, build_case_actor, case_groups, gather_full_model, synthetic_samples
from megatron_stare.testing.megatron_tiny import TINY_SPEC
from megatron_stare.testing.optimizer_state import gather_optimizer_state
from megatron_stare.actor.optim import torch_adams
from megatron_stare.checkpoint import core as checkpoint_core, dist_ckpt
from megatron_stare.checkpoint.core import latest_complete, load_checkpoint, save_checkpoint


def _train_steps(actor, controller, first: int, last: int, root: Optional[Path], save_at: int, record: dict):
    for step in range(first, last):
        batches = actor.prepare(synthetic_samples(seed=step))
        stats = actor.compute_logprobs(batches)
        state = controller.update(stats.entropy)
        res = actor.update(batches, step, state)
        record["steps"].append({"loss": res.loss, "grad_norm": res.grad_norm, "metrics": res.metrics,
                                "entropy": stats.entropy, "gate_on": state.gate_on})
        if root is not None and step + 1 == save_at:
            record["optimizer_state"] = gather_optimizer_state(actor.optimizer, actor.model, actor.groups)
            record["weights_at_save"] = gather_full_model(actor)
            save_checkpoint(root, step + 1, actor=actor, groups=actor.groups, spec=actor.spec,
                            trainer_state={"step": step + 1, "controller": controller.state_dict()})


def _break(kind: Optional[str]) -> None:
    if kind == "param_state":
        request = dist_ckpt._optimizer_sharded_state_dict

        def without_param_state(optimizer, model, is_loading, **kw):
            state = request(optimizer, model, is_loading, **kw)
            if is_loading:
                state.pop("param_state")  # the moments and fp32 main params stay unread
            return state

        dist_ckpt._optimizer_sharded_state_dict = without_param_state
    elif kind == "main_params":
        # where it is called: the weights-only resume (checkpoint.core) and load_optimizer
        dist_ckpt.reload_main_params = checkpoint_core.reload_main_params = lambda optimizer: None
    elif kind == "adam_steps":
        dist_ckpt._restore_adam_steps = lambda optimizer: None
    elif kind == "adam_kernels":
        dist_ckpt._adam_kernels = lambda optimizer, restore=None: restore or []
    elif kind is not None:
        raise ValueError(f"unknown break_load {kind!r}")


def run_resume_case(rank: int, world: int, root: str, *, phase: str, tp: int = 1, pp: int = 1, steps: int = 4,
                    save_at: int = 2, distributed_optimizer: bool = True, dtype=torch.float32,
                    lr: float = 1e-4, break_load: Optional[str] = None, load_optimizer: bool = True,
                    weights_seed: int = 0, ep: int = 1, moe: bool = False, fused_adam: bool = True):
    """See the module docstring. ``weights_seed`` sets the fresh actor's initial weights;
    ``moe``: the tiny Qwen3-MoE (``MOE_SPEC``) with experts at ``ep``; ``fused_adam``: the
    optimizer's kernel (``optimizer.fused_adam``); ``record["adam_kernels"]``: the torch Adam
    param groups' (fused, foreach) flags at the end."""

    groups = case_groups(world, tp, pp, distributed_optimizer=distributed_optimizer, ep=ep)
    spec = MOE_SPEC if moe else TINY_SPEC
    actor, algo = build_case_actor(groups, lr=lr, dtype=dtype, weights_seed=weights_seed, spec=spec,
                                   fused_adam=fused_adam)
    controller = StareController(algo.stare)
    record: dict = {"steps": []}
    if phase == "full":
        _train_steps(actor, controller, 0, steps, Path(root), save_at, record)
    elif phase == "resume":
        _break(break_load)
        state = load_checkpoint(latest_complete(root), actor=actor, groups=groups, spec=spec,
                                load_optimizer=load_optimizer)
        controller.load_state_dict(state["controller"])
        record["optimizer_state"] = gather_optimizer_state(actor.optimizer, actor.model, groups)
        record["weights_at_load"] = gather_full_model(actor)
        _train_steps(actor, controller, state["step"], steps, None, save_at, record)
    else:
        raise ValueError(f"unknown phase {phase!r}")
    record["weights"] = gather_full_model(actor)
    record["adam_kernels"] = sorted({(g.get("fused"), g.get("foreach")) for inner in torch_adams(actor.optimizer)
                                     for g in inner.param_groups}, key=repr)
    return record
