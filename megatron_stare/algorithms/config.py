"""Typed settings for advantages, policy losses and entropy control (`algorithm.*` in YAML).

Plain dataclasses with typed fields and defaults so the generic YAML loader can compose them.
Each has ``validate(prefix)`` raising ``ValueError`` with one line naming the field and the fix.
Defaults follow docs/algorithms.md (DAPO clip 0.2/0.28, dual clip 3.0, STARE P=0.1 W=1.1 M=0.9).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

SELECTION_SCOPES = ("global", "microbatch")


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _in_unit(name: str, value: float) -> None:
    _require(0.0 <= value <= 1.0 and math.isfinite(value), f"{name} must be in [0, 1], got {value}")


def _scope(name: str, value: str) -> None:
    _require(value in SELECTION_SCOPES, f"{name} must be one of {SELECTION_SCOPES}, got {value!r}")


@dataclass
class StareConfig:
    """STARE token reweighting; active when ``algorithm.policy_loss == 'stare'``."""

    variant: str = "O1"
    """'O1': amplify the top-P surprisal tokens of A>0 by w; 'C2': also attenuate those of A<0 by m."""
    top_p: float = 0.1
    """P: fraction of the candidate set T+ (T-) reweighted; k(n) = min(n, max(1, ceil(n*P)))."""
    w: float = 1.1
    """W: weight of the selected positive-advantage tokens (initial value when adaptive)."""
    m: float = 0.9
    """M: weight of the selected negative-advantage tokens, C2 only (initial value when adaptive)."""
    target_entropy: float = 0.3
    """H_tgt: the gate is on iff the step's global token-mean entropy is strictly below this."""
    selection_scope: str = "global"
    """'global': exact top-k over the whole mini-batch on all ranks (layout-independent);
    'microbatch': top-k inside each micro-batch on each rank (the public reference)."""
    adaptive: bool = False
    """Move W up and M down by alpha per step while entropy is below target (and back when above)."""
    alpha: float = 0.01
    """Adaptive step size for W and M."""
    w_max: float = 1.5
    """Upper clip of the adaptive W (lower clip is 1)."""
    m_min: float = 0.5
    """Lower clip of the adaptive M (upper clip is 1)."""

    def validate(self, prefix: str = "algorithm.stare") -> None:
        _require(self.variant in ("O1", "C2"), f"{prefix}.variant must be 'O1' or 'C2', got {self.variant!r}")
        _in_unit(f"{prefix}.top_p", self.top_p)
        # omega > 0 keeps every token's gradient sign; this is what makes STARE a reweighting.
        _require(self.w > 0 and math.isfinite(self.w), f"{prefix}.w must be a finite number > 0, got {self.w}")
        _require(self.m > 0 and math.isfinite(self.m), f"{prefix}.m must be a finite number > 0, got {self.m}")
        _require(math.isfinite(self.target_entropy), f"{prefix}.target_entropy must be finite, got {self.target_entropy}")
        _scope(f"{prefix}.selection_scope", self.selection_scope)
        _require(self.alpha >= 0, f"{prefix}.alpha must be >= 0, got {self.alpha}")
        _require(self.w_max >= 1, f"{prefix}.w_max must be >= 1, got {self.w_max}")
        _require(0 < self.m_min <= 1, f"{prefix}.m_min must be in (0, 1], got {self.m_min}")


@dataclass
class ClipCovConfig:
    """Clip-Cov (Cui et al.): zero the loss of a few random tokens with covariance in (lb, ub)."""

    ratio: float = 2e-4
    """r: pick max(1, floor(r*N)) tokens, N = valid tokens in the selection scope."""
    lb: float = 1.0
    """Lower (exclusive) bound of the token covariance for candidates."""
    ub: float = 5.0
    """Upper (exclusive) bound of the token covariance for candidates."""
    seed: int = 0
    """Seed of the random pick; with the step and the token key it fixes the choice reproducibly."""
    selection_scope: str = "global"
    """'global' (means and pick over the whole mini-batch, all ranks) or 'microbatch' (reference)."""

    def validate(self, prefix: str = "algorithm.clip_cov") -> None:
        _in_unit(f"{prefix}.ratio", self.ratio)
        _require(self.lb < self.ub, f"{prefix}.lb must be < {prefix}.ub, got lb={self.lb} ub={self.ub}")
        _require(self.seed >= 0, f"{prefix}.seed must be >= 0, got {self.seed}")
        _scope(f"{prefix}.selection_scope", self.selection_scope)


