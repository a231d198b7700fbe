"""``python -m megatron_stare.config``: see ``megatron_stare.config.load.main``."""

import sys

from megatron_stare.config.load import main

sys.exit(main())
