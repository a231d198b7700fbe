"""``UserError`` (``megatron_stare/errors.py``): the trainer's one-line exit 2 is for the project's
user errors only. A library's ``ValueError`` (here ``json.JSONDecodeError``, what a server's
plain-text reply parsed as JSON raised) is a crash with its traceback, not "exit 2, error: ..."
on the one rank that hit it while the others wait in a collective."""

import json

import pytest

from megatron_stare import train
from megatron_stare.checkpoint.core import CheckpointError
from megatron_stare.config.fields import ConfigError
from megatron_stare.data.readers import DataError
from megatron_stare.envs.base import EnvError
from megatron_stare.errors import UserError
from megatron_stare.trainer.metrics import MetricsError
from megatron_stare.models.tiny import build_tiny_hf_model
from megatron_stare.runtime.parallel import LayoutError
from megatron_stare.runtime.rendezvous import RendezvousError
from megatron_stare.rewards.registry import RewardError
from megatron_stare.rewards.synthetic import make_task, write_jsonl

from .test_preflight import EXAMPLE


def test_every_user_error_class_is_a_user_error():
    for cls in (CheckpointError, ConfigError, DataError, EnvError, LayoutError, MetricsError, RendezvousError,
                RewardError):
        assert issubclass(cls, UserError) and issubclass(cls, ValueError), cls
    assert not issubclass(json.JSONDecodeError, UserError)


@pytest.fixture(scope="module")
def args(tmp_path_factory):
    d = tmp_path_factory.mktemp("usererr")
    build_tiny_hf_model("qwen2", d / "model", num_layers=2)
    write_jsonl(make_task("add", 8, seed=0, digits=1), d / "train.jsonl")
    return ["--config", str(EXAMPLE), f"model.path={d / 'model'}", f"data.train_path={d / 'train.jsonl'}",
            f"checkpoint.dir={d / 'ckpt'}", f"logging.dir={d / 'logs'}", "logging.tensorboard=false", "parallel.tp=1"]


@pytest.mark.parametrize("error,user", [(DataError("train.jsonl row 3: no prompt"), True),
                                        (json.JSONDecodeError("Expecting value", "Cache flushed.", 0), False)])
def test_only_a_user_error_exits_2_in_one_line(args, monkeypatch, capsys, error, user):
    class Failing:
        def __init__(self, *a, **k):
            pass

        def fit(self):
            raise error

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(train, "Trainer", Failing)
    if user:
        assert train.main(args) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: {error}"
    else:
        with pytest.raises(json.JSONDecodeError):
            train.main(args)
