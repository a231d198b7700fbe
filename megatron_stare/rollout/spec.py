"""One engine spec for every rollout engine, built from the config and this process's place.

``EngineSpec.from_config(cfg, world)`` is the only place that reads ``cfg.rollout`` for an
engine: the trainer builds the spec, then the registered engine translates it into ITS API's
arguments (``from_spec``): ``vllm.LLM`` kwargs, the vLLM server's command line, SGLang's
``ServerArgs`` fields, the hf engine's device and dtype. Nothing else assembles engine
arguments.

Placement (each engine's ``EngineTraits``, in its folder's descriptor: ``rollout/engines/``):

- ``vllm``: every trainer rank hosts one engine rank (vLLM's ``external_launcher``); the
  engine's TP groups tile the world and are its ``world / tp`` data-parallel replicas. The
  ranks of one replica make the same calls; each replica generates its own slice of the
  prompts (``rollout/data_parallel.py``).
- ``sglang``: one SGLang server per group of ``rollout.tp`` consecutive ranks, spawned and
  driven by the group's first rank (the leader; ``engines/sglang/engine.py``), on the GPUs ``base_gpu_id .. base_gpu_id + tp - 1``
  of that node, which it shares with the trainer ranks of its group; each leader generates
  its group's slice of the prompts.
- ``hf``, ``vllm-server``, ``sglang-server``: a client on the driver rank (rank 0). A
  ``vllm-server`` without ``rollout.server_urls`` is spawned by the driver on its node's
  GPUs ``0 .. tp - 1`` (it shares them with the trainer, so it sleeps while the trainer
  trains); with ``rollout.server_urls`` the driver attaches to a server started elsewhere,
  on GPUs of its own (``sglang-server`` always attaches). Several ``vllm-server`` URLs sit
  behind the dispatcher (``rollout/dispatch.py``) in the driver's one client.

Log-probs: every engine returns the log-prob of the sampled token under the distribution it
sampled from, ``softmax(logits / temperature)`` (see ``rollout/base.py``); the config
refuses top-p/top-k for training rollouts (``preflight/checks.py``), so that distribution is the
one the trainer's log-prob pass computes.

Memory: on GPUs an engine takes ``rollout.gpu_memory_utilization`` of each GPU; a vLLM engine
on CPU gets an explicit KV cache instead (``cpu_kv_cache_bytes``, see ``vllm_cpu.py``), since
vLLM-CPU reads that fraction as a share of the host's RAM for each engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Optional, Tuple

from megatron_stare.config.fields import ConfigError
from megatron_stare.rollout import vllm_cpu
from megatron_stare.rollout.engines import EngineTraits, descriptor

if TYPE_CHECKING:
    from megatron_stare.config.sections import Config

__all__ = ["DRIVER", "EngineDevices", "EngineSpec", "EngineWorld", "RecoveryLimits", "SamplingDefaults"]

DRIVER = 0
"""The rank that holds a driver-placed engine's client, the logs and the prompt order."""


@dataclass(frozen=True)
class EngineWorld:
    """Where this process sits among the trainer's ranks (torchrun's environment)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    """Ranks (GPUs) on this node."""
    cuda: bool = False
    process_group: bool = False
    """The trainer's default process group exists (a colocated vLLM joins it)."""

    @classmethod
    def from_env(cls, cuda: Optional[bool] = None) -> "EngineWorld":
        """From ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` (torchrun's) and
        whether the default process group is up."""
        import torch
        import torch.distributed as dist

        if cuda is None:
            cuda = torch.cuda.is_available()
        env = os.environ
        world = int(env.get("WORLD_SIZE", "1"))
        return cls(rank=int(env.get("RANK", "0")), world_size=world,
                   local_rank=int(env.get("LOCAL_RANK", "0")),
                   local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world))), cuda=bool(cuda),
                   process_group=dist.is_initialized())


