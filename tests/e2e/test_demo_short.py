"""The CPU demo pipeline, shortened (``--quick``): on the tiny model (``--tiny``), tiny SFT, 3 RL
steps each of GRPO and STARE through torchrun (2 ranks, TP=2, the ``hf`` engine); on the real
model (the default), 1 step of each on SmolLM2 (DP2, the ``hf`` engine); then the figure and the
summary."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_stare.trainer.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.distributed]

KEYS = ("stare/entropy", "stare/gate", "stare/w", "stare/m", "reward/accuracy", "response/mean_length",
        "mismatch/max_abs_logp", "loss", "grad_norm")


def test_demo_quick(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "megatron_stare.demo.run", "--tiny", "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for run in ("grpo", "stare"):
        rows = read_metrics(str(out / run / "metrics.jsonl"))
        assert [r["step"] for r in rows] == [1, 2, 3], run
        for r in rows:
            missing = [k for k in KEYS if k not in r]
            assert not missing, f"{run} step {r['step']} lacks {missing}"
            assert r["mismatch/max_abs_logp"] < 1e-4  # the engine serves the trainer's weights
    # Both runs start from the same warm start with the same prompts and sampling seed.
    g, s = (read_metrics(str(out / run / "metrics.jsonl"))[0] for run in ("grpo", "stare"))
    assert g["stare/entropy"] == pytest.approx(s["stare/entropy"], abs=1e-6)
    png = out / "demo.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["runs"]) == {"GRPO", "STARE"}
    assert summary["start"]["target_entropy"] > 0
    assert "target entropy" in proc.stdout and "STARE" in proc.stdout
    # Long work shows progress on the console (not only in the logs): the warm start's probes
    # and every RL step here (log_every = steps // 20 = 1) print a line with an ETA.
    console = proc.stdout.splitlines()
    assert any(re.match(r"\[demo\] \[sft\] step 20/120 .*eta <= \d+", ln) for ln in console), proc.stdout
    for label in ("GRPO", "STARE"):
        steps = [int(m.group(1)) for ln in console
                 if (m := re.match(rf"\[demo\] {label} step (\d+)/3, eta \d+(m\d\ds)?s? \|", ln))]
        assert steps == [1, 2, 3], (label, proc.stdout)


def test_demo_quick_on_the_real_model(tmp_path):
    """The default demo's path at 1 step a run: STARE's target is the ratio times the first
    step's entropy, which both runs share (the same start, prompts and seeds); the held-out
    evaluation reaches the summary, the table and the figure."""
    pytest.importorskip("gguf", reason="the real model needs the real-model extra")
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "megatron_stare.demo.run", "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {run: read_metrics(str(out / run / "metrics.jsonl")) for run in ("grpo", "stare")}
    for run, rs in rows.items():
        assert [r["step"] for r in rs] == [1], run
        missing = [k for k in (*KEYS, "eval/avg@2", "eval/pass@2") if k not in rs[0]]
        assert not missing, f"{run} lacks {missing}"
        assert rs[0]["mismatch/max_abs_logp"] < 1e-3  # the engine serves the trainer's weights
    h0 = rows["grpo"][0]["stare/entropy"]
    assert rows["stare"][0]["stare/entropy"] == pytest.approx(h0, abs=1e-6)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["start"]["target_entropy"] == pytest.approx(0.35 * h0, abs=1e-4)
    assert summary["runs"]["STARE"]["final_pass@1"] == pytest.approx(rows["stare"][0]["eval/avg@2"])
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert re.search(r"\[demo\] start entropy H0 \d\.\d{3} .* STARE target \d\.\d{3} \(0\.35 x H0\)", proc.stdout)
    assert "held-out avg@2" in proc.stdout and re.search(r"^STARE\s", proc.stdout, re.M), proc.stdout
