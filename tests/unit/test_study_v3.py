"""Study v3's runner (study/v3.py): every method's overrides make a valid config, a run's key
names all that defines it, recorded runs are not run again, a finished run directory is recorded
without rerunning it, and the report is built from the recorded files alone."""

import json
import math

import pytest

from megatron_stare.config.load import load_config
from megatron_stare.preflight.checks import validate_config
from megatron_stare.study import results as sr
from megatron_stare.study import v3


@pytest.mark.parametrize("method", v3.METHODS)
def test_every_method_makes_a_valid_config_with_the_shared_settings(method, tmp_path):
    """The overrides the runner launches (its command after ``--config``) make a valid config."""
    cmd = v3.command(tmp_path, method, seed=2, steps=60, model="m")
    cfg = validate_config(load_config(str(v3.CONFIG), cmd[cmd.index(str(v3.CONFIG)) + 1:]),
                          world_size=2, cuda=False, check_paths=False)
    assert cfg.optimizer.lr == 1e-4 and cfg.trainer.prompts_per_step == 8 and cfg.rollout.n == 4
    assert cfg.trainer.seed == 2 and cfg.trainer.total_steps == 60 and cfg.trainer.eval_every == 12
    assert cfg.reward.fn == "megatron_stare.study.word_problems:compute_score_format"
    # Only STARE's gate reads the target: 0.35 x the start's H0.
    expected = round(0.35 * v3.START["H0"], 4) if method.startswith("stare") else 0.0
    assert cfg.algorithm.stare.target_entropy == pytest.approx(expected, abs=1e-9)
    # DAPO's overlong buffer is scaled to the 128-token limit (its paper's 20%), after v1's 3.
    assert cfg.reward.overlong_buffer_len == (26 if method == "dapo" else 0)
    # The public reference's recipes: dynamic sampling and clip-higher; STARE O1 at fixed weights.
    if method in ("grpo_ds", "stare_ref"):
        assert cfg.trainer.dynamic_sampling and cfg.algorithm.clip_ratio_high == 0.28
    if method == "stare_ref":
        stare = cfg.algorithm.stare
        assert (stare.variant, stare.top_p, stare.w, stare.m, stare.adaptive) == ("O1", 0.1, 1.1, 0.9, False)


def test_run_key_names_the_method_seed_steps_and_start(monkeypatch):
    keys = {v3.run_key(m, s, n) for m in ("grpo", "stare_c2") for s in (1, 2) for n in (60, 100)}
    assert len(keys) == 8
    k = v3.run_key("grpo", 1, 100)
    monkeypatch.setitem(v3.START, "H0", 2.5)
    assert v3.run_key("grpo", 1, 100) != k


def _rows(entropies, gate=0.0, acc=0.2, evals=None):
    rows = []
    for i, h in enumerate(entropies):
        r = {"step": i + 1, "stare/entropy": h, "stare/gate": gate if h < v3.target() else 0.0,
             "reward/accuracy": acc, "response/mean_length": 50.0, "rollout/generated_tokens": 100.0,
             "time/step": 30.0}
        r.update((evals or {}).get(i + 1, {}))
        rows.append(r)
    return rows


def test_a_finished_run_directory_is_recorded_without_rerunning_and_then_skipped(tmp_path, monkeypatch):
    out, results = tmp_path / "out", tmp_path / "results"
    rd = out / "seed1" / "grpo"
    rd.mkdir(parents=True)
    (rd / "run_key").write_text(v3.run_key("grpo", 1, 4))   # as the runner marked it at launch
    with open(rd / "metrics.jsonl", "w") as f:
        for r in _rows([2.0, 1.0, 0.3, 0.2], evals={4: {"eval/avg@4": 0.25, "eval/pass@4": 0.5}}):
            f.write(json.dumps(r) + "\n")

    def no_run(*a, **k):
        raise AssertionError("a finished run must not be run again")

    with open(rd / "samples.jsonl", "w") as f:   # the trainer's logging.samples_every rows
        for step in (2, 4):
            f.write(json.dumps({"step": step, "prompt": "p" * 900, "response": f"a|b\n{step}", "reward": 0.2}) + "\n")
    monkeypatch.setattr(v3.subprocess, "Popen", no_run)
    rec = v3.run_one(out, "grpo", 1, 4, "model", results)
    assert [x["step"] for x in rec["samples"]] == [2, 4] and len(rec["samples"][0]["prompt"]) == 600
    assert "| 1 | GRPO | 4 | 0.20 | a\\|b 4 |" in v3.report(results, [1], list(v3.METHODS))
    assert rec["key"] == v3.run_key("grpo", 1, 4) and rec["seconds"] == 120.0 and len(rec["rows"]) == 4
    assert rec["overrides"] == v3.method_overrides("grpo", 1, 4)
    # Recorded: skipped even once the run directory is gone.
    (rd / "metrics.jsonl").unlink()
    assert v3.run_one(out, "grpo", 1, 4, "model", results)["key"] == rec["key"]


