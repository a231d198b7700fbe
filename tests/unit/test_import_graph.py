"""The structure of the package, read from its import graph: no cycles between files or between
folders, the folders in their layer order (docs/architecture.md), at most four top-level modules,
and production never imports the test helpers (``megatron_stare.testing``).

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
    assert "megatron_stare.config.load" in g["megatron_stare.preflight.checks"]      # module level
    assert "megatron_stare.runtime.parallel" in g["megatron_stare.preflight.checks"]  # inside a function
    assert "megatron_stare.rollout.vllm_cpu" in g["megatron_stare.rollout.spec"]      # from pkg import module
    modules = _modules()
    rel = ast.parse("from .base import RolloutEngine\nfrom . import spec\n").body
    assert _targets(rel[0], "megatron_stare.rollout.spec", False, modules) == ["megatron_stare.rollout.base"]
    assert _targets(rel[1], "megatron_stare.rollout", True, modules) == ["megatron_stare.rollout.spec"]
    assert "megatron_stare.models.tiny" in g["megatron_stare.study.warm_start"]
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


@pytest.mark.parametrize("module", ["megatron_stare.config.load", "megatron_stare.preflight.cli", "megatron_stare.algorithms",
                                    "megatron_stare.runtime.rendezvous", "megatron_stare.rewards"])
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
    graph["megatron_stare.config.load"]["megatron_stare.preflight.checks"] = 1
    cycle = find_cycle(graph)
    assert cycle is not None and {"megatron_stare.config.load", "megatron_stare.preflight.checks"} <= set(cycle)
    text = _describe(cycle, graph)
    assert "megatron_stare.config.load (line 1) -> megatron_stare.preflight.checks" in text



# ----------------------------------------------------------------------------- folders and layers

#: The package's folders (and top-level modules) from the bottom up: a folder imports only from
#: folders of lower layers (and from itself). Entry points - ``train``, ``run``, every
#: ``__main__`` and the converters - sit above them all, the test helpers beside them.
LAYERS = (
    ("megatron_stare", "errors", "types", "compat"),  # megatron_stare: the package's __init__
    ("config", "runtime", "ops"),
    ("algorithms", "models"),
    ("weight_sync", "rewards"),
    ("envs", "data", "checkpoint", "actor"),
    ("rollout",),
    ("preflight",),
    ("plan",),
    ("trainer",),
    ("study",),
    ("demo",),
)
ENTRY_POINTS = ("train", "run", "checkpoints_convert", "testing")
TOP_LEVEL_MODULES = {"errors", "run", "train", "types"}


def folder_of(module: str) -> str:
    """``megatron_stare.rollout.spec`` -> ``rollout``; a ``__main__`` is its own node (an entry point)."""
    parts = module.split(".")
    if parts[-1] == "__main__":
        return module
    return parts[1] if parts[0] == "megatron_stare" and len(parts) > 1 else parts[0]


def folder_graph(graph: Dict[str, Dict[str, int]]) -> Dict[str, Dict[str, str]]:
    """folder -> {imported folder: one "module (line N) -> module" that makes the edge}."""
    out: Dict[str, Dict[str, str]] = {}
    for module, edges in graph.items():
        a = folder_of(module)
        for target, line in edges.items():
            b = folder_of(target)
            if a != b:
                out.setdefault(a, {}).setdefault(b, f"{module} (line {line}) -> {target}")
    return out


def layer_of(folder: str) -> int:
    if folder.endswith("__main__") or folder in ENTRY_POINTS:
        return len(LAYERS)
    for i, layer in enumerate(LAYERS):
        if folder in layer:
            return i
    raise AssertionError(f"{folder} is in no layer: add it to LAYERS (tests/unit/test_import_graph.py) "
                         f"and to docs/architecture.md")


def layer_violations(fgraph: Dict[str, Dict[str, str]]) -> List[str]:
    return [f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)}): {why}"
            for a, edges in sorted(fgraph.items()) for b, why in sorted(edges.items())
            if layer_of(b) >= layer_of(a) and not (a in ENTRY_POINTS and b in ENTRY_POINTS)]


def test_at_most_four_top_level_modules():
    top = {p.stem for p in (ROOT / "megatron_stare").glob("*.py")} - {"__init__"}
    assert top <= TOP_LEVEL_MODULES, f"new top-level modules {sorted(top - TOP_LEVEL_MODULES)}: put them in a folder"
    assert len(top) <= 4


def test_no_folder_cycles():
    fgraph = folder_graph(import_graph())
    cycle = find_cycle({a: dict.fromkeys(e, 1) for a, e in fgraph.items()})
    assert cycle is None, "folder cycle: " + "; ".join(fgraph[a][b] for a, b in zip(cycle, cycle[1:]))


def test_folders_import_only_lower_layers():
    folders = {folder_of(m) for m in _modules()}
    for folder in folders:
        layer_of(folder)  # every folder has a layer
    bad = layer_violations(folder_graph(import_graph()))
    assert not bad, "\n".join(bad)


def test_layer_check_bites():
    """A folder that imports upward, or sideways within its layer, is reported with the import."""
    fgraph = {"runtime": {"trainer": "megatron_stare.runtime.x (line 3) -> megatron_stare.trainer.y"},
              "models": {"algorithms": "megatron_stare.models.a (line 1) -> megatron_stare.algorithms.b"},
              "trainer": {"rollout": "ok"}}
    bad = layer_violations(fgraph)
    assert len(bad) == 2
    assert bad[0].startswith("models (layer 2) imports algorithms (layer 2)")
    assert "runtime.x (line 3)" in bad[1]
    with pytest.raises(AssertionError, match="newfolder is in no layer"):
        layer_of("newfolder")
