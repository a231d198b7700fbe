"""The formats of what a person reads (``console.py`` prints them): the step line, the eval
line, a collapsed warning's line, the start-up summary, and the sample records of
``logging.samples_every``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from megatron_stare.trainer.metrics import format_duration
from megatron_stare.models.sizes import param_counts
from megatron_stare.runtime.notices import PREFIX

WIDTH = 160
"""A third-party warning is cut to this many characters on the console (whole in the log file)."""
MAIN_PHASES = ("generate", "score", "train", "sync")
"""Step phases (``runtime/phases.py`` names) always shown; the others only when they took time."""
_MINOR = (("gather", "gather"), ("wait_generate", "wait"), ("eval", "eval"))
_WAKE = ("release", "resume_w", "resume_kv")  # the engine's sleep and wake: shown as one time
_SHOWN_FROM_S = 0.05
_PKG_DIR = Path(__file__).resolve().parents[1]  # megatron_stare/


def seconds(t: float) -> str:
    """``3ms``, ``0.4s``, ``28.1s``, ``4m12s``: short, and never ``0.0s`` for a phase that ran."""
    if t < 0.1:
        return f"{max(t, 0.0) * 1000:.0f}ms"
    return f"{t:.1f}s" if t < 60 else format_duration(t)


def _f(metrics: Mapping[str, Any], key: str) -> Optional[float]:
    v = metrics.get(key)
    try:
        return None if v is None else float(v)
    except (TypeError, ValueError):
        return None


def step_line(step: int, total_steps: Optional[int], metrics: Mapping[str, Any], eta_s: Optional[float] = None,
              target_entropy: Optional[float] = None) -> str:
    """``step 12/100, eta 4m12s | generate 28.1s score 0.2s train 3.1s sync 0.4s | reward 0.41
    acc 0.50 len 57.3 flat 25% | H 0.41/0.30 gate off | 812 tok/s``; fields whose metric is absent
    (or ``eta_s`` None) are left out, ``acc`` when it equals the reward mean (binary rewards),
    ``flat`` (the share of prompt groups whose rewards were all equal: zero advantage) when any was, minor
    phases (gather, the pipeline's wait, eval, the engine's sleep/wake) under 50 ms."""
    parts = [f"step {step}/{total_steps}" if total_steps else f"step {step}"]
    if eta_s is not None:
        parts[0] += f", eta {format_duration(eta_s)}"
    times = [(p, t) for p in MAIN_PHASES if (t := _f(metrics, f"time/{p}")) is not None]
    times += [(label, t) for p, label in _MINOR if (t := _f(metrics, f"time/{p}")) is not None and t >= _SHOWN_FROM_S]
    wake = sum(t for p in _WAKE if (t := _f(metrics, f"time/{p}")) is not None)
    if wake >= _SHOWN_FROM_S:
        times.append(("wake", wake))
    if times:
        parts.append(" ".join(f"{label} {seconds(t)}" for label, t in times))
    reward = []
    mean, acc, length = (_f(metrics, k) for k in ("reward/mean", "reward/accuracy", "response/mean_length"))
    if mean is not None:
        reward.append(f"reward {mean:.2f}")
    if acc is not None and (mean is None or abs(acc - mean) > 1e-9):
        reward.append(f"acc {acc:.2f}")
    if length is not None:
        reward.append(f"len {length:.1f}")
    if (flat := _f(metrics, "rollout/flat_groups")) is not None and flat > 0:
        reward.append(f"flat {flat:.0%}")  # groups whose rewards are all equal: no signal
    if reward:
        parts.append(" ".join(reward))
    stare = []
    if (h := _f(metrics, "stare/entropy")) is not None:
        stare.append(f"H {h:.2f}" + (f"/{target_entropy:.2f}" if target_entropy is not None else ""))
    if (gate := _f(metrics, "stare/gate")) is not None:
        stare.append(f"gate {'on' if gate > 0 else 'off'}")
    if stare:
        parts.append(" ".join(stare))
    if (tps := _f(metrics, "perf/tokens_per_s")) is not None:
        parts.append(f"{tps:.0f} tok/s")
    return " | ".join(parts)


def eval_line(step: int, metrics: Mapping[str, Any]) -> Optional[str]:
    """``[megatron-stare] eval after step 2: avg@4 0.250 pass@4 0.500 len 7.5`` from the
    ``eval/`` metrics, or None when the step did not evaluate."""
    vals = []
    for k in metrics:
        if k.startswith("eval/") and (v := _f(metrics, k)) is not None:
            name = k[len("eval/"):]
            vals.append(f"len {v:.1f}" if name == "response_len_mean" else f"{name} {v:.3f}")
    return f"{PREFIX} eval after step {step}: {' '.join(vals)}" if vals else None


def source_of(filename: str) -> str:
    """The package a warning was raised in: its top-level name (``megatron``, ``torch``, ...)."""
    p = Path(filename)
    try:
        p.resolve().relative_to(_PKG_DIR)
        return "megatron_stare"
    except (OSError, ValueError):
        pass
    parts = p.parts
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts and parts.index(anchor) + 1 < len(parts):
            return parts[parts.index(anchor) + 1].removesuffix(".py")
    return p.stem


def warning_line(source: str, text: str, category: Optional[str] = None, error: bool = False) -> str:
    """The console's line for a warning (or error) record: ``[warning] megatron UserWarning: Apex
    is not installed. ...``; a third-party text is cut to its first line and ``WIDTH`` characters."""
    lines = [ln.strip() for ln in str(text).strip().splitlines()]
    first = next((ln for ln in lines if ln), "")
    if not source.startswith("megatron_stare") and len(first) > WIDTH:
        first = first[:WIDTH - 3].rstrip() + "..."
    tag = f"{source} {category}" if category else source
    return f"[{'error' if error else 'warning'}] {tag}: {first}"


# ------------------------------------------------------------------------------------ summary
@dataclass(frozen=True)
class RunSummary:
    """What the start-up summary says about a run."""

    model: str
    """Architecture (``Qwen2ForCausalLM``) or model type."""
    model_path: str
    params: Optional[int]
    tp: int
    pp: int
    cp: int
    dp: int
    engine: str
    train_rows: int
    eval_rows: Optional[int]
    total_steps: int
    start_step: int
    prompts_per_step: int
    responses_per_prompt: int
    log_dir: str
    checkpoint_dir: Optional[str]
    save_every: int

    def lines(self) -> List[str]:
        params = f", {_count(self.params)} parameters" if self.params else ""
        world = self.tp * self.pp * self.cp * self.dp
        data = f"{self.train_rows} train rows" + (f", {self.eval_rows} eval rows" if self.eval_rows else "")
        steps = (f"steps {self.start_step + 1}-{self.total_steps}" if self.start_step else f"{self.total_steps} steps")
        ckpt = ("checkpoints: none (checkpoint.dir unset)" if not self.checkpoint_dir else
                f"checkpoints {self.checkpoint_dir} (" + (f"every {self.save_every} steps and the last)"
                                                          if self.save_every else "the last step)"))
        return [f"{PREFIX} model {self.model}{params} ({self.model_path})",
                f"{PREFIX} layout TP{self.tp}xPP{self.pp}xCP{self.cp}xDP{self.dp} on {world} rank"
                f"{'s' if world != 1 else ''} | engine {self.engine} | data {data}",
                f"{PREFIX} {steps} of {self.prompts_per_step} prompts x {self.responses_per_prompt} responses | "
                f"logs {self.log_dir} (console.log, metrics.jsonl) | {ckpt}"]

    @classmethod
    def of(cls, cfg, layout, train_rows: int, eval_rows: Optional[int], start_step: int) -> "RunSummary":
        """The summary of a run of ``cfg`` (a ``Config``, its HF model at ``model.path``) on
        ``layout`` (a ``ParallelLayout``), starting after ``start_step`` steps."""
        hf = json.loads((Path(cfg.model.path) / "config.json").read_text())
        try:
            params: Optional[int] = param_counts(hf).total
        except (ValueError, KeyError):  # an architecture the size model does not know
            params = None
        arch = (hf.get("architectures") or [hf.get("model_type", "?")])[0]
        c = cfg.checkpoint
        return cls(model=arch, model_path=str(cfg.model.path), params=params, tp=layout.tp, pp=layout.pp,
                   cp=layout.cp, dp=layout.dp, engine=cfg.rollout.engine, train_rows=train_rows, eval_rows=eval_rows,
                   total_steps=cfg.trainer.total_steps, start_step=start_step,
                   prompts_per_step=cfg.trainer.prompts_per_step, responses_per_prompt=cfg.rollout.n,
                   log_dir=str(Path(cfg.logging.dir).absolute()),
                   checkpoint_dir=str(Path(c.dir).absolute()) if c.dir else None, save_every=c.save_every)


def _count(n: int) -> str:
    """``812``, ``1.2K``, ``494.0M``, ``7.6B``."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


SAMPLES = 4
"""Generations per ``logging.samples_every`` record: the first response of the first groups."""


def sample_records(samples: Sequence, tokenizer, k: int = SAMPLES) -> List[Dict[str, Any]]:
    """``[{"prompt", "response", "reward"}]`` of the first response of each of the first ``k``
    prompt groups of ``samples`` (``types.Sample``), decoded with ``tokenizer``."""
    out, groups = [], set()
    for s in samples:
        if s.group_id in groups:
            continue
        groups.add(s.group_id)
        out.append({"prompt": tokenizer.decode(s.prompt_ids, skip_special_tokens=True),
                    "response": tokenizer.decode(s.response_ids, skip_special_tokens=True),
                    "reward": float(s.reward)})
        if len(out) == k:
            break
    return out
