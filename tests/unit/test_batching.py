"""Micro-batch planning: whole groups per mini-batch, DP balance, token budget, alignment of
targets and loss mask, padding to the sequence-parallel multiple, and Megatron's load-balanced
context-parallel slicing."""

import torch

from megatron_stare.batching import (assign_data_parallel, collate, cp_slice, pack_micro_batches,
                                     sequence_pad_multiple, split_mini_batches)
from megatron_stare.testing.actor_case import synthetic_samples
from megatron_stare.types import KEY_STRIDE


def test_collate_aligns_targets_mask_and_keys():
    s = synthetic_samples()[0]
    mb = collate([s])
    p, r = len(s.prompt_ids), len(s.response_ids)
    assert mb.loss_mask.sum() == r
    assert mb.targets[0][mb.loss_mask[0]].tolist() == s.response_ids
    assert mb.input_ids[0, : p + r - 1].tolist() == (s.prompt_ids + s.response_ids)[:-1]
    assert mb.token_keys[0][mb.loss_mask[0]].tolist() == [s.sample_id * KEY_STRIDE + j for j in range(r)]


def test_split_assign_pack():
    samples = synthetic_samples(groups=4, n=4)
    minis = split_mini_batches(samples, 2)
    assert [sorted({s.group_id for s in m}) for m in minis] == [[0, 1], [2, 3]]
    ranks = assign_data_parallel(minis[0], 2)
    assert sorted(s.sample_id for r in ranks for s in r) == sorted(s.sample_id for s in minis[0])
    loads = [sum(s.num_tokens for s in r) for r in ranks]
    assert max(loads) - min(loads) <= max(s.num_tokens for s in minis[0])
    for group in pack_micro_batches(samples, token_budget=64):
        width = max(s.num_tokens - 1 for s in group)
        assert len(group) == 1 or len(group) * width <= 64


def test_cp_slices_partition_and_reassemble():
    samples = synthetic_samples(groups=2, n=2)
    cp = 2
    full = collate(samples)
    parts = [cp_slice(collate(samples), cp, r) for r in range(cp)]
    width = full.loss_mask.shape[1]
    chunk = -(-width // (2 * cp))
    # Rank r holds chunks r and 2cp-1-r: put them back in order and compare with the original.
    rebuilt = torch.zeros(full.targets.shape[0], chunk * 2 * cp, dtype=full.targets.dtype)
    for r, part in enumerate(parts):
        rebuilt[:, r * chunk:(r + 1) * chunk] = part.targets[:, :chunk]
        rebuilt[:, (2 * cp - 1 - r) * chunk:(2 * cp - r) * chunk] = part.targets[:, chunk:]
    assert torch.equal(rebuilt[:, :width], full.targets)
    keys = sorted(k for part in parts for k in part.token_keys[part.loss_mask].tolist())
    assert keys == sorted(full.token_keys[full.loss_mask].tolist())
    assert parts[1].position_ids[0, 0].item() == chunk  # global positions survive the slicing


def test_sequence_pad_multiple():
    assert sequence_pad_multiple(8) == 1  # TP without sequence parallel splits no sequence
    assert sequence_pad_multiple(8, sequence_parallel=True) == 8
    assert sequence_pad_multiple(1, cp=2) == 4
    assert sequence_pad_multiple(8, cp=2, sequence_parallel=True) == 32


def test_padding_to_the_multiple_is_masked_and_leaves_real_tokens_alone():
    samples = synthetic_samples(groups=2, n=2)
    plain = collate(samples, with_engine_logp=False)
    width = plain.loss_mask.shape[1]
    multiple = 8 if width % 8 else 16  # make sure some padding is added
    padded = collate(samples, pad_multiple=multiple)
    assert padded.loss_mask.shape[1] % multiple == 0 and padded.loss_mask.shape[1] > width
    for name in ("input_ids", "position_ids", "targets", "loss_mask", "token_keys"):
        assert torch.equal(getattr(padded, name)[:, :width], getattr(plain, name)), name
    assert not padded.loss_mask[:, width:].any() and not padded.token_keys[:, width:].any()
    assert torch.equal(padded.position_ids[0], torch.arange(padded.loss_mask.shape[1]))
