"""The entropy study: every method from the same warm start, through the real trainer, over seeds.

``python -m megatron_stare.study.v2 [--task pick_sum|sum_steps] [--out DIR] [--seeds 0 1 2] [--jobs 2] [--quick]``
``python -m megatron_stare.study.v2 --tune shared|methods``       (seed 0 only; docs/study.md)
``python -m megatron_stare.study.v2 --report-only``                (rebuild table and figures)
``python -m megatron_stare.study.v2 --task sum_steps --validate``  (the warm starts' task validity only)

``--task`` (``study_tasks``): ``pick_sum`` (study v1, the default) or ``sum_steps`` (study v2: 16-32
token scratchpads). A task with a results directory (v2: ``docs/study_v2/results``; with ``--quick``
``<out>/results``) records each finished (seed, method) run there as one JSON (``study_results``),
skips the runs recorded there, and builds its report from those files alone: the study resumes
across sessions. Its warm start's validity (``study_validate``) is measured before any method runs,
and the warm start itself is kept there too (``seed<k>/sft``): a session whose seed directory is
empty restores it instead of rebuilding a start that would differ in its last bits.

Per seed k (``<out>/seed<k>``): a tiny Qwen2-style model (``base``), the ``pick_sum`` task's data
(``data``: warm-start rows, RL prompts, held-out prompts never seen in training), a supervised warm
start on a diverse set of correct answers stopped at partial sampled accuracy (``sft``), and its
measured entropy H0 (``start.json``); every method's target entropy is ``--target-ratio x H0``.
Each method (``study_methods``) is then one ``python -m megatron_stare.train`` run, a world of one
rank (``--jobs`` of them side by side), under ``seed<k>/runs/<key>`` where ``key`` names the
overrides: a run whose ``done.json`` exists is not run again, so an interrupted study resumes
where it stopped and a tuning run is reused by the study when the settings match.

Outputs (``study_report``): ``<out>/study.md`` and ``study.json`` (the table, per-seed goal
verdicts, means, the theory check, wall times), ``<out>/fig_<metric>.png`` (one per metric, every
method on it), and with ``--tune`` ``<out>/tuning_<stage>.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence
import shutil

from megatron_stare import REPO_ROOT as ROOT
from megatron_stare.study import methods as sm, report as study_report, results as sr
from megatron_stare.study.tasks import TASKS, StudyTask
from megatron_stare.study.figures import plot_study
from megatron_stare.study.report import load_runs, write_report
from megatron_stare.study.warm_start import prepare_warm_start, write_task_data
from megatron_stare.trainer.metrics import read_metrics

CONFIG = TASKS["pick_sum"].config


#: The methods this runner (v1, v2) knows: every study method but study v3's additions.
V2_METHODS = [m.name for m in sm.METHODS if m.name not in sm.V3_ONLY]


@dataclass
class StudySettings:
    out: str = "runs/study"
    seeds: List[int] = field(default_factory=lambda: [0, 1, 2])
    steps: int = 400
    """RL steps of every run."""
    evals: int = 8
    """Held-out evaluations per run (every steps/evals steps)."""
    target_ratio: float = 0.35
    """Target entropy = this x the warm start's entropy H0, for every method."""
    jobs: int = 2
    """Runs side by side (one rank each)."""
    sft_stop_accuracy: float = 0.3
    """The warm start stops once its sampled accuracy on the probe prompts reaches this."""
    eval_prompts: int = 256
    quick: bool = False
    """CI-sized: a few SFT steps, a few RL steps of tiny batches (checks the pipeline, shows nothing)."""
    methods: List[str] = field(default_factory=lambda: list(V2_METHODS))
    overrides: List[str] = field(default_factory=list)
    """Extra ``a.b=c`` trainer overrides for every run (after the study's own)."""
    task: str = "pick_sum"
    """``study_tasks.TASKS`` key."""
    results: Optional[str] = None
    """The committed results directory (default: the task's; ``<out>/results`` with ``quick``)."""


def task_of(s: StudySettings) -> StudyTask:
    return TASKS[s.task]


def results_dir(s: StudySettings) -> Optional[Path]:
    """Where finished runs are recorded (``study_results``), or None (v1: ``done.json`` only)."""
    if task_of(s).results_dir is None:
        return None
    return Path(s.results) if s.results else (Path(s.out) / "results" if s.quick else task_of(s).results_dir)


