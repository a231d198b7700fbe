"""Observability: per-step metrics to JSONL / TensorBoard / W&B, sample generations, phase
timers, plots. What the console shows of them (the step line, its ETA) is ``console.py``'s.

Only rank 0 writes (pass the global rank); other ranks construct the logger and call it freely.
Metrics are already global (reduced with ``algorithms.aggregation.MetricSums``) when they get here.

JSONL (``<logging.dir>/metrics.jsonl``, always): one object per step, ``{"step": s, **metrics}``,
flushed at every step. Values are JSON numbers (bools stay bools, strings pass through); JSON has
no NaN/Infinity, so non-finite floats are written as the strings ``"nan"``, ``"inf"``, ``"-inf"``
(``float()`` reads them back; ``read_metrics`` does). A fresh run (``start_step=0``) truncates
the file; a resumed one keeps the lines of steps before ``start_step`` and appends.

Samples (``<logging.dir>/samples.jsonl``, every ``logging.samples_every`` steps): one object
per generation, ``{"step", "prompt", "response", "reward"}``, and TensorBoard text under
``samples``; truncated on resume like the metrics.

Keys the console's step line (``console_lines.step_line``) and ``plot_runs`` read (the trainer
writes them): ``time/<phase>`` for the step's phases (``runtime/phases.py``: seconds, from ``Timer``),
``perf/tokens_per_s``, ``stare/entropy`` (global token-mean entropy H), ``stare/gate`` (1 on /
0 off), ``reward/mean``, ``reward/accuracy``, ``response/mean_length``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import time
from contextlib import contextmanager
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from megatron_stare.config.load import LoggingConfig
from megatron_stare.errors import UserError

log = logging.getLogger(__name__)

ENTROPY, GATE, ACCURACY, RESPONSE_LENGTH, TOKENS_PER_S = (
    "stare/entropy", "stare/gate", "reward/accuracy", "response/mean_length", "perf/tokens_per_s")
_NON_FINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


class MetricsError(UserError):
    """A logging problem; one line."""

    def __init__(self, msg: str) -> None:
        super().__init__(f"logging: {msg}")


def _json_value(name: str, v: Any) -> Union[bool, int, float, str]:
    if isinstance(v, (bool, str)):
        return v
    if hasattr(v, "item") and callable(v.item):  # 0-dim torch tensors, numpy scalars
        v = v.item()
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise MetricsError(f"metric {name!r} must be a number, got {type(v).__name__}") from None
    return f if math.isfinite(f) else ("nan" if f != f else ("inf" if f > 0 else "-inf"))


def read_metrics(path: str) -> List[Dict[str, Any]]:
    """The JSONL file's rows, with ``"nan"``/``"inf"``/``"-inf"`` turned back into floats."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rows.append({k: _NON_FINITE.get(v, v) if isinstance(v, str) else v
                             for k, v in json.loads(line).items()})
    return rows


