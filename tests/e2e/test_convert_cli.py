"""The converters from the command line: HF -> Megatron distributed checkpoint -> HF is bit-exact
(plain python at world size 1, and under torchrun at TP2 / PP2), with clear errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_stare.testing.hf_models import build_tiny_hf_model

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _run(args, torchrun=False, expect_ok=True, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "PYTHONWARNINGS": "ignore"}
    cmd = (TORCHRUN if torchrun else [sys.executable]) + ["-m"] + args
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if expect_ok:
        assert p.returncode == 0, f"{' '.join(cmd)}\nSTDOUT:\n{p.stdout[-3000:]}\nSTDERR:\n{p.stderr[-3000:]}"
    return p


def _tensors(hf_dir):
    from megatron_stare.models.hf_io import HFCheckpointReader

    r = HFCheckpointReader(hf_dir)
    return {n: r.get(n) for n in r.names()}


def _assert_same_model(src, out):
    a, b = _tensors(src), _tensors(out)
    assert sorted(a) == sorted(b)
    bad = [n for n in a if a[n].dtype != b[n].dtype or not torch.equal(a[n], b[n])]
    assert not bad, f"tensors differ after the round trip: {bad[:5]}"
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / f).read_bytes() == (src / f).read_bytes(), f
    ca, cb = (json.loads((d / "config.json").read_text()) for d in (src, out))
    assert {k: v for k, v in ca.items() if k != "transformers_version"} == \
        {k: v for k, v in cb.items() if k != "transformers_version"}


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_models")
    return {"qwen3": build_tiny_hf_model("qwen3", root / "qwen3", seed=7, tie_word_embeddings=True),
            "qwen2": build_tiny_hf_model("qwen2", root / "qwen2", seed=8)}


def test_help():
    for mod in ("checkpoints_convert.hf_to_megatron", "checkpoints_convert.megatron_to_hf"):
        p = _run([mod, "--help"])
        assert "--tp" in p.stdout and "--out" in p.stdout


def test_round_trip_single_process(hf, tmp_path):
    import transformers

    ckpt, out = tmp_path / "ckpt", tmp_path / "hf_out"
    p = _run(["checkpoints_convert.hf_to_megatron", "--hf-dir", str(hf["qwen3"]), "--out", str(ckpt)])
    assert "saved distributed checkpoint" in p.stdout
    p = _run(["checkpoints_convert.megatron_to_hf", "--ckpt", str(ckpt), "--out", str(out),
              "--shard-size", "300KB"])
    assert "wrote shard 2" in p.stdout  # several shards, with an index
    assert (out / "model.safetensors.index.json").is_file()
    _assert_same_model(hf["qwen3"], out)
    tokens = torch.arange(10).unsqueeze(0)
    with torch.no_grad():
        a, b = (transformers.AutoModelForCausalLM.from_pretrained(d)(tokens).logits
                for d in (hf["qwen3"], out))
    assert torch.equal(a, b)


def test_round_trip_under_torchrun_tp2_then_pp2(hf, tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf_out"
    _run(["checkpoints_convert.hf_to_megatron", "--hf-dir", str(hf["qwen2"]), "--out", str(ckpt),
          "--tp", "2"], torchrun=True)
    meta = json.loads((ckpt / "megatron_stare.json").read_text())
    assert meta["saved_layout"] == {"tp": 2, "pp": 1, "dp": 1, "ep": 1, "etp": 1}
    _run(["checkpoints_convert.megatron_to_hf", "--ckpt", str(ckpt), "--out", str(out), "--pp", "2",
          "--shard-size", "200KB", "--hf-config-dir", str(hf["qwen2"])], torchrun=True)
    _assert_same_model(hf["qwen2"], out)


def test_clear_errors(hf, tmp_path):
    p = _run(["checkpoints_convert.hf_to_megatron", "--hf-dir", str(tmp_path / "none"), "--out",
              str(tmp_path / "x")], expect_ok=False)
    assert p.returncode == 2 and "error: no config.json in" in p.stderr
    p = _run(["checkpoints_convert.megatron_to_hf", "--ckpt", str(tmp_path / "none"), "--out",
              str(tmp_path / "y")], expect_ok=False)
    assert p.returncode == 2 and "error: no checkpoint at" in p.stderr
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in hf["qwen2"].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 320}))
    p = _run(["checkpoints_convert.hf_to_megatron", "--hf-dir", str(bad), "--out", str(tmp_path / "z")],
             expect_ok=False)
    assert p.returncode == 2 and "shape mismatch" in p.stderr and "gate_proj" in p.stderr
    assert not (tmp_path / "z").exists()
