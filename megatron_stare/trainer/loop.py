"""The trainer loop: ``Trainer`` builds a run from its config and runs its steps, phase by phase
(``runtime/phases.py``; ``megatron_stare/train.py``'s docstring draws one step). Its collaborators
see only what they need of it: the handover around the training (``offload.Handover``), the
rollout pipeline (``async_rollouts.SteppedTrainer``), the interrupts
(``step_interrupt.InterruptibleTrainer``) and the console (``console_lines.RunSummary``).
"""


from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from megatron_stare.algorithms.gepo import GepoShaper, shape_batches
from megatron_stare.algorithms.off_policy import run_off_policy
from megatron_stare.algorithms.stare import StareController
from megatron_stare.checkpoint.async_save import BackgroundSaves
from megatron_stare.checkpoint.core import latest_complete, load_checkpoint, save_checkpoint
from megatron_stare.checkpoint.schedule import SaveClock
from megatron_stare.compat.host_memory import keep_freed_memory
from megatron_stare.config.load import Config, ConfigError
from megatron_stare.data import load_run_data
from megatron_stare.models.provider import load_hf_config, load_hf_weights, model_shape, spec_from_hf_config
from megatron_stare.plan.planner import resolve_recompute
from megatron_stare.rewards import RewardPool, check_reward_config
from megatron_stare.rewards.sharded import SharedScores, score_once
from megatron_stare.rollout import EngineWorld, engine_for_rank
from megatron_stare.rollout.data_parallel import check_prompt_major, gather_results, replica_slice
from megatron_stare.rollout.multiturn import multiturn_metrics
from megatron_stare.rollout.recovery import EngineRecovery
from megatron_stare.rollout.spec import DRIVER  # the rank of a driver-placed engine and of the logs
from megatron_stare.runtime.parallel import ParallelLayout, init_distributed
from megatron_stare.runtime.phases import GATHER, GENERATE, SCORE, TRAIN, Phase
from megatron_stare.runtime.preemption import Preemption, note_engine
from megatron_stare.trainer.async_rollouts import AsyncRollouts
from megatron_stare.trainer.console import Console, console_of
from megatron_stare.trainer.console_lines import RunSummary
from megatron_stare.trainer.generation import (GroupSelector, RanDry, ScoredBatch, eval_metrics, generate_episodes,
                                               sampling_params)
from megatron_stare.trainer.metrics import MetricsLogger, Timer
from megatron_stare.trainer.offload import Handover, Offloader
from megatron_stare.trainer.step_interrupt import StepInterrupts
from megatron_stare.trainer.sync_probe import MismatchWatch, SyncProbe, bound_for, probe_gap, sample_sources
from megatron_stare.weight_sync import update_verified
from megatron_stare.weight_sync.export import iter_hf_buckets
from megatron_stare.weight_sync.hf_export import write_hf_checkpoint