#: Study v1's methods (its committed results predate GSPO, CISPO and forking tokens).
V1_METHODS = [m for m in V2_METHODS if m not in ("gspo", "cispo", "forking_tokens")]


def log(msg: str) -> None:
    print(f"[study] {msg}", flush=True)


def seed_dir(s: StudySettings, seed: int) -> Path:
    return Path(s.out) / f"seed{seed}"


def prepare_seed(s: StudySettings, seed: int) -> dict:
    """Base model, data, warm start and H0 of one seed (``warm_start``; cached in ``start.json``)."""

    task = task_of(s)
    res = results_dir(s)
    if res is not None and not (seed_dir(s, seed) / "start.json").is_file():
        restore_start(s, seed)
    cached = (seed_dir(s, seed) / "start.json").is_file()
    stop = s.sft_stop_accuracy if task.name == "pick_sum" else task.stop_accuracy
    start = prepare_warm_start(seed_dir(s, seed), seed, quick=s.quick, eval_prompts=_eval_prompts(s),
                               stop_accuracy=stop, log=lambda m: log(f"seed {seed} {m}"), task=task)
    if res is not None:
        start = validate_seed(s, seed, start)
        if not (sr.start_checkpoint(res, seed) / "model.safetensors").is_file():
            sr.keep_start_checkpoint(res, seed, seed_dir(s, seed) / "sft")
    if not cached:
        log(f"seed {seed} warm start: sampled accuracy {start['accuracy']:.2f}, pass@8 {start['pass@8']:.2f}, "
            f"H0 {start['H0']:.3f} -> target {target_entropy(s, start):.3f} ({s.target_ratio} x H0); held-out "
            f"pass@1 {start['eval_pass@1']:.2f} pass@8 {start['eval_pass@8']:.2f}")
    return start


def _eval_prompts(s: StudySettings) -> int:
    task = task_of(s)
    return s.eval_prompts if task.name == "pick_sum" else task.eval_prompts


def restore_start(s: StudySettings, seed: int) -> bool:
    """Put the committed warm start of ``seed`` (``study_results.start_checkpoint`` and its
    ``start.json``) in this machine's seed directory, with the seed's task data, so that nothing
    is rebuilt. False (nothing done) when no matching checkpoint is committed."""


    res, d = results_dir(s), seed_dir(s, seed)
    start = sr.load_starts(res, [seed]).get(seed)
    ckpt = sr.start_checkpoint(res, seed)
    if (start is None or start.get("quick") != s.quick or start.get("task") != s.task
            or not (ckpt / "model.safetensors").is_file()):
        return False
    write_task_data(d, seed, quick=s.quick, eval_prompts=_eval_prompts(s), task=task_of(s))
    shutil.rmtree(d / "sft", ignore_errors=True)
    shutil.copytree(ckpt, d / "sft")
    sr.write_json_atomic(d / "start.json", start)  # last: its presence means "prepared"
    log(f"seed {seed}: warm start restored from {ckpt} (H0 {start['H0']:.3f})")
    return True


def validate_seed(s: StudySettings, seed: int, start: dict) -> dict:
    """The warm start's task validity (``study_validate``; cached in ``start.json``), copied with the
    start's numbers to the results directory."""
    from megatron_stare.study.validate import format_validity, validate_checkpoint

    d = seed_dir(s, seed)
    if "validity" not in start:
        v = validate_checkpoint(d / "sft", d / "data" / "eval.jsonl", task_of(s), seed=seed,
                                prompts=16 if s.quick else 64)
        start = {**start, "validity": v.to_json()}
        sr.write_json_atomic(d / "start.json", start)
        log(f"seed {seed} {format_validity(v)}")
    sr.write_json_atomic(results_dir(s) / f"seed{seed}" / "start.json", start)
    return start


def target_entropy(s: StudySettings, start: dict) -> float:
    """The target of every method: ``s.target_ratio`` x the warm start's measured entropy."""
    return s.target_ratio * start["H0"]


@dataclass(frozen=True)
class RunSpec:
    seed: int
    method: str
    """The method's name (``study_methods.METHODS``)."""
    overrides: tuple
    """The method's overrides (shared + switches + knobs), before the study's paths."""
    label: str = ""
    """Name on the console and in the tuning table (default: the method's)."""


def run_key(spec: RunSpec) -> str:
    """A directory name for these overrides: the method plus a hash of the overrides (so a tuning
    run and a study run with the same settings share one directory, and one run)."""
    h = hashlib.sha1("\n".join(spec.overrides).encode()).hexdigest()[:8]
    return f"{spec.method}-{h}"


