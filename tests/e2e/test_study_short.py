"""The entropy study, shortened (``--quick``): a small warm start on pick_sum, then every method
for 3 steps through the real trainer (a world of one rank, two runs side by side), the table with
every method, the goals, the figures; a second invocation runs nothing (the study resumes)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_stare.study import methods as sm
from megatron_stare.study.v2 import V1_METHODS
from megatron_stare.trainer.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow]


def _study(out: Path) -> subprocess.CompletedProcess:
    # Target 1.5 x H0: the entropy is below it from step 1, so STARE's gate fires in 3 steps.
    return subprocess.run([sys.executable, "-m", "megatron_stare.study.v2", "--quick", "--out", str(out),
                           "--seeds", "0", "--target-ratio", "1.5"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_study_quick_every_method_and_resume(tmp_path):
    out = tmp_path / "study"
    proc = _study(out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    start = json.loads((out / "seed0" / "start.json").read_text())
    assert start["H0"] > 0 and start["accuracy"] > 0  # the warm start earns rewards: advantages vary
    report = json.loads((out / "study.json").read_text())
    assert set(report["summaries"]["0"]) == set(V1_METHODS)  # v1's methods (v2 adds GSPO, CISPO, forking)
    md = (out / "study.md").read_text()
    for m in (sm.BY_NAME[n] for n in V1_METHODS):
        assert f"| 0 | {m.label} |" in md, m.label
    assert set(report["goals"]["0"]) == {"stare_o1", "stare_c2"}
    for png in report["figures"]:
        assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {Path(p).stem for p in report["figures"]} >= {"fig_entropy", "fig_pass8", "fig_theory"}
    runs = {}
    for d in (out / "seed0" / "runs").iterdir():
        runs[json.loads((d / "done.json").read_text())["method"]] = read_metrics(str(d / "metrics.jsonl"))
    assert set(runs) == set(V1_METHODS)
    for name, rows in runs.items():
        assert [r["step"] for r in rows] == [1, 2, 3], name
        assert "eval/pass@8" in rows[-1] and "dynamics/pred_dH" in rows[0], name
        gate = [r["stare/gate"] for r in rows]
        assert (max(gate) == 1.0) == name.startswith("stare"), (name, gate)  # only STARE's gate acts
    # Same warm start, prompts and sampling seed: the first step sees the same policy and batch
    # (DAPO may draw more prompts to fill its batch).
    h1 = {round(rows[0]["stare/entropy"], 6) for name, rows in runs.items() if name != "dapo"}
    assert len(h1) == 1, h1
    # Resume: nothing left to run, the report is rebuilt from the finished runs.
    again = _study(out)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert ": start (" not in again.stdout and "| 0 | STARE C2 |" in again.stdout
