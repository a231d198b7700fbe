"""What a weight sync allocates on a trainer rank, by the rank's role, for the planner (``plan.py``).

Read from the export (``weight_sync/export.py``, ``models/sharding.py``, ``weight_sync/export_pieces.py``,
``weight_sync.StagingBuffer``):

- **Colocated engine** (``dst="all"``, whole tensors; every rank yields the whole model): the TP
  all-gather lands in one reused scratch buffer grown to the stage's largest full tensor (the
  padded embedding on stage 0, the output layer on the last stage; rows split along dim 0 need
  nothing more); tensors split along dim 1 and the GLU ``fc1`` are concatenated into a second
  reused scratch buffer; the HF tensors are packed into a two-slot staging buffer of buckets of
  ``bucket`` bytes, a tensor larger than a bucket taking a bucket of its own (so one slot may
  hold the largest HF tensor while the other holds a full bucket); with pipeline parallel the
  other stages' buckets arrive in a second two-slot staging buffer. Only with tp > 1 the scratch
  buffers exist (at tp 1 parameters are packed without a copy).
- **Collector** (the weight sync to an engine behind a process group: ``pieces=True``, one
  ``dst``): every stage's collector and the destination hold two buckets of at most ``bucket``
  bytes (pieces are cut at bucket boundaries) and nothing else; other ranks hold nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SyncStaging", "sync_staging"]


@dataclass(frozen=True)
class SyncStaging:
    """Bytes a weight sync holds at once on one rank of a stage, by part."""

    gather: float = 0.0
    """TP all-gather scratch: the stage's largest full tensor."""
    join: float = 0.0
    """Concatenation scratch: the largest dim-1-split or GLU tensor, full."""
    own: float = 0.0
    """This stage's two staging slots."""
    received: float = 0.0
    """The other stages' buckets: two slots (pp > 1, colocated)."""

    @property
    def total(self) -> float:
        return self.gather + self.join + self.own + self.received

    def describe(self, gib: float) -> str:
        parts = [("TP gather", self.gather), ("concatenation", self.join), ("own buckets", self.own),
                 ("other stages' buckets", self.received)]
        return ", ".join(f"{name} {v / gib:.2f}" for name, v in parts if v)


def sync_staging(*, stage: int, pp: int, tp: int, bucket: float, esize: int, colocated: bool, hidden: int,
                 ffn: int, q_dim: int, kv_dim: int, vocab: int, vocab_padded: int, tied: bool) -> SyncStaging:
    """The staging of one rank of pipeline ``stage`` (``colocated``: the whole-tensor export to
    every rank; else the collector of the piece export), in bytes; ``esize`` bytes per element."""
    if not colocated:
        return SyncStaging(own=2 * bucket)

    def stage_tensors(s: int):
        """(full padded size, largest HF tensor, largest concatenated) of stage ``s``, elements."""
        qkv = (q_dim + 2 * kv_dim) * hidden
        full = [qkv, 2 * ffn * hidden, ffn * hidden, q_dim * hidden]
        hf = [q_dim * hidden, kv_dim * hidden, ffn * hidden, q_dim * hidden]  # q, k/v, gate/up/down, o
        joined = [2 * ffn * hidden, ffn * hidden, q_dim * hidden]  # GLU fc1; fc2, o split along dim 1
        if s == 0 or (s == pp - 1 and (not tied or pp > 1)):  # an embedding or an output layer here
            full.append(vocab_padded * hidden)
            hf.append(vocab * hidden)
        return max(full), max(hf), max(joined)

    full, hf, joined = stage_tensors(stage)
    own = bucket + max(bucket, hf * esize)
    received = 0.0
    if pp > 1:
        other = max(stage_tensors(s)[1] for s in range(pp) if s != stage)
        received = bucket + max(bucket, other * esize)
    scratch = tp > 1
    return SyncStaging(gather=full * esize if scratch else 0.0, join=joined * esize if scratch else 0.0,
                       own=own, received=received)
