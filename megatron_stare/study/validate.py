"""Task validity at the warm start (study v2, docs/study.md): is there anything for the methods to do?

Measured on the warm-started checkpoint before any method runs, sampling it as the rollout does
(raw prompt, temperature 1, no top-k/top-p), ``samples`` responses per prompt:

- ``pass@k`` for k = 1, 2, 4, ..., ``samples`` (the unbiased estimator
  ``1 - C(n-c, k) / C(n, k)`` per prompt, mean over prompts). Criterion: pass@32 <= ``MAX_PASS32``
  (room for pass@k to grow).
- ``frac_pos_high``: the share of *all* response tokens (EOS included) whose GRPO advantage is
  > 0 (groups of ``group`` responses, ``(r - mean) / (std + 1e-6)``) and whose surprisal
  ``-log p(token)`` is above the position's entropy: the tokens whose reinforcement raises
  entropy, STARE's lever. Criterion: >= ``MIN_POS_HIGH``. ``frac_pos_high_of_nonzero`` is the
  same count over the tokens with A != 0 (the trainer's ``dynamics/frac_pos_high``).
- ``mean_length`` (model tokens, EOS included). Criterion: in ``LENGTH_RANGE``.

The criteria were fixed before any method ran; ``validate`` prints the numbers and which hold.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Sequence

import torch
from megatron_stare.rewards import get_reward_fn
from megatron_stare.study.sft import PolicyStats

MAX_PASS32 = 0.9
MIN_POS_HIGH = 0.05
LENGTH_RANGE = (20.0, 60.0)


@dataclass
class Validity:
    prompts: int
    samples: int
    pass_at: Dict[str, float]
    """``"1"``, ``"2"``, ... ``"32"`` -> pass@k."""
    frac_pos_high: float
    frac_pos_high_of_nonzero: float
    mean_length: float
    entropy: float
    """Token-mean entropy of the sampled response tokens (the trainer's ``stare/entropy``)."""
    accuracy: float

    def checks(self) -> Dict[str, bool]:
        top = str(self.samples)
        return {f"pass@{top} <= {MAX_PASS32}": self.pass_at[top] <= MAX_PASS32,
                f"A>0 & s>H share >= {MIN_POS_HIGH}": self.frac_pos_high >= MIN_POS_HIGH,
                f"mean length in {LENGTH_RANGE}": LENGTH_RANGE[0] <= self.mean_length <= LENGTH_RANGE[1]}

    def to_json(self) -> dict:
        return {**asdict(self), "checks": self.checks()}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` correct among ``n`` samples (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@torch.no_grad()
def sample_tokens(model, tok, prompts: Sequence[str], n: int, *, max_new_tokens: int, seed: int,
                  batch: int = 512) -> List[dict]:
    """``n`` samples per prompt (temperature 1, KV cache); per response: ``ids``, per-token
    ``surprisal`` and ``entropy`` (lists of the response length, EOS included). Prompt-major."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    flat = [p for p in prompts for _ in range(n)]
    out: List[dict] = []
    for lo in range(0, len(flat), batch):
        enc = [tok(p)["input_ids"] for p in flat[lo:lo + batch]]
        b, plen = len(enc), max(map(len, enc))
        ids = torch.full((b, plen), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((b, plen), dtype=torch.long)
        for i, x in enumerate(enc):
            ids[i, plen - len(x):] = torch.tensor(x)
            mask[i, plen - len(x):] = 1
        rows = [{"ids": [], "surprisal": [], "entropy": []} for _ in range(b)]
        done = torch.zeros(b, dtype=torch.bool)
        past, step_ids = None, ids
        for _ in range(max_new_tokens):
            pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
            res = model(input_ids=step_ids, attention_mask=mask, position_ids=pos, past_key_values=past,
                        use_cache=True)
            past = res.past_key_values
            logp = torch.log_softmax(res.logits[:, -1].float(), -1)
            ent = -(logp.exp() * logp).sum(-1)
            nxt = torch.multinomial(logp.exp(), 1, generator=g).squeeze(-1)
            s = -logp.gather(-1, nxt[:, None]).squeeze(-1)
            for i in (~done).nonzero().flatten().tolist():
                rows[i]["ids"].append(int(nxt[i]))
                rows[i]["surprisal"].append(float(s[i]))
                rows[i]["entropy"].append(float(ent[i]))
            done |= nxt == tok.eos_token_id
            step_ids = nxt[:, None]
            mask = torch.cat([mask, (~done | (nxt == tok.eos_token_id)).long()[:, None]], -1)
            if bool(done.all()):
                break
        out += rows
    model.train()
    return out


def measure_validity(model, tok, rows: Sequence[dict], score: Callable[[str, str, dict], float], *,
                     samples: int = 32, group: int = 8, max_new_tokens: int, seed: int) -> Validity:
    """The validity numbers (module docstring) of ``model`` on ``rows`` (prompt, answer, metadata)."""
    resp = sample_tokens(model, tok, [r["prompt"] for r in rows], samples, max_new_tokens=max_new_tokens, seed=seed)
    texts = tok.batch_decode([x["ids"] for x in resp], skip_special_tokens=True)
    rewards = [float(score(t, rows[i // samples]["answer"], rows[i // samples])) for i, t in enumerate(texts)]
    correct = [r > 0 for r in rewards]
    ks = [2 ** j for j in range(int(math.log2(samples)) + 1)]
    pass_at = {str(k): sum(pass_at_k(samples, sum(correct[i:i + samples]), k)
                           for i in range(0, len(correct), samples)) / len(rows) for k in ks}
    pos_high = nonzero = total = 0
    ent_sum = 0.0
    for g0 in range(0, len(resp), group):  # GRPO groups: consecutive samples of one prompt
        rs = torch.tensor(rewards[g0:g0 + group], dtype=torch.float64)
        adv = (rs - rs.mean()) / (rs.std() + 1e-6) if len(rs) > 1 else torch.zeros_like(rs)
        for x, a in zip(resp[g0:g0 + group], adv.tolist()):
            high = sum(s > h for s, h in zip(x["surprisal"], x["entropy"]))
            total += len(x["ids"])
            ent_sum += sum(x["entropy"])
            nonzero += len(x["ids"]) if abs(a) > 1e-9 else 0
            pos_high += high if a > 1e-9 else 0
    return Validity(prompts=len(rows), samples=samples, pass_at=pass_at, frac_pos_high=pos_high / max(total, 1),
                    frac_pos_high_of_nonzero=pos_high / max(nonzero, 1), mean_length=total / max(len(resp), 1),
                    entropy=ent_sum / max(total, 1), accuracy=sum(correct) / len(correct))


def format_validity(v: Validity) -> str:
    ladder = " ".join(f"pass@{k} {p:.3f}" for k, p in v.pass_at.items())
    checks = "; ".join(f"{name}: {'holds' if ok else 'FAILS'}" for name, ok in v.checks().items())
    return (f"validity ({v.prompts} prompts x {v.samples}): {ladder}; accuracy {v.accuracy:.3f}; "
            f"A>0 & s>H {v.frac_pos_high:.3f} of all tokens ({v.frac_pos_high_of_nonzero:.3f} of A!=0 tokens); "
            f"mean length {v.mean_length:.1f}; entropy {v.entropy:.3f}\n  {checks}")


def validate_checkpoint(ckpt: Path, eval_jsonl: Path, task, *, seed: int, prompts: int = 64) -> Validity:
    """``measure_validity`` of the HF checkpoint ``ckpt`` on the first ``prompts`` held-out rows of
    ``eval_jsonl``, scored by ``task``'s reward (``study_tasks.StudyTask``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer


    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    rows = [json.loads(line) for line in Path(eval_jsonl).read_text().splitlines() if line.strip()][:prompts]
    return measure_validity(model, tok, rows, get_reward_fn(task.name), samples=task.validate_samples,
                            max_new_tokens=task.max_new_tokens, seed=seed)


def measure_policy_kv(model, tok, rows: Sequence[dict], *, seed: int, samples_per_prompt: int = 1,
                      max_new_tokens: int, score_fn: Callable[[str, str, dict], float]):
    """``sft.measure_policy``'s numbers with a KV cache (``sample_tokens``): the warm start's probes
    for tasks with long responses (``StudyTask.kv_cache``)."""

    k = samples_per_prompt
    resp = sample_tokens(model, tok, [r["prompt"] for r in rows], k, max_new_tokens=max_new_tokens, seed=seed)
    texts = tok.batch_decode([x["ids"] for x in resp], skip_special_tokens=True)
    correct = [score_fn(t, rows[i // k]["answer"], rows[i // k]) > 0 for i, t in enumerate(texts)]
    n_tok = sum(len(x["ids"]) for x in resp)
    return PolicyStats(accuracy=sum(correct) / len(resp), entropy=sum(sum(x["entropy"]) for x in resp) / max(n_tok, 1),
                       mean_length=n_tok / len(resp),
                       pass_at_k=sum(any(correct[i:i + k]) for i in range(0, len(resp), k)) / len(rows),
                       distinct=sum(len(set(texts[i:i + k])) for i in range(0, len(resp), k)) / len(rows))
