"""Optimizer state across expert-parallel layouts (EP2 -> EP1, EP1 -> EP2, and any change in
how many sub-optimizers a rank holds), for Megatron's distributed optimizer and its plain ones.

Why megatron-core 0.16.1 does not do it by itself. ``get_megatron_optimizer`` builds one
optimizer over the parameters with ``allreduce=True`` (reduced over data parallel) and, only if
some parameter has ``allreduce=False``, a second one over those (reduced over expert-data
parallel), chained in a ``ChainedOptimizer``. Megatron marks expert weights ``allreduce=False``
only at ``expert_model_parallel_size > 1`` (``tensor_parallel/layers.py``: ``not (is_expert and
expert_parallel)``): at EP1 the experts sit in the dense optimizer, at EP > 1 in their own. The
state itself is layout-free (``fully_reshardable`` and the plain optimizers keep one tensor per
parameter in model space, the experts' keyed by global expert index), but two things are not:

1. the keys: ``ChainedOptimizer.sharded_state_dict`` prefixes every tensor key with
   ``chained_<i>.`` when it holds two or more optimizers (unless ``chained_optim_avoid_prefix``)
   and with nothing when it holds one, so ``chained_0.optimizer.state.exp_avg.<param>`` saved at
   EP2 is looked up as ``optimizer.state.exp_avg.<param>`` at EP1 (a ``KeyError`` in the load
   plan), and the other way round;
2. the common (non-tensor) state, which is not sharded: the saved param groups and Adam step
   come back in the saved nesting (``{0: dense, 1: experts}`` vs one optimizer's dict), which the
   loading optimizer's ``load_state_dict`` cannot take.

So, when the saved keys or nesting differ from this rank's (``needs_conversion``), the load is
converted: every tensor requested is renamed to the saved key of the same parameter and state
(the key without its ``chained_<i>.`` prefix is unique), only the tensors are read, and the
common state is this optimizer's own with the saved values put in: each param group's
hyperparameters and step from the saved group of the same identity (megatron's
``param_group_identifier_keys`` less ``is_expert_parallel``, which is what changed), the plain
optimizers' ``common_step`` and the grad scaler. What is loaded is then what the unconverted load
would give at the saved layout: weights, fp32 main params and Adam moments bit-identical.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Tuple, Union

from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase
from megatron.core.dist_checkpointing.serialization import load_common_state_dict, load_tensors_metadata
from megatron.core.optimizer.optimizer import param_group_identifier_keys

PathLike = Union[str, Path]
_CHAINED = re.compile(r"^chained_\d+\.")
#: What identifies a param group across layouts: megatron's keys without the one EP changes.
GROUP_KEYS = tuple(k for k in param_group_identifier_keys if k != "is_expert_parallel")


def _plain_key(key: str) -> str:
    return _CHAINED.sub("", key)


def _leaves(x: Any, path: Tuple = ()) -> Iterator[Tuple[Tuple, Any]]:
    """(path, leaf) of every sharded or non-persistent leaf of a nested dict/list."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _leaves(v, path + (i,))
    elif isinstance(x, (ShardedBase, LocalNonpersistentObject)):
        yield path, x


def _get(x: Any, path: Tuple) -> Any:
    for k in path:
        x = x[k]
    return x


def _count(optimizer) -> int:
    return len(getattr(optimizer, "chained_optimizers", [optimizer]))


def _saved_count(common: dict) -> int:
    """Sub-optimizers in a saved ``{"optimizer": ...}`` common state: a ChainedOptimizer of two
    or more saves ``{0: ..., 1: ...}``, of one the optimizer's own dict."""
    opt = common.get("optimizer")
    return len(opt) if isinstance(opt, dict) and opt and all(isinstance(k, int) for k in opt) else 1


def needs_conversion(request: dict, optimizer, ckpt_dir: PathLike) -> bool:
    """True when ``request`` (``{"optimizer": optimizer.sharded_state_dict(...), ...}``) cannot
    be read by megatron-core's own load: a tensor key it asks for is not saved as such, or the
    saved common state nests a different number of sub-optimizers than ``optimizer`` holds."""
    try:
        saved = set(load_tensors_metadata(str(ckpt_dir)))
        count = _saved_count(load_common_state_dict(str(ckpt_dir)))
    except Exception:  # noqa: BLE001 - an unreadable checkpoint: the plain load names the problem
        return False
    asked = {leaf.key for _, leaf in _leaves(request["optimizer"]) if isinstance(leaf, ShardedBase)}
    return bool(asked - saved) or count != _count(optimizer)


