"""The launch scripts on CPU: --dry-run prints the plan, exit codes hold, scripts match the YAMLs,
and a training launch that cannot meet its nodes or has a bad config stops before torchrun.

The scripts run with a PATH whose ``python``/``python3`` is not the project's environment (a
shim to a torch-less system python, or one that refuses to run), as after the README's setup:
they must use the project's ``.venv`` (launch/common.sh), never PATH's python.

The too-small (exit 3) case runs in-process in tests/unit/test_plan.py; each script here costs a
torch import, so only the scripts' own paths run as subprocesses.
"""

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_stare.config.load import load_config, to_dict

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = {
    "32b": ("launch/train_32b_longcot.sh", "examples/qwen2.5_32b_longcot.yaml"),
    "7b": ("launch/train_7b_shortcot.sh", "examples/qwen2.5_7b_shortcot.yaml"),
    "tiny": ("launch/train_tiny_cpu.sh", "examples/tiny_cpu.yaml"),
    "30b_a3b": ("launch/train_30b_a3b.sh", "examples/qwen3_30b_a3b.yaml"),
}
_ENV_KEYS = ("NNODES", "NODE_RANK", "GPUS_PER_NODE", "GPU_MEM_GB", "MODEL_DIR", "DATA_DIR",
             "RUN_DIR", "TINY_DIR", "NPROC", "MASTER_ADDR", "MASTER_PORT", "MASTER_WAIT_S", "VENV", "PYTHON")


def _torchless_python():
    """A system python3 without torch, or None."""
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(cand) and subprocess.run(
                [cand, "-c", "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)"],
                capture_output=True).returncode == 0:
            return cand
    return None


@pytest.fixture(scope="module")
def shim_path(tmp_path_factory):
    """A PATH whose python/python3 is not the project's environment."""
    d = tmp_path_factory.mktemp("shim")
    target = _torchless_python()
    body = f'exec {target} "$@"' if target else 'echo "shim python: not the project environment" >&2; exit 97'
    for name in ("python", "python3"):
        (d / name).write_text(f"#!/bin/sh\n{body}\n")
        (d / name).chmod(0o755)
    return f"{d}:{os.environ['PATH']}"


def _env(shim_path, **env):
    full = {k: v for k, v in os.environ.items() if k not in _ENV_KEYS and not k.startswith("SLURM_")}
    full.update(PATH=shim_path, OMP_NUM_THREADS="1")
    if not (ROOT / ".venv" / "bin" / "python").exists():  # tests run from another environment
        full["VENV"] = sys.prefix
    full.update({k: str(v) for k, v in env.items()})
    return full


@pytest.fixture
def run(shim_path):
    def _run(script, *args, cwd=ROOT, **env):
        path = cwd / script
        cmd = [str(path)] if os.access(path, os.X_OK) else ["bash", str(path)]  # as the README runs them
        return subprocess.run([*cmd, *args], cwd=cwd, env=_env(shim_path, **env), capture_output=True,
                              text=True, timeout=60)
    return _run


def _takes_the_offload_advice(out: str) -> None:
    """A recipe whose engine cannot hold a replica's whole batch at once runs with the
    offload the plan recommends (``trainer.offload=all`` frees the trainer's state for KV cache)."""
    holds = int(re.search(r"the pool holds (\d+) full-length sequences at once", out).group(1))
    batch = int(re.search(r"instances x (\d+) sequences", out).group(1))
    advised = re.search(r"trainer\.offload=none \(with trainer\.offload=all: .*?(\d+) -> (\d+) full-length", out)
    assert holds >= batch or advised is None, f"the plan advises trainer.offload=all: {advised.group(0)}"


def test_32b_dry_run_fits_on_4_nodes(run):
    """The README's line, as written, with PATH's python unable to run the project."""
    res = run(SCRIPTS["32b"][0], "--dry-run", NNODES=4, GPUS_PER_NODE=8)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "32.76B parameters" in out and "tp 8 x pp 2 x cp 2 x dp 1 = 32" in out
    assert "vllm on the trainer's GPUs, engine tp 8 -> 4 instances" in out and "fits" in out
    assert "checkpoint save: 427 GiB, about 91 s" in out  # 4 nodes (tests/unit/test_save_estimate.py)
    _takes_the_offload_advice(out)
    assert "the pool holds 82 full-length sequences at once" in out  # 49 without the offload
    print(out)


