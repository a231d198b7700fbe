"""Supervised warm start for the CPU demo: plain torch training of a tiny HF model in one process.

The RL comparison needs a policy that already solves part of the task (so rewards vary inside a
prompt group) and still has real entropy (so there is something to collapse). A random-init
model has neither, so the demo first fits ``prompt -> " " + answer + EOS`` with cross-entropy on
the answer tokens only, and stops as soon as the *sampled* accuracy (temperature 1, the RL
rollout setting) reaches ``stop_accuracy``: the start is partial by construction, whatever the
seed. The result is saved as an HF checkpoint directory (safetensors + config + tokenizer) that
``megatron_stare.train`` loads like any other model.

``measure_policy`` samples the checkpoint the way the RL rollout does (raw prompt, temperature
1, no top-k/top-p) and returns the accuracy and the token-mean entropy over response tokens,
the quantity the trainer logs as ``stare/entropy``; the demo sets STARE's target from it.
"""

from __future__ import annotations

import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

from megatron_stare.trainer.metrics import format_duration
from megatron_stare.rewards.synthetic import exact_match

Row = Dict[str, str]
ScoreFn = Callable[[str, str, dict], float]
"""A reward function (``rewards.registry``): ``fn(response_text, answer, row) -> float``."""


@dataclass
class SftSettings:
    """Knobs of the warm start (defaults: a few hundred steps, well under a minute of CPU)."""

    max_steps: int = 1500
    """Upper bound on optimizer steps; the run usually stops earlier at ``stop_accuracy``."""
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.0
    stop_accuracy: float = 0.4
    """Stop once the sampled (temperature 1) accuracy on the held-out probe reaches this."""
    eval_every: int = 25
    """Steps between accuracy probes."""
    probe_prompts: int = 64
    """Held-out prompts of each probe (one sample each at temperature 1)."""
    max_new_tokens: int = 8
    stop_pass: float = 1.01
    """Also stop once the probe's pass@``pass_samples`` (``pass_samples`` samples per probe prompt at
    temperature 1: the share of prompts with at least one correct) reaches this (default: never).
    The study's validity asks pass@32 <= 0.9 at the warm start; sampled accuracy alone overshoots it
    on some seeds (docs/study.md, "Study v2")."""
    pass_samples: int = 32
    pass_every: int = 50
    """Steps between pass@k probes (each is ``probe_prompts x pass_samples`` samples)."""
    pass_from_accuracy: float = 0.05
    """pass@k is probed only once the sampled accuracy reaches this (below it, pass@k is far)."""


@dataclass
class PolicyStats:
    accuracy: float
    """Fraction of sampled responses (temperature 1) that score > 0 under the task's reward."""
    entropy: float
    """Token-mean entropy (nats) of the sampled response tokens, EOS included."""
    mean_length: float
    pass_at_k: float = float("nan")
    """Fraction of prompts with at least one correct response among their ``samples_per_prompt``."""
    distinct: float = float("nan")
    """Mean number of distinct responses per prompt among its ``samples_per_prompt``."""


def sft_target(row: Row, rng: random.Random) -> str:
    """The response the warm start fits for ``row``: one of its ``solutions`` (``|``-separated,
    drawn at random each time, so the warm start sees a diverse set of correct answers), else
    its ``answer``."""
    sols = row.get("solutions")
    return " " + (rng.choice(sols.split("|")) if sols else row["answer"])


def encode_answer(tok, row: Row, rng: Optional[random.Random] = None) -> tuple:
    """``(token ids, labels)`` of ``prompt + sft_target(row) + EOS``, labels -100 on the prompt
    (without ``rng``: the row's ``answer``)."""
    prompt = tok(row["prompt"])["input_ids"]
    target = tok(sft_target(row, rng) if rng is not None else " " + row["answer"])["input_ids"] + [tok.eos_token_id]
    return prompt + target, [-100] * len(prompt) + target


def _batch(tok, rows: Sequence[Row], encode=encode_answer) -> tuple:
    """Right-padded ``input_ids``/``labels``/``attention_mask`` ``[B, T]``; ``encode(tok, row)``
    gives each row's ``(token ids, labels)`` (-100 where nothing is trained)."""
    pairs = [encode(tok, r) for r in rows]
    t = max(len(seq) for seq, _ in pairs)
    ids = torch.full((len(rows), t), tok.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), t), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), t), dtype=torch.long)
    for i, (seq, lab) in enumerate(pairs):
        ids[i, :len(seq)] = torch.tensor(seq)
        labels[i, :len(seq)] = torch.tensor(lab)
        mask[i, :len(seq)] = 1
    return ids, labels, mask


