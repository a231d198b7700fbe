"""RL training entry point: ``python -m megatron_stare.train --config X.yaml [a.b=c ...]``.

Run under torchrun (``torchrun --standalone --nproc-per-node N -m megatron_stare.train ...``);
a plain ``python -m`` run is a world of one. ``--dry-run`` validates the config and prints the
parallel plan and a per-GPU memory estimate without touching a GPU.

One step reads like the algorithm:

    prompts  -> rollout (n per prompt)            driver rank's engine
             -> rewards -> advantages             reward pool; DAPO dynamic sampling
             -> log-prob pass                      Megatron actor, every rank
             -> STARE controller                   global token-mean entropy
             -> update                             registered policy loss, Megatron optimizer
             -> weight sync                        Megatron shards -> HF buckets -> engine
             -> metrics, eval, checkpoint

Between steps the ranks agree whether a preemption signal (SIGTERM, SIGUSR1) arrived; if so the
run saves the finished step and exits with code 75 (``preemption.py``); rerunning resumes exactly.
Exit codes: 0 done, 2 user error (one line), 75 preempted after saving, else a failure.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_stare.config import Config, ConfigError, load_config, validate_config
from megatron_stare.preemption import PREEMPTED_EXIT_CODE, Preemption, write_status

DRIVER = 0  # the rank that owns the rollout engine, the reward pool and the logs


class Trainer:
    """Builds every part from the config, then ``fit()`` runs the steps."""

    def __init__(self, cfg: Config):
        from megatron_stare.actor import ActorSettings, MegatronActor
        from megatron_stare.algorithms.gepo import GepoShaper
        from megatron_stare.algorithms.stare import StareController
        from megatron_stare.metrics import MetricsLogger, Timer
        from megatron_stare.models.provider import load_hf_weights, model_shape, spec_from_hf_config
        from megatron_stare.parallel import ParallelLayout, init_distributed

        from megatron_stare.rewards import get_reward_fn

        self.cfg = cfg
        # First: a preemption signal during the (long) set-up is recorded, not fatal, and the run
        # stops at the first step boundary.
        self.preemption = Preemption.install()
        p, m = cfg.parallel, cfg.model
        get_reward_fn(cfg.reward.fn)  # a bad reward path fails here, on every rank, before any work
        hf_dir = self._hf_dir()
        self.spec = spec_from_hf_config(hf_dir, make_vocab_size_divisible_by=m.make_vocab_size_divisible_by)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        layout = ParallelLayout.from_world(world, tp=p.tp, pp=p.pp, cp=p.cp,
                                           sequence_parallel=p.sequence_parallel,
                                           distributed_optimizer=p.distributed_optimizer)
        self.groups = init_distributed(layout, seed=cfg.trainer.seed, shape=model_shape(self.spec))
        self.rank = dist.get_rank()
        dtype = torch.bfloat16 if m.dtype == "bfloat16" else torch.float32
        settings = ActorSettings(parallel=p, optimizer=cfg.optimizer, algorithm=cfg.algorithm,
                                 temperature=cfg.rollout.temperature, dtype=dtype,
                                 total_optimizer_steps=cfg.trainer.total_steps * cfg.trainer.mini_batches_per_step
                                 * cfg.trainer.ppo_epochs, tis_cap=cfg.algorithm.tis_cap)
        ref_dir = m.ref_path or hf_dir
        load_ref = ((lambda stage, g: load_hf_weights(stage, g, self.spec, ref_dir))
                    if cfg.algorithm.kl_loss_coef > 0 else None)
        self.actor = MegatronActor(self.spec, self.groups, settings,
                                   lambda stage, g: load_hf_weights(stage, g, self.spec, hf_dir),
                                   load_ref_weights=load_ref)
        self.controller = StareController(cfg.algorithm.stare)
        self.gepo = GepoShaper(cfg.algorithm.gepo) if cfg.algorithm.gepo.enable else None
        self.tokenizer = self._tokenizer(hf_dir)
        self.train_set, self.eval_set, self.sampler = self._data()
        self.timer = Timer(cuda_sync=torch.cuda.is_available())
        # A colocated engine (vllm, sglang) has a shard on every rank (vLLM's external_launcher:
        # it joins the trainer's processes, its TP may differ from the trainer's); every rank
        # then generates in lockstep and the driver's samples are the ones broadcast. Server
        # engines and the embedded hf engine live on the driver only.
        self.colocated = cfg.rollout.engine in ("vllm", "sglang")
        self.engine = self.pool = None
        if self.colocated or self.rank == DRIVER:
            from megatron_stare.rewards import RewardPool
            from megatron_stare.rollout import build_engine

            self.pool = RewardPool(cfg.reward)
            self.engine = build_engine(cfg.rollout.engine, hf_dir, **self._engine_kwargs())
        self.start_step, self.skipped = 0, 0
        self._resume()
        self.saved_step = self.start_step  # the state at start_step is on disk (or the initial one)
        self.logger = MetricsLogger(cfg.logging, self.rank, total_steps=cfg.trainer.total_steps,
                                    start_step=self.start_step + 1)  # steps are logged 1-based

    # ------------------------------------------------------------------ the loop
    def fit(self) -> Optional[int]:
        """Run the steps; returns None when done, or the step a preemption stopped the run at."""
        self.sync_weights()  # the engine serves exactly the trainer's (possibly resumed) weights
        stopped = None
        for step in range(self.start_step, self.cfg.trainer.total_steps):
            if self.preempted(step):
                stopped = step
                break
            self.step(step)
        self.close()
        return stopped

    def step(self, step: int) -> dict:
        cfg, t0 = self.cfg, time.perf_counter()
        with self.timer("rollout"):
            samples, rollout_metrics = self.rollout(step)
        with self.timer("logprob"):
            batches = self.actor.prepare(samples, mini_batches=cfg.trainer.mini_batches_per_step)
            stats = self.actor.compute_logprobs(batches)
            if self.gepo is not None:
                self._shape_gepo(batches, len({s.group_id for s in samples}))
        state = self.controller.update(stats.entropy)
        plans = self.actor.loss_plans(batches, step, state)
        dynamics = self.actor.entropy_diagnostics(batches, plans)
        with self.timer("update"):
            result = self.actor.update(batches, step, state, ppo_epochs=cfg.trainer.ppo_epochs, plans=plans)
        self.skipped += result.skipped_steps
        if result.skipped_steps and self.rank == DRIVER:
            print(f"[megatron-stare] step {step + 1}: {result.skipped_steps} optimizer step(s) skipped "
                  f"(non-finite loss or grad norm {result.grad_norm}); weights and optimizer untouched",
                  flush=True)
        with self.timer("sync"):
            self.sync_weights()
        metrics = {**rollout_metrics, **result.metrics, **dynamics,
                   "loss": result.loss[-1], "grad_norm": result.grad_norm[-1],
                   "stare/entropy": stats.entropy,
                   # The gate only acts in the STARE loss; other losses log it as off.
                   "stare/gate": float(state.gate_on and cfg.algorithm.policy_loss == "stare"),
                   "stare/w": state.w, "stare/m": state.m, "skipped_steps": self.skipped}
        if stats.mismatch_mean is not None:
            metrics.update({"mismatch/mean_abs_logp": stats.mismatch_mean,
                            "mismatch/max_abs_logp": stats.mismatch_max})
        if cfg.trainer.eval_every and (step + 1) % cfg.trainer.eval_every == 0:
            with self.timer("eval"):
                metrics.update(self.evaluate(step))
        # The rollout phase splits into generation (time/rollout) and scoring (time/reward).
        metrics.update({k: v for k, v in self.timer.metrics().items() if k != "time/rollout"})
        metrics["perf/tokens_per_s"] = stats.num_tokens / max(time.perf_counter() - t0, 1e-9)
        self.logger.log(step + 1, metrics)
        c = cfg.checkpoint
        last = step + 1 == cfg.trainer.total_steps
        if c.dir and ((c.save_every and (step + 1) % c.save_every == 0) or last):
            self.save(step + 1)
        if c.hf_export_every and (step + 1) % c.hf_export_every == 0:
            self.export_hf(step + 1)
        return metrics

    # ------------------------------------------------------------------ phases
    def rollout(self, step: int):
        """Driver generates and scores; every rank receives the same samples."""
        from megatron_stare.generation import as_metrics, collect_samples

        prompts = self.train_set.batch(self.sampler.next_batch())
        payload = [None]
        if self.engine is not None:
            samples, stats = collect_samples(
                self.engine, prompts, lambda: self.train_set.batch(self.sampler.next_batch()),
                self.tokenizer, self.pool, self.cfg, seed=self.cfg.trainer.seed * 100_003 + step)
            payload = [(samples, as_metrics(stats), self.sampler.state_dict())]
            if self.rank != DRIVER:
                payload = [None]
        dist.broadcast_object_list(payload, src=DRIVER)
        samples, metrics, sampler_state = payload[0]
        self.sampler.load_state_dict(sampler_state)  # dynamic sampling may have drawn more
        if not samples:
            raise RuntimeError(f"step {step}: no informative prompt groups after "
                               f"{self.cfg.trainer.max_gen_batches} generation batches")
        return samples, metrics

    def _shape_gepo(self, batches, num_groups: int) -> None:
        from megatron_stare.algorithms.gepo import group_token_mean
        from megatron_stare.types import cat_padded

        flat = [mb for mini in batches for mb in mini]
        gid = torch.cat([mb.group_ids for mb in flat])
        ent = group_token_mean(cat_padded([mb.entropy for mb in flat]),
                               cat_padded([mb.loss_mask for mb in flat], False), gid, num_groups,
                               dp_group=self.groups.dp_cp_group)
        out = self.gepo(torch.cat([mb.advantages for mb in flat]).double(), ent, gid)
        adv = out.advantages.float()
        offset = 0
        for mb in flat:
            mb.advantages = adv[offset: offset + mb.advantages.numel()]
            offset += mb.advantages.numel()

    def sync_weights(self) -> None:
        """Stream the trainer's weights, as HF tensors in bounded buckets, into the engine."""
        from megatron_stare.models.export import iter_hf_buckets

        buckets = iter_hf_buckets(self.actor.model, self.groups, self.spec,
                                  bucket_bytes=self.cfg.rollout.sync_bucket_mb << 20,
                                  dst="all" if self.colocated else DRIVER)
        if self.engine is None:
            for _ in buckets:
                pass
            return
        if not self.cfg.rollout.verify_sync:
            self.engine.update_weights_from_buckets(buckets)
            return
        from megatron_stare.weight_sync.plan import compare_checksums, tensor_checksum

        expected = {}

        def watched():
            for bucket in buckets:
                for name, tensor in bucket:
                    expected[name] = tensor_checksum(tensor)
                yield bucket

        self.engine.update_weights_from_buckets(watched())
        compare_checksums(expected, self.engine.checksum(sorted(expected)))

    def evaluate(self, step: int) -> dict:
        from megatron_stare.generation import evaluate

        out = [None]
        if self.engine is not None:
            out = [evaluate(self.engine, list(self.eval_set), self.tokenizer, self.pool, self.cfg,
                            seed=self.cfg.trainer.seed * 7919 + step)]
            if self.rank != DRIVER:
                out = [None]
        dist.broadcast_object_list(out, src=DRIVER)
        return out[0]

    def preempted(self, step: int) -> bool:
        """At a step boundary (``step`` steps done), collectively: did any rank get a preemption
        signal? If so, save the finished step (unless it is saved already) and say so."""
        sig = self.preemption.agreed(device=self.groups.device)
        if sig is None:
            return False
        c = self.cfg.checkpoint
        if c.dir and step > self.saved_step:
            self.save(step)
        if self.rank == DRIVER:
            where = ("no checkpoint.dir: nothing saved" if not c.dir
                     else "no step finished since the start" if step == self.start_step
                     else f"saved {Path(c.dir).absolute() / f'step_{step:08d}'}")
            print(f"[megatron-stare] preempted by {sig.name} after step {step}: {where}; rerun the same "
                  f"command to resume (exit {PREEMPTED_EXIT_CODE})", flush=True)
        return True

    # ------------------------------------------------------------------ state
    def trainer_state(self, step: int) -> dict:
        return {"step": step, "sampler": self.sampler.state_dict(), "controller": self.controller.state_dict(),
                "gepo": self.gepo.state_dict() if self.gepo else None, "skipped_steps": self.skipped}

    def save(self, step: int) -> None:
        from megatron_stare.checkpoint import save_checkpoint
        from megatron_stare.models.provider import load_hf_config

        save_checkpoint(self.cfg.checkpoint.dir, step, actor=self.actor, groups=self.groups, spec=self.spec,
                        trainer_state=self.trainer_state(step), keep_last=self.cfg.checkpoint.keep_last,
                        hf_config=load_hf_config(self._hf_dir()))
        self.saved_step = step

    def _resume(self) -> None:
        from megatron_stare.checkpoint import latest_complete, load_checkpoint

        c = self.cfg.checkpoint
        if c.resume == "never" or (c.resume == "auto" and not c.dir):
            return
        path = latest_complete(c.dir) if c.resume == "auto" else Path(c.resume)
        if path is None:
            return
        state = load_checkpoint(path, actor=self.actor, groups=self.groups, spec=self.spec,
                                verified=c.resume == "auto")
        self.start_step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        self.controller.load_state_dict(state["controller"])
        if self.gepo is not None and state.get("gepo"):
            self.gepo.load_state_dict(state["gepo"])
        self.skipped = int(state.get("skipped_steps", 0))
        if self.rank == DRIVER:
            print(f"[megatron-stare] resumed from {path} at step {self.start_step}", flush=True)

    def export_hf(self, step: int) -> None:
        """Write the current policy as an HF checkpoint (safetensors + config + tokenizer)."""
        from megatron_stare.models.hf_export import write_hf_checkpoint
        from megatron_stare.models.provider import load_hf_config

        write_hf_checkpoint(self.actor.model, self.groups, self.spec,
                            Path(self.cfg.checkpoint.dir) / f"hf_step_{step:08d}",
                            hf_config=load_hf_config(self._hf_dir()), side_files_dir=self._hf_dir(),
                            bucket_bytes=self.cfg.rollout.sync_bucket_mb << 20, dst=DRIVER)

    # ------------------------------------------------------------------ setup helpers
    def _hf_dir(self) -> str:
        m = self.cfg.model
        if m.format == "megatron":
            raise ConfigError("model.format=megatron: start from an HF directory and use checkpoint.resume "
                              "for Megatron checkpoints")
        return m.path

    def _tokenizer(self, hf_dir: str):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(hf_dir)

    def _data(self):
        from megatron_stare.data import PromptSampler, load_prompts

        d, t = self.cfg.data, self.cfg.trainer
        train = load_prompts(d.train_path, d, self.tokenizer)
        ev = load_prompts(d.eval_path, d, self.tokenizer) if d.eval_path else None
        sampler = PromptSampler(len(train), t.prompts_per_step, seed=d.seed, shuffle=d.shuffle)
        return train, ev, sampler

    def _engine_kwargs(self) -> dict:
        r = self.cfg.rollout
        if r.engine == "hf":
            return {"dtype": torch.bfloat16 if self.cfg.model.dtype == "bfloat16" else torch.float32}
        max_len = self.cfg.data.max_prompt_length + r.max_new_tokens
        if r.engine == "vllm":
            world = dist.get_world_size()
            dp = {"data_parallel_size": world // r.tp} if world > r.tp else {}
            return {"seed": self.cfg.trainer.seed, "max_model_len": max_len, "tensor_parallel_size": r.tp,
                    "distributed_executor_backend": "external_launcher", "dtype": self.cfg.model.dtype,
                    "record_checksums": r.verify_sync, **dp}
        return {"max_model_len": max_len}

    def close(self) -> None:
        self.preemption.close()
        self.logger.close()
        if self.pool is not None:
            self.pool.close()
        if self.engine is not None:
            self.engine.shutdown()


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
        from megatron_stare import plan

        extra = ["--world-size", str(args.world_size or int(os.environ.get("WORLD_SIZE", "1"))),
                 "--gpu-mem-gb", str(args.gpu_mem_gb)]
        return plan.main(["--config", args.config, *extra, *args.overrides])
    try:
        cfg = validate_config(load_config(args.config, args.overrides),
                              world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        stopped = Trainer(cfg).fit()
    except ValueError as e:
        # User errors (malformed data rows, a bad reward path, a missing or torn checkpoint) are
        # detected identically on every rank before any collective: one line from rank 0. A
        # rendezvous error is a node's own (rank 0 may never see it): one line per node.
        from megatron_stare.rendezvous import RendezvousError

        first = "LOCAL_RANK" if isinstance(e, RendezvousError) else "RANK"
        if int(os.environ.get(first, "0")) == 0:
            print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if stopped is not None:
        write_status(PREEMPTED_EXIT_CODE)  # for the launch shell: torchrun exits 1 regardless
        return PREEMPTED_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