def test_30b_a3b_dry_run_plans_the_experts(run):
    """Qwen3-30B-A3B on 4 nodes: EP8, colocated vLLM, routing replay r3 (tests/unit/test_plan_moe.py
    has the numbers by hand)."""
    res = run(SCRIPTS["30b_a3b"][0], "--dry-run", NNODES=4, GPUS_PER_NODE=8)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "30.53B parameters" in out and "tp 2 x pp 2 x cp 1 x dp 8 = 32" in out
    assert "ep 8 x etp 1 -> 16 experts per rank" in out and "sharded over edp 2" in out
    assert "routing replay r3: 1152 B/token" in out and "MoE dispatcher buffers" in out and "fits" in out
    _takes_the_offload_advice(out)  # its engine holds the whole batch: no offload needed


def test_bad_config_is_one_line_exit_2(run):
    res = run(SCRIPTS["32b"][0], "--dry-run", "parallel.tpp=8")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and "unknown key 'parallel.tpp'" in res.stderr


@pytest.mark.parametrize("name,env", [("7b", {}), ("tiny", {"TINY_DIR": "/nonexistent/tiny"})])
def test_other_scripts_dry_run(run, name, env):
    res = run(SCRIPTS[name][0], "--dry-run", **env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Peak:" in res.stdout and "fits" in res.stdout
    if name == "7b":
        _takes_the_offload_advice(res.stdout)


def test_slurm_maps_its_environment(run):
    """Outside srun the job script hands --dry-run/--print-cmd to the 32B script, SLURM env mapped."""
    res = run("launch/slurm_32b.sbatch", "--print-cmd", SLURM_JOB_NUM_NODES=2, SLURM_GPUS_ON_NODE=4)
    assert res.returncode == 0, res.stderr
    assert "--nnodes 2 " in res.stdout and "--nproc-per-node 4 " in res.stdout
    # No MASTER_ADDR yet (the job sets it from its first host): the command leaves it to the shell.
    assert '--master-addr "$MASTER_ADDR" ' in res.stdout


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_script_overrides_agree_with_yaml(run, name):
    """With default paths, a script's grouped flags restate its YAML exactly (no drift)."""
    script, yaml = SCRIPTS[name]
    res = run(script, "--print-cmd")
    assert res.returncode == 0, res.stderr
    cmd = shlex.split(res.stdout)
    # torchrun runs inside megatron_stare.run (its Ctrl-C and exit codes), which starts the trainer.
    assert cmd[1:3] == ["-m", "megatron_stare.run"] and "megatron_stare.train" not in cmd
    overrides = cmd[cmd.index("--config") + 2:]
    assert cmd[cmd.index("--config") + 1] == yaml and overrides
    assert to_dict(load_config(str(ROOT / yaml), overrides)) == to_dict(load_config(str(ROOT / yaml)))


def test_scripts_use_the_project_environment(run):
    """--print-cmd shows the interpreter the run would use: the venv's, not PATH's python."""
    res = run(SCRIPTS["tiny"][0], "--print-cmd")
    assert res.returncode == 0, res.stderr
    expected = str(ROOT / ".venv") if (ROOT / ".venv" / "bin" / "python").exists() else sys.prefix
    assert shlex.split(res.stdout)[0] == str(Path(expected) / "bin" / "python")


def test_missing_environment_is_one_line(run, tmp_path):
    res = run(SCRIPTS["32b"][0], "--dry-run", VENV=tmp_path / "nope")
    assert res.returncode == 2 and res.stdout == "" and res.stderr.count("\n") == 1
    assert res.stderr.startswith(f"error: VENV={tmp_path / 'nope'} has no bin/python")
    # No .venv at all (a copy of the scripts elsewhere) and PATH's python lacks torch.
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "launch", copy / "launch")
    res = run("launch/train_32b_longcot.sh", "--dry-run", cwd=copy, VENV="")
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert "has no torch; run scripts/bootstrap.sh" in res.stderr


# ------------------------------------------------------------------------------ training preflight
def _host_ip():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def _fails_fast(res, elapsed, needle, limit=30):
    assert res.returncode == 2 and res.stdout == "", res.stdout + res.stderr
    assert res.stderr.count("\n") == 1 and needle in res.stderr, res.stderr
    assert elapsed < limit, elapsed  # not torchrun's 600 s rendezvous wait


