"""SGLang's mixture-of-experts path, built from a config file and checked against SGLang's recorded
API (it cannot run on CPU; ``tests/gpu/test_sglang_gpu.py`` runs it for real): expert parallel over
the engine's TP group (``ep_size``), ``enable_return_routed_experts`` for routing replay, the
``meta_info["routed_experts"]`` (base64 int32 ``[P + T - 1, num_hidden_layers, topk]``) read
into ``GenerationResult.routed_experts`` (MoE layers only, int16)."""

import base64
import dataclasses

import numpy as np
import pytest
import torch
import yaml

from megatron_stare.config.load import load_config
from megatron_stare.preflight.checks import validate_config
from megatron_stare.models.tiny import build_tiny_hf_model
from megatron_stare.rollout import EngineSpec, EngineWorld
from megatron_stare.rollout.engines.sglang.engine import colocated_command, engine_kwargs
from megatron_stare.rollout.engines.sglang_server.engine import server_command, to_result

from ..fixtures.fake_sglang.sglang.launch_server import fake_generation
from .test_rollout_sglang import API, _parse_flags, _type_ok

MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])
WORLD = EngineWorld(rank=0, world_size=4, local_rank=0, local_world_size=4, cuda=True)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return build_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("sgl") / "m", num_layers=3, ffn_hidden_size=96,
                               moe=MOE)


def _spec(tmp_path, model, engine="sglang", **extra):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"path": str(model), "dtype": "bfloat16"}, "data": {"max_prompt_length": 100},
        "rollout": {"engine": engine, "tp": 2, "max_new_tokens": 28, **extra}, "trainer": {"seed": 7}}))
    cfg = validate_config(load_config(str(path)), world_size=4, cuda=True, check_paths=False)
    return EngineSpec.from_config(cfg, WORLD)


def _routed(prompt, out):
    """SGLang's routing field for one row (as its tokenizer manager encodes it: base64 of the
    int32 ``[P + T - 1, num_hidden_layers, topk]`` tensor's bytes)."""
    n = len(prompt) + len(out["output_ids"]) - 1
    rows = np.arange(n * 3 * 2, dtype="<i4").reshape(n, 3, 2) % 8
    out["meta_info"]["routed_experts"] = base64.b64encode(rows.tobytes()).decode()
    return out


def test_moe_spec_translates_into_expert_parallel_and_routing(tmp_path, moe_model):
    spec = _spec(tmp_path, moe_model)
    kw = engine_kwargs(spec)
    assert kw["ep_size"] == 2 and "enable_return_routed_experts" not in kw
    kw = engine_kwargs(dataclasses.replace(spec, return_routed_experts=True))
    assert kw["ep_size"] == 2 and kw["enable_return_routed_experts"] is True
    assert not {k: v for k, v in kw.items() if k not in API["server_args"] or not _type_ok(v, API["server_args"][k]["type"])}
    server = _spec(tmp_path, moe_model, engine="sglang-server", server_urls=["http://rollout:31000"])
    flags = _parse_flags(list(server_command(dataclasses.replace(server, return_routed_experts=True)).argv[3:]))
    assert flags["ep_size"] == 2 and flags["enable_return_routed_experts"] is True
    colocated = _parse_flags(list(colocated_command(dataclasses.replace(_spec(tmp_path, moe_model),
                                                                        return_routed_experts=True)).argv[3:]))
    assert colocated["ep_size"] == 2 and colocated["enable_return_routed_experts"] is True


def test_sglang_rows_read_the_routing_of_the_moe_layers(moe_model):
    """Both SGLang engines read a row through ``to_result``: the routing of the MoE layers only."""
    from megatron_stare.rollout.routed_experts import moe_layout

    moe = moe_layout(str(moe_model))
    prompts = [[1, 2, 3], [4, 5]]
    for p, prompt in enumerate(prompts):
        out = _routed(prompt, fake_generation(prompt, {"max_new_tokens": 5, "stop_token_ids": []}, {}))
        r = to_result((p, 0), out, moe)
        n = len(prompt) + len(r.token_ids) - 1
        want = torch.from_numpy((np.arange(n * 3 * 2).reshape(n, 3, 2) % 8)[:, [0, 2]].astype(np.int16))
        assert r.routed_experts.dtype == torch.int16 and torch.equal(r.routed_experts, want)
        assert to_result((p, 0), out).routed_experts is None  # not asked: no routing
        with pytest.raises(RuntimeError, match="SGLang returned no routed experts"):
            to_result((p, 0), fake_generation(prompt, {"max_new_tokens": 5, "stop_token_ids": []}, {}), moe)
