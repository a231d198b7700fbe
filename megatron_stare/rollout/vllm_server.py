"""``vllm-server``: a vLLM OpenAI server in its own process; weights pushed over a process group.

The engine starts ``python -m vllm.entrypoints.openai.api_server`` with
``VLLM_SERVER_DEV_MODE=1`` (which exposes ``/collective_rpc``, ``/reset_prefix_cache``,
``/sleep``, ``/wake_up``) and our worker extension. Generation goes over HTTP to
``/v1/completions`` with token-id prompts, ``logprobs=0`` and ``return_token_ids``: no text,
no tokenizer round trip on our side.

Weights: on the first update the trainer and every engine worker form a process group
(trainer = rank 0, workers = 1..W) with vLLM's stateless helper - gloo on CPU, NCCL on GPU -
set up from the worker extension through ``/collective_rpc``. Each update then runs
``stare_receive_weights`` on the workers (an HTTP call that returns when the reload is done,
issued from a helper thread) while this process broadcasts the HF stream in flat buckets of
``bucket_bytes``; then the prefix cache is reset.

The server process (and the engine-core process it spawns) runs in its own session, so
``shutdown()`` ends exactly that process group; an ``atexit`` hook makes sure it does.

Failures: every HTTP call is bounded by ``request_timeout_s`` (per socket operation) and the
weight group by the same timeout. A call that fails on the transport (connection refused or
reset, a timeout) or a weight push that breaks raises ``EngineFailure``: one line naming the
server (pid, URL), whether it died (exit code) or stopped answering, and the call, followed by
the tail of the server's log. A server that dies mid-request closes its sockets, so the error
comes at once rather than after the timeout.
"""

from __future__ import annotations

import atexit
import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..weight_sync.plan import TensorChecksum
from ..weight_sync.transport import ProcessGroupSender, SyncStats
from .base import GenerationResult, RolloutEngine, SamplingParams, register_engine, sample_seed
from .vllm_engine import WORKER_EXTENSION

__all__ = ["EngineFailure", "VLLMServerEngine"]

log = logging.getLogger(__name__)

SERVED_NAME = "stare-policy"


#: Transport-level failures of an HTTP call (``HTTPError``, a reply, is handled apart).
TRANSPORT_ERRORS = (urllib.error.URLError, http.client.HTTPException, OSError)


