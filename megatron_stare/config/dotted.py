"""``resolve``: a registered object by name, or a user's object by dotted path - the one lookup
behind ``reward.fn`` (``rewards/lookup.py``) and ``rollout.multi_turn.env`` (``envs/base.py``).
``import_subpackages``: the folders of a package, imported - how engine and model-family
folders are found (``rollout/engines/``, ``models/families/``). ``registrar``: the one
decorator factory behind every small registry (rewards, tasks, losses, advantages, ...).
``with_plugins``: a registry plus the names other installed packages register in it through an entry-point group of their
``setup.py`` (loaded only when asked for), e.g. the study's tasks and rewards
(``megatron_stare.rewards``, ``megatron_stare.tasks``) or a user's own package.

``'pkg.mod:attr'`` imports ``pkg.mod`` and takes ``attr`` (which may itself be dotted);
``'pkg.mod.attr'`` splits at the last dot. Every problem is one line of ``error``, naming the
config field, e.g. ``reward.fn: cannot import 'foo.bar:baz' (No module named 'foo')``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import pkgutil
from types import ModuleType
from typing import Any, Callable, Dict, Iterator, List, Mapping, Type, TypeVar

T = TypeVar("T")


def registrar(table: Dict[str, Any], kind: str) -> Callable[[str], Callable[[T], T]]:
    """``register = registrar(TABLE, "reward")``; ``@register("name")`` adds the decorated object to
    ``TABLE`` under ``name`` and returns it unchanged; a name registered twice is a ValueError."""

    def register(name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in table:
                raise ValueError(f"{kind} {name!r} registered twice")
            table[name] = obj
            return obj

        return deco

    return register


@functools.lru_cache(maxsize=None)
def _entry_points(group: str) -> Dict[str, importlib.metadata.EntryPoint]:
    """The entry points of ``group`` by name: read once per process (the read scans the metadata
    of every installed distribution)."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=group)}


class _WithPlugins(Mapping):
    def __init__(self, registry: Mapping[str, Any], group: str):
        self.registry, self.group = registry, group

    def __getitem__(self, name: str) -> Any:
        if name in self.registry:  # a registered name wins, and reads no metadata
            return self.registry[name]
        return _entry_points(self.group)[name].load()

    def __iter__(self) -> Iterator[str]:
        return iter(sorted({*self.registry, *_entry_points(self.group)}))

    def __len__(self) -> int:
        return len({*self.registry, *_entry_points(self.group)})

    def __contains__(self, name: object) -> bool:
        return name in self.registry or name in _entry_points(self.group)

    def missing_hint(self) -> str:
        """Why a plugin name may be missing: this project's own (the study's tasks) register only
        once it is installed; a bare source tree on ``PYTHONPATH`` has no entry points."""
        try:
            importlib.metadata.distribution("megatron-stare")
            return ""
        except importlib.metadata.PackageNotFoundError:
            return (" (megatron-stare is not installed, so the names its setup.py registers, the study's tasks "
                    "among them, are missing: pip install -e .)")


def with_plugins(registry: Mapping[str, Any], group: str) -> Mapping[str, Any]:
    """``registry`` (name -> object) and the entry points of ``group``, one read-only mapping: a
    registered name wins; a plugin's object is imported on its first lookup (``pkg.module:attr``)."""
    return _WithPlugins(registry, group)


def import_subpackages(package: str) -> List[ModuleType]:
    """Every direct subpackage (folder with an ``__init__.py``) of ``package``, imported, sorted by
    name; a folder appended to the package's ``__path__`` counts too."""
    pkg = importlib.import_module(package)
    names = sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if m.ispkg)
    return [importlib.import_module(f"{package}.{name}") for name in names]


def resolve(spec: str, registry: Mapping[str, Any], *, field: str, noun: str, kind: str,
            error: Type[Exception]) -> Any:
    """``registry[spec]``, or the callable at dotted path ``spec``; raises ``error`` (one line)
    when the module cannot be imported, lacks the attribute, or it is not callable. ``noun``
    names what the registry holds (``reward``), ``kind`` what a path names (``function``)."""
    if spec in registry:
        return registry[spec]
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
    elif "." in spec:
        module_name, _, attr = spec.rpartition(".")
    else:
        hint = registry.missing_hint() if isinstance(registry, _WithPlugins) else ""
        raise error(f"{field}: unknown {noun} {spec!r}; registered: {', '.join(sorted(registry))}; "
                    f"or give a {kind} as 'pkg.module:{kind}'{hint}")
    if not module_name or not attr:
        raise error(f"{field}: {spec!r} is not of the form 'pkg.module:{kind}'")
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # any failure while importing user code is the user's to fix
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise error(f"{field}: cannot import {spec!r} ({msg})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise error(f"{field}: cannot import {spec!r} "
                        f"({getattr(obj, '__name__', type(obj).__name__)!s} has no attribute {part!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise error(f"{field}: {spec!r} is not callable (it is a {type(obj).__name__})")
    return obj
