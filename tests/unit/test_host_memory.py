"""``compat/host_memory.keep_freed_memory``: a freed large tensor's pages stay in the process
(glibc neither unmaps nor trims them), so later allocations reuse mapped memory instead of
page-faulting fresh zero-filled pages in. Measured as the process's resident pages (the
kernel's count, not a timing) before and after the tensor is freed, each setting in its own
process (mallopt is process-wide). Whether a later tensor lands on exactly those pages depends
on what else the heap holds; the step-level gain is the benchmark's (docs/performance.md)."""

import subprocess
import sys

import pytest

CHILD = r"""
import os, sys
import torch
if sys.argv[1] == "keep":
    from megatron_stare.compat.host_memory import keep_freed_memory
    assert keep_freed_memory()
def resident_pages():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1])
t = torch.empty(16 * 2 ** 20)  # 64 MiB, above glibc's largest mmap threshold (32 MiB)
t.fill_(1.0)
held = resident_pages()
del t
print(held - resident_pages())
"""


def pages_given_back(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and /proc")
def test_a_freed_large_tensor_stays_in_the_process():
    pages = 16 * 2 ** 20 * 4 // 4096
    assert pages_given_back("default") >= pages * 9 // 10  # glibc unmapped it at once
    assert pages_given_back("keep") < pages // 20
