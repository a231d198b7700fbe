"""Advantage estimators and DAPO's overlong shaping / dynamic-sampling filter."""

import pytest
import torch

from megatron_stare.algorithms import AlgorithmConfig, compute_advantages
from megatron_stare.algorithms.advantages import first_groups, nonzero_variance_groups, overlong_penalty


def adv(rewards, groups, **cfg):
    return compute_advantages(torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups), AlgorithmConfig(**cfg))


def test_hand_case_grpo_and_dr_grpo():
    assert adv([1, 0, 0, 0], [0] * 4).tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], rel=1e-5)
    # exact with the 1e-6 epsilon: std = 0.5
    assert adv([1, 0, 0, 0], [0] * 4)[0].item() == pytest.approx(0.75 / (0.5 + 1e-6), rel=1e-15)
    expect = [0.75, -0.25, -0.25, -0.25]
    assert adv([1, 0, 0, 0], [0] * 4, adv_estimator="dr_grpo").tolist() == pytest.approx(expect)
    assert adv([1, 0, 0, 0], [0] * 4, norm_adv_by_std=False).tolist() == pytest.approx(expect)


def test_groups_are_independent_and_labels_arbitrary():
    a = adv([1, 0, 0, 0, 5, 5, 3], [7, 7, 7, 7, -2, -2, 9])
    assert a[:4].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], rel=1e-5)
    assert a[4:6].tolist() == [0.0, 0.0]  # equal rewards -> 0
    assert a[6].item() == pytest.approx(3.0)  # singleton: mean 0, std 1


def test_rloo():
    a = adv([1, 0, 0, 0, 2], [0, 0, 0, 0, 1], adv_estimator="rloo")
    assert a.tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3, 2.0])


def test_dtype_follows_rewards():
    r = torch.tensor([1.0, 0.0], dtype=torch.float32)
    assert compute_advantages(r, torch.zeros(2, dtype=torch.int64), AlgorithmConfig()).dtype == torch.float32
    assert compute_advantages(torch.tensor([1, 0]), torch.zeros(2, dtype=torch.int64), AlgorithmConfig()).dtype == torch.float32


def test_unknown_estimator_names_the_field():
    with pytest.raises(ValueError, match="algorithm.adv_estimator must be one of"):
        adv([1.0], [0], adv_estimator="gae")


def test_overlong_shaping_hand_case():
    lengths = torch.tensor([100, 16384, 18432, 20480])
    assert overlong_penalty(lengths, max_len=20480, buffer_len=4096).tolist() == [0.0, 0.0, -0.5, -1.0]
    assert overlong_penalty(lengths, max_len=20480, buffer_len=4096, factor=2.0)[2].item() == -1.0
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lengths, max_len=10, buffer_len=20)


def test_dynamic_sampling_filter_and_truncation():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0])
    g = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4])
    keep = nonzero_variance_groups(r, g)
    assert keep.tolist() == [False, False, True, True, False, False, True, True, True]
    assert first_groups(g, keep, 1).tolist() == [False, False, True, True, False, False, False, False, False]
    assert first_groups(g, keep, 10).tolist() == keep.tolist()
