"""STARE's global selection on multi-turn batches over 2 data-parallel ranks equals the
single-process reference, and neither picks a tool token (they have the highest surprisal)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_stare.algorithms import AlgorithmConfig, StareState
from megatron_stare.algorithms.stare import stare_global_selection, stare_weights
from megatron_stare.actor.batching import assign_data_parallel
from megatron_stare.testing.distributed import run_on_ranks
from megatron_stare.testing.masked_case import masked_case, masked_samples

pytestmark = pytest.mark.distributed


def _selected(samples, variant):
    """``(selected token keys, chosen tool tokens, k_pos, k_neg)`` of these samples' rows."""
    old_logp, adv, mask, keys, tool = masked_case(samples)
    cfg = AlgorithmConfig().stare
    cfg.variant, cfg.top_p = variant, 0.3
    sel = stare_global_selection(old_logp, adv, mask, keys, cfg)
    w = stare_weights(-old_logp, adv, mask, keys, cfg, StareState(True, 1.3, 0.6), sel)
    chosen = w.pos_selected | w.neg_selected
    return sorted(keys[chosen].tolist()), int((chosen & tool).sum()), sel.k_pos, sel.k_neg


def _worker(rank, world):
    # Each rank builds the global batch's values (the case is seeded over the whole batch) and
    # keeps its own rows, as the trainer's data-parallel deal gives them.
    samples = masked_samples(num=16, seed=3)
    mine = assign_data_parallel(samples, world)[rank]
    out = {}
    for variant in ("O1", "C2"):
        old_logp, adv, mask, keys, tool = masked_case(samples)
        rows = [s.sample_id for s in mine]
        cfg = AlgorithmConfig().stare
        cfg.variant, cfg.top_p = variant, 0.3
        sel = stare_global_selection(old_logp[rows], adv[rows], mask[rows], keys[rows], cfg, dp_group=dist.group.WORLD)
        w = stare_weights(-old_logp[rows], adv[rows], mask[rows], keys[rows], cfg, StareState(True, 1.3, 0.6), sel)
        chosen = w.pos_selected | w.neg_selected
        out[variant] = (sorted(keys[rows][chosen].tolist()), int((chosen & tool[rows]).sum()), sel.k_pos, sel.k_neg)
    return out


def test_two_ranks_select_what_one_process_selects():
    samples = masked_samples(num=16, seed=3)
    ranks = run_on_ranks(_worker, 2)
    for variant in ("O1", "C2"):
        ref_keys, ref_tool, k_pos, k_neg = _selected(samples, variant)
        assert ref_keys and ref_tool == 0
        got = sorted(ranks[0][variant][0] + ranks[1][variant][0])
        assert got == ref_keys
        assert all(r[variant][1] == 0 and r[variant][2:] == (k_pos, k_neg) for r in ranks)
        assert ranks[0][variant][0] and ranks[1][variant][0]  # both ranks hold selected tokens