class FakeTrainer:
    """Stands in for ``subprocess.Popen`` of the trainer: records the command, writes ``rows``
    to the run's metrics, and exits ``rc`` (None: still running at the deadline)."""

    launched: list = []

    def __init__(self, rc, rows=(), output=""):
        self.rc, self.rows, self.signals, self.output = rc, rows, [], output

    def __call__(self, cmd, env, stdout, stderr):
        FakeTrainer.launched.append((cmd, env))
        stdout.write(self.output)
        stdout.flush()
        rd = [a.split("=", 1)[1] for a in cmd if a.startswith("logging.dir=")][0]
        with open(f"{rd}/metrics.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in self.rows)
        return self

    def wait(self, timeout=None):
        if self.rc is None and not self.signals:
            raise v3.subprocess.TimeoutExpired("trainer", timeout)
        return self.rc if self.rc is not None else -15

    def send_signal(self, sig):
        self.signals.append(sig)


def test_an_unfinished_run_is_launched_and_a_failed_one_stops_with_its_resume_hint(tmp_path, monkeypatch):
    out, results = tmp_path / "out", tmp_path / "results"
    FakeTrainer.launched.clear()
    monkeypatch.setattr(v3.subprocess, "Popen", FakeTrainer(rc=3))
    with pytest.raises(SystemExit, match="seed 2 stare_c2: the trainer exited 3 .*rerun to resume"):
        v3.run_one(out, "stare_c2", 2, 4, "/m", results)
    cmd, env = FakeTrainer.launched[0]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2" and "checkpoint.resume=auto" in cmd
    assert f"logging.dir={out / 'seed2' / 'stare_c2'}" in cmd and cmd[-len(v3.method_overrides("stare_c2", 2, 4)):] \
        == v3.method_overrides("stare_c2", 2, 4)
    assert env["OMP_NUM_THREADS"] == "1" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert not sr.result_path(results, 2, "stare_c2").exists()


def test_a_failed_or_interrupted_run_stops_the_runner_before_the_next_run(tmp_path, monkeypatch):
    """The runner queues every run; one that fails (or is stopped by Ctrl-C) must not let the
    queued ones start."""
    FakeTrainer.launched.clear()
    monkeypatch.setattr(v3.subprocess, "Popen", FakeTrainer(rc=-2))
    with pytest.raises(SystemExit, match="seed 1 grpo: the trainer exited -2"):
        v3.main(["--seeds", "1", "--methods", "grpo", "dapo", "--steps", "3", "--out", str(tmp_path / "out"),
                 "--model", "/m", "--results", str(tmp_path / "results")])
    assert len(FakeTrainer.launched) == 1


def test_on_a_gpu_a_run_past_the_deadline_is_stopped_and_recorded_with_its_steps(tmp_path, monkeypatch):
    out, results = tmp_path / "out", tmp_path / "results"
    FakeTrainer.launched.clear()
    fake = FakeTrainer(rc=None, rows=_rows([2.0, 1.5, 1.2]))
    monkeypatch.setattr(v3.subprocess, "Popen", fake)
    rec = v3.run_one(out, "grpo", 1, 10, "/m", results, gpu=True, deadline=0.0)
    assert fake.signals == [v3.signal.SIGTERM]
    assert rec["stopped"] == "deadline after 3 of 10 steps" and len(rec["rows"]) == 3
    assert rec["key"] == v3.run_key("grpo", 1, 10, gpu=True) != v3.run_key("grpo", 1, 10)
    cmd, _ = FakeTrainer.launched[0]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "1" and not any(a.startswith("checkpoint.dir") for a in cmd)
    assert {"rollout.engine=hf", "model.attention_backend=torch"} <= set(cmd)
    assert f"logging.samples_every={v3.SAMPLES_EVERY}" in cmd   # logging only: not in the key
    assert "Stopped early (their numbers are those of the steps they ran): seed 1 GRPO: deadline after 3 of 10" \
        in v3.report(results, [1], list(v3.METHODS), gpu=True)


def test_report_from_the_recorded_files_judges_the_goals_and_leaves_out_stale_runs(tmp_path):
    results, t = tmp_path / "results", v3.target()
    grpo = _rows([2.0, 1.0] + [0.3 * t] * 8, evals={10: {"eval/avg@4": 0.2, "eval/pass@4": 0.4}})
    stare = _rows([2.0, 1.0, 0.9 * t] + [1.1 * t] * 7, gate=1.0, evals={10: {"eval/avg@4": 0.3, "eval/pass@4": 0.5}})
    ref = _rows([2.0, 1.0] + [0.2 * t] * 8, gate=1.0, evals={10: {"eval/avg@4": 0.7, "eval/pass@4": 0.8}})
    for method, rows in (("grpo", grpo), ("stare_c2", stare), ("stare_ref", ref)):
        sr.write_result(results, seed=1, method=method, key=v3.run_key(method, 1, 10), rows=rows, seconds=300.0,
                        stopped=None, target=t, steps=10, overrides=v3.method_overrides(method, 1, 10))
    sr.write_result(results, seed=1, method="dapo", key="old", rows=grpo, seconds=1.0, stopped=None, target=t,
                    steps=10, overrides=[])
    text = v3.report(results, [1], list(v3.METHODS))
    assert (results / "report.md").read_text() == text
    assert "recorded runs (3, 0.2 h of runs; 2 CPU cores, DP2, vLLM-CPU)" in text
    assert "(pass@1 = avg@4, pass@k = pass@4), at steps 10." in text   # the runs' own evaluations
    assert "Recorded under other settings, left out: seed 1 dapo" in text
    goals = text.split("## Goals")[1].split("##")[0]
    assert "GRPO's final entropy below half the target | **met** (0.30x)" in goals
    # Both STAREs are judged: the reference recipe below its band misses the goal for the seed.
    assert ("STARE in the band on >= 80% of the steps after its gate | **missed** (STARE C2 1.00, "
            "STARE (reference recipe) 0.00)") in goals
    assert "STARE C2 0.500: met; STARE (reference recipe) 0.800: met (GRPO 0.400)" in goals   # pass@4
    summary_row = [line for line in text.splitlines() if line.startswith("| 1 | STARE C2 |")][0]
    assert not math.isnan(float(summary_row.split("|")[4]))  # in band after gate
    # The figures of the current runs sit beside the report, which links them.
    for stem in ("entropy", "pass1_4", "pass4", "gate", "length", "theory"):
        assert (results / f"fig_{stem}.png").stat().st_size > 1000 and f"![fig_{stem}](fig_{stem}.png)" in text
    assert "fig_pass1.png" not in text   # no avg@8 in v3's runs


def test_a_run_directory_of_other_settings_is_never_resumed(tmp_path, monkeypatch):
    """A checkpoint in ``<out>/seed<k>/<method>`` trained under other settings (steps, data, target)
    would be resumed as if it were this run: the runner stops first, naming the directory."""
    out, results = tmp_path / "out", tmp_path / "results"
    monkeypatch.setattr(v3.subprocess, "Popen", FakeTrainer(rc=0))
    FakeTrainer.launched.clear()
    rd = v3.run_dir(out, "grpo", 1)
    rd.mkdir(parents=True)
    (rd / "run_key").write_text(v3.run_key("grpo", 1, 60) + "\n")
    with pytest.raises(SystemExit, match=f"{rd} holds a run of other settings .*move it away"):
        v3.run_one(out, "grpo", 1, 100, "/m", results)
    (rd / "run_key").unlink()
    (rd / "ckpt").mkdir()
    with pytest.raises(SystemExit, match="holds a run with no run_key"):
        v3.run_one(out, "grpo", 1, 100, "/m", results)
    assert FakeTrainer.launched == []
    # A fresh directory is marked with the run's key before the trainer starts.
    with pytest.raises(SystemExit, match="ended before step 100"):
        v3.run_one(out, "stare_c2", 1, 100, "/m", results)
    assert (v3.run_dir(out, "stare_c2", 1) / "run_key").read_text().strip() == v3.run_key("stare_c2", 1, 100)


def _eval_file(path, rows=3, columns=("prompt", "reward_model", "data_source")):
    import pyarrow as pa
    import pyarrow.parquet as pq

    full = {"prompt": [[{"role": "user", "content": f"What is {i} + 1?"}] for i in range(rows)],
            "reward_model": [{"ground_truth": str(i + 1), "style": "rule"} for i in range(rows)],
            "data_source": ["mine"] * rows}
    pq.write_table(pa.table({c: full[c] for c in columns}), path)
    return str(path)


def test_other_problems_run_and_record_apart_from_the_study(tmp_path, monkeypatch):
    """``--data-seed`` / ``--eval-path``: the runs, their data and their results live under
    ``<out>/<tag>/``; the study's own run directories and committed results are never touched."""
    out = tmp_path / "out"
    study_results = tmp_path / "study_results"
    monkeypatch.setattr(v3, "RESULTS", study_results)
    mine = v3.Data(eval_path=_eval_file(tmp_path / "mine.parquet"))
    other = v3.Data(seed=7)
    assert v3.Data().default and not mine.default and not other.default
    keys = {v3.run_key("grpo", 1, 100, data=d) for d in (v3.Data(), mine, other)}
    assert len(keys) == 3
    # The key follows the held-out rows, not the file's name or bytes.
    same = v3.Data(eval_path=_eval_file(tmp_path / "copy.parquet"))
    assert v3.run_key("grpo", 1, 100, data=same) == v3.run_key("grpo", 1, 100, data=mine)
    assert v3.run_key("grpo", 1, 100, data=v3.Data(eval_path=_eval_file(tmp_path / "four.parquet", 4))) \
        != v3.run_key("grpo", 1, 100, data=mine)
    cmd = v3.command(out, "grpo", 1, 100, "/m", data=mine)
    assert f"data.eval_path={mine.eval_path}" in cmd and f"logging.dir={out / mine.tag / 'seed1' / 'grpo'}" in cmd
    assert f"data.train_path={out / mine.tag / 'data' / 'train.parquet'}" in cmd
    assert v3.run_dir(out, "grpo", 1, other) == out / "data_s7" / "seed1" / "grpo"

    FakeTrainer.launched.clear()
    monkeypatch.setattr(v3.subprocess, "Popen", FakeTrainer(rc=0, rows=_rows([2.0, 1.0, 0.5])))
    v3.main(["--seeds", "1", "--methods", "grpo", "--steps", "3", "--out", str(out), "--model", "/m",
             "--eval-path", mine.eval_path])
    rec = json.loads(sr.result_path(out / mine.tag / "results", 1, "grpo").read_text())
    assert rec["key"] == v3.run_key("grpo", 1, 3, data=mine) and len(rec["rows"]) == 3
    assert not study_results.exists() and not (out / "seed1").exists()
    assert (out / mine.tag / "data" / "train.parquet").is_file()
    report = (out / mine.tag / "results" / "report.md").read_text()
    assert f"held-out: 3 prompts of {mine.eval_path}" in report


@pytest.mark.parametrize("case,message", [
    ("missing", "no such file"), ("text", "not a parquet file"), ("columns", "missing \\['reward_model'\\]"),
    ("empty", "it has no rows")])
def test_a_held_out_file_the_trainer_cannot_use_stops_before_any_run(case, message, tmp_path, monkeypatch):
    path = tmp_path / "held_out.parquet"
    if case == "text":
        path.write_text("question,answer\n1+1,2\n")
    elif case == "columns":
        _eval_file(path, columns=("prompt", "data_source"))
    elif case == "empty":
        _eval_file(path, rows=0)
    monkeypatch.setattr(v3.subprocess, "Popen", FakeTrainer(rc=0))
    FakeTrainer.launched.clear()
    with pytest.raises(SystemExit, match=f"--eval-path {path}: .*{message}"):
        v3.main(["--seeds", "1", "--methods", "grpo", "--out", str(tmp_path / "out"), "--model", "/m",
                 "--eval-path", str(path)])
    assert FakeTrainer.launched == []


def test_runs_go_tier_by_tier_so_a_cut_budget_drops_the_least_needed():
    order = v3.order(list(v3.METHODS), [1, 2, 3])
    assert order[:12] == [(m, s) for s in (1, 2, 3) for m in ("grpo", "stare_c2", "dapo", "stare_ref")]
    assert order[12:17] == [("grpo_ds", 1), ("stare_o1", 1), ("clip_cov", 1), ("kl_cov", 1), ("gspo", 1)]
    assert order[-1] == ("forking_tokens", 3) and len(order) == 36 == len(set(order))
    assert v3.order(["dapo", "grpo"], [3, 1]) == [("grpo", 3), ("dapo", 3), ("grpo", 1), ("dapo", 1)]


def test_a_run_that_ran_dry_is_recorded_as_stopped_and_never_relaunched(tmp_path, monkeypatch):
    """DAPO's dynamic sampling running dry (the trainer's one line, exit 1) ends the run as a
    result: recorded as stopped with the steps it ran; a rerun records it without relaunching
    (it would resume and run dry at the same step). Any other exit is still a failure."""
    out, results = tmp_path / "out", tmp_path / "results"
    line = ("error: step 4: no informative prompt groups after 10 generation batches (dynamic sampling kept 1 "
            "groups with mixed rewards; a step needs at least 2): every group was all right or all wrong\n")
    FakeTrainer.launched.clear()
    monkeypatch.setattr(v3.subprocess, "Popen", FakeTrainer(rc=1, rows=_rows([2.0, 0.5, 0.2]), output=line))
    rec = v3.run_one(out, "dapo", 1, 10, "/m", results)
    assert rec["stopped"].startswith("ran dry after 3 of 10 steps (step 4: no informative prompt groups")
    assert len(rec["rows"]) == 3 and len(FakeTrainer.launched) == 1
    sr.result_path(results, 1, "dapo").unlink()
    assert v3.run_one(out, "dapo", 1, 10, "/m", results)["stopped"] == rec["stopped"]
    assert len(FakeTrainer.launched) == 1   # recorded from its log, not launched again
    assert "Stopped early (their numbers are those of the steps they ran): seed 1 DAPO: ran dry after 3" \
        in v3.report(results, [1], list(v3.METHODS))
    monkeypatch.setattr(v3.subprocess, "Popen", FakeTrainer(rc=1, rows=_rows([2.0]), output="error: out of memory\n"))
    with pytest.raises(SystemExit, match="seed 1 grpo: the trainer exited 1"):
        v3.run_one(out, "grpo", 1, 10, "/m", results)


def test_a_runner_for_one_seed_reports_every_recorded_seed(tmp_path):
    """``--seeds 2`` runs seed 2 only, but the report it rewrites keeps seed 1's recorded runs."""
    results = tmp_path / "results"
    for seed in (1, 2):
        sr.write_result(results, seed=seed, method="grpo", key=v3.run_key("grpo", seed, 3), rows=_rows([2.0, 1.0, 0.5]),
                        seconds=90.0, stopped=None, target=v3.target(), steps=3,
                        overrides=v3.method_overrides("grpo", seed, 3), samples=[])
    assert sr.recorded_seeds(results) == [1, 2] and sr.recorded_seeds(tmp_path / "none") == []
    v3.main(["--report-only", "--seeds", "2", "--results", str(results)])
    table = (results / "report.md").read_text().split("## Goals")[0]
    assert "| 1 | GRPO |" in table and "| 2 | GRPO |" in table


def test_the_recorded_runs_stay_current_and_an_edit_of_the_config_does_not(tmp_path):
    """Every committed record's key is the key the runner computes today: a move of the code (the
    word problems' module path in the config) must not turn the study's runs stale, while a real
    edit of the shared config does change the key."""
    recorded = sr.load_results(v3.RESULTS, sr.recorded_seeds(v3.RESULTS), list(v3.METHODS))
    assert len(recorded) >= 10
    for (seed, method), rec in recorded.items():
        assert rec["key"] == v3.run_key(method, seed, rec["steps"]), f"seed {seed} {method}: stale key"
    text = v3.CONFIG.read_text(encoding="utf-8")
    (tmp_path / "renamed.yaml").write_text(text.replace("megatron_stare.study.word_problems",
                                                        "megatron_stare.demo.word_problems"), encoding="utf-8")
    (tmp_path / "edited.yaml").write_text(text.replace("compute_score_format", "compute_score"), encoding="utf-8")
    assert v3.config_key(tmp_path / "renamed.yaml") == v3.config_key()
    assert v3.config_key(tmp_path / "edited.yaml") != v3.config_key()
