"""Megatron distributed checkpoint -> HF safetensors shards + config.json + tokenizer files.

    python -m checkpoints_convert.megatron_to_hf --ckpt ckpt/qwen25_7b --out Qwen2.5-7B-rl
    python -m checkpoints_convert.megatron_to_hf --ckpt runs/x/ckpt/step_00000040 --out hf_step40
    torchrun --standalone --nproc-per-node 8 -m checkpoints_convert.megatron_to_hf \
        --ckpt ckpt/qwen25_32b --out Qwen2.5-32B-rl --tp 4 --pp 2 --shard-size 5GB

The checkpoint loads at the given layout (any, not necessarily the one it was saved at); the
model streams out stage by stage in buckets of ``--shard-size`` to rank 0, which writes each
bucket as one safetensors shard: no rank holds the whole model. The output directory is
written as ``.<name>.partial`` and renamed when complete. A trainer's step directory converts
as is: its ``model/`` holds the run's tokenizer files, chat template and generation config
(under ``hf/``), which the output gets (``--hf-config-dir`` overrides them).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

from checkpoints_convert import DTYPES, config_dtype, fail, log

PROG = "megatron_to_hf"


def parse_size(text: str) -> int:
    """'2GB', '512MiB', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GB, 512MiB)")
    base = 1024 if (m.group(3) or "").lower() == "ib" else 1000
    power = " KMGT".index((m.group(2) or " ").upper())
    return int(float(m.group(1)) * base ** power)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, type=Path,
                   help="distributed checkpoint directory, or a trainer checkpoint's step directory "
                        "(runs/x/step_00000040, whose model/ it converts)")
    p.add_argument("--out", required=True, type=Path, help="HF directory to create")
    p.add_argument("--hf-config-dir", type=Path, default=None,
                   help="take config.json and tokenizer files from here (default: the copies "
                        "stored in the checkpoint)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree to load at (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree to load at (default 1)")
    p.add_argument("--dtype", default="auto", choices=["auto"] + sorted(DTYPES),
                   help="dtype of the written tensors (default: the HF config's dtype)")
    p.add_argument("--shard-size", type=parse_size, default=parse_size("2GB"),
                   help="largest safetensors shard / transfer bucket (default 2GB)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    return p.parse_args(argv)


def model_dir(ckpt: Path) -> Path:
    """The model checkpoint of ``ckpt``: itself, or the ``model/`` of a trainer's step directory."""
    from megatron_stare.checkpoint.dist_ckpt import META_FILE

    if not (ckpt / META_FILE).is_file() and (ckpt / "model" / META_FILE).is_file():
        return ckpt / "model"
    return ckpt


def _hf_config(args, meta, spec) -> dict:
    if args.hf_config_dir is not None:
        path = args.hf_config_dir / "config.json"
        if not path.is_file():
            raise ValueError(f"no config.json in --hf-config-dir {args.hf_config_dir}")
        return json.loads(path.read_text())
    if meta.hf_config:
        return dict(meta.hf_config)
    from megatron_stare.models.registry import family_by_name

    return family_by_name(spec.architecture).hf_config(spec)


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    from megatron_stare.checkpoint.dist_ckpt import load_model, read_meta
    from megatron_stare.weight_sync.hf_export import SIDE_DIR, write_hf_checkpoint
    from megatron_stare.models.provider import build_model_stage, model_shape
    from megatron_stare.runtime.parallel import ParallelLayout, destroy_distributed, init_distributed

    try:
        args.ckpt = model_dir(args.ckpt)
        meta = read_meta(args.ckpt)
        spec = meta.gpt_spec()
        hf_config = _hf_config(args, meta, spec)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        layout = ParallelLayout.from_world(world, tp=args.tp, pp=args.pp)
        layout.validate(world_size=world, shape=model_shape(spec))
        if args.out.exists() and not args.overwrite:
            raise ValueError(f"{args.out} already exists; choose a new --out or pass --overwrite")
    except ValueError as e:
        fail(PROG, str(e))
    dtype_name = config_dtype(hf_config) if args.dtype == "auto" else DTYPES[args.dtype]
    side_dir = args.hf_config_dir or (args.ckpt / SIDE_DIR)
    if not (side_dir / "tokenizer_config.json").is_file() and not (side_dir / "tokenizer.json").is_file():
        log(f"warning: no tokenizer files in {side_dir} (a checkpoint saved before they were recorded); "
            f"pass --hf-config-dir MODEL_DIR to add the model's tokenizer and chat template")
    log(f"{spec.architecture} checkpoint saved at {meta.saved_layout}; loading at tp={layout.tp} "
        f"pp={layout.pp}; writing {dtype_name} shards of <= {args.shard_size} bytes")
    groups = init_distributed(layout, shape=model_shape(spec))
    out = args.out.absolute()
    try:
        saved_dtype = meta.extra.get("dtype", "torch.float32").replace("torch.", "")
        model, _ = build_model_stage(spec, groups, dtype=getattr(torch, saved_dtype))
        load_model(model, args.ckpt, spec)
        log("checkpoint loaded")
        write_hf_checkpoint(
            model, groups, spec, out, hf_config=hf_config, bucket_bytes=args.shard_size,
            side_files_dir=side_dir, dtype=getattr(torch, dtype_name),
            on_shard=lambda w, bucket: log(f"wrote shard {w.num_shards}: {len(bucket)} tensors, "
                                           f"{bucket.nbytes / 2**20:.1f} MiB"))
        log(f"wrote {out}")
    except ValueError as e:
        fail(PROG, str(e))
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
