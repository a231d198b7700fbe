"""Every numeric config field has a documented range, and every value outside it is one line.

The fields are walked programmatically (``config_fields.numeric_fields``), so a field added
later is covered without touching this file: each gets values just outside its range (and NaN,
inf, a bool, a string) through the same path the trainer, the CLI and the dry-run use
(``load_config`` + ``validate_config``), and each must fail with one ``ConfigError`` line that
names that field. Cross-field rules have their own cases below.
"""

import ast
import json
import math
from pathlib import Path

import pytest

from megatron_stare.config.load import Config, ConfigError, load_config
from megatron_stare.preflight.checks import validate_config
from megatron_stare.config.fields import check_fields, numeric_fields
from megatron_stare.models.tiny import build_tiny_hf_model

ROOT = Path(__file__).resolve().parents[2]
FIELDS = list(numeric_fields(Config))
TINY_HF = {"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 4, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 301, "hidden_size": 128, "intermediate_size": 256}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cfg")
    # TINY_HF's shape, real files (the preflight reads the weights and the tokenizer)
    build_tiny_hf_model("qwen2", root / "model", num_layers=4, vocab_size=301, max_position_embeddings=4096)
    (root / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    return [f"model.path={root / 'model'}", f"data.train_path={root / 'train.jsonl'}"]


def _check(overrides, files, world_size=1, hf_config=None):
    return validate_config(load_config(None, files + list(overrides)), world_size=world_size, cuda=False,
                           hf_config=hf_config)


def _one_line_error(overrides, files, **kw) -> str:
    with pytest.raises(ConfigError) as info:
        _check(overrides, files, **kw)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("config: "), msg
    return msg


def _outside(f):
    """(YAML text, label) values just outside the field's range, plus values of the wrong kind."""
    r, out = f.range, []
    if f.kind is int:
        if r.lo is not None:
            out.append(str(int(r.lo) - (0 if r.lo_open else 1)))
        if r.hi is not None:
            out.append(str(int(r.hi) + (0 if r.hi_open else 1)))
        out += ["2.5", "true", "abc"]
    else:
        if r.lo is not None:
            out.append(repr(r.lo if r.lo_open else math.nextafter(r.lo, -math.inf)))
        if r.hi is not None:
            out.append(repr(r.hi if r.hi_open else math.nextafter(r.hi, math.inf)))
        out += [".nan", "true", "abc"]
        if not r.inf_ok:
            out += [".inf", "-.inf"]
    return [v for v in out if not any(float(v) == s for s in r.special if _numeric(v))]


def _numeric(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def test_every_numeric_field_declares_a_range():
    assert len(FIELDS) > 60, "the walk found too few fields"
    missing = [f.path for f in FIELDS if f.range is None]
    assert not missing, f"numeric fields without num(..., range): {missing}"


def _docstrings():
    """{class name: {field: docstring}} of the config dataclasses, from their source."""
    out = {}
    for rel in ("megatron_stare/config/sections.py", "megatron_stare/config/algorithm.py"):
        for node in ast.parse((ROOT / rel).read_text()).body:
            if isinstance(node, ast.ClassDef):
                docs, body = {}, node.body
                for a, b in zip(body, body[1:]):
                    if (isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr)
                            and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)):
                        docs[a.target.id] = b.value.value
                out[node.name] = docs
    return out


def test_every_range_is_documented_in_the_field_docstring():
    import dataclasses
    import typing

    docs = _docstrings()
    bad = []

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            path = f"{prefix}.{f.name}" if prefix else f.name
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], path)
            elif "range" in f.metadata:
                text = f.metadata["range"].text()
                if text not in docs.get(cls.__name__, {}).get(f.name, ""):
                    bad.append(f"{path}: docstring lacks {text!r}")

    walk(Config, "")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("field", FIELDS, ids=[f.path for f in FIELDS])
def test_values_outside_each_range_are_one_line_naming_the_field(field, files):
    values = _outside(field)
    assert values, field.path
    for text in values:
        msg = _one_line_error([f"{field.path}={text}"], files)
        assert msg.startswith(f"config: {field.path} must be "), (text, msg)


@pytest.mark.parametrize("field", FIELDS, ids=[f.path for f in FIELDS])
def test_range_bounds_themselves_are_accepted(field):
    """The ranges are not stricter than documented: the values at each bound pass."""
    r = field.range
    inside = list(r.special)
    if r.lo is not None:
        inside.append(math.nextafter(r.lo, math.inf) if r.lo_open and field.kind is float else
                      r.lo + (1 if r.lo_open else 0))
    if r.hi is not None:
        inside.append(math.nextafter(r.hi, -math.inf) if r.hi_open and field.kind is float else
                      r.hi - (1 if r.hi_open else 0))
    if r.inf_ok:
        inside += [x for x in (math.inf, -math.inf) if r.contains(x)]
    for value in inside:
        cfg = Config()
        *parents, name = field.path.split(".")
        node = cfg
        for p in parents:
            node = getattr(node, p)
        setattr(node, name, field.kind(value) if math.isfinite(value) else value)
        check_fields(cfg)  # ranges only: cross-field rules are tested below