def format_duration(seconds: float) -> str:
    """``42s``, ``4m12s``, ``3h05m``."""
    s = max(int(round(seconds)), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Timer:
    """Wall time per named phase: ``with timer("rollout"): ...``; repeated phases add up.

    ``cuda_sync`` synchronizes the device at both ends of a phase, so asynchronous kernels are
    charged to the phase that launched them (costs a sync; for honest GPU phase times).
    """

    def __init__(self, cuda_sync: bool = False):
        self.cuda_sync = cuda_sync
        self.times: Dict[str, float] = {}

    def _sync(self) -> None:
        if self.cuda_sync:
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.times[phase] = self.times.get(phase, 0.0) + time.perf_counter() - t0

    def metrics(self, reset: bool = True) -> Dict[str, float]:
        """``{"time/<phase>": seconds}``; clears the timer unless ``reset=False``."""
        out = {f"time/{k}": v for k, v in self.times.items()}
        if reset:
            self.times = {}
        return out


class MetricsLogger:
    """Rank 0 writes JSONL (always), TensorBoard (``cfg.tensorboard``, if importable) and W&B
    (``cfg.wandb_project``); it prints nothing (the console's step line: ``console.py``).

    A W&B project without ``wandb`` installed is a ``MetricsError`` on every rank (so no rank
    waits for one that failed); a missing TensorBoard only logs a warning.
    """

    def __init__(self, cfg: LoggingConfig, rank: int, total_steps: Optional[int] = None,
                 run_config: Optional[Dict[str, Any]] = None, start_step: int = 0):
        if cfg.wandb_project and importlib.util.find_spec("wandb") is None:
            raise MetricsError(f"logging.wandb_project={cfg.wandb_project!r} needs wandb: pip install wandb "
                               f"(or set logging.wandb_project=null)")
        self.cfg, self.rank, self.total_steps = cfg, rank, total_steps
        self.path = os.path.join(cfg.dir, "metrics.jsonl")
        self.samples_path = os.path.join(cfg.dir, "samples.jsonl")
        self._file = self._tb = self._wandb = self._samples = None
        self._start_step = start_step
        if rank != 0:
            return
        os.makedirs(cfg.dir, exist_ok=True)
        self._file = self._open_jsonl(start_step)
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=cfg.dir)
            except ImportError as e:
                log.warning("logging: TensorBoard disabled, cannot import it (%s)", e)
        if cfg.wandb_project:
            import wandb

            self._wandb = wandb.init(project=cfg.wandb_project, dir=cfg.dir, config=run_config)

    def _open_jsonl(self, start_step: int, path: Optional[str] = None):
        path = path or self.path
        kept: List[str] = []
        if start_step > 0 and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                for ln in f:
                    try:
                        step = json.loads(ln).get("step", -1)
                    except json.JSONDecodeError:  # a line torn by the crash we resume from
                        continue
                    # Steps at or past start_step were logged after the checkpoint we resume from.
                    if step < start_step:
                        kept.append(ln if ln.endswith("\n") else ln + "\n")
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp, path)
        return open(path, "a", encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record ``metrics`` (name -> number) of ``step``; no-op off rank 0."""
        if self.rank != 0:
            return
        row = {"step": int(step)}
        row.update({k: _json_value(k, v) for k, v in metrics.items()})
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()
        numeric = {}  # what TensorBoard / W&B take: numbers only, non-finite as floats
        for k, v in row.items():
            if k != "step" and (not isinstance(v, str) or v in _NON_FINITE):
                numeric[k] = float(_NON_FINITE[v] if isinstance(v, str) else v)
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        """Record a few generations of ``step`` (each ``{"prompt", "response", "reward"}``) to
        ``samples.jsonl`` and TensorBoard text; no-op off rank 0."""
        if self.rank != 0:
            return
        if self._samples is None:  # opened at the first samples: a run without them has no file
            self._samples = self._open_jsonl(self._start_step, self.samples_path)
        for s in samples:
            row = {"step": int(step), **{k: _json_value(k, v) for k, v in s.items()}}
            self._samples.write(json.dumps(row, allow_nan=False, ensure_ascii=False) + "\n")  # read by people
        self._samples.flush()
        if self._tb is not None and samples:
            text = "\n\n".join(f"reward {float(s['reward']):.3f}\n\n```\n{s['prompt']}\n--> {s['response']}\n```"
                               for s in samples)
            self._tb.add_text("samples", text, step)

    def close(self) -> None:
        """Close every sink once (idempotent): the two JSONL files, TensorBoard, wandb."""
        for name, end in (("_file", "close"), ("_samples", "close"), ("_tb", "close"), ("_wandb", "finish")):
            sink = getattr(self, name)
            if sink is not None:
                getattr(sink, end)()
                setattr(self, name, None)

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ------------------------------------------------------------------------------------------------
def held_out_k(rows: Iterable[dict]) -> Optional[int]:
    """The samples per problem of a run's held-out evaluations (its ``eval/avg@k``; the largest
    if several), or None when the run never evaluated."""
    ks = {int(k.rsplit("@", 1)[1]) for r in rows for k in r if k.startswith("eval/avg@")}
    return max(ks) if ks else None


def _held_out(rows: Sequence[dict]) -> Optional[Tuple[str, List[Tuple[int, float]]]]:
    """``("avg@k", [(step, value)])`` of a run's held-out evaluations, or None."""
    k = held_out_k(rows)
    if k is None:
        return None
    key = f"eval/avg@{k}"
    return key[len("eval/"):], [(r["step"], float(r[key])) for r in rows if key in r]


def plot_runs(jsonl_paths: Mapping[str, str], out_png: str,
              target_entropy: Union[None, float, Sequence[float]] = None) -> str:
    """Write a 2x2 PNG over steps - entropy, accuracy, mean response length, gate - one line per run;
    the accuracy panel also marks each run's held-out ``eval/avg@k`` where it evaluated.

    ``jsonl_paths``: run label -> metrics.jsonl. ``target_entropy``: a float draws the target
    as a dashed line on the entropy panel, a ``(low, high)`` pair a shaded band. A run without a
    metric is left out of that panel. Uses the Agg canvas directly (no global backend switch).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels: Tuple[Tuple[str, str], ...] = ((ENTROPY, "entropy H"), (ACCURACY, "accuracy (rollout reward; held-out: dots)"),
                                           (RESPONSE_LENGTH, "mean response length"), (GATE, "STARE gate (1 = on)"))
    fig = Figure(figsize=(11, 7), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2).ravel()
    runs = {label: read_metrics(path) for label, path in jsonl_paths.items()}
    for ax, (key, title) in zip(axes, panels):
        for label, rows in runs.items():
            pts = [(r["step"], float(r[key])) for r in rows if key in r]
            if pts:
                line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label,
                                drawstyle="steps-post" if key == GATE else "default")
                held = _held_out(rows) if key == ACCURACY else None
                if held:
                    name, hpts = held
                    ax.plot([p[0] for p in hpts], [p[1] for p in hpts], "o--", color=line.get_color(),
                            label=f"{label} held-out {name}")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if target_entropy is not None:
        if isinstance(target_entropy, (int, float)):
            axes[0].axhline(float(target_entropy), color="k", ls="--", lw=1, label="target")
        else:
            lo, hi = target_entropy
            axes[0].axhspan(float(lo), float(hi), color="tab:green", alpha=0.15, label="target band")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png)
    return out_png
