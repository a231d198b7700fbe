"""A constructed multi-turn batch where the tool / environment tokens have the HIGHEST surprisal:
if any loss, metric or STARE selection looked at them, it would pick them first.

``masked_case()`` -> ``(old_logp, advantages, mask, token_keys, tool)`` ``[N, T]`` float64 /
``[N]`` / bool / int64 / bool, built through ``collate`` from ``Sample``s with loss masks (the
trainer's own path); ``tool`` marks the tool tokens (targets inside the response, mask 0).
``compact_case()`` is the same batch with the tool tokens removed: what every loss and metric
must equal.
"""

from __future__ import annotations

import random
from typing import List, Tuple

import torch
from torch import Tensor

from megatron_stare.actor.batching import collate
from megatron_stare.types import Sample


def masked_samples(num: int = 8, seed: int = 0) -> List[Sample]:
    """``num`` trajectories: prompt, then 2-3 model turns with tool observations between them."""
    rng = random.Random(seed)
    out = []
    for i in range(num):
        prompt = [rng.randrange(100) for _ in range(rng.randint(2, 5))]
        resp, mask = [], []
        for turn in range(rng.randint(2, 3)):
            if turn:
                obs = rng.randint(1, 6)
                resp += [rng.randrange(100) for _ in range(obs)]
                mask += [0] * obs
            k = rng.randint(1, 7)
            resp += [rng.randrange(100) for _ in range(k)]
            mask += [1] * k
        out.append(Sample(sample_id=i, group_id=i // 4, prompt_ids=prompt, response_ids=resp, loss_mask=mask,
                          advantage=[1.0, -0.5, 0.0, 2.0, -1.5, 0.7, -0.2, 1.3][i % 8]))
    return out


def masked_case(samples: List[Sample] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    samples = samples if samples is not None else masked_samples()
    mb = collate(samples)
    g = torch.Generator().manual_seed(1)
    surprisal = torch.rand(mb.shape, generator=g, dtype=torch.float64) * 3
    tool = torch.zeros_like(mb.loss_mask)
    for b, s in enumerate(samples):
        p = len(s.prompt_ids)
        tool[b, p - 1:p - 1 + len(s.response_ids)] = torch.tensor(s.loss_mask) == 0
    surprisal[tool] = 50.0 + torch.arange(int(tool.sum()), dtype=torch.float64)  # the highest, all distinct
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float64)
    return -surprisal, adv, mb.loss_mask, mb.token_keys, tool


def compact_case(old_logp: Tensor, adv: Tensor, mask: Tensor, keys: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The trained tokens only, left-aligned per row (same values, keys and advantages)."""
    width = int(mask.sum(1).max())
    lp = torch.zeros(mask.shape[0], width, dtype=old_logp.dtype)
    m = torch.zeros(mask.shape[0], width, dtype=torch.bool)
    k = torch.zeros(mask.shape[0], width, dtype=keys.dtype)
    for b in range(mask.shape[0]):
        n = int(mask[b].sum())
        lp[b, :n], m[b, :n], k[b, :n] = old_logp[b][mask[b]], True, keys[b][mask[b]]
    return lp, adv, m, k
