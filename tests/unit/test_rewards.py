"""Rewards: registry and dotted paths, math-verify scoring, hostile inputs, the pool, shaping, tasks."""

import json
import signal
import time

import pytest
import torch

from megatron_stare.config.load import RewardConfig
from megatron_stare.rewards import registry
from megatron_stare.rewards import (HARD_KILL_GRACE_S, ExactMatch, MathVerifyReward, RewardError, RewardPool,
                                    exact_match, extract_after_marker, extract_boxed, get_reward_fn, make_task,
                                    math_reward, register_reward, shape_overlong, write_jsonl)
from megatron_stare.rewards.registry import RewardTimeout, deadline

TIMEOUT = 1.0
HOSTILE = [
    "\\boxed{" * 10000,
    "1" * 10**6,
    "The answer is " + "1" * 10**6,
    "9**9**9**9",
    "The answer is 9**9**9**9",
    "\\boxed{9^{9^{9^{9}}}}",
    "Answer: " + "(" * 5000 + ")" * 5000,
    "\\boxed{" + "{" * 5000 + "}" * 5000 + "}",
    "\\boxed{\\frac{\\frac{\\frac{\\frac{1}{2}}{3}}{4}}{" + "\\sqrt{" * 300 + "}" * 300 + "}",
]


# ------------------------------------------------------------------------------------------------ registry
def test_registry_names_and_dotted_paths():
    assert get_reward_fn("math") is math_reward
    assert get_reward_fn("exact_match") is exact_match
    assert get_reward_fn("json:dumps") is json.dumps
    assert get_reward_fn("json.dumps") is json.dumps
    assert get_reward_fn("os:path.join").__name__ == "join"  # a dotted attribute after ':'


@pytest.mark.parametrize("spec, msg", [
    ("foo.bar:baz", "reward.fn: cannot import 'foo.bar:baz' (No module named 'foo')"),
    ("json:nope", "reward.fn: cannot import 'json:nope' (json has no attribute 'nope')"),
    ("json.nope", "reward.fn: cannot import 'json.nope' (json has no attribute 'nope')"),
    ("os:sep", "reward.fn: 'os:sep' is not callable (it is a str)"),
    ("mathh", "reward.fn: unknown reward 'mathh'; registered: exact_match, hop_path, math, pick_sum, sum_steps"),
    (":f", "reward.fn: ':f' is not of the form 'pkg.module:function'"),
])
def test_registry_errors_are_one_line(spec, msg):
    with pytest.raises(RewardError) as e:
        get_reward_fn(spec)
    assert str(e.value).startswith(msg) and "\n" not in str(e.value)


def test_a_bare_source_tree_names_the_missing_install(monkeypatch):
    """The study's tasks register through setup.py's entry points: without the package installed
    (a source tree on PYTHONPATH) they are unknown, and the error says why and what to run."""
    import importlib.metadata

    from megatron_stare.config import dotted

    with pytest.raises(RewardError) as installed:
        get_reward_fn("mathh")
    assert "pip install" not in str(installed.value)  # installed here: no hint

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(dotted, "_entry_points", lambda group: {})
    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(RewardError) as e:
        get_reward_fn("pick_sum")
    assert str(e.value) == ("reward.fn: unknown reward 'pick_sum'; registered: exact_match, math; or give a function as "
                            "'pkg.module:function' (megatron-stare is not installed, so the names its setup.py "
                            "registers, the study's tasks among them, are missing: pip install -e .)")
    with pytest.raises(ValueError, match=r"got 'pick_sum' \(megatron-stare is not installed.*pip install -e \.\)"):
        make_task("pick_sum", 1, seed=0)


def test_register_twice_rejected():
    with pytest.raises(ValueError, match="registered twice"):
        register_reward("math")(lambda r, a, m: 0.0)


# ------------------------------------------------------------------------------------------------ math
def test_extraction():
    assert extract_boxed("a \\boxed{1} then \\boxed{\\frac{1}{2}} end") == "\\frac{1}{2}"
    assert extract_boxed("\\boxed 7.") == "7"
    assert extract_boxed("\\fbox{x}") == "x"
    assert extract_boxed("\\boxed{unclosed") is None and extract_boxed("no box") is None
    assert extract_after_marker("so the answer is: $42$.\nthanks") == "42"
    assert extract_after_marker("Answer: 3\nblah\n#### 5") == "5"
    assert extract_after_marker("The final answer is 7") == "7"
    assert extract_after_marker("nothing here") is None


