"""Study v2, shortened (``--task hop_path --quick``): a small warm start on hop_path, its task
validity measured before any method runs, three methods (GRPO, GSPO, STARE C2) for 3 steps through
the real trainer, each finished run recorded as one JSON in the results directory, the report
built from those files; a new session (run directories gone) runs nothing and rebuilds the same;
a new machine (seed directory gone) restores the kept warm start for a fourth method."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
METHODS = ("grpo", "gspo", "stare_c2")
pytestmark = [pytest.mark.slow]


def _study(out: Path, *extra: str) -> subprocess.CompletedProcess:
    # Target 1.5 x H0: the entropy is below it from step 1, so STARE's gate fires in 3 steps.
    return subprocess.run([sys.executable, "-m", "megatron_stare.study.v2", "--task", "hop_path", "--quick",
                           "--out", str(out), "--seeds", "0", "--target-ratio", "1.5", "--methods", *METHODS, *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_study_v2_quick_validity_results_and_resume(tmp_path):
    out = tmp_path / "study"
    proc = _study(out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = out / "results" / "seed0"
    start = json.loads((res / "start.json").read_text())
    v = start["validity"]
    assert set(v["pass_at"]) == {"1", "2", "4", "8", "16", "32"} and v["samples"] == 32
    ladder = [v["pass_at"][k] for k in ("1", "2", "4", "8", "16", "32")]
    assert ladder == sorted(ladder) and 0.0 <= ladder[0] <= ladder[-1] <= 1.0  # pass@k grows with k
    assert 0.0 <= v["frac_pos_high"] <= v["frac_pos_high_of_nonzero"] <= 1.0 and v["mean_length"] > 0
    assert len(v["checks"]) == 3 and "validity (16 prompts x 32)" in proc.stdout
    for m in METHODS:
        r = json.loads((res / f"{m}.json").read_text())
        assert (r["seed"], r["method"], r["steps"]) == (0, m, 3) and r["seconds"] > 0
        assert [x["step"] for x in r["rows"]] == [1, 2, 3]
        assert all(x["rollout/generated_tokens"] > 0 and "dynamics/frac_pos_high" in x for x in r["rows"])
        assert {"eval/avg@16", "eval/pass@2", "eval/pass@8", "eval/pass@16"} <= set(r["rows"][-1]), m
        assert not any(k.startswith("perf/") for k in r["rows"][0])  # only the report's inputs are kept
    assert not list((out / "results").rglob("*.tmp"))
    report = json.loads((out / "study.json").read_text())
    assert set(report["summaries"]["0"]) == set(METHODS) and set(report["goals"]["0"]) == {"stare_c2"}
    md = (out / "study.md").read_text()
    assert "| 0 | GSPO |" in md and "validity: pass@32" in md
    assert {Path(p).stem for p in report["figures"]} >= {"fig_entropy", "fig_pos_high", "fig_theory"}
    # A new session: the run directories are gone, the results remain; nothing runs again.
    shutil.rmtree(out / "seed0" / "runs")
    again = _study(out)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert ": start (" not in again.stdout and "| 0 | STARE C2 |" in again.stdout
    assert json.loads((out / "study.json").read_text())["summaries"] == report["summaries"]
    # A new machine asked for one more method: the seed directory is gone, the committed warm
    # start (results/seed0/sft) is restored, not rebuilt, and the new run starts from it: its
    # first step sees the same policy and batch as GRPO's did.
    assert {p.name for p in (res / "sft").iterdir()} >= {"model.safetensors", "config.json", "tokenizer.json"}
    shutil.rmtree(out / "seed0")
    more = _study(out, "cispo")
    assert more.returncode == 0, more.stdout[-3000:] + more.stderr[-3000:]
    assert "warm start restored from" in more.stdout and "[sft] step" not in more.stdout
    assert "warm start: sampled accuracy" not in more.stdout and "cispo" in more.stdout.lower()
    first = {m: json.loads((res / f"{m}.json").read_text())["rows"][0]["stare/entropy"] for m in ("grpo", "cispo")}
    assert first["cispo"] == first["grpo"], first
