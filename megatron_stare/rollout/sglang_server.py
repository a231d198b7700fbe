"""``sglang-server``: an SGLang HTTP server started elsewhere, on GPUs of its own. GPU only.

The trainer attaches to ``rollout.server_urls[0]``; ``server_command(spec)`` is the command a
launch script starts it with (``python -m megatron_stare.rollout.server_cmd`` prints it):
``python -m sglang.launch_server`` with the spec's ``--tp-size``, ``--dtype``,
``--context-length``, ``--mem-fraction-static``, ``--random-seed`` and
``--skip-tokenizer-init`` (flag names checked against SGLang 0.5.23's ``ServerArgs``), and
``SGLANG_RETURN_ORIGINAL_LOGPROB=false`` (the log-prob convention). Attaching reads the
server's ``/server_info`` and fails in one line when its TP size, dtype or context length do
not match the run.

Weights: ``/init_weights_update_group`` (the trainer is rank 0 of a group named
``group_name``), then per bucket ``/update_weights_from_distributed`` with the bucket's
names/dtypes/shapes while the trainer broadcasts each tensor of the bucket in order, inside
``/begin_weight_update`` ... ``/end_weight_update``, then ``/flush_cache``.

Memory: the server is not on the trainer's GPUs, so the release phase has nothing to free
(it says so once).
"""

from __future__ import annotations

import logging
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..weight_sync.plan import dtype_name, iter_buckets
from .base import GenerationResult, MemoryRelease, RolloutEngine, SamplingParams, register_engine
from .sglang_engine import RAW_LOGPROB_ENV, sglang_rows, to_result
from .http import EngineFailure, request_json
from .spec import EngineSpec
from .vllm_server import ServerCommand, _free_port, route_address

__all__ = ["SGLangServerEngine", "init_named_weight_group", "server_command"]

log = logging.getLogger(__name__)


def server_command(spec: EngineSpec, host: str = "0.0.0.0", port: int = 30000) -> ServerCommand:
    """The spec as ``sglang.launch_server`` flags (SGLang 0.5.23's names)."""
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", spec.model_path,
            "--host", host, "--port", str(port), "--tp-size", str(spec.tp), "--dtype", spec.dtype,
            "--context-length", str(spec.context_length),
            "--mem-fraction-static", str(spec.gpu_memory_utilization),
            "--random-seed", str(spec.seed), "--skip-tokenizer-init"]
    return ServerCommand(tuple(argv), {RAW_LOGPROB_ENV: "false"})


def init_named_weight_group(host: str, port: int, rank: int, world_size: int, group_name: str,
                            backend: str, timeout_s: float = 600.0,
                            register_as: Optional[str] = None) -> dist.ProcessGroup:
    """One member of a named weight-update group formed like SGLang's workers form theirs in
    ``init_weights_update_group``: TCP rendezvous at ``host:port`` (rank 0 hosts the store), a
    prefix store named after the group. The trainer is rank 0. The default group, if any, is
    left untouched. ``register_as``: the local registry name (default ``group_name``; two ends in
    one process, as in tests, need distinct ones)."""
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper,
                                                    _world, rendezvous)

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{host}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend),
                                      PrefixStore(group_name, store),
                                      group_name=register_as or group_name,
                                      timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


