"""``python -m megatron_stare.plan``: see ``megatron_stare.plan.planner.main``."""

import sys

from megatron_stare.plan.planner import main

sys.exit(main())
