"""``sglang``: SGLang colocated with the trainer - an SGLang server on the TP group's GPUs, spawned
and driven by the group's first rank. GPU only.

Why a process of its own, not ``sglang.Engine`` inside the rank (each read in SGLang 0.5.23 and
torch; ``docs/cluster-paths.md`` gives the lines):

1. start-up: SGLang's scheduler processes call ``init_process_group("tcp://...")``; inheriting a
   torchrun worker's ``TORCHELASTIC_USE_AGENT_STORE=True`` makes torch's rendezvous a store
   client on every rank, rank 0 included, and start-up waits for a store nobody hosts;
2. preemption: torchrun signals the worker's process group, which killed SGLang's children; its
   watchdog then SIGQUIT the rank, whose handler (SGLang's) kills the whole tree before any
   save; ``Engine`` also replaces the rank's SIGTERM / SIGQUIT handlers and, through
   ``loop.add_signal_handler``, the signal wakeup fd the preemption relay listens on;
3. shutdown: ``Engine.shutdown`` (also registered ``atexit``) SIGKILLs every child of its
   process - in the rank that is the asynchronous checkpoint writer, its file workers and the
   reaper too;
4. ``import sglang`` and ``Engine()`` set process-wide state: the asyncio event-loop policy
   (uvloop), ``CUDA_DEVICE_MAX_CONNECTIONS=8``, ``NCCL_CUMEM_ENABLE``, ``NCCL_NVLS_ENABLE``,
   the multiprocessing start method (``spawn``, forced), a SIGQUIT handler.

So the group's first rank spawns ``python -m sglang.launch_server`` (``colocated_command``: the
spec's ``ServerArgs`` as flags, with ``--base-gpu-id`` = the group's first GPU and
``--enable-memory-saver``) through ``spawned.SpawnedServer``: its own session, torchrun's
variables dropped, its process group alone ended at shutdown. The rank's handlers, wakeup fd,
environment and children are untouched. Generation, abort on preemption and failure reporting
are the HTTP client's (``sglang_server.SGLangServerEngine``); a failed weight or memory call
(``{"success": false}``, status 400) raises.

Weights: inside ``/begin_weight_update`` ... ``/end_weight_update``, one
``/update_weights_from_tensor`` per bucket whose ``serialized_named_tensors`` holds, per TP rank,
the bucket's ``[(hf_name, tensor)]`` pickled by torch's ``ForkingPickler`` (SGLang's
``MultiprocessingSerializer`` format: CUDA tensors travel as IPC handles, not bytes), base64 for
JSON; each TP rank reads its own copy (SGLang's rule: the producer's IPC refcounts then drop).
Then ``/flush_cache`` unless the KV cache is released (releasing it flushed it). The tensors sit
on the group leader's GPU; each other TP rank of the engine opens a CUDA context there to map
them (about 0.5 GB each on that GPU: ``plan_memory`` budgets it).

Memory: ``/release_memory_occupation`` (every tag: ``kv_cache``, ``weights``, ``cuda_graph``),
``/resume_memory_occupation`` with ``["weights"]`` before the sync and ``["kv_cache",
"cuda_graph"]`` after it. SGLang refuses to resume a tag that is not released, so the two
resumes cover exactly what was released.

Log-probs: SGLang's ``output_token_logprobs`` are ``log(softmax(logits / temperature))`` of the
sampled token (the project's convention) unless ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is set: the
engine refuses to start with it set and starts the server with it off. Seeds: see
``sglang_server.SEED_NOTICE``.

On CPU the command is checked against SGLang's recorded ``ServerArgs`` and the whole adapter runs
against a fake ``sglang.launch_server`` that answers SGLang's routes
(``tests/unit/test_sglang_colocated.py``); on a GPU against SGLang itself
(``tests/gpu/test_sglang_gpu.py``).
"""

from __future__ import annotations

import base64
import io
import logging
import sys
from multiprocessing.reduction import ForkingPickler
from typing import Iterable, List, Optional, Sequence, Tuple

import torch.multiprocessing  # noqa: F401 - registers torch's tensor reductions with ForkingPickler
from torch import Tensor

from megatron_stare.errors import UserError
from megatron_stare.weight_sync import free_port, iter_buckets
from megatron_stare.rollout.base import MemoryRelease
from megatron_stare.rollout.http import ErrorReply
from megatron_stare.runtime.phases import EngineMemory
from megatron_stare.rollout.engines.sglang_server.engine import RAW_LOGPROB_ENV, SGLangServerEngine, check_logprob_env, moe_kwargs
from megatron_stare.rollout.spawned import SpawnedServer
from megatron_stare.rollout.spec import EngineSpec
from megatron_stare.rollout.spawned import ServerCommand

__all__ = ["SGLangEngine", "colocated_command", "engine_kwargs", "serialize_for_ranks"]

log = logging.getLogger(__name__)

RESUME_WEIGHTS_TAGS = ["weights"]
RESUME_KV_TAGS = ["kv_cache", "cuda_graph"]
HOST = "127.0.0.1"


def engine_kwargs(spec: EngineSpec) -> dict:
    """The spec as SGLang ``ServerArgs`` fields: ``model_path``, ``tp_size``, ``dtype`` (the
    policy's), ``context_length``, ``mem_fraction_static`` (``rollout.gpu_memory_utilization``),
    ``base_gpu_id`` (the group's first GPU on its node), ``random_seed``, ``skip_tokenizer_init``
    (we send token ids), ``enable_memory_saver`` (on trainer GPUs: ``release_memory`` needs it),
    plus ``moe_kwargs``."""
    return {"model_path": spec.model_path, "tp_size": spec.tp, "dtype": spec.dtype,
            "context_length": spec.context_length, "mem_fraction_static": spec.gpu_memory_utilization,
            "base_gpu_id": spec.devices.base_gpu_id, "random_seed": spec.seed, "skip_tokenizer_init": True,
            "enable_memory_saver": spec.devices.shares_trainer_gpus, **moe_kwargs(spec)}


