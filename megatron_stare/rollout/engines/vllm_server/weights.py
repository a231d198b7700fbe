"""One weight group for one or several vLLM servers: the trainer (rank 0) and every worker of
every server, so ONE broadcast of each bucket reaches all of them (the engine and the fleet)."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Sequence

import torch

from megatron_stare.rollout.http import EngineFailure
from megatron_stare.weight_sync import SyncStats, form_group, push_to_group

__all__ = ["open_weight_group", "push_weights"]

log = logging.getLogger(__name__)


def open_weight_group(servers: Sequence, host: str, backend: str, timeout_s: float):
    """One weight-broadcast group (``servers``: ``VLLMServerEngine``s): this process (rank 0) and every worker of every server in
    ``servers`` (server ``k``'s workers are ranks ``1 + sum of the earlier servers' sizes`` on),
    so ONE broadcast of each bucket reaches all of them. Set up over ``/collective_rpc``."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    world = 1 + sum(s.world for s in servers)
    offsets = [1 + sum(s.world for s in servers[:k]) for k in range(len(servers))]
    joins = [lambda port, s=s, o=o: s.join_weight_group(host, port, world, o) for s, o in zip(servers, offsets)]
    return form_group(joins, lambda port, sock: stateless_init_torch_distributed_process_group(
        host, port, 0, world, backend, listen_socket=sock, timeout=timedelta(seconds=timeout_s)), host)

def push_weights(servers: Sequence, group, backend: str, send) -> SyncStats:
    """Every server reloads from the stream ``send(sender)`` broadcasts over ``group`` (made by
    ``open_weight_group`` for the same ``servers``), then resets its prefix cache."""
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def broken(e: RuntimeError, errors) -> BaseException:  # most likely a server is gone
        failed = next((x for x in errors if isinstance(x, EngineFailure)), None)
        return failed or servers[0].failure("the weight push", e)

    stats = push_to_group(group, device, [s.receive_weights for s in servers], send, broken)
    for s in servers:
        s.reset_prefix_cache()
    log.info("vllm server%s: pushed %d tensors (%.1f MB) in %d buckets, %.2fs",
             "s" if len(servers) > 1 else "", stats.num_tensors, stats.bytes / 2 ** 20, stats.num_buckets,
             stats.seconds)
    return stats
