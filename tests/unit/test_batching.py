"""Micro-batch planning: whole groups per mini-batch, DP balance, token budget, alignment of
targets and loss mask, padding to the sequence-parallel multiple, Megatron's load-balanced
context-parallel slicing, and packed rows (real-token budget, per-sequence positions, TE's THD
split over context-parallel ranks)."""

import torch

from megatron_stare.actor.batching import (assign_data_parallel, collate, collate_packed, cp_slice, pack_micro_batches,
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


def test_packed_micro_batches_count_real_tokens():
    samples = synthetic_samples(groups=4, n=4)
    packed = pack_micro_batches(samples, token_budget=64, packed=True)
    assert sorted(s.sample_id for g in packed for s in g) == [s.sample_id for s in samples]
    for group in packed:
        assert len(group) == 1 or sum(s.num_tokens - 1 for s in group) <= 64
        assert [s.sample_id for s in group] == sorted(s.sample_id for s in group)
    assert len(packed) < len(pack_micro_batches(samples, token_budget=64))
    assert all(len(g) <= 2 for g in pack_micro_batches(samples, token_budget=10 ** 6, max_rows=2, packed=True))


def test_collate_packed_puts_sequences_end_to_end_with_their_own_positions():
    samples = synthetic_samples(groups=2, n=2)
    rows = collate(samples)
    mb = collate_packed(samples, pad_multiple=8)
    row = mb.packed
    lens = [s.num_tokens - 1 for s in samples]
    assert row.seq_lens == tuple(lens) and row.input_ids.shape == (1, sum(row.slot_lens))
    assert sum(row.slot_lens) % 8 == 0 and row.slot_lens[:-1] == tuple(lens[:-1])  # only the row is padded
    starts = [0] + list(torch.tensor(row.slot_lens).cumsum(0)[:-1].tolist())
    for i, (n, start) in enumerate(zip(lens, starts)):
        assert torch.equal(row.position_ids[0, start:start + n], torch.arange(n))
        assert torch.equal(row.targets[0, row.index[i, :n]], rows.targets[i, :n])
        for name in ("input_ids", "targets", "loss_mask", "token_keys"):
            assert torch.equal(getattr(mb, name)[i, :n], getattr(rows, name)[i, :n]), name
    assert mb.model_shape == (1, sum(row.slot_lens)) and mb.shape[0] == len(samples)


def test_collate_packed_splits_every_sequence_over_context_parallel_ranks():
    samples = synthetic_samples(groups=2, n=2)
    cp = 2
    parts = [collate_packed(samples, pad_multiple=sequence_pad_multiple(2, cp, True), cp=cp, cp_rank=r)
             for r in range(cp)]
    slots = parts[0].packed.slot_lens
    assert all(s % (2 * cp) == 0 for s in slots) and sum(slots) % 8 == 0
    full = collate(samples)
    for i, s in enumerate(samples):
        rebuilt = torch.zeros(slots[i], dtype=torch.long)
        for r, part in enumerate(parts):
            pos, c = part.position_ids[i], slots[i] // (2 * cp)
            # Rank r holds chunks r and 2cp-1-r of the slot, in the row and in the [B, L] fields.
            expect = torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((2 * cp - 1 - r) * c, (2 * cp - r) * c)])
            assert torch.equal(pos[:2 * c], expect)
            assert torch.equal(part.packed.targets[0, part.packed.index[i, :2 * c]], part.targets[i, :2 * c])
            rebuilt[pos[:2 * c]] = part.targets[i, :2 * c]
        n = s.num_tokens - 1
        assert torch.equal(rebuilt[:n], full.targets[i, :n]) and not rebuilt[n:].any()
    keys = sorted(k for part in parts for k in part.token_keys[part.loss_mask].tolist())
    assert keys == sorted(full.token_keys[full.loss_mask].tolist())
