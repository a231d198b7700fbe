"""The parallel layout (tp, pp, dp, cp) and the process groups that go with it.

``ParallelLayout`` is a frozen description validated up front against the world size, the
model's shape and the device, before any process group exists. ``init_distributed`` then
creates the default group (NCCL with CUDA, gloo without), sets up Megatron's parallel state
exactly once, seeds Megatron's RNG tracker, and returns a ``ParallelGroups`` whose named
groups math code receives explicitly (``tp_group=``, ``dp_group=``): nothing below the actor
reaches into Megatron's module globals.

Rank order follows Megatron's default ``tp-cp-ep-dp-pp``: TP ranks are adjacent, PP is outermost.
Experts (mixture of experts) have their own grid over the same ranks, megatron-core's
``etp-ep-edp-pp``: expert-tensor (etp) x expert (ep) x pipeline degrees divide the world size
and the rest is expert-data parallel (edp); EP may span TP ranks (EP2 x TP2 on 4 ranks).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron_stare.errors import UserError
from megatron_stare.runtime.rendezvous import check_env, free_port
from megatron_stare.compat import cpu as cpu_compat


class LayoutError(UserError):
    """A parallel layout that cannot work; the message names the degree and the fix."""


@dataclass(frozen=True)
class ModelShape:
    """The model dimensions a layout must divide."""

    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    hidden_size: int = 0
    num_experts: int = 0  # routed experts per MoE layer; 0 for a dense model
    moe_ffn_hidden_size: int = 0


@dataclass(frozen=True)
class ParallelLayout:
    """Degrees of tensor (tp), pipeline (pp), data (dp) and context (cp) parallelism.

    ``tp * pp * cp * dp`` equals the world size. ``sequence_parallel`` (needs tp > 1),
    ``distributed_optimizer`` and context parallel (``cp``; transformer-engine's attention on
    CUDA, ``models/torch_attention.py`` elsewhere) run on CUDA and, through ``compat/cpu.py``,
    on CPU gloo ranks.

    ``ep`` / ``etp``: expert-parallel and expert-tensor-parallel degrees of a mixture-of-experts
    model (default 1 and 1: experts are not split by TP; megatron-core itself would default etp
    to tp). They do not enter ``world_size``: ``etp * ep * pp`` must divide it.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    ep: int = 1
    etp: int = 1

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: the ranks holding the same experts."""
        return self.world_size // (self.etp * self.ep * self.pp)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @classmethod
    def from_world(cls, world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, **kw) -> "ParallelLayout":
        """The layout with ``dp`` filled in from the world size."""
        for name, v in (("tp", tp), ("pp", pp), ("cp", cp)):
            if not isinstance(v, int) or v < 1:
                raise LayoutError(f"parallel.{name} must be an integer >= 1, got {v!r}")
        mp = tp * pp * cp
        if world_size % mp:
            raise LayoutError(
                f"world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = {mp}; "
                f"launch a multiple of {mp} ranks or change the degrees"
            )
        return cls(tp=tp, pp=pp, cp=cp, dp=world_size // mp, **kw)

    def validate(self, world_size: Optional[int] = None, shape: Optional[ModelShape] = None) -> "ParallelLayout":
        """Raise ``LayoutError`` (one line naming the field and the fix) if this layout can't run."""
        for name in ("tp", "pp", "dp", "cp", "ep", "etp"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise LayoutError(f"parallel.{name} must be an integer >= 1, got {v!r}")
        if world_size is not None and self.world_size != world_size:
            raise LayoutError(
                f"tp*pp*cp*dp = {self.tp}*{self.pp}*{self.cp}*{self.dp} = {self.world_size} "
                f"but the world size is {world_size}; set parallel.dp so the product matches"
            )
        if shape is not None:
            if shape.num_attention_heads % self.tp:
                raise LayoutError(
                    f"parallel.tp={self.tp} does not divide the {shape.num_attention_heads} "
                    f"attention heads; choose tp among the divisors of the head count"
                )
            if shape.num_query_groups % self.tp:
                raise LayoutError(
                    f"parallel.tp={self.tp} does not divide the {shape.num_query_groups} "
                    f"key/value heads (query groups); choose tp dividing the KV-head count"
                )
            if shape.num_layers % self.pp:
                raise LayoutError(
                    f"parallel.pp={self.pp} does not divide the {shape.num_layers} layers; "
                    f"choose pp dividing the layer count"
                )
            if shape.num_layers < self.pp:
                raise LayoutError(f"parallel.pp={self.pp} exceeds the {shape.num_layers} layers")
        if self.sequence_parallel and self.tp == 1:
            raise LayoutError("parallel.sequence_parallel needs parallel.tp > 1")
        self._validate_experts(shape)
        return self

    def _validate_experts(self, shape: Optional[ModelShape]) -> None:
        """megatron-core's rule for the expert grid (``parallel_state.initialize_model_parallel``)
        and what its MoE layer refuses, as ``LayoutError`` lines before any group exists."""
        ept = self.etp * self.ep * self.pp
        if self.world_size % ept:
            raise LayoutError(
                f"parallel.etp*ep*pp = {self.etp}*{self.ep}*{self.pp} = {ept} does not divide the world "
                f"size {self.world_size}; choose ep/etp so that their product with pp divides it"
            )
        if shape is None:
            return
        if not shape.num_experts:
            if self.ep > 1 or self.etp > 1:
                raise LayoutError(f"parallel.ep={self.ep}/etp={self.etp} need a mixture-of-experts model; "
                                  f"this one is dense: set both to 1")
            return
        if shape.num_experts % self.ep:
            raise LayoutError(f"parallel.ep={self.ep} does not divide the {shape.num_experts} experts; "
                              f"choose ep among the divisors of the expert count")
        if shape.moe_ffn_hidden_size and shape.moe_ffn_hidden_size % self.etp:
            raise LayoutError(f"parallel.etp={self.etp} does not divide the expert width "
                              f"{shape.moe_ffn_hidden_size}; choose etp dividing it")
        if self.tp > 1 and not self.sequence_parallel:
            raise LayoutError("a mixture-of-experts model at parallel.tp > 1 needs "
                              "parallel.sequence_parallel: true (megatron-core's MoE layer refuses to train without it)")


@dataclass
class ParallelGroups:
    """This rank's coordinates and process groups, handed to code that communicates.

    ``dp_cp_group`` spans data and context parallel ranks: token-level reductions over the
    whole mini-batch (token-mean denominators, STARE thresholds) use it.
    """

    layout: ParallelLayout
    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    cp_rank: int
    tp_group: Optional[dist.ProcessGroup]
    pp_group: Optional[dist.ProcessGroup]
    dp_group: Optional[dist.ProcessGroup]
    cp_group: Optional[dist.ProcessGroup]
    dp_cp_group: Optional[dist.ProcessGroup]
    mp_group: Optional[dist.ProcessGroup]
    device: torch.device
    ep_rank: int = 0
    etp_rank: int = 0
    ep_group: Optional[dist.ProcessGroup] = None
    etp_group: Optional[dist.ProcessGroup] = None
    edp_group: Optional[dist.ProcessGroup] = None  # ranks holding the same experts

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    @property
    def pp_last_rank(self) -> int:
        """Global rank of the last pipeline stage that shares this rank's tp/dp/cp coordinates."""
        from megatron.core import parallel_state as ps

        return ps.get_pipeline_model_parallel_last_rank()

    @property
    def pp_first_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_pipeline_model_parallel_first_rank()


def init_distributed(layout: ParallelLayout, seed: int = 1234, timeout_s: int = 1800,
                     shape: Optional[ModelShape] = None) -> ParallelGroups:
    """Create the default group if needed, set Megatron's parallel state once, seed RNG.

    Reads ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` as set by torchrun when the default group
    does not exist yet, after checking MASTER_ADDR/MASTER_PORT (``rendezvous.check_env``: one
    ``RendezvousError`` line instead of a hang). Applies the CPU compatibility layer when CUDA
    is absent.
    """
    cuda = torch.cuda.is_available()
    if not cuda:
        cpu_compat.apply()
    if not dist.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        layout.validate(world_size=world, shape=shape)
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if world == 1 and "MASTER_ADDR" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            os.environ.setdefault("RANK", "0")
        # A missing, unresolvable or unreachable MASTER_ADDR would hang in the store's connect
        # retries for the whole timeout: fail in one line instead (rendezvous.py).
        check_env(world, int(os.environ.get("RANK", "0")))
        dist.init_process_group(
            backend="nccl" if cuda else "gloo",
            rank=int(os.environ.get("RANK", "0")),
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    layout.validate(world_size=dist.get_world_size(), shape=shape)

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if ps.model_parallel_is_initialized():
        raise RuntimeError("Megatron parallel state is already initialised; call "
                           "destroy_distributed() before init_distributed() again")
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return ParallelGroups(
        layout=layout,
        rank=dist.get_rank(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        cp_group=ps.get_context_parallel_group(),
        dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
        mp_group=ps.get_model_parallel_group(),
        device=torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"),
        ep_rank=ps.get_expert_model_parallel_rank(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        ep_group=ps.get_expert_model_parallel_group(),
        etp_group=ps.get_expert_tensor_parallel_group(),
        edp_group=ps.get_expert_data_parallel_group(),
    )


def destroy_distributed() -> None:
    """Tear down Megatron's parallel state and the default group."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def group_ranks(group: Optional[dist.ProcessGroup]) -> List[int]:
    """Global ranks of ``group`` (the whole world for None)."""
    if group is None:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)
