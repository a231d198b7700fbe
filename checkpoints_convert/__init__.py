"""Command-line converters between HF checkpoints and Megatron distributed checkpoints.

    python -m checkpoints_convert.hf_to_megatron --hf-dir HF --out CKPT [--tp 2 --pp 2]
    python -m checkpoints_convert.megatron_to_hf --ckpt CKPT --out HF2 [--hf-config-dir HF]

Both run as plain ``python`` (one process) or under ``torchrun --standalone --nproc-per-node N``
for models that need TP/PP; the name/layout mapping lives in ``megatron_stare.models``.
"""

from __future__ import annotations

import os
import sys
import time

_T0 = time.monotonic()


def log(msg: str, all_ranks: bool = False) -> None:
    """Progress line on rank 0 (or every rank), with elapsed seconds."""
    rank = int(os.environ.get("RANK", "0"))
    if all_ranks or rank == 0:
        prefix = f"[{time.monotonic() - _T0:6.1f}s]" + (f" rank {rank}:" if all_ranks else "")
        print(f"{prefix} {msg}", flush=True)


def fail(prog: str, msg: str) -> "NoReturn":  # noqa: F821
    """Print one error line (rank 0 only under torchrun) and exit with status 2."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{prog}: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


def config_dtype(hf_config: dict) -> str:
    """The dtype an HF config declares (``dtype`` in transformers 5, ``torch_dtype`` before)."""
    name = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
    return DTYPES.get(str(name).replace("torch.", ""), "float32")
