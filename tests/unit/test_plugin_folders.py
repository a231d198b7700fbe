"""Adding a rollout engine or a model family is one new folder.

A toy engine folder (a light descriptor plus its code) and a toy family folder are written to a
temporary directory that joins ``rollout/engines/`` and ``models/families/`` the way a new
folder of the package would (their packages' ``__path__``); the config checks, the planner and
the engine factory then find them by name, with no other file touched.
"""
import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_stare.config.fields import ConfigError
from megatron_stare.config.load import load_config
from megatron_stare.models import families, registry
from megatron_stare.models.sizes import _spec
from megatron_stare.plan.planner import check_for_gpus, estimate_memory
from megatron_stare.rollout import engine_for_rank, engines
from megatron_stare.rollout.spec import EngineWorld

ROOT = Path(__file__).resolve().parents[2]
QWEN7 = ROOT / "examples" / "configs" / "qwen2.5-7b.json"
YAML7 = ROOT / "examples" / "qwen2.5_7b_shortcot.yaml"

TOY_ENGINE = '''
"""A toy engine: vLLM's placement and memory model under another name, with a check of its own."""
from megatron_stare.rollout.engines import EngineDescriptor, EngineMemoryModel, EngineTraits, require


def _greedy_only(c):
    require(c.cfg.rollout.temperature == 1.0, "rollout.engine=toy-echo samples at temperature 1 only")


ENGINE = EngineDescriptor(
    name="toy-echo", summary="a toy",
    traits=EngineTraits(placement={placement!r}, cuda_only=False, server={server!r}),
    memory=EngineMemoryModel({memory!r}),
    implementation="megatron_stare.rollout.engines.toy_echo.engine:ToyEngine",
    checks=(_greedy_only,))
'''
TOY_ENGINE_CODE = '''
from megatron_stare.rollout.base import RolloutEngine


class ToyEngine(RolloutEngine):
    name = "toy-echo"

    def __init__(self, spec):
        self.spec = spec

    @classmethod
    def from_spec(cls, spec):
        return cls(spec)

    def generate(self, prompt_token_ids, params, prompt_indices=None):
        raise NotImplementedError

    def update_weights(self, named_tensors):
        pass
'''
TOY_FAMILY = '''
"""A toy family: Qwen2's mapping under another architecture name, refusing one field of its own."""
from megatron_stare.models.llama_like import LlamaLikeFamily
from megatron_stare.models.registry import register_architecture


@register_architecture("toy_qwen", "ToyQwenForCausalLM", "toy_qwen")
class ToyQwenFamily(LlamaLikeFamily):
    hf_architecture = "ToyQwenForCausalLM"
    model_type = "toy_qwen"
    qkv_bias = True

    @classmethod
    def problems(cls, cfg):
        return super().problems(cfg) + (["toy_window set (unsupported)"] if cfg.get("toy_window") else [])
'''


@pytest.fixture
def plugin_folders(tmp_path):
    """``write(engine=dict(placement=..., server=..., memory=...))``: the toy folders, found."""
    eng_dir, fam_dir = tmp_path / "engines", tmp_path / "families"

    def write(placement="every_rank", server=False, memory="budgeted"):
        (eng_dir / "toy_echo").mkdir(parents=True, exist_ok=True)
        (eng_dir / "toy_echo" / "__init__.py").write_text(textwrap.dedent(TOY_ENGINE.format(
            placement=placement, server=server, memory=memory)))
        (eng_dir / "toy_echo" / "engine.py").write_text(TOY_ENGINE_CODE)
        (fam_dir / "toy_qwen").mkdir(parents=True, exist_ok=True)
        (fam_dir / "toy_qwen" / "__init__.py").write_text(TOY_FAMILY)
        for mod in [m for m in sys.modules if ".toy_echo" in m]:
            del sys.modules[mod]
        engines.descriptors(refresh=True)

    engines.__path__.append(str(eng_dir))
    families.__path__.append(str(fam_dir))
    yield write
    engines.__path__.remove(str(eng_dir))
    families.__path__.remove(str(fam_dir))
    for mod in [m for m in sys.modules if ".toy_echo" in m or ".toy_qwen" in m]:
        del sys.modules[mod]
    for table in (registry.ARCHITECTURES, registry.FAMILIES):
        for key in [k for k, v in table.items() if getattr(v, "family", "") == "toy_qwen"]:
            del table[key]
    engines.descriptors(refresh=True)


