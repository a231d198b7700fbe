"""Config loading and validation: good configs load; each bad input is one clear line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_stare.config.load import Config, ConfigError, load_config
from megatron_stare.preflight.checks import validate_config
from megatron_stare.algorithms.off_policy import run_off_policy
from megatron_stare.models.tiny import build_tiny_hf_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def files(tmp_path):
    # A real tiny model (the preflight reads its weights and tokenizer): 4 layers, 4 heads, 2 KV heads.
    model = build_tiny_hf_model("qwen2", tmp_path / "model", num_layers=4, vocab_size=301,
                                max_position_embeddings=4096)
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    return [f"model.path={model}", f"data.train_path={data}"]


def _error(overrides, files, world_size=2, path=None):
    with pytest.raises(ConfigError) as info:
        validate_config(load_config(path, files + overrides), world_size=world_size, cuda=False)
    msg = str(info.value)
    assert "\n" not in msg, "errors must be one line"
    assert msg.startswith("config: ")
    return msg


def test_defaults_and_example_load(files):
    cfg = validate_config(load_config(None, files), world_size=1, cuda=False)
    assert isinstance(cfg, Config) and cfg.algorithm.stare.top_p == 0.1
    example = load_config(str(ROOT / "examples" / "tiny_cpu.yaml"), files)
    validate_config(example, world_size=2, cuda=False)
    assert example.parallel.tp == 2 and example.algorithm.policy_loss == "stare"


def test_overrides_are_typed(files):
    cfg = load_config(None, files + ["optimizer.lr=3e-6", "parallel.tp=2", "rollout.verify_sync=true",
                                     "algorithm.clip_ratio_c=null", "algorithm.stare.variant=C2"])
    assert cfg.optimizer.lr == 3e-6 and cfg.parallel.tp == 2 and cfg.rollout.verify_sync == "checksums"
    assert cfg.algorithm.clip_ratio_c is None and cfg.algorithm.stare.variant == "C2"


@pytest.mark.parametrize("overrides,world,needle", [
    (["parallel.tp=3"], 6, "does not divide the 4 attention heads"),
    (["parallel.tp=4", "parallel.pp=1"], 4, "does not divide the 2 key/value heads"),
    (["parallel.pp=3"], 3, "does not divide the 4 layers"),
    (["parallel.tp=2"], 3, "world size 3 is not divisible by tp*pp*cp"),
    (["parallel.dp=4"], 2, "parallel.dp=4 but world size 2"),
    (["parallel.tp=0"], 2, "parallel.tp must be >= 1"),
    (["optimizer.lrr=1"], 1, "unknown key 'optimizer.lrr'; did you mean 'optimizer.lr'?"),
    (["optimiser.lr=1"], 1, "unknown key 'optimiser'; did you mean 'optimizer'?"),
    (["optimizer.lr=fast"], 1, "optimizer.lr must be a float, got 'fast' (str)"),
    (["parallel.tp=two"], 1, "parallel.tp must be an integer, got 'two'"),
    (["rollout.n=2.5"], 1, "rollout.n must be an integer"),
    (["rollout.verify_sync=maybe"], 1, "rollout.verify_sync must be one of 'probe', 'checksums', 'off' or true or false"),
    (["rollout.engine=tgi"], 1, "rollout.engine must be one of 'hf', 'vllm'"),
    (["model.path=/nonexistent/model"], 1, "model.path: directory not found: /nonexistent/model"),
    (["data.train_path=/nonexistent.jsonl"], 1, "data.train_path: file not found"),
    (["checkpoint.resume=/nonexistent/ckpt"], 1, "checkpoint.resume: checkpoint not found"),
    (["parallel.sequence_parallel=true"], 1, "parallel.sequence_parallel needs parallel.tp > 1"),
    (["parallel.cp=2"], 3, "world size 3 is not divisible by tp*pp*cp = 1*1*2"),
    (["rollout.engine=sglang"], 1, "rollout.engine=sglang needs CUDA"),
    (["algorithm.stare.top_p=1.5"], 1, "algorithm.stare.top_p must be in (0, 1] (P is the fraction"),
    (["algorithm.policy_loss=ppo2"], 1, "algorithm.policy_loss must be one of"),
    (["trainer.prompts_per_step=6", "trainer.mini_batches_per_step=4"], 1, "not divisible by"),
    (["algorithm.loss_agg_mode=seq-mean-token-sum-norm"], 1, "seq_mean_norm_const must be > 0"),
    (["rollout.top_p=0"], 1, "rollout.top_p must be in (0, 1]"),
    (["parallel=3"], 1, "parallel must be a mapping (section)"),
    (["trainer.eval_every=5"], 1, "trainer.eval_every > 0 needs data.eval_path"),
    (["trainer.staleness=1"], 2, "trainer.staleness=1 needs a server engine that generates while the "
                                 "trainer trains, but rollout.engine=hf"),
    (["trainer.staleness=-1"], 1, "trainer.staleness must be >= 0"),
    (["trainer.staleness=1", "rollout.engine=vllm-server", "trainer.dynamic_sampling=true"], 2,
     "trainer.staleness=1 with trainer.dynamic_sampling=true"),
    (["trainer.ratio_mask_low=1.5"], 1, "trainer.ratio_mask_low must be in (0, 1]"),
    (["trainer.ratio_mask_high=0.9"], 1, "trainer.ratio_mask_high must be >= 1"),
    (["trainer.partial_rollout_tokens=4"], 1, "trainer.partial_rollout_tokens=4 needs trainer.staleness >= 1"),
    (["trainer.partial_rollout_tokens=-1"], 1, "trainer.partial_rollout_tokens must be >= 0"),
    (["trainer.partial_segments_per_version=0"], 1, "trainer.partial_segments_per_version must be >= 1"),
    (["trainer.partial_rollout_tokens=4", "trainer.staleness=1", "rollout.engine=vllm-server",
      "rollout.multi_turn.env=calculator"], 2, "partial rollouts cut single-turn responses only"),
])
def test_bad_input_gives_one_clear_line(files, overrides, world, needle):
    msg = _error(overrides, files, world_size=world)
    assert needle in msg, msg


def test_staleness_accepts_a_server_engine(files):
    """The old band fields still work (one deprecation line) and give the band mask's bounds."""
    with pytest.warns(FutureWarning, match="trainer.ratio_mask_low/high are deprecated"):
        cfg = validate_config(load_config(None, files + ["trainer.staleness=2", "rollout.engine=vllm-server",
                                                         "trainer.ratio_mask_high=inf"]), world_size=2, cuda=False)
    corr, _ = run_off_policy(cfg)
    assert cfg.trainer.staleness == 2 and corr.rules == ("band_mask",)
    assert (corr.bounds.band_low, corr.bounds.band_high) == (0.5, float("inf"))


