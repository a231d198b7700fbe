"""The preflight (``megatron_stare/preflight/inputs.py``): each invalid input a user produces is refused
before any process group exists, with one line and exit 2, through both entry points:

- the trainer, ``WORLD_SIZE=2 RANK=0 python -m megatron_stare.train --config C.yaml`` with
  ``MASTER_ADDR`` unset (a config that passed would die at process-group init instead);
- the config CLI, ``python -m megatron_stare.config --config C.yaml --world-size 2`` (what the
  launch scripts run before torchrun).

Each case calls both ``main`` functions in-process (the same code path as the commands, minus the
interpreter start); one case of each runs the real commands in subprocesses.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_stare.preflight import cli as config_cli
from megatron_stare.plan import planner as plan
from megatron_stare import train
from megatron_stare.models.tiny import build_tiny_hf_model
from megatron_stare.rewards.synthetic import make_task, write_jsonl

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_cpu.yaml"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A tiny model, data, and the overrides of a run that passes the preflight."""
    d = tmp_path_factory.mktemp("preflight")
    build_tiny_hf_model("qwen2", d / "model", num_layers=2)
    build_tiny_hf_model("qwen2", d / "model3", num_layers=3)  # another size, for model.ref_path
    write_jsonl(make_task("add", 8, seed=0, digits=1), d / "train.jsonl")
    return d


def _model_copy(good, tmp, edit=None, drop=()):
    out = tmp / "model_copy"
    shutil.copytree(good / "model", out)
    for name in drop:
        (out / name).unlink()
    if edit is not None:
        cfg = json.loads((out / "config.json").read_text())
        edit(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    return out


def _write(tmp, name, data: bytes):
    (tmp / name).write_bytes(data)
    return tmp / name


def _seq_cls(cfg):
    cfg["architectures"] = ["Qwen2ForSequenceClassification"]


def _vision(cfg):
    cfg.update(architectures=["Qwen2VLForConditionalGeneration"], model_type="qwen2_vl",
               vision_config={"depth": 2, "embed_dim": 64})


def _more_tokens(good, tmp):
    """The model's tokenizer with extra tokens: ids beyond the model's vocab_size."""
    from transformers import AutoTokenizer

    out = _model_copy(good, tmp)
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_tokens([f"<extra_{i}>" for i in range(2000)])
    tok.save_pretrained(out)
    return out


def _lfs_pointer(good, tmp):
    out = _model_copy(good, tmp)
    (out / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:"
                                           + "0" * 64 + "\nsize 123456\n")
    return out


def _config_file(tmp, extra: bytes):
    return _write(tmp, "c.yaml", EXAMPLE.read_bytes() + extra)


def _data(name: str, data: bytes, field: str = "train_path"):
    return lambda g, t: ([f"data.{field}={_write(t, name, data)}"], None)


def _model(**kw):
    return lambda g, t: ([f"model.path={_model_copy(g, t, **kw)}"], None)


ROW = b'{"prompt": "1+1", "answer": "2"}\n'
LONG = json.dumps({"prompt": "1 + 1 " * 200, "answer": "2"}).encode()

# (case id, builder(good, tmp) -> (overrides, config file or None), needle of the one line)
CASES = [
    ("csv-named-parquet", _data("x.parquet", b"prompt,answer\n1+1,2\n"), "data.train_path: "),
    ("jsonl-cp1252-byte", _data("x.jsonl", b'{"prompt": "caf\xe9", "answer": "2"}\n'), "x.jsonl"),
    ("every-prompt-too-long", _data("x.jsonl", LONG + b"\n" + LONG), "over data.max_prompt_length=64"),
    ("every-answer-empty", _data("x.jsonl", b'{"prompt": "1+1", "answer": ""}\n' * 3), "answer"),
    ("eval-cut-mid-row", _data("e.jsonl", ROW + b'{"prompt": "2+2", "ans', "eval_path"), "data.eval_path: "),
    ("empty-train-file", _data("x.jsonl", b""), "no rows in"),
    ("sequence-classification", _model(edit=_seq_cls), "unsupported HF architecture ['Qwen2ForSequenceClassification']"),
    ("vision-language", _model(edit=_vision), "vision-language"),
    ("no-config-json", _model(drop=("config.json",)), "no config.json in"),
    ("no-weights", _model(drop=("model.safetensors",)), "no model.safetensors"),
    ("lfs-pointer-weights", lambda g, t: ([f"model.path={_lfs_pointer(g, t)}"], None), "git lfs pull"),
    ("tokenizer-beyond-vocab", lambda g, t: ([f"model.path={_more_tokens(g, t)}"], None),
     "ids >= 397 have no embedding row"),
    ("ref-model-other-size", lambda g, t: ([f"model.ref_path={g / 'model3'}", "algorithm.kl_loss_coef=0.1"], None),
     "model.ref_path: "),
    ("resume-an-hf-dir", lambda g, t: ([f"checkpoint.resume={g / 'model'}"], None), "is an HF model directory"),
    ("checkpoint-dir-is-a-file", lambda g, t: ([f"checkpoint.dir={_write(t, 'ckpt', b'x')}"], None),
     "is a file, not a directory"),
    ("wandb-not-installed", lambda g, t: (["logging.wandb_project=p"], None), "needs wandb: pip install wandb"),
    ("config-not-utf8", lambda g, t: ([], _config_file(t, b"# caf\xe9\n")), "is not UTF-8"),
    ("optimizer-twice", lambda g, t: ([], _config_file(t, b"optimizer:\n  lr: 1.0e-3\n")),
     "key 'optimizer' is given twice"),
]


def _args(good, tmp, case):
    overrides, cfg_file = case(good, tmp)
    base = [f"model.path={good / 'model'}", f"data.train_path={good / 'train.jsonl'}",
            f"checkpoint.dir={tmp / 'run' / 'ckpt'}", f"logging.dir={tmp / 'run' / 'logs'}",
            "logging.tensorboard=false"]
    return ["--config", str(cfg_file or EXAMPLE), *base, *overrides]


def _one_line(err: str, needle: str) -> str:
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], err[-3000:]
    return errors[0]