@register_engine("sglang-server")
class SGLangServerEngine(RolloutEngine):
    """An SGLang HTTP server started elsewhere (``server_command``), driven over HTTP.

    Args:
        base_url: ``http://host:port`` of the server.
        engine_world_size: the server's TP size (its workers join the weight group as 1..W).
        expect: what the server must report in ``/server_info`` (``tp_size``, ``dtype``,
            ``context_length``; the last as a minimum); empty: no check.
        group_host: address of this trainer process reachable from the server (default: the
            address this machine routes to the server from).
        weight_backend: ``"nccl"`` on GPUs (``"gloo"`` for CPU tests of the protocol).
    """

    def __init__(self, *, base_url: str, engine_world_size: int = 1, expect: Optional[dict] = None,
                 group_host: Optional[str] = None, group_name: str = "stare_weights",
                 weight_backend: Optional[str] = None, bucket_bytes: int = 512 << 20,
                 request_timeout_s: float = 600.0, max_concurrency: int = 64):
        self.base_url = base_url.rstrip("/")
        self.world = engine_world_size
        self.group_host = group_host or route_address(self.base_url)
        self.group_name = group_name
        self.weight_backend = weight_backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.bucket_bytes = bucket_bytes
        self.request_timeout_s = request_timeout_s
        self.max_concurrency = max_concurrency
        self._group: Optional[dist.ProcessGroup] = None
        if expect:
            self._check_server(expect)

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> "SGLangServerEngine":
        return cls(base_url=spec.server_urls[0], engine_world_size=spec.tp,
                   expect={"tp_size": spec.tp, "dtype": spec.dtype, "context_length": spec.context_length},
                   weight_backend="nccl" if spec.cuda else "gloo", bucket_bytes=spec.sync_bucket_bytes)

    def _check_server(self, expect: dict) -> None:
        """The server must honour the spec; one line naming every difference otherwise."""
        info = self._get("/server_info")
        bad = [k for k, v in expect.items()
               if ((info.get(k) or 0) < v if k == "context_length" else info.get(k) != v)]
        if bad:
            cmd = "python -m megatron_stare.rollout.server_cmd"
            raise ValueError(f"sglang-server at {self.base_url} does not match the run: "
                             + ", ".join(f"{k} {info.get(k)!r} (the run needs {expect[k]!r})" for k in bad)
                             + f"; start it with the command `{cmd}` prints")

    def _get(self, path: str):
        return request_json(self.base_url + path, None, method="GET", timeout=self.request_timeout_s,
                            server="SGLang server", failure=self._failure)

    def _failure(self, path: str, e: BaseException) -> EngineFailure:
        # Started elsewhere: no pid or log of ours to show; its own log says why.
        detail = str(e).splitlines()[0] if str(e) else ""
        return EngineFailure(f"sglang-server at {self.base_url} failed during {path} "
                             f"({type(e).__name__}: {detail}): is it still up? See its own log")

    def _post(self, path: str, body: Optional[dict] = None):
        out = request_json(self.base_url + path, body or {}, method="POST", timeout=self.request_timeout_s,
                           server="SGLang server", failure=self._failure)
        if isinstance(out, dict) and out.get("success") is False:
            raise RuntimeError(f"SGLang server {path} refused: {out.get('message')}")
        return out

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams,
                 prompt_indices: Optional[Sequence[int]] = None) -> List[GenerationResult]:
        self.check_can_generate()
        rows, input_ids, sp = sglang_rows(prompt_token_ids, params, prompt_indices)

        def one(i: int) -> GenerationResult:
            out = self._post("/generate", {"input_ids": input_ids[i], "sampling_params": sp[i],
                                           "return_logprob": True})
            return to_result(rows[i], out)

        with ThreadPoolExecutor(max_workers=max(1, min(len(rows), self.max_concurrency))) as pool:
            return list(pool.map(one, range(len(rows))))

    def _in_thread(self, path: str, body: dict) -> Tuple[threading.Thread, dict]:
        box: dict = {}

        def call():
            try:
                box["result"] = self._post(path, body)
            except BaseException as e:  # noqa: BLE001 - re-raised by the caller
                box["error"] = e

        t = threading.Thread(target=call)
        t.start()
        return t, box

    def _ensure_group(self) -> dist.ProcessGroup:
        if self._group is None:
            port = _free_port(self.group_host)
            t, box = self._in_thread("/init_weights_update_group", {
                "master_address": self.group_host, "master_port": port, "rank_offset": 1,
                "world_size": 1 + self.world, "group_name": self.group_name,
                "backend": self.weight_backend})
            try:
                self._group = init_named_weight_group(self.group_host, port, 0, 1 + self.world,
                                                      self.group_name, self.weight_backend,
                                                      self.request_timeout_s)
            finally:
                t.join()
            if "error" in box:
                raise box["error"]
        return self._group

    def update_weights(self, named_tensors: Iterable[Tuple[str, Tensor]]) -> None:
        self.check_can_load_weights()
        group = self._ensure_group()
        device = torch.device("cuda", torch.cuda.current_device()) if self.weight_backend == "nccl" \
            else torch.device("cpu")
        self._post("/begin_weight_update")
        try:
            for bucket in iter_buckets(named_tensors, self.bucket_bytes):
                t, box = self._in_thread("/update_weights_from_distributed", {
                    "names": [n for n, _ in bucket],
                    "dtypes": [dtype_name(x.dtype) for _, x in bucket],
                    "shapes": [list(x.shape) for _, x in bucket],
                    "group_name": self.group_name, "flush_cache": False})
                try:
                    for _, x in bucket:
                        group.broadcast(x.detach().contiguous().to(device), 0).wait()
                finally:
                    t.join()
                if "error" in box:
                    raise box["error"]
        finally:
            self._post("/end_weight_update")
        self._post("/flush_cache")

    @property
    def memory_release(self) -> MemoryRelease:
        return MemoryRelease(False, "the server runs on GPUs of its own; nothing to release there")

    def shutdown(self) -> None:
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None
