"""``math``: 1.0 if the response's final answer equals the reference under math-verify, else 0.0.

Final answer = the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), else the text
after the last answer marker ("The answer is", "Answer:", "####", ...) up to the end of that
line; no final answer scores 0 (as in the STARE/DAPO reference reward). Only that candidate,
at most ``MAX_ANSWER_CHARS`` long, goes to math-verify: a megabyte of digits or ten thousand
unclosed braces costs one linear scan, not a parse.

Timeouts: math-verify's own timeouts are ``signal.alarm`` based with whole-second resolution
and cancel any other ``SIGALRM`` timer when they finish, so they are switched off here and the
whole call runs under one ``registry.deadline`` (a float-second ``ITIMER_REAL``) instead: in
the main thread it is always bounded, inline or in a ``RewardPool`` worker (whose parent also
hard-kills a worker stuck in one C call). A timed-out call scores 0. Called from another
thread (no signals there) it is unbounded: score through ``RewardPool`` workers instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

from megatron_stare.rewards.registry import RewardTimeout, deadline, register_reward

#: A longer "final answer" is not an answer; it scores 0 without being parsed.
MAX_ANSWER_CHARS = 1000

#: Case-insensitive markers; the last occurrence in the response wins.
ANSWER_MARKERS = ("the final answer is", "final answer:", "the answer is", "answer:", "####")

_BOXED = ("\\boxed", "\\fbox")
_WARM = False  # math-verify imported and its regexes compiled in this process


def extract_boxed(text: str, max_chars: int = MAX_ANSWER_CHARS) -> Optional[str]:
    """Content of the last ``\\boxed{...}``/``\\fbox{...}`` (balanced braces), or ``None``.

    ``\\boxed 5`` (no brace) gives the next whitespace-delimited token. Unbalanced or longer
    than ``max_chars``: ``None``. Cost: one reverse search plus at most ``max_chars`` steps.
    """
    start = max(text.rfind(b) for b in _BOXED)
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    rest = text[i:i + max_chars + 2]
    if rest.lstrip()[:1] != "{":
        # '\\boxed 5' (TeX takes one token); '\\boxedx' is not a box
        token = rest.split(maxsplit=1) if rest[:1].isspace() else []
        return token[0].rstrip(".$") if token else None
    depth = 0
    for j, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[rest.index("{") + 1:j].strip()
    return None


def extract_after_marker(text: str, markers: Sequence[str] = ANSWER_MARKERS,
                         max_chars: int = MAX_ANSWER_CHARS) -> Optional[str]:
    """Text after the last (case-insensitive) marker up to the end of its line, or ``None``.

    Leading ``:`` and surrounding ``$``, whitespace and a trailing ``.`` are stripped.
    """
    low = text.lower()
    end = -1  # the marker that ends last wins ('final answer: 5' matches 'answer:' too)
    for m in markers:
        pos = low.rfind(m.lower())
        if pos >= 0:
            end = max(end, pos + len(m))
    if end < 0:
        return None
    tail = text[end:end + max_chars + 1].lstrip(" \t:")
    line = tail.split("\n", 1)[0].strip()
    line = line.rstrip(".").strip().strip("$").strip()
    return line if line and len(line) <= max_chars else None


def extract_final_answer(text: str, markers: Sequence[str] = ANSWER_MARKERS) -> Optional[str]:
    """``extract_boxed`` if the response has a box, else ``extract_after_marker``."""
    boxed = extract_boxed(text)
    return boxed if boxed is not None else extract_after_marker(text, markers)


def _parse(latex: str):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    # Boxing the candidate makes math-verify's LaTeX extractor take exactly it; the plain
    # expression extractor covers '1/2', '3*x'. Timeouts off: see the module docstring.
    return parse(f"\\boxed{{{latex}}}", extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
                 parsing_timeout=None)


@dataclass
class MathVerifyReward:
    """The ``math`` reward as a configurable callable (register your own variant by dotted path)."""

    timeout_s: float = 5.0
    """Wall-time limit of one call when no outer deadline (a ``RewardPool``'s) is armed."""
    markers: Sequence[str] = ANSWER_MARKERS

    def warmup(self) -> None:
        """Import math-verify/sympy and compile its regexes (seconds, once per process), so that
        no scored call pays for it inside its time limit."""
        global _WARM
        if not _WARM:
            _parse("1")
            _WARM = True

    def __call__(self, response_text: str, answer: str, metadata: Optional[dict] = None) -> float:
        pred = extract_final_answer(response_text, self.markers)
        if pred is None:
            return 0.0
        self.warmup()
        from math_verify import verify

        mine = False
        try:
            with deadline(self.timeout_s) as mine:
                gold = _parse(str(answer).strip().strip("$"))
                target = _parse(pred)
                return 1.0 if gold and target and verify(gold, target, timeout_seconds=None) else 0.0
        except RewardTimeout:
            if not mine:  # an outer limit (the pool's): let it count the timeout
                raise
            return 0.0
        except Exception:  # sympy/latex2sympy errors on odd input: an unverifiable answer
            return 0.0


# math-verify warns once at WARNING that its timeout is off; we own the timeout (see above).
logging.getLogger("math_verify.parser").setLevel(logging.ERROR)
logging.getLogger("math_verify.grader").setLevel(logging.ERROR)

math_reward = register_reward("math")(MathVerifyReward())
