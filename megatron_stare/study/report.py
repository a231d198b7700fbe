"""The entropy study's numbers: per-run summaries, the table, the goals, the theory check, figures.

Definitions (docs/study.md):

- **final** entropy / accuracy / length: mean over the last 10% of the steps (at least 5).
- **in band**: among the steps from the first one whose entropy is below the target (the step at
  which STARE's gate first fires; the same rule for every method) to the end, the fraction whose
  entropy is within 0.7-1.3x the target. ``nan`` if entropy never fell below the target.
- **pass@1 / pass@8**: held-out prompts, 8 samples each at temperature 1 (``eval/avg@8``,
  ``eval/pass@8``), averaged over the evaluations of the last quarter of the run. Study v2 samples
  32 per prompt: pass@1 is ``eval/avg@32``, pass@8 the unbiased estimate from the 32, and
  **pass@32** (``eval/pass@32``) is the pass@k of its goal; v1's goal uses pass@8; v3 samples 4
  (pass@1 is ``eval/avg@4``, its goal's pass@k ``eval/pass@4``).
- **DAPO at equal generated tokens**: DAPO's numbers at the last step whose cumulative generated
  tokens (``rollout/generated_tokens``, every rollout batch it drew) do not exceed GRPO's total.
- **theory check**: Pearson correlation between the logged predicted entropy change of step t
  (``dynamics/pred_dH``, first order, per unit step size) and the measured one, H(t+1) - H(t);
  per step, and over non-overlapping windows of ``WINDOW`` steps (sum of predictions vs change
  over the window), which averages out the batch-to-batch noise of the measured entropy.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from megatron_stare.study import methods as sm
from megatron_stare.trainer.metrics import ACCURACY, ENTROPY, GATE, RESPONSE_LENGTH, read_metrics

BAND = (0.7, 1.3)
WINDOW = 10
QUADRANTS = ("frac_pos_high", "frac_pos_low", "frac_neg_high", "frac_neg_low")
PASS1, PASS8, PASS32 = "eval/avg@8", "eval/pass@8", "eval/pass@32"
COLUMNS = (("final_ratio", "H final / target", "{:.2f}"), ("in_band", "in band after gate", "{:.2f}"),
           ("train_acc", "train acc", "{:.3f}"), ("pass1", "pass@1", "{:.3f}"), ("pass8", "pass@8", "{:.3f}"),
           ("pass32", "pass@32", "{:.3f}"),
           ("length", "resp. len", "{:.2f}"), ("corr_step", "corr(pred, dH) step", "{:.2f}"),
           ("corr_window", f"corr {WINDOW}-step", "{:.2f}"))

#: Columns a study may add (study v3): the goal's pass@k at the evaluation's own k, the gate's duty
#: cycle (the fraction of steps it was on) and the run's wall time.
EXTRA_COLUMNS = (("passk", "pass@k", "{:.3f}"), ("gate_duty", "gate on", "{:.2f}"), ("minutes", "run min", "{:.0f}"))


def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.fmean(xs) if xs else math.nan


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float:
    if len(xs) < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return math.nan
    return statistics.correlation(list(xs), list(ys))


def theory_pairs(rows: Sequence[dict], window: int = 1) -> Tuple[List[float], List[float]]:
    """(predicted, measured) entropy changes over consecutive windows of ``window`` steps."""
    pred = [float(r.get("dynamics/pred_dH", math.nan)) for r in rows]
    ent = [float(r[ENTROPY]) for r in rows]
    xs, ys = [], []
    for i in range(0, len(rows) - window, window):
        p = sum(pred[i:i + window])
        if not math.isnan(p):
            xs.append(p)
            ys.append(ent[i + window] - ent[i])
    return xs, ys


def summarize_run(rows: Sequence[dict], target: float) -> dict:
    """The table's numbers for one run's metrics rows (see the module docstring)."""
    n = len(rows)
    tail = max(5, n // 10)
    ent = [float(r[ENTROPY]) for r in rows]
    gate = [i for i, r in enumerate(rows) if float(r.get(GATE, 0)) > 0]
    below = [i for i, h in enumerate(ent) if h < target]
    first = gate[0] if gate else (below[0] if below else None)
    after = ent[first:] if first is not None else []
    lo, hi = BAND[0] * target, BAND[1] * target
    p1 = next((k for r in rows for k in r if k.startswith("eval/avg@")), PASS1)
    pk = "eval/pass@" + p1.rsplit("@", 1)[1]  # pass@k at the evaluation's own k (v3: 4)
    evals = [(r["step"], float(r[p1]), float(r.get(PASS8, math.nan)), float(r.get(PASS32, math.nan)),
              float(r.get(pk, math.nan))) for r in rows if p1 in r]
    last_step = rows[-1]["step"] if rows else 0
    late = [e for e in evals if e[0] > 0.75 * last_step] or evals[-1:]
    out = {
        "steps": n,
        "first_gate_step": rows[first]["step"] if first is not None else None,
        "final_entropy": _mean(ent[-tail:]),
        "final_ratio": _mean(ent[-tail:]) / target if target > 0 else math.nan,
        "in_band": sum(lo <= h <= hi for h in after) / len(after) if after else math.nan,
        "train_acc": _mean([float(r[ACCURACY]) for r in rows[-tail:]]),
        "pass1": _mean([e[1] for e in late]),
        "pass8": _mean([e[2] for e in late]),
        "pass32": _mean([e[3] for e in late]),
        "gen_tokens": sum(float(r.get("rollout/generated_tokens", math.nan)) for r in rows),
        "length": _mean([float(r[RESPONSE_LENGTH]) for r in rows[-tail:]]),
        "corr_step": pearson(*theory_pairs(rows, 1)),
        "corr_window": pearson(*theory_pairs(rows, WINDOW)),
        "gate_duty": _mean([float(r.get(GATE, 0.0)) for r in rows]),
        "final_w": float(rows[-1].get("stare/w", math.nan)) if rows else math.nan,
        "final_m": float(rows[-1].get("stare/m", math.nan)) if rows else math.nan,
    }
    for q in QUADRANTS:
        out[q] = _mean([float(r.get(f"dynamics/{q}", math.nan)) for r in rows])
    out["pred_dH_mean"] = _mean([float(r.get("dynamics/pred_dH", math.nan)) for r in rows])
    # The goal's pass@k: pass@32 (v2), else pass@8 (v1), else the evaluation's own k (v3).
    out["passk"] = next((v for v in (out["pass32"], out["pass8"], _mean([e[4] for e in late])) if not math.isnan(v)),
                        math.nan)
    return out


def equal_tokens(dapo: Sequence[dict], grpo: Sequence[dict], target: float) -> Optional[dict]:
    """DAPO's run cut at GRPO's total generated tokens: ``summarize_run`` of the steps whose
    cumulative tokens stay within it, with ``budget_tokens`` (GRPO's) and ``tokens`` (those
    steps': fewer when DAPO's run ended first); None without token counts."""
    if not dapo or not grpo or "rollout/generated_tokens" not in dapo[0]:
        return None
    budget = sum(float(r["rollout/generated_tokens"]) for r in grpo)
    cum, cut, used = 0.0, 0, 0.0
    for i, r in enumerate(dapo):
        cum += float(r["rollout/generated_tokens"])
        if cum > budget:
            break
        cut, used = i + 1, cum
    if cut == 0:
        return None
    return {**summarize_run(dapo[:cut], target), "budget_tokens": budget, "tokens": used}


def goals(per_method: Mapping[str, dict]) -> Dict[str, Dict[str, bool]]:
    """The issue's goals for one seed, for each STARE variant present: GRPO collapses (final
    entropy below half the target), STARE holds (>= 80% of the steps after its gate in band),
    STARE's training accuracy >= GRPO's and DAPO's, its held-out pass@8 > theirs."""
    out: Dict[str, Dict[str, bool]] = {}
    g, d = per_method.get("grpo"), per_method.get("dapo")
    refs = [r for r in (g, d) if r is not None]
    for name in ("stare_o1", "stare_c2"):
        s = per_method.get(name)
        if s is None:
            continue
        out[name] = {
            "grpo_collapses": bool(g is not None and g["final_ratio"] < 0.5),
            "stare_holds": bool(s["in_band"] >= 0.8),
            "acc_at_least": all(s["train_acc"] >= r["train_acc"] for r in refs),
            "pass8_higher": all(s.get("passk", s["pass8"]) > r.get("passk", r["pass8"]) for r in refs),
        }
    return out


