"""The launch scripts' --dry-run on CPU: the plan prints, exit codes hold, scripts match the YAMLs.

The too-small (exit 3) case runs in-process in tests/unit/test_plan.py; each script here costs a
torch import, so only the scripts' own paths run as subprocesses.
"""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_stare.config import load_config, to_dict

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = {
    "32b": ("launch/train_32b_longcot.sh", "examples/qwen2.5_32b_longcot.yaml"),
    "7b": ("launch/train_7b_shortcot.sh", "examples/qwen2.5_7b_shortcot.yaml"),
    "tiny": ("launch/train_tiny_cpu.sh", "examples/tiny_cpu.yaml"),
}
_ENV_KEYS = ("NNODES", "NODE_RANK", "GPUS_PER_NODE", "GPU_MEM_GB", "MODEL_DIR", "DATA_DIR",
             "RUN_DIR", "TINY_DIR", "NPROC", "MASTER_ADDR", "MASTER_PORT")


def _run(script, *args, **env):
    full = {k: v for k, v in os.environ.items() if k not in _ENV_KEYS and not k.startswith("SLURM_")}
    full.update(PYTHON=sys.executable, OMP_NUM_THREADS="1")
    full.update({k: str(v) for k, v in env.items()})
    return subprocess.run(["bash", script, *args], cwd=ROOT, env=full, capture_output=True,
                          text=True, timeout=60)


def test_32b_dry_run_fits_on_4_nodes():
    res = _run(SCRIPTS["32b"][0], "--dry-run", NNODES=4, GPUS_PER_NODE=8)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "32.76B parameters" in out and "tp 8 x pp 2 x cp 2 x dp 1 = 32" in out
    assert "vllm colocated, engine tp 8 -> 4 instances" in out and "fits" in out
    print(out)


def test_bad_config_is_one_line_exit_2():
    res = _run(SCRIPTS["32b"][0], "--dry-run", "parallel.tpp=8")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and "unknown key 'parallel.tpp'" in res.stderr


@pytest.mark.parametrize("name,env", [("7b", {}), ("tiny", {"TINY_DIR": "/nonexistent/tiny"})])
def test_other_scripts_dry_run(name, env):
    res = _run(SCRIPTS[name][0], "--dry-run", **env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Peak:" in res.stdout and "fits" in res.stdout


def test_slurm_maps_its_environment():
    """Outside srun the job script hands --dry-run/--print-cmd to the 32B script, SLURM env mapped."""
    res = _run("launch/slurm_32b.sbatch", "--print-cmd", SLURM_JOB_NUM_NODES=2, SLURM_GPUS_ON_NODE=4)
    assert res.returncode == 0, res.stderr
    assert "--nnodes 2 " in res.stdout and "--nproc-per-node 4 " in res.stdout


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_script_overrides_agree_with_yaml(name):
    """With default paths, a script's grouped flags restate its YAML exactly (no drift)."""
    script, yaml = SCRIPTS[name]
    res = _run(script, "--print-cmd")
    assert res.returncode == 0, res.stderr
    cmd = shlex.split(res.stdout)
    assert cmd[cmd.index("-m", cmd.index("torch.distributed.run")) + 1] == "megatron_stare.train"
    overrides = cmd[cmd.index("--config") + 2:]
    assert cmd[cmd.index("--config") + 1] == yaml and overrides
    assert to_dict(load_config(str(ROOT / yaml), overrides)) == to_dict(load_config(str(ROOT / yaml)))
