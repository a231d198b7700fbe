"""``calculator``: a tool task at CPU scale - the model calls a calculator to answer arithmetic.

Protocol (text inside the model's turn, parsed from its decoded tokens):

- ``<calc>EXPR</calc>`` calls the tool; the observation is ``<result>VALUE</result>`` or, when
  the expression is malformed, too costly or out of time, ``<error>WHY</error>`` (the
  trajectory goes on either way).
- a turn without a call is the final answer: ``<answer>N</answer>`` (else the turn's last
  number) is compared with the task's answer; reward 1.0 if equal, else 0.0, and done.

The tool is ``safe_eval``: an AST walker over numbers, ``+ - * / // % **`` and parentheses,
nothing else (no names, calls or attributes). Its limits are deterministic (an operation
budget, bounded magnitudes and exponents), so a run and its resume see the same observations;
a wall-clock ``time_limit_s`` (``rewards.registry.deadline``, main thread) backs them up.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from typing import Sequence

from megatron_stare.envs.base import EnvStep, Environment, register_env
from megatron_stare.rewards.registry import RewardTimeout, deadline

__all__ = ["CalculatorEnv", "ToolFailure", "safe_eval"]

CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNOPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class ToolFailure(Exception):
    """A tool call that cannot give a result; its message becomes the error observation."""


def safe_eval(expr: str, *, max_ops: int = 200, max_abs: float = 1e15, max_exponent: int = 64) -> float:
    """The value of an arithmetic expression, or ``ToolFailure`` (one line saying why).

    Deterministic limits: at most ``max_ops`` operators (else "timed out"), every intermediate
    ``|x| <= max_abs``, exponents ``|e| <= max_exponent`` (a huge power is one long C call no
    signal can interrupt, so it is refused before it starts).
    """
    if len(expr) > 10 * max_ops:
        raise ToolFailure("timed out (expression too long)")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        raise ToolFailure("syntax error") from None
    ops = 0

    def ev(node):
        nonlocal ops
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        ops += 1
        if ops > max_ops:
            raise ToolFailure(f"timed out (over {max_ops} operations)")
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(b) > max_exponent:
                raise ToolFailure(f"exponent {b} too large")
            try:
                x = _BINOPS[type(node.op)](a, b)
            except ZeroDivisionError:
                raise ToolFailure("division by zero") from None
        elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
            x = _UNOPS[type(node.op)](ev(node.operand))
        else:
            raise ToolFailure(f"unsupported {type(node).__name__}")
        if isinstance(x, complex) or not math.isfinite(x) or abs(x) > max_abs:
            raise ToolFailure("result out of range")
        return x

    return ev(tree)


def format_number(x: float) -> str:
    """Integers without a decimal point; other values to 6 significant digits."""
    return str(int(x)) if float(x).is_integer() else f"{x:.6g}"


@register_env("calculator")
class CalculatorEnv(Environment):
    """The calculator task (see the module docstring). Options: ``time_limit_s`` (wall clock
    per call), ``max_ops`` (the deterministic operation budget)."""

    def __init__(self, tokenizer=None, *, time_limit_s: float = 1.0, max_ops: int = 200):
        super().__init__(tokenizer)
        self.time_limit_s, self.max_ops = float(time_limit_s), int(max_ops)

    def run_tool(self, expr: str) -> str:
        """The tool's result as text; ``ToolFailure`` when it cannot give one."""
        return format_number(safe_eval(expr, max_ops=self.max_ops))

    def call_tool(self, expr: str) -> tuple:
        """``(observation text, failed)``: any failure of the tool (raised, timed out) becomes an
        error observation; the run never stops for it."""
        try:
            with deadline(self.time_limit_s):
                return f"<result>{self.run_tool(expr)}</result>", False
        except RewardTimeout:
            return f"<error>timed out after {self.time_limit_s:g} s</error>", True
        except ToolFailure as e:
            return f"<error>{e}</error>", True
        except Exception as e:  # a tool's own bug is an error observation too, not a dead run
            return f"<error>{type(e).__name__}</error>", True

    def step(self, turn_token_ids: Sequence[int]) -> EnvStep:
        text = self.decode(turn_token_ids)
        call = CALL.search(text)
        if call is not None:
            obs, failed = self.call_tool(call.group(1))
            return EnvStep(self.encode(obs), tool_call=True, tool_error=failed)
        return EnvStep([], reward=self.score(text), done=True)

    def score(self, text: str) -> float:
        """1.0 if the final answer equals the task's answer (as numbers), else 0.0."""
        tagged = ANSWER.search(text)
        nums = NUMBER.findall(tagged.group(1) if tagged else text)
        if not nums:
            return 0.0
        try:
            return float(float(nums[-1]) == float(self.answer))
        except ValueError:
            return 0.0
