"""Study v2's committed results: one JSON per finished (seed, method) run, written atomically.

The run directories (``<out>/seed<k>/runs/...``: logs, full metrics) are not committed; a
finished run's result is, so the study resumes across sessions and machines: the runner skips a
(seed, method) whose result file exists with the same ``key`` (a hash of everything that defines
the run: its overrides, steps, evaluation schedule, target), and the report is rebuilt from the
result files alone. A result file is written to ``<name>.json.tmp`` and renamed (atomic on one
file system), so a killed runner leaves either the whole file or none.

Layout: ``<results>/seed<k>/<method>.json`` (``RunResult``), ``<results>/seed<k>/start.json``
(the warm start's numbers and its validity measurement) and ``<results>/seed<k>/sft/`` (the warm
start itself: the tiny model's safetensors, config and tokenizer, ~1.5 MB). A warm start is not
bit-reproducible across machines (CPU kernels round differently), so a session that rebuilt it
would get another H0 and orphan every result recorded under the first; with the checkpoint kept,
every later session starts its runs from the same weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

#: The metrics a result keeps per step (the report's inputs); the rest stays in the run directory.
KEEP_PREFIXES = ("stare/entropy", "stare/gate", "stare/w", "stare/m", "reward/accuracy", "response/mean_length",
                 "response/truncated_frac", "rollout/gen_batches", "rollout/generated_tokens", "dynamics/", "eval/")


def result_key(parts: Sequence[str]) -> str:
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:12]


def _round(v):
    return float(f"{v:.6g}") if isinstance(v, float) else v


def compact_rows(rows: Sequence[dict]) -> List[dict]:
    """``rows`` with only ``KEEP_PREFIXES`` metrics (and ``step``), floats to 6 significant digits."""
    return [{k: _round(v) for k, v in r.items() if k == "step" or k.startswith(KEEP_PREFIXES)} for r in rows]


def write_json_atomic(path: Path, obj: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def result_path(results: Path, seed: int, method: str) -> Path:
    return Path(results) / f"seed{seed}" / f"{method}.json"


def finished(results: Path, seed: int, method: str, key: str) -> Optional[dict]:
    """The committed result of (seed, method) if its key matches, else None (to be run)."""
    p = result_path(results, seed, method)
    if not p.is_file():
        return None
    r = json.loads(p.read_text())
    return r if r.get("key") == key else None


def write_result(results: Path, *, seed: int, method: str, key: str, rows: Sequence[dict], seconds: float,
                 stopped: Optional[str], target: float, steps: int, overrides: Sequence[str],
                 samples: Sequence[dict] = ()) -> Path:
    """``samples``: a few of the run's generations (``samples.jsonl`` rows), kept for people to read."""
    return write_json_atomic(result_path(results, seed, method), {
        "seed": seed, "method": method, "key": key, "seconds": seconds, "stopped": stopped, "target": target,
        "steps": steps, "overrides": list(overrides), "rows": compact_rows(rows),
        **({"samples": list(samples)} if samples else {})})


def load_results(results: Path, seeds: Sequence[int], methods: Sequence[str]) -> Dict[Tuple[int, str], dict]:
    """Every committed (seed, method) result among ``seeds`` x ``methods`` (whatever its key)."""
    out = {}
    for seed in seeds:
        for m in methods:
            p = result_path(results, seed, m)
            if p.is_file():
                out[(seed, m)] = json.loads(p.read_text())
    return out


def recorded_seeds(results: Path) -> List[int]:
    """The seeds with a ``seed<k>/`` folder of records under ``results`` (sorted)."""
    root = Path(results)
    found = [p.name[4:] for p in root.glob("seed*") if p.is_dir()] if root.is_dir() else []
    return sorted(int(k) for k in found if k.isdigit())


def load_starts(results: Path, seeds: Sequence[int]) -> Mapping[int, dict]:
    return {seed: json.loads((Path(results) / f"seed{seed}" / "start.json").read_text()) for seed in seeds
            if (Path(results) / f"seed{seed}" / "start.json").is_file()}


def start_checkpoint(results: Path, seed: int) -> Path:
    """Where the warm start of ``seed`` is kept (``sft/``: a Hugging Face model directory)."""
    return Path(results) / f"seed{seed}" / "sft"


def keep_start_checkpoint(results: Path, seed: int, sft: Path) -> Path:
    """Copy the warm start's files (``sft``, flat) to ``start_checkpoint``: into a temporary
    directory renamed over the old one, so a killed copy leaves the old checkpoint or the new."""
    dst = start_checkpoint(results, seed)
    tmp = dst.with_name(".sft.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in sorted(Path(sft).iterdir()):
        if f.is_file():
            shutil.copyfile(f, tmp / f.name)
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)
    return dst


def ran_dry(rd: Path, log_name: str = "train.log") -> Optional[str]:
    """Why a run ended early as a *result* rather than a failure, or None: DAPO's dynamic sampling
    finds no prompt group with mixed rewards in ``trainer.max_gen_batches`` draws once the policy
    has collapsed (every group all right or all wrong), and the trainer stops there (as verl's DAPO
    does; ``generation.RanDry``). The steps until then are the run's result; the report marks the
    run as stopped. Reads the trainer's one line (``error: step N: ...``) in ``rd/log_name``, or
    the traceback's last line that runs from before it was one line (``RuntimeError: ...``)."""
    marker = "no informative prompt groups after"
    log_text = (rd / log_name).read_text(errors="replace") if (rd / log_name).is_file() else ""
    for ln in log_text.splitlines():
        if marker in ln:
            for prefix in ("RuntimeError: ", "RanDry: ", "error: "):
                if prefix in ln and (rd / "metrics.jsonl").is_file():
                    return ln.split(prefix, 1)[1].strip()
    return None
