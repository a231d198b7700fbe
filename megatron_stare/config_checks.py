"""Value and cross-field checks of a loaded ``Config`` (see ``megatron_stare.config``).

``validate_config`` runs before any process group exists; each problem is one ``ConfigError``
line naming the field and the fix.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from megatron_stare.config import Config, ConfigError


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def _model_shape(cfg: Config):
    """The model's shape from an HF config.json next to ``model.path`` (None if not readable)."""
    from megatron_stare.parallel import ModelShape

    path = cfg.model.path
    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        return None
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        hf = json.load(f)
    heads = hf.get("num_attention_heads")
    if not heads or "num_hidden_layers" not in hf:
        return None
    return ModelShape(num_layers=hf["num_hidden_layers"], num_attention_heads=heads,
                      num_query_groups=hf.get("num_key_value_heads", heads),
                      vocab_size=hf.get("vocab_size", 0), hidden_size=hf.get("hidden_size", 0))


def check_config(cfg: Config, world_size: Optional[int] = None, cuda: Optional[bool] = None,
                    check_paths: bool = True) -> Config:
    """Check values and cross-field consistency; raise one ``ConfigError`` line per problem."""
    import torch

    from megatron_stare.parallel import LayoutError, ParallelLayout

    if cuda is None:
        cuda = torch.cuda.is_available()
    p = cfg.parallel
    for name in ("tp", "pp", "cp"):
        _require(getattr(p, name) >= 1, f"parallel.{name} must be >= 1, got {getattr(p, name)}")
    _require(p.dp >= 0, f"parallel.dp must be >= 0 (0 = derive from the world size), got {p.dp}")
    _require(p.micro_batch_tokens >= 1, f"parallel.micro_batch_tokens must be >= 1, got {p.micro_batch_tokens}")
    try:
        if world_size is not None:
            layout = ParallelLayout.from_world(world_size, tp=p.tp, pp=p.pp, cp=p.cp,
                                               sequence_parallel=p.sequence_parallel,
                                               distributed_optimizer=p.distributed_optimizer)
            if p.dp and p.dp != layout.dp:
                raise LayoutError(f"parallel.dp={p.dp} but world size {world_size} / (tp*pp*cp) = "
                                  f"{layout.dp}; set parallel.dp=0 or launch {p.dp * p.tp * p.pp * p.cp} ranks")
        else:
            layout = ParallelLayout(tp=p.tp, pp=p.pp, cp=p.cp, dp=max(p.dp, 1),
                                    sequence_parallel=p.sequence_parallel,
                                    distributed_optimizer=p.distributed_optimizer)
        layout.validate(shape=_model_shape(cfg) if check_paths else None, cuda=cuda)
    except LayoutError as e:
        raise ConfigError(str(e)) from None

    m = cfg.model
    if check_paths:
        _require(m.path is not None, "model.path is required (an HF or Megatron checkpoint directory)")
        _require(os.path.isdir(m.path), f"model.path: directory not found: {m.path}")
        if m.format == "hf":
            _require(os.path.isfile(os.path.join(m.path, "config.json")),
                     f"model.path: no config.json in {m.path} (model.format is 'hf')")
        if m.ref_path is not None:
            _require(os.path.isdir(m.ref_path), f"model.ref_path: directory not found: {m.ref_path}")
    _require(m.make_vocab_size_divisible_by >= 1, "model.make_vocab_size_divisible_by must be >= 1")

    r = cfg.rollout
    _require(r.n >= 1, f"rollout.n must be >= 1, got {r.n}")
    _require(r.temperature > 0, f"rollout.temperature must be > 0, got {r.temperature}")
    _require(0 < r.top_p <= 1, f"rollout.top_p must be in (0, 1], got {r.top_p}")
    _require(r.top_k == -1 or r.top_k >= 1, f"rollout.top_k must be -1 (off) or >= 1, got {r.top_k}")
    _require(r.max_new_tokens >= 1, f"rollout.max_new_tokens must be >= 1, got {r.max_new_tokens}")
    _require(r.tp >= 1, f"rollout.tp must be >= 1, got {r.tp}")
    _require(r.sync_bucket_mb >= 1, f"rollout.sync_bucket_mb must be >= 1, got {r.sync_bucket_mb}")
    _require(0 < r.gpu_memory_utilization <= 1,
             f"rollout.gpu_memory_utilization must be in (0, 1], got {r.gpu_memory_utilization}")
    if r.engine.startswith("sglang"):
        _require(cuda, f"rollout.engine={r.engine} needs CUDA; use rollout.engine=hf or vllm on CPU")
    if world_size is not None and r.engine == "vllm":
        _require(world_size % r.tp == 0,
                 f"rollout.tp={r.tp} does not divide the world size {world_size}; colocated vLLM "
                 f"runs its TP groups inside the trainer's ranks")

    w = cfg.reward
    _require(w.timeout_s > 0, f"reward.timeout_s must be > 0, got {w.timeout_s}")
    _require(w.num_workers >= 0, f"reward.num_workers must be >= 0, got {w.num_workers}")
    _require(w.overlong_buffer_len >= 0, "reward.overlong_buffer_len must be >= 0")
    _require(w.overlong_buffer_len < r.max_new_tokens or w.overlong_buffer_len == 0,
             f"reward.overlong_buffer_len={w.overlong_buffer_len} must be below rollout.max_new_tokens="
             f"{r.max_new_tokens}")

    try:
        cfg.algorithm.validate("algorithm")
    except ValueError as e:
        raise ConfigError(str(e)) from None

    o = cfg.optimizer
    _require(o.lr > 0, f"optimizer.lr must be > 0, got {o.lr}")
    _require(0 <= o.min_lr <= o.lr, f"optimizer.min_lr must be in [0, optimizer.lr], got {o.min_lr}")
    _require(o.weight_decay >= 0, f"optimizer.weight_decay must be >= 0, got {o.weight_decay}")
    _require(0 <= o.adam_beta1 < 1 and 0 <= o.adam_beta2 < 1, "optimizer.adam_beta1/adam_beta2 must be in [0, 1)")
    _require(o.adam_eps > 0, f"optimizer.adam_eps must be > 0, got {o.adam_eps}")
    _require(o.clip_grad >= 0, f"optimizer.clip_grad must be >= 0 (0 disables), got {o.clip_grad}")
    _require(o.warmup_steps >= 0, f"optimizer.warmup_steps must be >= 0, got {o.warmup_steps}")

    d = cfg.data
    if check_paths:
        _require(d.train_path is not None, "data.train_path is required (a .jsonl or .parquet file)")
        for name in ("train_path", "eval_path"):
            path = getattr(d, name)
            if path is not None:
                _require(os.path.isfile(path), f"data.{name}: file not found: {path}")
                _require(path.endswith((".jsonl", ".json", ".parquet")),
                         f"data.{name} must be a .jsonl or .parquet file, got {path}")
    _require(d.max_prompt_length >= 1, f"data.max_prompt_length must be >= 1, got {d.max_prompt_length}")

    c = cfg.checkpoint
    _require(c.save_every >= 0 and c.hf_export_every >= 0, "checkpoint.save_every/hf_export_every must be >= 0")
    _require(c.keep_last >= 1, f"checkpoint.keep_last must be >= 1, got {c.keep_last}")
    if check_paths and c.resume not in ("auto", "never"):
        _require(os.path.isdir(c.resume), f"checkpoint.resume: checkpoint not found: {c.resume} "
                                          f"(use 'auto', 'never' or an existing checkpoint directory)")

    t = cfg.trainer
    _require(t.total_steps >= 1, f"trainer.total_steps must be >= 1, got {t.total_steps}")
    _require(t.prompts_per_step >= 1, f"trainer.prompts_per_step must be >= 1, got {t.prompts_per_step}")
    _require(t.mini_batches_per_step >= 1, "trainer.mini_batches_per_step must be >= 1")
    _require(t.prompts_per_step % t.mini_batches_per_step == 0,
             f"trainer.prompts_per_step={t.prompts_per_step} is not divisible by "
             f"trainer.mini_batches_per_step={t.mini_batches_per_step}; whole prompt groups go to a mini-batch")
    _require(t.ppo_epochs >= 1, f"trainer.ppo_epochs must be >= 1, got {t.ppo_epochs}")
    _require(t.eval_every >= 0, f"trainer.eval_every must be >= 0, got {t.eval_every}")
    if t.eval_every and check_paths:
        _require(d.eval_path is not None, "trainer.eval_every > 0 needs data.eval_path")
    if cfg.algorithm.policy_loss == "stare" or cfg.algorithm.adv_estimator == "grpo":
        _require(r.n >= 2 or cfg.algorithm.adv_estimator != "grpo",
                 "rollout.n must be >= 2 for GRPO-style group advantages")
    return cfg


