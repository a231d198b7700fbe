"""The disaggregated asynchronous 32B recipe (launch/train_32b_async.sh, examples/qwen2.5_32b_async.yaml):
its dry-run shows the placement (the vLLM servers on the engine nodes, none of the trainer's GPU
memory, the weight-push route), its config validates for the training world, its flags restate
the YAML, and an engine node starts servers that match the URLs the trainer attaches to.

Each script call is a subprocess (the dry-run one imports torch); the numbers are checked
in-process against the planner with the same config.
"""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_stare.config.load import load_config, to_dict
from megatron_stare.plan.planner import check_for_gpus, estimate_memory

ROOT = Path(__file__).resolve().parents[2]
SCRIPT, YAML = "launch/train_32b_async.sh", "examples/qwen2.5_32b_async.yaml"
QWEN32 = ROOT / "examples" / "configs" / "qwen2.5-32b.json"
_ENV_KEYS = ("NNODES", "ENGINE_NODES", "NODE_RANK", "GPUS_PER_NODE", "GPU_MEM_GB", "MODEL_DIR", "DATA_DIR",
             "RUN_DIR", "MASTER_ADDR", "MASTER_PORT", "ENGINE_HOSTS", "ENGINE_PORT", "ENGINE_TP", "VENV")


def _run(*args, **env):
    full = {k: v for k, v in os.environ.items() if k not in _ENV_KEYS and not k.startswith("SLURM_")}
    full["OMP_NUM_THREADS"] = "1"
    if not (ROOT / ".venv" / "bin" / "python").exists():  # tests run from another environment
        full["VENV"] = sys.prefix
    full.update({k: str(v) for k, v in env.items()})
    return subprocess.run(["bash", str(ROOT / SCRIPT), *args], cwd=ROOT, env=full, capture_output=True,
                          text=True, timeout=120)


def _train_cmd(**env):
    res = _run("--print-cmd", **env)
    assert res.returncode == 0, res.stderr
    cmd = shlex.split(res.stdout)
    i = cmd.index("--config")
    return cmd, cmd[i + 1], cmd[i + 2:]


def test_dry_run_shows_the_disaggregated_placement():
    res = _run("--dry-run", ENGINE_HOSTS="gpu-e0,gpu-e1")
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    # The trainer plans for the 2 training nodes only; the engines are on the other 2.
    assert "GPUs: 16 x 80 GiB" in out and "tp 8 x pp 2 x cp 1 x dp 1 = 16" in out
    assert "2 attached server(s) (rollout.server_urls) x engine tp 8 = 16 engine GPUs of their own" in out
    assert "trainer.staleness 1" in out and "fits" in out
    assert "over one group of 1 + 16 engine workers" in out and "keeps its 1/8" in out
    assert "engine weights" not in out and "engine KV cache" not in out  # no engine row in the table


def test_recipe_validates_and_its_engines_cost_the_trainer_nothing():
    cmd, yaml, overrides = _train_cmd(ENGINE_HOSTS="gpu-e0,gpu-e1")
    assert yaml == YAML and cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--nproc-per-node") + 1] == "8"
    hf = json.loads(QWEN32.read_text())
    cfg = check_for_gpus(load_config(str(ROOT / yaml), overrides), hf, 16)  # raises on a bad config
    assert cfg.rollout.server_urls == ["http://gpu-e0:8000", "http://gpu-e1:8000"]
    assert cfg.trainer.staleness == 1 and cfg.rollout.engine == "vllm-server"
    plan = estimate_memory(cfg, hf, 16, 80)
    assert plan.fits and not plan.layout.colocated and plan.layout.attached_servers == 2
    assert plan.engine_weights_gib == plan.engine_kv_gib == plan.engine_workspace_gib == 0.0
    # The same run with a server spawned on the driver node's GPUs would cost them its memory.
    cfg.rollout.server_urls = []
    spawned = estimate_memory(cfg, hf, 16, 80)
    assert spawned.layout.colocated and spawned.layout.attached_servers == 0
    assert spawned.engine_weights_gib > 0 and spawned.phases["generate"] > plan.phases["generate"] + 10
    # ... in every phase: asynchronous, it generates while the trainer trains (never released).
    awake = spawned.engine_weights_gib + spawned.engine_kv_gib + spawned.engine_workspace_gib
    assert spawned.phases["train"] == pytest.approx(spawned.phases["generate"] + spawned.activations_gib
                                                    + spawned.logits_gib)
    cfg.trainer.staleness = 0
    synchronous = estimate_memory(cfg, hf, 16, 80)  # it sleeps while the trainer trains
    assert spawned.phases["train"] - synchronous.phases["train"] == pytest.approx(
        awake - synchronous.engine_asleep_gib)


def test_script_flags_restate_the_yaml():
    _, yaml, overrides = _train_cmd()
    assert to_dict(load_config(str(ROOT / yaml), overrides)) == to_dict(load_config(str(ROOT / yaml)))


@pytest.mark.parametrize("engine_tp,ports", [(8, [8000]), (4, [8000, 8001])])
def test_engine_node_serves_the_urls_the_trainer_attaches_to(engine_tp, ports):
    env = dict(ENGINE_HOSTS="gpu-e0,gpu-e1", ENGINE_TP=engine_tp)
    _, yaml, overrides = _train_cmd(**env)
    urls = load_config(str(ROOT / yaml), overrides).rollout.server_urls
    res = _run("--print-cmd", NODE_RANK=3, **env)  # the second engine node
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 8 // engine_tp
    for j, line in enumerate(lines):
        argv = shlex.split(line)
        gpus = argv[0].split("=", 1)
        assert gpus == ["CUDA_VISIBLE_DEVICES", ",".join(str(g) for g in range(j * engine_tp, (j + 1) * engine_tp))]
        assert argv[argv.index("--tensor-parallel-size") + 1] == str(engine_tp)
        assert int(argv[argv.index("--port") + 1]) == ports[j] and f"http://gpu-e1:{ports[j]}" in urls
        assert "--enable-sleep-mode" not in argv  # on GPUs of its own: it never sleeps
    assert len(urls) == 2 * len(ports)


@pytest.mark.parametrize("env,needle", [
    ({}, "ENGINE_HOSTS is not set"),
    ({"ENGINE_HOSTS": "only-one"}, "ENGINE_HOSTS lists 1 host(s) but ENGINE_NODES=2"),
    ({"ENGINE_HOSTS": "a,b", "NNODES": 2}, "leaves no training or no engine node"),
    ({"ENGINE_HOSTS": "a,b", "ENGINE_TP": 3}, "ENGINE_TP=3 does not divide GPUS_PER_NODE=8"),
])
def test_bad_placement_is_one_line_before_any_work(env, needle):
    res = _run(**env)  # a training launch
    assert res.returncode == 2 and res.stdout == "" and res.stderr.count("\n") == 1, res.stderr
    assert needle in res.stderr
