"""A tiny Qwen2-style Megatron model trained with Megatron's own DDP, optimizer and pipeline
schedule; used by the layout-equivalence tests (same numbers at every TP/PP/DP layout).

Weights are a deterministic function of the canonical parameter name (``seeded_canonical``),
so every layout starts from the same model without any rank holding the whole of it.
"""

from __future__ import annotations

import zlib
from typing import Dict, List

import torch
import torch.distributed as dist

from megatron_stare.models.gpt import GPTSpec, build_gpt_stage, transformer_config
from megatron_stare.models.sharding import ExpertGroups, gather_canonical, load_canonical, num_local_experts, unwrap
from megatron_stare.runtime.parallel import ParallelGroups, ParallelLayout, init_distributed

TINY_SPEC = GPTSpec(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                    num_query_groups=2, vocab_size=250, add_qkv_bias=True, rotary_base=1e6,
                    max_position_embeddings=64, make_vocab_size_divisible_by=8)

#: (world, tp, layout knobs) of the cluster features the layout tests compare with one process:
#: TP2 + sequence parallel, DP2 with the distributed optimizer, and both at DP2 (4 ranks).
CLUSTER_LAYOUTS = [
    (2, 2, {"sequence_parallel": True}),
    (2, 1, {"distributed_optimizer": True}),
    (4, 2, {"sequence_parallel": True, "distributed_optimizer": True}),
]
CLUSTER_LAYOUT_IDS = ["tp2_sp", "dp2_distopt", "tp2_sp_distopt_dp2"]


def seeded_canonical(name: str, shape, seed: int = 0) -> torch.Tensor:
    """Deterministic canonical tensor for ``name``: ~N(0, 0.02), norm weights ~1."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + seed)
    t = torch.randn(shape, generator=g, dtype=torch.float64)
    if "norm" in name:
        return (1.0 + 0.1 * t).float()
    return (0.02 * t).float()


def build_trainable(groups: ParallelGroups, spec: GPTSpec = TINY_SPEC, lr: float = 1e-4,
                    clip_grad: float = 1.0, seed: int = 0, miswire_tp: bool = False,
                    dtype: torch.dtype = torch.float32):
    """(DDP-wrapped stage, Megatron optimizer, transformer config) at ``groups.layout``.

    Sequence parallel and the distributed optimizer follow the layout; ``dtype`` bfloat16 gives
    bf16 params with Megatron's fp32 main params and fp32 gradient accumulation.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    lay = groups.layout
    cfg = transformer_config(spec, lay.tp, lay.pp, cp=lay.cp, dtype=dtype, sequence_parallel=lay.sequence_parallel)
    model = build_gpt_stage(spec, cfg, pre_process=groups.is_first_stage,
                            post_process=groups.is_last_stage, tp=lay.tp)
    # ``miswire_tp`` deals the TP shards to the wrong ranks: the tests use it to prove that
    # the equivalence checks catch a mis-wired tensor-parallel layout.
    tp_rank = lay.tp - 1 - groups.tp_rank if miswire_tp else groups.tp_rank
    load_canonical(model, lambda n, s: seeded_canonical(n, s, seed).to(dtype), tp_rank, lay.tp)
    ddp = DistributedDataParallel(
        config=cfg,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                 use_distributed_optimizer=lay.distributed_optimizer),
        module=model,
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0, clip_grad=clip_grad,
                        bf16=dtype == torch.bfloat16, params_dtype=dtype,
                        use_distributed_optimizer=lay.distributed_optimizer),
        [ddp],
    )
    cfg.finalize_model_grads_func = finalize_model_grads
    cfg.no_sync_func = ddp.no_sync
    return ddp, opt, cfg


def gather_full_weights(module: torch.nn.Module, groups: ParallelGroups) -> Dict[str, torch.Tensor]:
    """Canonical fp32 CPU weights of the whole model on every rank (test-sized models only)."""
    lay, inner = groups.layout, unwrap(module)
    experts = (ExpertGroups(groups.ep_group, lay.ep, groups.etp_group, lay.etp, num_local_experts(inner))
               if num_local_experts(inner) else None)
    mine = {n: t.float().cpu() for n, t in gather_canonical(inner, groups.tp_group, lay.tp, experts=experts)}
    if groups.layout.pp == 1:
        return mine
    parts = [None] * groups.layout.pp
    dist.all_gather_object(parts, mine, group=groups.pp_group)
    full: Dict[str, torch.Tensor] = {}
    for p in parts:
        full.update(p)
    return full


