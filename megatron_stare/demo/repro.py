"""The demo over several seeds, for the record: ``python -m megatron_stare.demo.repro
[--out runs/demo_repro] [--seeds 0 1 2] [--steps N]``.

Each seed is a whole ``demo.run`` pipeline (its own base model, warm start, target, GRPO and
STARE runs) under ``<out>/seed<k>``. Prints, and writes to ``<out>/repro.md`` and
``<out>/repro.json``, one row per seed and run plus the mean over seeds, and checks the demo's
claims per seed:

- GRPO collapses: its final entropy is below half the target;
- STARE holds: its mean entropy after the gate first fires is within 0.7-1.3x the target, and
  so is its final entropy (a run that drifts through the band and out of it does not hold);
- STARE's final accuracy is not below GRPO's by more than ``--acc-tolerance`` (seed noise).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from megatron_stare.demo.run import BAND, DemoSettings, run_demo


def check(summary: dict, acc_tolerance: float) -> Dict[str, bool]:
    t = summary["start"]["target_entropy"]
    g, s = summary["runs"]["GRPO"], summary["runs"]["STARE"]
    return {
        "grpo_collapses": g["final_entropy"] < 0.5 * t,
        "stare_holds": all(BAND[0] * t <= s[k] <= BAND[1] * t for k in ("mean_entropy_after_gate", "final_entropy")),
        "stare_acc_ok": s["final_accuracy"] >= g["final_accuracy"] - acc_tolerance,
    }


def table(summaries: Dict[int, dict], acc_tolerance: float) -> str:
    """A markdown table: one row per seed and run, then the mean over seeds per run."""
    head = ("| seed | run | H0 | target | first below target | H final | H final / target | H after (mean) "
            "| in band after | acc start | acc final | claim |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines: List[str] = [head]
    per_run: Dict[str, List[dict]] = {}
    for seed, sm in summaries.items():
        ok = check(sm, acc_tolerance)
        for label, r in sm["runs"].items():
            per_run.setdefault(label, []).append(r)
            claim = ("collapses" if ok["grpo_collapses"] else "does not collapse") if label == "GRPO" else (
                ("holds" if ok["stare_holds"] else "does not hold") + ", acc " + ("ok" if ok["stare_acc_ok"] else "lower"))
            lines.append(f"| {seed} | {label} | {sm['start']['start_entropy']:.3f} | {sm['start']['target_entropy']:.3f} "
                         f"| {r['first_gate_step']} | {r['final_entropy']:.3f} "
                         f"| {r['final_entropy'] / sm['start']['target_entropy']:.2f} | {r['mean_entropy_after_gate']:.3f} "
                         f"| {r['frac_in_band_after_gate']:.2f} | {r['start_accuracy']:.2f} | {r['final_accuracy']:.2f} "
                         f"| {claim} |")
    if len(summaries) > 1:
        for label, rs in per_run.items():
            def ms(key: str) -> str:
                xs = [r[key] for r in rs]
                return f"{statistics.fmean(xs):.3f} +- {statistics.stdev(xs):.3f}"

            lines.append(f"| mean | {label} | | | | {ms('final_entropy')} | | {ms('mean_entropy_after_gate')} "
                         f"| {ms('frac_in_band_after_gate')} | {ms('start_accuracy')} | {ms('final_accuracy')} | |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_stare.demo.repro", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/demo_repro")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=DemoSettings.steps)
    ap.add_argument("--acc-tolerance", type=float, default=0.1,
                    help="how far STARE's final accuracy may fall below GRPO's and still count as equal")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--table-only", action="store_true",
                    help="rebuild the table from the seeds' existing summary.json files, run nothing")
    ap.add_argument("overrides", nargs="*", help="extra a.b=c trainer overrides for every run")
    a = ap.parse_args(argv)
    summaries = {}
    for seed in a.seeds:
        if a.table_only:
            summaries[seed] = json.loads((Path(a.out) / f"seed{seed}" / "summary.json").read_text())
            continue
        summaries[seed] = run_demo(DemoSettings(out=str(Path(a.out) / f"seed{seed}"), seed=seed, steps=a.steps,
                                                quick=a.quick, overrides=list(a.overrides)))
    md = table(summaries, a.acc_tolerance)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "repro.md").write_text(md + "\n")
    with open(Path(a.out) / "repro.json", "w") as f:
        json.dump({str(k): {**v, "checks": check(v, a.acc_tolerance)} for k, v in summaries.items()}, f, indent=2)
    print(md, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
