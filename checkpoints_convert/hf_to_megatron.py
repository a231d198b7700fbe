"""HF safetensors checkpoint -> Megatron distributed checkpoint (loadable at any TP/PP layout).

    python -m checkpoints_convert.hf_to_megatron --hf-dir Qwen2.5-7B --out ckpt/qwen25_7b
    torchrun --standalone --nproc-per-node 8 -m checkpoints_convert.hf_to_megatron \
        --hf-dir Qwen2.5-32B --out ckpt/qwen25_32b --tp 4 --pp 2

Each rank builds its own pipeline stage at (tp, pp), reads only that stage's tensors from the
safetensors files, and the stages save one distributed checkpoint together. The checkpoint
directory also holds ``megatron_stare.json`` (GPTSpec, original HF config, saved layout) and
the original config/tokenizer files under ``hf/``, so ``megatron_to_hf`` needs nothing else.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from checkpoints_convert import DTYPES, config_dtype, fail, log

PROG = "hf_to_megatron"
#: Files copied next to the tensors so the checkpoint converts back on its own.
HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                 "tokenizer.model", "chat_template.jinja", "added_tokens.json")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-dir", required=True, type=Path, help="HF model directory (config.json + safetensors)")
    p.add_argument("--out", required=True, type=Path, help="checkpoint directory to create")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree used to convert (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree used to convert (default 1)")
    p.add_argument("--dtype", default="auto", choices=["auto"] + sorted(DTYPES),
                   help="parameter dtype of the checkpoint (default: the HF config's dtype)")
    p.add_argument("--vocab-multiple", type=int, default=128,
                   help="pad the vocabulary to a multiple of this times TP (default 128)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint at --out")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    from megatron_stare.checkpoint.dist_ckpt import save_model
    from megatron_stare.models.hf_io import HFCheckpointReader, check_hf_tensors
    from megatron_stare.models.provider import (build_model_stage, load_hf_config, load_hf_weights,
                                                mapping_for, model_shape, spec_from_hf_config)
    from megatron_stare.runtime.parallel import ParallelLayout, destroy_distributed, init_distributed

    try:  # everything checkable before any process group exists
        hf_config = load_hf_config(args.hf_dir)
        spec = spec_from_hf_config(hf_config, make_vocab_size_divisible_by=args.vocab_multiple)
        reader = HFCheckpointReader(args.hf_dir)
        check_hf_tensors({n: reader.shape(n) for n in reader.names()},
                         mapping_for(spec).expected_hf_shapes(), str(args.hf_dir))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        layout = ParallelLayout.from_world(world, tp=args.tp, pp=args.pp)
        layout.validate(world_size=world, shape=model_shape(spec))
        if args.out.exists() and not args.overwrite:
            raise ValueError(f"{args.out} already exists; choose a new --out or pass --overwrite")
    except ValueError as e:
        fail(PROG, str(e))
    dtype = getattr(torch, config_dtype(hf_config) if args.dtype == "auto" else DTYPES[args.dtype])
    log(f"{spec.architecture}: {spec.num_layers} layers, hidden {spec.hidden_size}, vocab "
        f"{spec.vocab_size} -> layout tp={layout.tp} pp={layout.pp} dp={layout.dp}, {dtype}")
    groups = init_distributed(layout, shape=model_shape(spec))
    try:
        model, _ = build_model_stage(spec, groups, dtype=dtype)
        n = load_hf_weights(model, groups, spec, reader)
        log(f"stage {groups.pp_rank} tp {groups.tp_rank}: loaded {n} tensors", all_ranks=True)
        side = {f"hf/{f}": args.hf_dir / f for f in HF_SIDE_FILES if (args.hf_dir / f).is_file()}
        out = save_model(model, groups, args.out, spec, hf_config=hf_config, overwrite=args.overwrite,
                         extra={"source": str(args.hf_dir.absolute()), "dtype": str(dtype)},
                         extra_files=side)
        log(f"saved distributed checkpoint to {out}")
    except ValueError as e:
        fail(PROG, str(e))
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
