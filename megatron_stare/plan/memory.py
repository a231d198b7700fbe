"""The dry-run planner's types and its table of what is resident when: the constants it assumes
(``Assumptions``), the parallel plan (``PlanLayout``), the per-phase memory of one GPU
(``MemoryPlan``, with its printed lines) and which component is resident in which phase of the
step (``runtime/phases.py``; offloaded state leaves the phases ``trainer.offload`` moves it out
of). ``plan.py`` computes the numbers; this module holds what they mean."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from megatron_stare.models.sizes import ParamCounts
from megatron_stare.plan.moe import MoEPlan
from megatron_stare.plan.offload import OFFLOADED, OffloadPlan
from megatron_stare.plan.sync import SyncStaging
from megatron_stare.runtime.phases import EngineMemory, PHASES as STEP_PHASES, Phase

GiB = float(2**30)
PHASES = tuple(p.name for p in STEP_PHASES)
"""The step's phases, in order (``runtime/phases.py``): the columns of the memory table."""


@dataclass(frozen=True)
class Assumptions:
    """The constants of the memory model that are not in the config."""

    flash_attention: bool = True
    """Fused/flash attention: no ``[a, s, s]`` softmax tensors (drops Korthikanti's 5*a*s/h term)."""
    logits_chunk: int = 1024
    """Rows of the vocab-parallel op's fp32 ``[chunk, V/tp]`` buffer."""
    runtime_gib: float = 1.5
    """CUDA context, cuBLAS workspaces and NCCL communicators per GPU."""
    fragmentation: float = 0.05
    """Allocator slack, as a fraction of the GPU's memory."""
    engine_workspace_gib: float = 2.0
    """A colocated engine's profiled activations and CUDA graphs while awake (inside its budget)."""
    engine_asleep_gib: float = 1.0
    """What a sleeping colocated engine keeps (CUDA-graph pools, its own communicators)."""
    ipc_context_gib: float = 0.5
    """A CUDA context one process opens on another's GPU to map its memory over CUDA IPC: each
    of a colocated SGLang engine's TP ranks but the first maps the weight buckets on its group
    leader's GPU (``rollout/engines/sglang/engine.py``), and keeps that context for its life."""
    moe_imbalance: float = 1.5
    """Mixture of experts: the busiest rank's routed tokens over the mean (``plan/moe.py``)."""


@dataclass
class PlanLayout:
    """The parallel plan a run gets (trainer and rollout engine)."""

    world_size: int
    tp: int
    pp: int
    cp: int
    dp: int
    sequence_parallel: bool
    distributed_optimizer: bool
    recompute: Optional[str]
    layers_per_stage: int
    micro_batch_tokens: int
    """Tokens of one micro-batch before the CP split (at least one max-length sequence)."""
    tokens_per_cp_rank: int
    num_micro_batches: int
    """Micro-batches per DP rank per optimizer step when every response has the maximum length."""
    max_seq_len: int
    engine: str
    colocated: bool
    engine_tp: int
    engine_instances: int
    sequences_per_instance: int
    kv_bytes_per_token: float
    """Per GPU of an engine instance."""
    kv_needed_gib: float
    """KV cache for all of an instance's sequences at full length, per GPU."""
    kv_concurrent_sequences: int
    """Full-length sequences the KV pool holds at once (per instance)."""
    replicas: int = 1
    """Engine replicas that each generate their own slice of the prompts (data-parallel rollout)."""
    prompts_per_replica: int = 0
    """Largest slice of a step's prompts one replica generates (each with ``rollout.n`` samples)."""
    sync_received_gib: float = 0.0
    """Per weight sync, what each rank's engine (colocated) or the driver's sender (server/hf)
    receives: the whole HF model, in the model's dtype."""
    sync_gathered_gib: float = 0.0
    """Per weight sync, what each rank receives in the TP all-gather of its stage's sharded weights."""
    sync_kept_gib: float = 0.0
    """Per weight sync, what a colocated engine rank keeps of what it received (its 1/engine-tp)."""
    attached_servers: int = 0
    """Servers attached through ``rollout.server_urls`` (disaggregated: on GPUs of their own, each
    ``engine_tp`` GPUs, none of the trainer's); 0 when the engine is on the trainer's GPUs."""
    sync_bucket_mb: int = 0
    """Flat bucket size of the weight push (``rollout.sync_bucket_mb``)."""
    staleness: int = 0
    """``trainer.staleness``: batches generated ahead while a step trains (0: synchronous)."""
    offload: Optional[OffloadPlan] = None
    """What ``trainer.offload`` frees while a colocated engine generates (None: no such engine)."""
    sync_staging: SyncStaging = field(default_factory=SyncStaging)
    """The sync's staging on a rank of the planned stage, bytes by part (``plan/sync.py``)."""
    recompute_note: str = ""
    """Why ``parallel.recompute=auto`` chose what it chose, or what it would choose instead of 'full'."""
    first_sync_gib: float = 0.0
    """The first weight sync (at start, after a resume): with ``trainer.offload=none`` the engine
    is awake (KV cache resident) and the trainer's state too, plus the staging, on the stage that
    needs most; with offload it runs in a trainer turn (the engine released): the sync column."""


