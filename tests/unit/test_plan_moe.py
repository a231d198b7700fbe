"""The dry-run planner on Qwen3-30B-A3B (``plan/moe.py``): expert weights at 1/ep of the routed
experts, their optimizer state over expert-data-parallel, the dispatcher's buffers and the
routing-replay tensors, against hand-computed values; offload counts the experts' state."""

import json
from pathlib import Path

import pytest

from megatron_stare.config.load import ConfigError, load_config
from megatron_stare.plan.planner import GiB, estimate_memory, param_counts

ROOT = Path(__file__).resolve().parents[2]
HF = json.loads((ROOT / "examples" / "configs" / "qwen3-30b-a3b.json").read_text())
YAML = str(ROOT / "examples" / "qwen3_30b_a3b.yaml")


def test_param_counts_qwen3_30b_a3b():
    c = param_counts(HF)
    h, E, I, L = 2048, 128, 768, 48
    assert c.experts == E * 3 * h * I and c.mlp == E * h  # the router; no shared expert
    assert c.attention == h * 4096 + 2 * h * 512 + 4096 * h and c.norms == 2 * h + 2 * 128
    assert c.total == 2 * 151936 * h + L * (c.attention + c.mlp + c.norms + c.experts) + h == 30_532_122_624


def test_expert_weights_optimizer_dispatcher_and_routes_by_hand():
    plan = estimate_memory(load_config(YAML), HF, world_size=32, gpu_mem_gb=80)
    c, m = param_counts(HF), plan.moe
    assert (plan.layout.tp, plan.layout.pp, plan.layout.dp, m.ep, m.edp) == (2, 2, 8, 8, 2)
    experts = 24 * c.experts / 8  # 24 layers a stage, 16 of 128 experts a rank
    assert m.expert_params == experts and m.num_experts // m.ep == 16
    dense = 24 * (c.attention + c.mlp) / 2 + 24 * c.norms + 2048 + 152064 * 2048 / 2  # stage 1
    assert plan.stage == 1
    assert plan.weights_gib == pytest.approx(2 * (dense + experts) / GiB)
    assert plan.main_grads_gib == pytest.approx(4 * (dense + experts) / GiB)
    assert plan.optimizer_gib == pytest.approx(12 * (dense / 8 + experts / 2) / GiB)
    tokens = 20480 / 2  # the micro-batch over sequence parallel: what one rank's routers see
    assert plan.dispatcher_gib == pytest.approx(2 * 2 * 8 * tokens * 2048 * 1.5 / GiB)
    per_token = (48 + 24) * 8 * 2  # r3: every layer's engine routes + the stage's record, int16
    assert m.routing_bytes_per_token == per_token
    assert plan.routing_gib == pytest.approx(64 * 8 * 10240 / 8 * per_token / GiB)
    assert plan.fits and "16 experts per rank" in plan.format()
    r2 = estimate_memory(load_config(YAML, ["rollout.routing_replay=r2"]), HF, 32, 80)
    none = estimate_memory(load_config(YAML, ["rollout.routing_replay=none"]), HF, 32, 80)
    assert r2.routing_gib == pytest.approx(plan.routing_gib / 3) and none.routing_gib == 0
    plain = estimate_memory(load_config(YAML, ["parallel.distributed_optimizer=false"]), HF, 32, 80)
    assert plain.optimizer_gib == pytest.approx(12 * (dense + experts) / GiB)
    # Offload 'optimizer' frees the experts' grads and optimizer state with the rest.
    off = estimate_memory(load_config(YAML, ["trainer.offload=optimizer"]), HF, 32, 80)
    assert off.layout.offload.freed_gib == pytest.approx(off.main_grads_gib + off.optimizer_gib)
    assert off.phases["generate"] == pytest.approx(plan.phases["generate"] - off.layout.offload.freed_gib)


def test_bad_expert_grid_is_one_line():
    with pytest.raises(ConfigError, match="does not divide the 128 experts") as e:
        estimate_memory(load_config(YAML, ["parallel.ep=3", "parallel.tp=1", "parallel.sequence_parallel=false"]), HF, 24, 80)
    assert "\n" not in str(e.value)