def run_dir(s: StudySettings, spec: RunSpec) -> Path:
    return seed_dir(s, spec.seed) / "runs" / run_key(spec)


def trainer_args(s: StudySettings, spec: RunSpec, start: dict) -> List[str]:
    d, rd = seed_dir(s, spec.seed), run_dir(s, spec)
    steps = run_steps(s)
    # Only STARE's gate reads the target; other methods run without it, so changing the target
    # ratio re-runs only the STARE runs (the report measures every method against the target).
    target = target_entropy(s, start) if spec.method.startswith("stare") else 0.0
    ov = [f"model.path={d / 'sft'}", f"data.train_path={d / 'data' / 'train.jsonl'}",
          f"data.eval_path={d / 'data' / 'eval.jsonl'}", f"logging.dir={rd}",
          f"algorithm.stare.target_entropy={target:.6f}", f"trainer.total_steps={steps}",
          f"trainer.eval_every={max(1, steps // s.evals)}", f"trainer.seed={spec.seed + 1}", f"data.seed={spec.seed}",
          f"logging.log_every={max(1, steps // 4)}", *spec.overrides]
    task = task_of(s)
    if task.name != "pick_sum":  # the v2 config serves every v2 task: its reward and length limit
        ov += [f"reward.fn={task.name}", f"rollout.max_new_tokens={task.max_new_tokens}"]
        if spec.method == "dapo":  # overlong shaping over the last quarter of the length limit
            ov += [f"reward.overlong_buffer_len={task.max_new_tokens // 4}"]
    if s.quick:
        ov += ["trainer.prompts_per_step=4", "rollout.n=4"]
        if task.name != "pick_sum":  # one evaluation, of 16 samples (still a pass@k ladder)
            ov += [f"trainer.eval_every={steps}", "rollout.eval_n=16"]
    return ov + list(s.overrides)


def run_steps(s: StudySettings) -> int:
    return 3 if s.quick else s.steps


def result_key(s: StudySettings, spec: RunSpec, start: dict) -> str:
    """What defines a recorded run, without this machine's paths (``study_results``): the task and
    its settings, the warm start (its H0), the run's overrides and schedule."""
    target = target_entropy(s, start) if spec.method.startswith("stare") else 0.0
    return sr.result_key([s.task, json.dumps(task_of(s).kwargs, sort_keys=True), f"{start['H0']:.6f}", str(spec.seed),
                          str(run_steps(s)), str(s.evals), f"{target:.4f}", str(s.quick), *spec.overrides, "--",
                          *s.overrides])


def run_one(s: StudySettings, spec: RunSpec, start: dict) -> Path:
    """Run (unless already done) one trainer run; returns its directory."""
    rd = run_dir(s, spec)
    args = trainer_args(s, spec, start)
    done = rd / "done.json"
    res, key = results_dir(s), result_key(s, spec, start)
    if res is not None and sr.finished(res, spec.seed, spec.method, key) is not None:
        return rd
    if done.is_file() and json.loads(done.read_text()).get("args") == args:
        if res is not None:  # finished here, not yet recorded (a runner killed in between)
            _record(s, spec, start, rd, key)
        return rd
    rd.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "megatron_stare.train", "--config", str(task_of(s).config), *args]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    log(f"seed {spec.seed} {_name(spec)}: start ({rd.name})")
    with open(rd / "train.log", "w") as f:
        code = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    stopped = None if code == 0 else sr.ran_dry(rd)
    if code != 0 and stopped is None:
        tail = (rd / "train.log").read_text()[-2000:]
        raise RuntimeError(f"seed {spec.seed} {_name(spec)} failed (exit {code}); log {rd / 'train.log'}:\n{tail}")
    wall = round(time.perf_counter() - t0, 1)
    done.write_text(json.dumps({"args": args, "method": spec.method, "seconds": wall, "stopped": stopped}, indent=2))
    log(f"seed {spec.seed} {_name(spec)}: done in {wall:.0f}s" + (f" (stopped: {stopped})" if stopped else ""))
    if res is not None:
        _record(s, spec, start, rd, key)
    return rd


