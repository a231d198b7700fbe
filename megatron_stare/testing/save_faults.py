"""Faults for checkpoint-save tests: file workers that write slowly, so a test can kill one mid-write."""

from __future__ import annotations

import time
from megatron_stare.checkpoint import writer as checkpoint_writer


def slow_writer_open(delay_s: float = 60.0):
    """An ``open`` for megatron-core's writer workers (``filesystem_async.open``) that opens like
    ``checkpoint_writer._writer_open``, then holds each tensor file open for ``delay_s`` seconds
    before the worker writes to it."""
    def slow_open(file, mode="r", *args, **kwargs):
        f = checkpoint_writer._writer_open(file, mode, *args, **kwargs)
        if mode == "wb":
            time.sleep(delay_s)  # a worker with its file open, writing slowly
        return f

    return slow_open