@dataclass
class KLCovConfig:
    """KL-Cov (Cui et al.): a |log rho| penalty on the k largest-covariance tokens, no clipping."""

    ratio: float = 2e-3
    """Fraction of valid tokens penalised: k = max(1, floor(N*ratio)); 2e-3 (7B), 2e-4 (32B)."""
    coef: float = 1.0
    """beta: weight of |log rho| on the selected tokens."""
    selection_scope: str = "global"
    """'global' (means and top-k over the whole mini-batch, all ranks) or 'microbatch' (reference)."""

    def validate(self, prefix: str = "algorithm.kl_cov") -> None:
        _in_unit(f"{prefix}.ratio", self.ratio)
        _require(self.coef >= 0, f"{prefix}.coef must be >= 0, got {self.coef}")
        _scope(f"{prefix}.selection_scope", self.selection_scope)


@dataclass
class GepoConfig:
    """GEPO group-entropy advantage shaping (a reconstruction; see algorithms/gepo.py)."""

    enable: bool = False
    """Apply the GEPO transform to the advantages after the old-log-prob pass."""
    lam_pos: float = 0.5
    """Shrink factor of A>0 in groups whose entropy is below tau_lo (A' = A*(1-lam_pos))."""
    lam_neg: float = 0.5
    """Shrink factor of A<0 in groups whose entropy is above tau_hi (A' = A*(1-lam_neg))."""
    kappa: float = 1.0
    """Threshold width in EMA standard deviations: tau = mu -/+ kappa*sigma (inf disables)."""
    ema_rate: float = 0.1
    """Weight of the newest step in the EMA of the group entropies (1 = last step only)."""
    warmup_steps: int = 1
    """Steps of history observed before any shaping (>= 1: the history must exist first)."""

    def validate(self, prefix: str = "algorithm.gepo") -> None:
        _in_unit(f"{prefix}.lam_pos", self.lam_pos)
        _in_unit(f"{prefix}.lam_neg", self.lam_neg)
        _require(self.kappa >= 0, f"{prefix}.kappa must be >= 0 (inf allowed), got {self.kappa}")
        _require(0 < self.ema_rate <= 1, f"{prefix}.ema_rate must be in (0, 1], got {self.ema_rate}")
        _require(self.warmup_steps >= 1, f"{prefix}.warmup_steps must be >= 1, got {self.warmup_steps}")


