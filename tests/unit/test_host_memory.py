"""``compat/host_memory.keep_freed_memory``: a freed large tensor's pages stay mapped, so the
next tensor of that size is not page-faulted in again. Counted in minor page faults (the
kernel's count, not a timing), each setting in its own process (mallopt is process-wide)."""

import subprocess
import sys

import pytest

CHILD = r"""
import resource, sys
import torch
if sys.argv[1] == "keep":
    from megatron_stare.compat.host_memory import keep_freed_memory
    assert keep_freed_memory()
def faults_of_one_round():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(16 * 2 ** 20)  # 64 MiB, above glibc's largest mmap threshold (32 MiB)
    t.fill_(1.0)
    del t
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_of_one_round()  # the first round maps the memory in either case
print(min(faults_of_one_round() for _ in range(3)))
"""


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_large_tensor_is_reused_without_page_faults():
    pages = 16 * 2 ** 20 * 4 // 4096
    assert faults("default") >= pages // 2  # glibc unmapped it: every page faulted in again
    assert faults("keep") < pages // 20
