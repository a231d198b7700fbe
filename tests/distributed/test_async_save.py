"""Background checkpoints (``checkpoint.async_save``, ``async_save.py``) at 2 gloo ranks, DP2 with
Megatron's distributed optimizer (the fully-parallel save over DP):

- the save returns before its directory exists; the weights and optimizer state changed after
  it do not reach it (the writer holds the state of the save's step boundary); after the
  finalization it is the latest checkpoint, verified, and loads back to the saved state;
- its tensor files are hashed as written: the manifest's digests equal the files' SHA-256, and
  no tensor file was read back to compute them (only the small files are); no sidecar remains;
- never two in flight: a second save finalizes the first before it starts;
- a write error in a writer worker on one rank (ENOSPC) is one ``CheckpointError`` line on every
  rank at the finalization, naming the cause; the partial directory is removed and the previous
  checkpoint stays the latest;
- a writer process killed alone (the OOM killer's SIGKILL) takes its file workers with it, and the
  finalization names that rank's writer and the signal on every rank, without waiting; a file
  worker killed alone ends its writer (which would wait for it forever) and is named alike.
"""

import errno
import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch

from megatron_stare.testing.distributed import run_on_ranks

pytestmark = pytest.mark.distributed


def _wait_for_error(saves):
    """(the ``CheckpointError`` line of finalizing the save in flight, or None; seconds it took)."""
    from megatron_stare.checkpoint.core import CheckpointError

    t0 = time.monotonic()
    try:
        saves.wait()
        return None, time.monotonic() - t0
    except CheckpointError as e:
        return str(e), time.monotonic() - t0


