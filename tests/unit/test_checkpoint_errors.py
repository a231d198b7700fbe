"""A failed save names its cause however megatron-core and torch wrap it (``checkpoint._cause``):
the errno inside a ``CheckpointException``'s per-rank failures, a full disk that surfaced
without an errno (a zip writer's ``unexpected pos``), and the wrapped error otherwise."""

import errno
import os
import shutil
from collections import namedtuple

from torch.distributed.checkpoint.api import CheckpointException

from megatron_stare.checkpoint import core as checkpoint

Usage = namedtuple("Usage", "total used free")


def _wrapped(exc: BaseException) -> CheckpointException:
    return CheckpointException("save failed", {0: (exc, None), 1: (RuntimeError("peer"), None)})


def test_errno_inside_checkpoint_exception_failures_is_named(tmp_path):
    cause = checkpoint._cause(_wrapped(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))), tmp_path)
    assert cause.startswith("CheckpointException: ") and "[Errno 28] No space left on device" in cause


def test_full_disk_without_errno_is_named_from_the_free_space(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(100 << 20, (100 << 20) - 4096, 4096))
    cause = checkpoint._cause(_wrapped(RuntimeError("unexpected pos 704 vs 598")), tmp_path)
    assert "[Errno 28] No space left on device: 4096 bytes free on its file system" in cause


def test_other_failures_name_what_the_wrapper_wraps(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(100 << 30, 1 << 30, 99 << 30))
    cause = checkpoint._cause(_wrapped(RuntimeError("unexpected pos 704 vs 598")), tmp_path)
    assert "No space" not in cause and "RuntimeError: unexpected pos 704 vs 598" in cause