def _fmt(v: float, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else spec.format(v)


def table_md(summaries: Mapping[int, Mapping[str, dict]], starts: Mapping[int, dict],
             columns: Sequence[Tuple[str, str, str]] = COLUMNS) -> str:
    """Markdown: one row per seed and method, then the mean +- sd over seeds per method;
    ``columns``: (summary key, heading, format)."""
    head = "| seed | method | " + " | ".join(c[1] for c in columns) + " |"
    lines = [head, "|" + "---|" * (len(columns) + 2)]
    for seed, per in summaries.items():
        for name, r in per.items():
            lines.append(f"| {seed} | {sm.BY_NAME[name].label} | " +
                         " | ".join(_fmt(r[k], f) for k, _, f in columns) + " |")
    if len(summaries) > 1:
        names = [m.name for m in sm.METHODS if any(m.name in per for per in summaries.values())]
        for name in names:
            cells = []
            for k, _, f in columns:
                xs = [per[name][k] for per in summaries.values() if name in per and not math.isnan(per[name][k])]
                sd = statistics.stdev(xs) if len(xs) > 1 else math.nan
                cells.append(f"{_fmt(_mean(xs), f)} +- {_fmt(sd, f)}" if xs else "-")
            lines.append(f"| mean | {sm.BY_NAME[name].label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goals_md(summaries: Mapping[int, Mapping[str, dict]]) -> str:
    keys = ("grpo_collapses", "stare_holds", "acc_at_least", "pass8_higher")
    lines = ["| seed | STARE variant | GRPO < 0.5x target | STARE >= 80% in band | acc >= GRPO, DAPO "
             "| pass@k > GRPO, DAPO (k = 32 in v2, 8 in v1) |", "|---|---|---|---|---|---|"]
    per_seed = {seed: goals(per) for seed, per in summaries.items()}
    for seed, gs in per_seed.items():
        for name, g in gs.items():
            lines.append(f"| {seed} | {sm.BY_NAME[name].label} | " + " | ".join("yes" if g[k] else "no" for k in keys) + " |")
    if len(summaries) > 1:
        mean = {name: {k: _mean([per[name][k] for per in summaries.values() if name in per])
                       for k in ("final_ratio", "in_band", "train_acc", "pass8", "passk")}
                for name in {n for per in summaries.values() for n in per}}
        for name, g in goals(mean).items():
            lines.append(f"| mean | {sm.BY_NAME[name].label} | " + " | ".join("yes" if g[k] else "no" for k in keys) + " |")
    return "\n".join(lines)


def goals_values_md(summaries: Mapping[int, Mapping[str, dict]]) -> str:
    """Markdown: one row per goal, one column per seed, each cell the verdict with the numbers it
    rests on (``goals`` gives the booleans; here a tie on pass@k is named as one)."""
    seeds = list(summaries)
    # Every STARE the study runs: ours on GRPO (C2, O1) and the reference's recipe (study v3).
    variants = [(n, sm.BY_NAME[n].label) for n in ("stare_c2", "stare_o1", "stare_ref")
                if any(n in summaries[s] for s in seeds)]

    def verdict(ok: bool) -> str:
        return "**met**" if ok else "**missed**"

    def collapse(per: Mapping[str, dict]) -> str:
        g = per.get("grpo")
        return "-" if g is None else f"{verdict(g['final_ratio'] < 0.5)} ({_fmt(g['final_ratio'], '{:.2f}')}x)"

    def holds(per: Mapping[str, dict]) -> str:
        vs = [(lab, per[n]["in_band"]) for n, lab in variants if n in per]
        if not vs:
            return "-"
        ok = all(not math.isnan(v) and v >= 0.8 for _, v in vs)
        return verdict(ok) + " (" + ", ".join(f"{lab} {_fmt(v, '{:.2f}')}" for lab, v in vs) + ")"

    def higher(per: Mapping[str, dict]) -> str:
        refs = [(lab, per[n]["passk"]) for n, lab in (("grpo", "GRPO"), ("dapo", "DAPO")) if n in per]
        if not refs:
            return "-"
        best = max(v for _, v in refs)
        cells = []
        for n, lab in variants:
            if n in per:
                p = per[n]["passk"]
                word = "met" if p > best else ("tie" if p == best else "missed")
                cells.append(f"{lab} {p:.3f}: {word}")
        return "; ".join(cells) + " (" + ", ".join(f"{lab} {v:.3f}" for lab, v in refs) + ")"

    lines = ["| goal | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---|" + "---|" * len(seeds)]
    for text, fn in (("GRPO's final entropy below half the target", collapse),
                     ("STARE in the band on >= 80% of the steps after its gate", holds),
                     ("STARE's pass@k above GRPO's and DAPO's", higher)):
        lines.append(f"| {text} | " + " | ".join(fn(summaries[s]) for s in seeds) + " |")
    return "\n".join(lines)


MEDIAN_COLUMNS = ("final_ratio", "in_band", "pass1", "pass8", "pass32", "length")


def medians_md(summaries: Mapping[int, Mapping[str, dict]], median_columns: Sequence[str] = MEDIAN_COLUMNS) -> str:
    """Markdown: per method, the median over seeds of each column (a run that blew up does not
    stand for its method as it does in a mean). ``in band`` is the median over the seeds where
    entropy fell below the target; how many those were is said when not all. The last column lists
    pass@k (the goal's k) seed by seed, in the order of ``summaries``."""
    cols = [c for c in (*COLUMNS, *EXTRA_COLUMNS) if c[0] in median_columns]
    lines = ["| method | seeds | " + " | ".join(c[1] for c in cols) + " | pass@k by seed |",
             "|" + "---|" * (len(cols) + 3)]
    for m in sm.METHODS:
        rs = [per[m.name] for per in summaries.values() if m.name in per]
        if not rs:
            continue
        cells = []
        for k, _, f in cols:
            xs = [r[k] for r in rs if not math.isnan(r[k])]
            cell = _fmt(statistics.median(xs), f) if xs else "-"
            if k == "in_band" and len(xs) < len(rs):
                cell += f" ({len(xs)} of {len(rs)} seeds)" if xs else " (never below target)"
            cells.append(cell)
        by_seed = " / ".join(_fmt(per[m.name]["passk"], "{:.3f}") if m.name in per else "-" for per in summaries.values())
        lines.append(f"| {m.label} | {len(rs)} | " + " | ".join(cells) + f" | {by_seed} |")
    return "\n".join(lines)


def diagnostics_md(summaries: Mapping[int, Mapping[str, dict]]) -> str:
    """Mean over seeds of the quadrant fractions, pred_dH, the theory-check correlations and W/M."""
    lines = ["| method | A>0, s>H (raises H) | A>0, s<=H (lowers) | A<0, s>H (lowers) | A<0, s<=H (raises) "
             "| mean pred_dH | corr step | corr window | final W | final M |", "|" + "---|" * 10]
    for m in sm.METHODS:
        rs = [per[m.name] for per in summaries.values() if m.name in per]
        if not rs:
            continue
        cells = [_fmt(_mean([r[q] for r in rs]), "{:.3f}") for q in QUADRANTS]
        cells += [_fmt(_mean([r["pred_dH_mean"] for r in rs]), "{:.4f}"),
                  _fmt(_mean([r["corr_step"] for r in rs]), "{:.2f}"), _fmt(_mean([r["corr_window"] for r in rs]), "{:.2f}")]
        stare = m.name.startswith("stare")
        cells += [_fmt(_mean([r["final_w"] for r in rs]), "{:.2f}") if stare else "-",
                  _fmt(_mean([r["final_m"] for r in rs]), "{:.2f}") if stare and m.name.endswith("c2") else "-"]
        lines.append(f"| {m.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load_runs(runs: Mapping[Tuple[int, str], str]) -> Dict[Tuple[int, str], List[dict]]:
    return {k: read_metrics(str(Path(d) / "metrics.jsonl")) for k, d in runs.items()}


def _validity_md(start: dict) -> str:
    """The warm start's task validity (``study_validate``), if measured."""
    v = start.get("validity")
    if not v:
        return ""
    top = str(v["samples"])
    return (f"; validity: pass@{top} {v['pass_at'][top]:.3f}, A>0 & s>H {v['frac_pos_high']:.3f} of all tokens "
            f"({v['frac_pos_high_of_nonzero']:.3f} of A!=0), mean length {v['mean_length']:.1f} ("
            + ", ".join(f"{name}: {'holds' if ok else 'fails'}" for name, ok in v["checks"].items()) + ")")


def write_report(s, starts: Mapping[int, dict], rows: Mapping[Tuple[int, str], List[dict]],
                 done: Mapping[Tuple[int, str], dict], figs: Sequence[str], wall_seconds: float) -> dict:
    """``study.md`` and ``study.json`` under ``s.out``; prints the report. ``rows``: (seed, method)
    -> metrics rows of its run; ``done``: (seed, method) -> its ``seconds`` and ``stopped``; ``figs``:
    the figures' paths."""
    summaries: Dict[int, Dict[str, dict]] = {}
    for (seed, name), rs in rows.items():
        summaries.setdefault(seed, {})[name] = summarize_run(rs, s.target_ratio * starts[seed]["H0"])
    out = Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    run_seconds = {f"{seed}/{name}": v.get("seconds") for (seed, name), v in done.items()}
    stopped = "".join(f"- seed {seed} {sm.BY_NAME[name].label} stopped early ({v['stopped']}): its numbers are "
                      f"those of the steps it ran.\n" for (seed, name), v in done.items() if v.get("stopped"))
    starts_md = "\n".join(f"- seed {k}: H0 {v['H0']:.3f}, target {s.target_ratio * v['H0']:.3f} ({s.target_ratio} x H0), "
                          f"warm-start accuracy {v['accuracy']:.2f} (pass@8 {v['pass@8']:.2f}), held-out pass@1 "
                          f"{v['eval_pass@1']:.2f} pass@8 {v['eval_pass@8']:.2f}" + _validity_md(v) for k, v in starts.items())
    eq = []
    for seed in summaries:
        e = equal_tokens(rows.get((seed, "dapo"), []), rows.get((seed, "grpo"), []),
                         s.target_ratio * starts[seed]["H0"])
        if e is not None:
            eq.append(f"| {seed} | {e['steps']} | {e['budget_tokens']:.0f} | {_fmt(e['final_ratio'], '{:.2f}')} | "
                      f"{e['train_acc']:.3f} | {_fmt(e['pass1'], '{:.3f}')} | {_fmt(e['passk'], '{:.3f}')} |")
    eq_md = ("## DAPO at equal generated tokens (GRPO's total)\n\n| seed | DAPO steps | tokens | H final / target "
             "| train acc | pass@1 | pass@k |\n|---|---|---|---|---|---|---|\n" + "\n".join(eq) + "\n\n") if eq else ""
    md = (f"# Entropy study ({len(starts)} seed(s), {s.steps if not s.quick else 3} steps per run)\n\n"
          f"Warm starts:\n{starts_md}\n\n## Table\n\n{table_md(summaries, starts)}\n\n{stopped}\n## Goals\n\n"
          f"{goals_md(summaries)}\n\nWith the numbers they rest on:\n\n{goals_values_md(summaries)}\n\n"
          f"{eq_md}## Medians over seeds\n\n{medians_md(summaries)}\n\n## Dynamics diagnostics (mean over seeds)\n\n{diagnostics_md(summaries)}\n\n"
          f"Wall time: {wall_seconds / 60:.1f} min for this invocation (runs already done are not re-run).\n")
    (out / "study.md").write_text(md)
    report = {"starts": {str(k): v for k, v in starts.items()},
              "summaries": {str(k): v for k, v in summaries.items()},
              "goals": {str(k): goals(v) for k, v in summaries.items()}, "figures": list(figs),
              "run_seconds": run_seconds, "stopped": {f"{k[0]}/{k[1]}": v.get("stopped") for k, v in done.items()},
              "wall_seconds": round(wall_seconds, 1)}
    (out / "study.json").write_text(json.dumps(report, indent=2, default=str))
    print(md, flush=True)
    return report


def write_tuning(s, start: dict, runs: Mapping, stage: str) -> dict:
    """``tuning_<stage>.md``: every grid point's numbers and its selection score; the winners marked.
    ``runs``: ``RunSpec`` -> run directory (seed 0)."""
    by_method: Dict[str, List[Tuple[str, tuple, dict]]] = {}
    for spec, d in runs.items():
        r = summarize_run(read_metrics(str(Path(d) / "metrics.jsonl")), s.target_ratio * start["H0"])
        r["score"] = (r["pass1"] + r["pass8"]) / 2
        r["diverged"] = r["train_acc"] < start["accuracy"]
        r["stopped"] = json.loads((Path(d) / "done.json").read_text()).get("stopped")
        group = "shared (GRPO)" if spec.label.startswith("shared") else spec.method
        by_method.setdefault(group, []).append((spec.label, spec.overrides, r, spec.method))
    lines = [f"# Tuning on seed 0 (H0 {start['H0']:.3f}, target {s.target_ratio * start['H0']:.3f}, warm-start accuracy "
             f"{start['accuracy']:.2f})\n", "Selection score: mean of held-out pass@1 and pass@8 over the last "
             "quarter's evaluations; a run whose final training accuracy is below the warm start's counts as "
             "diverged and is not eligible.\n"]
    for group, items in by_method.items():
        ok = [it for it in items if not it[2]["diverged"]] or items
        best = max(ok, key=lambda it: it[2]["score"])[0]
        lines += [f"\n## {group}\n", "| point | knobs | H final / target | in band | train acc | pass@1 | pass@8 | score |",
                  "|---|---|---|---|---|---|---|---|"]
        for label, ov, r, method in items:
            skip = set(sm.BY_NAME[method].base) | (set() if label.startswith("shared") else set(sm.SHARED))
            knobs = " ".join(_short(o) for o in ov if o not in skip)
            mark = " **chosen**" if label == best else (" (diverged)" if r["diverged"] else "")
            mark += f" (stopped: {r['stopped']})" if r["stopped"] else ""
            lines.append(f"| {label}{mark} | {knobs} | {_fmt(r['final_ratio'], '{:.2f}')} | {_fmt(r['in_band'], '{:.2f}')} "
                         f"| {r['train_acc']:.3f} | {r['pass1']:.3f} | {r['pass8']:.3f} | {r['score']:.3f} |")
    md = "\n".join(lines) + "\n"
    Path(s.out).mkdir(parents=True, exist_ok=True)
    (Path(s.out) / f"tuning_{stage}.md").write_text(md)
    print(md, flush=True)
    return {"groups": {g: [(lab, list(ov), r) for lab, ov, r, _ in it] for g, it in by_method.items()}}


def _short(override: str) -> str:
    """``algorithm.stare.w_max=10`` -> ``w_max=10``."""
    key, _, value = override.partition("=")
    return f"{key.rsplit('.', 1)[-1]}={value}"