def colocated_command(spec: EngineSpec, host: str = HOST, port: int = 30000) -> ServerCommand:
    """``engine_kwargs(spec)`` as ``sglang.launch_server`` flags (``--field-name value``; a true
    boolean field is a bare switch, a false one is left out), served on ``host:port``."""
    argv = [sys.executable, "-m", "sglang.launch_server"]
    for k, v in {**engine_kwargs(spec), "host": host, "port": port}.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            argv += [flag] if v else []
        else:
            argv += [flag, str(v)]
    return ServerCommand(tuple(argv), {RAW_LOGPROB_ENV: "false"})


def serialize_for_ranks(named: Sequence[Tuple[str, Tensor]], ranks: int) -> List[str]:
    """``named`` in SGLang's ``serialized_named_tensors`` form: one base64 ``ForkingPickler``
    dump of the ``[(name, tensor)]`` list per TP rank. A CUDA tensor travels as an IPC handle
    (its memory must stay alive until the call returns: SGLang has loaded it by then)."""
    out = []
    for _ in range(ranks):
        buf = io.BytesIO()
        ForkingPickler(buf).dump(list(named))
        out.append(base64.b64encode(buf.getvalue()).decode())
    return out


class SGLangEngine(SGLangServerEngine):
    """SGLang colocated on the TP group's GPUs, in a server process of its own (module docstring).

    Args:
        command: the server's command (``colocated_command``); its ``--host`` / ``--port``
            are where it is reached, its ``--tp-size`` the engine's TP ranks.
        memory_saver: the server runs with ``--enable-memory-saver`` (``release_memory`` frees).
        startup_timeout_s: how long the server may take to answer ``/health``.
        Others: as ``SGLangServerEngine``.
    """

    name = "sglang"

    def __init__(self, command: ServerCommand, *, bucket_bytes: int = 512 << 20,
                 startup_timeout_s: float = 1800.0, request_timeout_s: float = 600.0,
                 return_routed_experts: bool = False, model_path: Optional[str] = None):
        check_logprob_env()
        argv = list(command.argv)
        flag = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}
        url = f"http://{flag['--host']}:{flag['--port']}"
        self._memory_saver = "--enable-memory-saver" in argv
        self._server = SpawnedServer("sglang", argv, command.env, url + "/health")
        try:
            self._server.wait_ready(startup_timeout_s)
            super().__init__(base_url=url, engine_world_size=int(flag.get("--tp-size", "1")),
                             bucket_bytes=bucket_bytes, request_timeout_s=request_timeout_s,
                             return_routed_experts=return_routed_experts,
                             model_path=model_path or flag["--model-path"])
        except BaseException:
            self._server.shutdown()
            raise

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> "SGLangEngine":
        if not spec.cuda:
            raise UserError("the sglang engine needs a CUDA GPU (SGLang has no CPU path); "
                            "use rollout engine 'hf' or 'vllm' on CPU")
        return cls(colocated_command(spec, HOST, free_port(HOST)), bucket_bytes=spec.sync_bucket_bytes,
                   return_routed_experts=spec.return_routed_experts, model_path=spec.model_path)

    @property
    def pid(self) -> Optional[int]:
        """The server's guard process (the leader of its process group); None once shut down."""
        return self._server.proc.pid if self._server.proc is not None else None

    def _failure(self, path: str, e: BaseException):
        code = None if isinstance(e, ErrorReply) else self._server.exit_code()
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        state = (f"died with exit code {code}" if code is not None
                 else f"replied {detail}" if isinstance(e, ErrorReply) else f"did not answer ({detail})")
        return self._server.failure(f"at {self.base_url} {state} during {path}")

    def update_weights(self, named_tensors: Iterable[Tuple[str, Tensor]]) -> None:
        self.check_can_load_weights()
        self._post("/begin_weight_update")
        try:
            for bucket in iter_buckets(named_tensors, self.bucket_bytes):
                self._post("/update_weights_from_tensor", {
                    "serialized_named_tensors": serialize_for_ranks(bucket, self.world),
                    "load_format": None, "flush_cache": False})
        finally:
            self._post("/end_weight_update")
        if self.memory is EngineMemory.AWAKE:  # a released KV cache was flushed when released
            self.flush_cache()

    # ------------------------------------------------------------------ memory phases
    @property
    def memory_release(self) -> MemoryRelease:
        if not self._memory_saver:
            return MemoryRelease(False, "the server was started without --enable-memory-saver")
        return MemoryRelease(True, "SGLang memory saver: weights, KV cache and CUDA graphs released")

    def _release(self) -> bool:
        if not self._memory_saver:
            return False
        self._post("/release_memory_occupation", {})
        return True

    def _resume_weights(self) -> None:
        if self._memory_saver:
            self._post("/resume_memory_occupation", {"tags": RESUME_WEIGHTS_TAGS})

    def _resume_kv(self) -> None:
        if self._memory_saver:
            self._post("/resume_memory_occupation", {"tags": RESUME_KV_TAGS})

    def shutdown(self) -> None:
        super().shutdown()
        server = getattr(self, "_server", None)
        if server is not None:
            server.shutdown()
