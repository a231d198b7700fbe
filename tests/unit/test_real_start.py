"""Study v3's start measurement (demo/real_start.py): its GRPO advantages follow algorithms.md."""

import pytest

from megatron_stare.demo.real_start import grpo_advantages


def test_grpo_advantages_hand_case():
    assert grpo_advantages([1, 0, 0, 0]) == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)
    assert grpo_advantages([1, 1, 1, 1]) == [0.0] * 4
    assert grpo_advantages([1]) == [1.0]  # singleton: mean 0, std 1
