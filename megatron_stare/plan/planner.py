"""Dry-run planner: the parallel plan of a run and a per-GPU memory estimate, without GPUs.

``python -m megatron_stare.plan --config X.yaml --world-size 32 --gpu-mem-gb 80
[--hf-config path/to/config.json] [a.b=c ...]`` validates the config for a GPU run, prints the
plan and exits 0 if it fits, 3 if it does not (with the reason), 2 on a config error (one line).

The memory model (per GPU, in GiB; ``--gpu-mem-gb`` is taken as GiB: an "80 GB" H100 has 79.6):

- **Weights**: bf16 (or the model dtype) parameters of the most-loaded pipeline stage on one TP
  rank: ``layers/pp`` layers with linear weights and q/k/v biases divided by tp, norms replicated;
  the input embedding on the first stage and the output layer plus final norm on the last stage
  (a tied embedding is a second copy on the last stage when pp > 1); the vocabulary padded as
  Megatron pads it (``model.make_vocab_size_divisible_by * tp``).
- **Main grads**: Megatron's DDP grad buffer in fp32, one per parameter, never sharded (the
  distributed optimizer reduce-scatters into the full buffer).
- **Optimizer**: fp32 master parameters (bf16 models only) and Adam m and v: 12 (8) bytes per
  parameter, divided over dp*cp with the distributed optimizer (megatron-core shards over the
  data-parallel group with context parallel).
- **Activations** of one micro-batch, Korthikanti et al. 2022 ("Reducing Activation Recomputation"),
  bf16, per layer ``s*b*h*(34 + 5*a*s/h)`` bytes for GPT (MHA, 4h GELU MLP), generalised here to
  GQA and SwiGLU (``layer_activation_bytes``); all terms divided by tp with sequence parallel;
  ``s`` is the micro-batch's tokens on one CP rank. The quadratic ``5*a*s/h`` term (softmax,
  dropout) is dropped with flash/fused attention, which megatron-core uses on GPU. Full recompute
  keeps only each layer's input (``2*s*h`` bytes, /tp with SP) plus one layer's full activations
  while it is recomputed in backward. The 1F1B schedule keeps ``min(pp - stage, micro-batches)``
  micro-batches in flight on a stage. Logits (last stage): the bf16 ``[s, V/tp]`` shard saved
  for backward, its gradient, and the vocab-parallel log-prob op's one fp32 ``[chunk, V/tp]``
  buffer (``ops/vocab_parallel.py``; the fused no-logits path needs less).
- **Reference model** (``algorithm.kl_loss_coef > 0``): a second copy of the stage's weights,
  resident (no offload).
- **Engine**, on the trainer's GPUs (``vllm``, ``sglang`` colocated; a ``vllm-server`` the
  driver spawns on its node's first ``rollout.tp`` GPUs; ``hf`` on the driver's GPU): weights
  sharded by ``rollout.tp`` (whole model, no PP); vLLM reserves ``gpu_memory_utilization *
  gpu_mem`` in all, and what is left after the weights and a workspace (profiled activations,
  CUDA graphs) is its KV cache pool. KV per token per GPU ``2 * layers * kv_heads * head_dim
  * 2 bytes / rollout.tp`` (a KV head is replicated when rollout.tp > kv_heads). The plan also
  reports the KV the whole rollout batch needs at full length (``sequences per instance *
  (max_prompt_length + max_new_tokens)``) and how many such sequences the pool holds at once.
  ``hf`` is one full model copy with the KV for the whole batch; a server attached through
  ``rollout.server_urls`` runs on GPUs of its own and costs nothing here.

Phases: the step's phases and what each holds come from ``runtime/phases.py``, the list the
training loop runs: an engine on the trainer's GPUs holds its weights, KV cache and workspace
while awake (generate, gather, score, resume_kv), releases them for the trainer's turn (release,
train: only a residue stays), and restores its weights before the weight sync (resume_w, sync)
and its KV cache after it. The trainer keeps its weights, grads and optimizer state resident in
every phase unless ``trainer.offload`` moves them (``offload.py``: 'optimizer' the grads and the
optimizer state, 'all' also the weights and a reference model) from the ``offload`` phase to the
``onload`` phase, i.e. while the engine generates; the ``offload`` line then says what the
engine may take of it (its memory fraction raised by the freed bytes, the KV pool and the
full-length sequences per replica before and after; with 'none' what 'all' would give). Activations and logits live in ``train``, one
weight-sync bucket in ``sync``. Asynchronous (``trainer.staleness > 0``), an engine on the
trainer's GPUs (a spawned ``vllm-server``) never releases: it generates the next batch while the
trainer trains, so it counts as awake in every phase. The peak is the largest phase total, each phase
including a runtime overhead (CUDA context, cuBLAS/NCCL buffers, allocator slack). The numbers
are estimates for planning, not a guarantee: measure with ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Optional, Sequence, Tuple
import torch

from megatron_stare.config.load import Config, ConfigError, load_config
from megatron_stare.preflight.checks import validate_config
from megatron_stare.preflight.inputs import DRY_RUN_SKIPPED
from megatron_stare.models.sizes import (ParamCounts, _counts, _spec,  # noqa: F401 - re-exported
                                         layer_activation_bytes, param_counts)
from megatron_stare.plan.moe import plan_moe
from megatron_stare.plan.offload import OFFLOADED, OffloadPlan
from megatron_stare.plan.sync import sync_staging
from megatron_stare.runtime.phases import PHASES as STEP_PHASES
from megatron_stare.rollout.engines import descriptor
from megatron_stare.plan.save_estimate import estimate_save

from megatron_stare.plan.memory import (GiB, PHASES, Assumptions, MemoryPlan, PlanLayout,  # noqa: F401
                                     _awake_throughout, _phase_totals)


def _stage_params(c: ParamCounts, pp: int, tp: int, stage: int, expert_shards: int = 1) -> float:
    """Parameters held by one TP rank of pipeline ``stage`` (routed experts over ``expert_shards``
    = ep*etp ranks)."""
    layers = c.num_layers // pp
    split = layers * (c.attention + c.mlp)
    replicated = layers * c.norms
    if stage == 0:
        split += c.embedding
    if stage == pp - 1:
        replicated += c.final_norm
        # A tied embedding is a second copy on the last stage when the stages differ.
        split += c.output_layer or (c.embedding if pp > 1 else 0)
    return split / tp + replicated + layers * c.experts / expert_shards


def _hint(label: str, cfg: Config, dp: int) -> str:
    p = cfg.parallel
    if label.startswith("optimizer") and not p.distributed_optimizer and dp * p.cp > 1:
        return "set parallel.distributed_optimizer=true"
    if label.startswith(("activations", "logits")):
        return ("set parallel.recompute=full" if p.recompute != "full" else
                "lower parallel.micro_batch_tokens or raise parallel.cp")
    if label.startswith("engine"):
        return "lower rollout.gpu_memory_utilization or raise rollout.tp"
    return "raise parallel.tp/parallel.pp or use more GPUs"


def estimate_memory(cfg: Config, hf_config: dict, world_size: int, gpu_mem_gb: float,
                    assumptions: Assumptions = Assumptions()) -> MemoryPlan:
    """The per-GPU memory plan of ``cfg`` on ``world_size`` GPUs of ``gpu_mem_gb`` GiB each.

    ``cfg`` should have passed ``check_for_gpus``; the model shape comes from ``hf_config``.

    ``parallel.recompute=auto`` plans with ``choose_recompute``'s choice and says why; with
    'full', the plan says what auto would choose instead when that is cheaper.
    """
    r = cfg.parallel.recompute
    if r not in ("auto", "full"):
        return _estimate_memory(cfg, hf_config, world_size, gpu_mem_gb, assumptions)
    choice, why = choose_recompute(cfg, hf_config, world_size, gpu_mem_gb, assumptions)
    plan = _estimate_memory(_with_recompute(cfg, choice if r == "auto" else "full"), hf_config, world_size,
                            gpu_mem_gb, assumptions)
    if r == "auto":
        plan.layout.recompute_note = why
    elif choice != "full":
        plan.layout.recompute_note = f"parallel.recompute=full; parallel.recompute=auto would choose: {why}"
    return plan


def _estimate_memory(cfg: Config, hf_config: dict, world_size: int, gpu_mem_gb: float,
                    assumptions: Assumptions = Assumptions()) -> MemoryPlan:
    """The per-GPU memory plan of ``cfg`` on ``world_size`` GPUs of ``gpu_mem_gb`` GiB each.

    ``cfg`` should have passed ``check_for_gpus``; the model shape comes from ``hf_config``.
    """
    a = assumptions
    spec = _spec(hf_config)
    p, r, t = cfg.parallel, cfg.rollout, cfg.trainer
    tp, pp, cp = p.tp, p.pp, p.cp
    if world_size % (tp * pp * cp):
        raise ConfigError(f"world size {world_size} is not divisible by tp*pp*cp = {tp * pp * cp}")
    dp = world_size // (tp * pp * cp)
    h, hd, L = spec.hidden_size, spec.head_dim, spec.num_layers
    vocab_p = math.ceil(spec.vocab_size / (cfg.model.make_vocab_size_divisible_by * tp)) * (
        cfg.model.make_vocab_size_divisible_by * tp)
    counts = _counts(spec, vocab_p)
    wbytes = 2 if cfg.model.dtype == "bfloat16" else 4
    opt_bytes = 12 if wbytes == 2 else 8  # fp32 master copy only for a bf16 model
    opt_shards = dp * cp if p.distributed_optimizer else 1

    # Batches: a sequence is never split across micro-batches, only across CP ranks.
    max_seq = cfg.data.max_prompt_length + r.max_response_tokens
    mb_tokens = max(p.micro_batch_tokens, max_seq)
    s_local = math.ceil(mb_tokens / cp)
    responses = t.prompts_per_step // t.mini_batches_per_step * r.n
    per_micro = max(1, p.micro_batch_tokens // max_seq)
    n_micro = math.ceil(math.ceil(responses / dp) / per_micro)

    kv_dim = spec.num_query_groups * hd
    # Mixture of experts (plan/moe.py): this rank's tokens of the step carry their routes.
    moe = None if spec.moe is None else plan_moe(
        spec, counts, cfg, world_size, s_local, t.prompts_per_step * r.n * max_seq / (dp * cp), a.moe_imbalance)
    layer_full = layer_activation_bytes(
        s_local, h, spec.num_attention_heads, kv_dim, spec.ffn_hidden_size if moe is None else moe.activation_ffn,
        tp=tp, sequence_parallel=p.sequence_parallel,
        flash_attention=a.flash_attention or p.recompute == "selective") + (moe.permuted_bytes_per_layer if moe else 0)
    layer_input = 2.0 * s_local * h / (tp if p.sequence_parallel else 1)

    # Engine: on the trainer's GPUs unless it is a server attached through rollout.server_urls.
    # The engine's memory model comes from its folder's descriptor (rollout/engines/).
    engine = descriptor(r.engine)
    traits = engine.traits
    colocated = traits.on_trainer_gpus(r.server_urls)
    whole = engine.memory.kind == "whole_copy"  # one full copy on one GPU (hf)
    budgeted = colocated and not whole  # a share of each GPU: weights, workspace, KV pool
    etp = 1 if whole else r.tp
    # Colocated engines tile the world; hf and a spawned server generate the whole batch.
    instances = (world_size // etp if traits.colocated else 1) if colocated else 0
    seqs = math.ceil(t.prompts_per_step * r.n / instances) if instances else 0
    kv_local = spec.num_query_groups if whole else spec.num_query_groups / etp
    kv_local = max(kv_local, 1.0)
    kv_elem = wbytes if whole else 2
    kv_per_token = 2.0 * L * kv_local * hd * kv_elem
    kv_needed = seqs * max_seq * kv_per_token / GiB
    eng_w = eng_kv = eng_ws = eng_sleep = 0.0
    if budgeted:
        ec = _counts(spec, math.ceil(spec.vocab_size / etp) * etp, kv_heads=kv_local * etp)
        eng_w = 2 * ((ec.embedding + ec.output_layer + L * (ec.attention + ec.mlp + ec.experts)) / etp
                     + L * ec.norms + ec.final_norm) / GiB
        eng_ws, eng_sleep = a.engine_workspace_gib, a.engine_asleep_gib
        eng_kv = max(r.gpu_memory_utilization * gpu_mem_gb - eng_w - eng_ws, 0.0)
    elif whole:  # its release moves the weights to host memory: nothing stays
        eng_w = counts.total * wbytes / GiB
        eng_kv = kv_needed
    concurrent = int(eng_kv * GiB // (max_seq * kv_per_token)) if colocated else 0

    # SGLang's other TP ranks map the weight buckets on their leader's GPU: a context each there.
    ipc = (etp - 1) * a.ipc_context_gib if colocated and engine.memory.ipc_context_per_tp_rank else 0.0
    shared = dict(engine_weights_gib=eng_w, engine_kv_gib=eng_kv, engine_workspace_gib=eng_ws,
                  engine_asleep_gib=eng_sleep, ipc_contexts_gib=ipc,
                  runtime_gib=a.runtime_gib + a.fragmentation * gpu_mem_gb)
    # The sync's staging by rank role (plan/sync.py): the whole-tensor export to a colocated
    # engine on every rank, else the piece export's collector.
    staging = {i: sync_staging(stage=i, pp=pp, tp=tp, bucket=r.sync_bucket_mb * 2.0 ** 20, esize=wbytes,
                               colocated=traits.colocated, hidden=h, ffn=spec.ffn_hidden_size,
                               q_dim=spec.num_attention_heads * hd, kv_dim=kv_dim, vocab=spec.vocab_size,
                               vocab_padded=vocab_p, tied=spec.tie_word_embeddings)
               for i in sorted({0, pp - 1})}
    stages = {}
    for stage in sorted({0, pp - 1}):  # middle stages hold no more than either end
        shards = p.ep * p.etp if moe else 1
        n_params = _stage_params(counts, pp, tp, stage, shards)
        n_experts = (L // pp) * counts.experts / shards  # their optimizer state shards over edp
        exp_shards = moe.edp if moe and p.distributed_optimizer else 1
        in_flight = min(pp - stage, n_micro)  # 1F1B: stage i holds pp - i micro-batches
        if p.recompute == "full":
            act = in_flight * (L // pp) * layer_input + layer_full
        else:
            act = in_flight * (L // pp) * layer_full
        logits = 0.0
        if stage == pp - 1:
            v_local = vocab_p // tp
            logits = s_local * v_local * (2 + 2) + min(a.logits_chunk, s_local) * v_local * 4
        weights = n_params * wbytes / GiB
        stages[stage] = dict(
            weights_gib=weights, main_grads_gib=n_params * 4 / GiB,
            optimizer_gib=((n_params - n_experts) / opt_shards + n_experts / exp_shards) * opt_bytes / GiB,
            dispatcher_gib=moe.dispatcher_bytes / GiB if moe else 0.0,
            routing_gib=moe.routing_bytes / GiB if moe else 0.0,
            activations_gib=act / GiB, logits_gib=logits / GiB,
            reference_gib=weights if cfg.algorithm.kl_loss_coef > 0 else 0.0,
            sync_bucket_gib=staging[stage].total / GiB, **shared)
    # Asynchronous, an engine on the trainer's GPUs (a spawned server) stays awake while it trains.
    step_phases = _awake_throughout(STEP_PHASES) if t.staleness > 0 and colocated else STEP_PHASES
    off = t.offload
    stage = max(stages, key=lambda i: max(_phase_totals(stages[i], step_phases, off).values()))
    # Data-parallel rollout (rollout/data_parallel.py): a colocated engine's TP groups are its
    # replicas, each generating its slice; a driver client is one (servers share its batch).
    replicas = world_size // etp if traits.colocated else 1
    # The TP all-gather of the export: (tp - 1) shards of each TP-split weight of the stage.
    gathered = max((tp - 1) * (_stage_params(counts, pp, tp, i) - _stage_params(counts, pp, 10 ** 9, i))
                   for i in stages) * wbytes
    phases = _phase_totals(stages[stage], step_phases, off)
    peak_phase = max(PHASES, key=phases.get)
    layout = PlanLayout(
        world_size=world_size, tp=tp, pp=pp, cp=cp, dp=dp, sequence_parallel=p.sequence_parallel,
        distributed_optimizer=p.distributed_optimizer, recompute=p.recompute,
        layers_per_stage=L // pp, micro_batch_tokens=mb_tokens, tokens_per_cp_rank=s_local,
        num_micro_batches=n_micro, max_seq_len=max_seq, engine=r.engine, colocated=colocated,
        engine_tp=etp, engine_instances=instances, sequences_per_instance=seqs,
        kv_bytes_per_token=kv_per_token, kv_needed_gib=kv_needed, kv_concurrent_sequences=concurrent,
        replicas=replicas, prompts_per_replica=math.ceil(t.prompts_per_step / replicas),
        sync_received_gib=_counts(spec, spec.vocab_size).total * wbytes / GiB, sync_gathered_gib=gathered / GiB,
        sync_kept_gib=eng_w if budgeted else 0.0,
        attached_servers=0 if colocated else len(r.server_urls), sync_bucket_mb=r.sync_bucket_mb,
        sync_staging=staging[stage],
        staleness=t.staleness)
    plan = MemoryPlan(layout=layout, params=_counts(spec, spec.vocab_size), gpu_mem_gb=gpu_mem_gb,
                      stage=stage, phases=phases, peak_gib=phases[peak_phase], peak_phase=peak_phase,
                      fits=True, assumptions=a, step_phases=step_phases, offload=off, moe=moe, **stages[stage])

    if plan.peak_gib > gpu_mem_gb:
        label, per = max(plan.rows(), key=lambda row: row[1][plan.peak_phase])
        plan.reasons.append(
            f"the {plan.peak_phase} phase needs {plan.peak_gib:.1f} GiB on pipeline stage {plan.stage}, "
            f"more than the {gpu_mem_gb:g} GiB of a GPU; largest part: {label} "
            f"{per[plan.peak_phase]:.1f} GiB ({_hint(label, cfg, dp)})")
    if budgeted:
        budget = r.gpu_memory_utilization * gpu_mem_gb
        one_seq = max_seq * kv_per_token / GiB
        if eng_kv < one_seq:
            plan.reasons.append(
                f"rollout.gpu_memory_utilization={r.gpu_memory_utilization} gives the engine "
                f"{budget:.1f} GiB, which after its weights ({eng_w:.1f} GiB) and workspace holds "
                f"less than one {max_seq}-token sequence's KV cache ({one_seq:.2f} GiB); raise "
                f"rollout.gpu_memory_utilization or rollout.tp")
    if budgeted:
        layout.first_sync_gib = phases["sync"] if off != "none" else max(
            _phase_totals(stages[i], step_phases)["generate"] + staging[i].total / GiB for i in stages)
        if layout.first_sync_gib > gpu_mem_gb:
            plan.reasons.append(
                f"the first weight sync (at start and after a resume) runs with the engine's KV cache resident: "
                f"{layout.first_sync_gib:.1f} GiB, more than the {gpu_mem_gb:g} GiB of a GPU; set trainer.offload="
                f"optimizer or all (the sync then runs with the engine released), or lower "
                f"rollout.gpu_memory_utilization or rollout.sync_bucket_mb")
        level = off if off != "none" else "all"
        freed = min(sum(st[k] for k in OFFLOADED[level]) for st in stages.values())
        after = min(math.floor((r.gpu_memory_utilization + freed / gpu_mem_gb) * 100 + 1e-9) / 100, 0.95)
        after = max(after, r.gpu_memory_utilization)
        kv_after = max(after * gpu_mem_gb - eng_w - eng_ws, 0.0)
        layout.offload = OffloadPlan(off, freed, r.gpu_memory_utilization, after, eng_kv, kv_after, concurrent,
                                     int(kv_after * GiB // (max_seq * kv_per_token)))
    plan.fits = not plan.reasons
    return plan


def _with_recompute(cfg: Config, choice: Optional[str]) -> Config:
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, recompute=choice))


def choose_recompute(cfg: Config, hf_config: dict, world_size: int, gpu_mem_gb: float,
                     assumptions: Assumptions = Assumptions()) -> Tuple[str, str]:
    """(recompute, why) for ``parallel.recompute=auto``: the cheapest of none, selective, full
    whose plan fits (full when none does)."""
    train = {}
    for choice in ("none", "selective", "full"):
        plan = _estimate_memory(_with_recompute(cfg, choice), hf_config, world_size, gpu_mem_gb, assumptions)
        train[choice] = plan.phases["train"]
        if plan.fits and choice != "full":
            break
    else:
        return "full", (f"recompute auto -> full: the train phase needs {train['none']:.1f} GiB without "
                        f"recompute ({train['selective']:.1f} selective): the plan does not fit {gpu_mem_gb:g} GiB "
                        f"without full recompute ({train['full']:.1f} GiB with it)")
    why = (f"recompute auto -> {choice}: the train phase fits with {'no' if choice == 'none' else 'selective'} "
           f"recompute ({train[choice]:.1f} GiB of {gpu_mem_gb:g}, activations {plan.activations_gib:.1f} GiB); "
           f"full recompute would re-run every layer's forward in backward (about 1/3 more update FLOPs)")
    if choice == "selective":
        why += f"; without any, the train phase needs {train['none']:.1f} GiB"
    return choice, why


def resolve_recompute(cfg: Config, hf_dir: str, world_size: int) -> Tuple[str, str]:
    """The trainer's ``parallel.recompute=auto``: the planner's choice for this GPU's memory (on
    CPU: none, there is no device memory to save)."""

    if not torch.cuda.is_available():
        return "none", "recompute auto -> none (CPU)"
    gpu = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GiB
    return choose_recompute(cfg, load_hf_config(hf_dir), world_size, gpu)


# ----------------------------------------------------------------------------- command line

def load_hf_config(path: str) -> dict:
    """An HF ``config.json`` (file or the directory holding it) as a dict; ConfigError if unreadable."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"HF config not found: {path}; pass --hf-config path/to/config.json")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data