def _toy_hf_config(**extra):
    cfg = json.loads(QWEN7.read_text())
    return {**cfg, "architectures": ["ToyQwenForCausalLM"], "model_type": "toy_qwen", **extra}


def _plan(engine, hf_config, *overrides, world=8):
    cfg = load_config(str(YAML7), [f"rollout.engine={engine}", "trainer.offload=none", *overrides])
    check_for_gpus(cfg, hf_config, world)
    return estimate_memory(cfg, hf_config, world, 80.0)


def test_a_toy_engine_and_family_folder_are_found_checked_and_planned(plugin_folders):
    plugin_folders()
    assert "toy-echo" in engines.descriptors() and registry.family_by_name("toy_qwen").hf_architecture == "ToyQwenForCausalLM"
    toy_cfg, qwen_cfg = _toy_hf_config(), json.loads(QWEN7.read_text())
    # The family folder gives Qwen2's spec under its own name; its own check refuses its field.
    assert dataclasses.replace(_spec(toy_cfg), architecture="qwen2") == _spec(qwen_cfg)
    with pytest.raises(ValueError, match="toy_window set"):
        _spec(_toy_hf_config(toy_window=4))
    # The planner reads the descriptor: vLLM's traits and memory model plan as vLLM does.
    toy, vllm = _plan("toy-echo", toy_cfg), _plan("vllm", qwen_cfg)
    assert toy.phases == vllm.phases and toy.peak_gib > 0 and toy.layout.engine == "toy-echo"
    assert toy.layout.colocated and toy.layout.replicas == vllm.layout.replicas == 8 // 2
    # The engine's own check runs with the generic ones; the generic ones read its traits.
    with pytest.raises(ConfigError, match="toy-echo samples at temperature 1 only"):
        _plan("toy-echo", toy_cfg, "rollout.temperature=0.7")
    with pytest.raises(ConfigError, match="needs a server engine"):
        _plan("toy-echo", toy_cfg, "trainer.staleness=1")
    # The factory builds the folder's class from the run's spec, on the ranks its placement says.
    cfg = load_config(str(YAML7), ["rollout.engine=toy-echo", "rollout.tp=2", "model.path=/m"])
    spec, engine = engine_for_rank(cfg, EngineWorld(rank=3, world_size=4, local_rank=3, local_world_size=4))
    assert type(engine).__name__ == "ToyEngine" and engine.spec is spec
    assert spec.devices.engine_ranks == (2, 3) and spec.devices.replica == 1


def test_the_descriptor_not_the_name_decides(plugin_folders):
    """The same toy folder declared as hf is (a whole copy in the driver) plans as hf, and as a
    server it may run asynchronously but not offload."""
    plugin_folders(placement="driver", memory="whole_copy")
    toy = _plan("toy-echo", _toy_hf_config(), "rollout.tp=1")
    hf = _plan("hf", json.loads(QWEN7.read_text()), "rollout.tp=1")
    assert toy.phases == hf.phases and toy.engine_weights_gib == hf.engine_weights_gib > 0
    assert toy.layout.replicas == 1 and toy.layout.engine_tp == 1

    plugin_folders(placement="driver", server=True)
    _plan("toy-echo", _toy_hf_config(), "trainer.staleness=1", "trainer.dynamic_sampling=false",
          "rollout.server_urls=[http://h:1]")
    with pytest.raises(ConfigError, match=r"trainer.offload=optimizer needs an engine on the trainer's GPUs "
                                          r"that generates between its phases \(hf, vllm, sglang\)"):
        _plan("toy-echo", _toy_hf_config(), "trainer.offload=optimizer", "rollout.server_urls=[http://h:1]")


def test_an_unknown_engine_names_the_folders():
    cfg = load_config(str(YAML7), ["rollout.engine=tgi"])
    with pytest.raises(ConfigError, match=r"rollout.engine must be one of 'hf', 'vllm', 'vllm-server', "
                                          r"'sglang', 'sglang-server', got 'tgi' \(an engine is a folder"):
        check_for_gpus(cfg, json.loads(QWEN7.read_text()), 8)


def test_descriptors_are_light():
    """Finding every engine folder (and checking a config against them) imports no torch and no
    engine library: the descriptors are read by the config CLI and every node's preflight."""
    code = ("import sys; from megatron_stare.rollout.engines import descriptors; d = descriptors(); "
            "heavy = [m for m in ('torch', 'vllm', 'sglang', 'transformers') if m in sys.modules]; "
            "print(sorted(d), heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "['hf', 'sglang', 'sglang-server', 'vllm', 'vllm-server'] []", out.stdout
