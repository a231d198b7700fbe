"""From a step's samples to this rank's mini-batches of padded micro-batches.

1. ``split_mini_batches``: whole prompt groups, in order, into ``k`` optimizer mini-batches.
2. ``assign_data_parallel``: a mini-batch's samples dealt over DP ranks, balanced by token
   count (longest first to the least-loaded rank; ties by sample id, then rank), deterministic.
3. ``pack_micro_batches``: a rank's samples packed, longest first, into micro-batches whose
   padded size ``rows * max_len`` stays within a token budget (dynamic batch size).
4. ``collate``: right-padded to the longest row, rounded up to ``sequence_pad_multiple`` (what
   sequence and context parallelism split the sequence by). Padding is a masked target
   (``loss_mask`` False, ``token_keys`` 0), so no loss, selection or metric sees it.

Every rank computes the same plan from the same global batch, so the pipeline stages and
tensor-parallel ranks of a replica iterate identical micro-batches without talking.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from megatron_stare.types import KEY_STRIDE, MicroBatch, Sample, pad_stack


def split_mini_batches(samples: Sequence[Sample], k: int) -> List[List[Sample]]:
    """``k`` mini-batches of whole groups (group order preserved); groups must divide evenly."""
    groups: dict = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s)
    ids = sorted(groups)
    if len(ids) % k:
        raise ValueError(f"{len(ids)} prompt groups cannot be split into {k} equal mini-batches "
                         f"(trainer.mini_batches_per_step)")
    per = len(ids) // k
    return [[s for g in ids[i * per:(i + 1) * per] for s in groups[g]] for i in range(k)]


def assign_data_parallel(samples: Sequence[Sample], dp_size: int) -> List[List[Sample]]:
    """Samples per DP rank, balanced by token count; each rank's list ordered by sample id."""
    load = [0] * dp_size
    out: List[List[Sample]] = [[] for _ in range(dp_size)]
    for s in sorted(samples, key=lambda s: (-s.num_tokens, s.sample_id)):
        r = min(range(dp_size), key=lambda i: (load[i], i))
        out[r].append(s)
        load[r] += s.num_tokens
    return [sorted(o, key=lambda s: s.sample_id) for o in out]


def pack_micro_batches(samples: Sequence[Sample], token_budget: int,
                       max_rows: Optional[int] = None) -> List[List[Sample]]:
    """Groups of samples whose padded size ``len(group) * longest`` fits ``token_budget``.

    A sample longer than the budget gets a micro-batch of its own. ``max_rows`` caps the rows
    (a fixed micro-batch size when the budget is generous).
    """
    order = sorted(samples, key=lambda s: (-s.num_tokens, s.sample_id))
    out: List[List[Sample]] = []
    cur: List[Sample] = []
    for s in order:
        width = max([s.num_tokens - 1] + [c.num_tokens - 1 for c in cur])
        full = max_rows is not None and len(cur) >= max_rows
        if cur and ((len(cur) + 1) * width > token_budget or full):
            out.append(cur)
            cur = []
        cur.append(s)
    if cur:
        out.append(cur)
    return out


def sequence_pad_multiple(tp: int, cp: int = 1, sequence_parallel: bool = False) -> int:
    """The multiple a micro-batch's length must have for Megatron to split it.

    Sequence parallelism scatters the sequence over the ``tp`` ranks; context parallelism cuts it
    into ``2*cp`` load-balanced chunks, and with both each chunk is scattered over TP:
    ``tp * 2*cp``. Without either, 1.
    """
    sp = tp if sequence_parallel else 1
    return sp * (2 * cp if cp > 1 else 1)


def collate(samples: Sequence[Sample], with_engine_logp: bool = False, pad_multiple: int = 1) -> MicroBatch:
    """Right-padded ``MicroBatch`` of ``samples`` (see ``MicroBatch`` for the alignment), its
    length rounded up to a multiple of ``pad_multiple`` (``sequence_pad_multiple``)."""
    rows, tgts, masks, keys = [], [], [], []
    for s in samples:
        seq = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        p, r = len(s.prompt_ids), len(s.response_ids)
        if p < 1 or r < 1:
            raise ValueError(f"sample {s.sample_id}: needs >= 1 prompt and >= 1 response token")
        inp, tgt = seq[:-1], seq[1:]
        mask = torch.zeros(inp.numel(), dtype=torch.bool)
        mask[p - 1:] = True  # target index t is token t+1: response tokens start at p
        key = torch.zeros(inp.numel(), dtype=torch.long)
        key[p - 1:] = s.sample_id * KEY_STRIDE + torch.arange(r)
        rows.append(inp), tgts.append(tgt), masks.append(mask), keys.append(key)
    width = -(-max(r.numel() for r in rows) // pad_multiple) * pad_multiple
    mb = MicroBatch(
        input_ids=pad_stack(rows, width),
        position_ids=torch.arange(width).unsqueeze(0).expand(len(rows), width).contiguous(),
        targets=pad_stack(tgts, width),
        loss_mask=pad_stack(masks, width, False),
        token_keys=pad_stack(keys, width),
        advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        sample_ids=torch.tensor([s.sample_id for s in samples], dtype=torch.long),
        group_ids=torch.tensor([s.group_id for s in samples], dtype=torch.long),
    )
    if with_engine_logp:
        if any(s.engine_logprobs is None or len(s.engine_logprobs) != len(s.response_ids) for s in samples):
            raise ValueError("engine log-probs missing or of the wrong length for some samples")
        e = torch.zeros(len(samples), width)
        for i, s in enumerate(samples):
            p = len(s.prompt_ids)
            e[i, p - 1: p - 1 + len(s.response_ids)] = torch.tensor(s.engine_logprobs)
        mb.engine_logp = e
    return mb


def cp_slice(mb: MicroBatch, cp: int, cp_rank: int) -> MicroBatch:
    """This context-parallel rank's part of every ``[B, L]`` field, Megatron's load-balanced way.

    The padded length is split into ``2*cp`` chunks and rank ``r`` keeps chunks ``r`` and
    ``2*cp-1-r`` (causal attention cost then balances across ranks). ``position_ids`` are
    sliced like the rest, so they keep their global values. ``[B]`` fields are unchanged.
    """
    if cp == 1:
        return mb
    b, width = mb.loss_mask.shape
    chunk = -(-width // (2 * cp))
    padded = chunk * 2 * cp
    keep = torch.cat([torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk)])
    for name, value in list(vars(mb).items()):
        if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape == (b, width):
            if name == "position_ids":
                full = torch.arange(padded).unsqueeze(0).expand(b, padded)
            else:
                full = torch.zeros((b, padded), dtype=value.dtype)
                full[:, :width] = value
            setattr(mb, name, full[:, keep].contiguous())
    return mb


def plan_rank_batches(samples: Sequence[Sample], *, mini_batches: int, dp_rank: int, dp_size: int,
                      token_budget: int, max_rows: Optional[int] = None,
                      with_engine_logp: bool = False, cp: int = 1, cp_rank: int = 0,
                      pad_multiple: int = 1) -> List[List[MicroBatch]]:
    """This DP rank's micro-batches for each mini-batch of the step (CP-sliced when ``cp > 1``),
    each padded to a multiple of ``pad_multiple`` (``sequence_pad_multiple``)."""
    out = []
    for mini in split_mini_batches(samples, mini_batches):
        mine = assign_data_parallel(mini, dp_size)[dp_rank]
        out.append([cp_slice(collate(g, with_engine_logp, pad_multiple), cp, cp_rank)
                    for g in pack_micro_batches(mine, token_budget, max_rows)])
    return out
