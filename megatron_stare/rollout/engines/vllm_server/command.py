"""The vLLM server's command line for a spec: the one a spawned server runs and the one a launch
script starts an attached server with (``python -m megatron_stare.rollout.server_cmd`` prints it).

``python -m vllm.entrypoints.openai.api_server`` with the spec's ``--tensor-parallel-size``,
``--dtype`` (the policy's), ``--gpu-memory-utilization``, ``--max-model-len``, ``--seed``,
``--logprobs-mode processed_logprobs`` (the log-prob convention), ``--generation-config vllm``
and our worker extension; on CPU eager mode, no chunked prefill and an explicit KV cache; on a
GPU the trainer shares, ``--enable-sleep-mode`` with ``CUDA_VISIBLE_DEVICES`` = the driver
node's first ``tp`` GPUs.
"""

from __future__ import annotations

import sys

from megatron_stare.rollout import vllm_cpu
from megatron_stare.rollout.engines.vllm.engine import LOGPROBS_MODE, WORKER_EXTENSION
from megatron_stare.rollout.spawned import ServerCommand
from megatron_stare.rollout.spec import EngineSpec

__all__ = ["SERVED_NAME", "server_command"]

SERVED_NAME = "stare-policy"


def server_command(spec: EngineSpec, host: str = "127.0.0.1", port: int = 8000) -> ServerCommand:
    """The spec as vLLM server flags: the command a spawned server runs, and the one a launch
    script starts an attached server with."""
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", spec.model_path,
            "--served-model-name", SERVED_NAME, "--host", host, "--port", str(port),
            "--tensor-parallel-size", str(spec.tp), "--dtype", spec.dtype, "--seed", str(spec.seed),
            "--max-model-len", str(spec.context_length),
            "--gpu-memory-utilization", str(spec.gpu_memory_utilization),
            "--logprobs-mode", LOGPROBS_MODE, "--generation-config", "vllm",
            "--worker-extension-cls", WORKER_EXTENSION]
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if spec.return_routed_experts:  # each completion then carries its routing (base64 .npy)
        argv.append("--enable-return-routed-experts")
    if not spec.cuda:
        argv.append("--enforce-eager")
        sched = vllm_cpu.scheduler_kwargs(spec.context_length)  # seeded sampling survives big batches
        argv += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(sched["max_num_batched_tokens"])]
        if spec.cpu_kv_cache_bytes:  # on CPU the fraction above would be of host RAM
            argv += ["--kv-cache-memory-bytes", str(spec.cpu_kv_cache_bytes)]
    elif spec.devices.shares_trainer_gpus:  # spawned on the driver node's GPUs: it must sleep
        argv.append("--enable-sleep-mode")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, spec.devices.gpu_ids))
    return ServerCommand(tuple(argv), env)