class Trainer:
    """Builds every part from the config, then ``fit()`` runs the steps."""

    def __init__(self, cfg: Config, preemption: Optional[Preemption] = None, console: Optional[Console] = None):
        from megatron_stare.actor import ActorSettings, MegatronActor

        self.cfg = cfg
        self.keep_host_memory = cfg.trainer.keep_host_memory and not torch.cuda.is_available()
        if self.keep_host_memory:
            keep_freed_memory()  # before the model and engine allocate
        # First (unless main() did it already): a preemption signal during the (long) set-up is
        # recorded, not fatal, and the run stops at the first step boundary.
        self.preemption = preemption if preemption is not None else Preemption.install()
        self._owns_preemption = preemption is None  # main() keeps its handlers until the process ends
        p, m = cfg.parallel, cfg.model
        check_reward_config(cfg.reward)  # a bad reward fails here, on every rank, before any work
        hf_dir = self.hf_dir
        self.model_spec = spec_from_hf_config(hf_dir, make_vocab_size_divisible_by=m.make_vocab_size_divisible_by)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        layout = ParallelLayout.from_world(world, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.etp,
                                           sequence_parallel=p.sequence_parallel,
                                           distributed_optimizer=p.distributed_optimizer)
        self.groups = init_distributed(layout, seed=cfg.trainer.seed, shape=model_shape(self.model_spec))
        self.rank = dist.get_rank()
        self.console = console_of(cfg, self.rank, console)  # what a person reads (console.py)
        if p.recompute == "auto":  # the planner's choice for this GPU (plan.py), said once
            p.recompute, why = resolve_recompute(cfg, hf_dir, world)
            self.console.note(why)
        settings = ActorSettings(parallel=p, optimizer=cfg.optimizer, algorithm=cfg.algorithm,
                                 temperature=cfg.rollout.temperature, dtype=getattr(torch, m.dtype),  # model.dtype
                                 attention=m.attention_backend, routing_replay=cfg.rollout.routing_replay,
                                 total_optimizer_steps=cfg.trainer.total_steps * cfg.trainer.mini_batches_per_step
                                 * cfg.trainer.ppo_epochs, off_policy=run_off_policy(cfg)[0],
                                 moe_router_losses=(m.moe_aux_loss_coeff, m.moe_z_loss_coeff))
        ref_dir = m.ref_path or hf_dir
        load_ref = ((lambda stage, g: load_hf_weights(stage, g, self.model_spec, ref_dir))
                    if cfg.algorithm.kl_loss_coef > 0 else None)
        self.actor = MegatronActor(self.model_spec, self.groups, settings,
                                   lambda stage, g: load_hf_weights(stage, g, self.model_spec, hf_dir),
                                   load_ref_weights=load_ref)
        self.offload = Offloader(self.actor, cfg.trainer.offload)  # off the GPU while the engine generates
        self.offload.offload()  # before the engine starts: it sizes its memory from what is free
        self.controller = StareController(cfg.algorithm.stare)
        self.gepo = GepoShaper(cfg.algorithm.gepo) if cfg.algorithm.gepo.enable else None
        t = cfg.trainer
        self.logprob_pass = self.actor.logprob_pass_reason(t.logprob_pass, t.mini_batches_per_step, t.ppo_epochs,
                                                           gepo=self.gepo is not None)
        if self.logprob_pass is None:
            self.console.note("old log-probs: from the update's own forward (one optimizer step per batch and "
                              f"loss '{cfg.algorithm.policy_loss}' plans without them; "
                              "trainer.logprob_pass=always runs the separate pass)")
        self.tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        self.train_set, self.eval_set, self.sampler = load_run_data(cfg.data, cfg.trainer.prompts_per_step,
                                                                    self.tokenizer)
        self.timer = Timer(cuda_sync=torch.cuda.is_available())
        self.save_clock = SaveClock(cfg.checkpoint.save_every_minutes)  # rank 0's clock decides
        self.saves = BackgroundSaves(cfg.checkpoint.async_save, done=self.console.saved)  # async_save.py
        self.phases_run: list = []  # this step's phases, in the order they ran
        self.verified_tensors = 0  # tensors whose checksums matched after the last sync (verify_sync)
        # Every rank scores its share of each batch (rewards/sharded.py); the engine's spec
        # says which ranks host an engine and which generate (rollout/spec.py).

        self.pool = RewardPool(cfg.reward)
        self.engine_spec, self.engine = engine_for_rank(cfg, EngineWorld.from_env())
        if self.engine is not None and self.engine_spec.traits.colocated:  # named if it dies (run.py)
            server = getattr(self.engine, "_server", None)  # sglang: a server process of its own
            note_engine(cfg.rollout.engine, f"server pid {server.proc.pid}, log {server.log_name}"
                        if server is not None and server.proc is not None else "in the rank's process")
        self.probe = SyncProbe.for_run(cfg, self.tokenizer, self.engine_spec)  # None unless verify_sync=probe
        self._probe_now = False  # a restarted server's first push is probed whatever the schedule says
        # A lost rollout server is restarted and re-synced (rollout/recovery.py, rollout/engines/vllm_server/fleet.py).
        self.recovery = EngineRecovery(self.engine, self.engine_spec.traits.restarts_servers
                                       and cfg.rollout.max_engine_restarts > 0, self.groups.device, self.console.note)
        self.mismatch_watch = MismatchWatch(bound_for(m.dtype, self.engine_spec.dtype)[0])
        # The engine <-> trainer handover in the phases' order, for steps and for work between them.
        self.handover = Handover(self.engine, self.offload, sync=lambda: self.sync_weights(),
                                 phase=lambda p: self.phase(p))
        self.interrupts = StepInterrupts(self)  # a signal inside a step's rollout stops it (step_interrupt.py)
        self.start_step, self.skipped = 0, 0
        self.version, self.rollouts, self._saved_in_flight = 0, None, []
        with self.handover.trainer_turn():
            self._resume()
        self.saved_step = self.start_step  # the state at start_step is on disk (or the initial one)
        self.logger = MetricsLogger(cfg.logging, self.rank, total_steps=cfg.trainer.total_steps,
                                    start_step=self.start_step + 1)  # steps are logged 1-based
        self.console.started(RunSummary.of(cfg, self.groups.layout, len(self.train_set),
                                           None if self.eval_set is None else len(self.eval_set), self.start_step),
                             self.logger, self.tokenizer)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> Optional[int]:
        """Run the steps; returns None when done, or the step a preemption stopped the run at."""
        self.handover.first_sync()  # the engine serves exactly the trainer's (possibly resumed) weights
        self.version = self.start_step  # policy version: steps trained into the engine's weights
        self.probe_engine(self.start_step)
        # Every step goes through the rollout pipeline: with staleness 0 it runs ``step`` exactly.
        self.rollouts = AsyncRollouts(self, self._saved_in_flight)
        self._saved_in_flight = []
        stopped = None
        try:
            try:
                for step in range(self.start_step, self.cfg.trainer.total_steps):
                    if self.preempted(step) or self.interrupts.run(step):  # runs the step
                        stopped = step
                        break
            finally:
                self.rollouts.close()
        except Exception:
            # A failed step still ends the engine (and waits for a background save) here, while
            # the process group lives: left to the interpreter's exit, vLLM's finalizer tears
            # down its groups after main's destroy_process_group and adds a traceback of its own.
            self.close_after_error()
            raise
        self.close()
        self.console.finished(self.start_step, stopped)
        return stopped

    def step(self, step: int) -> dict:
        """One synchronous step, phase by phase (see the module docstring)."""
        t0 = time.perf_counter()
        self.phases_run = []
        return self.finish_step(step, *self.rollout(step), t0=t0)  # 1-3 generate, gather, score

    def finish_step(self, step: int, samples, rollout, t0: float, job=None) -> dict:
        """Phases 4-8 and the step's metrics; ``job``: the pipeline's batch (asynchronous:
        ``async_rollouts.py``)."""
        cfg = self.cfg

        def drain() -> None:  # asynchronous: no request sees two weight versions
            if job is not None:
                with self.timer("wait_generate"):
                    self.rollouts.drain()

        # Phases 4-5 and 7-10 around the training (runtime/phases.py; trainer/offload.py). A
        # pipelined engine (job) generates through the step: it does not sleep. A probe deferred
        # while the trainer's weights were offloaded is checked once they are back.
        with self.handover.around(engine_sleeps=job is None, on_device=self.check_probe, before_sync=drain):
            train_start = time.perf_counter()
            with self.phase(TRAIN):
                result, stats, state, dynamics = self.train(samples, step)  # 6
            train_end = time.perf_counter()
        self.version = step + 1
        if step + 1 < cfg.trainer.total_steps:  # no samples follow the last sync
            self.probe_engine(step + 1)
        metrics = {**rollout.metrics(), **result.metrics, **dynamics,
                   "loss": result.loss[-1], "grad_norm": result.grad_norm[-1],
                   "time/optimizer_step": result.optimizer_s,  # rank 0's, part of time/update
                   "stare/entropy": stats.entropy,
                   # The gate only acts in the STARE loss; other losses log it as off.
                   "stare/gate": float(state.gate_on and cfg.algorithm.policy_loss == "stare"),
                   "stare/w": state.w, "stare/m": state.m, "skipped_steps": self.skipped}
        if job is not None:
            metrics.update(self.rollouts.step_metrics(step, job, samples, train_start, train_end))
        if stats.mismatch_mean is not None:
            metrics.update({"mismatch/mean_abs_logp": stats.mismatch_mean, "mismatch/max_abs_logp": stats.mismatch_max})
            if not cfg.trainer.staleness and (line := self.mismatch_watch.update(step + 1, stats.mismatch_mean)):
                self.console.note(line)
        if self.probe is not None and self.probe.last is not None:
            metrics.update({"sync/probe_mean_abs_logp": self.probe.last.mean, "sync/probe_max_abs_logp": self.probe.last.max})
        if stats.ratio_masked_frac is not None:
            metrics["mismatch/ratio_masked_frac"] = stats.ratio_masked_frac
        if cfg.trainer.eval_every and (step + 1) % cfg.trainer.eval_every == 0:
            with self.timer("eval"):
                metrics.update(self.evaluate(step))
        metrics.update(self.timer.metrics())
        metrics["time/step"] = time.perf_counter() - t0  # the whole step, its evaluation included
        metrics["perf/tokens_per_s"] = stats.num_tokens / max(metrics["time/step"], 1e-9)
        self.console.step(step + 1, metrics, samples)  # metrics logged, step line, samples
        c, last = cfg.checkpoint, step + 1 == cfg.trainer.total_steps
        self.saves.poll()  # a background save is finalized once every rank's writer is done
        if c.dir and ((c.save_every and (step + 1) % c.save_every == 0) or last
                      or self.save_clock.due(device=self.groups.device)):
            self.save(step + 1)
        if c.hf_export_every and (step + 1) % c.hf_export_every == 0:
            self.export_hf(step + 1)
        return metrics

    # ------------------------------------------------------------------ phases
    @contextmanager
    def phase(self, p: Phase) -> Iterator[None]:
        """Time phase ``p`` (``time/<name>``) and record that it ran."""
        self.phases_run.append(p.name)
        with self.timer(p.name), self.interrupts.phase(p):
            yield

    def rollout(self, step: int):
        """Phases 1-3, repeated while DAPO dynamic sampling asks for more prompt groups. Every
        rank runs this loop on the same gathered results and shared scores, so every rank draws
        the same prompts, keeps the same groups and makes the same generate calls."""
        selector = GroupSelector(self.cfg)
        self.recovery.new_step()
        generated: list = []  # every generation batch's results (multi-turn metrics)
        while not selector.full:
            prompts = self.train_set.batch(self.sampler.next_batch())
            seed = (self.cfg.trainer.seed * 100_003 + step) * 1009 + selector.batches
            params = sampling_params(self.engine_spec.sampling, seed=seed)
            with self.phase(GENERATE):
                results = self.generate(prompts, params)
            with self.phase(GATHER):
                results = self.gather(results, len(prompts), params.n)
            with self.phase(SCORE):
                shared = self.score(prompts, results)
            selector.add(ScoredBatch(prompts, results, shared.scores, params.n, shared.timeouts,
                                     shared.crashes, shared.extras))
            generated += results
        samples, stats = selector.finish()
        if self.cfg.rollout.multi_turn.env:
            stats.multiturn = multiturn_metrics(generated)
        if not samples:
            t = self.cfg.trainer
            raise RanDry(f"step {step + 1}: no informative prompt groups after {selector.batches} generation batches "
                         f"(dynamic sampling kept {len(selector.kept)} groups with mixed rewards; a step needs at "
                         f"least {t.mini_batches_per_step}): every group was all right or all wrong; "
                         f"trainer.max_gen_batches={t.max_gen_batches} bounds the draws")
        return samples, stats

    def generate(self, prompts, params):
        """Phase 1: each engine replica generates its own slice of the prompts, seeded by their
        batch indices (``rollout/data_parallel.py``); None on ranks that do not generate."""
        d = self.engine_spec.devices
        part = replica_slice(len(prompts), d.replica, d.replicas) if d.generates else None
        mt = self.cfg.rollout.multi_turn
        if self.recovery.active and not mt.env and not self.cfg.trainer.staleness:  # rollout/recovery.py
            return self.recovery.generate(part, lambda todo: self.engine.generate_partial(
                [prompts[i].token_ids for i in todo], params, prompt_indices=todo), self._resync_engine)
        if not d.generates:
            return None
        if not mt.env:
            return self.engine.generate([prompts[i].token_ids for i in part], params, prompt_indices=part)
        return generate_episodes(self.engine, [prompts[i] for i in part], part, params, mt, self.tokenizer)

    def gather(self, results, num_prompts: int, n: int):
        """Phase 2: every rank gets every replica's slice, in prompt order (one rank per replica
        contributes), and checks it is the whole batch."""
        gathered = gather_results(results, self.engine_spec.devices.leads_replica)
        check_prompt_major(gathered, num_prompts, n)
        return gathered

    def score(self, prompts, results):
        """Phase 3: each response scored once on one rank, the scores shared by all ranks. A
        multi-turn trajectory's score is its environment's reward (identical on every rank)."""
        if self.cfg.rollout.multi_turn.env:
            return SharedScores([float(r.env_reward) for r in results], 0, 0)

        def item(i: int):
            r = results[i]
            p = prompts[r.prompt_index]
            return self.tokenizer.decode(r.token_ids, skip_special_tokens=True), p.ground_truth, p.metadata

        return score_once(self.pool, len(results), item)

    def train(self, samples, step: int):
        """Phase 5: log-prob pass, GEPO shaping, STARE controller, update."""
        cfg = self.cfg
        if self.logprob_pass is None:
            return self.train_without_pass(samples, step)
        with self.timer("logprob"):
            batches = self.actor.prepare(samples, mini_batches=cfg.trainer.mini_batches_per_step)
            stats = self.actor.compute_logprobs(batches)
            if self.gepo is not None:
                shape_batches(self.gepo, batches, len({s.group_id for s in samples}), self.groups.dp_cp_group)
        state = self.controller.update(stats.entropy)
        plans = self.actor.loss_plans(batches, step, state)
        dynamics = self.actor.entropy_diagnostics(batches, plans)
        with self.timer("update"):
            result = self.actor.update(batches, step, state, ppo_epochs=cfg.trainer.ppo_epochs, plans=plans)
        self._note_skipped(result, step)
        return result, stats, state, dynamics

    def _note_skipped(self, result, step: int) -> None:
        self.skipped += result.skipped_steps
        if result.skipped_steps:
            self.console.note(f"step {step + 1}: {result.skipped_steps} optimizer step(s) skipped (non-finite "
                              f"loss or grad norm {result.grad_norm}); weights and optimizer untouched")

    def train_without_pass(self, samples, step: int):
        """Phase 5 when the update's forward stands in for the log-prob pass
        (``self.logprob_pass`` None): the reference pass if any, update, then the pass's
        statistics and the controller (whose state this loss does not read)."""
        batches = self.actor.prepare(samples, mini_batches=1)
        if self.actor.ref is not None:  # time/logprob is then the reference model's forward alone
            with self.timer("logprob"):
                self.actor.reference_logprobs(batches)
        plans = self.actor.loss_plans(batches, step, self.controller.state)
        with self.timer("update"):
            result = self.actor.update(batches, step, self.controller.state, plans=plans, fill_old=True)
        self._note_skipped(result, step)
        stats = self.actor.step_stats(batches)
        state = self.controller.update(stats.entropy)
        return result, stats, state, self.actor.entropy_diagnostics(batches, plans)

    def sync_weights(self) -> None:
        """Stream the trainer's weights, as HF tensors in bounded buckets, into the engine."""
        colocated = self.engine_spec.traits.colocated  # else pieces: two buckets on the sending rank
        buckets = iter_hf_buckets(self.actor.model, self.groups, self.model_spec,
                                  bucket_bytes=self.engine_spec.sync_bucket_bytes,
                                  dst="all" if colocated else DRIVER, pieces=not colocated)
        if self.engine is None:
            for _ in buckets:
                pass
        elif self.cfg.rollout.verify_sync != "checksums":
            self.engine.update_weights_from_buckets(buckets)
        else:
            self.verified_tensors = update_verified(self.engine, buckets)  # checksums on both sides
        if self.recovery.active:  # a server lost in the push (or before): back, and pushed to again
            agreed = self.recovery.agree()
            self._probe_now |= agreed.probe
            if agreed.resync:
                self.sync_weights()

    def _resync_engine(self) -> None:
        """A lost server is back with the checkpoint's weights: every rank syncs the current
        ones (the step's generation resumes with them), and the probe checks that push."""
        self.handover.first_sync()
        self.probe_engine(self.version)

    def probe_engine(self, version: int) -> None:
        """After the sync that installed policy ``version`` (engine awake): when due, the engine
        generates the probe and the trainer scores it, now if its weights are on the device,
        else at the next onload (``trainer/sync_probe.py``)."""
        if self.probe is None or not (self.probe.due(version) or self._probe_now):
            return
        self._probe_now = False

        with self.timer("sync_probe"):
            prompts, d = self.probe.prompts, self.engine_spec.devices
            results = None
            if d.generates:
                part = replica_slice(len(prompts), d.replica, d.replicas)
                results = self.engine.generate([prompts[i] for i in part], self.probe.sampling(), prompt_indices=part)
            results = self.gather(results, len(prompts), 1)
            self.probe.pending = (version, results)
            if self.offload.level == "none":
                self.check_probe()

    def check_probe(self) -> None:
        """The trainer's side of a pending probe; raises ``SyncCheckError`` past the bound."""
        if self.probe is None or self.probe.pending is None:
            return
        version, results = self.probe.pending
        self.probe.pending = None
        with self.timer("sync_probe"):
            gap = probe_gap(self.actor, self.probe.samples(results), self.groups)
        where = sample_sources(len(self.probe.prompts), self.engine_spec.devices, self.engine)
        self.probe.check(gap, version, self.cfg.rollout.engine, where)

    def evaluate(self, step: int) -> dict:
        """avg@k / pass@k on the eval set: generate, gather, score, as in a step."""
        prompts = list(self.eval_set)
        params = sampling_params(self.engine_spec.eval_sampling, seed=self.cfg.trainer.seed * 7919 + step)
        results = self.gather(self.generate(prompts, params), len(prompts), params.n)
        shared = self.score(prompts, results)  # a dict return's "acc" is the verdict (generation.py)
        return eval_metrics(ScoredBatch(prompts, results, shared.scores, params.n, extras=shared.extras))

    def preempted(self, step: int) -> bool:
        """At a step boundary (``step`` steps done), collectively: did any rank get a preemption
        signal? If so, save the finished step (unless it is saved already) and say so."""
        return self.interrupts.at_boundary(step)

    # ------------------------------------------------------------------ state
    def trainer_state(self, step: int) -> dict:
        return {"step": step, "sampler": self.sampler.state_dict(), "controller": self.controller.state_dict(),
                "in_flight": self.rollouts.state() if self.rollouts is not None else [],
                "gepo": self.gepo.state_dict() if self.gepo else None, "skipped_steps": self.skipped}

    def save(self, step: int, state: Optional[dict] = None) -> None:
        """Save after ``step`` steps (collective; ``state``: ``trainer_state(step)``, taken now when
        None), in the background with ``checkpoint.async_save`` (``self.saves``: then reported at
        its finalization)."""
        c, hf_dir = self.cfg.checkpoint, self.hf_dir
        with self.handover.trainer_turn():
            path = save_checkpoint(c.dir, step, actor=self.actor, groups=self.groups, spec=self.model_spec,
                                   trainer_state=state or self.trainer_state(step), keep_last=c.keep_last,
                                   hf_config=load_hf_config(hf_dir), hf_dir=hf_dir, background=self.saves)
        if path is not None:
            self.console.saved(path)
        self.saved_step = step
        self.save_clock.saved()

    def _resume(self) -> None:
        c = self.cfg.checkpoint
        if c.resume == "never" or (c.resume == "auto" and not c.dir):
            return
        path = latest_complete(c.dir) if c.resume == "auto" else Path(c.resume)
        if path is None:
            return
        state = load_checkpoint(path, actor=self.actor, groups=self.groups, spec=self.model_spec,
                                verified=c.resume == "auto")
        self.start_step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        self.controller.load_state_dict(state["controller"])
        if self.gepo is not None and state.get("gepo"):
            self.gepo.load_state_dict(state["gepo"])
        self.skipped = int(state.get("skipped_steps", 0))
        self._saved_in_flight = list(state.get("in_flight", []))
        self.console.note(f"resumed from {path} at step {self.start_step}")

    def export_hf(self, step: int) -> None:
        """Write the current policy as an HF checkpoint (safetensors + config + tokenizer)."""

        with self.handover.trainer_turn():
            write_hf_checkpoint(self.actor.model, self.groups, self.model_spec,
                                Path(self.cfg.checkpoint.dir) / f"hf_step_{step:08d}",
                                hf_config=load_hf_config(self.hf_dir), side_files_dir=self.hf_dir,
                                bucket_bytes=self.cfg.rollout.sync_bucket_mb << 20, dst=DRIVER)

    # ------------------------------------------------------------------ setup helpers
    @property
    def hf_dir(self) -> str:
        """The HF directory the run starts from (its config, tokenizer and side files)."""
        m = self.cfg.model
        if m.format == "megatron":
            raise ConfigError("model.format=megatron: start from an HF directory and use checkpoint.resume "
                              "for Megatron checkpoints")
        return m.path

    def close_after_error(self) -> None:
        """``close`` on the way out of a failure, with nothing collective (another rank may be gone
        or stuck): a background save in flight is abandoned (never finalized, its step directory
        has no COMPLETE and resume passes it over) and the engine is shut down while the process
        group lives. An error of its own is noted, never raised over the failure's."""
        parts = [self.saves.abort, self.interrupts.close, self.logger.close,
                 *([self.preemption.close] if self._owns_preemption else []),
                 *([self.pool.close] if self.pool is not None else []),
                 *([self.engine.shutdown] if self.engine is not None else [])]
        for close in parts:
            try:
                close()
            except Exception as e:  # noqa: BLE001 - the failure being raised is the one to report
                self.console.note(f"while stopping after an error: {type(e).__name__}: {e}")

    def close(self) -> None:
        self.interrupts.close()
        if self._owns_preemption:
            self.preemption.close()
        self.logger.close()
        if self.pool is not None:
            self.pool.close()
        # The background save first: an engine's shutdown may end processes (SGLang's
        # Engine.shutdown kills every child of its process), and the save's writer must finish.
        try:
            self.saves.close()
        finally:
            if self.engine is not None:
                self.engine.shutdown()