def _always(p: Phase) -> bool:
    return True


#: (MemoryPlan field, label, in which phases it is resident).
_COMPONENTS = (
    ("weights_gib", "weights (policy)", _always),
    ("main_grads_gib", "main grads (fp32)", _always),
    ("optimizer_gib", "optimizer (master + Adam m, v)", _always),
    ("activations_gib", "activations", lambda p: p.trainer_work),
    ("logits_gib", "logits + log-prob buffer", lambda p: p.trainer_work),
    ("dispatcher_gib", "MoE dispatcher buffers", lambda p: p.trainer_work),
    ("routing_gib", "routing replay (int16)", lambda p: p.trainer_work),
    ("reference_gib", "reference model", _always),
    ("engine_weights_gib", "engine weights", lambda p: p.engine is not EngineMemory.RELEASED),
    ("engine_kv_gib", "engine KV cache", lambda p: p.engine is EngineMemory.AWAKE),
    ("engine_workspace_gib", "engine workspace", lambda p: p.engine is EngineMemory.AWAKE),
    ("engine_asleep_gib", "engine while released", lambda p: p.engine is not EngineMemory.AWAKE),
    ("sync_bucket_gib", "weight-sync staging", lambda p: p.sync_bucket),
    ("ipc_contexts_gib", "engine TP ranks' IPC contexts", _always),
    ("runtime_gib", "runtime (context, NCCL, slack)", _always),
)


def _resident(name: str, where, p: Phase, offload: str) -> bool:
    return where(p) and not (p.trainer_offloaded and name in OFFLOADED[offload])


def _phase_totals(components: Dict[str, float], step: Tuple[Phase, ...] = STEP_PHASES,
                  offload: str = "none") -> Dict[str, float]:
    return {p.name: sum(components[name] for name, _, where in _COMPONENTS if _resident(name, where, p, offload))
            for p in step}


def _awake_throughout(step: Tuple[Phase, ...]) -> Tuple[Phase, ...]:
    """The phases of an asynchronous step (``trainer.staleness > 0``): the engine never releases
    its memory (it generates the next batch while the trainer trains)."""
    return tuple(dataclasses.replace(p, engine=EngineMemory.AWAKE) for p in step)