@pytest.mark.parametrize("response, answer, expected", [
    ("We get \\boxed{\\frac{1}{2}}.", "1/2", 1.0),
    ("so \\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("The answer is 0.5.", "1/2", 1.0),
    ("Answer: $\\frac{1}{2}$", "0.5", 1.0),
    ("#### 42", "42", 1.0),
    ("first \\boxed{3} then \\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("\\boxed{4}", "5", 0.0),
    ("The answer is 0.25", "1/2", 0.0),
    ("#### 3", "$3$", 1.0),
    ("I think it is 42", "42", 0.0),  # no box, no marker: no final answer
    ("", "1", 0.0),
])
def test_math_reward(response, answer, expected):
    assert math_reward(response, answer, {}) == expected


def test_hostile_inputs_inline_bounded():
    with RewardPool(RewardConfig(fn="math", timeout_s=TIMEOUT, num_workers=0)) as pool:
        for text in HOSTILE:
            t0 = time.monotonic()
            assert pool.score([text], ["3"]) == [0.0]
            assert time.monotonic() - t0 < 3 * TIMEOUT + 1.0, text[:40]


class _SlowFinalizer:
    def __del__(self):
        time.sleep(3)  # the deadline fires in here; the interpreter prints its raise and drops it


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_deadline_survives_a_raise_the_interpreter_drops():
    t0 = time.monotonic()
    with pytest.raises(RewardTimeout):
        with deadline(0.2):
            obj = _SlowFinalizer()
            del obj  # __del__ runs now; its RewardTimeout is "ignored" by the interpreter
            time.sleep(10)  # without a re-fire, nothing would interrupt this
    assert time.monotonic() - t0 < 6.0
    assert signal.getsignal(signal.SIGALRM) is not registry._on_deadline  # the block restored the handler
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # and left no timer armed


def test_math_reward_bounds_itself_when_called_directly():
    fn = MathVerifyReward(timeout_s=TIMEOUT)
    t0 = time.monotonic()
    assert fn("\\boxed{9^{9^{9^{9}}}}", "3", {}) == 0.0
    assert time.monotonic() - t0 < 3 * TIMEOUT + 1.0


def test_exact_match():
    assert exact_match("Answer: 42", "42", {}) == 1.0
    assert exact_match("  42 \n", "42", {}) == 1.0
    assert exact_match("Answer: 43", "42", {}) == 0.0
    assert ExactMatch(whole_response_fallback=False)("42", "42", {}) == 0.0
    assert ExactMatch(markers=("=",))("1+1 = 2", "2", {}) == 1.0


# ------------------------------------------------------------------------------------------------ pool
def test_pool_matches_inline_in_order():
    responses = [f"\\boxed{{{i}}}" if i % 3 else f"Answer: {i}" for i in range(12)] + HOSTILE[:2] + [HOSTILE[5]]
    answers = [str(i if i % 2 else i + 1) for i in range(12)] + ["3"] * 3
    metas = [{"i": i} for i in range(len(responses))]
    with RewardPool(RewardConfig(fn="math", timeout_s=TIMEOUT, num_workers=0)) as pool:
        inline = pool.score(responses, answers, metas)
    with RewardPool(RewardConfig(fn="math", timeout_s=TIMEOUT, num_workers=2)) as pool:
        fut = pool.submit(responses, answers, metas)
        assert fut.result(timeout=60) == inline
        assert fut.num_timeouts == 1  # the exponent tower hits the soft limit
        assert pool.score([], []) == []
    assert inline == [float(i % 2 == 1) for i in range(12)] + [0.0] * 3


_STUCK_MODULE = '''
import signal, time

def reward(response, answer, metadata):
    if response == "stuck":  # a C-level hang: no signal reaches Python code
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        time.sleep(120)
    if response == "raise":
        raise ValueError("bad verifier")
    return float(response == answer)
'''


def test_pool_kills_and_replaces_a_stuck_worker(tmp_path, monkeypatch):
    (tmp_path / "stuck_reward_mod.py").write_text(_STUCK_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))  # workers get the parent's sys.path
    cfg = RewardConfig(fn="stuck_reward_mod:reward", timeout_s=0.5, num_workers=1)
    with RewardPool(cfg) as pool:
        t0 = time.monotonic()
        fut = pool.submit(["a", "stuck", "b"], ["a", "stuck", "c"])
        assert fut.result(timeout=60) == [1.0, 0.0, 0.0]
        assert fut.num_timeouts == 1
        assert time.monotonic() - t0 < cfg.timeout_s + HARD_KILL_GRACE_S + 20  # + worker restarts
        assert pool.score(["x"], ["x"]) == [1.0]  # the replacement works
        with pytest.raises(RewardError, match="failed on response 1: ValueError: bad verifier"):
            pool.submit(["x", "raise"], ["x", "x"]).result(timeout=60)


_SLOW_MATH_MODULE = """
import time
from megatron_stare.rewards import math_reward

def reward(response, answer, metadata):
    if response == "slow":
        time.sleep(60)
    return math_reward(response, answer, metadata)
"""


def test_pool_replaces_a_killed_math_worker_and_survives_preemption_signals(tmp_path, monkeypatch, caplog):
    """A math-verify worker killed mid-call (SIGKILL): that response scores 0, the crash is
    counted and logged, a new worker takes its place; the others' scores are untouched. The
    trainer's preemption signals (SIGTERM, SIGUSR1, which torchrun sends to the trainer's whole
    process group) leave the workers alive."""
    import os
    import signal

    (tmp_path / "slow_math_mod.py").write_text(_SLOW_MATH_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = RewardConfig(fn="slow_math_mod:reward", timeout_s=120, num_workers=2)
    with RewardPool(cfg) as pool, caplog.at_level("WARNING"):
        assert pool.score(["\\boxed{2}", "\\boxed{3}"], ["2", "2"]) == [1.0, 0.0]  # both ready
        pids = [w.proc.pid for w in pool._workers]
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
            os.kill(pid, signal.SIGUSR1)
        assert pool.score(["\\boxed{2}", "\\boxed{3}"], ["2", "3"]) == [1.0, 1.0]
        assert [w.proc.pid for w in pool._workers] == pids and all(w.proc.poll() is None for w in pool._workers)
        fut = pool.submit(["\\boxed{4}", "slow", "Answer: 5", "\\boxed{6}"], ["4", "slow", "5", "7"])
        deadline = time.monotonic() + 60
        while not any(w.job is not None and w.job[1] == 1 for w in pool._workers):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        victim = next(w for w in pool._workers if w.job is not None and w.job[1] == 1)
        os.kill(victim.proc.pid, signal.SIGKILL)
        assert fut.result(timeout=60) == [1.0, 0.0, 1.0, 0.0]
        assert fut.num_crashes == 1 and fut.num_timeouts == 0
        assert f"worker {victim.proc.pid} died (exit code -9); restarting it" in caplog.text
        assert pool.score(["\\boxed{8}"] * 3, ["8"] * 3) == [1.0] * 3  # the replacement scores
        assert victim not in pool._workers and len(pool._workers) == 2


def test_pool_rejects_bad_fn_and_mismatched_lengths():
    with pytest.raises(RewardError, match="cannot import"):
        RewardPool(RewardConfig(fn="nope.nope:f", num_workers=0))
    with RewardPool(RewardConfig(fn="exact_match", num_workers=0)) as pool:
        with pytest.raises(RewardError, match="2 responses, 1 answers"):
            pool.submit(["a", "b"], ["a"])


# ------------------------------------------------------------------------------------------------ shaping
def test_overlong_shaping():
    cfg = RewardConfig(overlong_buffer_len=4096, overlong_penalty_factor=1.0)
    lengths = torch.tensor([100, 16384, 18432, 20480])
    out = shape_overlong([1.0, 1.0, 1.0, 1.0], lengths, max_len=20480, cfg=cfg)
    torch.testing.assert_close(out, torch.tensor([1.0, 1.0, 0.5, 0.0]))
    off = shape_overlong([1.0, 0.0], torch.tensor([20480, 20480]), 20480, RewardConfig(overlong_buffer_len=0))
    torch.testing.assert_close(off, torch.tensor([1.0, 0.0]))


# ------------------------------------------------------------------------------------------------ tasks
def test_synthetic_tasks(tmp_path):
    rows = make_task("add", 20, seed=3, digits=3)
    assert rows == make_task("add", 20, seed=3, digits=3) and rows != make_task("add", 20, seed=4, digits=3)
    for r in rows:
        a, b = r["prompt"][len("What is "):-len("? Answer:")].split(" + ")
        assert len(a) == len(b) == 3 and int(r["answer"]) == int(a) + int(b)
        assert exact_match(f" Answer: {r['answer']}", r["answer"], {}) == 1.0
    for r in make_task("sort", 10, seed=0, length=5):
        digits = r["prompt"].split("digits ")[1].split(" ascending")[0].split()
        assert r["answer"].split() == sorted(digits)
    for r in make_task("count", 10, seed=0):
        s = r["prompt"].split(" in ")[1].rstrip("? Answer:")
        assert int(r["answer"]) == s.count(r["prompt"].split("does ")[1][0])
    path = write_jsonl(rows, str(tmp_path / "d" / "train.jsonl"))
    assert [json.loads(line) for line in open(path)] == rows
    with pytest.raises(ValueError, match="synthetic task must be one of"):
        make_task("nope", 1, 0)
