"""The reward contract: how a reward function is called, what it may return, which one scores a row.

**Call.** A function whose parameters are named as verl's is called with keywords::

    compute_score(data_source=..., solution_str=response, ground_truth=answer, extra_info=...)

passing those of the four names it takes (all four if it takes ``**kwargs``); its other
parameters must have defaults (verl's variants: ``compute_score(solution_str, ground_truth,
method="strict", format_score=0.0)``, ``..., extra_info=None, **kwargs``). A first positional
parameter named otherwise, in a function that takes ``ground_truth`` but not ``solution_str``,
receives the response (verl's ``compute_score(model_output, ground_truth, timeout_score=0)``,
``compute_score(predict_str, ground_truth)``). ``data_source`` and
``extra_info`` are the row's columns (``None`` when it has none), ``ground_truth`` the answer as
the row gives it. Any other function is called positionally, as the built-ins are::

    fn(response: str, answer: str, metadata: dict)

``metadata`` holds the row's other columns. A function neither call can satisfy (required
parameters left over, unknown names, fewer than three positional parameters) is refused when
the run starts, in one ``RewardError`` line naming the config field (``reward.fn``).

**Return.** A number, a bool (``True`` = 1.0) or a dict with a ``"score"`` key; the dict's other
numeric (or bool) values are logged as ``reward/<key>``, their mean over the step's responses
(non-numeric values, such as verl's ``"pred"``, are ignored). An ``"acc"`` value is also the
verdict the step's ``reward/accuracy`` and the held-out avg@k / pass@k count (verl's validation
does the same), for a reward that also pays for format or length; without one a response counts
as correct when its score is > 0. Anything else (``None``, NaN, a dict
without ``"score"``) fails the step with one line naming the response.

**Routing.** ``reward.by_source: {my_math: math, my_code: 'pkg.mod:fn'}`` scores a row whose
``data_source`` is a key with that reward; every other row uses ``reward.fn``.

``RewardPool`` workers receive the whole routing as one spec string (``worker_spec``) and build
the same ``RewardRouter`` (``load_worker_spec``) as the inline path does.
"""

from __future__ import annotations

import inspect
import json
import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Mapping, Optional, Tuple

from megatron_stare.rewards.lookup import get_reward_fn
from megatron_stare.rewards.registry import RewardError

if TYPE_CHECKING:  # importing the config is for type hints only: reward workers stay light
    from megatron_stare.config.sections import RewardConfig  # not config: the preflight checks rewards

__all__ = ["VERL_PARAMS", "BoundReward", "RewardRouter", "bind_reward", "build_reward", "check_reward_config",
           "load_worker_spec", "normalize_return", "worker_spec"]

#: verl's reward keywords, in verl's order.
VERL_PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")
_P = inspect.Parameter
_POSITIONAL = (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)


@dataclass(frozen=True)
class BoundReward:
    """A reward function with its call style: ``keywords`` (verl's) or None (positional)."""

    fn: Callable[..., Any]
    keywords: Optional[Tuple[str, ...]]
    response_first: bool = False
    """Keyword style whose first positional parameter takes the response (not ``solution_str``)."""

    def __call__(self, response: str, answer: Any, metadata: dict) -> Any:
        if self.keywords is None:
            return self.fn(response, answer if isinstance(answer, str) else str(answer), metadata)
        given = {"data_source": metadata.get("data_source"), "solution_str": response, "ground_truth": answer,
                 "extra_info": metadata.get("extra_info")}
        kwargs = {k: given[k] for k in self.keywords}
        return self.fn(response, **kwargs) if self.response_first else self.fn(**kwargs)

    def warmup(self) -> None:
        if callable(getattr(self.fn, "warmup", None)):
            self.fn.warmup()


