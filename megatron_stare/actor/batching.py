"""From a step's samples to this rank's mini-batches of micro-batches.

1. ``split_mini_batches``: whole prompt groups, in order, into ``k`` optimizer mini-batches.
2. ``assign_data_parallel``: a mini-batch's samples dealt over DP ranks, balanced by token
   count (longest first to the least-loaded rank; ties by sample id, then rank), deterministic.
3. ``pack_micro_batches``: a rank's samples grouped into micro-batches within a token budget
   (dynamic batch size): padded, ``rows * longest`` fits it (longest first); packed, the real
   tokens fit it (first-fit decreasing).
4. ``collate`` (padded): right-padded to the longest row, rounded up to
   ``sequence_pad_multiple`` (what sequence and context parallelism split the sequence by),
   then ``cp_slice``d. ``collate_packed``: the sequences end to end in one row (each padded to
   a multiple of ``2*cp`` under CP, the row to the multiple), this CP rank's part of it
   (``types.PackedRow``), plus the same ``[B, L]`` per-token fields for the losses. Padding is
   a masked target (``loss_mask`` False, ``token_keys`` 0), so no loss, selection or metric
   sees it.

Every rank computes the same plan from the same global batch, so the pipeline stages and
tensor-parallel ranks of a replica iterate identical micro-batches without talking.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor

from megatron_stare.types import KEY_STRIDE, MicroBatch, PackedRow, Sample, pad_stack


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


def pack_micro_batches(samples: Sequence[Sample], token_budget: int, max_rows: Optional[int] = None,
                       packed: bool = False) -> List[List[Sample]]:
    """Groups of samples within ``token_budget``: their padded size ``len(group) * longest``, or
    with ``packed`` their real tokens (first-fit decreasing; each group in sample-id order).

    A sample longer than the budget gets a micro-batch of its own. ``max_rows`` caps the
    sequences of a group (a fixed micro-batch size when the budget is generous).
    """
    order = sorted(samples, key=lambda s: (-s.num_tokens, s.sample_id))
    if packed:
        bins: List[List[Sample]] = []
        loads: List[int] = []
        for s in order:
            n = s.num_tokens - 1
            for i, b in enumerate(bins):
                if loads[i] + n <= token_budget and (max_rows is None or len(b) < max_rows):
                    b.append(s)
                    loads[i] += n
                    break
            else:
                bins.append([s])
                loads.append(n)
        return [sorted(b, key=lambda s: s.sample_id) for b in bins]
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


#: The per-token fields of a micro-batch row, with their padding value.
ROW_FIELDS = {"input_ids": 0, "position_ids": 0, "targets": 0, "loss_mask": False, "token_keys": 0,
              "engine_logp": 0.0, "routes": -1}
ROUTES_DTYPE = torch.int16
"""The engine's expert indices per token and MoE layer (-1: not routed): 2 bytes each."""


def sample_row(s: Sample, with_engine_logp: bool = False, with_routes: bool = False) -> Dict[str, Tensor]:
    """The ``ROW_FIELDS`` of one sample, unpadded (``[n]``, n = its tokens - 1; ``routes``
    ``[n, layers, k]``, the engine's for its last positions, -1 before); see ``MicroBatch``
    for the alignment."""
    seq = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
    p, r = len(s.prompt_ids), len(s.response_ids)
    if p < 1 or r < 1:
        raise ValueError(f"sample {s.sample_id}: needs >= 1 prompt and >= 1 response token")
    n = seq.numel() - 1
    row = {"input_ids": seq[:-1], "position_ids": torch.arange(n), "targets": seq[1:]}
    row["loss_mask"] = torch.zeros(n, dtype=torch.bool)
    row["loss_mask"][p - 1:] = True  # target index t is token t+1: response tokens start at p
    row["token_keys"] = torch.zeros(n, dtype=torch.long)
    row["token_keys"][p - 1:] = s.sample_id * KEY_STRIDE + torch.arange(r)
    if s.loss_mask is not None:  # multi-turn: tool / environment tokens are masked targets
        if len(s.loss_mask) != r:
            raise ValueError(f"sample {s.sample_id}: loss mask of {len(s.loss_mask)} for {r} response tokens")
        trained = torch.tensor(s.loss_mask, dtype=torch.bool)
        row["loss_mask"][p - 1:] = trained
        row["token_keys"][p - 1:] *= trained
    if with_engine_logp:
        if s.engine_logprobs is None or len(s.engine_logprobs) != r:
            raise ValueError("engine log-probs missing or of the wrong length for some samples")
        row["engine_logp"] = torch.zeros(n)
        row["engine_logp"][p - 1:] = torch.tensor(s.engine_logprobs, dtype=torch.float32)
    if with_routes:  # shapes checked up front (actor/routing_replay.check_sample_routes)
        r = s.routed_experts
        row["routes"] = torch.full((n, *r.shape[1:]), -1, dtype=ROUTES_DTYPE)
        row["routes"][n - r.shape[0]:] = r.to(ROUTES_DTYPE)
    return row


def _micro_batch(samples: Sequence[Sample], rows: List[Dict[str, Tensor]], width: int,
                 packed: Optional[PackedRow] = None) -> MicroBatch:
    cols = {name: pad_stack([r[name] for r in rows], width, pad) for name, pad in ROW_FIELDS.items()
            if name in rows[0]}
    return MicroBatch(**cols, advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32),
                      sample_ids=torch.tensor([s.sample_id for s in samples], dtype=torch.long),
                      group_ids=torch.tensor([s.group_id for s in samples], dtype=torch.long), packed=packed,
                      seq_lens=torch.tensor([s.num_tokens - 1 for s in samples], dtype=torch.long))


