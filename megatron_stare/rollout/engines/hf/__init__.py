"""``rollout.engine=hf``: embedded transformers in the driver's process (the CPU default).

One rank, one full copy of the policy in its dtype; released to host memory while the trainer
trains. The code: ``engine.py``.
"""

from megatron_stare.rollout.engines import (EngineCheck, EngineDescriptor, EngineMemoryModel, EngineTraits,
                                            require)


def _one_rank(c: EngineCheck) -> None:
    r = c.cfg.rollout
    require(r.tp == 1, f"rollout.tp={r.tp} but the hf engine runs on one rank; set rollout.tp=1 "
                       f"(or use rollout.engine=vllm)")


ENGINE = EngineDescriptor(
    name="hf", summary="embedded transformers on the driver (CPU default)",
    traits=EngineTraits(placement="driver", cuda_only=False, server=False),
    memory=EngineMemoryModel("whole_copy"),
    implementation="megatron_stare.rollout.engines.hf.engine:HFEngine",
    checks=(_one_rank,))
