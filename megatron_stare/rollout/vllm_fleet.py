"""``vllm-server``: one vLLM server, or several behind the dispatcher (``rollout.server_urls``).

``VLLMServerFleet.from_spec`` builds ``vllm_server.VLLMServerEngine`` for a spawned server or
one URL; for several URLs, it attaches to each (each checked against the spec) and returns a
fleet that is one engine to the trainer:

- generation: each prompt is one request, placed by ``dispatch.Dispatcher`` on the server
  with the least outstanding tokens when a slot of the window (``max_concurrency`` per
  server) frees up, seeded by its batch index (so the answer does not depend on the server);
  results come back in prompt order;
- weights: ONE process group holds the trainer (rank 0) and every worker of every server
  (``VLLMServerEngine.open_weight_group``, on ``weight_sync.form_group``), so each bucket is
  broadcast once and reaches all servers; every server then resets its prefix cache;
- checksums: a tensor's checksum is reported only where every server holds the same bytes
  (otherwise None, which the trainer's verification reports as a mismatch);
- memory: attached servers run on GPUs of their own and release nothing.
"""

from __future__ import annotations

import logging
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from torch import Tensor

from ..weight_sync import SyncStats, TensorChecksum
from .base import GenerationResult, MemoryRelease, RolloutEngine, SamplingParams, batch_indices, register_engine
from .dispatch import Dispatcher, DispatchStats
from .spec import EngineSpec
from .vllm_server import VLLMServerEngine

__all__ = ["VLLMServerFleet"]

log = logging.getLogger(__name__)


@register_engine("vllm-server")
class VLLMServerFleet(RolloutEngine):
    """Several attached vLLM servers as one engine (see the module docstring).

    Args:
        servers: attached ``VLLMServerEngine`` clients (the fleet shuts them down).
        policy: the dispatcher's placement policy (``least_work``; ``round_robin`` for tests).
        window_per_server: requests in flight per server (the dispatcher's window is this
            times the number of servers).
    """

    def __init__(self, servers: Sequence[VLLMServerEngine], *, policy: str = "least_work",
                 window_per_server: Optional[int] = None):
        if len(servers) < 1:
            raise ValueError("a vllm-server fleet needs at least one server")
        self.servers = list(servers)
        first = self.servers[0]
        self.weight_backend, self.request_timeout_s = first.weight_backend, first.request_timeout_s
        self.record_checksums = first.record_checksums
        self.host = first.host
        per = window_per_server or first.max_concurrency
        self.dispatcher = Dispatcher(len(self.servers), window=per * len(self.servers), policy=policy)
        self._group = None
        self.last_sync: Optional[SyncStats] = None

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> RolloutEngine:
        if len(spec.server_urls) <= 1:
            return VLLMServerEngine.from_spec(spec)
        servers: List[VLLMServerEngine] = []
        try:
            for url in spec.server_urls:
                servers.append(VLLMServerEngine.from_spec(spec, url=url))
        except BaseException:
            for s in servers:
                s.shutdown()
            raise
        return cls(servers)

    @property
    def dispatch_stats(self) -> DispatchStats:
        """Where the last ``generate`` sent its requests."""
        return self.dispatcher.last

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams,
                 prompt_indices: Optional[Sequence[int]] = None) -> List[GenerationResult]:
        self.check_can_generate()
        idx = batch_indices(prompt_token_ids, prompt_indices)
        # Outstanding work of a request, in tokens: its prompt and all it may generate.
        costs = [len(p) + params.n * params.max_new_tokens for p in prompt_token_ids]
        outs = self.dispatcher.run(
            costs, lambda b, j: self.servers[b].complete(prompt_token_ids[j], params, idx[j]),
            interrupted=self.interrupted, abort=lambda: [s.abort_requests() for s in self.servers])
        return [r for rs in outs for r in rs]

    # ---------------------------------------------------------------- weights
    def update_weights(self, named_tensors: Iterable[Tuple[str, Tensor]]) -> None:
        self._push(lambda sender: sender.send(named_tensors, self.servers[0].bucket_bytes))

    def update_weights_from_buckets(self, buckets: Iterable) -> None:
        self._push(lambda sender: sender.send_buckets(buckets))

    def _push(self, send) -> None:
        self.check_can_load_weights()
        if self._group is None:
            self._group = VLLMServerEngine.open_weight_group(self.servers, self.host, self.weight_backend,
                                                             self.request_timeout_s)
        self.last_sync = VLLMServerEngine.push_weights(self.servers, self._group, self.weight_backend, send)

    def checksum(self, names: Sequence[str]) -> Dict[str, Optional[TensorChecksum]]:
        per = [s.checksum(names) for s in self.servers]
        out: Dict[str, Optional[TensorChecksum]] = {}
        for n in names:
            got = [p.get(n) for p in per]
            same = all(g is not None and got[0] is not None and g.digest == got[0].digest for g in got)
            out[n] = got[0] if same else None
        return out

    @property
    def memory_release(self) -> MemoryRelease:
        return MemoryRelease(False, "attached servers run on GPUs of their own; nothing to release there")

    def shutdown(self) -> None:
        if self._group is not None:
            try:
                from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

                stateless_destroy_torch_distributed_process_group(self._group)
            except Exception as e:  # noqa: BLE001 - the servers stay up regardless
                log.debug("weight group teardown: %s", e)
            self._group = None
        for s in self.servers:
            s.shutdown()
