"""The hf engine on a GPU: its release phase moves the weights to host memory and gives the
memory back to the device; resume brings them back; a sync in between lands on the GPU.

Skipped cleanly without CUDA. The hf engine allocates through PyTorch's caching allocator, so
``torch.cuda.memory_allocated`` sees its weights (vLLM's and SGLang's pools it does not: their
GPU tests read the driver's ``mem_get_info``); after ``empty_cache`` the driver sees them too.
"""

from __future__ import annotations

import pytest
import torch

from megatron_stare.rollout import EngineWorld, SamplingParams
from megatron_stare.testing.hf_models import build_tiny_hf_model

from ..unit.test_rollout_hf import (MAX_NEW, PROMPTS, assert_matches_reference, engine_from_config_file,
                                    reference_outputs, stream_state_dict, write_engine_config)

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_hf_engine_releases_and_restores_gpu_memory(tmp_path):
    a = build_tiny_hf_model("qwen2", tmp_path / "A", seed=0)
    b = build_tiny_hf_model("qwen2", tmp_path / "B", seed=1)
    _, eng = engine_from_config_file(write_engine_config(tmp_path / "run.yaml", a, engine="hf"),
                                     EngineWorld(cuda=True))
    weights = sum(t.numel() * t.element_size() for t in eng.model.state_dict().values())
    before = torch.cuda.memory_allocated()
    assert eng.memory_release.frees and eng.release_memory() is True
    assert before - torch.cuda.memory_allocated() >= 0.9 * weights
    assert next(eng.model.parameters()).device.type == "cpu"
    eng.resume_weights()
    assert torch.cuda.memory_allocated() - before > -0.1 * weights
    eng.update_weights(stream_state_dict(b))
    eng.resume_kv_cache()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)
    assert_matches_reference(eng.generate(PROMPTS, greedy), reference_outputs(b, PROMPTS, MAX_NEW))
