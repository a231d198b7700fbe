"""The console (``megatron_stare/trainer/console.py``): line formats, the ETA, warning collapsing, the
start-up summary, and the already-complete check of a finished run's checkpoints."""

import io
import logging
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_stare.checkpoint.core import finished_checkpoint
from megatron_stare.checkpoint.manifest import write_manifest
from megatron_stare.config.load import Config
from megatron_stare.trainer.console import Console, adopt_library_loggers
from megatron_stare.trainer.console_lines import WIDTH, RunSummary, eval_line, seconds, step_line, warning_line

FULL = {"time/generate": 28.14, "time/gather": 0.01, "time/score": 0.21, "time/release": 0.5, "time/train": 3.1,
        "time/logprob": 1.0, "time/update": 2.1, "time/resume_w": 0.3, "time/sync": 0.4, "time/resume_kv": 0.2,
        "perf/tokens_per_s": 812.4, "stare/entropy": 0.4123, "stare/gate": 0.0, "reward/mean": 0.41,
        "reward/accuracy": 0.531, "response/mean_length": 57.26}


def test_step_line():
    # Every main phase (generate: the phases are named as runtime/phases.py names them), the
    # engine's sleep and wake summed (0.5 + 0.3 + 0.2), a 10 ms gather left out.
    assert step_line(12, 100, FULL, eta_s=252.4, target_entropy=0.3) == (
        "step 12/100, eta 4m12s | generate 28.1s score 0.2s train 3.1s sync 0.4s wake 1.0s | "
        "reward 0.41 acc 0.53 len 57.3 | H 0.41/0.30 gate off | 812 tok/s")
    # Binary rewards: accuracy equals the mean and is not repeated; no target without STARE.
    assert step_line(3, None, {"reward/mean": 0.5, "reward/accuracy": 0.5, "stare/gate": 1}) == \
        "step 3 | reward 0.50 | gate on"
    assert step_line(1, 2, {"time/generate": 0.004, "time/eval": 0.2, "time/wait_generate": 0.06}) == \
        "step 1/2 | generate 4ms wait 60ms eval 0.2s"
    assert step_line(12, 100, {}, eta_s=252.4) == "step 12/100, eta 4m12s"
    # The share of prompt groups with one reward for all (zero advantage), only when there were any.
    assert step_line(2, 4, {"reward/mean": 0.2, "response/mean_length": 15.0, "rollout/flat_groups": 0.4375}) == \
        "step 2/4 | reward 0.20 len 15.0 flat 44%"
    assert step_line(2, 4, {"reward/mean": 0.2, "rollout/flat_groups": 0.0}) == "step 2/4 | reward 0.20"
    assert [seconds(t) for t in (0.0, 0.0123, 0.1, 28.14, 252.4)] == ["0ms", "12ms", "0.1s", "28.1s", "4m12s"]


def test_eval_line():
    m = {"eval/avg@4": 0.25, "eval/pass@4": 0.5, "eval/response_len_mean": 7.5, "loss": 1.0}
    assert eval_line(2, m) == "[megatron-stare] eval after step 2: avg@4 0.250 pass@4 0.500 len 7.5"
    assert eval_line(3, {"loss": 1.0}) is None


def test_warning_line_keeps_ours_whole_and_cuts_third_party():
    long = "x" * (WIDTH + 50)
    assert warning_line("megatron", f"Apex is missing.\n  details\n", "UserWarning") == \
        "[warning] megatron UserWarning: Apex is missing."
    cut = warning_line("vllm", long)
    assert cut.endswith("...") and len(cut) == len("[warning] vllm: ") + WIDTH
    assert warning_line("megatron_stare", long, "CheckpointWarning").endswith(long)
    assert warning_line("torch", "boom", error=True) == "[error] torch: boom"


def _console(tmp_path, rank=0):
    out, err = io.StringIO(), io.StringIO()
    cfg = Config()
    cfg.logging.dir, cfg.trainer.total_steps = str(tmp_path), 20
    return Console(rank, out=out, err=err).configure(cfg), out, err


def _warn_twice():
    for _ in range(2):  # two call sites, one text: one line on the console
        warnings.warn("Apex is not installed.\nFalling back to Torch Norm", UserWarning)
    warnings.warn("Apex is not installed.\nFalling back to Torch Norm", UserWarning)