def collate(samples: Sequence[Sample], with_engine_logp: bool = False, pad_multiple: int = 1,
            with_routes: bool = False) -> MicroBatch:
    """Right-padded ``MicroBatch`` of ``samples`` (see ``MicroBatch`` for the alignment), its
    length rounded up to a multiple of ``pad_multiple`` (``sequence_pad_multiple``); positions
    run on through the padding."""
    rows = [sample_row(s, with_engine_logp, with_routes) for s in samples]
    width = -(-max(r["input_ids"].numel() for r in rows) // pad_multiple) * pad_multiple
    mb = _micro_batch(samples, rows, width)
    mb.position_ids = torch.arange(width).unsqueeze(0).expand(len(rows), width).contiguous()
    return mb


def slot_chunks(slot: int, cp: int, cp_rank: int) -> Tensor:
    """Positions within a slot of ``slot`` tokens that CP rank ``cp_rank`` holds: chunks
    ``cp_rank`` and ``2*cp-1-cp_rank`` of ``2*cp`` (all of it without CP)."""
    if cp == 1:
        return torch.arange(slot)
    c = slot // (2 * cp)
    return torch.cat([torch.arange(cp_rank * c, (cp_rank + 1) * c),
                      torch.arange((2 * cp - 1 - cp_rank) * c, (2 * cp - cp_rank) * c)])


def collate_packed(samples: Sequence[Sample], with_engine_logp: bool = False, pad_multiple: int = 1,
                   cp: int = 1, cp_rank: int = 0, with_routes: bool = False) -> MicroBatch:
    """``MicroBatch`` whose model input is one packed row (``types.PackedRow``).

    Each sequence gets a slot of its tokens rounded up to ``2*cp`` (under CP); the last slot also
    takes the padding that rounds the row to ``pad_multiple`` (a multiple of ``2*cp``,
    ``sequence_pad_multiple``). This rank keeps its two chunks of every slot (TE's THD split).
    The ``[B, L]`` fields hold, per sequence, the same tokens in the same order.
    """
    if cp > 1 and pad_multiple % (2 * cp):
        raise ValueError(f"pad_multiple {pad_multiple} is not a multiple of 2*cp = {2 * cp}")
    rows = [sample_row(s, with_engine_logp, with_routes) for s in samples]
    lens = [r["input_ids"].numel() for r in rows]
    unit = 2 * cp if cp > 1 else 1
    slots = [-(-n // unit) * unit for n in lens]
    slots[-1] += -sum(slots) % pad_multiple
    local, index, offset = [], [], 0
    for row, slot in zip(rows, slots):
        keep = slot_chunks(slot, cp, cp_rank)
        padded = {name: torch.cat([x, torch.full((slot - x.shape[0], *x.shape[1:]), ROW_FIELDS[name], dtype=x.dtype)])
                  for name, x in row.items()}
        padded["position_ids"] = torch.arange(slot)
        local.append({name: x[keep] for name, x in padded.items()})
        index.append(torch.arange(offset, offset + keep.numel()))
        offset += keep.numel()
    width = max(i.numel() for i in index)
    packed = PackedRow(**{name: torch.cat([r[name] for r in local]).unsqueeze(0)
                          for name in ("input_ids", "position_ids", "targets")},
                       index=pad_stack(index, width), seq_lens=tuple(lens), slot_lens=tuple(slots))
    return _micro_batch(samples, local, width, packed)


def cp_slice(mb: MicroBatch, cp: int, cp_rank: int) -> MicroBatch:
    """This context-parallel rank's part of every ``[B, L]`` field, Megatron's load-balanced way.

    The padded length is split into ``2*cp`` chunks and rank ``r`` keeps chunks ``r`` and
    ``2*cp-1-r`` (causal attention cost then balances across ranks). ``position_ids`` are
    sliced like the rest, so they keep their global values. ``[B]`` fields are unchanged;
    ``[B, L, ...]`` ones (``routes``) are sliced along ``L``.
    """
    if cp == 1:
        return mb
    b, width = mb.loss_mask.shape
    chunk = -(-width // (2 * cp))
    padded = chunk * 2 * cp
    keep = torch.cat([torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk)])
    for name, value in list(vars(mb).items()):
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (b, width):
            if name == "position_ids":
                full = torch.arange(padded).unsqueeze(0).expand(b, padded)
            else:
                full = torch.full((b, padded, *value.shape[2:]), ROW_FIELDS.get(name, 0), dtype=value.dtype)
                full[:, :width] = value
            setattr(mb, name, full[:, keep].contiguous())
    return mb


def plan_rank_batches(samples: Sequence[Sample], *, mini_batches: int, dp_rank: int, dp_size: int,
                      token_budget: int, max_rows: Optional[int] = None,
                      with_engine_logp: bool = False, cp: int = 1, cp_rank: int = 0,
                      pad_multiple: int = 1, packed: bool = False,
                      with_routes: bool = False) -> List[List[MicroBatch]]:
    """This DP rank's micro-batches for each mini-batch of the step, this CP rank's part of each,
    padded to a multiple of ``pad_multiple`` (``sequence_pad_multiple``): packed rows with
    ``packed`` (``collate_packed``), else padded rows (``collate`` + ``cp_slice``); with
    ``with_routes`` each carries its samples' routed experts (``MicroBatch.routes``)."""
    out = []
    for mini in split_mini_batches(samples, mini_batches):
        mine = assign_data_parallel(mini, dp_size)[dp_rank]
        groups = pack_micro_batches(mine, token_budget, max_rows, packed=packed)
        if packed:
            out.append([collate_packed(g, with_engine_logp, pad_multiple, cp, cp_rank, with_routes) for g in groups])
        else:
            out.append([cp_slice(collate(g, with_engine_logp, pad_multiple, with_routes), cp, cp_rank)
                        for g in groups])
    return out
