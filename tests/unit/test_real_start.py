"""Study v3's start measurement (demo/real_start.py): its GRPO advantages follow algorithms.md."""

import pytest

from megatron_stare.demo.real_start import grpo_advantages


def test_grpo_advantages_hand_case():
    assert grpo_advantages([1, 0, 0, 0]) == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)
    assert grpo_advantages([1, 1, 1, 1]) == [0.0] * 4
    assert grpo_advantages([1]) == [1.0]  # singleton: mean 0, std 1


def test_token_stats_match_a_forward_of_each_sequence_alone(tmp_path):
    """The padded teacher-forced batch gives each response token the entropy and surprisal of
    softmax(logits / T) at its own position, as a forward of that sequence alone does."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_stare.demo.real_start import token_stats
    from megatron_stare.models.tiny import build_tiny_hf_model

    model = AutoModelForCausalLM.from_pretrained(build_tiny_hf_model("llama", tmp_path / "m", seed=0)).eval()
    prompt, responses, temp = [5, 9, 3], [[7, 8, 2, 4, 1], [6], [11, 12, 13]], 0.7
    got = token_stats(model, prompt, responses, temp)
    for r, (ent, surprisal) in zip(responses, got):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + r])).logits[0].float() / temp
        lp = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
        torch.testing.assert_close(ent, -(lp.exp() * lp).sum(-1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(surprisal, -lp[torch.arange(len(r)), torch.tensor(r)], rtol=1e-5, atol=1e-5)
        assert ent.shape == (len(r),)
