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
from typing import Dict, List, Sequence

import torch

from megatron_stare.metrics import format_duration
from megatron_stare.rewards.synthetic import exact_match

Row = Dict[str, str]


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


@dataclass
class PolicyStats:
    accuracy: float
    """Fraction of sampled responses (temperature 1) that score 1 under ``exact_match``."""
    entropy: float
    """Token-mean entropy (nats) of the sampled response tokens, EOS included."""
    mean_length: float


def encode_answer(tok, row: Row) -> tuple:
    """``(token ids, labels)`` of ``prompt + " " + answer + EOS``, labels -100 on the prompt."""
    prompt = tok(row["prompt"])["input_ids"]
    target = tok(" " + row["answer"])["input_ids"] + [tok.eos_token_id]
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
                   max_new_tokens: int = 8, temperature: float = 1.0) -> PolicyStats:
    """Sample ``samples_per_prompt`` responses per row (left-padded batch, no KV cache: the
    responses are a few tokens) and score them as the RL rollout does."""
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
    acc = sum(exact_match(t, a) for t, a in zip(texts, answers)) / b
    model.train()
    return PolicyStats(accuracy=acc, entropy=ent_sum / max(ent_n, 1), mean_length=sum(map(len, out)) / b)


def train_sft(base_dir: str, out_dir: str, train_rows: Sequence[Row], probe_rows: Sequence[Row],
              settings: SftSettings, *, seed: int, log=print, encode=encode_answer, probe=None) -> PolicyStats:
    """Fit ``base_dir``'s model on ``train_rows``, stop at ``settings.stop_accuracy`` on
    ``probe_rows``, write the HF checkpoint (with tokenizer) to ``out_dir``; return its stats.

    ``encode(tok, row) -> (token ids, labels)``: what a row trains (default: the answer after
    the prompt). ``probe(model, tok, rows, seed) -> PolicyStats``: the sampled accuracy the
    stop rule reads (default: ``measure_policy``, one single-turn sample per row)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    rng = random.Random(seed)
    s = settings
    if probe is None:
        def probe(model, tok, rows, seed):
            return measure_policy(model, tok, rows, seed=seed, max_new_tokens=s.max_new_tokens)
    stats = probe(model, tok, probe_rows[:s.probe_prompts], seed)
    t0, step = time.perf_counter(), 0
    while step < s.max_steps and stats.accuracy < s.stop_accuracy:
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
