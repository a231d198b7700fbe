"""Environments: the calculator tool task (a real restricted evaluator), tool failures as error
observations, and the registry by name or dotted path with one-line errors."""

from __future__ import annotations

import time

import pytest

from megatron_stare.envs import CalculatorEnv, EnvError, ToolFailure, get_env_class, make_env, safe_eval
from megatron_stare.testing.hf_models import build_tiny_hf_model


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    import transformers

    d = build_tiny_hf_model("qwen2", tmp_path_factory.mktemp("envtok") / "m")
    return transformers.AutoTokenizer.from_pretrained(str(d))


def test_safe_eval_computes_and_refuses():
    assert safe_eval("2*(3+4)**2 - 10/4") == 2 * (3 + 4) ** 2 - 10 / 4
    assert safe_eval("-7 // 2 + 9 % 4") == -7 // 2 + 9 % 4
    for bad, why in [("__import__('os')", "unsupported"), ("x + 1", "unsupported"), ("1/0", "division by zero"),
                     ("2**100000", "exponent"), ("1 +", "syntax"), ("+".join(["1"] * 300), "timed out"),
                     ("10**15*10**15", "out of range")]:
        with pytest.raises(ToolFailure, match=why):
            safe_eval(bad)


def test_calculator_turns(tokenizer):
    env = make_env("calculator", tokenizer)
    env.reset([1, 2], answer="42")
    call = env.step(tokenizer.encode("let me compute <calc>6*7</calc>", add_special_tokens=False))
    assert (call.tool_call, call.tool_error, call.done, call.reward) == (True, False, False, 0.0)
    # The observation is the encoding of the result text, nothing else.
    assert call.observation == tokenizer.encode("<result>42</result>", add_special_tokens=False)
    err = env.step(tokenizer.encode("<calc>6/0</calc>", add_special_tokens=False))
    assert (err.tool_call, err.tool_error, err.done) == (True, True, False)
    assert tokenizer.decode(err.observation) == "<error>division by zero</error>"
    final = env.step(tokenizer.encode("so <answer>42</answer>", add_special_tokens=False))
    assert (final.done, final.reward, final.observation) == (True, 1.0, [])
    wrong = env.step(tokenizer.encode("it is 41", add_special_tokens=False))
    assert (wrong.done, wrong.reward) == (True, 0.0)


class _SlowTool(CalculatorEnv):
    def run_tool(self, expr):
        time.sleep(5)
        return "never"


class _BuggyTool(CalculatorEnv):
    def run_tool(self, expr):
        raise KeyError(expr)


def test_tool_timeout_and_crash_become_error_observations(tokenizer):
    """A wall-clock timeout and a tool's own exception: error observations, the run goes on."""
    turn = tokenizer.encode("<calc>1+1</calc>", add_special_tokens=False)
    slow = _SlowTool(tokenizer, time_limit_s=0.2)
    t0 = time.perf_counter()
    res = slow.step(turn)
    assert time.perf_counter() - t0 < 3
    assert (res.tool_error, res.done) == (True, False)
    assert tokenizer.decode(res.observation) == "<error>timed out after 0.2 s</error>"
    res = _BuggyTool(tokenizer).step(turn)
    assert (res.tool_error, tokenizer.decode(res.observation)) == (True, "<error>KeyError</error>")
    # Budget "timeouts" are deterministic: the same observation every time.
    env = CalculatorEnv(tokenizer, max_ops=3)
    long = tokenizer.encode("<calc>1+1+1+1+1</calc>", add_special_tokens=False)
    assert env.step(long).observation == env.step(long).observation
    assert tokenizer.decode(env.step(long).observation) == "<error>timed out (over 3 operations)</error>"


def test_registry_by_name_and_dotted_path():
    assert get_env_class("calculator") is CalculatorEnv
    assert get_env_class("megatron_stare.testing.envs:EchoToolEnv").__name__ == "EchoToolEnv"
    assert get_env_class("megatron_stare.testing.envs.EchoToolEnv").__name__ == "EchoToolEnv"
    for spec, msg in [("nope", "unknown environment 'nope'; registered: calculator"),
                      ("no_such_mod:Env", "cannot import 'no_such_mod:Env'"),
                      ("megatron_stare.envs:Missing", "has no attribute 'Missing'")]:
        with pytest.raises(EnvError, match=msg) as e:
            get_env_class(spec)
        assert "\n" not in str(e.value) and str(e.value).startswith("rollout.multi_turn.env: ")
    with pytest.raises(EnvError, match="env_options: 'calculator' rejects them"):
        make_env("calculator", None, {"bogus": 1})