@dataclass(frozen=True)
class EngineDevices:
    """Which processes and GPUs one engine instance uses, seen from this rank."""

    hosts_engine: bool
    """This rank holds an engine handle (builds the engine)."""
    generates: bool
    """This rank calls ``generate`` (vLLM's lockstep ranks; otherwise the driver only)."""
    engine_ranks: Tuple[int, ...]
    """Global trainer ranks whose GPUs this rank's engine instance uses (empty: none of them)."""
    gpu_ids: Tuple[int, ...]
    """Node-local GPU ids the engine instance runs on (empty on CPU and for attached servers)."""
    replica: int = 0
    """This rank's engine replica (data-parallel rollout, ``rollout/data_parallel.py``)."""
    replicas: int = 1
    """Engine replicas in the run, each generating its own slice of the prompts: a colocated
    vLLM or SGLang has ``world / rollout.tp``; driver-placed engines one (several servers are
    balanced by the dispatcher inside that one client)."""
    leads_replica: bool = False
    """This rank contributes its replica's results to the gather (one rank per replica)."""

    @property
    def base_gpu_id(self) -> int:
        """The first GPU of the instance (SGLang's ``base_gpu_id``); 0 when it has none."""
        return self.gpu_ids[0] if self.gpu_ids else 0

    @property
    def shares_trainer_gpus(self) -> bool:
        """The instance lives on trainer GPUs: it must release memory while the trainer trains."""
        return bool(self.gpu_ids)


@dataclass(frozen=True)
class SamplingDefaults:
    """How training and evaluation rollouts sample (``rollout.*``)."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    """0 = off (``rollout.top_k=-1``)."""
    max_new_tokens: int
    ignore_eos: bool = False
    """Responses run to ``max_new_tokens`` (``rollout.ignore_eos``; training rollouts only)."""


@dataclass(frozen=True)
class RecoveryLimits:
    """How server engines watch and recover their servers (``rollout.*_timeout_s``,
    ``rollout.max_engine_restarts*``; ``engines/vllm_server/fleet.py``)."""

    request_timeout_s: float = 600.0
    sync_timeout_s: float = 600.0
    startup_timeout_s: float = 600.0
    max_restarts: int = 8
    """Over the run; 0: no recovery (a lost server is an error at once)."""
    max_restarts_per_step: int = 2


@dataclass(frozen=True)
class EngineSpec:
    """Everything an engine needs, from ``RolloutConfig`` and the layout; see the module docstring."""

    engine: str
    """Registry name: hf, vllm, vllm-server, sglang, sglang-server."""
    model_path: str
    tp: int
    """Engine tensor-parallel degree (``rollout.tp``)."""
    dtype: Literal["float32", "bfloat16"]
    """The policy's dtype (``model.dtype``): the engine computes what the trainer computes."""
    gpu_memory_utilization: float
    """Fraction of each GPU the engine may take (vLLM's budget, SGLang's ``mem_fraction_static``)."""
    context_length: int
    """Longest sequence: ``data.max_prompt_length + rollout.max_response_tokens`` (multi-turn:
    each turn is generated on the whole trajectory so far, up to ``max_total_tokens``)."""
    seed: int
    devices: EngineDevices
    server_urls: Tuple[str, ...]
    """Servers to attach to (``rollout.server_urls``); empty: a ``vllm-server`` spawns its own."""
    sampling: SamplingDefaults
    eval_sampling: SamplingDefaults
    sync_bucket_bytes: int
    record_checksums: bool
    """Engines remember checksums of received tensors (``rollout.verify_sync``)."""
    world_size: int
    """Trainer ranks (a colocated vLLM's data-parallel size is ``world_size / tp``)."""
    joins_process_group: bool
    """A colocated vLLM joins the trainer's process group (``external_launcher``)."""
    cuda: bool
    cpu_kv_cache_bytes: int = 0
    """KV cache of a vLLM engine on CPU, bytes (vLLM's ``kv_cache_memory_bytes``, from
    ``rollout.cpu_kv_cache_gb``: ``vllm_cpu.kv_cache_gb``); 0 on GPU and for other engines."""
    return_routed_experts: bool = False
    """vLLM engines return the routed experts of every sample (MoE routing replay, R3:
    ``GenerationResult.routed_experts``); GPU only (``rollout/routed_experts.py``)."""
    recovery: RecoveryLimits = RecoveryLimits()
    """Server engines: timeouts and restart bounds."""

    @property
    def traits(self) -> EngineTraits:
        return descriptor(self.engine).traits

    @property
    def attaches(self) -> bool:
        """A server engine that attaches to ``server_urls`` instead of spawning one."""
        return self.traits.server and bool(self.server_urls)

    @classmethod
    def from_config(cls, cfg: "Config", world: EngineWorld) -> "EngineSpec":
        """The spec of ``cfg``'s engine as seen from ``world.rank``; ConfigError (one line) for a
        placement the node cannot give (checked by ``config_checks`` where the config alone says)."""
        r = cfg.rollout
        traits = descriptor(r.engine).traits  # one ConfigError line for an unknown engine
        if cfg.model.path is None:
            raise ConfigError("model.path is required (the engine loads the policy from it)")
        return cls(
            engine=r.engine, model_path=str(cfg.model.path), tp=r.tp, dtype=cfg.model.dtype,
            gpu_memory_utilization=r.gpu_memory_utilization,
            context_length=cfg.data.max_prompt_length + r.max_response_tokens, seed=cfg.trainer.seed,
            devices=_devices(r.engine, traits, r.tp, tuple(r.server_urls), world),
            server_urls=tuple(r.server_urls),
            sampling=SamplingDefaults(n=r.n, temperature=r.temperature, top_p=r.top_p,
                                      top_k=0 if r.top_k == -1 else r.top_k, max_new_tokens=r.max_new_tokens,
                                      ignore_eos=r.ignore_eos),
            eval_sampling=SamplingDefaults(n=r.eval_n, temperature=r.eval_temperature, top_p=r.eval_top_p,
                                           top_k=0, max_new_tokens=r.max_new_tokens),
            sync_bucket_bytes=r.sync_bucket_mb << 20, record_checksums=r.verify_sync == "checksums",
            world_size=world.world_size, joins_process_group=world.process_group, cuda=world.cuda,
            cpu_kv_cache_bytes=_cpu_kv_cache_bytes(r, traits, world),
            return_routed_experts=r.routing_replay == "r3",
            recovery=RecoveryLimits(request_timeout_s=r.request_timeout_s, sync_timeout_s=r.sync_timeout_s,
                                    startup_timeout_s=r.startup_timeout_s, max_restarts=r.max_engine_restarts,
                                    max_restarts_per_step=r.max_engine_restarts_per_step))


