"""``rollout.engine=sglang``: one SGLang server per group of ``rollout.tp`` ranks, spawned and
driven by the group's first rank on the group's GPUs (GPU only). The code: ``engine.py``.
"""

from megatron_stare.rollout.engines import EngineDescriptor, EngineMemoryModel, EngineTraits

ENGINE = EngineDescriptor(
    name="sglang", summary="SGLang per group of rollout.tp ranks, colocated (GPU only)",
    traits=EngineTraits(placement="group_leader", cuda_only=True, server=False, routed_experts=True,
                        reports_checksums=False),
    memory=EngineMemoryModel("budgeted", ipc_context_per_tp_rank=True),
    implementation="megatron_stare.rollout.engines.sglang.engine:SGLangEngine")
