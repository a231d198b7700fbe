"""The word-problem task (megatron_stare/study/word_problems.py): answer extraction and the split."""

import pytest

from megatron_stare.study.word_problems import (DEFAULT_TIERS, INSTRUCTION, STUDY_TIERS, TIERS, compute_score,
                                                extract_answer, make_rows)


@pytest.mark.parametrize("text, expected", [
    # 1. \boxed{} wins over everything, its last number; the last box when several.
    ("3 + 4 = 7, so \\boxed{7}. Later I had 9.", 7),
    ("\\boxed{5} no wait \\boxed{1,200}", 1200),
    ("The answer is 3. \\boxed{8}", 8),
    # 2. an explicit answer statement wins over later talk and later numbers ...
    ("The answer is 12. To check, 12 - 5 = 7 and 7 + 5 = 12 again, so 4 more steps.", 12),
    ("Answer: 6\nI hope this helps with your 2 questions.", 6),
    ("So Ava has 8 apples.\nThe answer is: 8", 8),
    ("The final answer = 15. Let me know if you have 3 more.", 15),
    # ... its first number that is not an operand, or the result of an equation in its sentence ...
    ("The answer is: Ava has 7 apples. She had 3 before.", 7),
    ("The answer is 3 + 4 = 7. Then 9.", 7),
    ("The answer is 5.5. Later 6.", 5.5),
    # ... and the last statement wins when there are several.
    ("My first answer was 4. Checking again, the correct answer is 5. Thanks for 2 tries.", 5),
    # "answer" without a statement ("To find the answer, ...") is no statement.
    ("To find the answer, we add 3 and 4. 3 + 4 = 7", 7),
    # 3. the last equation's result, not an operand of a later expression and not a later number.
    ("15 - 12 = 3 books left. To find out how many books Emma has now, we can calculate 4", 3),
    ("3 + 4 = 7 + 2 = 9 apples. She has 2 friends.", 9),
    ("12 + 2 = 14", 14),
    ("5 x 2 = 10 cookies, then 10 - 3 = 7. Emma shares with 2 friends.", 7),
    ("The total is 1,200 = 1,200 coins for 3 days.", 1200),
    ("-3 + 1 = -2", -2),
    # 4. the last number when nothing else says which.
    ("Ben had 4 and now has 9", 9),
    ("Ava has 1,000 coins.", 1000),
    ("no number at all", None),
    ("", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_compute_score_verl_signature():
    assert compute_score("word_problems", "3 + 4 = 7 apples. How many do I have? 2 friends help.", "7") == 1.0
    assert compute_score(data_source="word_problems", solution_str="The answer is 8.", ground_truth="7",
                         extra_info={"tier": 1}) == 0.0
    assert compute_score("word_problems", "I don't know.", "7") == 0.0
    assert compute_score("word_problems", "\\boxed{}", "7") == 0.0
    assert compute_score("word_problems", "7", "seven") == 0.0  # a malformed ground truth scores 0, no raise
    assert compute_score("word_problems", "The answer is 7.0", "7") == 1.0



def test_format_score_credits_a_wrong_answer_only_in_the_instructions_format():
    """verl's gsm8k habit: ``format_score`` for a wrong answer in the format the instruction asks
    (the response ends with its number), 1.0 for a right one however written, 0 otherwise."""
    from megatron_stare.study.word_problems import FORMAT_SCORE, compute_score_format, ends_with_number

    formatted = ["The answer is 8.", "So 3 + 4 = 8", "\\boxed{8}", "Ava has **8**", "answer: $8$", "It is 8!"]
    unformatted = ["8 apples.", "The answer is 8, I think", "I think 8 and then I", "no number here", "\\boxed{}",
                   "The answer is 8. Now let us count the apples again and again and"]   # cut off mid-text
    for text in formatted:
        assert ends_with_number(text), text
        assert compute_score("word_problems", text, "7", format_score=0.25) == 0.25
        assert compute_score_format("word_problems", text, "7") == {"score": FORMAT_SCORE, "acc": 0.0}
        assert compute_score("word_problems", text, "7") == 0.0          # off by default
        assert compute_score("word_problems", text, "8", format_score=0.25) == 1.0
    for text in unformatted:
        assert not ends_with_number(text), text
        assert compute_score("word_problems", text, "7", format_score=0.25) == 0.0
    assert FORMAT_SCORE == 0.2
    # A right answer without the format still scores 1.
    assert compute_score_format("word_problems", "3 + 4 = 7 apples.", "7") == {"score": 1.0, "acc": 1.0}
    assert compute_score_format("word_problems", "The answer is 8.", "seven")["score"] == FORMAT_SCORE  # bad truth


def test_tiers_and_disjoint_split():
    assert TIERS == {0: 0, 1: 1, 2: 1, 3: 2, 4: 3}
    # Tier 0: bare single-digit sums; tier 1: one-step word problems with single-digit operands.
    for r in make_rows("test", 16, 0, tiers=(0,)):
        q = r["prompt"][0]["content"].rsplit(" " + INSTRUCTION, 1)[0]
        a, b = (int(x) for x in q.removeprefix("What is ").rstrip("?").split(" + "))
        assert 1 <= a <= 9 and 1 <= b <= 9 and r["reward_model"]["ground_truth"] == str(a + b)
    for r in make_rows("test", 48, 0, tiers=(1,)):
        q = r["prompt"][0]["content"].rsplit(" " + INSTRUCTION, 1)[0]
        nums = [int(t.rstrip(".")) for t in q.split() if t.rstrip(".").isdigit()]
        assert len(nums) <= 2 and all(1 <= n <= 9 for n in nums), q
        assert q.count("Then ") == 1
    # Train and held-out are disjoint (sums included: they are partitioned), for any mix.
    for tiers in (STUDY_TIERS, DEFAULT_TIERS, (0, 1, 2, 3, 4)):
        train = make_rows("train", 512, 0, tiers=tiers)
        seen = {r["prompt"][0]["content"] for r in train}
        test = make_rows("test", 64, 0, tiers=tiers, exclude={c.rsplit(" " + INSTRUCTION, 1)[0] for c in seen})
        assert not seen & {r["prompt"][0]["content"] for r in test}
        assert [r["extra_info"]["tier"] for r in train[:len(tiers)]] == list(tiers)
        assert make_rows("test", 64, 0, tiers=tiers) == make_rows("test", 64, 0, tiers=tiers)
    # Train's 64 sums repeat only once each has appeared.
    sums = [r["prompt"][0]["content"] for r in make_rows("train", 200, 0, tiers=(0,))]
    assert len(set(sums[:64])) == 64 and len(set(sums)) == 64


def test_bad_tiers_are_one_clear_error():
    with pytest.raises(ValueError, match="tiers must be some of"):
        make_rows("train", 4, 0, tiers=(5,))
    with pytest.raises(ValueError, match="tiers must be some of"):
        make_rows("train", 4, 0, tiers=())