def _record(s: StudySettings, spec: RunSpec, start: dict, rd: Path, key: str) -> None:

    d = json.loads((rd / "done.json").read_text())
    path = sr.write_result(results_dir(s), seed=spec.seed, method=spec.method, key=key,
                           rows=read_metrics(str(rd / "metrics.jsonl")), seconds=d["seconds"], stopped=d.get("stopped"),
                           target=target_entropy(s, start), steps=run_steps(s), overrides=spec.overrides)
    log(f"seed {spec.seed} {_name(spec)}: recorded {path}")


def run_all(s: StudySettings, specs: Sequence[RunSpec], starts: Dict[int, dict]) -> Dict[RunSpec, Path]:
    """Every spec, ``s.jobs`` at a time; the first failure stops the rest (after the running ones)."""
    with ThreadPoolExecutor(max_workers=max(1, s.jobs)) as pool:
        futures = {spec: pool.submit(run_one, s, spec, starts[spec.seed]) for spec in specs}
        return {spec: fut.result() for spec, fut in futures.items()}


def study_specs(s: StudySettings) -> List[RunSpec]:
    return [RunSpec(seed, name, tuple(task_of(s).method_overrides(name))) for seed in s.seeds for name in s.methods]


def _name(spec: RunSpec) -> str:
    return spec.label or spec.method


def report(s: StudySettings, starts: Dict[int, dict], wall_seconds: float) -> dict:
    """The figures, ``study.md`` and ``study.json`` from the finished runs of ``s``'s seeds and
    methods: the recorded results (a task with a results directory) or the run directories."""

    res = results_dir(s)
    if res is not None:
        found = sr.load_results(res, list(starts), s.methods)
        # Only results recorded under the seed's current warm start (its H0 is in the key): a result
        # of a start since rebuilt describes other weights and is not mixed into the table.
        keys = {(spec.seed, spec.method): result_key(s, spec, starts[spec.seed]) for spec in study_specs(s)
                if spec.seed in starts}
        stale = sorted(k for k, v in found.items() if v.get("key") != keys.get(k))
        if stale:
            log("not in the report (recorded under an earlier warm start): "
                + ", ".join(f"seed {seed} {m}" for seed, m in stale))
        found = {k: v for k, v in found.items() if k not in stale}
        rows = {k: v["rows"] for k, v in found.items()}
        done = {k: {"seconds": v["seconds"], "stopped": v["stopped"]} for k, v in found.items()}
    else:
        runs = {(spec.seed, spec.method): str(run_dir(s, spec)) for spec in study_specs(s)
                if spec.seed in starts and (run_dir(s, spec) / "done.json").is_file()}
        rows = load_runs(runs)
        done = {k: json.loads((Path(d) / "done.json").read_text()) for k, d in runs.items()}
    Path(s.out).mkdir(parents=True, exist_ok=True)
    figs = plot_study(rows, {seed: target_entropy(s, st) for seed, st in starts.items()}, Path(s.out))
    return write_report(s, starts, rows, done, figs, wall_seconds=wall_seconds)


def recorded_start(s: StudySettings, seed: int) -> Optional[dict]:
    """The committed ``start.json`` of ``seed`` when every requested method of it is recorded under
    that start (its H0 is in the key), else None: such a seed needs no warm start on this machine."""
    res = results_dir(s)
    start = sr.load_starts(res, [seed]).get(seed) if res is not None else None
    if start is None or start.get("quick") != s.quick:
        return None
    specs = [spec for spec in study_specs(s) if spec.seed == seed]
    done = all(sr.finished(res, seed, spec.method, result_key(s, spec, start)) is not None for spec in specs)
    return start if done else None


def run_study(s: StudySettings) -> dict:
    t0 = time.perf_counter()
    sm.check_grids()
    starts = {}
    for seed in s.seeds:
        starts[seed] = recorded_start(s, seed)
        if starts[seed] is not None:
            log(f"seed {seed}: every requested method is recorded; its warm start is not rebuilt")
        else:
            starts[seed] = prepare_seed(s, seed)
    run_all(s, study_specs(s), starts)
    return report(s, starts, wall_seconds=time.perf_counter() - t0)


def rebuild(s: StudySettings) -> dict:
    """The report from the finished runs of ``s``'s seeds and methods (nothing is run)."""
    res = results_dir(s)
    if res is not None:
        starts = dict(sr.load_starts(res, s.seeds))
    else:
        starts = {seed: json.loads((seed_dir(s, seed) / "start.json").read_text()) for seed in s.seeds
                  if (seed_dir(s, seed) / "start.json").is_file()}
    return report(s, starts, wall_seconds=0.0)