@torch.no_grad()
def measure_policy(model, tok, rows: Sequence[Row], *, seed: int, samples_per_prompt: int = 1,
                   max_new_tokens: int = 8, temperature: float = 1.0,
                   score_fn: Optional[ScoreFn] = None) -> PolicyStats:
    """Sample ``samples_per_prompt`` responses per row (left-padded batch, no KV cache: the
    responses are a few tokens) and score them as the RL rollout does (``score_fn``, default
    ``exact_match``; the row's other keys are its metadata)."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    prompts = [tok(r["prompt"])["input_ids"] for r in rows for _ in range(samples_per_prompt)]
    answers = [r["answer"] for r in rows for _ in range(samples_per_prompt)]
    b, p = len(prompts), max(len(x) for x in prompts)
    ids = torch.full((b, p), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((b, p), dtype=torch.long)
    for i, x in enumerate(prompts):
        ids[i, p - len(x):] = torch.tensor(x)
        mask[i, p - len(x):] = 1
    done = torch.zeros(b, dtype=torch.bool)
    out: List[List[int]] = [[] for _ in range(b)]
    ent_sum, ent_n = 0.0, 0
    for _ in range(max_new_tokens):
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].float() / temperature
        logp = torch.log_softmax(logits, -1)
        ent = -(logp.exp() * logp).sum(-1)
        nxt = torch.multinomial(logp.exp(), 1, generator=g).squeeze(-1)
        live = ~done
        ent_sum += float(ent[live].sum())
        ent_n += int(live.sum())
        for i in live.nonzero().flatten().tolist():
            out[i].append(int(nxt[i]))
        done |= nxt == tok.eos_token_id
        ids = torch.cat([ids, nxt.unsqueeze(-1)], -1)
        mask = torch.cat([mask, live.long().unsqueeze(-1)], -1)
        if bool(done.all()):
            break
    texts = tok.batch_decode(out, skip_special_tokens=True)
    fn = score_fn or exact_match
    k = samples_per_prompt
    correct = [fn(t, a, rows[i // k]) > 0 for i, (t, a) in enumerate(zip(texts, answers))]
    model.train()
    return PolicyStats(accuracy=sum(correct) / b, entropy=ent_sum / max(ent_n, 1), mean_length=sum(map(len, out)) / b,
                       pass_at_k=sum(any(correct[i:i + k]) for i in range(0, b, k)) / len(rows),
                       distinct=sum(len(set(texts[i:i + k])) for i in range(0, b, k)) / len(rows))


def train_sft(base_dir: str, out_dir: str, train_rows: Sequence[Row], probe_rows: Sequence[Row],
              settings: SftSettings, *, seed: int, log=print, encode=None, probe=None,
              score_fn: Optional[ScoreFn] = None) -> PolicyStats:
    """Fit ``base_dir``'s model on ``train_rows``, stop at ``settings.stop_accuracy`` on
    ``probe_rows``, write the HF checkpoint (with tokenizer) to ``out_dir``; return its stats.

    ``encode(tok, row) -> (token ids, labels)``: what a row trains (default: ``encode_answer``
    with the run's rng, so each step draws one of a row's ``solutions``). ``probe(model, tok,
    rows, seed) -> PolicyStats``: the sampled accuracy the stop rule reads (default:
    ``measure_policy``, one single-turn sample per row, scored with ``score_fn``); with
    ``samples=k`` it returns pass@k as ``pass_at_k`` (``settings.stop_pass``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    rng = random.Random(seed)
    s = settings
    if encode is None:
        def encode(tok, row):
            return encode_answer(tok, row, rng)
    if probe is None:
        def probe(model, tok, rows, seed, samples=1):
            return measure_policy(model, tok, rows, seed=seed, max_new_tokens=s.max_new_tokens, score_fn=score_fn,
                                  samples_per_prompt=samples)
    stats = probe(model, tok, probe_rows[:s.probe_prompts], seed)
    t0, step, passed = time.perf_counter(), 0, 0.0
    while step < s.max_steps and stats.accuracy < s.stop_accuracy and passed < s.stop_pass:
        ids, labels, mask = _batch(tok, rng.sample(list(train_rows), s.batch_size), encode)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % s.eval_every == 0 or step == s.max_steps:
            stats = probe(model, tok, probe_rows[:s.probe_prompts], seed + step)
            model.train()
            took = time.perf_counter() - t0
            # An upper bound: the run stops earlier once the probe reaches stop_accuracy.
            eta = format_duration(took / step * (s.max_steps - step))
            log(f"[sft] step {step}/{s.max_steps} loss {loss.item():.3f} sampled acc {stats.accuracy:.2f} "
                f"H {stats.entropy:.3f} ({took:.0f}s, eta <= {eta})")
            if s.stop_pass <= 1.0 and step % s.pass_every == 0 and stats.accuracy >= s.pass_from_accuracy:
                passed = probe(model, tok, probe_rows[:s.probe_prompts], seed + step, samples=s.pass_samples).pass_at_k
                model.train()
                log(f"[sft] step {step}: probe pass@{s.pass_samples} {passed:.3f}"
                    + (f" >= {s.stop_pass}: stop" if passed >= s.stop_pass else ""))
    out = Path(out_dir)
    tmp = out.parent / f".{out.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (Path(base_dir) / name).is_file():  # the tokenizer files as built, byte for byte
            shutil.copyfile(Path(base_dir) / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return stats
