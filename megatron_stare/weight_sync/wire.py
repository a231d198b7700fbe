"""The one wire protocol: how a ``FlatBucket`` crosses a process boundary.

One bucket is three transfers over a *link* (a function that moves one tensor: a broadcast
over a process group, or a point-to-point send/recv):

1. ``int64[2] = (header bytes, data bytes)``;
2. the JSON header (``bucket.encode_header``) as ``uint8``;
3. the flat data buffer.

``(0, 0)`` in step 1 ends the stream. The Megatron export (pipeline stages to the destination)
and the process-group transport (trainer to engine workers) both speak it, so a bucket the
export produced is sent to an engine as is, without repacking. (``send_each`` is the bare
per-tensor form, for an engine whose receiving side speaks its own protocol: SGLang's servers.)

Links: ``group_link(group, root)`` broadcasts from group rank ``root`` on the group object
itself (so groups made outside ``torch.distributed``'s registry - vLLM's stateless groups,
SGLang-style named groups - work the same as ``dist.new_group`` ones); ``send_link(dst)`` /
``recv_link(src)`` are ``dist.send`` / ``dist.recv`` to / from a global rank.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_stare.weight_sync.bucket import FlatBucket, StagingBuffer, TensorMeta, decode_header, encode_header

__all__ = ["AsyncLink", "Link", "Pending", "broadcast", "broadcast_async", "group_link_async", "isend_link", "send_bucket_async", "default_device", "group_link", "recv_bucket", "recv_link", "send_bucket",
           "send_data", "send_each", "send_end", "send_header", "send_link"]

Link = Callable[[Tensor], None]
"""Moves one tensor: sends it (sending side) or fills it in place (receiving side)."""

_BACKEND_RELEASE_S = 10.0
"""How long to wait for gloo's worker thread to drop its reference to a finished transfer's
tensor. It always does, within microseconds on an idle machine but up to seconds on a loaded
one (CI's 2 cores running both ranks): a short bound (0.5 s) let a staging buffer look still in
use, so the next bucket got a fresh one while the old was alive (two buckets of peak memory)."""


def _await_backend_release(tensor: Tensor, base: int) -> None:
    """Block until ``tensor``'s use count is back to ``base`` (CPU), at most ``_BACKEND_RELEASE_S``."""
    if tensor.device.type != "cpu":
        return
    deadline, spins = time.monotonic() + _BACKEND_RELEASE_S, 0
    while tensor._use_count() > base and time.monotonic() < deadline:
        # Yield only, at first (the usual wait is microseconds); then sleep 1 ms, so that a long
        # wait on 2 cores does not keep a core from the very thread it waits for.
        time.sleep(0 if spins < 1000 else 1e-3)
        spins += 1


def broadcast(tensor: Tensor, root: int, group: dist.ProcessGroup) -> None:
    """Broadcast ``tensor`` in place from group rank ``root`` (blocking).

    On CPU, gloo's worker thread drops its reference to the tensor just AFTER the work
    completes; we wait for that (briefly), so the tensor is freed by whoever drops it next on
    this thread - bucket memory is then released deterministically before the next bucket is
    allocated, instead of racing the backend thread.
    """
    base = tensor._use_count()
    group.broadcast(tensor, root).wait()
    _await_backend_release(tensor, base)


class Pending:
    """A transfer issued without waiting (``async_op``): the tensor must stay untouched until
    ``wait()``, which blocks until the work is done AND the backend dropped its reference to the
    tensor (as ``broadcast`` does), so the caller's ``del`` then frees or recycles it at once."""

    def __init__(self, tensor: Tensor, issue: Callable[[Tensor], Optional[object]]):
        """``issue(tensor)`` starts the transfer and returns its work handle (``None``: the
        transfer already completed)."""
        self._base = tensor._use_count()
        self.tensor: Optional[Tensor] = tensor
        self._work = issue(tensor)

    def wait(self) -> None:
        if self.tensor is None:
            return
        if self._work is not None:
            self._work.wait()
        self._work = None  # the work object holds the tensor too: drop it before counting
        _await_backend_release(self.tensor, self._base)
        self.tensor = None


AsyncLink = Callable[[Tensor], Pending]
"""Starts moving one tensor and returns at once; the ``Pending`` is waited before reuse."""


def broadcast_async(tensor: Tensor, root: int, group: dist.ProcessGroup) -> Pending:
    """``broadcast`` without the wait: it runs on the backend's thread until ``wait()``."""
    return Pending(tensor, lambda x: group.broadcast(x, root))


def group_link_async(group: dist.ProcessGroup, root: int) -> AsyncLink:
    """``group_link`` without the wait (the same broadcast, left in flight)."""
    return lambda t: broadcast_async(t, root, group)


def isend_link(dst: int) -> AsyncLink:
    return lambda t: Pending(t, lambda x: dist.isend(x, dst=dst))


def group_link(group: dist.ProcessGroup, root: int) -> Link:
    """Broadcast over ``group`` from its rank ``root`` (both sides use the same link)."""
    return lambda t: broadcast(t, root, group)


def send_link(dst: int) -> Link:
    return lambda t: dist.send(t, dst=dst)


def recv_link(src: int) -> Link:
    return lambda t: dist.recv(t, src=src)


def default_device(group: dist.ProcessGroup) -> torch.device:
    """Where a group's tensors must live: the current GPU for NCCL, else CPU."""
    try:
        nccl = group._get_backend_name() == "nccl"  # noqa: SLF001 - no public accessor
    except Exception:  # noqa: BLE001 - stateless groups without a name: assume gloo
        nccl = False
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def send_header(link: Link, metas: Sequence[TensorMeta], data_bytes: int, device: torch.device) -> None:
    """Steps 1 and 2 of a bucket (the data follows with ``send_data``)."""
    head = torch.frombuffer(bytearray(encode_header(metas)), dtype=torch.uint8).to(device)
    link(torch.tensor([head.numel(), data_bytes], dtype=torch.int64, device=device))
    link(head)


def send_data(link: Link, buffer: Tensor, device: torch.device) -> None:
    """Step 3: the flat ``uint8`` buffer (moved to ``device`` first when it is elsewhere)."""
    link(buffer.to(device))


def send_bucket(link: Link, bucket: FlatBucket, device: torch.device) -> None:
    send_header(link, bucket.metas, bucket.nbytes, device)
    send_data(link, bucket.buffer, device)


def send_bucket_async(link: Link, data_link: AsyncLink, bucket: FlatBucket, device: torch.device) -> Pending:
    """``send_bucket`` whose data transfer is left in flight: the small sizes/header go over
    ``link`` (blocking), the buffer over ``data_link``; wait the result before the buffer is
    reused. The receiver cannot tell the two apart (same transfers, same order)."""
    send_header(link, bucket.metas, bucket.nbytes, device)
    return data_link(bucket.buffer.to(device))


def send_each(link: Link, tensors: Iterable[Tensor], device: torch.device) -> None:
    """One transfer per tensor, in order, no header: the per-tensor protocol of engines whose
    receiving side is not ours (SGLang's ``update_weights_from_distributed`` announces the
    names/dtypes/shapes over HTTP itself)."""
    for t in tensors:
        link(t.detach().contiguous().to(device))


def send_end(link: Link, device: torch.device) -> None:
    """The end-of-stream marker."""
    link(torch.zeros(2, dtype=torch.int64, device=device))


def recv_bucket(link: Link, device: torch.device, staging: Optional[StagingBuffer] = None
                ) -> Optional[FlatBucket]:
    """The next bucket, or None at the end of the stream. The data lands in ``staging`` (reused
    once the consumer dropped the previous bucket) or in a fresh buffer."""
    sizes = torch.zeros(2, dtype=torch.int64, device=device)
    link(sizes)
    head_len, data_len = (int(v) for v in sizes.tolist())
    if head_len == 0:
        return None
    head = torch.empty(head_len, dtype=torch.uint8, device=device)
    link(head)
    metas = decode_header(head.cpu().numpy().tobytes(), data_len)
    del head
    buffer = staging.get(data_len) if staging is not None else torch.empty(data_len, dtype=torch.uint8, device=device)
    link(buffer)
    return FlatBucket(metas, buffer)
