"""Value and cross-field checks of a loaded ``Config`` (see ``megatron_stare.config.load``).

``check_config`` is the one place a config's values are checked, shared by the trainer
(``python -m megatron_stare.train``), the config CLI (``python -m megatron_stare.config``) and
the dry-run planner (``megatron_stare.plan.planner``, the launch scripts' ``--dry-run``). It runs
before any process group exists; each problem is one ``ConfigError`` line naming the field and
the fix. In order:

1. every numeric field's type and range (``config_fields.check_fields``, from the ranges the
   dataclasses declare), then the algorithm sections' own consistency and registered names;
2. the parallel layout against the world size, the device, and the model's shape: TP divides
   the attention heads, the KV heads and the FFN width, PP the layers (``ParallelLayout``);
   the rollout engine's TP against the heads (vLLM's rules) and, colocated, the world size;
   every rollout setting the chosen engine cannot honour (``_check_engine``): by its traits
   (SGLang without CUDA, server URLs for an engine that takes none, top-p/top-k whose
   log-probs the trainer cannot match, checksums SGLang cannot report), then the engine's
   own checks from its folder's descriptor (``rollout/engines/``: the hf engine's one rank;
   on CPU, the head size vLLM's CPU attention serves);
3. lengths: a max-length sequence fits the model's positions and one micro-batch;
4. paths (``check_paths``), and the remaining cross-field rules (schedule, checkpoints, eval);
5. with ``check_paths``, the preflight (``preflight.py``): what the run will read - weights,
   tokenizer, data rows, reward function, the checkpoint to resume, the checkpoint directory.

The model's shape comes from ``hf_config`` (a ``config.json`` dict; the planner passes the one
it plans with) or else from ``model.path/config.json``; without either, shape checks are skipped.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Optional, Sequence
import warnings

from megatron_stare.config.fields import ConfigError, check_fields
from megatron_stare.config.load import load_config
from megatron_stare.config.sections import Config
from megatron_stare.rollout.engines import EngineCheck, descriptor, descriptors
from megatron_stare.envs import EnvError, get_env_class
from megatron_stare.models.sizes import _spec

#: Estimators whose advantage compares the responses of one prompt (a group of rollout.n).
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo")


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def _model_spec(cfg: Config, hf_config: Optional[dict]):
    """The model's ``GPTSpec`` from ``hf_config`` or ``model.path/config.json``; None if neither."""

    where = "model"
    if hf_config is None:
        path = os.path.join(cfg.model.path or "", "config.json")
        if not cfg.model.path or not os.path.isfile(path):
            return None
        where = f"model.path: {path}"
        try:
            with open(path, encoding="utf-8") as f:
                hf_config = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{where} cannot be read ({e})") from None
    try:
        return _spec(hf_config)
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{where}: {e}") from None


def _check_names(cfg: Config) -> None:
    """The algorithm's names and the engine are registered (the registries sit above the config types)."""
    from megatron_stare.algorithms.advantages import ADVANTAGE_ESTIMATORS
    from megatron_stare.algorithms.losses import check_loss_names

    a = cfg.algorithm
    _require(a.adv_estimator in ADVANTAGE_ESTIMATORS, f"algorithm.adv_estimator must be one of "
                                                      f"{sorted(ADVANTAGE_ESTIMATORS)}, got {a.adv_estimator!r}")
    check_loss_names(a, "algorithm")
    descriptor(cfg.rollout.engine)  # an engine is a folder of rollout/engines/


def _check_rollout_layout(cfg: Config, world_size: Optional[int], spec) -> None:
    r = cfg.rollout
    if world_size is not None and descriptor(r.engine).traits.colocated:
        _require(world_size % r.tp == 0,
                 f"rollout.tp={r.tp} does not divide the world size {world_size}; a colocated engine "
                 f"runs its TP groups inside the trainer's ranks")
    if spec is None:
        return
    heads, kv = spec.num_attention_heads, spec.num_query_groups
    _require(heads % r.tp == 0, f"rollout.tp={r.tp} does not divide the {heads} attention heads; "
                                f"choose a divisor of the head count")
    # vLLM splits the KV heads over TP ranks, or replicates them when there are fewer.
    _require(kv % r.tp == 0 if kv >= r.tp else r.tp % kv == 0,
             f"rollout.tp={r.tp} and the {kv} KV heads: one must divide the other (the engine splits "
             f"or replicates the KV heads); choose rollout.tp dividing {kv} or a multiple of it")
    _require(spec.ffn_hidden_size % r.tp == 0, f"rollout.tp={r.tp} does not divide the FFN width "
                                               f"{spec.ffn_hidden_size}; choose a divisor")


