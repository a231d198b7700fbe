"""``model.attention_backend``: no silent fallback (``models/gpt.py``), and the torch attention's
GQA calls on CUDA that avoid SDPA's math kernel (``models/torch_attention.py``), on CPU: 'auto'
is the torch attention on CPU and transformer-engine on CUDA, where a failed import is one line
naming the import error and the fix; 'te' on CPU is refused up front; the K/V heads expanded
for a masked CUDA call give the same attention as ``enable_gqa``."""

import pytest
import torch
import torch.nn.functional as F

from megatron_stare.config.load import ConfigError, load_config
from megatron_stare.preflight.checks import check_config
from megatron_stare.models.gpt import resolve_attention, transformer_engine_error
from megatron_stare.models.torch_attention import _kv_for_sdpa


def test_auto_is_torch_on_cpu_and_te_on_cuda_or_one_line():
    assert resolve_attention("auto", cuda=False) == resolve_attention("torch", cuda=True) == "torch"
    err = transformer_engine_error()
    if err is None:  # a machine with transformer-engine
        assert resolve_attention("auto", cuda=True) == resolve_attention("te", cuda=True) == "te"
        return
    for backend in ("auto", "te"):
        with pytest.raises(ValueError) as e:
            resolve_attention(backend, cuda=True)
        msg = str(e.value)
        assert "\n" not in msg and err in msg and "model.attention_backend=torch" in msg
        assert msg.startswith(f"model.attention_backend={backend} on CUDA means transformer-engine")
    assert err.startswith(("ModuleNotFoundError", "ImportError", "OSError"))  # names the import's error


def test_te_needs_cuda_and_bad_names_are_refused():
    with pytest.raises(ValueError, match="model.attention_backend=te needs CUDA"):
        resolve_attention("te", cuda=False)
    with pytest.raises(ValueError, match="choose one of auto, te, torch"):
        resolve_attention("flash", cuda=False)
    with pytest.raises(ConfigError, match="model.attention_backend=te needs CUDA"):
        check_config(load_config(None, ["model.attention_backend=te"]), cuda=False, check_paths=False)
    check_config(load_config(None, ["model.attention_backend=torch"]), cuda=False, check_paths=False)


@pytest.mark.parametrize("masked,dtype,expands", [(True, torch.bfloat16, True), (False, torch.float32, True),
                                                   (False, torch.bfloat16, False)])
def test_gqa_on_cuda_expands_kv_where_the_fused_kernels_take_no_gqa(masked, dtype, expands):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 13, 16, generator=g).to(dtype)
    k, v = (torch.randn(1, 2, 13, 16, generator=g).to(dtype) for _ in range(2))
    mask = torch.rand(13, 13, generator=g) > 0.3 if masked else None
    mask = None if mask is None else mask | torch.eye(13, dtype=torch.bool)
    kc, vc, gqa = _kv_for_sdpa(q, k, v, masked=masked, cuda=True)
    assert gqa != expands and (kc.shape[1] == 8) == expands
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    got = F.scaled_dot_product_attention(q.float(), kc.float(), vc.float(), attn_mask=mask, enable_gqa=gqa)
    assert torch.equal(got, want) or (got - want).abs().max() <= 1e-6
    assert _kv_for_sdpa(q, k, v, masked=masked, cuda=False)[2]  # CPU: enable_gqa, nothing expanded
    same = _kv_for_sdpa(q, q, q, masked=masked, cuda=True)
    assert same[0] is q and not same[2]  # no GQA: nothing to do
