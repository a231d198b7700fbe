"""Study v3's validity measurements at the start (docs/study.md, "Study v3 (real model): validity").

``python -m megatron_stare.demo.real_start MODEL DATA.parquet [--k 8] [--max-new-tokens 128] [--temperature 1]
[--out start.json]``

Samples every prompt of a word-problem split ``k`` times from the pretrained chat model, as the
rollout does (chat template, ``temperature``, no top-p / top-k, ``max_new_tokens``), with
transformers on CPU, and reports:

- ``avg@k`` / ``pass@k``: the start's sampled accuracy (``word_problems.compute_score``);
- ``H0``: the token-mean full-vocabulary entropy of the sampled responses (the trainer's
  ``stare/entropy``: generate's scores are the tempered logits);
- the quadrant fractions of algorithms.md's entropy sensitivity over the response tokens, with
  GRPO's advantages of each prompt's ``k`` samples: ``frac_pos_high`` = A > 0 and surprisal
  above the token's entropy (the tokens STARE amplifies toward higher entropy), as a fraction of
  all response tokens and of the tokens with A != 0 (the trainer's ``dynamics/frac_pos_high``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Dict, List

import torch

from megatron_stare.demo.word_problems import compute_score


def grpo_advantages(rewards: List[float]) -> List[float]:
    """algorithms.md's GRPO advantages of one group (unbiased std, 1e-6; a singleton: mean 0, std 1)."""
    if len(rewards) < 2:
        return [float(r) for r in rewards]
    mean, std = statistics.fmean(rewards), statistics.stdev(rewards)
    return [(r - mean) / (std + 1e-6) for r in rewards]


@torch.no_grad()
def measure(model_path: str, data_path: str, k: int = 8, max_new_tokens: int = 128, batch_prompts: int = 8,
            seed: int = 0, limit: int = 0, temperature: float = 1.0) -> Dict[str, float]:
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    rows = pq.read_table(data_path).to_pylist()
    rows = rows[:limit] if limit else rows
    eos = [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    scores: List[List[float]] = []
    n_tok = ent_sum = 0.0
    quad = {"pos_high": 0.0, "pos_low": 0.0, "neg_high": 0.0, "neg_low": 0.0}
    lengths: List[int] = []
    t0 = time.perf_counter()
    for b in range(0, len(rows), batch_prompts):
        chunk = rows[b:b + batch_prompts]
        texts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in chunk]
        enc = tok([t for t in texts for _ in range(k)], return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**enc, do_sample=True, temperature=temperature, top_p=1.0, top_k=0,
                             max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=tok.pad_token_id,
                             output_scores=True, return_dict_in_generate=True)
        resp = out.sequences[:, enc["input_ids"].shape[1]:]                       # [B, T]
        logp = torch.log_softmax(torch.stack(out.scores, 1).float(), -1)          # [B, T, V]
        ent = -(logp.exp() * logp).sum(-1)                                        # [B, T]
        surprisal = -logp.gather(-1, resp.unsqueeze(-1)).squeeze(-1)              # [B, T]
        # Valid: up to and including the first stop token.
        stop = torch.isin(resp, torch.tensor(eos))
        valid = (stop.cumsum(1) - stop.long()) == 0
        for p, row in enumerate(chunk):
            gt = row["reward_model"]["ground_truth"]
            idx = range(p * k, (p + 1) * k)
            r = [compute_score("word_problems", tok.decode(resp[i][valid[i]], skip_special_tokens=True), gt)
                 for i in idx]
            scores.append(r)
            for i, a in zip(idx, grpo_advantages(r)):
                v = valid[i]
                lengths.append(int(v.sum()))
                n_tok += float(v.sum())
                ent_sum += float(ent[i][v].sum())
                if a != 0:
                    high = surprisal[i][v] > ent[i][v]
                    sign = "pos" if a > 0 else "neg"
                    quad[f"{sign}_high"] += float(high.sum())
                    quad[f"{sign}_low"] += float((~high).sum())
        print(f"[real_start] {min(b + batch_prompts, len(rows))}/{len(rows)} prompts, "
              f"{time.perf_counter() - t0:.0f}s", flush=True)
    nz = max(sum(quad.values()), 1.0)
    return {
        "model": model_path, "data": data_path, "prompts": len(rows), "k": k, "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        f"avg@{k}": statistics.fmean(s for r in scores for s in r),
        f"pass@{k}": statistics.fmean(max(r) for r in scores),
        "mixed_groups": statistics.fmean(0 < sum(r) < k for r in scores),
        "H0": ent_sum / max(n_tok, 1.0),
        "response_len_mean": statistics.fmean(lengths),
        "truncated_frac": statistics.fmean(n >= max_new_tokens for n in lengths),
        "frac_pos_high_of_all_tokens": quad["pos_high"] / max(n_tok, 1.0),
        **{f"frac_{q}_of_nonzero_A": v / nz for q, v in quad.items()},
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_stare.demo.real_start", description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("data")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=0, help="first N prompts only (0 = all)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    res = measure(a.model, a.data, a.k, a.max_new_tokens, seed=a.seed, limit=a.limit, temperature=a.temperature)
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
