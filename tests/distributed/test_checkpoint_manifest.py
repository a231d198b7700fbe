"""Checkpoint manifests at 2 gloo ranks: content checksums written and verified together, one
verdict on every rank (also when one rank's view differs), naming the damaged file."""

import json
import os
from pathlib import Path

import pytest

from megatron_stare.checkpoint import manifest as cm
from megatron_stare.testing.distributed import run_on_ranks

pytestmark = pytest.mark.distributed


def _fake_checkpoint(d: Path, rank: int) -> None:
    """What a save leaves before its manifest: per-rank files, dist-ckpt shards, shared files."""
    (d / "model").mkdir(parents=True, exist_ok=True)
    (d / f"rank_{rank:05d}.pt").write_bytes(os.urandom(3000 + rank))
    (d / "model" / f"__{rank}_0.distcp").write_bytes(os.urandom(5000))
    if rank == 0:
        (d / "trainer_state.json").write_text(json.dumps({"step": 4, "sampler": [1, 2, 3]}))
        (d / "model" / "metadata.json").write_text("{}")


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _scenarios(rank, world, root):
    """Each rank's verdicts over a sequence of damages (rank 0 damages, both verify)."""
    import torch.distributed as dist

    root = Path(root)
    d = root / "step_00000004"
    _fake_checkpoint(d, rank)
    dist.barrier()
    cm.write_manifest(d, 4)
    out = {"clean": cm.verify(d)}
    manifest = json.loads((d / cm.COMPLETE).read_text())

    def damaged(name, damage):
        if rank == 0:
            saved = (d / name).read_bytes()
            damage(d / name)
        dist.barrier()
        out[name] = cm.verify(d)
        dist.barrier()
        if rank == 0:
            (d / name).write_bytes(saved)
        dist.barrier()

    damaged("trainer_state.json", lambda p: p.write_text(p.read_text().replace("4", "5")))  # same size
    damaged("model/__1_0.distcp", _flip_byte)  # a shard rank 1 wrote (and checks)
    damaged("rank_00000.pt", lambda p: p.write_bytes(p.read_bytes()[:-1]))
    damaged("model/metadata.json", lambda p: p.unlink())
    damaged(cm.COMPLETE, lambda p: p.write_text('{"files": '))
    # One rank's view differs (here: rank 1 reads a different digest for a file only it checks);
    # a rank-local verdict would split the job.
    real = cm.file_sha256
    cm.file_sha256 = lambda p: "0" * 64 if rank == 1 and p.name == "__1_0.distcp" else real(p)
    out["split_view"] = cm.verify(d)
    cm.file_sha256 = real
    out["first_problem"] = cm.first_problem("cannot read my part" if rank == 1 else None)
    out["no_problem"] = cm.first_problem(None)
    out["shares"] = cm.shares({n: e["size"] for n, e in manifest["files"].items()}, world)[rank]
    out["format"] = (manifest["format"], sorted(manifest["files"]))
    return out


def test_manifest_verdicts_agree_and_name_the_file(tmp_path):
    r0, r1 = run_on_ranks(_scenarios, 2, str(tmp_path))
    d = tmp_path / "step_00000004"
    assert {k: v for k, v in r0.items() if k != "shares"} == {k: v for k, v in r1.items() if k != "shares"}
    assert r0["clean"] is None
    assert r0["format"] == (2, ["model/__0_0.distcp", "model/__1_0.distcp", "model/metadata.json",
                                "rank_00000.pt", "rank_00001.pt", "trainer_state.json"])
    assert r0["trainer_state.json"] == (f"{d}/trainer_state.json does not match its SHA-256 in the "
                                        f"manifest (changed after the save)")
    assert r0["model/__1_0.distcp"].startswith(f"{d}/model/__1_0.distcp does not match its SHA-256")
    assert r0["rank_00000.pt"].startswith(f"{d}/rank_00000.pt has 2999 bytes, the manifest says 3000")
    assert r0["model/metadata.json"] == f"{d}/model/metadata.json is missing"
    assert r0[cm.COMPLETE].startswith(f"{d}/COMPLETE is not a valid manifest (JSONDecodeError")
    assert r0["split_view"].startswith(f"{d}/model/__1_0.distcp does not match its SHA-256")
    assert r0["first_problem"] == "rank 1: cannot read my part" and r0["no_problem"] is None
    # Writers hash their own files; the shared rest is balanced.
    assert {"rank_00000.pt", "model/__0_0.distcp"} <= set(r0["shares"])
    assert {"rank_00001.pt", "model/__1_0.distcp"} <= set(r1["shares"])
    assert sorted(r0["shares"] + r1["shares"]) == r0["format"][1]


def test_single_process_and_sizes_only_manifests(tmp_path):
    """Without a process group it is the same check; a format-1 manifest (sizes only, older
    saves) is checked by size, so it cannot see a same-size change."""
    d = tmp_path / "step_00000001"
    _fake_checkpoint(d, 0)
    cm.write_manifest(d, 1)
    assert cm.verify(d) is None
    sizes = {n: e["size"] for n, e in json.loads((d / cm.COMPLETE).read_text())["files"].items()}
    (d / cm.COMPLETE).write_text(json.dumps({"step": 1, "files": sizes}))
    _flip_byte(d / "rank_00000.pt")
    assert cm.verify(d) is None
    (d / "rank_00000.pt").write_bytes(b"short")
    assert "rank_00000.pt has 5 bytes" in cm.verify(d)
    assert cm.verify(tmp_path / "step_00000009") == f"{tmp_path}/step_00000009/COMPLETE is missing (the save did not finish)"
