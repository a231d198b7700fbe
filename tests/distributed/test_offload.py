"""The trainer's state offloaded while the engine generates (``offload.py``), on CPU: the
same code path as on CUDA, host to host.

While offloaded, every offloaded tensor's storage has size 0 and the process's live tensor
bytes (counted from every Python-reachable tensor, the host copies left out) drop by at least
what the level must free, counted from the model and optimizer: a no-op offload fails. An
update after offload and reload equals one without, bit-exact, in every piece of state:
parameters, gradients (``main_grad`` and the DDP buffers), main params, Adam's moments and step,
and the distributed optimizer's buffers. Two layouts of 2 ranks: DP2 with the distributed
optimizer (its param buffer and shard main params) and TP2 + sequence parallel (the plain bf16
optimizer's fp32 copies); one spawn each, the ``optimizer`` level at DP2 (parameters stay); and
the tiny MoE at EP2 with the distributed optimizer (expert weights, grads and optimizer state)."""

import pytest
import torch

from megatron_stare.trainer.offload import Offloader
from megatron_stare.testing.distributed import run_on_ranks
from megatron_stare.testing.offload_case import run_offload_case

pytestmark = pytest.mark.distributed

CASES = {
    "dp2_distopt_all": dict(world=2, tp=1, level="all", distributed_optimizer=True),
    "tp2_sp_all": dict(world=2, tp=2, level="all", sequence_parallel=True),
    "dp2_distopt_optimizer": dict(world=2, tp=1, level="optimizer", distributed_optimizer=True),
    # The tiny MoE at EP2: the experts' DDP buffers and their optimizer (over expert-data-parallel).
    "ep2_moe_distopt_all": dict(world=2, tp=1, level="all", distributed_optimizer=True, ep=2),
}


@pytest.fixture(scope="module")
def cases():
    cache = {}

    def run(name):
        if name not in cache:
            kw = dict(CASES[name])
            world, tp = kw.pop("world"), kw.pop("tp")
            cache[name] = run_on_ranks(run_offload_case, world, tp, 1, **kw)
        return cache[name]

    return run


@pytest.mark.parametrize("name", list(CASES))
def test_offload_releases_storage(cases, name):
    level = CASES[name]["level"]
    for r in cases(name):
        assert r["expected"] > 0
        assert r["live_drop"] >= r["expected"], (r["live_drop"], r["expected"])
        assert r["freed"] >= r["expected"]
        sizes = r["sizes_offloaded"]
        moved = [n for n in sizes if n.startswith(("main_grad/", "grad_buffer/", "state/"))
                 and not n.endswith("/step")]
        if level == "all":
            moved += [n for n in sizes if n.startswith(("param/", "param_buffer/", "main_param/"))]
            assert "params" in r["kinds"]
        else:
            kept = [n for n in sizes if n.startswith(("param/", "param_buffer/"))]
            assert kept and all(sizes[n] > 0 for n in kept), "the optimizer level moved parameters"
            moved += [n for n in sizes if n.startswith("main_param/")]  # bf16: fp32 copies
        assert moved and all(sizes[n] == 0 for n in moved), [n for n in moved if sizes[n]]
        if CASES[name].get("ep", 1) > 1:
            assert any(".experts." in n for n in moved if n.startswith("main_grad/")), "no expert state moved"
        assert r["sizes_again"] == sizes, "resident() did not offload again"
        during = r["sizes_params_resident"]
        assert all(during[n] > 0 for n in during if n.startswith(("param/", "param_buffer/")))
        assert all(during[n] == 0 for n in moved if n.startswith(("main_grad/", "grad_buffer/", "state/")))


@pytest.mark.parametrize("name", list(CASES))
def test_step_after_offload_is_bit_exact(cases, name):
    for r in cases(name):
        plain, off = r["plain"], r["offload"]
        assert plain.keys() == off.keys()
        assert any(k.endswith("/exp_avg") for k in plain) and any(k.startswith("grad_buffer/") for k in plain)
        if CASES[name].get("distributed_optimizer"):
            assert any(k.startswith("param_buffer/") for k in plain)
        bad = [k for k in plain if not torch.equal(plain[k], off[k])]
        assert not bad, bad[:5]


def test_bad_level_is_one_line():
    with pytest.raises(ValueError, match="trainer.offload='gpu'"):
        Offloader(actor=None, level="gpu")


def test_offload_needs_an_engine_between_the_trainers_phases():
    from megatron_stare.config.load import ConfigError, load_config
    from megatron_stare.preflight.checks import check_config

    cfg = load_config(None, ["trainer.offload=all", "rollout.engine=vllm-server",
                             "rollout.server_urls=[http://rollout:8000]"])
    with pytest.raises(ConfigError, match="trainer.offload=all needs an engine on the trainer's GPUs") as e:
        check_config(cfg, cuda=False, check_paths=False)
    assert "\n" not in str(e.value) and "set trainer.offload=none" in str(e.value)
    check_config(load_config(None, ["trainer.offload=optimizer", "rollout.engine=hf"]), cuda=False, check_paths=False)
