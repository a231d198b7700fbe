"""Two updates of the tiny actor with the trainer's state offloaded between them, and without.

``run_offload_case(rank, world, tp, pp, level=..., **layout)`` builds the actor twice on the
same process groups and weights and runs two STARE updates on each; between them, the first
actor's state is offloaded (``offload.py``) and brought back. It returns, per rank, what
the offload freed (measured independently, from the live tensors of the process), the storage
sizes of the offloaded tensors while offloaded, and a snapshot of every piece of the two
actors' state after the second update, for a bit-exact comparison.
"""

from __future__ import annotations

import gc
from typing import Dict, Iterable

import torch

from megatron_stare.trainer.offload import Offloader, _sub_optimizers
from megatron_stare.algorithms.stare import StareController
from megatron_stare.testing.actor_case import MOE_SPEC, build_case_actor, case_groups, synthetic_samples


def live_tensor_bytes(exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages of every tensor the process's Python objects reach,
    leaving out the storages of ``exclude`` (the offload's host copies)."""
    skip = {t.untyped_storage()._cdata for t in exclude}
    seen: Dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type != "meta":
                s = obj.untyped_storage()
                if s._cdata not in skip:
                    seen[s._cdata] = s.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without a storage
            continue
    return sum(seen.values())


def _one_step(actor, algo, seed: int) -> None:
    batches = actor.prepare(synthetic_samples(seed=seed))
    stats = actor.compute_logprobs(batches)
    state = StareController(algo.stare).update(stats.entropy)
    actor.update(batches, step=seed, stare_state=state)


def _tracked(actor) -> Dict[str, torch.Tensor]:
    """Every tensor of the actor's state, by a stable name (this rank's, not gathered)."""
    out: Dict[str, torch.Tensor] = {}
    for name, p in actor.module.named_parameters():
        out[f"param/{name}"] = p
        out[f"main_grad/{name}"] = p.main_grad
    for i, buf in enumerate(actor.model.buffers + actor.model.expert_parallel_buffers):
        if buf.param_data is not None:
            out[f"param_buffer/{i}"] = buf.param_data
        out[f"grad_buffer/{i}"] = buf.grad_data
    for j, opt in enumerate(_sub_optimizers(actor.optimizer)):
        inner = opt.optimizer
        for g, group in enumerate(inner.param_groups):
            for k, main in enumerate(group["params"]):
                out[f"main_param/{j}/{g}/{k}"] = main
                for key, v in inner.state.get(main, {}).items():
                    if isinstance(v, torch.Tensor):
                        out[f"state/{j}/{g}/{k}/{key}"] = v
    return out


def expected_offload_bytes(actor, level: str) -> int:
    """What ``level`` must free on this rank, counted from the model and optimizer: gradient
    buffers, moments and (bf16) main params; with ``all`` also the parameters. A lower bound:
    Megatron pads its buffers."""
    params = list(actor.module.parameters())
    total = sum(p.numel() * 4 for p in params)  # fp32 gradient accumulation
    bf16 = params[0].dtype == torch.bfloat16
    for opt in _sub_optimizers(actor.optimizer):
        for group in opt.optimizer.param_groups:
            for main in group["params"]:
                st = opt.optimizer.state.get(main, {})
                total += sum(st[k].numel() * 4 for k in ("exp_avg", "exp_avg_sq") if k in st)
                total += main.numel() * 4 if bf16 else 0
    if level == "all":
        total += sum(p.numel() * p.element_size() for p in params)
    return total


def run_offload_case(rank: int, world: int, tp: int, pp: int, *, level: str = "all",
                     distributed_optimizer: bool = False, sequence_parallel: bool = False,
                     dtype=torch.bfloat16, ep: int = 1) -> dict:
    """See the module docstring (``ep`` > 1: the tiny MoE, ``MOE_SPEC``, at that expert parallel)."""
    groups = case_groups(world, tp, pp, distributed_optimizer=distributed_optimizer,
                         sequence_parallel=sequence_parallel, ep=ep)
    model = {"spec": MOE_SPEC} if ep > 1 else {}
    out: dict = {}
    for offload in (True, False):
        actor, algo = build_case_actor(groups, dtype=dtype, lr=1e-4, **model)
        _one_step(actor, algo, seed=0)
        if offload:
            off = Offloader(actor, level)
            expected = expected_offload_bytes(actor, level)
            gc.collect()
            before = live_tensor_bytes()
            cuda_before = torch.cuda.memory_allocated() if groups.device.type == "cuda" else 0
            freed = off.offload()
            cuda_after = torch.cuda.memory_allocated() if groups.device.type == "cuda" else 0
            gc.collect()
            after = live_tensor_bytes(exclude=[m.host for m in off.moves if m.host is not None])
            out.update(cuda_drop=cuda_before - cuda_after,
                       pinned=all(m.host.is_pinned() for m in off.moves if m.host is not None))
            sizes = {n: t.untyped_storage().nbytes() for n, t in _tracked(actor).items()}
            with off.resident(("params",)):  # the first sync's: the weights back, the rest stays out
                during = {n: t.untyped_storage().nbytes() for n, t in _tracked(actor).items()}
            again = {n: t.untyped_storage().nbytes() for n, t in _tracked(actor).items()}
            out.update(sizes_params_resident=during, sizes_again=again)
            off.onload()
            out.update(expected=expected, freed=freed, live_drop=before - after, sizes_offloaded=sizes,
                       kinds=sorted({m.kind for m in off.moves}))
        _one_step(actor, algo, seed=1)
        out["offload" if offload else "plain"] = {n: t.detach().cpu().clone() for n, t in _tracked(actor).items()}
        del actor
    return out
