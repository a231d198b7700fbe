"""Observability: JSONL round trip, rank 0 only, resume truncation, samples, timer, plot (the
console's step line: test_console.py)."""

import json
import math
import os
import time

import pytest
import torch

from megatron_stare.config.load import LoggingConfig
from megatron_stare.trainer.metrics import MetricsError, MetricsLogger, Timer, format_duration, plot_runs, read_metrics

FULL = {"time/generate": 3.14, "time/score": 0.21, "time/logprob": 1.0, "time/update": 2.2, "time/sync": 0.4,
        "perf/tokens_per_s": 812.4, "stare/entropy": 0.4123, "stare/gate": 0.0, "reward/accuracy": 0.531}


def test_jsonl_round_trip_and_non_finite(tmp_path, capsys):
    cfg = LoggingConfig(dir=str(tmp_path / "logs"), tensorboard=False)
    with MetricsLogger(cfg, rank=0, total_steps=3) as logger:
        logger.log(1, {"loss": 0.5, "n": 7, "flag": True, "t": torch.tensor(2.5)})
        logger.log(2, {"loss": float("nan"), "up": float("inf"), "down": -math.inf})
        with open(logger.path) as f:  # flushed per step: readable while the run goes on
            assert len(f.readlines()) == 2
    lines = open(tmp_path / "logs" / "metrics.jsonl").read().splitlines()
    assert json.loads(lines[0]) == {"step": 1, "loss": 0.5, "n": 7, "flag": True, "t": 2.5}
    assert json.loads(lines[1]) == {"step": 2, "loss": "nan", "up": "inf", "down": "-inf"}  # strict JSON
    rows = read_metrics(logger.path)
    assert math.isnan(rows[1]["loss"]) and rows[1]["up"] == math.inf and rows[1]["down"] == -math.inf
    assert capsys.readouterr().out == ""  # the console prints the step line (console.py)
    with MetricsLogger(cfg, rank=0) as logger, pytest.raises(MetricsError, match="'x' must be a number, got list"):
        logger.log(1, {"x": [1]})


def test_other_ranks_write_nothing(tmp_path, capsys):
    cfg = LoggingConfig(dir=str(tmp_path / "logs"), tensorboard=True)
    logger = MetricsLogger(cfg, rank=1)
    logger.log(1, FULL)
    logger.close()
    assert not os.path.exists(tmp_path / "logs") and capsys.readouterr().out == ""


def test_resume_keeps_earlier_steps(tmp_path):
    cfg = LoggingConfig(dir=str(tmp_path), tensorboard=False)
    with MetricsLogger(cfg, rank=0) as logger:
        for s in range(1, 6):
            logger.log(s, {"x": s})
    with open(logger.path, "a") as f:
        f.write('{"step": 6, "x"')  # torn by a crash
    with MetricsLogger(cfg, rank=0, start_step=4) as logger:  # resumed from the step-3 checkpoint
        logger.log(4, {"x": 40})
    assert [(r["step"], r["x"]) for r in read_metrics(logger.path)] == [(1, 1), (2, 2), (3, 3), (4, 40)]
    with MetricsLogger(cfg, rank=0) as logger:  # a fresh run starts a fresh file
        pass
    assert read_metrics(logger.path) == []


def test_tensorboard_events_written(tmp_path):
    cfg = LoggingConfig(dir=str(tmp_path), tensorboard=True)
    with MetricsLogger(cfg, rank=0) as logger:
        logger.log(1, {"loss": 1.0, "nan": float("nan")})
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path))


def test_wandb_missing_is_one_clear_error(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(MetricsError, match="logging.wandb_project='proj' needs wandb: pip install wandb"):
        MetricsLogger(LoggingConfig(dir=str(tmp_path), wandb_project="proj"), rank=3)


def test_format_duration():
    assert [format_duration(s) for s in (0, 42.4, 3599, 3600 * 3 + 300)] == ["0s", "42s", "59m59s", "3h05m"]


def test_samples_jsonl_and_tensorboard_text(tmp_path):
    """A few generations per logged step to samples.jsonl (not the metrics file), truncated on
    resume like the metrics; TensorBoard gets them as text."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = LoggingConfig(dir=str(tmp_path), tensorboard=True)
    one = [{"prompt": "1+1=", "response": " 2", "reward": 1.0}, {"prompt": "2+2=", "response": " 5", "reward": 0}]
    with MetricsLogger(cfg, rank=0) as logger:
        logger.log(2, {"x": 1})
        logger.log_samples(2, one)
        logger.log_samples(4, one[:1])
    rows = read_metrics(str(tmp_path / "samples.jsonl"))
    assert rows == [{"step": 2, **one[0]}, {"step": 2, **one[1]}, {"step": 4, **one[0]}]
    assert [r["step"] for r in read_metrics(logger.path)] == [2]
    acc = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0}).Reload()
    texts = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("samples/text_summary")]
    assert len(texts) == 2 and "1+1=" in texts[0] and "-->  2" in texts[0] and "reward 0.000" in texts[0]
    with MetricsLogger(cfg, rank=0, start_step=3) as logger:  # resumed from the step-2 checkpoint
        logger.log_samples(3, one[1:])
    assert [(r["step"], r["prompt"]) for r in read_metrics(str(tmp_path / "samples.jsonl"))] == \
        [(2, "1+1="), (2, "2+2="), (3, "2+2=")]
    with MetricsLogger(cfg, rank=1) as logger:
        logger.log_samples(5, one)  # other ranks write nothing


def test_timer_collects_phases():
    timer = Timer()
    for _ in range(2):
        with timer("rollout"):
            time.sleep(0.01)
    with pytest.raises(RuntimeError):
        with timer("update"):
            raise RuntimeError("boom")  # still timed
    m = timer.metrics()
    assert set(m) == {"time/rollout", "time/update"} and m["time/rollout"] >= 0.02
    assert timer.metrics() == {}


def test_plot_runs_writes_png(tmp_path):
    paths = {}
    for name, h0 in (("grpo", 0.8), ("stare", 0.6)):
        cfg = LoggingConfig(dir=str(tmp_path / name), tensorboard=False)
        with MetricsLogger(cfg, rank=0) as logger:
            for s in range(1, 9):
                logger.log(s, {"stare/entropy": h0 / s, "reward/accuracy": s / 10, "response/mean_length": 10 + s,
                               "stare/gate": float(h0 / s < 0.2)})
        paths[name] = logger.path
    out = plot_runs(paths, str(tmp_path / "plots" / "runs.png"), target_entropy=0.2)
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    plot_runs(paths, str(tmp_path / "band.png"), target_entropy=(0.15, 0.25))
    assert os.path.getsize(tmp_path / "band.png") > 10_000
