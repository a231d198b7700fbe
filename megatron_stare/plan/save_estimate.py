"""How long a training checkpoint takes to write, and whether a SLURM recipe's warning lead
(``#SBATCH --signal=...@N``) leaves room for it.

Bytes: a checkpoint holds the bf16 (or fp32) weights plus the fp32 main params and both Adam
moments (12 bytes a parameter): 14 bytes a parameter in bf16 training, 61 + 366 GiB at 32B.
Every rank writes its share (the fully-parallel save splits replicas over DP x CP), so the
time is the bytes over the nodes' aggregate write bandwidth, plus the manifest's SHA-256 pass
(``checkpoint/manifest.py``: a re-read at about 0.7x the write time).

``NODE_WRITE_GIBPS`` is an assumption (a parallel file system's per-node share), not a
measurement on the target cluster; ``plan.py`` prints the estimate so that it can be compared.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

#: Assumed write bandwidth of one node into the checkpoint file system (GiB/s).
NODE_WRITE_GIBPS = 2.0
#: Hashing cost relative to the write (benchmarks/bench_checkpoint_hash.py: ~0.7x).
HASH_FACTOR = 0.7
#: SLURM delivers ``--signal`` up to this many seconds early or late (its event resolution).
SLURM_SIGNAL_SLACK_S = 60


@dataclass(frozen=True)
class SaveEstimate:
    """One checkpoint's size and write time at a layout."""

    total_bytes: float
    seconds: float

    def format(self) -> str:
        return (f"checkpoint save: {self.total_bytes / 2**30:.0f} GiB, about {self.seconds:.0f} s "
                f"(at {NODE_WRITE_GIBPS:g} GiB/s a node, SHA-256 pass included)")


def estimate_save(num_params: float, nodes: int, *, bf16: bool = True,
                  node_gibps: float = NODE_WRITE_GIBPS) -> SaveEstimate:
    """The size and synchronous write time of a checkpoint of ``num_params`` parameters."""
    total = num_params * ((2 if bf16 else 4) + 12)
    seconds = total / (nodes * node_gibps * 2**30) * (1 + HASH_FACTOR)
    return SaveEstimate(total, seconds)


def signal_lead_s(sbatch: Path) -> Optional[int]:
    """The ``@N`` of ``#SBATCH --signal=...@N`` in a job script, or None."""
    m = re.search(r"^#SBATCH\s+--signal=\S*@(\d+)\s*$", Path(sbatch).read_text(), re.M)
    return int(m.group(1)) if m else None


def check_lead(lead_s: int, grace_s: int, save: SaveEstimate) -> Optional[str]:
    """None when the scheduler's lead covers the grace period (plus SLURM's slack) and the grace
    covers a save; else one line naming the shortfall and the fix."""
    if lead_s < grace_s + SLURM_SIGNAL_SLACK_S:
        return (f"--signal lead {lead_s} s is under PREEMPT_GRACE_S={grace_s} s + {SLURM_SIGNAL_SLACK_S} s "
                f"(SLURM's signal slack): raise the lead to >= {grace_s + SLURM_SIGNAL_SLACK_S}")
    if grace_s < save.seconds:
        return (f"PREEMPT_GRACE_S={grace_s} s is shorter than the estimated save ({save.format()}): "
                f"raise it (and the --signal lead) to >= {save.seconds + SLURM_SIGNAL_SLACK_S:.0f} s")
    return None
