"""Real training checkpoints (tiny actor, DP2 with the distributed optimizer, gloo) verified by
content: a same-size change to the newest one makes every rank fall back to the one before; a
damaged checkpoint named explicitly, or a part that one rank alone cannot read, makes both ranks
raise the same one-line CheckpointError, naming the file, and nobody waits for the other."""

import json
from pathlib import Path

import pytest

from megatron_stare.testing.distributed import run_on_ranks

pytestmark = pytest.mark.distributed


def _save_two(rank, world, root):
    """Two training steps, a checkpoint after each (step_1, step_2)."""
    from megatron_stare.algorithms.stare import StareController
    from megatron_stare.checkpoint.core import save_checkpoint
    from megatron_stare.testing.actor_case import build_case_actor, case_groups, synthetic_samples
    from megatron_stare.testing.megatron_tiny import TINY_SPEC

    groups = case_groups(world, 1, 1, distributed_optimizer=True)
    actor, algo = build_case_actor(groups, lr=1e-4)
    controller = StareController(algo.stare)
    for step in range(2):
        batches = actor.prepare(synthetic_samples(seed=step))
        state = controller.update(actor.compute_logprobs(batches).entropy)
        actor.update(batches, step, state)
        save_checkpoint(root, step + 1, actor=actor, groups=groups, spec=TINY_SPEC,
                        trainer_state={"step": step + 1, "controller": controller.state_dict()})


def _load_all_ways(rank, world, root):
    """What each rank sees: the resume choice (with rank 0's warning), an explicit load of the
    damaged step_2, and a load of step_1 in which rank 1 alone cannot read its rank file."""
    import warnings

    from megatron_stare.checkpoint import core as checkpoint
    from megatron_stare.testing.actor_case import build_case_actor, case_groups
    from megatron_stare.testing.megatron_tiny import TINY_SPEC

    groups = case_groups(world, 1, 1, distributed_optimizer=True)
    actor, _ = build_case_actor(groups, lr=1e-4)
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = checkpoint.latest_complete(root)
    out["chosen"] = chosen.name
    out["warnings"] = [str(w.message) for w in caught if w.category is checkpoint.CheckpointWarning]
    out["step"] = checkpoint.load_checkpoint(chosen, actor=actor, groups=groups, spec=TINY_SPEC)["step"]

    def error(path):
        try:
            checkpoint.load_checkpoint(Path(root) / path, actor=actor, groups=groups, spec=TINY_SPEC)
        except checkpoint.CheckpointError as e:
            return str(e)
        return None

    out["explicit"] = error("step_00000002")
    real = checkpoint._torch

    def unreadable_on_rank1(path):
        if rank == 1:
            raise OSError(f"[Errno 5] Input/output error: '{path}'")
        return real(path)

    checkpoint._torch = unreadable_on_rank1
    out["split"] = error("step_00000001")
    checkpoint._torch = real
    return out


def test_damaged_checkpoints_fall_back_and_errors_agree(tmp_path):
    root = tmp_path / "ckpt"
    run_on_ranks(_save_two, 2, str(root))
    state = root / "step_00000002" / "trainer_state.json"
    text = state.read_text()
    assert json.loads(text)["step"] == 2
    state.write_text(text.replace('"step": 2', '"step": 7'))  # same size, still valid JSON
    r0, r1 = run_on_ranks(_load_all_ways, 2, str(root))
    assert {k: v for k, v in r0.items() if k != "warnings"} == {k: v for k, v in r1.items() if k != "warnings"}
    assert r0["chosen"] == "step_00000001" and r0["step"] == 1
    damage = f"{state} does not match its SHA-256 in the manifest (changed after the save)"
    assert r0["warnings"] == [f"checkpoint {root / 'step_00000002'} is damaged: {damage}; falling back "
                              f"to an earlier one"] and r1["warnings"] == []  # rank 0 says it, once
    assert r0["explicit"] == f"checkpoint {root / 'step_00000002'} is damaged: {damage}"
    assert r0["split"] == (f"rank 1: checkpoint file {root / 'step_00000001' / 'rank_00001.pt'} cannot be "
                           f"read (OSError: [Errno 5] Input/output error: "
                           f"'{root / 'step_00000001' / 'rank_00001.pt'}')")


def test_a_broken_dist_checkpoint_meta_file_is_named(tmp_path):
    """Reading a distributed checkpoint without a manifest (checkpoints_convert): the file is named."""
    import re

    from megatron_stare.checkpoint import dist_ckpt

    (tmp_path / dist_ckpt.META_FILE).write_text("{broken")
    (tmp_path / dist_ckpt.MEGATRON_META).write_text("{}")
    with pytest.raises(ValueError, match=rf"^checkpoint file {re.escape(str(tmp_path / dist_ckpt.META_FILE))} "
                                         rf"cannot be read \(JSONDecodeError"):
        dist_ckpt.read_meta(tmp_path)