def check_for_gpus(cfg: Config, hf_config: dict, world_size: int) -> Config:
    """``validate_config`` for a GPU run on ``world_size`` GPUs, with the model shape of
    ``hf_config`` (the layout checks run even when ``model.path`` is not on this machine)."""
    return validate_config(cfg, world_size=world_size, cuda=True, check_paths=False, hf_config=hf_config)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_stare.plan",
                                 description="Print the parallel plan and per-GPU memory estimate of a run.")
    ap.add_argument("--config", required=True, help="YAML config file")
    ap.add_argument("--world-size", type=int, required=True, help="number of GPUs (nodes x GPUs per node)")
    ap.add_argument("--gpu-mem-gb", type=float, default=80.0, help="memory of one GPU (GiB)")
    ap.add_argument("--hf-config", default=None,
                    help="HF config.json of the model (default: model.path/config.json)")
    ap.add_argument("overrides", nargs="*", help="a.b=value overrides")
    args = ap.parse_args(argv)
    try:
        if args.world_size < 1 or args.gpu_mem_gb <= 0:
            raise ConfigError("--world-size must be >= 1 and --gpu-mem-gb > 0")
        cfg = load_config(args.config, args.overrides)
        hf_path = args.hf_config or cfg.model.path
        if hf_path is None:
            raise ConfigError("no HF config: pass --hf-config path/to/config.json or set model.path")
        hf_config = load_hf_config(hf_path)
        check_for_gpus(cfg, hf_config, args.world_size)
        plan = estimate_memory(cfg, hf_config, args.world_size, args.gpu_mem_gb)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(plan.format())
    print(f"not checked here (dry run): {', '.join(DRY_RUN_SKIPPED)}; the trainer and "
          f"`python -m megatron_stare.config` check them where the run's files are")
    nodes = max(1, args.world_size // max(1, int(os.environ.get("GPUS_PER_NODE", "8"))))
    print(estimate_save(param_counts(hf_config).total, nodes, bf16=cfg.model.dtype == "bfloat16").format())
    return 0 if plan.fits else 3


if __name__ == "__main__":
    sys.exit(main())
