"""``trainer.offload`` in the trainer's step (``offload.py``, ``train.py``): two steps of the tiny
CPU recipe (2 ranks, TP2, the hf engine on the driver, a checkpoint after each step) with
``trainer.offload=all`` give the same metrics and the same weights, bit-exact, as without; the
onload and offload phases run where ``runtime/phases.py`` puts them; and between steps (while
the engine generates) the state is off the device, saves and all."""

import os
from pathlib import Path

import pytest
import torch

from megatron_stare.testing.distributed import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _run(rank, world, assets: Path, offload: str):
    from megatron_stare.config.load import load_config
    from megatron_stare.preflight.checks import validate_config
    from megatron_stare.testing.actor_case import gather_full_model
    from megatron_stare.train import Trainer

    over = [f"model.path={assets / 'model'}", f"data.train_path={assets / 'train.jsonl'}",
            f"logging.dir={assets / ('logs_' + offload)}", "logging.tensorboard=false",
            f"checkpoint.dir={assets / ('ckpt_' + offload)}", "checkpoint.save_every=1", "trainer.total_steps=2",
            "trainer.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=8", "rollout.temperature=0.7",
            f"trainer.offload={offload}", "algorithm.stare.target_entropy=10.0", "optimizer.lr=1e-3"]
    cfg = validate_config(load_config(str(ROOT / "examples" / "tiny_cpu.yaml"), over), world_size=world)
    tr = Trainer(cfg)
    rows, phases, between = [], [], []
    real_generate = tr.generate

    def generate(prompts, params):  # what is off the device while the engine generates
        between.append(tr.offload.offloaded_bytes)
        return real_generate(prompts, params)

    tr.generate = generate
    try:
        tr.handover.first_sync()
        for s in range(2):
            m = tr.step(s)
            rows.append({k: v for k, v in m.items() if not k.startswith(("time/", "perf/", "sync/"))})
            phases.append(list(tr.phases_run))
            tr.save(s + 1)
        params = sum(p.numel() * p.element_size() for p in tr.actor.module.parameters())
        at_end = tr.offload.offloaded_bytes
        tr.offload.onload()
        return {"rows": rows, "phases": phases, "between": between, "params_bytes": params,
                "weights": gather_full_model(tr.actor), "offloaded_at_end": at_end}
    finally:
        tr.close()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from megatron_stare.rewards.synthetic import make_task, write_jsonl
    from megatron_stare.testing.hf_models import build_tiny_hf_model

    d = tmp_path_factory.mktemp("offload_train")
    build_tiny_hf_model("qwen2", d / "model", num_layers=2)
    write_jsonl(make_task("add", 32, seed=0, digits=1), d / "train.jsonl")
    return d


def test_offload_all_trains_the_same(assets):
    plain = run_on_ranks(_run, 2, assets, "none")
    off = run_on_ranks(_run, 2, assets, "all")
    for p, o in zip(plain, off):
        assert p["rows"] == o["rows"]
        assert p["weights"].keys() == o["weights"].keys()
        assert all(torch.equal(w, o["weights"][n]) for n, w in p["weights"].items())
        assert p["between"] and set(p["between"]) == {0}
        # params (fp32: also the main params), fp32 grads, Adam's moments: >= 4 x the params
        assert len(o["between"]) == 2 and all(b >= 4 * o["params_bytes"] for b in o["between"][1:])
        assert o["between"][0] >= 2 * o["params_bytes"]  # before the first step: no moments yet
        assert o["offloaded_at_end"] == o["between"][1]  # the save left it offloaded
        for ph in o["phases"]:
            assert ph[-7:] == ["release", "onload", "train", "resume_w", "sync", "offload", "resume_kv"]
