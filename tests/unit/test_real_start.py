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


def test_quadrants_count_tokens_by_advantage_sign_and_surprisal(tmp_path):
    """Hand case: one group of two responses with rewards [1, 0] (A = +0.707, -0.707) and one
    all-equal group (A = 0, no quadrant); counts are (tokens, tokens with surprisal > entropy).
    ``rescore`` of the same samples from a dump gives the same figures."""
    import json

    from megatron_stare.demo.real_start import quadrants, rescore

    counts = [[(3, 2), (2, 1)], [(1, 1), (1, 1)]]
    got = quadrants([[1.0, 0.0], [0.1, 0.1]], counts, ["0", "1"])
    assert got["mixed_groups"] == 0.5
    assert got["frac_pos_high_of_all_tokens"] == pytest.approx(2 / 7)       # of 7 response tokens
    assert got["frac_pos_high_of_nonzero_A"] == pytest.approx(2 / 5)        # of the 5 with A != 0
    assert got["frac_pos_low_of_nonzero_A"] == pytest.approx(1 / 5)
    assert got["frac_neg_high_of_nonzero_A"] == pytest.approx(1 / 5)
    assert got["frac_neg_low_of_nonzero_A"] == pytest.approx(1 / 5)
    assert got["by_tier_tokens"] == {"0": {"tokens": 5.0, "pos_high": 2.0}, "1": {"tokens": 2.0, "pos_high": 0.0}}
    # A reward that makes the second group mixed moves its tokens into the quadrants.
    second = quadrants([[1.0, 0.0], [0.1, 0.0]], counts, ["0", "1"])
    assert second["mixed_groups"] == 1.0 and second["frac_pos_high_of_all_tokens"] == pytest.approx(3 / 7)

    dump = tmp_path / "d.jsonl"
    texts = [["7", "8"], ["The answer is 5.", "five"]]
    dump.write_text("".join(json.dumps({"prompt": i, "tier": str(i), "ground_truth": ["7", "4"][i], "text": t,
                                        "tokens": c[0], "high": c[1]}) + "\n"
                            for i in (1, 0) for t, c in zip(texts[i], counts[i])))   # order-free
    exact = rescore(str(dump), lambda text, gt: float(text == gt))
    assert {k: exact[k] for k in got} == got and exact["reward_mean"] == 0.25
    fmt = rescore(str(dump), lambda text, gt: float(text == gt) or 0.1 * text.startswith("The answer"))
    assert {k: fmt[k] for k in second} == second
