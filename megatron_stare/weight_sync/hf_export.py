"""Write a live Megatron model (any TP/PP layout) as an HF checkpoint directory, atomically.

Shared by ``checkpoints_convert.megatron_to_hf`` and the trainer's periodic HF export: the
streaming export gathers buckets on ``dst``, which writes them as safetensors shards with the
index, ``config.json`` and the tokenizer files into ``.<name>.partial`` and renames it to
``out`` only when complete. Collective: every rank must call it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable, Dict, Optional, Union

import torch
import torch.distributed as dist

from megatron_stare.weight_sync.export import ExportStats, iter_hf_buckets
from megatron_stare.models.gpt import GPTSpec
from megatron_stare.models.hf_io import HFShardWriter
from megatron_stare.runtime.parallel import ParallelGroups

TOKENIZER_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "chat_template.jinja", "added_tokens.json")
#: Where a Megatron checkpoint keeps its HF side files (config, tokenizer, chat template).
SIDE_DIR = "hf"


def side_files(hf_dir: Union[str, Path]) -> Dict[str, Path]:
    """``{"hf/<name>": path}`` for the config and ``TOKENIZER_FILES`` present in ``hf_dir``: the
    files a checkpoint carries so that it converts back to a model that tokenizes, applies its
    chat template and generates (``save_sharded(extra_files=...)``)."""
    return {f"{SIDE_DIR}/{name}": Path(hf_dir) / name for name in ("config.json", *TOKENIZER_FILES)
            if (Path(hf_dir) / name).is_file()}


def write_hf_checkpoint(model, groups: ParallelGroups, spec: GPTSpec, out: Union[str, Path], *,
                        hf_config: dict, side_files_dir: Optional[Union[str, Path]] = None,
                        bucket_bytes: int = 2 << 30, dtype: Optional[torch.dtype] = None,
                        dst: int = 0, on_shard: Optional[Callable[[HFShardWriter, list], None]] = None
                        ) -> Path:
    """Write ``model`` as HF safetensors shards of <= ``bucket_bytes`` plus config and tokenizer.

    ``dtype`` casts the tensors (and is recorded in config.json); ``side_files_dir`` is where the
    tokenizer files are copied from; ``on_shard(writer, bucket)`` reports progress on ``dst``.
    """
    out = Path(out).absolute()
    tmp = out.parent / f".{out.name}.partial"
    writer = None
    if dist.get_rank() == dst:
        shutil.rmtree(tmp, ignore_errors=True)
        writer = HFShardWriter(tmp)
    for bucket in iter_hf_buckets(model, groups, spec, bucket_bytes, dst=dst, dtype=dtype,
                                  stats=ExportStats()):
        writer.write(bucket)
        if on_shard is not None:
            on_shard(writer, bucket)
    if writer is not None:
        writer.finish()
        config = dict(hf_config)
        if dtype is not None:
            config.pop("torch_dtype", None)
            config["dtype"] = str(dtype).replace("torch.", "")
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if side_files_dir is not None:
            for name in TOKENIZER_FILES:
                src = Path(side_files_dir) / name
                if src.is_file():
                    shutil.copyfile(src, tmp / name)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    dist.barrier()
    return out