def validate(s: StudySettings) -> Dict[int, dict]:
    """Only the warm starts and their task validity (``--validate``), every seed; prints them."""
    from megatron_stare.study.validate import Validity, format_validity

    out = {}
    for seed in s.seeds:
        start = prepare_seed(s, seed)
        v = start.get("validity")
        if v is not None:
            print(f"seed {seed}: " + format_validity(Validity(**{k: x for k, x in v.items() if k != "checks"})),
                  flush=True)
        out[seed] = start
    return out


def tuning_specs(s: StudySettings, stage: str) -> List[RunSpec]:
    """Seed 0 only. ``shared``: plain GRPO (clip 0.2) at each point of ``SHARED_GRID``;
    ``methods``: each method's grid on top of the chosen ``SHARED`` (run after ``shared``)."""
    if stage == "shared":
        return [RunSpec(0, "grpo", tuple(sm.method_overrides("grpo", knobs=(), shared=p)), label=f"shared{i}")
                for i, p in enumerate(sm.SHARED_GRID)]
    return [RunSpec(0, name, tuple(sm.method_overrides(name, knobs)), label=f"{name}{i}")
            for name in s.methods for i, knobs in enumerate(sm.GRIDS[name])]


def tune(s: StudySettings, stage: str) -> dict:
    """Run a tuning stage (docs/study.md) and write ``tuning_<stage>.md``."""

    sm.check_grids()
    if results_dir(s) is not None:
        raise SystemExit(f"--tune is study v1's (pick_sum); study v2 ({s.task}) reuses v1's tuned settings "
                         "(docs/study.md, 'Study v2')")
    starts = {0: prepare_seed(s, 0)}
    specs = tuning_specs(s, stage)
    dirs = run_all(s, specs, starts)
    return study_report.write_tuning(s, starts[0], {spec: str(dirs[spec]) for spec in specs}, stage)


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple:
    ap = argparse.ArgumentParser(prog="python -m megatron_stare.study.v2", description=__doc__.split("\n")[0])
    d = StudySettings()
    ap.add_argument("--task", default=d.task, choices=sorted(TASKS), help="pick_sum (v1, default) or sum_steps (v2)")
    ap.add_argument("--out", default=None, help="default runs/study (pick_sum), runs/study_<task> otherwise")
    ap.add_argument("--results", default=None, help="results directory of a v2 task (default: the task's)")
    ap.add_argument("--seeds", type=int, nargs="+", default=d.seeds)
    ap.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the task's)")
    ap.add_argument("--jobs", type=int, default=d.jobs, help="runs side by side (default %(default)s)")
    ap.add_argument("--target-ratio", type=float, default=d.target_ratio)
    ap.add_argument("--methods", nargs="+", default=d.methods, choices=V2_METHODS)
    ap.add_argument("--quick", action="store_true", help="CI-sized: tiny warm start, 3 RL steps per run")
    ap.add_argument("--tune", choices=("shared", "methods"), default=None,
                    help="run a tuning stage on seed 0 instead of the study: the shared lr/batch grid "
                         "(GRPO), then each method's own grid")
    ap.add_argument("--report-only", action="store_true", help="rebuild the report from finished runs; run nothing")
    ap.add_argument("--validate", action="store_true", help="warm starts and their task validity only")
    ap.add_argument("overrides", nargs="*", help="extra a.b=c trainer overrides for every run")
    a = ap.parse_args(argv)
    steps = a.steps if a.steps is not None else TASKS[a.task].default_steps
    if steps < 1 or a.target_ratio <= 0 or a.jobs < 1:
        ap.error("--steps and --jobs must be >= 1, --target-ratio > 0")
    out = a.out or (d.out if a.task == "pick_sum" else f"runs/study_{a.task}")
    methods = list(a.methods) if a.task != "pick_sum" or a.methods != d.methods else V1_METHODS
    s = StudySettings(out=out, seeds=list(a.seeds), steps=steps, jobs=a.jobs, target_ratio=a.target_ratio,
                      methods=methods, quick=a.quick, overrides=list(a.overrides), task=a.task, results=a.results,
                      evals=TASKS[a.task].evals)
    return s, a.tune, ("validate" if a.validate else "report" if a.report_only else None)


def main(argv: Optional[Sequence[str]] = None) -> int:
    s, stage, mode = parse_args(argv)
    if mode == "validate":
        validate(s)
    elif stage:
        tune(s, stage)
    elif mode == "report":
        rebuild(s)
    else:
        run_study(s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