@pytest.mark.parametrize("env,needle", [
    ({}, "error: rendezvous: NNODES=4 needs MASTER_ADDR"),
    ({"MASTER_ADDR": "no-such-host.invalid"}, "error: rendezvous: MASTER_ADDR=no-such-host.invalid does not resolve"),
    ({"MASTER_ADDR": "127.0.0.1"}, "is a loopback address"),
])
def test_multi_node_launch_without_a_usable_master_fails_fast(run, env, needle):
    t0 = time.monotonic()
    res = run(SCRIPTS["32b"][0], NNODES=4, NODE_RANK=1, **env)
    _fails_fast(res, time.monotonic() - t0, needle)


def test_unreachable_master_fails_after_the_bounded_wait(run):
    ip = _host_ip()
    if ip is None:
        pytest.skip("no non-loopback address on this host")
    with socket.socket() as s:  # a port nobody listens on: node 0 never came up
        s.bind((ip, 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    res = run(SCRIPTS["32b"][0], NNODES=4, NODE_RANK=1, MASTER_ADDR=ip, MASTER_PORT=port, MASTER_WAIT_S=2)
    elapsed = time.monotonic() - t0
    _fails_fast(res, elapsed, f"port {port} is not reachable from this node after 2s")
    assert elapsed >= 2
    # Node 0 up: the rendezvous check passes and the config preflight runs next, still before
    # torchrun; on this CPU machine without the 32B model, the config is not runnable: one line.
    with socket.create_server((ip, 0)) as server:
        res = run(SCRIPTS["32b"][0], NNODES=4, NODE_RANK=1, MASTER_ADDR=ip, MASTER_PORT=server.getsockname()[1])
    _fails_fast(res, 0, "error: config: ")
    assert "rendezvous" not in res.stderr


# ------------------------------------------------------------------------------ preemption relay
_FAKE_SRUN = """#!/bin/bash
echo "srun $*" >> {log}
trap 'echo "srun got USR1" >> {log}; exit {code}' USR1
trap 'echo "srun got TERM" >> {log}; exit {code}' TERM
echo ready >> {log}
[[ {code} == 1 ]] && exit 1
while true; do sleep 0.05; done
"""
_FAKE_SCONTROL = """#!/bin/bash
echo "scontrol $*" >> {log}
if [[ $1 == show ]]; then echo node0; fi
"""


@pytest.mark.parametrize("signal_name,code", [("USR1", 75), (None, 1)])
def test_slurm_job_relays_the_warning_and_requeues(shim_path, tmp_path, signal_name, code):
    """The batch shell (SLURM signals it alone: --signal=B:USR1@...) relays SIGUSR1 to srun and,
    when the run exits 75 (preempted after saving), requeues the job; a plain failure does not.
    srun and scontrol are stand-ins that record their calls (srun's forwarding to its tasks is
    SLURM's; the launch shell's relay into torchrun is tested end to end in test_train_resume)."""
    import signal

    fake, log = tmp_path / "bin", tmp_path / "calls.txt"
    fake.mkdir()
    for name, body in (("srun", _FAKE_SRUN), ("scontrol", _FAKE_SCONTROL)):
        (fake / name).write_text(body.format(log=log, code=code))
        (fake / name).chmod(0o755)
    sbatch = ROOT / "launch" / "slurm_32b.sbatch"
    cpus = re.search(r"^#SBATCH --cpus-per-task=(\d+)$", sbatch.read_text(), re.M).group(1)
    env = _env(f"{fake}:{shim_path}", SLURM_JOB_ID=42, SLURM_JOB_NODELIST="node0", SLURM_JOB_NUM_NODES=1,
               SLURM_CPUS_PER_TASK=cpus)  # what sbatch sets from its --cpus-per-task
    assert "#SBATCH --signal=B:USR1@" in sbatch.read_text()
    proc = subprocess.Popen(["bash", str(sbatch)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (log.is_file() and "ready" in log.read_text()):
            assert time.monotonic() < deadline and proc.poll() in (None, code)
            time.sleep(0.05)
        if signal_name:
            time.sleep(0.2)  # the trap is set right after srun starts
            proc.send_signal(getattr(signal, f"SIG{signal_name}"))
        out, err = proc.communicate(timeout=30)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the stand-in srun, should the job shell be gone
        except ProcessLookupError:
            pass
    calls = log.read_text()
    assert proc.returncode == code, out + err + calls
    assert ("srun got USR1" in calls) == bool(signal_name)
    assert ("scontrol requeue 42" in calls) == (code == 75), calls
    # srun (Slurm >= 22.05) does not inherit sbatch's --cpus-per-task: the job passes it again.
    assert f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 --cpus-per-task={cpus} " in calls, calls
