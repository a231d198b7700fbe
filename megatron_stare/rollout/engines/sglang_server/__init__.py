"""``rollout.engine=sglang-server``: an SGLang server started elsewhere, attached through
``rollout.server_urls`` (GPU only). The code: ``engine.py``.
"""

from megatron_stare.rollout.engines import EngineDescriptor, EngineMemoryModel, EngineTraits

ENGINE = EngineDescriptor(
    name="sglang-server", summary="an attached SGLang server (GPU only)",
    traits=EngineTraits(placement="driver", cuda_only=True, server=True, routed_experts=True,
                        reports_checksums=False),
    memory=EngineMemoryModel("budgeted"),
    implementation="megatron_stare.rollout.engines.sglang_server.engine:SGLangServerEngine",
    server_command="megatron_stare.rollout.engines.sglang_server.engine:server_command", default_port=30000)
