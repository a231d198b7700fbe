"""HF checkpoint -> Megatron model stage on this rank, for any TP/PP layout.

    spec = spec_from_hf_config(hf_dir)                  # config.json -> GPTSpec (or one ValueError)
    model, cfg = build_model_stage(spec, groups)        # this rank's pipeline stage, TP-sharded
    load_hf_weights(model, groups, spec, hf_dir)        # reads only this stage's tensors

The architecture family (``registry.py``) supplies the config parsing and the HF <-> canonical
mapping; ``sharding.load_canonical`` turns canonical tensors into this rank's shards.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Mapping, Optional, Tuple, Union

import torch

from megatron_stare.models.gpt import GPTSpec, build_gpt_stage, transformer_config
from megatron_stare.models.hf_io import HFCheckpointReader, check_hf_tensors
from megatron_stare.models.llama_like import LlamaLikeMapping
from megatron_stare.models.moe import per_expert_view
from megatron_stare.models.registry import family_by_name, family_for_config
from megatron_stare.models.sharding import load_canonical
from megatron_stare.runtime.parallel import ModelShape, ParallelGroups

PathLike = Union[str, Path]
HFSource = Union[PathLike, HFCheckpointReader, Mapping[str, torch.Tensor]]


def load_hf_config(hf_dir: PathLike) -> dict:
    """The ``config.json`` of an HF checkpoint directory as a dict."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json in {hf_dir}; point at an HF model directory")
    return json.loads(path.read_text())


def spec_from_hf_config(config: Union[dict, PathLike], *,
                        make_vocab_size_divisible_by: int = 128) -> GPTSpec:
    """``GPTSpec`` of an HF config (a dict, or a directory holding config.json).

    Raises ValueError naming the architecture or every unsupported field.
    """
    cfg = config if isinstance(config, dict) else load_hf_config(config)
    return family_for_config(cfg).spec_from_hf(
        cfg, make_vocab_size_divisible_by=make_vocab_size_divisible_by)


def mapping_for(spec: GPTSpec) -> LlamaLikeMapping:
    """The HF <-> canonical mapping of ``spec``'s architecture family."""
    return family_by_name(spec.architecture).mapping(spec)


def model_shape(spec: GPTSpec) -> ModelShape:
    """The dimensions ``ParallelLayout.validate`` checks a layout against."""
    return ModelShape(num_layers=spec.num_layers, num_attention_heads=spec.num_attention_heads,
                      num_query_groups=spec.num_query_groups, vocab_size=spec.vocab_size,
                      hidden_size=spec.hidden_size, num_experts=spec.moe.num_experts if spec.moe else 0,
                      moe_ffn_hidden_size=spec.moe.ffn_hidden_size if spec.moe else 0)


def build_model_stage(spec: GPTSpec, groups: ParallelGroups, *, dtype: torch.dtype = torch.float32,
                      use_te: Optional[bool] = None, attention: Optional[str] = None, **config_overrides):
    """(this rank's GPTModel stage, its TransformerConfig) at ``groups.layout``.

    Weights are Megatron's random init; load them with ``load_hf_weights`` or a distributed
    checkpoint. ``use_te``/``attention``: see ``gpt.build_gpt_stage`` (``model.attention_backend``:
    transformer-engine's layer spec on CUDA, the local spec with the torch attention on CPU).
    """
    lay = groups.layout
    lay.validate(shape=model_shape(spec))
    cfg = transformer_config(spec, lay.tp, lay.pp, cp=lay.cp, dtype=dtype, ep=lay.ep, etp=lay.etp,
                             sequence_parallel=lay.sequence_parallel, **config_overrides)
    model = build_gpt_stage(spec, cfg, pre_process=groups.is_first_stage,
                            post_process=groups.is_last_stage, tp=lay.tp, use_te=use_te,
                            attention=attention)
    return model.to(groups.device), cfg


def _reader(source: HFSource) -> Tuple[Callable[[str], torch.Tensor], dict, str]:
    """(get(name), {name: shape}, description) for a directory, reader or state dict."""
    if isinstance(source, Mapping):
        return (*per_expert_view(source.__getitem__, {n: tuple(t.shape) for n, t in source.items()}),
                "state dict")
    reader = source if isinstance(source, HFCheckpointReader) else HFCheckpointReader(source)
    # Fused expert tensors (transformers 5's in-memory layout) are read as per-expert ones.
    return (*per_expert_view(reader.get, {n: reader.shape(n) for n in reader.names()}), str(reader.dir))


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, groups: ParallelGroups, spec: GPTSpec,
                    source: HFSource) -> int:
    """Fill this rank's shards from an HF checkpoint; returns the number of local tensors loaded.

    ``source``: an HF directory, an ``HFCheckpointReader`` or a ``{hf_name: tensor}`` dict.
    Names and shapes of the whole checkpoint are checked first (headers only); then only the
    HF tensors of this rank's pipeline stage are read. Values are cast to the parameter dtype.
    """
    get, shapes, where = _reader(source)
    mapping = mapping_for(spec)
    check_hf_tensors(shapes, mapping.expected_hf_shapes(), where)

    def get_full(canonical: str, shape) -> torch.Tensor:
        return mapping.to_canonical(canonical, get, shape)

    return load_canonical(model, get_full, groups.tp_rank, groups.layout.tp,
                          etp_rank=groups.etp_rank, etp=groups.layout.etp)


def build_from_hf(hf_dir: PathLike, groups: ParallelGroups, *, dtype: torch.dtype = torch.float32,
                  make_vocab_size_divisible_by: int = 128, use_te: Optional[bool] = None,
                  **config_overrides):
    """(model stage with HF weights loaded, GPTSpec, TransformerConfig) in one call."""
    spec = spec_from_hf_config(hf_dir, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    model, cfg = build_model_stage(spec, groups, dtype=dtype, use_te=use_te, **config_overrides)
    load_hf_weights(model, groups, spec, hf_dir)
    return model, spec, cfg
