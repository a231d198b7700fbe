"""The import graph of the production packages has no cycles, and production never imports the
test helpers (``megatron_stare.testing``).

The graph is built from the source with ``ast``, counting every import statement wherever it
is (module level, inside functions, under ``if TYPE_CHECKING``): a lazy import that only dodges
a cycle is still a cycle. Relative imports are resolved; ``from pkg import name`` is an edge to
the submodule ``pkg.name`` when there is one, else to ``pkg``. Importing ``pkg.sub`` also runs
``pkg/__init__``, but that implicit step is not an edge: it is how every package works, and
counting it would make any package whose ``__init__`` re-exports its modules a "cycle".
"""

import ast
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("megatron_stare", "checkpoints_convert")
TESTING = "megatron_stare.testing"


def _modules() -> Dict[str, Tuple[Path, bool]]:
    """Dotted module name -> (file, is_package) for every module of ``PACKAGES``."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _known(name: str, modules) -> Optional[str]:
    """The longest prefix of ``name`` that is one of our modules (None for third-party)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.AST, module: str, is_pkg: bool, modules) -> List[str]:
    if isinstance(node, ast.Import):
        return [t for t in (_known(a.name, modules) for a in node.names) if t]
    if node.level:  # relative: from .x import y / from .. import z
        base = module.split(".") if is_pkg else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    out = []
    for alias in node.names:
        sub = f"{source}.{alias.name}"
        target = sub if sub in modules else _known(source, modules)
        if target:
            out.append(target)
    return out


def import_graph() -> Dict[str, Dict[str, int]]:
    """module -> {imported module: line of the first such import}."""
    modules = _modules()
    graph: Dict[str, Dict[str, int]] = {}
    for module, (path, is_pkg) in modules.items():
        edges: Dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(node, module, is_pkg, modules):
                    if target != module:
                        edges.setdefault(target, node.lineno)
        graph[module] = edges
    return graph


def find_cycle(graph: Dict[str, Dict[str, int]]) -> Optional[List[str]]:
    """One cycle ``[a, b, ..., a]`` if the graph has any (iterative DFS), else None."""
    state: Dict[str, int] = {}  # 1 = on the current path, 2 = done
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def _describe(cycle: List[str], graph) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_graph_is_built_from_real_imports():
    """Guards for the builder itself: it sees function-level, relative and from-imports."""
    g = import_graph()
    assert "megatron_stare.config.checks" in g["megatron_stare.config.load"]           # module level
    assert "megatron_stare.runtime.parallel" in g["megatron_stare.config.checks"]         # inside a function
    assert "megatron_stare.rollout.base" in g["megatron_stare.rollout.hf_engine"]  # from .base import
    assert "megatron_stare.rollout.hf_engine" in g["megatron_stare.rollout"]      # from . import hf_engine
    assert "megatron_stare.models.tiny" in g["megatron_stare.demo.warm_start"]
    assert find_cycle({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}, "c": {"a": 1}}) is None


def test_no_import_cycles():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {_describe(cycle, graph)}"


def test_production_never_imports_the_test_helpers():
    graph = import_graph()
    bad = [f"{m} (line {edges[t]}) imports {t}" for m, edges in sorted(graph.items())
           if not m.startswith(TESTING) for t in edges if t == TESTING or t.startswith(TESTING + ".")]
    scripts = [p for d in ("launch", "scripts") for p in sorted((ROOT / d).iterdir()) if p.is_file()]
    bad += [f"{p.relative_to(ROOT)} mentions {TESTING}" for p in scripts if TESTING in p.read_text()]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module", ["megatron_stare.config.load", "megatron_stare.runtime.rendezvous",
                                    "megatron_stare.rewards"])
def test_light_modules_do_not_import_torch(module):
    """The config (and the launch preflight, and reward workers) must stay light: no torch, no losses."""
    code = (f"import sys, {module}; heavy = [m for m in ('torch', 'megatron.core', "
            f"'megatron_stare.algorithms.losses') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"import {module} pulled in {out.stdout.strip()}"


def test_cycle_report_names_the_modules():
    """Proof the check bites: a graph with the old config <-> config_checks cycle is reported."""
    graph: Dict[str, Dict[str, int]] = {m: dict(e) for m, e in import_graph().items()}
    graph["megatron_stare.config.checks"]["megatron_stare.config.load"] = 1
    cycle = find_cycle(graph)
    assert cycle is not None and {"megatron_stare.config.load", "megatron_stare.config.checks"} <= set(cycle)
    text = _describe(cycle, graph)
    assert "megatron_stare.config.checks (line 1) -> megatron_stare.config.load" in text