def test_sequence_parallel_distributed_optimizer_and_bf16_validate_on_cpu(files):
    cfg = validate_config(load_config(None, files + [
        "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.distributed_optimizer=true",
        "model.dtype=bfloat16"]), world_size=4, cuda=False)
    assert cfg.parallel.sequence_parallel and cfg.model.dtype == "bfloat16"


def test_context_parallel_and_packing_validate_on_cpu(files):
    cfg = validate_config(load_config(None, files + [
        "parallel.tp=2", "parallel.cp=2", "parallel.sequence_parallel=true",
        "parallel.pack_sequences=false"]), world_size=4, cuda=False)
    assert cfg.parallel.cp == 2 and cfg.parallel.pack_sequences is False
    assert load_config(None, files).parallel.pack_sequences is True


def test_missing_required_paths():
    with pytest.raises(ConfigError, match="model.path is required"):
        validate_config(load_config(None, []), world_size=1, cuda=False)


def test_bad_files(tmp_path, files):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("parallel:\n  tp: [1\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+ is not valid YAML"):
        load_config(str(bad))
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(str(lst))
    with pytest.raises(ConfigError, match="not of the form a.b=value"):
        load_config(None, ["parallel.tp"])


def test_cli_prints_one_line_on_error(files):
    out = subprocess.run([sys.executable, "-m", "megatron_stare.config", *files, "optimizer.lrr=1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = [ln for ln in out.stderr.splitlines() if ln.strip() and "warn" not in ln.lower()]
    assert lines == ["error: config: unknown key 'optimizer.lrr'; did you mean 'optimizer.lr'?"]


@pytest.mark.parametrize("overrides,needle", [
    # Errors raised by the value checks (config_checks), not only by the loader: run as
    # __main__, the CLI once caught a second ConfigError class and printed a traceback.
    (["algorithm.stare.w=0.9"], "error: config: algorithm.stare.w must be >= 1"),
    (["--world-size", "6", "parallel.tp=3"], "error: config: parallel.tp=3 does not divide the 4 attention heads"),
    (["checkpoint.hf_export_every=2"], "error: config: checkpoint.hf_export_every=2 needs checkpoint.dir"),
])
def test_cli_value_errors_are_one_line_exit_2(files, overrides, needle):
    out = subprocess.run([sys.executable, "-m", "megatron_stare.config", *files, *overrides],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stdout == "" and out.stderr.count("\n") == 1 and out.stderr.startswith(needle), out.stderr


def test_cli_quiet_checks_without_printing(files):
    out = subprocess.run([sys.executable, "-m", "megatron_stare.config", "--quiet", "--world-size", "2",
                          "parallel.tp=2", *files], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout == "", out.stderr