class EngineFailure(RuntimeError):
    """A rollout server died or stopped answering; the first line names it."""


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@register_engine("vllm-server")
class VLLMServerEngine(RolloutEngine):
    """A vLLM server process driven over HTTP, weights over a gloo/NCCL group.

    Args:
        model_path: HF checkpoint directory the server starts from.
        host / port: where the server listens (default a free port on 127.0.0.1).
        seed, max_model_len, dtype, enforce_eager, tensor_parallel_size: server flags.
        extra_args: more server command-line flags.
        env: extra environment for the server (``OMP_NUM_THREADS=1`` is the default there).
        bucket_bytes: flat bucket size of the weight broadcast.
        weight_backend: ``"gloo"`` (CPU default) or ``"nccl"`` (GPU default).
        record_checksums: workers record checksums of received tensors (see ``checksum``).
        startup_timeout_s / request_timeout_s: readiness wait; per HTTP call and group timeout.
        max_concurrency: parallel HTTP requests (the server batches them).
        keep_log: keep the server's log file after ``shutdown()`` (its tail is in every
            start-up error anyway).
    """

    def __init__(self, model_path: str, *, host: str = "127.0.0.1", port: Optional[int] = None,
                 seed: int = 0, max_model_len: int = 2048, dtype: str = "float32",
                 enforce_eager: Optional[bool] = None, tensor_parallel_size: int = 1,
                 extra_args: Sequence[str] = (), env: Optional[Dict[str, str]] = None,
                 bucket_bytes: int = 256 << 20, weight_backend: Optional[str] = None,
                 record_checksums: bool = False, startup_timeout_s: float = 300.0,
                 request_timeout_s: float = 600.0, max_concurrency: int = 64,
                 keep_log: bool = False):
        cuda = torch.cuda.is_available()
        self.keep_log = keep_log
        self.host, self.port = host, port or _free_port(host)
        self.base_url = f"http://{host}:{self.port}"
        self.bucket_bytes = bucket_bytes
        self.weight_backend = weight_backend or ("nccl" if cuda else "gloo")
        self.world = tensor_parallel_size
        self.record_checksums = record_checksums
        self.request_timeout_s = request_timeout_s
        self.max_concurrency = max_concurrency
        self.cpu = not cuda
        self._group = None
        self.last_sync: Optional[SyncStats] = None
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(model_path), "--served-model-name", SERVED_NAME,
               "--host", host, "--port", str(self.port), "--dtype", dtype, "--seed", str(seed),
               "--max-model-len", str(max_model_len),
               "--tensor-parallel-size", str(tensor_parallel_size),
               "--worker-extension-cls", WORKER_EXTENSION, *extra_args]
        if (self.cpu if enforce_eager is None else enforce_eager):
            cmd.append("--enforce-eager")
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {}), "VLLM_SERVER_DEV_MODE": "1"}
        self._log = tempfile.NamedTemporaryFile(prefix="vllm_server_", suffix=".log", delete=False)
        log.info("starting vLLM server on %s (log: %s)", self.base_url, self._log.name)
        self._proc = subprocess.Popen(cmd, env=full_env, stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        atexit.register(self.shutdown)
        try:
            self._wait_ready(startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    # ---------------------------------------------------------------- process & HTTP
    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines of the server's log (for error messages)."""
        with open(self._log.name, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def failure(self, what: str, err: BaseException) -> EngineFailure:
        """``EngineFailure`` for ``what`` (a call that failed with ``err``): dead or not answering."""
        proc, code = self._proc, None
        if proc is not None:
            try:  # a server that is going down may take a moment to be reaped
                code = proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        pid = proc.pid if proc is not None else "shut down"
        state = (f"died with exit code {code}" if code is not None
                 else f"did not answer ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})")
        return EngineFailure(f"vllm-server (pid {pid}, {self.base_url}) {state} during {what}; "
                             f"its log tail ({self._log.name}):\n{self.log_tail()}")

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with code {self._proc.returncode} during "
                                   f"start-up; log tail:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(1.0)
        raise RuntimeError(f"vLLM server not ready after {timeout_s:.0f}s; log tail:\n{self.log_tail()}")

    def _request(self, path: str, body: Optional[dict] = None, method: str = "POST"):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.request_timeout_s) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"vLLM server {path} failed ({e.code}): "
                               f"{e.read().decode(errors='replace')[:2000]}") from None
        except TRANSPORT_ERRORS as e:
            raise self.failure(path.split("?")[0], e) from None
        return json.loads(raw) if raw else None

    def _rpc(self, method: str, *args: str) -> list:
        """Call a worker-extension method on every worker; returns the per-worker results."""
        out = self._request("/collective_rpc", {"method": method, "args": list(args),
                                                "timeout": self.request_timeout_s})
        return out["results"] if out else []

    # ---------------------------------------------------------------- generation
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams
                 ) -> List[GenerationResult]:
        def one(i: int) -> List[GenerationResult]:
            body = {
                "model": SERVED_NAME, "prompt": list(prompt_token_ids[i]), "n": params.n,
                "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                "max_tokens": params.max_new_tokens, "stop_token_ids": list(params.stop_token_ids),
                "ignore_eos": params.ignore_eos, "logprobs": 0, "return_token_ids": True,
                "skip_special_tokens": False,
                "seed": None if params.seed is None else sample_seed(params.seed, i),
            }
            choices = sorted(self._request("/v1/completions", body)["choices"],
                             key=lambda c: c["index"])
            results = []
            for s, c in enumerate(choices):
                reason = c["finish_reason"]
                if reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM server request ended with finish_reason={reason!r}")
                lps = torch.tensor(c["logprobs"]["token_logprobs"], dtype=torch.float32)
                results.append(GenerationResult(i, s, list(c["token_ids"]), lps, reason))
            return results

        n = len(prompt_token_ids)
        with ThreadPoolExecutor(max_workers=max(1, min(n, self.max_concurrency))) as pool:
            return [r for rs in pool.map(one, range(n)) for r in rs]

    # ---------------------------------------------------------------- weights
    def _ensure_weight_group(self) -> None:
        if self._group is not None:
            return
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        port = _free_port(self.host)
        spec = json.dumps({"host": self.host, "port": port, "world_size": 1 + self.world,
                           "rank_offset": 1, "backend": self.weight_backend,
                           "timeout_s": self.request_timeout_s})
        box: Dict[str, object] = {}
        joiner = threading.Thread(target=self._call_into, args=(box, "stare_init_weight_group", spec))
        joiner.start()
        try:
            self._group = stateless_init_torch_distributed_process_group(
                self.host, port, 0, 1 + self.world, self.weight_backend,
                timeout=timedelta(seconds=self.request_timeout_s))
        finally:
            joiner.join()
        if "error" in box:
            raise box["error"]  # type: ignore[misc]

    def _call_into(self, box: dict, method: str, *args: str) -> None:
        try:
            box["result"] = self._rpc(method, *args)
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller's thread
            box["error"] = e

    def update_weights(self, named_tensors: Iterable[Tuple[str, Tensor]]) -> None:
        self._push(lambda sender: sender.send(named_tensors, self.bucket_bytes))

    def update_weights_from_buckets(self, buckets: Iterable) -> None:
        """Broadcast ready-made flat buckets (e.g. the Megatron export's) without repacking."""
        self._push(lambda sender: sender.send_buckets(buckets))

    def _push(self, send) -> None:
        self._ensure_weight_group()
        device = (torch.device("cuda", torch.cuda.current_device())
                  if self.weight_backend == "nccl" else torch.device("cpu"))
        box: Dict[str, object] = {}
        opts = json.dumps({"record_checksums": self.record_checksums})
        receiver = threading.Thread(target=self._call_into, args=(box, "stare_receive_weights", opts))
        receiver.start()
        try:
            self.last_sync = send(ProcessGroupSender(self._group, 0, device))
        except RuntimeError as e:  # the group's collective broke: most likely the server is gone
            receiver.join()
            raise (box["error"] if isinstance(box.get("error"), EngineFailure)
                   else self.failure("the weight push", e)) from e
        finally:
            receiver.join()
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        self._request("/reset_prefix_cache")
        log.info("vllm server: pushed %d tensors (%.1f MB) in %d buckets, %.2fs",
                 self.last_sync.num_tensors, self.last_sync.bytes / 2 ** 20,
                 self.last_sync.num_buckets, self.last_sync.seconds)

    def checksum(self, names: Sequence[str]) -> Dict[str, Optional[TensorChecksum]]:
        res = self._rpc("stare_checksum", json.dumps(list(names)))[0]
        return {n: None if v is None else TensorChecksum.from_json(v) for n, v in res.items()}

    # ---------------------------------------------------------------- memory & life cycle
    @property
    def supports_sleep(self) -> bool:
        return not self.cpu

    def sleep(self) -> bool:
        if not self.supports_sleep:
            log.warning("vllm server: sleep skipped - vLLM-CPU accepts sleep() but frees nothing; "
                        "memory stays allocated")
            return False
        self._request("/sleep?level=1")
        return True

    def wake_up(self) -> bool:
        if not self.supports_sleep:
            return False
        self._request("/wake_up?tags=weights")
        self._request("/wake_up")
        return True

    def shutdown(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is None:
            return
        self._proc = None
        atexit.unregister(self.shutdown)
        if self._group is not None:
            try:
                from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

                stateless_destroy_torch_distributed_process_group(self._group)
            except Exception as e:  # noqa: BLE001 - the server is going away regardless
                log.debug("weight group teardown: %s", e)
            self._group = None
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._log.close()
        if not self.keep_log:
            os.unlink(self._log.name)
