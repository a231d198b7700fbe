"""The entropy study: every method from the same warm start, through the real trainer, over seeds.

``python -m megatron_stare.demo.study [--out runs/study] [--seeds 0 1 2] [--jobs 2] [--quick]``
``python -m megatron_stare.demo.study --tune shared|methods``       (seed 0 only; docs/study.md)
``python -m megatron_stare.demo.study --report-only``                (rebuild table and figures)

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

from megatron_stare.demo import study_methods as sm

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "study_cpu.yaml"


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
    methods: List[str] = field(default_factory=lambda: [m.name for m in sm.METHODS])
    overrides: List[str] = field(default_factory=list)
    """Extra ``a.b=c`` trainer overrides for every run (after the study's own)."""


def log(msg: str) -> None:
    print(f"[study] {msg}", flush=True)


def seed_dir(s: StudySettings, seed: int) -> Path:
    return Path(s.out) / f"seed{seed}"


def prepare_seed(s: StudySettings, seed: int) -> dict:
    """Base model, data, warm start and H0 of one seed (``warm_start``; cached in ``start.json``)."""
    from megatron_stare.demo.warm_start import prepare_warm_start

    cached = (seed_dir(s, seed) / "start.json").is_file()
    start = prepare_warm_start(seed_dir(s, seed), seed, quick=s.quick, eval_prompts=s.eval_prompts,
                               stop_accuracy=s.sft_stop_accuracy, log=lambda m: log(f"seed {seed} {m}"))
    if not cached:
        log(f"seed {seed} warm start: sampled accuracy {start['accuracy']:.2f}, pass@8 {start['pass@8']:.2f}, "
            f"H0 {start['H0']:.3f} -> target {target_entropy(s, start):.3f} ({s.target_ratio} x H0); held-out "
            f"pass@1 {start['eval_pass@1']:.2f} pass@8 {start['eval_pass@8']:.2f}")
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
    steps = 3 if s.quick else s.steps
    # Only STARE's gate reads the target; other methods run without it, so changing the target
    # ratio re-runs only the STARE runs (the report measures every method against the target).
    target = target_entropy(s, start) if spec.method.startswith("stare") else 0.0
    ov = [f"model.path={d / 'sft'}", f"data.train_path={d / 'data' / 'train.jsonl'}",
          f"data.eval_path={d / 'data' / 'eval.jsonl'}", f"logging.dir={rd}",
          f"algorithm.stare.target_entropy={target:.6f}", f"trainer.total_steps={steps}",
          f"trainer.eval_every={max(1, steps // s.evals)}", f"trainer.seed={spec.seed + 1}", f"data.seed={spec.seed}",
          f"logging.log_every={max(1, steps // 4)}", *spec.overrides]
    if s.quick:
        ov += ["trainer.prompts_per_step=4", "rollout.n=4"]
    return ov + list(s.overrides)


def run_one(s: StudySettings, spec: RunSpec, start: dict) -> Path:
    """Run (unless already done) one trainer run; returns its directory."""
    rd = run_dir(s, spec)
    args = trainer_args(s, spec, start)
    done = rd / "done.json"
    if done.is_file() and json.loads(done.read_text()).get("args") == args:
        return rd
    rd.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "megatron_stare.train", "--config", str(CONFIG), *args]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    log(f"seed {spec.seed} {_name(spec)}: start ({rd.name})")
    with open(rd / "train.log", "w") as f:
        code = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    stopped = None if code == 0 else ran_dry(rd)
    if code != 0 and stopped is None:
        tail = (rd / "train.log").read_text()[-2000:]
        raise RuntimeError(f"seed {spec.seed} {_name(spec)} failed (exit {code}); log {rd / 'train.log'}:\n{tail}")
    wall = round(time.perf_counter() - t0, 1)
    done.write_text(json.dumps({"args": args, "method": spec.method, "seconds": wall, "stopped": stopped}, indent=2))
    log(f"seed {spec.seed} {_name(spec)}: done in {wall:.0f}s" + (f" (stopped: {stopped})" if stopped else ""))
    return rd


def ran_dry(rd: Path) -> Optional[str]:
    """Why a run ended early as a *result* rather than a failure, or None: DAPO's dynamic sampling
    finds no prompt group with mixed rewards in ``trainer.max_gen_batches`` draws once the policy
    has collapsed (every group all right or all wrong), and the trainer stops there (as verl's DAPO
    does). The steps until then are the run's result; the report marks the run as stopped."""
    marker = "no informative prompt groups after"
    log_text = (rd / "train.log").read_text(errors="replace") if (rd / "train.log").is_file() else ""
    line = next((ln for ln in log_text.splitlines() if marker in ln and "RuntimeError: " in ln), None)
    if line is None or not (rd / "metrics.jsonl").is_file():
        return None
    return line.split("RuntimeError: ", 1)[1].strip()


