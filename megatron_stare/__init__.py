"""megatron-stare: RL post-training of LLMs on Megatron-core with STARE as the policy loss."""

from pathlib import Path

__version__ = "0.1.0"

#: The source checkout this package runs from (its ``examples/`` and ``docs/``): the studies and
#: demos read their configs and records there. One definition, so a module that moves between
#: folders keeps finding them.
REPO_ROOT = Path(__file__).resolve().parent.parent
