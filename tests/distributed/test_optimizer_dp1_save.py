"""The DP1 distributed-optimizer save without megatron-core's gather (``checkpoint/optimizer_dp1.py``),
at 2 gloo ranks, TP2 DP1, bf16 with the distributed optimizer:

- the fast path is taken on every rank (and only for saving);
- a background save through it, whose optimizer state and weights are changed in place right
  after it starts (no copy is made: the writer's fork is the snapshot), writes tensor files
  byte-for-byte equal to a synchronous save of the same state through megatron-core's own path.
"""

import contextlib
import hashlib
from pathlib import Path

import pytest
import torch

from megatron_stare.testing.distributed import run_on_ranks

pytestmark = pytest.mark.distributed


def _case(rank, world, root):
    from megatron_stare.checkpoint.async_save import BackgroundSaves
    from megatron_stare.checkpoint.core import save_checkpoint
    from megatron_stare.checkpoint import dist_ckpt
    from megatron_stare.checkpoint import optimizer_dp1
    from megatron_stare.checkpoint.dist_ckpt import _allocate_torch_adam_state
    from megatron_stare.testing.actor_case import build_case_actor, case_groups

    root = Path(root)
    groups = case_groups(world, 2, 1, distributed_optimizer=True)
    actor, _ = build_case_actor(groups, dtype=torch.bfloat16)
    _allocate_torch_adam_state(actor.optimizer)
    g = torch.Generator().manual_seed(rank)
    for o in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        for state in o.optimizer.state.values():
            for t in state.values():
                if isinstance(t, torch.Tensor) and t.dim():
                    t.copy_(torch.rand(t.shape, generator=g))
    kw = dict(actor=actor, groups=groups, spec=actor.spec, trainer_state={"step": 0})

    fast = dist_ckpt.optimizer_dp1.dp1_fully_reshardable
    dist_ckpt.optimizer_dp1 = type("Off", (), {"dp1_fully_reshardable": staticmethod(
        lambda opt: contextlib.nullcontext())})
    save_checkpoint(root, 1, **kw)  # megatron-core's own path
    dist_ckpt.optimizer_dp1 = optimizer_dp1

    taken = []
    real = optimizer_dp1._param_state
    optimizer_dp1._param_state = lambda *a: taken.append(1) or real(*a)
    saves = BackgroundSaves(True)
    save_checkpoint(root, 2, background=saves, **kw)
    with torch.no_grad():  # the next step's updates, in place: the save must not see them
        for p in actor.model.parameters():
            p.add_(1.0)
        for o in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
            for state in o.optimizer.state.values():
                for t in state.values():
                    if isinstance(t, torch.Tensor) and t.dim():
                        t.mul_(2.0)
    saves.wait()
    optimizer_dp1._param_state = real
    assert fast is optimizer_dp1.dp1_fully_reshardable

    def digests(step):
        d = root / f"step_{step:08d}"
        return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(d.rglob("*.distcp"))}

    return {"taken": len(taken), "sync": digests(1), "fast": digests(2)}


def test_dp1_save_skips_the_gather_and_writes_the_same_bytes(tmp_path):
    results = run_on_ranks(_case, 2, str(tmp_path))
    for r in results:
        assert r["taken"] >= 1  # the save went through the fast path
    r = results[0]
    assert any(n.startswith("optimizer/") for n in r["sync"]) and any(n.startswith("model/") for n in r["sync"])
    assert r["fast"] == r["sync"], "the fast DP1 save differs from megatron-core's own"