def test_warnings_and_library_logs_collapse_to_one_line_each(tmp_path):
    console, out, err = _console(tmp_path)
    lib = logging.getLogger("vllm.test_console")
    own_handler = logging.StreamHandler(io.StringIO())  # a library's own console handler
    lib.addHandler(own_handler)
    lib.propagate = False
    before = (warnings.showwarning, list(logging.getLogger().handlers))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            console.install()
            assert own_handler not in lib.handlers and lib.propagate  # adopted at install
            _warn_twice()
            for i in range(3):
                lib.warning("KV cache %s GiB\nsecond line", "1.0")
            lib.info("an info record: log file only")
            logging.getLogger("megatron_stare.x").warning("ours: " + "y" * (WIDTH + 10))
            logging.getLogger("torch.x").error("a failure")
        console.uninstall()
        assert (warnings.showwarning, logging.getLogger().handlers) == before
        assert lib.handlers == [own_handler] and not lib.propagate  # given back
    finally:
        console.close()
        lib.removeHandler(own_handler)
    lines = err.getvalue().splitlines()
    assert lines == ["[warning] test_console UserWarning: Apex is not installed.",
                     "[warning] vllm: KV cache 1.0 GiB", "[warning] megatron_stare: ours: " + "y" * (WIDTH + 10),
                     "[error] torch: a failure"], lines
    assert out.getvalue() == ""
    log = (tmp_path / "console.log").read_text()
    # The full text of every record, each occurrence: both lines, the call site, the info record.
    assert log.count("UserWarning: Apex is not installed.\nFalling back to Torch Norm") == 3
    assert "test_console.py:" in log
    assert log.count("KV cache 1.0 GiB\nsecond line") == 3 and "an info record: log file only" in log


def test_other_ranks_show_errors_only_and_keep_their_own_log(tmp_path):
    console, out, err = _console(tmp_path, rank=1)
    assert not (tmp_path / "console_rank1.log").exists()  # opened at its first record
    console.note("rank 0 says this")
    console.record("megatron", "a warning", "a warning (full)", logging.WARNING, "UserWarning")
    console.record("torch", "a failure", "a failure (full)", logging.ERROR)
    console.close()
    assert out.getvalue() == "" and err.getvalue() == "[rank 1] [error] torch: a failure\n"
    log = (tmp_path / "console_rank1.log").read_text()
    assert "a warning (full)" in log and "a failure (full)" in log and "rank 0 says" not in log


def test_adopt_leaves_file_handlers():
    lg = logging.getLogger("transformers.test_console_adopt")
    fh = logging.FileHandler("/dev/null")
    lg.addHandler(fh)
    lg.propagate = False
    try:
        adopt_library_loggers()
        assert lg.handlers == [fh] and not lg.propagate
    finally:
        lg.removeHandler(fh)
        fh.close()


def test_step_lines_every_log_every_with_an_eta_from_the_pace_so_far(tmp_path, monkeypatch):
    """Resumed at step 5 of 20, set-up done at t=100; steps take 2 s: after step 6 (2 steps in
    4 s), 14 steps are left (28 s). A line every 3 steps and at the last."""
    console, out, _ = _console(tmp_path)
    console.log_every, console._t_ready, console._first_step = 3, 100.0, 5
    clock = iter([104.0, 130.0])  # read for the printed lines only
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    console.step(5, {})
    console.step(6, {"eval/pass@4": 0.5})
    console.step(20, {})
    console.close()
    assert out.getvalue().splitlines() == ["step 6/20, eta 28s", "[megatron-stare] eval after step 6: pass@4 0.500",
                                           "step 20/20, eta 0s"]
    assert (tmp_path / "console.log").read_text().endswith("step 20/20, eta 0s\n")


