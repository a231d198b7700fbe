"""The entropy study's methods, their tuning grids and the chosen settings (docs/study.md).

Every method is a list of ``a.b=c`` trainer overrides on top of ``examples/study_cpu.yaml`` and
of the shared settings (``SHARED``: the learning rate and batch, tuned first, for all methods
alike). Tuning (seed 0 only, ``python -m megatron_stare.study.v2 --tune``):

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
    # The issue-31 baselines (study v2): sequence-level ratio and clip; clipped detached IS weight on
    # every token; the policy gradient on the top-rho entropy ("forking") tokens of the batch only.
    Method("gspo", "GSPO", ("algorithm.policy_loss=gspo",)),
    Method("cispo", "CISPO", ("algorithm.policy_loss=cispo",)),
    Method("forking_tokens", "Forking tokens", ("algorithm.policy_loss=forking_tokens", *GRPO_CLIP)),
    Method("stare_o1", "STARE O1", ("algorithm.policy_loss=stare", *GRPO_CLIP, "algorithm.stare.variant=O1")),
    Method("stare_c2", "STARE C2", ("algorithm.policy_loss=stare", *GRPO_CLIP, "algorithm.stare.variant=C2")),
    # The public reference's own recipes (hp-luo/STARE, recipe/STARE/scripts/run_short_cot_*): STARE
    # O1 with fixed weights on GRPO with dynamic sampling and clip-higher, and that GRPO ("GRPO-ds")
    # as its baseline. Study v3 only (V3_ONLY).
    Method("grpo_ds", "GRPO-ds", ("algorithm.policy_loss=vanilla", "algorithm.clip_ratio_low=0.2",
                                  "trainer.dynamic_sampling=true")),
    Method("stare_ref", "STARE (reference recipe)",
           ("algorithm.policy_loss=stare", "algorithm.clip_ratio_low=0.2", "algorithm.clip_ratio_high=0.28",
            "trainer.dynamic_sampling=true", "algorithm.stare.variant=O1", "algorithm.stare.top_p=0.1",
            "algorithm.stare.adaptive=false")),
)
#: Methods added for study v3; v1 and v2 (their runners' defaults and committed results) predate them.
V3_ONLY: Tuple[str, ...] = ("grpo_ds", "stare_ref")
BY_NAME: Dict[str, Method] = {m.name: m for m in METHODS}

#: Step 1 of tuning: (learning rate, prompts per step), GRPO only; applies to every method.
SHARED_GRID: Tuple[Overrides, ...] = tuple(
    (f"optimizer.lr={lr}", f"trainer.prompts_per_step={b}") for lr in ("1e-4", "3e-4", "1e-3") for b in (8, 16))

#: The winner of step 1 (docs/study.md, "Tuning").
SHARED: Overrides = ("optimizer.lr=1e-4", "trainer.prompts_per_step=16")

_ADAPTIVE = ("algorithm.stare.adaptive=true", "algorithm.stare.w=1", "algorithm.stare.m=1", "algorithm.stare.alpha=0.1")

#: Step 2 of tuning: each method's own knobs, GRID_SIZE points each (the same budget for every
#: method). Two points per method, each around the value its paper or reference recipe uses:
GRIDS: Dict[str, Tuple[Overrides, ...]] = {
    # PPO's symmetric clip 0.2, and a wider 0.3 (near DAPO's upper 0.28).
    "grpo": tuple((f"algorithm.clip_ratio_low={e}", f"algorithm.clip_ratio_high={e}") for e in ("0.2", "0.3")),
    # DAPO's clip-higher: its paper's 0.28 and a milder 0.24.
    "dapo": tuple((f"algorithm.clip_ratio_high={e}",) for e in ("0.24", "0.28")),
    # The usual LLM-RL range of the bonus coefficient is 1e-3..1e-2; at this scale the collapse is
    # fast, so 0.01 and 0.03.
    "entropy_bonus": tuple((f"algorithm.entropy_coeff={c}",) for c in ("0.01", "0.03")),
    # Clip-Cov / KL-Cov (Cui et al. 2025): the fraction of tokens acted on. Their 2e-4 (clip) and
    # 2e-3 (KL) are for batches of ~1e6 tokens; ours are ~600, so 2e-3 (about one token) and 2e-2.
    "clip_cov": tuple((f"algorithm.clip_cov.ratio={r}", "algorithm.clip_cov.lb=1", "algorithm.clip_cov.ub=5")
                      for r in ("2e-3", "2e-2")),
    "kl_cov": tuple((f"algorithm.kl_cov.ratio={r}", "algorithm.kl_cov.coef=1") for r in ("2e-3", "2e-2")),
    # GEPO: the group-level weights' mixing (lam_pos = lam_neg) at kappa 1.
    "gepo": tuple((f"algorithm.gepo.lam_pos={lam}", f"algorithm.gepo.lam_neg={lam}", "algorithm.gepo.kappa=1")
                  for lam in ("0.5", "0.9")),
    # GSPO: its paper's (3e-4, 4e-4) on the geometric-mean sequence ratio, and 10x wider.
    "gspo": tuple((f"algorithm.gspo.clip_ratio_low={lo}", f"algorithm.gspo.clip_ratio_high={hi}")
                  for lo, hi in (("3e-4", "4e-4"), ("3e-3", "4e-3"))),
    # CISPO: MiniMax-M1's upper bound on the detached weight, and a wider one.
    "cispo": tuple((f"algorithm.cispo.clip_ratio_high={e}",) for e in ("0.28", "1.0")),
    # Forking tokens: the paper's rho 0.2 with each normaliser (all valid tokens: its form; the kept ones).
    "forking_tokens": tuple(("algorithm.forking_tokens.rho=0.2", f"algorithm.forking_tokens.normalizer={n}")
                            for n in ("all", "selected")),
    # STARE: the adaptive closed loop (W up / M down by alpha per step while entropy is below the
    # target, back when above), the variant that aims at the band, with two caps on W (and M).
    "stare_o1": (("algorithm.stare.top_p=0.2", *_ADAPTIVE, "algorithm.stare.w_max=10"),
                 ("algorithm.stare.top_p=0.2", *_ADAPTIVE, "algorithm.stare.w_max=30")),
    "stare_c2": (("algorithm.stare.top_p=0.2", *_ADAPTIVE, "algorithm.stare.w_max=10", "algorithm.stare.m_min=0.1"),
                 ("algorithm.stare.top_p=0.2", *_ADAPTIVE, "algorithm.stare.w_max=30", "algorithm.stare.m_min=0.03")),
    # The reference recipes: its clip-higher 0.28 (as DAPO's grid), and its STARE weights for 7B
    # (W 1.1, M 0.9) and for 14B/32B (W 1.05, M 0.95). Not tuned: the reference's 7B point is chosen.
    "grpo_ds": tuple((f"algorithm.clip_ratio_high={e}",) for e in ("0.28", "0.24")),
    "stare_ref": tuple((f"algorithm.stare.w={w}", f"algorithm.stare.m={m}") for w, m in (("1.1", "0.9"), ("1.05", "0.95"))),
}
GRID_SIZE = 2

#: The winners of step 2 (docs/study.md, "Tuning"): index into GRIDS[method].
CHOSEN: Dict[str, int] = {"grpo": 0, "dapo": 0, "entropy_bonus": 0, "clip_cov": 1, "kl_cov": 1, "gepo": 1,
                          "stare_o1": 0, "stare_c2": 0,
                          # Not tuned (study v2 cut its tuning to fit; docs/study.md): the papers' point.
                          "gspo": 0, "cispo": 0, "forking_tokens": 0, "grpo_ds": 0, "stare_ref": 0}


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
