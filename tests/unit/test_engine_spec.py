"""The engine spec (``rollout/spec.py``): built from the config and the layout alone, where each
engine lives, what the config refuses because an engine cannot honour it (one line each), and the
server command a launch script starts an attached server with."""

import subprocess
import sys

import pytest

from megatron_stare.config.load import ConfigError, load_config
from megatron_stare.preflight.checks import validate_config
from megatron_stare.rollout import EngineSpec, EngineWorld

BASE = ["model.path=/models/policy", "data.max_prompt_length=1000", "rollout.max_new_tokens=3000",
        "rollout.gpu_memory_utilization=0.45", "model.dtype=bfloat16", "trainer.seed=11"]


def _spec(overrides, rank=0, world=8, local=8, cuda=True):
    cfg = validate_config(load_config(None, BASE + overrides), world_size=world, cuda=cuda, check_paths=False)
    return EngineSpec.from_config(cfg, EngineWorld(rank=rank, world_size=world, local_rank=rank % local,
                                                   local_world_size=local, cuda=cuda, process_group=True))


def test_spec_carries_the_rollout_settings():
    s = _spec(["rollout.engine=vllm", "rollout.tp=2", "rollout.temperature=0.7", "rollout.eval_top_p=0.7"])
    assert (s.model_path, s.tp, s.dtype, s.gpu_memory_utilization, s.context_length, s.seed) == (
        "/models/policy", 2, "bfloat16", 0.45, 4000, 11)
    assert (s.sampling.temperature, s.sampling.top_p, s.sampling.top_k) == (0.7, 1.0, 0)
    assert s.eval_sampling.top_p == 0.7 and s.server_urls == () and s.joins_process_group
    assert not s.sampling.ignore_eos


def test_ignore_eos_reaches_the_training_rollouts_sampling_params_only():
    from megatron_stare.trainer.generation import sampling_params

    s = _spec(["rollout.engine=vllm", "rollout.ignore_eos=true"])
    train, evaluate = sampling_params(s.sampling, seed=1), sampling_params(s.eval_sampling, seed=1)
    assert train.ignore_eos and train.max_new_tokens == 3000 and not evaluate.ignore_eos


@pytest.mark.parametrize("engine,rank,hosts,generates,ranks,gpus,replica,leads", [
    # vLLM: every rank an engine rank (external_launcher); TP groups are the DP replicas, each
    # generating its own slice; the group's first rank contributes it to the gather.
    ("vllm", 5, True, True, (4, 5), (5,), 2, False),
    ("vllm", 4, True, True, (4, 5), (4,), 2, True),
    # SGLang: one Engine per TP group on its leader, over the group's GPUs; each leader generates.
    ("sglang", 2, True, True, (2, 3), (2, 3), 1, True),
    ("sglang", 3, False, False, (2, 3), (2, 3), 1, False),
    ("sglang", 0, True, True, (0, 1), (0, 1), 0, True),
    # A spawned vLLM server: on the driver node's first tp GPUs, which it shares with the trainer.
    ("vllm-server", 0, True, True, (0, 1), (0, 1), 0, True),
    ("vllm-server", 1, False, False, (0, 1), (0, 1), 0, False),
    # hf: in the driver's process, on its GPU.
    ("hf", 0, True, True, (0,), (0,), 0, True),
    ("hf", 3, False, False, (0,), (3,), 0, False),
])
def test_placement(engine, rank, hosts, generates, ranks, gpus, replica, leads):
    d = _spec([f"rollout.engine={engine}", f"rollout.tp={1 if engine == 'hf' else 2}"], rank=rank).devices
    assert (d.hosts_engine, d.generates, d.engine_ranks) == (hosts, generates, ranks)
    assert (d.replica, d.leads_replica, d.replicas) == (replica, leads, 4 if engine in ("vllm", "sglang") else 1)
    if hosts:
        assert d.gpu_ids == gpus and d.shares_trainer_gpus


def test_attached_servers_use_no_trainer_gpu_and_cpu_has_none():
    for engine in ("vllm-server", "sglang-server"):
        d = _spec([f"rollout.engine={engine}", "rollout.server_urls=[http://rollout:8000]"]).devices
        assert d.gpu_ids == () and not d.shares_trainer_gpus and d.hosts_engine
    assert _spec(["rollout.engine=vllm"], cuda=False).devices.gpu_ids == ()


def test_sglang_group_must_fit_a_node():
    with pytest.raises(ConfigError, match="rollout.tp=4 does not divide the 6 GPUs of a node"):
        _spec(["rollout.engine=sglang", "rollout.tp=4"], world=12, local=6)


@pytest.mark.parametrize("overrides,cuda,needle", [
    (["rollout.engine=sglang"], False, "rollout.engine=sglang needs CUDA; use rollout.engine=hf or vllm on CPU"),
    (["rollout.engine=sglang-server", "rollout.server_urls=[http://h:1]"], False, "needs CUDA"),
    (["rollout.engine=vllm", "rollout.server_urls=[http://h:1]"], True,
     "rollout.server_urls is set, but rollout.engine=vllm runs inside the trainer ranks"),
    (["rollout.engine=hf", "rollout.server_urls=[http://h:1]"], True, "rollout.engine=hf runs in the driver"),
    (["rollout.engine=sglang-server"], True, "rollout.engine=sglang-server attaches to a running server"),
    (["rollout.engine=sglang-server", "rollout.server_urls=[http://a:1,http://b:2]"], True,
     "rollout.server_urls has 2 servers; rollout.engine=sglang-server drives one"),
    (["rollout.engine=vllm-server", "rollout.server_urls=[http://a:1,http://a:1]"], True,
     "lists a server twice"),
    (["rollout.engine=vllm-server", "rollout.server_urls=[rollout-node:8000]"], True,
     "'rollout-node:8000' is not of the form http://host:port"),
    (["rollout.top_p=0.9"], False, "rollout.top_p=0.9: engines return the log-probs of the top-p-filtered"),
    (["rollout.top_k=20"], False, "trainer's log-prob pass (softmax(logits / temperature) over the whole vocabulary)"),
    (["rollout.engine=sglang", "rollout.verify_sync=true"], True, "cannot report checksums"),
    (["rollout.engine=vllm", "rollout.tp=3"], True, "rollout.tp=3 does not divide the world size 8"),
    (["rollout.engine=hf", "rollout.tp=2"], True, "rollout.tp=2 but the hf engine runs on one rank"),
])
def test_config_refuses_what_an_engine_cannot_honour(overrides, cuda, needle):
    with pytest.raises(ConfigError) as e:
        validate_config(load_config(None, BASE + overrides), world_size=8, cuda=cuda, check_paths=False)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_server_cmd_prints_the_attached_servers_command(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model: {path: /models/policy, dtype: bfloat16}\nrollout: {engine: vllm-server, tp: 4, "
                   "server_urls: ['http://rollout-node:8100']}\n")
    out = subprocess.run([sys.executable, "-m", "megatron_stare.rollout.server_cmd", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert line.startswith("VLLM_SERVER_DEV_MODE=1 ") and "CUDA_VISIBLE_DEVICES" not in line  # GPUs of its own
    for flag in ("--port 8100", "--tensor-parallel-size 4", "--dtype bfloat16", "--max-model-len 1536",
                 "--logprobs-mode processed_logprobs"):
        assert flag in line, flag
    assert "--enable-sleep-mode" not in line  # it never shares the trainer's GPUs
    out = subprocess.run([sys.executable, "-m", "megatron_stare.rollout.server_cmd", "--config", str(cfg),
                          "rollout.engine=vllm"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.startswith("error: config: rollout.engine=vllm starts no server")
