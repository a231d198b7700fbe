"""``rollout.engine=vllm-server``: vLLM's OpenAI server, spawned by the driver on its node's first
``rollout.tp`` GPUs or attached through ``rollout.server_urls`` (several, behind the dispatcher).

The driver's client is a fleet (``fleet.py``) of server engines (``server.py``); it restarts a
lost server and re-syncs it.
"""

from megatron_stare.rollout import vllm_cpu
from megatron_stare.rollout.engines import EngineDescriptor, EngineMemoryModel, EngineTraits

ENGINE = EngineDescriptor(
    name="vllm-server", summary="vLLM OpenAI servers, spawned or attached (CPU and GPU)",
    traits=EngineTraits(placement="driver", cuda_only=False, server=True, can_spawn=True, routed_experts=True,
                        several_servers=True, restarts_servers=True, cpu_kv_cache=True),
    memory=EngineMemoryModel("budgeted"),
    implementation="megatron_stare.rollout.engines.vllm_server.fleet:VLLMServerFleet",
    checks=(vllm_cpu.check_head_size, vllm_cpu.check_routed_experts),
    server_command="megatron_stare.rollout.engines.vllm_server.command:server_command", default_port=8000)
