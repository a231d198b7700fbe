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
``/begin_weight_update`` ... ``/end_weight_update``, then ``/flush_cache`` (SGLang's protocol, not
ours: its server decides it; the group, the threads and the sends come from ``weight_sync``).

Memory: the server is not on the trainer's GPUs, so the release phase has nothing to free
(it says so once).
"""

from __future__ import annotations

import logging
import sys
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..weight_sync import (PeerCalls, dtype_name, form_group, group_link, init_named_weight_group, iter_buckets,
                           route_address, send_each)
from .base import GenerationResult, MemoryRelease, RolloutEngine, SamplingParams, register_engine
from .routed_experts import moe_layout
from .sglang_engine import RAW_LOGPROB_ENV, moe_kwargs, sglang_rows, to_result
from .http import EngineFailure, request_json
from .interruptible import run_requests
from .spec import EngineSpec
from .vllm_server import ServerCommand

__all__ = ["SGLangServerEngine", "server_command"]

log = logging.getLogger(__name__)


def server_command(spec: EngineSpec, host: str = "0.0.0.0", port: int = 30000) -> ServerCommand:
    """The spec as ``sglang.launch_server`` flags (SGLang 0.5.23's names)."""
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", spec.model_path,
            "--host", host, "--port", str(port), "--tp-size", str(spec.tp), "--dtype", spec.dtype,
            "--context-length", str(spec.context_length),
            "--mem-fraction-static", str(spec.gpu_memory_utilization),
            "--random-seed", str(spec.seed), "--skip-tokenizer-init"]
    moe = moe_kwargs(spec)  # a mixture-of-experts policy: expert parallel, routing when asked
    if "ep_size" in moe:
        argv += ["--ep-size", str(moe["ep_size"])]
    if moe.get("enable_return_routed_experts"):
        argv.append("--enable-return-routed-experts")
    return ServerCommand(tuple(argv), {RAW_LOGPROB_ENV: "false"})


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
        return_routed_experts / model_path: results carry the server's routed experts (the
            server runs with ``--enable-return-routed-experts``, which ``server_command`` adds
            when the spec asks); ``model_path``: the checkpoint whose MoE layers they cover.
    """

    def __init__(self, *, base_url: str, engine_world_size: int = 1, expect: Optional[dict] = None,
                 group_host: Optional[str] = None, group_name: str = "stare_weights",
                 weight_backend: Optional[str] = None, bucket_bytes: int = 512 << 20,
                 request_timeout_s: float = 600.0, max_concurrency: int = 64,
                 return_routed_experts: bool = False, model_path: Optional[str] = None):
        if return_routed_experts and (model_path is None or moe_layout(model_path) is None):
            raise ValueError(f"sglang-server: return_routed_experts needs the mixture-of-experts checkpoint's "
                             f"model_path (got {model_path})")
        self._moe = moe_layout(model_path) if return_routed_experts else None
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
                   weight_backend="nccl" if spec.cuda else "gloo", bucket_bytes=spec.sync_bucket_bytes,
                   return_routed_experts=spec.return_routed_experts, model_path=spec.model_path)

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
            body = {"input_ids": input_ids[i], "sampling_params": sp[i], "return_logprob": True}
            if self._moe is not None:
                body["return_routed_experts"] = True
            return to_result(rows[i], self._post("/generate", body), self._moe)

        return run_requests(len(rows), one, max_workers=self.max_concurrency, interrupted=self.interrupted,
                            abort=self.abort_requests)

    def abort_requests(self) -> None:
        """End every request in flight (a preemption: ``rollout/interruptible.py``)."""
        self._post("/abort_request", {"rid": "", "abort_all": True})

    def _ensure_group(self) -> dist.ProcessGroup:
        if self._group is None:
            def join(port: int) -> None:
                self._post("/init_weights_update_group", {
                    "master_address": self.group_host, "master_port": port, "rank_offset": 1,
                    "world_size": 1 + self.world, "group_name": self.group_name,
                    "backend": self.weight_backend})

            self._group = form_group([join], lambda port, sock: init_named_weight_group(
                self.group_host, port, 0, 1 + self.world, self.group_name, self.weight_backend,
                self.request_timeout_s, listen_socket=sock), self.group_host)
        return self._group

    def update_weights(self, named_tensors: Iterable[Tuple[str, Tensor]]) -> None:
        """SGLang's own wire format (its server decides it): per bucket, the names/dtypes/shapes
        over HTTP, then one broadcast per tensor in order (``weight_sync.iter_buckets`` groups)."""
        self.check_can_load_weights()
        group = self._ensure_group()
        device = torch.device("cuda", torch.cuda.current_device()) if self.weight_backend == "nccl" \
            else torch.device("cpu")
        self._post("/begin_weight_update")
        try:
            for bucket in iter_buckets(named_tensors, self.bucket_bytes):
                calls = PeerCalls([lambda b=bucket: self._post("/update_weights_from_distributed", {
                    "names": [n for n, _ in b],
                    "dtypes": [dtype_name(x.dtype) for _, x in b],
                    "shapes": [list(x.shape) for _, x in b],
                    "group_name": self.group_name, "flush_cache": False})])
                try:
                    send_each(group_link(group, 0), (x for _, x in bucket), device)
                finally:
                    errors = calls.join()
                if errors:
                    raise errors[0]
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
