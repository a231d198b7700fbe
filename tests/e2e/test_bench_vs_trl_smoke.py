"""The project side of ``benchmarks/bench_vs_trl.py`` for one step (``--smoke``; never TRL): a tiny
Llama with a ChatML template, the word problems, DP2 with the ``hf`` engine. Its figures must be
consistent: every response exactly L tokens (the benchmark raises otherwise), the phases inside
the step, model FLOPs and the matmul peak > 0. Not timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from transformers import AutoTokenizer

from megatron_stare.models.tiny import build_tiny_hf_model

from .harness import ROOT

CHATML = ("{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant."
          "<|im_end|>\\n' }}{%- endif %}{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + "
          "m['content'] + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
          "{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_one_project_step_reports_consistent_figures(tmp_path):
    model = build_tiny_hf_model("llama", tmp_path / "model", hidden_size=64, num_heads=2, num_kv_heads=1,
                                ffn_hidden_size=128, tie_word_embeddings=True)
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = CHATML
    tok.save_pretrained(model)
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_vs_trl.py"), "--smoke", "--model", str(model),
                          "--layout", "dp2-hf", "--max-prompt-length", "256"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    p = res["project"]
    assert res["length"] == 8 and p["generated_tokens"] == 32 * 8
    assert p["seq_tokens"] > 32 * 8  # prompts + responses
    ph = p["phases_s"]
    assert ph["logprob"] == 0.0  # an on-policy vanilla step: the update's forward gives the old log-probs
    assert 0 < ph["generate"] + ph["logprob"] + ph["update"] + ph["sync"] <= p["step_s"]
    assert ph["logprob"] + ph["update"] <= ph["train"] * 1.01
    assert 0 < ph["optimizer"] < ph["update"]  # the Adam step is timed inside the update
    assert p["train_gflop"] > 0 and res["matmul_peak_gflops"] > 0
    assert 0 < p["train_peak_frac"] == p["train_gflops_per_s"] / res["matmul_peak_gflops"]
