"""Background checkpoints on one CUDA GPU (skipped without CUDA or megatron-core): the trainer
with ``checkpoint.async_save=true`` (bf16, distributed optimizer, NCCL) saves every step in the
background: megatron-core stages the tensors device to host, forks its writer after CUDA is
initialised (the writer never touches CUDA), and the finalization's collectives run on NCCL. The
checkpoints are complete and verified, no hash sidecar is left, and a resume continues from the
last one. Untested on CPU: the device-to-host staging, a fork of a CUDA process, NCCL."""

import pytest
import torch

from tests.gpu.test_train_gpu import _train

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_background_saves_on_gpu_complete_and_resume(tmp_path):
    pytest.importorskip("megatron.core", reason="needs megatron-core (scripts/gpu_check.sh installs it)")
    from megatron_stare.checkpoint.core import latest_complete, list_checkpoints
    from megatron_stare.rewards.synthetic import make_task, write_jsonl
    from megatron_stare.testing.hf_models import build_tiny_hf_model

    build_tiny_hf_model("qwen2", tmp_path / "model", num_layers=2)
    write_jsonl(make_task("add", 16, seed=0, digits=1), tmp_path / "train.jsonl")
    run = tmp_path / "run"
    # keep_last=2: the background finalization also prunes the oldest.
    out = _train(tmp_path, run, "trainer.total_steps=3", "checkpoint.async_save=true", "checkpoint.keep_last=2")
    assert out.stdout.count("saved checkpoint") == 3, out.stdout[-3000:]
    assert [p.name for p in list_checkpoints(run / "ckpt")] == [f"step_{s:08d}" for s in (2, 3)]
    assert latest_complete(run / "ckpt").name == "step_00000003"
    assert not list((run / "ckpt").rglob("*.sha256")) and not list((run / "ckpt").glob(".*partial"))
    out = _train(tmp_path, run, "trainer.total_steps=4", "checkpoint.async_save=true", "checkpoint.keep_last=2")
    assert "resumed from" in out.stdout and "step_00000003" in out.stdout
    assert [p.name for p in list_checkpoints(run / "ckpt")] == [f"step_{s:08d}" for s in (3, 4)]
