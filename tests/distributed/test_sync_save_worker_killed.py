"""A synchronous checkpoint save (``checkpoint.async_save=false``) whose file worker is killed alone
(the OOM killer's pick) at 2 gloo ranks, DP2 with Megatron's distributed optimizer:

megatron-core's rank waits for its forked file workers with no timeout, so before the watch
(``checkpoint_writer._watched_multiproc``) the rank hung and the other rank waited for it in the
gather of the write results. Now every rank raises the same one ``CheckpointError`` line naming
the rank, the worker and the signal, within seconds; the save's other workers are gone; the
partial directory is removed and the previous checkpoint stays the latest; the rank's signal
handler is restored, and the next save succeeds.
"""

import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from megatron_stare.testing.distributed import run_on_ranks

pytestmark = pytest.mark.distributed


def _case(rank, world, root):
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_stare.checkpoint import writer as checkpoint_writer
    from megatron_stare.checkpoint.core import CheckpointError, latest_complete, save_checkpoint
    from megatron_stare.checkpoint.dist_ckpt import _allocate_torch_adam_state
    from megatron_stare.testing.actor_case import build_case_actor, case_groups
    from megatron_stare.testing.save_faults import slow_writer_open

    root = Path(root)
    groups = case_groups(world, 1, 1, distributed_optimizer=True)
    actor, _ = build_case_actor(groups)
    _allocate_torch_adam_state(actor.optimizer)
    kw = dict(actor=actor, groups=groups, spec=actor.spec)
    out = {}
    save_checkpoint(root, 1, trainer_state={"step": 1}, **kw)
    handler_before = signal.getsignal(signal.SIGUSR2)

    me = psutil.Process()
    killed, others = [], []
    if rank == 1:
        filesystem_async.open = slow_writer_open(60.0)  # a worker holds its file open, writing slowly
        before = {p.pid for p in me.children()}

        def kill_one_worker():
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                new = [p for p in me.children() if p.pid not in before]
                if new:
                    time.sleep(2.0)  # every worker of the write has started and opened its file
                    workers = [p for p in me.children() if p.pid not in before]
                    killed.append(workers[0].pid)
                    others.extend(workers[1:])
                    workers[0].kill()
                    return
                time.sleep(0.05)
        threading.Thread(target=kill_one_worker, daemon=True).start()
    t0 = time.monotonic()
    try:
        save_checkpoint(root, 2, trainer_state={"step": 2}, **kw)
        out["error"] = None
    except CheckpointError as e:
        out["error"] = str(e)
    out["wait_s"] = time.monotonic() - t0
    filesystem_async.open = checkpoint_writer._writer_open
    _, alive = psutil.wait_procs(others, timeout=10)
    out["killed"], out["others"], out["others_alive"] = killed, len(others), [p.pid for p in alive]
    out["handler_restored"] = signal.getsignal(signal.SIGUSR2) == handler_before
    dist.barrier()
    out["left"] = sorted(p.name for p in root.iterdir())
    out["latest"] = latest_complete(root).name
    save_checkpoint(root, 3, trainer_state={"step": 3}, **kw)  # the rank is still usable
    out["latest_after"] = latest_complete(root).name
    return out


def test_a_killed_file_worker_of_a_synchronous_save_is_one_line_on_every_rank(tmp_path):
    results = run_on_ranks(_case, 2, str(tmp_path), timeout=300)
    for r in results:
        assert r["error"] is not None and r["error"] == results[0]["error"], r["error"]
        assert "saving step 2" in r["error"], r["error"]
        assert "a file worker of rank 1 was killed by SIGKILL" in r["error"], r["error"]
        assert "out-of-memory killer" in r["error"] and "async_save" not in r["error"], r["error"]
        assert r["error"].endswith("step_00000001 stays the latest checkpoint"), r["error"]
        assert r["wait_s"] < 30, r["wait_s"]  # not the workers' 60 s, nor a hang
        assert r["handler_restored"]
        assert r["left"] == ["step_00000001"] and r["latest"] == "step_00000001"
        assert r["latest_after"] == "step_00000003"
    assert len(results[1]["killed"]) == 1
    assert results[1]["others_alive"] == []  # the write's other workers were killed with it