def _keywords(fn: Callable[..., Any], field: str, spec: str) -> Tuple[Optional[Tuple[str, ...]], bool]:
    """``(keywords, response_first)``: the verl keywords to call ``fn`` with (None: the positional
    call) and whether its first parameter takes the response; raises ``RewardError`` when
    neither call fits."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: the positional call, as before
        return None, False
    params = list(sig.parameters.values())
    named = {p.name for p in params if p.kind in (_P.POSITIONAL_OR_KEYWORD, _P.KEYWORD_ONLY)}
    var_kw = any(p.kind is _P.VAR_KEYWORD for p in params)
    var_pos = any(p.kind is _P.VAR_POSITIONAL for p in params)
    positional = [p for p in params if p.kind in _POSITIONAL]
    required = [p for p in params if p.default is _P.empty and p.kind not in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD)]
    neither = (f"{field}: {spec!r}{sig} fits neither reward call: verl's keywords "
               f"({', '.join(VERL_PARAMS)}) nor (response, answer, metadata)")
    if named & set(VERL_PARAMS) or (var_kw and not var_pos and len(positional) < 3):
        first = positional[0] if positional else None
        response_first = (first is not None and first.name not in VERL_PARAMS and "ground_truth" in named
                          and "solution_str" not in named)
        left = [p.name for p in required if (p.name not in VERL_PARAMS or p.kind is _P.POSITIONAL_ONLY)
                and not (response_first and p is first)]
        if left:
            raise RewardError(f"{neither}; it also requires {', '.join(left)} (give them defaults)")
        keys = tuple(k for k in VERL_PARAMS if (var_kw or k in named) and not (response_first and k == "solution_str"))
        if "solution_str" not in keys and not response_first:
            raise RewardError(f"{neither}; it never receives the response (add a solution_str parameter)")
        return keys, response_first
    if any(p.kind is _P.KEYWORD_ONLY for p in required):
        left = [p.name for p in required if p.kind is _P.KEYWORD_ONLY]
        raise RewardError(f"{neither}; it requires the keywords {', '.join(left)}")
    if len([p for p in required if p.kind in _POSITIONAL]) > 3 or (len(positional) < 3 and not var_pos):
        raise RewardError(f"{neither}; rename its parameters to verl's or take three positional ones")
    return None, False


def bind_reward(fn: Callable[..., Any], field: str = "reward.fn", spec: str = "") -> BoundReward:
    """``fn`` with its call style (see the module docstring); ``field``/``spec`` name it in errors."""
    return BoundReward(fn, *_keywords(fn, field, spec or getattr(fn, "__name__", type(fn).__name__)))


def normalize_return(value: Any) -> Tuple[float, Dict[str, float]]:
    """``(score, extras)`` of a reward's return value; ``ValueError`` (one line) if it is none of
    a finite number, a bool, or a dict with a ``"score"`` key."""
    extras: Dict[str, float] = {}
    if isinstance(value, Mapping):
        if "score" not in value:
            raise ValueError(f"returned a dict without a 'score' key (keys: {', '.join(map(str, value))})")
        extras = {str(k): float(x) for k, x in ((k, _scalar(v)) for k, v in value.items())
                  if k != "score" and isinstance(x, numbers.Real) and math.isfinite(float(x))}
        value = value["score"]
    value = _scalar(value)
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return float(value), extras
    raise ValueError(f"returned {value!r} ({type(value).__name__}), not a finite number, a bool or a dict "
                     f"with a 'score' key")


def _scalar(value: Any) -> Any:
    """A numpy scalar or one-element array / tensor as a Python number; anything else as is."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes, Mapping)):
        try:
            return value.item()
        except (TypeError, ValueError):  # several elements: not a score
            return value
    return value


class RewardRouter:
    """Scores a response with its row's reward: ``by_source[metadata['data_source']]``, else the
    default. Called as ``router(response, answer, metadata)``; ``warmup()`` warms them all."""

    def __init__(self, default: BoundReward, by_source: Optional[Dict[str, BoundReward]] = None):
        self.default, self.by_source = default, dict(by_source or {})

    def for_row(self, metadata: dict) -> BoundReward:
        return self.by_source.get(metadata.get("data_source"), self.default) if self.by_source else self.default

    def __call__(self, response: str, answer: Any, metadata: dict) -> Any:
        return self.for_row(metadata)(response, answer, metadata)

    def warmup(self) -> None:
        for r in {id(r): r for r in (self.default, *self.by_source.values())}.values():
            r.warmup()


def build_reward(fn: str, by_source: Optional[Mapping[str, str]] = None) -> RewardRouter:
    """The ``RewardRouter`` of ``reward.fn`` and ``reward.by_source``; raises ``RewardError``
    (one line naming the field) for a reward that cannot be found or called."""
    default = bind_reward(get_reward_fn(fn), "reward.fn", fn)
    routes: Dict[str, BoundReward] = {}
    for source, spec in (by_source or {}).items():
        where = f"reward.by_source.{source}"
        if not isinstance(spec, str) or not spec:
            raise RewardError(f"{where}: must name a reward (a registered name or 'pkg.module:function'), "
                              f"got {spec!r}")
        try:
            routes[str(source)] = bind_reward(get_reward_fn(spec), where, spec)
        except RewardError as e:
            raise RewardError(str(e).replace("reward.fn:", f"{where}:", 1)) from None
    return RewardRouter(default, routes)


def check_reward_config(reward_cfg: "RewardConfig") -> None:
    """Resolve and check every reward ``reward_cfg`` names (``fn`` and ``by_source``) without
    scoring anything: for the preflight and the trainer's start. Raises ``RewardError``."""
    build_reward(reward_cfg.fn, reward_cfg.by_source)


def worker_spec(reward_cfg: "RewardConfig") -> str:
    """The one string a ``RewardPool`` worker process builds its router from."""
    if not reward_cfg.by_source:
        return reward_cfg.fn
    return json.dumps({"fn": reward_cfg.fn, "by_source": dict(reward_cfg.by_source)})


def load_worker_spec(spec: str) -> RewardRouter:
    """``build_reward`` of a ``worker_spec`` string."""
    if spec.startswith("{"):
        d = json.loads(spec)
        return build_reward(d["fn"], d["by_source"])
    return build_reward(spec)
