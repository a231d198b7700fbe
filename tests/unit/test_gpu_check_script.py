"""scripts/gpu_check.sh on a machine without a GPU: bad arguments are one line and exit 2; a dry
run says there is no GPU, what it would install, skip and run, and installs and runs nothing."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _run(*args, **env):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable, **env})


@pytest.mark.parametrize("args,needle", [(["--budget", "soon"], "--budget needs a number"),
                                         (["--fast"], "unknown argument '--fast'")])
def test_bad_arguments_give_one_line(args, needle):
    out = _run(*args)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and needle in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_dry_run_without_gpu_plans_and_does_nothing(tmp_path):
    deps = tmp_path / "deps"
    out = _run("--dry-run", "--budget", "300", DEPS_DIR=str(deps))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any("skip: no CUDA GPU" in ln for ln in lines)
    assert any(ln.startswith("[gpu-check] sglang: not installed -> skipped") for ln in lines)
    # The cluster paths (docs/cluster-paths.md) first, then the rest of tests/gpu, in one budget.
    assert "first: pytest tests/gpu/test_cluster_paths_gpu.py" in lines[-2] and str(deps) in lines[-2]
    assert "300" in lines[-1] and "pytest tests/gpu --ignore=tests/gpu/test_cluster_paths_gpu.py" in lines[-1]
    assert not deps.exists()