def _check_multi_turn(cfg: Config) -> None:
    """The environment resolves (name or dotted path), and an option set only means something
    with one."""

    mt = cfg.rollout.multi_turn
    if not mt.env:
        _require(not mt.env_options, "rollout.multi_turn.env_options are set but rollout.multi_turn.env is "
                                     "empty (single turn); name an environment, or drop the options")
        return
    try:
        get_env_class(mt.env)
    except EnvError as e:
        raise ConfigError(str(e)) from None


def _check_engine(cfg: Config, cuda: bool, world_size: Optional[int], spec) -> None:
    """Rollout settings the chosen engine cannot honour, one line each: by its traits here, then
    its descriptor's own checks (``rollout/engines/<name>/__init__.py``)."""
    r = cfg.rollout
    engine, found = descriptor(r.engine), descriptors()
    t = engine.traits
    if t.cuda_only:
        # The engines of the same kind (in the trainer's processes, or a server) that run on CPU.
        on_cpu = " or ".join(n for n, d in found.items() if not d.traits.cuda_only and d.traits.server == t.server)
        _require(cuda, f"rollout.engine={r.engine} needs CUDA; use rollout.engine={on_cpu} on CPU")
    if not t.server:
        servers = " or ".join(n for n, d in found.items() if d.traits.server)
        _require(not r.server_urls, f"rollout.server_urls is set, but rollout.engine={r.engine} "
                                    f"{'runs inside the trainer ranks' if t.colocated else 'runs in the driver'}"
                                    f" and attaches to no server; use {servers}, or clear rollout.server_urls")
    elif not t.can_spawn:
        _require(bool(r.server_urls), f"rollout.engine={r.engine} attaches to a running server: set "
                                      f"rollout.server_urls=[http://host:port] (start the server with "
                                      f"the command python -m megatron_stare.rollout.server_cmd prints)")
    several = " or ".join(n for n, d in found.items() if d.traits.several_servers)
    _require(len(r.server_urls) <= 1 or t.several_servers,
             f"rollout.server_urls has {len(r.server_urls)} servers; rollout.engine={r.engine} drives one "
             f"(its weight push goes to one server); keep one, or use {several}, whose dispatcher takes several")
    _require(len(set(r.server_urls)) == len(r.server_urls),
             f"rollout.server_urls lists a server twice ({r.server_urls}); list each once")
    for url in r.server_urls:
        _require(re.fullmatch(r"https?://[^/:\s]+:\d+/?", url) is not None,
                 f"rollout.server_urls: {url!r} is not of the form http://host:port")
    for name, off, value in (("top_p", 1.0, r.top_p), ("top_k", -1, r.top_k)):
        _require(value == off, f"rollout.{name}={value}: engines return the log-probs of the "
                               f"{name.replace('_', '-')}-filtered distribution they sample from, which the "
                               f"trainer's log-prob pass (softmax(logits / temperature) over the whole "
                               f"vocabulary) cannot match; set rollout.{name}={off:g} (rollout.eval_top_p "
                               f"still filters evaluation)")
    _require(t.reports_checksums or r.verify_sync != "checksums",
             f"rollout.verify_sync=checksums, but rollout.engine={r.engine} cannot report checksums of the "
             f"weights it holds; use rollout.verify_sync=probe (any engine) or off")
    for check in engine.checks:
        check(EngineCheck(cfg=cfg, cuda=cuda, world_size=world_size, model=spec))


def _check_lengths(cfg: Config, spec) -> None:
    r, p, d = cfg.rollout, cfg.parallel, cfg.data
    max_seq = d.max_prompt_length + r.max_response_tokens
    resp = "rollout.multi_turn.max_total_tokens" if r.multi_turn.env else "rollout.max_new_tokens"
    if spec is not None:
        _require(max_seq <= spec.max_position_embeddings,
                 f"data.max_prompt_length + {resp} = {max_seq} exceeds the model's "
                 f"max_position_embeddings {spec.max_position_embeddings}; shorten them")
    _require(p.micro_batch_tokens >= max_seq,
             f"parallel.micro_batch_tokens={p.micro_batch_tokens} is below the longest sequence, "
             f"data.max_prompt_length + {resp} = {max_seq}, which would get a "
             f"micro-batch of its own beyond the budget; raise micro_batch_tokens to >= {max_seq}")
    w = cfg.reward
    budget = ("rollout.max_new_tokens" if not r.multi_turn.env else
              "the model-token budget min(rollout.multi_turn.max_turns * rollout.max_new_tokens, "
              "rollout.multi_turn.max_total_tokens)")
    _require(w.overlong_buffer_len < r.max_model_tokens or w.overlong_buffer_len == 0,
             f"reward.overlong_buffer_len={w.overlong_buffer_len} must be below {budget}="
             f"{r.max_model_tokens}")


