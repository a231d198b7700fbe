"""The pick_sum warm start shared by the demo and the study: base model, data, SFT, H0.

``prepare_warm_start(d, seed)`` writes under ``d``: ``base/`` (a tiny random-init Qwen2-style model
and its locally trained BPE tokenizer), ``data/train.jsonl`` (RL prompts) and ``data/eval.jsonl``
(held-out prompts: digit lists and targets that neither the warm start nor RL trains on),
``sft/`` (the warm start: supervised on a diverse set of correct answers - each step draws one of
a prompt's solutions at random - and stopped once its sampled accuracy on 64 probe prompts
reaches ``stop_accuracy``), and ``start.json`` (H0 and the start's accuracy, pass@8, measured the
way the rollout and the evaluation sample: temperature 1, 8 samples per prompt). Cached: a
directory whose ``start.json`` has the same seed (and quick flag) is reused as is.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Callable

from megatron_stare.study.tasks import TASKS, StudyTask
from megatron_stare.rewards import get_reward_fn, make_task, write_jsonl

TASK = TASKS["pick_sum"].kwargs
"""``pick_sum``: 6 distinct digits offered, pick 2 that sum to N; >= 2 unordered pairs do."""
REWARD = "pick_sum"


def prepare_warm_start(d: Path, seed: int, *, quick: bool = False, eval_prompts: int = 256,
                       stop_accuracy: float = 0.3, log: Callable[[str], None] = print,
                       task: StudyTask = TASKS["pick_sum"]) -> dict:
    """Build (or reuse) everything under ``d`` for ``seed`` and ``task``; returns ``start.json``'s content."""
    d = Path(d)
    if (d / "start.json").is_file():
        cached = json.loads((d / "start.json").read_text())
        if cached.get("seed") == seed and cached.get("quick") == quick and cached.get("task", "pick_sum") == task.name:
            return cached
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_stare.study.sft import SftSettings, measure_policy, train_sft
    from megatron_stare.models.tiny import build_tiny_hf_model

    t0 = time.perf_counter()
    score = get_reward_fn(task.name)
    base = build_tiny_hf_model("qwen2", d / "base", seed=seed)
    sft_rows, probe, train, held = write_task_data(d, seed, quick=quick, eval_prompts=eval_prompts, task=task)
    # SFT lr 1e-3: at 3e-3 the tiny model sat on a plateau for ~1000 steps (docs/study.md).
    # Quick: just long enough that some responses are correct (rewards vary inside groups).
    mnt = task.max_new_tokens
    cfg = (SftSettings(max_steps=task.quick_sft_steps, eval_every=20, probe_prompts=16, lr=task.sft_lr, stop_accuracy=0.15,
                       max_new_tokens=mnt) if quick else
           SftSettings(max_steps=task.sft_max_steps, eval_every=10, probe_prompts=64, lr=task.sft_lr,
                       stop_accuracy=stop_accuracy, max_new_tokens=mnt,
                       stop_pass=task.stop_pass if task.stop_pass is not None else 1.01,
                       pass_samples=task.validate_samples))
    encode = None
    if task.sft_target is not None:
        rng = random.Random(seed)

        def encode(tok, row):  # the task's own supervised response (a random correct scratchpad)
            prompt = tok(row["prompt"])["input_ids"]
            target = tok(task.sft_target(row, rng))["input_ids"] + [tok.eos_token_id]
            return prompt + target, [-100] * len(prompt) + target
    measure = measure_policy
    if task.kv_cache:
        from megatron_stare.study.validate import measure_policy_kv as measure
    train_sft(str(base), str(d / "sft"), sft_rows, probe, cfg, seed=seed, log=log, score_fn=score, encode=encode,
              probe=lambda model, tok, rows, seed, samples=1: measure(model, tok, rows, seed=seed, max_new_tokens=mnt,
                                                                      score_fn=score, samples_per_prompt=samples))
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(d / "sft")
    model = AutoModelForCausalLM.from_pretrained(d / "sft", dtype=torch.float32)
    n = 8 if quick else 64
    st = measure(model, tok, train[:n], seed=seed, samples_per_prompt=8, score_fn=score, max_new_tokens=mnt)
    ev = measure(model, tok, held, seed=seed, samples_per_prompt=8, score_fn=score, max_new_tokens=mnt)
    start = {"seed": seed, "quick": quick, "task": task.name, "H0": st.entropy, "accuracy": st.accuracy, "pass@8": st.pass_at_k,
             "distinct@8": st.distinct, "eval_pass@1": ev.accuracy, "eval_pass@8": ev.pass_at_k,
             "mean_length": st.mean_length, "seconds": round(time.perf_counter() - t0, 1)}
    (d / "start.json").write_text(json.dumps(start, indent=2))
    return start


def write_task_data(d: Path, seed: int, *, quick: bool = False, eval_prompts: int = 256,
                    task: StudyTask = TASKS["pick_sum"]):
    """The seed's task rows (deterministic in ``seed``): writes ``d/data/train.jsonl`` (RL prompts)
    and ``d/data/eval.jsonl`` (held-out prompts no warm-start or RL row has); returns
    ``(sft_rows, probe_rows, train_rows, eval_rows)``."""

    kw, name = task.kwargs, task.name
    sft_rows = make_task(name, 1000 if quick else 5000, seed=1000 + seed, **kw)
    probe = make_task(name, 64, seed=2000 + seed, **kw)
    train = make_task(name, 2000, seed=3000 + seed, **kw)
    seen = {r["prompt"] for r in sft_rows + train}
    held = [r for r in make_task(name, 2 * eval_prompts, seed=4000 + seed, **kw) if r["prompt"] not in seen]
    held = held[:16 if quick else eval_prompts]
    write_jsonl(train, str(d / "data" / "train.jsonl"))
    write_jsonl(held, str(d / "data" / "eval.jsonl"))
    return sft_rows, probe, train, held
