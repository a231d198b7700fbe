"""RL training entry point: ``python -m megatron_stare.train --config X.yaml [a.b=c ...]``.

Run under torchrun (``torchrun --standalone --nproc-per-node N -m megatron_stare.train ...``);
a plain ``python -m`` run is a world of one. ``--dry-run`` validates the config and prints the
parallel plan and a per-GPU memory estimate without touching a GPU.

One step reads like the algorithm, phase by phase (``runtime/phases.py``, which the dry-run
planner's memory model reads too):

    1 generate     the engine: n responses per prompt          each replica its slice (spec.py)
    2 gather       every rank receives the same samples         each replica's slice, all-gathered
    3 score        each response scored once, scores shared     sharded over ranks; DAPO
                   (1-3 repeat while dynamic sampling wants more groups: the same on every rank)
    4 release      the engine frees its weights and KV cache    its supported sleep level
    5 onload       the trainer's offloaded state comes back     trainer.offload (offload.py)
    6 train        advantages -> log-prob pass -> STARE         Megatron actor, every rank
                   controller -> update
    7 resume_w     the engine restores its weight memory
    8 sync         Megatron shards -> HF buckets -> engine
    9 offload      the trainer's state leaves the GPU           trainer.offload
   10 resume_kv    the engine restores its KV cache
                   then metrics, eval, checkpoint

With ``trainer.staleness = k > 0`` (a server engine: vllm-server, sglang-server) ``fit`` runs
the steps through the rollout pipeline (``async_rollouts.py``, ``rollout/async_loop.py``): the
batches of the next k steps generate in a worker thread while this step trains (with
``trainer.partial_rollout_tokens``, in token segments that continue under each new version:
``rollout/partial.py``), the engine stays awake (no phases 4, 6, 8), the pipeline is drained
before the sync, and a sample is at most k policy versions old. With k = 0 ``fit`` runs exactly
``step``.

On a preemption signal (SIGTERM, SIGUSR1, SIGINT) the ranks save at the step boundary (``preemption.py``);
one during a step's rollout stops it and saves the step's start at once (``step_interrupt.py``).
Exit codes: 0 done, 2 user error, 75 preempted after saving, 130 Ctrl-C (saved), else a failure.
"""


from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import torch.distributed as dist

from megatron_stare.config.load import ConfigError, load_config
from megatron_stare.errors import UserError
from megatron_stare.plan import planner as plan
from megatron_stare.preflight.checks import validate_config
from megatron_stare.rollout.engines.vllm_server.fleet import EngineLost
from megatron_stare.runtime import notices
from megatron_stare.runtime.preemption import Preemption, interrupted_again, leave, write_status
from megatron_stare.runtime.reaper import install as install_reaper
from megatron_stare.runtime.rendezvous import RendezvousError
from megatron_stare.trainer.console import Console
from megatron_stare.trainer.generation import RanDry
from megatron_stare.trainer.loop import Trainer
from megatron_stare.trainer.sync_probe import SyncCheckError

__all__ = ["Trainer", "main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_stare.train", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="YAML config (see examples/)")
    ap.add_argument("--dry-run", action="store_true",
                    help="validate the config, print the parallel plan and memory estimate, exit")
    ap.add_argument("--world-size", type=int, default=None, help="world size for --dry-run")
    ap.add_argument("--gpu-mem-gb", type=float, default=80.0, help="GPU memory for --dry-run")
    ap.add_argument("overrides", nargs="*", help="a.b=value overrides")
    args = ap.parse_args(argv)
    if args.dry_run:
        extra = ["--world-size", str(args.world_size or int(os.environ.get("WORLD_SIZE", "1"))),
                 "--gpu-mem-gb", str(args.gpu_mem_gb)]
        return plan.main(["--config", args.config, *extra, *args.overrides])
    # Before anything slow: torchrun SIGTERMs every worker as soon as one exits. A user error is
    # found on every rank but printed by rank 0 alone, so a rank 0 still importing when a faster
    # rank exits must not die of that SIGTERM before its line: from here the signal is only
    # recorded (preemption.py), and torchrun's SIGKILL follows after its shutdown timeout.
    preemption = Preemption.install()
    console = Console.from_env().install()  # warnings collapsed, libraries' logging routed (console.py)
    install_reaper()  # this rank's helper processes die with it, however it dies (reaper.py)
    try:
        cfg = validate_config(load_config(args.config, args.overrides),
                              world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as e:
        console.say(f"error: {e}", err=True)
        preemption.close()
        write_status(2)
        return 2
    stopped = None
    try:
        if not console.configure(cfg).already_complete(cfg):  # a finished run says so before any set-up
            stopped = Trainer(cfg, preemption, console).fit()
        if stopped is not None:
            # For the launch shell (torchrun exits 1 whatever its workers return). Written
            # before any rank may exit: torchrun SIGTERMs the other workers as soon as one exits,
            # so no rank leaves this barrier before every node's local rank 0 has written it.
            write_status(preemption.exit_code())
            if dist.is_initialized():
                dist.barrier()
    except UserError as e:
        # User errors (malformed data rows, a bad reward path, a missing or torn checkpoint) are
        # detected identically on every rank before any collective: one line from rank 0. A
        # rendezvous error is a node's own (rank 0 may never see it): one line per node. Any
        # other exception - a library's ValueError included - is a crash with its traceback
        # (errors.py says why the two are kept apart).

        first = "LOCAL_RANK" if isinstance(e, RendezvousError) else "RANK"
        if int(os.environ.get(first, "0")) == 0:
            notices.say(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", err=True)
        write_status(2)
        return 2
    except (SyncCheckError, EngineLost, RanDry) as e:
        # Found by a collective check, identically on every rank: one line, exit 1 (a failure,
        # not a user error); nothing of the step after the last checkpoint is saved. A rollout
        # server lost past its restarts is such a check too (rollout/recovery.py), and so is
        # DAPO's dynamic sampling running dry (generation.RanDry: on the same shared scores).
        if int(os.environ.get("RANK", "0")) == 0:
            notices.say(f"error: {str(e).splitlines()[0]}", err=True)
        write_status(1)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C (preemption.py): stopped at once, nothing saved
        return interrupted_again()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # A preempted run keeps its handlers (they only record) until the process ends: the first
        # rank to exit makes torchrun SIGTERM the others, and one still shutting down must exit
        # 75 like the rest, not die of that signal.
        if stopped is None:
            preemption.close()
        console.close()
    return preemption.exit_code() if stopped is not None else 0


if __name__ == "__main__":
    sys.exit(leave(main()))  # a preempted rank ends at once (preemption.leave)