def _check_schedule(cfg: Config) -> None:
    o, t, a, c = cfg.optimizer, cfg.trainer, cfg.algorithm, cfg.checkpoint
    _require(o.min_lr <= o.lr, f"optimizer.min_lr={o.min_lr} is above optimizer.lr={o.lr}; "
                               f"set min_lr <= lr")
    optimizer_steps = t.total_steps * t.mini_batches_per_step * t.ppo_epochs
    _require(o.warmup_steps < optimizer_steps or o.warmup_steps == 0,
             f"optimizer.warmup_steps={o.warmup_steps} is not below the run's {optimizer_steps} optimizer "
             f"steps (trainer.total_steps * mini_batches_per_step * ppo_epochs), so the learning rate "
             f"would never reach optimizer.lr; lower warmup_steps")
    _require(t.prompts_per_step % t.mini_batches_per_step == 0,
             f"trainer.prompts_per_step={t.prompts_per_step} is not divisible by "
             f"trainer.mini_batches_per_step={t.mini_batches_per_step}; whole prompt groups go to a mini-batch")
    if a.adv_estimator in GROUP_ESTIMATORS:
        _require(cfg.rollout.n >= 2, f"rollout.n must be >= 2 for group advantages "
                                     f"(algorithm.adv_estimator={a.adv_estimator}), got {cfg.rollout.n}")
    _require(not t.eval_every or cfg.data.eval_path is not None, "trainer.eval_every > 0 needs data.eval_path")
    _check_staleness(cfg)
    _check_offload(cfg)
    for name in ("save_every", "save_every_minutes", "hf_export_every"):
        _require(not getattr(c, name) or c.dir is not None,
                 f"checkpoint.{name}={getattr(c, name)} needs checkpoint.dir (where they are written); "
                 f"set checkpoint.dir or checkpoint.{name}=0")


def _check_staleness(cfg: Config) -> None:
    """Asynchronous training (``rollout/async_loop.py``) needs an engine that generates in its own
    process while the trainer trains, and one generation batch per step."""
    t, r = cfg.trainer, cfg.rollout
    _require(not t.partial_rollout_tokens or t.staleness > 0,
             f"trainer.partial_rollout_tokens={t.partial_rollout_tokens} needs trainer.staleness >= 1 (a "
             f"synchronous step has no weight update during generation); set one of them")
    _require(not t.partial_rollout_tokens or not r.multi_turn.env,
             f"trainer.partial_rollout_tokens={t.partial_rollout_tokens} with rollout.multi_turn.env="
             f"{r.multi_turn.env}: partial rollouts cut single-turn responses only; set "
             f"trainer.partial_rollout_tokens=0")
    if t.staleness == 0:
        return
    servers = " or ".join(n for n, d in descriptors().items() if d.traits.server)
    _require(descriptor(r.engine).traits.server,
             f"trainer.staleness={t.staleness} needs a server engine that generates while the trainer "
             f"trains, but rollout.engine={r.engine}; use rollout.engine={servers} or trainer.staleness=0")
    _require(not t.dynamic_sampling, f"trainer.staleness={t.staleness} with trainer.dynamic_sampling=true: "
                                     f"a step's extra generation batches cannot be drawn ahead; set one of "
                                     f"trainer.dynamic_sampling=false or trainer.staleness=0")


def _warn_off_policy_deprecations(cfg: Config) -> None:
    """One line per old off-policy field the run still sets (they keep working)."""

    from megatron_stare.algorithms.off_policy import run_off_policy

    for note in run_off_policy(cfg)[1]:
        # No source location: the line the user reads is the note itself, not a call site.
        warnings.warn_explicit(note, FutureWarning, filename="config", lineno=0)


def _check_offload(cfg: Config) -> None:
    """Offloading the trainer's state (``offload.py``) pays only while a colocated engine
    generates on the same GPUs between the trainer's phases."""
    t, r = cfg.trainer, cfg.rollout
    # In the trainer's processes (colocated, or in the driver's): a server is a process of its own.
    between = [n for n, d in descriptors().items() if not d.traits.server]
    _require(t.offload == "none" or r.engine in between,
             f"trainer.offload={t.offload} needs an engine on the trainer's GPUs that generates between "
             f"its phases ({', '.join(between)}), but rollout.engine={r.engine}; set trainer.offload=none")


