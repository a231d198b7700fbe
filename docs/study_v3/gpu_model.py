"""Rebuild, on a GPU machine without network, the bootstrap's SmolLM2-135M-Instruct directory:
the weights dequantized from the packaged Q4_1 GGUF (as ``megatron_stare.models.fetch`` does), the
config, tokenizer and chat template copied from this machine's directory (so both sides tokenize
alike). Prints a fingerprint of the weights to compare with the one printed here.

``python docs/study_v3/gpu_model.py MODEL.gguf META_DIR OUT_DIR`` (``--fingerprint DIR`` alone:
the fingerprint of a model directory).
"""

import shutil
import sys
from pathlib import Path

import torch


def fingerprint(model) -> str:
    """Sum over parameters of sum |w| (float64) and of the first 1000 values: equal bf16 weights
    give equal strings."""
    a = sum(float(p.detach().double().abs().sum()) for p in model.parameters())
    b = sum(float(p.detach().double().flatten()[:1000].sum()) for p in model.parameters())
    return f"{a:.6f}/{b:.6f}"


def main(argv):
    import transformers

    if argv[0] == "--fingerprint":
        print("fingerprint", fingerprint(transformers.AutoModelForCausalLM.from_pretrained(argv[1], dtype=torch.bfloat16)))
        return 0
    gguf, meta, out = map(Path, argv[:3])
    src = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = transformers.AutoConfig.from_pretrained(meta)
    with torch.device("meta"):
        plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(src.state_dict(), assign=True, strict=True)
    plain.tie_weights()
    plain = plain.to(torch.bfloat16)  # the bootstrap's dtype (megatron-stare-fetch.json)
    plain.save_pretrained(out)
    for f in meta.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copyfile(f, out / f.name)
    print("fingerprint", fingerprint(plain))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
