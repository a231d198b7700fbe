"""The distributed optimizer's ``fully_reshardable`` save at DP1 without megatron-core's gather.

megatron-core 0.16.1 builds the ``fully_reshardable`` optimizer state for a save
(``DistributedOptimizer.sharded_param_state_fully_reshardable``) from ``get_parameter_state_dp_zero``:
per gradient buffer, three zero-filled fp32 "world" buffers of the whole buffer, per bucket three
zero-filled local shards, a copy of every parameter's fp32 main param and Adam moments into them,
an ``all_gather`` over the DP group and a ``torch.cat``, a copy into the world buffers, and finally
one slice (a view) of those per parameter and state. At DP1 the gather is a copy of the one local
shard, so a save makes four full copies of the optimizer state, and the write then clones each
view again (megatron-core's ``_clone_if_needed``: ``torch.save`` of a view would write its whole
storage). On CPU that is most of what a background save blocks the step for
(``benchmarks/bench_checkpoint.py``).

At DP1 every parameter's state is this rank's own whole tensor, so ``dp1_fully_reshardable``
hands megatron-core those tensors themselves (reshaped to the parameter's shape; on a GPU, copied
to the host as megatron-core does) in the same ``ShardedTensor``\\ s (keys, replica ids, dtype,
shape, order): the files are byte-for-byte the same. No copy is made on CPU: a synchronous save's
writer workers and a background save's writer process are forked before the trainer touches
the state again, and the fork is the snapshot (copy-on-write).

The fast path is taken only where it provably gives megatron-core's values: DP size 1, not
loading, not the memory-efficient variant, no Megatron-FSDP, fp32 state, and every parameter's
place in megatron-core's world buffer (its bucket's unpadded offset plus its range in the bucket)
equal to the range ``param_index_map`` slices. Anything else runs megatron-core's own code.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import replace
from typing import Any, Dict, Optional

import torch

_KEYS = ("param", "exp_avg", "exp_avg_sq")  # megatron-core's world-tensor keys, in its order


def _world_ranges(opt, gbuf_idx: int, gbuf_range_maps) -> Optional[Dict[Any, tuple]]:
    """``{model_param: (world_start, world_end)}`` where megatron-core's DP1 gather puts each
    parameter of buffer ``gbuf_idx`` (its bucket's unpadded offset plus its bucket range); None
    where that differs from ``param_index_map`` (then megatron-core's own path is used)."""
    buffer = opt.buffers[gbuf_idx]
    if len(gbuf_range_maps) != 1:
        return None
    ranges, offset = {}, 0
    (per_bucket,) = gbuf_range_maps.values()
    for bucket_idx, gbuf_range_map in enumerate(per_bucket):
        for model_param, rmap in gbuf_range_map["param_map"].items():
            local = rmap["gbuf_local"]
            ranges[model_param] = (offset + local.start, offset + local.end)
        offset += buffer.buckets[bucket_idx].numel_unpadded
    for model_param, (start, end, _) in buffer.param_index_map.items():
        if ranges.get(model_param) != (start, end) or end > buffer.numel_unpadded:
            return None
    return ranges


def _param_state(opt, model_sharded_state_dict) -> Optional[dict]:
    """megatron-core's ``sharded_param_state_fully_reshardable`` (save, DP1) without its copies;
    None where the fast path does not provably apply."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    model_sd, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    meta_of = {sh.data: sh for sh in nested_values(model_sd)}
    out, param_idx = {}, 0
    for gbuf_idx, gbuf_range_maps in enumerate(opt.gbuf_ranges):
        ranges = _world_ranges(opt, gbuf_idx, gbuf_range_maps)
        if ranges is None:
            return None
        for model_param, (start, end, _) in opt.buffers[gbuf_idx].param_index_map.items():
            sharded_metadata = meta_of.get(model_param)
            if sharded_metadata is None or sharded_metadata.flattened_range is not None:
                return None  # megatron-core raises or asserts here: let it
            states = opt._get_main_param_and_optimizer_states(model_param)
            tensors = {}
            for key in _KEYS:
                t = states.get(key)
                if (not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != end - start
                        or t.numel() != sharded_metadata.data.numel()):
                    return None
                t = t.detach()
                if t.device.type != "cpu":
                    t = t.cpu()  # megatron-core stages on the host too
                t = t.reshape(sharded_metadata.data.shape)
                kwargs = dict(key=f"optimizer.state.{key}.{sharded_metadata.key}", data=t, dtype=t.dtype,
                              replica_id=sharded_metadata.replica_id)
                if isinstance(sharded_metadata, ShardedTensorFactory):
                    kwargs.pop("dtype")
                tensors[key] = replace(sharded_metadata, **kwargs)
                tensors[key].validate_metadata_integrity()
            out[param_idx] = tensors
            param_idx += 1
    return out


@contextlib.contextmanager
def dp1_fully_reshardable(optimizer):
    """While saving: the ``fully_reshardable`` parameter state of each DP1 distributed optimizer
    in ``optimizer`` (a chained one too) is built from its own state tensors (module docstring)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron.core.optimizer import distrib_optimizer

    patched, slow = [], []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, DistributedOptimizer) or opt.data_parallel_group.size() != 1:
            continue
        if getattr(getattr(opt, "ddp_config", None), "use_megatron_fsdp", False):
            continue
        original = opt.sharded_param_state_fully_reshardable

        def fast(model_sharded_state_dict, is_loading=False, metadata=None, _opt=opt, _original=original):
            state = None
            if not is_loading and not (metadata or {}).get("distrib_optim_fully_reshardable_mem_efficient"):
                state = _param_state(_opt, model_sharded_state_dict)
            if state is None:
                slow.append(_opt)
                return _original(model_sharded_state_dict, is_loading, metadata)
            return state

        opt.sharded_param_state_fully_reshardable = fast
        patched.append(opt)
    if not patched:
        yield
        return
    # megatron-core runs a full ``gc.collect()`` after building this state (for its freed world
    # buffers; about 0.3 s on a loaded CPU heap): the fast path frees none, so it is skipped then.
    distrib_optimizer.gc = _CollectUnlessSlow(slow)
    try:
        yield
    finally:
        distrib_optimizer.gc = gc
        for opt in patched:
            del opt.sharded_param_state_fully_reshardable  # back to the class's method


class _CollectUnlessSlow:
    """``distrib_optimizer``'s ``gc`` while saving: ``collect`` only once megatron-core's own
    (buffer-allocating) path ran for some optimizer."""

    def __init__(self, slow: list) -> None:
        self.slow = slow

    def collect(self, *args, **kwargs) -> int:
        return gc.collect(*args, **kwargs) if self.slow else 0

    def __getattr__(self, name: str):
        return getattr(gc, name)
