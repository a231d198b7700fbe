"""The entropy study's methods, their tuning grids and the chosen settings (docs/study.md).

Every method is a list of ``a.b=c`` trainer overrides on top of ``examples/study_cpu.yaml`` and
of the shared settings (``SHARED``: the learning rate and batch, tuned first, for all methods
alike). Tuning (seed 0 only, ``python -m megatron_stare.demo.study --tune``):

1. ``SHARED_GRID``: GRPO at each learning rate x batch; the best by the selection score below
   becomes ``SHARED`` for every method. Learning rates at which GRPO diverges (accuracy falls
   below the warm start's) are excluded.
2. ``GRIDS``: for each method, an equal-size grid of its own knobs (``GRID_SIZE`` points); the best
   by the selection score becomes ``CHOSEN[method]``.

Selection score (the same for every method): the mean of held-out pass@1 and pass@8 over the
evaluations of the last quarter of the run. Entropy is not part of it, so no method is tuned
to the band.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

Overrides = Tuple[str, ...]


@dataclass(frozen=True)
class Method:
    name: str
    """Key used in directories and tables (``grpo``, ``stare_o1``...)."""
    label: str
    """Name in the table and the figures."""
    base: Overrides
    """What makes it this method (the policy loss, its switches), before its tuned knobs."""


GRPO_CLIP = ("algorithm.clip_ratio_low=0.2", "algorithm.clip_ratio_high=0.2")
METHODS: Tuple[Method, ...] = (
    Method("grpo", "GRPO", ("algorithm.policy_loss=vanilla", *GRPO_CLIP)),
    # DAPO: clip-higher, dynamic sampling (drop groups whose rewards are all equal, draw more),
    # overlong shaping (the buffer: responses longer than max_new_tokens - 3 = 5 tokens lose
    # up to 1; a correct " 7+2" + EOS is 5 tokens, so only rambling is penalised).
    Method("dapo", "DAPO", ("algorithm.policy_loss=vanilla", "algorithm.clip_ratio_low=0.2",
                            "trainer.dynamic_sampling=true", "reward.overlong_buffer_len=3")),
    Method("entropy_bonus", "Entropy bonus", ("algorithm.policy_loss=vanilla", *GRPO_CLIP)),
    Method("clip_cov", "Clip-Cov", ("algorithm.policy_loss=clip_cov", *GRPO_CLIP)),
    Method("kl_cov", "KL-Cov", ("algorithm.policy_loss=kl_cov", *GRPO_CLIP)),
    Method("gepo", "GEPO", ("algorithm.policy_loss=vanilla", *GRPO_CLIP, "algorithm.gepo.enable=true")),
    Method("stare_o1", "STARE O1", ("algorithm.policy_loss=stare", *GRPO_CLIP, "algorithm.stare.variant=O1")),
    Method("stare_c2", "STARE C2", ("algorithm.policy_loss=stare", *GRPO_CLIP, "algorithm.stare.variant=C2")),
)
BY_NAME: Dict[str, Method] = {m.name: m for m in METHODS}

#: Step 1 of tuning: (learning rate, prompts per step), GRPO only; applies to every method.
SHARED_GRID: Tuple[Overrides, ...] = tuple(
    (f"optimizer.lr={lr}", f"trainer.prompts_per_step={b}") for lr in ("1e-4", "3e-4", "1e-3") for b in (8, 16))

#: The winner of step 1 (docs/study.md, "Tuning").
SHARED: Overrides = ("optimizer.lr=1e-4", "trainer.prompts_per_step=16")

_ADAPTIVE = ("algorithm.stare.adaptive=true", "algorithm.stare.w=1", "algorithm.stare.m=1", "algorithm.stare.alpha=0.1")

#: Step 2 of tuning: each method's own knobs, GRID_SIZE points each.
GRIDS: Dict[str, Tuple[Overrides, ...]] = {
    "grpo": tuple((f"algorithm.clip_ratio_low={e}", f"algorithm.clip_ratio_high={e}")
                  for e in ("0.1", "0.2", "0.3", "0.4")),
    "dapo": tuple((f"algorithm.clip_ratio_high={e}",) for e in ("0.24", "0.28", "0.35", "0.45")),
    "entropy_bonus": tuple((f"algorithm.entropy_coeff={c}",) for c in ("0.003", "0.01", "0.03", "0.1")),
    "clip_cov": tuple((f"algorithm.clip_cov.ratio={r}", f"algorithm.clip_cov.lb={lb}", "algorithm.clip_cov.ub=5")
                      for r, lb in (("2e-3", "1"), ("2e-2", "1"), ("2e-2", "0.2"), ("1e-1", "0.2"))),
    "kl_cov": tuple((f"algorithm.kl_cov.ratio={r}", f"algorithm.kl_cov.coef={c}")
                    for r, c in (("2e-3", "1"), ("2e-2", "1"), ("2e-2", "5"), ("1e-1", "1"))),
    "gepo": tuple((f"algorithm.gepo.lam_pos={lp}", f"algorithm.gepo.lam_neg={ln}", f"algorithm.gepo.kappa={k}")
                  for lp, ln, k in (("0.5", "0.5", "1"), ("0.9", "0.9", "1"), ("0.5", "0.5", "0.5"),
                                    ("0.9", "0.9", "0.5"))),
    # STARE: P and the weights; the adaptive closed loop (W up / M down by alpha per step while
    # entropy is below target, and back when above) with two caps, and two fixed settings.
    "stare_o1": (("algorithm.stare.top_p=0.2", "algorithm.stare.w=2"),
                 ("algorithm.stare.top_p=0.2", "algorithm.stare.w=5"),
                 ("algorithm.stare.top_p=0.2", *_ADAPTIVE, "algorithm.stare.w_max=10"),
                 ("algorithm.stare.top_p=0.2", *_ADAPTIVE, "algorithm.stare.w_max=30")),
    "stare_c2": (("algorithm.stare.top_p=0.2", "algorithm.stare.w=2", "algorithm.stare.m=0.5"),
                 ("algorithm.stare.top_p=0.2", "algorithm.stare.w=5", "algorithm.stare.m=0.2"),
                 ("algorithm.stare.top_p=0.2", *_ADAPTIVE, "algorithm.stare.w_max=10", "algorithm.stare.m_min=0.1"),
                 ("algorithm.stare.top_p=0.2", *_ADAPTIVE, "algorithm.stare.w_max=30", "algorithm.stare.m_min=0.03")),
}
GRID_SIZE = 4

#: The winners of step 2 (docs/study.md, "Tuning"): index into GRIDS[method].
CHOSEN: Dict[str, int] = {"grpo": 1, "dapo": 1, "entropy_bonus": 1, "clip_cov": 0, "kl_cov": 0, "gepo": 0,
                          "stare_o1": 2, "stare_c2": 2}


def method_overrides(name: str, knobs: Optional[Overrides] = None, shared: Overrides = SHARED) -> List[str]:
    """The trainer overrides of method ``name``: shared settings, the method's switches, its knobs
    (default: the chosen point of its grid)."""
    m = BY_NAME[name]
    knobs = GRIDS[name][CHOSEN[name]] if knobs is None else knobs
    return [*shared, *m.base, *knobs]


def check_grids() -> None:
    """Every method has a grid of GRID_SIZE points and a chosen point inside it."""
    for m in METHODS:
        g = GRIDS.get(m.name, ())
        if len(g) != GRID_SIZE or not 0 <= CHOSEN.get(m.name, -1) < len(g):
            raise ValueError(f"study method {m.name!r}: its grid must have {GRID_SIZE} points and a chosen index")
