"""Print the command that starts a rollout server for a run: ``python -m
megatron_stare.rollout.server_cmd --config X.yaml [--port P] [a.b=c ...]``.

A launch script starts the server with it (on GPUs of its own), then the trainer with
``rollout.server_urls=[http://host:P]``: the server then honours the run's spec (TP size,
dtype, context length, seed, the log-prob convention), which the trainer checks when it
attaches. For ``rollout.engine`` = ``vllm-server`` or ``sglang-server``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import urllib.parse
from typing import Optional, Sequence

from megatron_stare.config.load import ConfigError, load_config
from megatron_stare.rollout.engines import descriptor, descriptors
from megatron_stare.rollout.spec import EngineDevices, EngineSpec, EngineWorld
from megatron_stare.errors import print_or_error


def command_for(cfg, host: str, port: Optional[int]) -> str:
    """The server command of ``cfg``'s server engine, as one shell line."""
    r = cfg.rollout
    d = descriptor(r.engine)  # the server command comes from the engine's folder
    if d.server_command is None:
        servers = [n for n, e in descriptors().items() if e.server_command]
        raise ConfigError(f"rollout.engine={r.engine} starts no server; server_cmd is for {' and '.join(servers)}")
    module, _, attr = d.server_command.partition(":")
    # The engine's module (its library's imports stay lazy inside it), loaded for this command only.
    build, default_port = getattr(importlib.import_module(module), attr), d.default_port
    if port is None and r.server_urls:
        port = urllib.parse.urlsplit(r.server_urls[0]).port
    # The server runs on GPUs of its own: an attached server's placement (no trainer GPUs).
    world = EngineWorld(cuda=True)
    spec = EngineSpec.from_config(cfg, world)
    attached = dataclasses.replace(
        spec, server_urls=spec.server_urls or (f"http://{host}:{port or default_port}",),
        devices=EngineDevices(hosts_engine=True, generates=True, engine_ranks=(), gpu_ids=()))
    return build(attached, host, port or default_port).shell()


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_stare.rollout.server_cmd",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="YAML config of the run")
    ap.add_argument("--host", default="0.0.0.0", help="address the server listens on")
    ap.add_argument("--port", type=int, default=None,
                    help="port (default: that of rollout.server_urls[0], else the engine's default)")
    ap.add_argument("overrides", nargs="*", help="a.b=value overrides")
    args = ap.parse_args(argv)
    return print_or_error(lambda: command_for(load_config(args.config, args.overrides), args.host, args.port), (ConfigError,))


if __name__ == "__main__":
    sys.exit(main())