def _groups(x: Any) -> Iterator[dict]:
    """Every param group (a dict in a ``param_groups`` list) of a nested state dict."""
    if isinstance(x, dict):
        for k, v in x.items():
            if k == "param_groups" and isinstance(v, list):
                yield from (g for g in v if isinstance(g, dict))
            else:
                yield from _groups(v)


def _find(x: Any, key: str) -> List[Any]:
    """Values of ``key`` anywhere in a nested dict, outermost first."""
    out = []
    if isinstance(x, dict):
        if key in x:
            out.append(x[key])
        for k, v in x.items():
            if k != key:
                out.extend(_find(v, key))
    return out


def _put_saved_common(target: dict, saved: dict, where: PathLike) -> None:
    """Put the saved param groups' values, ``common_step`` and grad scaler into ``target`` (this
    optimizer's own common state, in its own nesting), in place."""
    saved_groups = list(_groups(saved))
    for g in _groups(target):
        ident = tuple(g.get(k) for k in GROUP_KEYS)
        match = [s for s in saved_groups if tuple(s.get(k) for k in GROUP_KEYS) == ident]
        if not match:
            raise ValueError(f"optimizer state in {where} has no param group like this run's "
                             f"({dict(zip(GROUP_KEYS, ident))}); it was saved with other lr/wd multipliers")
        g.update({k: v for k, v in match[0].items() if k not in ("params", "is_expert_parallel")})
    # A plain optimizer's state dict (torch's: "state" beside "param_groups") keeps Adam's step
    # as state["common_step"], which the request for loading does not hold yet.
    steps = _find(saved, "common_step")
    if steps:
        for d in _dicts_with(target, "param_groups"):
            if isinstance(d.get("state"), dict):
                d["state"]["common_step"] = steps[0]
    scalers = _find(saved, "grad_scaler")
    if scalers:
        for d in _dicts_with(target, "grad_scaler"):
            d["grad_scaler"] = scalers[0]


def _dicts_with(x: Any, key: str) -> Iterator[dict]:
    if isinstance(x, dict):
        if key in x:
            yield x
        for v in x.values():
            yield from _dicts_with(v, key)


def load_converted(request: dict, ckpt_dir: PathLike, load: Callable[[dict, PathLike], dict]) -> dict:
    """Load ``request`` (``{"optimizer": sharded optimizer state, "scheduler": ...}``) from a
    checkpoint saved with other optimizer keys or nesting (see the module docstring) with
    ``load`` (a collective ``dist_checkpointing.load``); returns what ``optimizer.load_state_dict``
    takes, in this optimizer's nesting, and the scheduler's state."""
    by_plain: Dict[str, str] = {}
    for key in load_tensors_metadata(str(ckpt_dir)):
        by_plain.setdefault(_plain_key(key), key)
    leaves = list(_leaves(request["optimizer"]))
    only: dict = {}
    for path, leaf in leaves:
        if not isinstance(leaf, ShardedBase):
            continue
        saved_key = by_plain.get(_plain_key(leaf.key))
        if saved_key is None:
            raise ValueError(f"optimizer state in {ckpt_dir} has no {_plain_key(leaf.key)!r}; it was "
                             f"saved for another model")
        leaf.key = saved_key
        node = only
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = leaf
    loaded = load({"optimizer": only, "scheduler": request["scheduler"]}, ckpt_dir)
    saved_common = load_common_state_dict(str(ckpt_dir))["optimizer"]
    target = request["optimizer"]
    for path, leaf in leaves:
        parent = _get(target, path[:-1])
        parent[path[-1]] = (_get(loaded["optimizer"], path) if isinstance(leaf, ShardedBase) else leaf.unwrap())
    _put_saved_common(target, saved_common, ckpt_dir)
    return {"optimizer": target, "scheduler": loaded["scheduler"]}