@pytest.mark.parametrize("case,needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_bad_input_is_one_line_on_both_entry_points(good, tmp_path, monkeypatch, capsys, case, needle):
    args = _args(good, tmp_path, case)
    assert config_cli.main([*args, "--world-size", "2", "--quiet"]) == 2
    line = _one_line(capsys.readouterr().err, needle)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert train.main(args) == 2  # before process-group init: it would fail there otherwise
    assert _one_line(capsys.readouterr().err, needle) == line
    assert not (tmp_path / "run" / "ckpt").exists()  # nothing was written


def test_the_good_run_passes_and_the_commands_refuse_for_real(good, tmp_path):
    """The base config passes; then the real commands on one bad input (no rank but 0 prints)."""
    args = _args(good, tmp_path, lambda g, t: ([], None))
    assert config_cli.main([*args, "--world-size", "2", "--quiet"]) == 0
    bad = [*args, f"checkpoint.resume={good / 'model'}"]
    env = {k: v for k, v in os.environ.items() if k != "MASTER_ADDR"}
    cli = subprocess.run([sys.executable, "-m", "megatron_stare.config", *bad, "--world-size", "2", "--quiet"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert cli.returncode == 2 and cli.stderr.count("\n") == 1, cli.stderr
    trainer = subprocess.run([sys.executable, "-m", "megatron_stare.train", *bad], capture_output=True, text=True,
                             timeout=300, env={**env, "WORLD_SIZE": "2", "RANK": "0"})
    assert trainer.returncode == 2 and _one_line(trainer.stderr, "is an HF model directory") in cli.stderr
    rank1 = subprocess.run([sys.executable, "-m", "megatron_stare.train", *bad], capture_output=True, text=True,
                           timeout=300, env={**env, "WORLD_SIZE": "2", "RANK": "1"})
    assert rank1.returncode == 2 and "error:" not in rank1.stderr


def test_low_free_space_is_a_warning(good, tmp_path, capsys):
    """checkpoint.dir on a file system with less room than a checkpoint: a warning, not an error."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("needs mount (root) for a small tmpfs")
    try:
        args = _args(good, tmp_path, lambda g, t: ([f"checkpoint.dir={mnt / 'ckpt'}"], None))
        assert config_cli.main([*args, "--world-size", "2", "--quiet"]) == 0
        err = capsys.readouterr().err
        assert f"warning: checkpoint.dir: {mnt} has 0.00 GiB free, less than one checkpoint" in err, err
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_dry_run_says_what_it_skipped(good, tmp_path, capsys):
    """The planner checks a config for another machine: paths are not read, and it says so."""
    code = plan.main(["--config", str(EXAMPLE), "--world-size", "2", "--hf-config", str(good / "model"),
                      "model.path=/elsewhere/model", "data.train_path=/elsewhere/train.jsonl"])
    out = capsys.readouterr().out
    assert code in (0, 3) and "not checked here (dry run): model weights and tokenizer" in out, out