@dataclass
class AlgorithmConfig:
    """Advantage estimator, policy loss, aggregation, regularisers."""

    adv_estimator: str = "grpo"
    """Advantage registry name: 'grpo', 'dr_grpo', 'rloo'."""
    norm_adv_by_std: bool = True
    """GRPO only: divide by the group std (+1e-6); False gives Dr.GRPO's advantage."""
    policy_loss: str = "vanilla"
    """Policy-loss registry name: 'vanilla' (dual-clip surrogate: GRPO/DAPO/PPO), 'stare',
    'clip_cov', 'kl_cov'."""
    loss_agg_mode: str = "token-mean"
    """'token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum', 'seq-mean-token-sum-norm';
    denominators are global over the optimizer mini-batch (all micro-batches and ranks)."""
    seq_mean_norm_const: Optional[float] = None
    """Constant divisor of 'seq-mean-token-sum-norm' (Dr.GRPO), e.g. the max response length."""
    clip_ratio_low: float = 0.2
    """eps_low: rho is clipped below at 1 - eps_low."""
    clip_ratio_high: float = 0.28
    """eps_high: rho is clipped above at 1 + eps_high (equal to eps_low for plain GRPO/PPO)."""
    clip_ratio_c: Optional[float] = 3.0
    """Dual clip c (A<0 only: loss <= -A*c); None disables. STARE recipes use 10."""
    entropy_coeff: float = 0.0
    """Entropy bonus: loss -= entropy_coeff * agg(H)."""
    kl_loss_coef: float = 0.0
    """KL-to-reference loss weight; 0 disables (no reference log-probs needed)."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator: 'k1'/'kl', 'k2'/'mse', 'k3'/'low_var_kl', 'abs'; suffix '+' = value of that
    estimator with the gradient of k2 (straight-through)."""
    tis_cap: Optional[float] = None
    """Truncated importance sampling against the rollout engine: each token's loss is weighted by
    min(pi_old / pi_engine, tis_cap) (needs engine log-probs); null disables."""
    stare: StareConfig = field(default_factory=StareConfig)
    clip_cov: ClipCovConfig = field(default_factory=ClipCovConfig)
    kl_cov: KLCovConfig = field(default_factory=KLCovConfig)
    gepo: GepoConfig = field(default_factory=GepoConfig)

    def validate(self, prefix: str = "algorithm") -> None:
        # Imported here: the registries import this module for the config types.
        from megatron_stare.algorithms.advantages import ADVANTAGE_ESTIMATORS
        from megatron_stare.algorithms.aggregation import AGG_MODES
        from megatron_stare.algorithms.kl import resolve_kl_type
        from megatron_stare.algorithms.losses import POLICY_LOSSES

        names = sorted(ADVANTAGE_ESTIMATORS)
        _require(self.adv_estimator in ADVANTAGE_ESTIMATORS,
                 f"{prefix}.adv_estimator must be one of {names}, got {self.adv_estimator!r}")
        names = sorted(POLICY_LOSSES)
        _require(self.policy_loss in POLICY_LOSSES,
                 f"{prefix}.policy_loss must be one of {names}, got {self.policy_loss!r}")
        _require(self.loss_agg_mode in AGG_MODES,
                 f"{prefix}.loss_agg_mode must be one of {sorted(AGG_MODES)}, got {self.loss_agg_mode!r}")
        if self.loss_agg_mode == "seq-mean-token-sum-norm":
            c = self.seq_mean_norm_const
            _require(c is not None and c > 0,
                     f"{prefix}.seq_mean_norm_const must be > 0 with loss_agg_mode "
                     f"'seq-mean-token-sum-norm' (e.g. the max response length), got {c}")
        _require(0 <= self.clip_ratio_low < 1, f"{prefix}.clip_ratio_low must be in [0, 1), got {self.clip_ratio_low}")
        _require(self.clip_ratio_high >= 0, f"{prefix}.clip_ratio_high must be >= 0, got {self.clip_ratio_high}")
        if self.clip_ratio_c is not None:
            _require(self.clip_ratio_c > 1, f"{prefix}.clip_ratio_c must be > 1 (or null to disable), got {self.clip_ratio_c}")
        _require(self.entropy_coeff >= 0, f"{prefix}.entropy_coeff must be >= 0, got {self.entropy_coeff}")
        _require(self.kl_loss_coef >= 0, f"{prefix}.kl_loss_coef must be >= 0, got {self.kl_loss_coef}")
        try:
            resolve_kl_type(self.kl_loss_type)
        except ValueError as e:
            raise ValueError(f"{prefix}.kl_loss_type: {e}") from None
        if self.tis_cap is not None:
            _require(self.tis_cap >= 1, f"{prefix}.tis_cap must be >= 1 (or null to disable), got {self.tis_cap}")
        self.stare.validate(f"{prefix}.stare")
        self.clip_cov.validate(f"{prefix}.clip_cov")
        self.kl_cov.validate(f"{prefix}.kl_cov")
        self.gepo.validate(f"{prefix}.gepo")