def run_all(s: StudySettings, specs: Sequence[RunSpec], starts: Dict[int, dict]) -> Dict[RunSpec, Path]:
    """Every spec, ``s.jobs`` at a time; the first failure stops the rest (after the running ones)."""
    with ThreadPoolExecutor(max_workers=max(1, s.jobs)) as pool:
        futures = {spec: pool.submit(run_one, s, spec, starts[spec.seed]) for spec in specs}
        return {spec: fut.result() for spec, fut in futures.items()}


def study_specs(s: StudySettings) -> List[RunSpec]:
    return [RunSpec(seed, name, tuple(sm.method_overrides(name))) for seed in s.seeds for name in s.methods]


def _name(spec: RunSpec) -> str:
    return spec.label or spec.method


def report(s: StudySettings, starts: Dict[int, dict], runs: Dict[tuple, str], wall_seconds: float) -> dict:
    """The figures, ``study.md`` and ``study.json`` from finished runs ((seed, method) -> directory)."""
    from megatron_stare.demo.study_figures import plot_study
    from megatron_stare.demo.study_report import load_runs, write_report

    rows = load_runs(runs)
    Path(s.out).mkdir(parents=True, exist_ok=True)
    figs = plot_study(rows, {seed: target_entropy(s, st) for seed, st in starts.items()}, Path(s.out))
    return write_report(s, starts, rows, runs, figs, wall_seconds=wall_seconds)


def run_study(s: StudySettings) -> dict:
    t0 = time.perf_counter()
    sm.check_grids()
    starts = {seed: prepare_seed(s, seed) for seed in s.seeds}
    specs = study_specs(s)
    dirs = run_all(s, specs, starts)
    runs = {(spec.seed, spec.method): str(dirs[spec]) for spec in specs}
    return report(s, starts, runs, wall_seconds=time.perf_counter() - t0)


def rebuild(s: StudySettings) -> dict:
    """The report from the finished runs of ``s``'s seeds and methods (nothing is run)."""
    starts = {seed: json.loads((seed_dir(s, seed) / "start.json").read_text()) for seed in s.seeds
              if (seed_dir(s, seed) / "start.json").is_file()}
    runs = {(spec.seed, spec.method): str(run_dir(s, spec)) for spec in study_specs(s)
            if spec.seed in starts and (run_dir(s, spec) / "done.json").is_file()}
    return report(s, starts, runs, wall_seconds=0.0)


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
    from megatron_stare.demo import study_report

    sm.check_grids()
    starts = {0: prepare_seed(s, 0)}
    specs = tuning_specs(s, stage)
    dirs = run_all(s, specs, starts)
    return study_report.write_tuning(s, starts[0], {spec: str(dirs[spec]) for spec in specs}, stage)


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple:
    ap = argparse.ArgumentParser(prog="python -m megatron_stare.demo.study", description=__doc__.split("\n")[0])
    d = StudySettings()
    ap.add_argument("--out", default=d.out)
    ap.add_argument("--seeds", type=int, nargs="+", default=d.seeds)
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--jobs", type=int, default=d.jobs, help="runs side by side (default %(default)s)")
    ap.add_argument("--target-ratio", type=float, default=d.target_ratio)
    ap.add_argument("--methods", nargs="+", default=d.methods, choices=[m.name for m in sm.METHODS])
    ap.add_argument("--quick", action="store_true", help="CI-sized: tiny warm start, 3 RL steps per run")
    ap.add_argument("--tune", choices=("shared", "methods"), default=None,
                    help="run a tuning stage on seed 0 instead of the study: the shared lr/batch grid "
                         "(GRPO), then each method's own grid")
    ap.add_argument("--report-only", action="store_true", help="rebuild the report from finished runs; run nothing")
    ap.add_argument("overrides", nargs="*", help="extra a.b=c trainer overrides for every run")
    a = ap.parse_args(argv)
    if a.steps < 1 or a.target_ratio <= 0 or a.jobs < 1:
        ap.error("--steps and --jobs must be >= 1, --target-ratio > 0")
    s = StudySettings(out=a.out, seeds=list(a.seeds), steps=a.steps, jobs=a.jobs, target_ratio=a.target_ratio,
                      methods=list(a.methods), quick=a.quick, overrides=list(a.overrides))
    return s, a.tune, a.report_only


def main(argv: Optional[Sequence[str]] = None) -> int:
    s, stage, report_only = parse_args(argv)
    if stage:
        tune(s, stage)
    elif report_only:
        rebuild(s)
    else:
        run_study(s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