def _cpu_kv_cache_bytes(r, t: EngineTraits, w: EngineWorld) -> int:
    """A vLLM engine's KV cache on CPU: one engine per rank of the node (colocated), else one."""
    if w.cuda or not t.cpu_kv_cache:
        return 0
    engines = w.local_world_size if t.colocated else 1
    return int(vllm_cpu.kv_cache_gb(r.cpu_kv_cache_gb, engines) * 2**30)


def _devices(engine: str, t: EngineTraits, tp: int, urls: Tuple[str, ...], w: EngineWorld) -> EngineDevices:
    if t.placement == "every_rank":
        group = tuple(range(w.rank - w.rank % tp, w.rank - w.rank % tp + tp))
        # vLLM's external_launcher: DP rank = rank // tp, each DP replica its own slice.
        return EngineDevices(hosts_engine=True, generates=True, engine_ranks=group,
                             gpu_ids=(w.local_rank,) if w.cuda else (), replica=w.rank // tp,
                             replicas=max(1, w.world_size // tp), leads_replica=w.rank % tp == 0)
    if t.placement == "group_leader":
        if w.local_world_size % tp:
            raise ConfigError(f"rollout.tp={tp} does not divide the {w.local_world_size} GPUs of a node; "
                              f"a colocated {engine} engine keeps its TP group on one node")
        first = w.rank - w.rank % tp
        local_first = w.local_rank - w.local_rank % tp
        # Each group's leader drives its engine on its own slice of the prompts.
        return EngineDevices(hosts_engine=w.rank == first, generates=w.rank == first,
                             engine_ranks=tuple(range(first, first + tp)),
                             gpu_ids=tuple(range(local_first, local_first + tp)) if w.cuda else (),
                             replica=w.rank // tp, replicas=max(1, w.world_size // tp),
                             leads_replica=w.rank == first)
    driver = w.rank == DRIVER
    if t.server and urls:  # attached: the server runs on GPUs of its own
        return EngineDevices(hosts_engine=driver, generates=driver, engine_ranks=(), gpu_ids=(),
                             leads_replica=driver)
    if t.server:  # spawned by the driver on its node's first tp GPUs
        if w.cuda and tp > w.local_world_size:
            raise ConfigError(f"rollout.tp={tp} is more than the {w.local_world_size} GPUs of the driver's "
                              f"node, where a spawned {engine} runs; lower rollout.tp or set rollout.server_urls")
        return EngineDevices(hosts_engine=driver, generates=driver, engine_ranks=tuple(range(tp)),
                             gpu_ids=tuple(range(tp)) if w.cuda else (), leads_replica=driver)
    # hf: in the driver's process, on its GPU.
    return EngineDevices(hosts_engine=driver, generates=driver, engine_ranks=(DRIVER,),
                         gpu_ids=(w.local_rank,) if w.cuda else (), leads_replica=driver)
