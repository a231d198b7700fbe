"""The cluster paths of docs/cluster-paths.md that only a GPU can show (scripts/gpu_check.sh runs this
file first). Skipped cleanly without CUDA, and each test without what it needs (a second GPU,
SGLang).

- The colocated SGLang engine's weight payload (``sglang_engine.serialize_for_ranks``): CUDA
  tensors cross to an unrelated process (SGLang's server is one) as IPC handles and read there
  as the values sent (1 GPU, no SGLang needed).
- Colocated SGLang at TP 2 (2 GPUs, SGLang): started under a torchrun worker's environment
  (item 1), its TP rank 1 maps the weight buckets on the leader's GPU, and the CUDA context it
  opens there fits the planner's ``ipc_context_gib`` (item 9).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
TORCHRUN_ENV = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_RUN_ID": "none"}
READ = """
import base64, json, pickle, sys
import torch, torch.multiprocessing
out = []
for line in sys.stdin:
    named = pickle.loads(base64.b64decode(line))
    out.append([[n, str(t.device), t.double().sum().item()] for n, t in named])
print(json.dumps(out))
"""


def _need_gpus(n: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs")


def test_weight_payload_maps_in_an_unrelated_process_over_cuda_ipc():
    _need_gpus(1)
    from megatron_stare.rollout.engines.sglang.engine import serialize_for_ranks

    named = [("model.norm.weight", torch.arange(64, dtype=torch.bfloat16, device="cuda")),
             ("lm_head.weight", torch.randn(256, 64, device="cuda"))]
    payloads = serialize_for_ranks(named, 2)
    assert len(payloads) == 2 and max(len(p) for p in payloads) < 4096  # handles, not the bytes
    child = subprocess.run([sys.executable, "-c", READ], input="\n".join(payloads) + "\n", capture_output=True,
                           text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert child.returncode == 0, child.stderr
    want = [[n, "cuda:0", t.double().sum().item()] for n, t in named]
    assert json.loads(child.stdout) == [want, want]  # each TP rank's copy, read in another process


def test_colocated_sglang_tp2_maps_buckets_within_the_planned_context(tmp_path, monkeypatch):
    _need_gpus(2)
    pytest.importorskip("sglang")
    pynvml = pytest.importorskip("pynvml")
    from megatron_stare.config.load import load_config
    from megatron_stare.preflight.checks import validate_config
    from megatron_stare.plan.memory import Assumptions
    from megatron_stare.rollout import EngineWorld, SamplingParams, engine_for_rank
    from megatron_stare.testing.hf_models import build_tiny_hf_model

    from ..unit.test_rollout_hf import stream_state_dict

    model = build_tiny_hf_model("qwen2", tmp_path / "m", seed=0)
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(yaml.safe_dump({"model": {"path": str(model)}, "data": {"max_prompt_length": 64},
                                        "rollout": {"engine": "sglang", "tp": 2, "max_new_tokens": 32,
                                                    "gpu_memory_utilization": 0.2}}))
    cfg = validate_config(load_config(str(cfg_file)), world_size=2, cuda=True, check_paths=False)
    for k, v in TORCHRUN_ENV.items():  # a torchrun worker's environment (item 1)
        monkeypatch.setenv(k, v)
    _, eng = engine_for_rank(cfg, EngineWorld(rank=0, world_size=2, local_rank=0, local_world_size=2, cuda=True))
    try:
        pynvml.nvmlInit()
        gpu0 = pynvml.nvmlDeviceGetHandleByIndex(0)

        def on_gpu0():
            return {p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(gpu0)}

        torch.zeros(1, device="cuda:0")  # this process's own context first
        before = on_gpu0()
        eng.update_weights((n, t.cuda(0)) for n, t in stream_state_dict(model))
        new = {pid: mem for pid, mem in on_gpu0().items() if pid not in before}
        # TP rank 1's scheduler (on GPU 1) now holds a context on GPU 0, within the plan's budget.
        assert len(new) == 1, (before, new)
        assert next(iter(new.values())) <= Assumptions().ipc_context_gib * 2**30
        assert len(eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))[0].token_ids) == 4
    finally:
        eng.shutdown()