def test_run_summary_lines():
    s = RunSummary(model="Qwen2ForCausalLM", model_path="runs/tiny/model", params=1_234_567, tp=2, pp=1, cp=1, dp=2,
                   engine="vllm", train_rows=32, eval_rows=4, total_steps=10, start_step=4, prompts_per_step=8,
                   responses_per_prompt=4, log_dir="/r/logs", checkpoint_dir="/r/ckpt", save_every=5)
    assert s.lines() == [
        "[megatron-stare] model Qwen2ForCausalLM, 1.2M parameters (runs/tiny/model)",
        "[megatron-stare] layout TP2xPP1xCP1xDP2 on 4 ranks | engine vllm | data 32 train rows, 4 eval rows",
        "[megatron-stare] steps 5-10 of 8 prompts x 4 responses | logs /r/logs (console.log, metrics.jsonl) | "
        "checkpoints /r/ckpt (every 5 steps and the last)"]


def _checkpoint(root: Path, step: int) -> Path:
    d = root / f"step_{step:08d}"
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text('{"step": %d}' % step)
    write_manifest(d, step)  # one process: no process group needed
    return d


def test_finished_checkpoint(tmp_path):
    assert finished_checkpoint("auto", tmp_path / "none", 4) is None
    _checkpoint(tmp_path, 2)
    last = _checkpoint(tmp_path, 4)
    (tmp_path / "step_00000006").mkdir()  # a torn save, no manifest: skipped
    assert finished_checkpoint("auto", tmp_path, 4) == (4, last)
    assert finished_checkpoint("auto", tmp_path, 3) == (4, last)
    assert finished_checkpoint("auto", tmp_path, 5) is None
    assert finished_checkpoint("never", tmp_path, 4) is None
    assert finished_checkpoint(str(tmp_path / "step_00000002"), tmp_path, 2) == (2, tmp_path / "step_00000002")
    assert finished_checkpoint(str(tmp_path / "step_00000002"), tmp_path, 4) is None
    state = last / "trainer_state.json"
    state.write_text("[" + state.read_text()[1:])  # changed in place at the same size: not complete
    assert finished_checkpoint("auto", tmp_path, 4) is None


def test_already_complete_says_so_in_one_line(tmp_path):
    console, out, err = _console(tmp_path)
    last = _checkpoint(tmp_path / "ckpt", 20)
    cfg = Config()
    cfg.checkpoint.dir, cfg.trainer.total_steps = str(tmp_path / "ckpt"), 20
    assert console.already_complete(cfg)
    cfg.trainer.total_steps = 21
    assert not console.already_complete(cfg)
    console.close()
    assert out.getvalue() == (f"[megatron-stare] already complete: {last} is step 20 of trainer.total_steps=20; "
                              f"nothing to do (raise trainer.total_steps to train on)\n")


def test_lower_layers_lines_go_through_the_installed_console(tmp_path, capsys):
    """The checkpoint loader, preemption and preflight speak through ``runtime.notices``: plain
    printing with no console, the console (its streams and its log file) once it is installed,
    plain printing again after it is uninstalled."""
    from megatron_stare.runtime import notices

    notices.note("before the console")
    notices.say("warning: before", err=True)
    plain = capsys.readouterr()
    assert plain.out == "[megatron-stare] before the console\n" and plain.err == "warning: before\n"
    console, out, err = _console(tmp_path, rank=1)  # the caller chose the rank: echo prints anyway
    try:
        console.install()
        notices.note("checkpoint x was saved at another layout")
        notices.say("error: a bad row", err=True)
        console.uninstall()
        notices.note("after the console")
    finally:
        console.close()
    assert out.getvalue() == "[megatron-stare] checkpoint x was saved at another layout\n"
    assert err.getvalue() == "error: a bad row\n"
    log = (tmp_path / "console_rank1.log").read_text()
    assert "saved at another layout" in log and "error: a bad row" in log and "after" not in log
    assert capsys.readouterr().out == "[megatron-stare] after the console\n"


def test_a_warning_from_any_folder_of_the_package_is_ours():
    """Ours, whole on the console, from every folder (a moved module must not turn third-party)."""
    from megatron_stare.checkpoint import core
    from megatron_stare.trainer import console_lines

    for module in (core, console_lines, __import__("megatron_stare.train").train):
        assert console_lines.source_of(module.__file__) == "megatron_stare", module.__name__
    assert console_lines.source_of("/x/site-packages/megatron/core/optimizer/__init__.py") == "megatron"
