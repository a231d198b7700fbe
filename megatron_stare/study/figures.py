"""The entropy study's figures: one PNG per metric, every method on it, plus the theory check.

Curves are the median over seeds (per step; the entropy as a multiple of each seed's target so
seeds with different targets compare), smoothed with a ``SMOOTH``-step moving average, with the
seeds' range shaded: one run that blew up does not drag its method's curve, as a mean would. The
entropy figure's y axis stops at ``ENTROPY_YMAX`` x the target (a run that explodes to 40x would
flatten every other curve); the title says when a curve leaves it. Uses the Agg canvas directly
(no global backend switch).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Dict, List, Mapping, Sequence, Tuple

from megatron_stare.study import methods as sm
from megatron_stare.study.report import WINDOW, pearson, theory_pairs
from megatron_stare.trainer.metrics import ACCURACY, ENTROPY, GATE, RESPONSE_LENGTH

SMOOTH = 10
ENTROPY_YMAX = 4.0
#: file stem -> (metric key, title, per-step? (else: evaluation points), divide by the target?)
FIGURES: Dict[str, Tuple[str, str, bool, bool]] = {
    "entropy": (ENTROPY, "entropy / target (band 0.7-1.3x shaded)", True, True),
    "accuracy": (ACCURACY, "training accuracy (rollouts, temperature 1)", True, False),
    "pass1": ("eval/avg@8", "held-out pass@1 (mean of 8 samples)", False, False),
    "pass8": ("eval/pass@8", "held-out pass@8", False, False),
    "length": (RESPONSE_LENGTH, "mean response length (tokens)", True, False),
    # Study v2 (32 samples per held-out prompt) and the quadrant fractions over training:
    "pass1_32": ("eval/avg@32", "held-out pass@1 (mean of 32 samples)", False, False),
    "pass32": ("eval/pass@32", "held-out pass@32", False, False),
    # Study v3 (4 samples per held-out prompt) and STARE's gate (0 for the other methods):
    "pass1_4": ("eval/avg@4", "held-out pass@1 (mean of 4 samples)", False, False),
    "pass4": ("eval/pass@4", "held-out pass@4", False, False),
    "gate": (GATE, "STARE's gate (share of steps on, smoothed)", True, False),
    "pos_high": ("dynamics/frac_pos_high", "share of A!=0 tokens with A>0 and surprisal > H (raises H)", True, False),
    "neg_high": ("dynamics/frac_neg_high", "share of A!=0 tokens with A<0 and surprisal > H (lowers H)", True, False),
}


def _smooth(xs: Sequence[float], k: int) -> List[float]:
    out, acc = [], []
    for x in xs:
        acc.append(x)
        if len(acc) > k:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def _series(rows: Sequence[dict], key: str, scale: float) -> Tuple[List[int], List[float]]:
    pts = [(r["step"], float(r[key]) / scale) for r in rows if key in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def _figure(title: str):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=80)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    return fig, ax


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:  # none when no run logs the metric's inputs
        ax.legend(fontsize=7, ncol=2)


def _save(fig, ax, path: Path) -> str:
    """The legend, the layout, the PNG at ``path``; returns the path."""
    _legend(ax)
    fig.tight_layout()
    fig.savefig(path)
    return str(path)


def plot_study(rows: Mapping[Tuple[int, str], List[dict]], targets: Mapping[int, float], out: Path,
               smooth: int = SMOOTH) -> List[str]:
    """``fig_<metric>.png`` under ``out`` for each of ``FIGURES`` the runs log and ``fig_theory.png``;
    returns the paths. Per-step curves are smoothed over ``smooth`` steps."""
    paths = []
    methods = [m for m in sm.METHODS if any(name == m.name for _, name in rows)]
    for stem, (key, title, per_step, by_target) in FIGURES.items():
        if not any(key in r for rs in rows.values() for r in rs):
            continue  # a metric these runs do not log (v1 has no pass@32)
        fig, ax = _figure(title)
        top = -math.inf
        for i, m in enumerate(methods):
            runs = [(seed, rs) for (seed, name), rs in rows.items() if name == m.name]
            curves = [_series(rs, key, targets[seed] if by_target else 1.0) for seed, rs in runs]
            curves = [c for c in curves if c[0]]
            if not curves:
                continue
            n = min(len(c[0]) for c in curves)
            steps = curves[0][0][:n]
            ys = [c[1][:n] for c in curves]
            if per_step:
                ys = [_smooth(y, smooth) for y in ys]
            mid = [statistics.median(col) for col in zip(*ys)]
            top = max(top, max(max(y) for y in ys))
            style = "-" if m.name.startswith("stare") else "--"
            color = f"C{i}"
            ax.plot(steps, mid, style, color=color, lw=2 if m.name.startswith("stare") else 1.2, label=m.label,
                    marker=None if per_step else "o", ms=3)
            if len(ys) > 1:
                ax.fill_between(steps, [min(c) for c in zip(*ys)], [max(c) for c in zip(*ys)], color=color, alpha=0.08)
        if stem == "entropy":
            ax.axhspan(0.7, 1.3, color="tab:green", alpha=0.12)
            ax.axhline(1.0, color="k", lw=0.8, ls=":")
            ax.axhline(0.5, color="tab:red", lw=0.8, ls=":")
            if top > ENTROPY_YMAX:
                ax.set_ylim(0, ENTROPY_YMAX)
                ax.set_title(f"{title}; runs reaching {top:.0f}x cut at {ENTROPY_YMAX:.0f}x", fontsize=10)
        ax.set_xlabel("step")
        paths.append(_save(fig, ax, out / f"fig_{stem}.png"))
    paths.append(_plot_theory(rows, methods, out))
    if any("eval/pass@32" in r for rs in rows.values() for r in rs):
        paths.append(_plot_pass_at_k(rows, methods, out))
        paths.append(_plot_by_tokens(rows, methods, out))
    return paths


def _plot_pass_at_k(rows, methods, out: Path) -> str:
    """pass@k against k (1..32, log scale) at each run's last evaluation, median over seeds."""
    fig, ax = _figure("held-out pass@k at the last evaluation (median over seeds)")
    for i, m in enumerate(methods):
        curves = []
        for (seed, name), rs in rows.items():
            last = next((r for r in reversed(rs) if "eval/pass@32" in r), None)
            if name == m.name and last is not None:
                ks = sorted(int(k.split("@")[1]) for k in last if k.startswith("eval/pass@"))
                curves.append({k: float(last["eval/avg@32"] if k == 1 else last[f"eval/pass@{k}"])
                               for k in [1, *ks]})
        if curves:
            ks = sorted(set.intersection(*(set(c) for c in curves)))
            ax.plot(ks, [statistics.median(c[k] for c in curves) for k in ks], "-o" if m.name.startswith("stare")
                    else "--o", color=f"C{i}", ms=3, lw=2 if m.name.startswith("stare") else 1.2, label=m.label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k")
    return _save(fig, ax, out / "fig_pass_at_k.png")


def _plot_by_tokens(rows, methods, out: Path) -> str:
    """Training accuracy against the cumulative generated tokens (DAPO at equal rollout work)."""
    fig, ax = _figure("training accuracy vs generated tokens (one line per seed, smoothed)")
    for i, m in enumerate(methods):
        label = m.label  # once per method: one line per seed
        for (seed, name), rs in sorted(rows.items()):
            if name != m.name or not rs or "rollout/generated_tokens" not in rs[0]:
                continue
            cum, xs = 0.0, []
            for r in rs:
                cum += float(r["rollout/generated_tokens"])
                xs.append(cum)
            ax.plot(xs, _smooth([float(r[ACCURACY]) for r in rs], SMOOTH), color=f"C{i}", lw=1, alpha=0.8, label=label)
            label = None
    ax.set_xlabel("generated tokens (cumulative, every rollout batch)")
    return _save(fig, ax, out / "fig_accuracy_by_tokens.png")


def _plot_theory(rows, methods, out: Path) -> str:
    fig, ax = _figure(f"theory check: predicted vs measured entropy change ({WINDOW}-step windows)")
    for i, m in enumerate(methods):
        xs, ys = [], []
        for (seed, name), rs in rows.items():
            if name == m.name:
                x, y = theory_pairs(rs, WINDOW)
                xs += x
                ys += y
        if xs:
            r = pearson(xs, ys)
            ax.scatter(xs, ys, s=8, color=f"C{i}", alpha=0.6,
                       label=f"{m.label} (r = {'-' if math.isnan(r) else f'{r:.2f}'})")
    ax.axhline(0, color="k", lw=0.6)
    ax.axvline(0, color="k", lw=0.6)
    ax.set_xlabel(f"sum of logged pred_dH over {WINDOW} steps (per unit step size)")
    ax.set_ylabel("measured entropy change")
    return _save(fig, ax, out / "fig_theory.png")
