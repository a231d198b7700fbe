"""The project's side of ``bench_vs_trl.py``: ``python -m megatron_stare.train`` under torchrun,
with what the benchmark needs added (for the benchmark only):

- each step waits for the driver's ``go_<k>`` file in ``$BENCH_GATE`` and rank 0 answers with
  ``done_<k>.json`` (the step's wall time, its metrics and its sequences' lengths), so that the
  driver can interleave the steps with TRL's while this world sleeps;
- ``BENCH_PROFILE_STEP=k``: step ``k``'s training phase runs under ``torch.profiler`` and each
  rank writes its op table to ``profile_rank<r>.txt`` in the gate directory.

Usage (by the driver): ``BENCH_GATE=DIR torchrun --standalone --nproc-per-node 2
benchmarks/_vs_trl_project.py --config ... a.b=c ...``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from megatron_stare import train

GATE = Path(os.environ["BENCH_GATE"])
_step = train.Trainer.step
_train = train.Trainer.train


def wait_for(path: Path, poll_s: float = 0.02) -> None:
    while not path.exists():
        time.sleep(poll_s)


def recorded_train(self, samples, step: int):
    self.bench_seq_lens = [s.num_tokens for s in samples]  # prompt + response, the whole batch
    if step != int(os.environ.get("BENCH_PROFILE_STEP", "-1")):
        return _train(self, samples, step)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = _train(self, samples, step)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    (GATE / f"profile_rank{os.environ.get('RANK', '0')}.txt").write_text(table)
    return out


def gated_step(self, step: int) -> dict:
    wait_for(GATE / f"go_{step}")
    t0 = time.perf_counter()
    metrics = _step(self, step)
    dt = time.perf_counter() - t0
    if int(os.environ.get("RANK", "0")) == 0:
        numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        tmp = GATE / f"done_{step}.tmp"
        tmp.write_text(json.dumps({"step_s": dt, "metrics": numbers, "seq_lens": self.bench_seq_lens}))
        tmp.rename(GATE / f"done_{step}.json")
    return metrics


train.Trainer.step = gated_step
train.Trainer.train = recorded_train

if __name__ == "__main__":
    sys.exit(train.main(sys.argv[1:]))
