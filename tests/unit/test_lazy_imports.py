"""Imports sit at the top of a module, except where a late import is the point.

The one rule, checked on the source (``ast``) for every import inside a function of
``megatron_stare``: it is allowed when

- it loads an **optional library** (``OPTIONAL``: a rollout engine, a kernel library, a logger or
  a file format that a run may not have installed), or
- it **adds a heavy library** (``HEAVY``: torch, megatron-core, transformers) that the importing
  module keeps out of its own import. That is what keeps ``python -m megatron_stare.config``
  and the launch preflight, the reward workers, the rollout server launchers and the dry-run
  planner free of torch or megatron-core, and lets ``train.main`` install its signal handlers
  before megatron-core loads (a preemption during that import is then still handled).

Anything else is a hidden dependency: move it to the top. "What a module loads" is its static
closure: its module-level imports (``if TYPE_CHECKING`` blocks excluded), their packages'
``__init__`` and so on, recursively; a third-party import counts as the heavy libraries it is.
``tests/unit/test_import_graph.py::test_light_modules_do_not_import_torch`` checks the same
closure against a real interpreter for the entry points that must stay light.
"""

import ast
from pathlib import Path
from typing import Dict, FrozenSet, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "megatron_stare"

#: Optional libraries, imported where they are used: a run without them still works.
OPTIONAL = {
    "vllm": "the vLLM engines (rollout.engine: vllm, vllm-server)",
    "sglang": "the SGLang engines",
    "transformer_engine": "megatron-core's TE layers, only with model.transformer_impl=transformer_engine",
    "triton": "the routed-experts capture's GPU path",
    "pyarrow": "parquet data files (verl's format); JSONL needs nothing",
    "matplotlib": "figures (the demo, the study, logging.plot)",
    "math_verify": "the math_verify reward",
    "wandb": "logging.wandb_project",
    "torch.utils.tensorboard": "logging.tensorboard",
}
#: Heavy libraries: what a late import may keep out of a module, and why that matters.
HEAVY = {
    "torch": "the config CLI, the launch preflight and the reward workers start in ~0.1 s without it",
    "megatron": "the planner, the preflight and the rollout servers read model specs without megatron-core; "
                "train.main installs its signal handlers before it loads",
    "transformers": "HF models and tokenizers load only where one is built",
}


def _modules() -> Dict[str, Tuple[Path, bool]]:
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _resolve(node: ast.AST, module: str, is_pkg: bool, modules) -> List[str]:
    """Dotted names an import statement loads (ours resolved to modules, third-party as written)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".") if is_pkg else module.split(".")[:-1]
        parts = parts[:len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [base] + [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _top_level_imports(tree: ast.Module):
    """Import statements that run when the module is imported (not in functions or classes' methods,
    not under ``if TYPE_CHECKING``)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and not _is_type_checking(node):
            stack += node.body + node.orelse
        elif isinstance(node, (ast.Try, ast.With, ast.ClassDef)):
            stack += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
            for h in getattr(node, "handlers", []):
                stack += h.body


def _function_imports(tree: ast.Module):
    """(function name, import statement) for every import inside a function body."""
    def walk(node, fn):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from walk(child, child.name)
            elif fn and isinstance(child, (ast.Import, ast.ImportFrom)):
                yield fn, child
            else:
                yield from walk(child, fn)
    yield from walk(tree, None)


def _heavy_of_name(name: str) -> Set[str]:
    top = name.split(".")[0]
    if top == "torch":
        return {"torch"}
    if top == "megatron":
        return {"megatron", "torch"}
    if top == "transformers":
        return {"transformers"}
    if name.startswith("safetensors.torch"):
        return {"torch"}
    return set()


class Closure:
    """The heavy libraries each of our modules loads at import (static, memoised)."""

    def __init__(self):
        self.modules = _modules()
        self.trees = {m: ast.parse(p.read_text(), str(p)) for m, (p, _) in self.modules.items()}
        self._memo: Dict[str, FrozenSet[str]] = {}

    def ours(self, name: str) -> List[str]:
        """``name`` and the packages above it that are ours (importing a.b.c runs a, a.b, a.b.c)."""
        parts = name.split(".")
        return [".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in self.modules]

    def of_name(self, name: str) -> FrozenSet[str]:
        if name.split(".")[0] != PACKAGE:
            return frozenset(_heavy_of_name(name))
        out: Set[str] = set()
        for m in self.ours(name):
            out |= self.of_module(m)
        return frozenset(out)

    def of_module(self, module: str) -> FrozenSet[str]:
        if module in self._memo:
            return self._memo[module]
        self._memo[module] = frozenset()  # a cycle through packages' __init__: no new heavy library
        _, is_pkg = self.modules[module]
        out: Set[str] = set()
        for m in self.ours(module)[:-1]:  # the packages above it run first
            out |= self.of_module(m)
        for node in _top_level_imports(self.trees[module]):
            for name in _resolve(node, module, is_pkg, self.modules):
                out |= self.of_name(name)
        self._memo[module] = frozenset(out)
        return self._memo[module]


def _optional(name: str) -> bool:
    return any(name == o or name.startswith(o + ".") for o in OPTIONAL)


def late_import_offenders() -> List[str]:
    closure = Closure()
    bad = []
    for module, (path, is_pkg) in closure.modules.items():
        own = closure.of_module(module)
        for fn, node in _function_imports(closure.trees[module]):
            names = _resolve(node, module, is_pkg, closure.modules)
            if any(_optional(n) for n in names):
                continue
            adds = set().union(*(closure.of_name(n) for n in names)) - own
            if not adds:
                rel = path.relative_to(ROOT)
                bad.append(f"{rel}:{node.lineno} in {fn}(): {ast.unparse(node)} (adds no heavy library: "
                           f"move it to the top)")
    return bad


def test_late_imports_only_keep_out_optional_or_heavy_libraries():
    bad = late_import_offenders()
    assert not bad, "\n".join(bad)


def test_the_closure_sees_what_a_real_import_loads():
    """Guards for the rule's inputs: known light and heavy modules come out as they are."""
    c = Closure()
    assert c.of_module("megatron_stare.config.load") == frozenset()         # the config CLI: light
    assert c.of_module("megatron_stare.preflight.cli") == frozenset()
    assert "torch" in c.of_module("megatron_stare.ops.vocab_parallel")
    assert "megatron" in c.of_module("megatron_stare.actor.core")
    assert "megatron" not in c.of_module("megatron_stare.models.gpt")       # specs without megatron-core
    assert "megatron" not in c.of_module("megatron_stare.train")            # handlers first
    assert c.of_name("megatron.core.parallel_state") == {"megatron", "torch"}


def test_the_rule_bites(tmp_path, monkeypatch):
    """A late import of a light module, or of torch into a module that already loads torch, is
    reported; one that keeps torch out of a light module, or loads vLLM, is not."""
    c = Closure()
    src = ("import torch\n"
           "def f():\n    import json\n    from megatron_stare.config import load\n"
           "def g():\n    import vllm\n    from megatron_stare.actor import core\n")
    tree = ast.parse(src)
    own = frozenset({"torch"})
    found = []
    for fn, node in _function_imports(tree):
        names = _resolve(node, "megatron_stare.x", False, c.modules)
        if not any(_optional(n) for n in names) and not (set().union(*(c.of_name(n) for n in names)) - own):
            found.append(ast.unparse(node))
    assert found == ["import json", "from megatron_stare.config import load"]