def _case(rank, world, root):
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_stare.checkpoint import manifest as checkpoint_manifest
    from megatron_stare.checkpoint import writer as checkpoint_writer
    from megatron_stare.checkpoint.async_save import BackgroundSaves
    from megatron_stare.checkpoint.core import CheckpointError, latest_complete, load_checkpoint, save_checkpoint
    from megatron_stare.checkpoint.manifest import file_sha256
    from megatron_stare.checkpoint.dist_ckpt import _allocate_torch_adam_state
    from megatron_stare.testing.actor_case import build_case_actor, case_groups, gather_full_model
    from megatron_stare.testing.optimizer_state import gather_optimizer_state
    from megatron_stare.testing.save_faults import slow_writer_open

    root = Path(root)
    groups = case_groups(world, 1, 1, distributed_optimizer=True)
    actor, _ = build_case_actor(groups, dtype=torch.bfloat16)
    _allocate_torch_adam_state(actor.optimizer)  # Adam moments exist (as after a step)
    out = {"done": []}
    saves = BackgroundSaves(True, done=lambda p: out["done"].append(p.name))
    kw = dict(actor=actor, groups=groups, spec=actor.spec)

    read_back = []
    real_sha = checkpoint_manifest.file_sha256
    checkpoint_manifest.file_sha256 = lambda p: read_back.append(str(p)) or real_sha(p)
    weights, opt_state = gather_full_model(actor), gather_optimizer_state(actor.optimizer, actor.model, groups)
    out["returned"] = save_checkpoint(root, 1, trainer_state={"step": 1}, background=saves, **kw)
    out["exists_before_finalize"] = (root / "step_00000001").exists()
    out["partial_before_finalize"] = (root / ".step_00000001.partial").is_dir()
    with torch.no_grad():  # the trainer goes on: the save must not see this
        for p in actor.model.parameters():
            p.add_(1.0)
        for o in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
            for state in o.optimizer.state.values():
                for t in state.values():
                    if isinstance(t, torch.Tensor) and t.dim():
                        t.add_(1.0)
    saves.wait()
    checkpoint_manifest.file_sha256 = real_sha
    d = latest_complete(root)
    out["latest"] = d.name
    out["read_back"] = read_back
    out["sidecars"] = [str(p) for p in d.rglob("*.sha256")]
    if rank == 0:
        files = json.loads((d / "COMPLETE").read_text())["files"]
        out["digests_match"] = all(file_sha256(d / n) == e["sha256"] for n, e in files.items())
        out["distcp"] = sorted(n for n in files if n.endswith(".distcp"))
    load_checkpoint(d, **kw)
    out["weights_equal"] = all(torch.equal(w, gather_full_model(actor)[n]) for n, w in weights.items())
    loaded = gather_optimizer_state(actor.optimizer, actor.model, groups)
    out["optimizer_equal"] = all(torch.equal(t, loaded[n][k]) for n, s in opt_state.items() for k, t in s.items())

    # Never two in flight: step 3's save finalizes step 2's first. Step 3's meets a full disk in
    # rank 1's writer workers, found at its finalization.
    save_checkpoint(root, 2, trainer_state={"step": 2}, background=saves, **kw)
    out["pending_after_2"] = saves.pending
    if rank == 1:
        def full_disk(*args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        filesystem_async.open = full_disk  # the forked writer's workers open their files with it
    save_checkpoint(root, 3, trainer_state={"step": 3}, background=saves, **kw)
    out["step2_complete_when_3_starts"] = (root / "step_00000002" / "COMPLETE").is_file()
    out["pending_after_3"] = saves.pending
    try:
        saves.wait()
        out["error"] = None
    except CheckpointError as e:
        out["error"] = str(e)
    out["pending_after_error"] = saves.pending
    dist.barrier()
    out["left"] = sorted(p.name for p in root.iterdir())
    out["latest_after_error"] = latest_complete(root).name

    # Step 4: rank 1's writer is killed alone mid-write (the OOM killer's pick), its rank lives on.
    filesystem_async.open = checkpoint_writer._writer_open  # undo step 3's full disk
    if rank == 1:
        filesystem_async.open = slow_writer_open(60.0)  # a worker holds its file open, writing slowly
    save_checkpoint(root, 4, trainer_state={"step": 4}, background=saves, **kw)
    helpers = []
    if rank == 1:
        writer = psutil.Process(saves.queue.async_calls[0].async_caller.process.pid)
        time.sleep(2.0)  # its file workers have started and opened their files
        helpers = [writer] + writer.children(recursive=True)
        os.kill(writer.pid, signal.SIGKILL)
    out["killed_error"], out["killed_wait_s"] = _wait_for_error(saves)
    _, alive = psutil.wait_procs(helpers, timeout=10)
    out["helpers"], out["helpers_alive"] = len(helpers), [p.pid for p in alive]
    dist.barrier()
    out["latest_after_kill"] = latest_complete(root).name

    # Step 5: one of rank 1's file workers is killed alone; its writer would wait for it forever.
    save_checkpoint(root, 5, trainer_state={"step": 5}, background=saves, **kw)
    helpers = []
    if rank == 1:
        writer = psutil.Process(saves.queue.async_calls[0].async_caller.process.pid)
        time.sleep(2.0)
        helpers = writer.children(recursive=True)
        os.kill(helpers[0].pid, signal.SIGKILL)
        helpers.append(writer)
    out["worker_error"], out["worker_wait_s"] = _wait_for_error(saves)
    _, alive = psutil.wait_procs(helpers, timeout=10)
    out["worker_helpers_alive"] = [p.pid for p in alive]
    filesystem_async.open = checkpoint_writer._writer_open
    dist.barrier()
    out["latest_after_worker"] = latest_complete(root).name
    return out


def test_background_save_is_finalized_hashed_as_written_and_named_on_error(tmp_path):
    results = run_on_ranks(_case, 2, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["returned"] is None and not r["exists_before_finalize"] and r["partial_before_finalize"]
        assert r["latest"] == "step_00000001"
        assert r["weights_equal"] and r["optimizer_equal"], "the background save saw later changes"
        assert r["sidecars"] == []
        assert not [p for p in r["read_back"] if p.endswith(".distcp")], r["read_back"]
        assert r["pending_after_2"] == 2 and r["step2_complete_when_3_starts"] and r["pending_after_3"] == 3
        assert r["done"] == ["step_00000001", "step_00000002"]
        assert r["error"] is not None and r["error"] == results[0]["error"]
        assert "saving step 3" in r["error"] and "No space left on device" in r["error"], r["error"]
        assert r["error"].endswith("step_00000002 stays the latest checkpoint"), r["error"]
        assert r["pending_after_error"] is None
        assert r["left"] == ["step_00000001", "step_00000002"]
        assert r["latest_after_error"] == "step_00000002"
        assert r["killed_error"] is not None and r["killed_error"] == results[0]["killed_error"], r["killed_error"]
        assert "saving step 4" in r["killed_error"], r["killed_error"]
        assert "rank 1's writer process was killed by SIGKILL" in r["killed_error"], r["killed_error"]
        assert "out-of-memory killer" in r["killed_error"] and "stays the latest" in r["killed_error"]
        assert r["helpers_alive"] == []  # the killed writer's file workers died with it
        assert r["killed_wait_s"] < 30 and r["latest_after_kill"] == "step_00000002"
        assert r["worker_error"] is not None and r["worker_error"] == results[0]["worker_error"], r["worker_error"]
        assert "saving step 5" in r["worker_error"], r["worker_error"]
        assert "a file worker of rank 1's writer was killed by SIGKILL" in r["worker_error"], r["worker_error"]
        assert r["worker_wait_s"] < 30 and r["worker_helpers_alive"] == [] and r["latest_after_worker"] == "step_00000002"
    assert results[1]["helpers"] >= 2  # the writer and at least one file worker were there to die
    assert results[0]["digests_match"] and len(results[0]["distcp"]) >= 4  # both ranks wrote, 2 files each
    assert any(p.endswith("rank_00000.pt") for p in results[0]["read_back"])  # the small files are read
