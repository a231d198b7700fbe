"""The building blocks of the typed config: ``ConfigError`` and declarative numeric ranges.

Every numeric field of the config dataclasses (``megatron_stare.config.load``,
``megatron_stare.config.algorithm``) is declared with ``num(default, ge=..., gt=..., le=...,
lt=...)``, which stores a ``Range`` in the field's metadata; its docstring states the same range
(``Range.text()``, a test keeps the two in step). ``check_fields(obj, prefix)`` is the one
generic checker: it walks a config dataclass and its sections and checks each numeric field's
type and range, raising one ``ConfigError`` line that names the field and the allowed values::

    config: algorithm.stare.w must be >= 1 (W amplifies the selected A>0 tokens; ...), got 0.9

Cross-field consistency lives next to the sections (``validate()`` of the algorithm sections)
and in ``megatron_stare.preflight.checks``. This module imports nothing from the project, so every
config module can import it downward (and ``ConfigError`` is one class even when
``megatron_stare.config.load`` runs as ``__main__``).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Tuple

from megatron_stare.errors import UserError

RANGE = "range"
"""The metadata key of a field's ``Range``."""


class ConfigError(UserError):
    """A configuration problem; ``str()`` is one line naming the field and the fix."""

    def __init__(self, msg: str) -> None:
        super().__init__(msg if msg.startswith("config: ") else f"config: {msg}")


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


@dataclass(frozen=True)
class Range:
    """The values a numeric field accepts: an interval, plus ``special`` values (e.g. -1 = off).

    ``None`` bounds are unbounded; NaN is never accepted, +-inf only with ``inf_ok``.
    """

    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False
    special: Tuple[float, ...] = ()
    inf_ok: bool = False
    why: str = ""
    """The field's role, shown in the error (why the range is what it is)."""

    def contains(self, v: float) -> bool:
        if v in self.special:
            return True
        if math.isnan(v) or (math.isinf(v) and not self.inf_ok):
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return not (self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi))

    def text(self) -> str:
        """``'in (0, 1]'``, ``'>= 1'``, ``'>= 1 or -1'``, ``'a number'``."""
        if self.lo is not None and self.hi is not None:
            core = (f"in {'(' if self.lo_open else '['}{_fmt(self.lo)}, {_fmt(self.hi)}"
                    f"{')' if self.hi_open else ']'}")
        elif self.lo is not None:
            core = f"{'>' if self.lo_open else '>='} {_fmt(self.lo)}"
        elif self.hi is not None:
            core = f"{'<' if self.hi_open else '<='} {_fmt(self.hi)}"
        else:
            core = "a number"
        return core + "".join(f" or {_fmt(s)}" for s in self.special)


def num(default: Any, *, ge: Optional[float] = None, gt: Optional[float] = None,
        le: Optional[float] = None, lt: Optional[float] = None, special: Tuple[float, ...] = (),
        inf_ok: bool = False, why: str = "") -> Any:
    """A dataclass field with ``default`` whose values must lie in the given range."""
    if ge is not None and gt is not None or le is not None and lt is not None:
        raise TypeError("give at most one lower (ge/gt) and one upper (le/lt) bound")
    rng = Range(lo=gt if gt is not None else ge, hi=lt if lt is not None else le,
                lo_open=gt is not None, hi_open=lt is not None, special=tuple(special),
                inf_ok=inf_ok, why=why)
    return field(default=default, metadata={RANGE: rng})


@dataclass(frozen=True)
class NumericField:
    """One numeric field of a config tree (what ``numeric_fields`` yields)."""

    path: str
    """Dotted name, e.g. ``algorithm.stare.w``."""
    kind: type
    """``int`` or ``float``."""
    optional: bool
    """``None`` (null) is accepted too."""
    range: Optional[Range]
    """None only for a field that forgot its ``num(...)`` (a test rejects that)."""


def _numeric_kind(tp: Any) -> Tuple[Optional[type], bool]:
    """``(int | float | None, optional)`` of a field's type hint."""
    optional = False
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        tp = args[0] if len(args) == 1 else None
    return (tp if tp in (int, float) else None), optional


def numeric_fields(cls: type, prefix: str = "") -> Iterator[NumericField]:
    """Every int/float field of config dataclass ``cls`` and of its sections, depth first."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from numeric_fields(tp, path)
            continue
        kind, optional = _numeric_kind(tp)
        if kind is not None:
            yield NumericField(path, kind, optional, f.metadata.get(RANGE))


def _type_ok(v: Any, kind: type) -> bool:
    if isinstance(v, bool):
        return False
    return isinstance(v, int) if kind is int else isinstance(v, (int, float))


def check_fields(obj: Any, prefix: str = "") -> None:
    """Check the type and range of every numeric field of ``obj`` (a config dataclass) and its
    sections; raise one ``ConfigError`` line naming the first bad field."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        path = f"{prefix}.{f.name}" if prefix else f.name
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            check_fields(v, path)
            continue
        kind, optional = _numeric_kind(hints[f.name])
        rng = f.metadata.get(RANGE)
        if kind is None or rng is None or (v is None and optional):
            continue
        allowed = rng.text() + (" or null" if optional else "")
        why = f" ({rng.why})" if rng.why else ""
        if not _type_ok(v, kind):
            noun = "an integer" if kind is int else "a number"
            raise ConfigError(f"{path} must be {noun} {allowed}{why}, got {v!r} ({type(v).__name__})")
        if not rng.contains(float(v)):
            raise ConfigError(f"{path} must be {allowed}{why}, got {v!r}")
