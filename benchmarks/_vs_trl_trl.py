"""TRL's side of ``bench_vs_trl.py``: ``GRPOTrainer`` on the same model, prompts and batch, run by
the benchmark's own TRL virtual environment (never the project's ``.venv``).

Every completion is exactly ``--length`` new tokens (``min_new_tokens`` = ``max_completion_length``:
EOS is suppressed until the last token). Each optimizer step waits for the driver's ``go_<k>``
file in ``--gate`` and answers with ``done_<k>.json``: the step's wall time, its phases (generate:
``_generate``, prompts to completion ids; log-prob: no-grad log-prob passes, none when generation
and update are aligned, as here; score: the reward; update: the rest, i.e. the loss's forward,
backward and the optimizer step) and its sequences' lengths (prompt + completion tokens).

Imports only TRL's stack and the project's stdlib-only reward module.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from datasets import load_dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatron_stare.study.word_problems import compute_score  # noqa: E402  (stdlib + regex only)

PHASES = defaultdict(float)


def timed(name, fn, when=lambda: True):
    def wrapper(*a, **k):
        if not when():
            return fn(*a, **k)
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            PHASES[name] += time.perf_counter() - t0
    return wrapper


def reward(prompts, completions, ground_truth, **_):
    return [compute_score("word_problems", c[-1]["content"] if isinstance(c, list) else c, gt)
            for c, gt in zip(completions, ground_truth)]


class Gate(TrainerCallback):
    def __init__(self, gate: Path):
        self.gate, self.t0, self.seq_lens, self.generated = gate, 0.0, [], 0

    def on_step_begin(self, args, state, control, **kw):
        k = state.global_step
        while not (self.gate / f"go_{k}").exists():
            time.sleep(0.02)
        PHASES.clear()
        self.seq_lens, self.generated = [], 0
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        dt = time.perf_counter() - self.t0
        k = state.global_step - 1
        phases = dict(PHASES)
        phases["update"] = dt - phases.get("generate_and_score", 0.0)
        tmp = self.gate / f"done_{k}.tmp"
        tmp.write_text(json.dumps({"step_s": dt, "phases": phases, "seq_lens": self.seq_lens,
                                   "generated": self.generated}))
        tmp.rename(self.gate / f"done_{k}.json")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True, help="word problems in verl parquet")
    ap.add_argument("--length", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--gate", required=True)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--gradient-checkpointing", action="store_true", help="TRL's default; off here unless asked")
    ap.add_argument("--micro-batch", type=int, default=0, help="completions per forward/backward (0: all)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    gate = Path(a.gate)
    ds = load_dataset("parquet", data_files=a.data, split="train")
    ds = ds.map(lambda r: {"ground_truth": r["reward_model"]["ground_truth"]},
                remove_columns=["reward_model", "extra_info", "ability", "data_source"])
    batch = a.prompts * a.n
    micro = a.micro_batch or batch
    cfg = GRPOConfig(
        output_dir=str(gate / "trl_out"), per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro, num_generations=a.n, max_completion_length=a.length,
        generation_kwargs={"min_new_tokens": a.length}, temperature=1.0, learning_rate=a.lr, beta=0.0,
        max_steps=a.steps, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
        bf16=a.bf16, gradient_checkpointing=a.gradient_checkpointing, seed=1, log_completions=False,
        dataloader_num_workers=0, disable_dropout=True)
    model_kwargs = {"dtype": torch.bfloat16 if a.bf16 else torch.float32}
    cfg.model_init_kwargs = model_kwargs
    gate_cb = Gate(gate)
    trainer = GRPOTrainer(model=a.model, reward_funcs=reward, args=cfg, train_dataset=ds, callbacks=[gate_cb])
    T = type(trainer)
    T._generate = timed("generate", T._generate)
    T._generate_and_score_completions = timed("generate_and_score", T._generate_and_score_completions)
    T._calculate_rewards = timed("score", T._calculate_rewards)
    T._get_per_token_logps_and_entropies = timed("logprob", T._get_per_token_logps_and_entropies,
                                                 when=lambda: not torch.is_grad_enabled())
    orig = T._generate_and_score_completions

    def record_lengths(self, inputs):
        out = orig(self, inputs)
        lens = (out["prompt_mask"].sum(1) + out["completion_mask"].sum(1)).tolist()
        gate_cb.seq_lens += [int(x) for x in lens]
        gate_cb.generated += int(out["completion_mask"].sum())
        return out

    T._generate_and_score_completions = record_lengths
    trainer.train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
