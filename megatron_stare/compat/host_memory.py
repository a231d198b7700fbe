"""Keep freed host memory in the process instead of handing it back to the OS (CPU runs).

glibc's malloc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh
``mmap`` and unmaps it on free. A CPU training step allocates and frees many such tensors per
micro-batch (the ``[tokens, vocab]`` logits and their gradient are ~400 MiB at 2k tokens x 49k
vocab), so every step the kernel maps them again and zero-fills each 4 KiB page on first touch:
that page-fault work shows up inside the first op that writes the buffer (the GEMM producing
the logits, the vocabulary op's backward). ``keep_freed_memory`` sets ``M_MMAP_MAX`` to 0 (large
blocks come from the heap too) and a trim threshold of 2 GiB, so freed blocks stay mapped and
are reused; the process's resident size then stays near its peak, which is the memory the step
needs anyway. jemalloc or tcmalloc (``LD_PRELOAD``) do the same and more; this needs nothing
installed.

Measured (``benchmarks/bench_vs_trl.py --project-only``, SmolLM2-135M, L=64, DP2, the update of
rounds 1 and 2, docs/performance.md): default malloc 70.8 / 58.3 s; torch's transparent huge
pages (``THP_MEM_ALLOC_ENABLE=1``: 512x fewer faults, the same zero-filling) 59.6 / 52.5 s;
this 41.4 / 30.0 s. The busiest rank's peak resident memory was 9.2 GB with the default (8.7
with huge pages). Handing the free heap back after every update (``malloc_trim``) instead
made the update slower than the default (84-95 s): the reuse across steps is the gain.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TRIM_THRESHOLD_BYTES = 2 ** 31 - 1  # mallopt takes an int


def keep_freed_memory() -> bool:
    """Tune glibc's malloc as the module docstring says; False (nothing changed) on a libc
    without ``mallopt`` (musl, macOS) or when glibc refuses a setting."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))