def _check_routing_replay(cfg: Config, spec) -> None:
    """Routing replay needs a mixture-of-experts model, and r3 an engine that returns routes
    (vLLM-CPU cannot capture them: its descriptor's check, ``rollout/vllm_cpu.py``)."""
    r = cfg.rollout
    if r.routing_replay == "none":
        return
    _require(spec is None or spec.moe is not None,
             f"rollout.routing_replay={r.routing_replay} needs a mixture-of-experts model, but "
             f"{cfg.model.path} is dense; set rollout.routing_replay=none")
    _require(r.routing_replay != "r3" or descriptor(r.engine).traits.routed_experts,
             f"rollout.routing_replay=r3 needs an engine that returns routed experts "
             f"({', '.join(n for n, d in descriptors().items() if d.traits.routed_experts)}), but "
             f"rollout.engine={r.engine}; use one of those, or rollout.routing_replay=r2")


def check_config(cfg: Config, world_size: Optional[int] = None, cuda: Optional[bool] = None,
                 check_paths: bool = True, hf_config: Optional[dict] = None) -> Config:
    """Check values and cross-field consistency; raise one ``ConfigError`` line per problem.

    ``world_size``: ranks of the run (None: layout checks that need it are skipped). ``cuda``:
    whether the run has GPUs (None: this machine's). ``check_paths``: model/data/checkpoint
    paths must exist here. ``hf_config``: the model's HF ``config.json`` dict for the shape
    checks (None: read from ``model.path`` when it is there).
    """
    import torch

    from megatron_stare.runtime.parallel import LayoutError, ModelShape, ParallelLayout

    check_fields(cfg)
    cfg.algorithm.validate("algorithm")
    _check_names(cfg)
    _warn_off_policy_deprecations(cfg)
    if cuda is None:
        cuda = torch.cuda.is_available()
    spec = _model_spec(cfg, hf_config)
    shape = None if spec is None else ModelShape(
        num_layers=spec.num_layers, num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups, vocab_size=spec.vocab_size, hidden_size=spec.hidden_size)
    p = cfg.parallel
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
        layout.validate(shape=shape)
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    if spec is not None:
        _require(spec.ffn_hidden_size % p.tp == 0, f"parallel.tp={p.tp} does not divide the FFN width "
                                                   f"{spec.ffn_hidden_size}; choose tp dividing it")

    m = cfg.model
    if check_paths:
        _require(m.path is not None, "model.path is required (an HF or Megatron checkpoint directory)")
        _require(os.path.isdir(m.path), f"model.path: directory not found: {m.path}")
        if m.format == "hf":
            _require(os.path.isfile(os.path.join(m.path, "config.json")),
                     f"model.path: no config.json in {m.path} (model.format is 'hf')")
        if m.ref_path is not None:
            _require(os.path.isdir(m.ref_path), f"model.ref_path: directory not found: {m.ref_path}")

    _check_engine(cfg, cuda, world_size, spec)
    _require(cuda or cfg.model.attention_backend != "te",
             "model.attention_backend=te needs CUDA (transformer-engine's attention); on CPU set "
             "model.attention_backend=auto or torch")
    _check_multi_turn(cfg)
    _check_rollout_layout(cfg, world_size, spec)
    _check_lengths(cfg, spec)
    _check_routing_replay(cfg, spec)

    d = cfg.data
    if check_paths:
        _require(d.train_path is not None, "data.train_path is required (a .jsonl or .parquet file)")
        for name in ("train_path", "eval_path"):
            path = getattr(d, name)
            if path is not None:
                _require(os.path.isfile(path), f"data.{name}: file not found: {path}")
                _require(path.endswith((".jsonl", ".json", ".parquet")),
                         f"data.{name} must be a .jsonl or .parquet file, got {path}")

    c = cfg.checkpoint
    if check_paths and c.resume not in ("auto", "never"):
        _require(os.path.isdir(c.resume), f"checkpoint.resume: checkpoint not found: {c.resume} "
                                          f"(use 'auto', 'never' or an existing checkpoint directory)")
    _check_schedule(cfg)
    if check_paths:
        # Reads the weight headers, the tokenizer and the data (torch, transformers): not at import.
        from megatron_stare.preflight.inputs import preflight

        preflight(cfg)
    return cfg


def validate_config(cfg: Config, world_size: Optional[int] = None, cuda: Optional[bool] = None,
                    check_paths: bool = True, hf_config: Optional[dict] = None) -> Config:
    """Check values and cross-field consistency (``check_config``); returns ``cfg``."""
    return check_config(cfg, world_size=world_size, cuda=cuda, check_paths=check_paths, hf_config=hf_config)


def resolve_config(path: Optional[str], overrides: Sequence[str] = (), **checks: Any) -> Config:
    """``load_config`` then ``validate_config(**checks)``: the one path from files to a checked config."""
    return validate_config(load_config(path, overrides), **checks)