def lm_batches(global_batch: int, seq: int, vocab: int, steps: int, seed: int = 0) -> List[torch.Tensor]:
    """``steps`` global batches of token ids ``[global_batch, seq + 1]``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (global_batch, seq + 1), generator=g) for _ in range(steps)]


def train_lm_steps(groups: ParallelGroups, batches: List[torch.Tensor], micro_batch: int,
                   spec: GPTSpec = TINY_SPEC, miswire_tp: bool = False,
                   clip_grad: float = 1.0, dtype: torch.dtype = torch.float32) -> Dict[str, list]:
    """Train next-token LM on ``batches`` (each split over DP, then into micro-batches).

    Returns per-step global mean loss and grad norm, the final full-vocab logits of the first
    batch's first two rows (gathered over TP, broadcast from the last stage, fp32) and the final
    canonical weights (fp32).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp, opt, cfg = build_trainable(groups, spec, miswire_tp=miswire_tp, clip_grad=clip_grad, dtype=dtype)
    lay = groups.layout
    fb = get_forward_backward_func()
    seq = batches[0].shape[1] - 1
    pos = torch.arange(seq).unsqueeze(0)
    losses, norms = [], []

    def forward_step(data_iter, model):
        tokens = next(data_iter)
        inp, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        out = model(inp, pos.expand_as(inp), None, labels=labels)

        def loss_fn(output):
            loss = output.float().mean()
            # The schedule divides the returned loss in place: hand it a fresh tensor.
            return loss.clone(), {"loss": loss.detach().clone()}

        return out, loss_fn

    for batch in batches:
        local = batch.chunk(lay.dp)[groups.dp_rank]
        mbs = list(local.split(micro_batch))
        ddp.zero_grad_buffer()
        opt.zero_grad()
        out = fb(forward_step_func=forward_step, data_iterator=iter(mbs), model=[ddp],
                 num_microbatches=len(mbs), seq_length=seq, micro_batch_size=micro_batch,
                 forward_only=False)
        ok, gnorm, _ = opt.step()
        step_loss = torch.zeros(1)
        if groups.is_last_stage:
            step_loss += sum(o["loss"] for o in out) / len(out)
        # Mean over DP ranks, then hand the last stage's value to every rank.
        dist.all_reduce(step_loss, group=groups.dp_group)
        step_loss /= lay.dp
        dist.all_reduce(step_loss, group=groups.pp_group)
        losses.append(step_loss.item())
        norms.append(float(gnorm))
    logits = final_logits(ddp, groups, batches[0][:2, :-1])
    return {"loss": losses, "grad_norm": norms, "logits": logits,
            "weights": gather_full_weights(ddp, groups)}


@torch.no_grad()
def final_logits(ddp, groups: ParallelGroups, tokens: torch.Tensor) -> torch.Tensor:
    """Full-vocab logits ``[b, s, V_padded]`` of ``tokens`` on every rank (forward-only)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    seq = tokens.shape[1]
    result = {}

    def forward_step(data_iter, model):
        t = next(data_iter)
        out = model(t, torch.arange(seq).unsqueeze(0).expand_as(t), None)

        def collect(output):
            result["logits"] = output.detach().float().clone()
            return output.sum() * 0.0, {}

        return out, collect

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([tokens]),
                                model=[ddp], num_microbatches=1, seq_length=seq,
                                micro_batch_size=tokens.shape[0], forward_only=True)
    lay = groups.layout
    vshard = TINY_SPEC.padded_vocab_size(lay.tp) // lay.tp
    local = result.get("logits", torch.zeros(tokens.shape[0], seq, vshard))
    if lay.tp > 1:
        parts = [torch.empty_like(local) for _ in range(lay.tp)]
        dist.all_gather(parts, local.contiguous(), group=groups.tp_group)
        local = torch.cat(parts, dim=-1)
    if lay.pp > 1:
        src = groups.pp_last_rank
        dist.broadcast(local, src=src, group=groups.pp_group)
    return local


def run_layout(rank: int, world: int, tp: int, pp: int, steps: int, micro_batch: int,
               miswire_tp: bool = False, sequence_parallel: bool = False,
               distributed_optimizer: bool = False, dtype: torch.dtype = torch.float32):
    """Entry point for ``run_on_ranks``: train the tiny model at (tp, pp, dp=world/(tp*pp))."""
    lay = ParallelLayout.from_world(world, tp=tp, pp=pp, sequence_parallel=sequence_parallel,
                                    distributed_optimizer=distributed_optimizer)
    groups = init_distributed(lay, seed=1234)
    batches = lm_batches(global_batch=8, seq=16, vocab=TINY_SPEC.vocab_size, steps=steps)
    return train_lm_steps(groups, batches, micro_batch=micro_batch, miswire_tp=miswire_tp, dtype=dtype)