@dataclass
class MemoryPlan:
    """Per-GPU memory of the most-loaded pipeline stage, per phase, in GiB."""

    layout: PlanLayout
    params: ParamCounts
    gpu_mem_gb: float
    stage: int
    """The most-loaded pipeline stage (the one these numbers are for)."""
    weights_gib: float
    main_grads_gib: float
    optimizer_gib: float
    activations_gib: float
    logits_gib: float
    reference_gib: float
    engine_weights_gib: float
    engine_kv_gib: float
    engine_workspace_gib: float
    engine_asleep_gib: float
    sync_bucket_gib: float
    runtime_gib: float
    phases: Dict[str, float]
    """Total per phase (``PHASES``: 'generate', ..., 'train', ..., 'resume_kv')."""
    peak_gib: float
    peak_phase: str
    fits: bool
    reasons: List[str] = field(default_factory=list)
    """Why it does not fit (empty when it fits)."""
    assumptions: Assumptions = field(default_factory=Assumptions)
    step_phases: Tuple[Phase, ...] = STEP_PHASES
    """The phases with what each holds (asynchronous: the engine awake in all of them)."""
    offload: str = "none"
    """``trainer.offload``: what leaves the GPU from the offload phase to the onload phase."""
    dispatcher_gib: float = 0.0
    routing_gib: float = 0.0
    ipc_contexts_gib: float = 0.0
    """Colocated SGLang at TP > 1, on its group leader's GPU: ``(tp - 1) * ipc_context_gib``."""
    moe: Optional[MoEPlan] = None
    """The mixture-of-experts terms (``plan/moe.py``); None for a dense model."""

    def rows(self) -> List[tuple]:
        """(label, {phase: GiB}) for each component, in table order."""
        return [(label, {p.name: getattr(self, name) if _resident(name, where, p, self.offload) else 0.0
                         for p in self.step_phases})
                for name, label, where in _COMPONENTS]

    def format(self) -> str:
        L, p = self.layout, self.params
        n = lambda x: f"{x / 1e9:.2f}B" if x >= 1e9 else f"{x / 1e6:.1f}M"  # noqa: E731
        on = lambda b: "on" if b else "off"  # noqa: E731
        shard_over = f" (shards over dp*cp = {L.dp * L.cp})" if L.distributed_optimizer else ""
        lines = [
            f"Model: {n(p.total)} parameters: embedding {n(p.embedding)}, {p.num_layers} layers x "
            f"{n(p.per_layer)}, output layer {n(p.output_layer) if p.output_layer else 'tied'}",
            f"GPUs: {L.world_size} x {self.gpu_mem_gb:g} GiB",
            "Parallel plan:",
            f"  trainer  tp {L.tp} x pp {L.pp} x cp {L.cp} x dp {L.dp} = {L.world_size}; sequence "
            f"parallel {on(L.sequence_parallel)}; distributed optimizer {on(L.distributed_optimizer)}"
            f"{shard_over}; recompute {L.recompute or 'none'}",
            f"  stages   {L.pp} x {L.layers_per_stage} layers (embedding on stage 0, output layer on "
            f"stage {L.pp - 1})",
            *([self.moe.line()] if self.moe is not None else []),
            f"  batches  micro-batch {L.micro_batch_tokens} tokens ({L.tokens_per_cp_rank} per CP rank); "
            f"up to {L.num_micro_batches} micro-batches per DP rank per optimizer step "
            f"(max sequence {L.max_seq_len} tokens)",
        ]
        if L.colocated:
            lines.append(
                f"  rollout  {L.engine} on the trainer's GPUs, engine tp {L.engine_tp} -> {L.engine_instances} "
                f"instances x {L.sequences_per_instance} sequences; KV {L.kv_bytes_per_token / 1024:.1f} "
                f"KiB/token/GPU; full batch needs {L.kv_needed_gib:.1f} GiB, the pool holds "
                f"{L.kv_concurrent_sequences} full-length sequences at once")
        elif L.attached_servers:
            lines.append(f"  rollout  {L.engine}: {L.attached_servers} attached server(s) (rollout.server_urls) x "
                         f"engine tp {L.engine_tp} = {L.attached_servers * L.engine_tp} engine GPUs of their own "
                         f"(no trainer GPU memory: not counted below)")
        else:
            lines.append(f"  rollout  {L.engine} on separate GPUs (not counted here), "
                         f"engine tp {L.engine_tp}")
        if L.staleness:
            lines.append(f"  async    trainer.staleness {L.staleness}: the batches of the next {L.staleness} step(s) "
                         f"generate while a step trains; the engine stays awake")
        lines.append(f"  replicas {L.replicas} engine replica(s), each generating its own slice of a step's prompts: "
                     f"<= {L.prompts_per_replica} prompts x n samples per replica")
        kept = (f", its engine rank keeps {L.sync_kept_gib:.1f} GiB (vLLM's loader takes full HF tensors and "
                f"slices them itself)" if L.sync_kept_gib else "")
        if L.attached_servers:
            workers = L.attached_servers * L.engine_tp
            lines.append(f"  sync     per weight push: TP all-gather {L.sync_gathered_gib:.1f} GiB per rank; trainer "
                         f"rank 0 receives the whole model ({L.sync_received_gib:.1f} GiB, the other stages' "
                         f"over PP) and broadcasts it in {L.sync_bucket_mb} MiB buckets over one group of 1 + "
                         f"{workers} engine workers (NCCL on GPUs, each bucket once to all {L.attached_servers} "
                         f"servers); each engine GPU receives {L.sync_received_gib:.1f} GiB and keeps its "
                         f"1/{L.engine_tp}")
        else:
            lines.append(f"  sync     per rank per weight sync: TP all-gather {L.sync_gathered_gib:.1f} GiB, "
                         f"receives {L.sync_received_gib:.1f} GiB (the whole model){kept}")
        if L.sync_staging.total:
            lines.append(f"  staging  per rank of stage {self.stage} during a sync ({L.sync_bucket_mb} MiB buckets): "
                         f"{L.sync_staging.describe(GiB)} = {L.sync_staging.total / GiB:.2f} GiB")
        if L.first_sync_gib:
            how = ("with the engine awake (KV cache resident) and the trainer's state resident"
                   if self.offload == "none" else "in a trainer turn (the engine released, only the weights back)")
            lines.append(f"  first    the first sync (start, resume) runs {how}: {L.first_sync_gib:.1f} GiB of "
                         f"{self.gpu_mem_gb:g} ({self.gpu_mem_gb - L.first_sync_gib:.1f} GiB headroom)")
        if L.offload is not None:
            lines.append(L.offload.line(L.sequences_per_instance))
        if L.recompute_note:
            lines.append(f"  recomp   {L.recompute_note}")
        lines += ["", f"Memory per GPU (GiB), pipeline stage {self.stage}:",
                  f"  {'component':<32}" + "".join(f"{q:>10}" for q in PHASES)]
        for label, per in self.rows():
            if any(per.values()):
                lines.append(f"  {label:<32}" + "".join(f"{per[q]:>10.2f}" for q in PHASES))
        lines.append(f"  {'total':<32}" + "".join(f"{self.phases[q]:>10.2f}" for q in PHASES))
        head = self.gpu_mem_gb - self.peak_gib
        verdict = f"fits, {head:.1f} GiB headroom" if self.fits else "DOES NOT FIT"
        lines += ["", f"Peak: {self.peak_gib:.1f} GiB ({self.peak_phase}) of "
                      f"{self.gpu_mem_gb:g} GiB: {verdict}"]
        lines += [f"  - {r}" for r in self.reasons]
        a = self.assumptions
        lines.append(f"Assumptions: {'flash' if a.flash_attention else 'unfused'} attention; logits "
                     f"chunk {a.logits_chunk}; runtime {a.runtime_gib:g} GiB + {a.fragmentation:.0%} "
                     f"slack; trainer state {'offloaded (' + self.offload + ')' if self.offload != 'none' else 'resident'} "
                     f"during rollout; see megatron_stare/plan/planner.py")
        return "\n".join(lines)


# ----------------------------------------------------------------------------- estimate
