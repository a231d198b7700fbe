"""``python -m megatron_stare.config``: see ``megatron_stare.preflight.cli``."""

import sys

from megatron_stare.preflight.cli import main

sys.exit(main())
