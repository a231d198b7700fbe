"""``rollout.engine=vllm``: vLLM in every trainer rank (``external_launcher``), on CPU and GPU.

Its TP groups tile the world, each one a data-parallel replica. The code: ``engine.py``.
"""

from megatron_stare.rollout import vllm_cpu
from megatron_stare.rollout.engines import (EngineCheck, EngineDescriptor, EngineMemoryModel, EngineTraits,
                                            require)


def _one_moe_replica_on_cpu(c: EngineCheck) -> None:
    # vLLM's data-parallel MoE layers gather every replica's tokens (all_gatherv), which its CPU
    # communicator lacks (base_device_communicator.py:296): one engine over all ranks instead.
    r = c.cfg.rollout
    if c.cuda or c.model is None or c.model.moe is None or not c.world_size:
        return
    replicas = c.world_size // r.tp
    require(replicas == 1, f"rollout.engine=vllm on CPU cannot run {replicas} data-parallel replicas of a "
                           f"mixture-of-experts model (vLLM-CPU has no all_gatherv for their MoE layers); "
                           f"set rollout.tp={c.world_size}")


ENGINE = EngineDescriptor(
    name="vllm", summary="vLLM colocated in every trainer rank (CPU and GPU)",
    traits=EngineTraits(placement="every_rank", cuda_only=False, server=False, routed_experts=True,
                        cpu_kv_cache=True),
    memory=EngineMemoryModel("budgeted"),
    implementation="megatron_stare.rollout.engines.vllm.engine:VLLMEngine",
    checks=(vllm_cpu.check_head_size, _one_moe_replica_on_cpu, vllm_cpu.check_routed_experts))
