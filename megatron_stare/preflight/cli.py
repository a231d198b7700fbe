"""``python -m megatron_stare.config --config X.yaml [--world-size N] [a.b=c ...]``: the resolved,
validated config (exit 2 with one line per problem). The launch scripts' preflight runs it on
every node before torchrun; it loads no torch (``tests/unit/test_import_graph.py``)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import yaml

from megatron_stare.config.fields import ConfigError
from megatron_stare.config.load import to_dict
from megatron_stare.preflight.checks import resolve_config


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_stare.config",
                                 description="Print the resolved, validated config (exit 2 on an error).")
    ap.add_argument("--config", help="YAML config file")
    ap.add_argument("--world-size", type=int, default=None, help="ranks of the run (checks the layout)")
    ap.add_argument("--quiet", action="store_true", help="check only; print nothing when the config is good")
    ap.add_argument("overrides", nargs="*", help="a.b=value overrides")
    args = ap.parse_intermixed_args(argv)  # options may follow the a.b=c overrides
    try:
        cfg = resolve_config(args.config, args.overrides, world_size=args.world_size)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return 0