def test_stare_roles(files):
    """W amplifies (>= 1), M attenuates (in (0, 1]), P selects (in (0, 1]): the errors say so."""
    assert "W amplifies" in _one_line_error(["algorithm.stare.w=0.9"], files)
    assert "M attenuates" in _one_line_error(["algorithm.stare.m=1.1"], files)
    assert "algorithm.stare.m must be in (0, 1]" in _one_line_error(["algorithm.stare.m=0"], files)
    assert "algorithm.stare.top_p must be in (0, 1]" in _one_line_error(["algorithm.stare.top_p=0"], files)
    _check(["algorithm.stare.w=1.0", "algorithm.stare.m=1.0"], files)  # W = M = 1: plain surrogate


@pytest.mark.parametrize("overrides,needle", [
    (["algorithm.stare.adaptive=true", "algorithm.stare.w=1.6"],
     "algorithm.stare.w=1.6 is above algorithm.stare.w_max=1.5"),
    (["algorithm.stare.adaptive=true", "algorithm.stare.m=0.4"],
     "algorithm.stare.m=0.4 is below algorithm.stare.m_min=0.5"),
    (["algorithm.stare.adaptive=true", "algorithm.stare.alpha=0"], "algorithm.stare.alpha must be > 0"),
    (["algorithm.clip_cov.lb=5", "algorithm.clip_cov.ub=5"], "algorithm.clip_cov.lb must be < algorithm.clip_cov.ub"),
    (["algorithm.loss_agg_mode=seq-mean-token-sum-norm"], "seq_mean_norm_const must be > 0"),
    (["algorithm.kl_loss_type=k9"], "algorithm.kl_loss_type"),
    (["algorithm.adv_estimator=gae"], "algorithm.adv_estimator must be one of"),
    (["checkpoint.hf_export_every=5"], "checkpoint.hf_export_every=5 needs checkpoint.dir"),
    (["checkpoint.save_every=5"], "checkpoint.save_every=5 needs checkpoint.dir"),
    (["checkpoint.save_every_minutes=30"], "checkpoint.save_every_minutes=30.0 needs checkpoint.dir"),
    (["reward.overlong_buffer_len=512"], "reward.overlong_buffer_len=512 must be below rollout.max_new_tokens"),
    (["parallel.micro_batch_tokens=1000"], "parallel.micro_batch_tokens=1000 is below the longest sequence"),
    (["data.max_prompt_length=4000"], "exceeds the model's max_position_embeddings 4096"),
    (["optimizer.min_lr=1e-3"], "optimizer.min_lr=0.001 is above optimizer.lr"),
    (["optimizer.warmup_steps=100"], "optimizer.warmup_steps=100 is not below the run's 100 optimizer steps"),
    (["rollout.n=1"], "rollout.n must be >= 2 for group advantages"),
    (["rollout.n=1", "algorithm.adv_estimator=rloo"], "rollout.n must be >= 2 for group advantages"),
    (["rollout.tp=2"], "rollout.tp=2 but the hf engine runs on one rank"),
    (["trainer.eval_every=5"], "trainer.eval_every > 0 needs data.eval_path"),
    (["trainer.prompts_per_step=6", "trainer.mini_batches_per_step=4"], "not divisible by"),
])
def test_cross_field_rules(files, overrides, needle):
    assert needle in _one_line_error(overrides, files)


def test_cross_field_fixes_pass(files):
    """The fixes the errors name are accepted."""
    _check(["algorithm.stare.adaptive=true", "algorithm.stare.w=1.6", "algorithm.stare.w_max=2"], files)
    _check(["checkpoint.hf_export_every=5", "checkpoint.dir=/tmp/ckpt"], files)
    _check(["parallel.micro_batch_tokens=1536"], files)  # exactly the longest sequence (1024 + 512)
    _check(["rollout.n=2"], files)


@pytest.mark.parametrize("hf,overrides,world,needle", [
    (dict(TINY_HF, intermediate_size=255), ["parallel.tp=2"], 2, "parallel.tp=2 does not divide the FFN width 255"),
    (dict(TINY_HF, num_attention_heads=12, num_key_value_heads=4, hidden_size=384), [
        "rollout.engine=vllm-server", "rollout.tp=6"], 1, "rollout.tp=6 and the 4 KV heads"),
    (TINY_HF, ["rollout.engine=vllm", "rollout.tp=4"], 2, "rollout.tp=4 does not divide the world size 2"),
    (TINY_HF, ["rollout.engine=vllm-server", "rollout.tp=8"], 1, "rollout.tp=8 does not divide the 4 attention heads"),
    (TINY_HF, ["parallel.tp=4"], 4, "does not divide the 2 key/value heads"),
    ({"architectures": ["GPT2LMHeadModel"]}, [], 1, "model: unsupported HF architecture"),
])
def test_model_shape_rules(files, hf, overrides, world, needle):
    assert needle in _one_line_error(overrides, files, world_size=world, hf_config=hf)
