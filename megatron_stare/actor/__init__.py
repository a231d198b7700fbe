"""The Megatron actor: log-prob pass and policy update over Megatron's pipeline schedule.

One step, on every rank, from the same global list of samples:

    batches = actor.prepare(samples)                # this DP rank's mini-batches of micro-batches
    stats   = actor.compute_logprobs(batches)       # old log-prob, entropy (+ ref) per token
    state   = controller.update(stats.entropy)      # STARE gate from the GLOBAL token-mean entropy
    plans   = actor.loss_plans(batches, step, state)  # global denominators and selections
    dyn     = actor.entropy_diagnostics(batches, plans)
    result  = actor.update(batches, step, state, plans=plans)  # registered loss, Megatron optimizer

Correctness across layouts rests on three things: every rank derives the same micro-batch plan;
loss denominators and STARE/Cov selections are global (computed once per mini-batch from the
old-log-prob pass over the data(x context)-parallel group); and the backward scale undoes
exactly what Megatron's schedule and DDP divide by (``aggregation.backward_scale``).

The parts, one job each:

- ``types``: ``ActorSettings`` (what the actor reads from the config), ``StepStats``, ``UpdateResult``;
- ``core``: ``MegatronActor``, the model stage, DDP wrapper, optimizer and the public step API;
- ``optim``: Megatron's optimizer and LR schedule, and the step with its non-finite guard;
- ``batches``: samples -> this rank's mini-batches of padded micro-batches;
- ``token_stats``: logits of one micro-batch -> per-token log-prob / entropy / sensitivity sums;
- ``schedule``: Megatron's forward(-backward) schedule and the last pipeline stage's results
  shared with every stage;
- ``logprob_pass``: the forward-only pass that fills the micro-batches' old log-probs;
- ``loss_plans``: one ``LossPlan`` per mini-batch (global denominators and selections);
- ``update``: the per-micro-batch loss function object and the optimizer step per mini-batch;
- ``diagnostics``: entropy dynamics and STARE-selected keys, read from the loss plans;
- ``mismatch``: the rollout engine's log-probs against the trainer's (the off-policy correction
  itself is ``algorithms/off_policy.py``).
"""

from megatron_stare.actor.core import MegatronActor
from megatron_stare.actor.types import ActorSettings, StepStats, UpdateResult, WeightLoader

__all__ = ["ActorSettings", "MegatronActor", "StepStats", "UpdateResult", "WeightLoader"]
