"""Typed settings for advantages, policy losses and entropy control (`algorithm.*` in YAML).

Plain dataclasses with typed fields and defaults so the generic YAML loader can compose them.
Every numeric field declares its range (``num(..., ge=...)``, stated in its docstring too);
``validate(prefix)`` checks the ranges (``config_fields.check_fields``) and the consistency of
the section's fields, raising one ``ConfigError`` line naming the field and the fix. The
registered names (``adv_estimator``, ``policy_loss``, ``loss_agg_mode``, ``kl_loss_type``) are
checked by the registries that own them (``losses.check_loss_names``, ``compute_advantages``)
and by ``config_checks.check_config``: this module sits below the registries and imports none.
Defaults follow docs/algorithms.md (DAPO clip 0.2/0.28, dual clip 3.0, STARE P=0.1 W=1.1 M=0.9).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_stare.config.fields import ConfigError, check_fields, num

SELECTION_SCOPES = ("global", "microbatch")
SEED_MAX = 2**32 - 1


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def _scope(name: str, value: str) -> None:
    _require(value in SELECTION_SCOPES, f"{name} must be one of {SELECTION_SCOPES}, got {value!r}")


@dataclass
class StareConfig:
    """STARE token reweighting; active when ``algorithm.policy_loss == 'stare'``."""

    variant: str = "O1"
    """'O1': amplify the top-P surprisal tokens of A>0 by w; 'C2': also attenuate those of A<0 by m."""
    top_p: float = num(0.1, gt=0, le=1, why="P is the fraction of T+ (T-) reweighted; 0 selects nothing")
    """P, in (0, 1]: fraction of the candidate set T+ (T-) reweighted; k(n) = min(n, max(1, ceil(n*P)))."""
    w: float = num(1.1, ge=1, why="W amplifies the selected A>0 tokens; below 1 it would attenuate them")
    """W, >= 1: weight of the selected positive-advantage tokens (initial value when adaptive)."""
    m: float = num(0.9, gt=0, le=1, why="M attenuates the selected A<0 tokens; above 1 it would amplify "
                                        "them, 0 would drop their gradient")
    """M, in (0, 1]: weight of the selected negative-advantage tokens, C2 only (initial value when adaptive)."""
    target_entropy: float = num(0.3, ge=0, why="entropy is >= 0; 0 keeps the gate off")
    """H_tgt, >= 0: the gate is on iff the step's global token-mean entropy is strictly below this."""
    selection_scope: str = "global"
    """'global': exact top-k over the whole mini-batch on all ranks (layout-independent);
    'microbatch': top-k inside each micro-batch on each rank (the public reference)."""
    adaptive: bool = False
    """Move W up and M down by alpha per step while entropy is below target (and back when above)."""
    alpha: float = num(0.01, ge=0, le=1, why="the W/M step per training step; M lives in (0, 1]")
    """Adaptive step size for W and M, in [0, 1] (> 0 when adaptive)."""
    w_max: float = num(1.5, ge=1, why="the upper clip of the adaptive W, whose lower clip is 1")
    """Upper clip of the adaptive W (lower clip is 1), >= 1 and >= w when adaptive."""
    m_min: float = num(0.5, gt=0, le=1, why="the lower clip of the adaptive M, whose upper clip is 1")
    """Lower clip of the adaptive M (upper clip is 1), in (0, 1] and <= m when adaptive."""

    def validate(self, prefix: str = "algorithm.stare") -> None:
        check_fields(self, prefix)
        _require(self.variant in ("O1", "C2"), f"{prefix}.variant must be 'O1' or 'C2', got {self.variant!r}")
        _scope(f"{prefix}.selection_scope", self.selection_scope)
        if self.adaptive:
            # The controller clips W to [1, w_max] and M to [m_min, 1]: a start outside would be
            # snapped back silently at the first step.
            _require(self.w <= self.w_max, f"{prefix}.w={self.w} is above {prefix}.w_max={self.w_max}; "
                                           f"the adaptive W lives in [1, w_max]: raise w_max or lower w")
            _require(self.m >= self.m_min, f"{prefix}.m={self.m} is below {prefix}.m_min={self.m_min}; "
                                           f"the adaptive M lives in [m_min, 1]: lower m_min or raise m")
            _require(self.alpha > 0, f"{prefix}.alpha must be > 0 with {prefix}.adaptive=true (0 never "
                                     f"moves W/M); set alpha > 0 or adaptive=false")


@dataclass
class ClipCovConfig:
    """Clip-Cov (Cui et al.): zero the loss of a few random tokens with covariance in (lb, ub)."""

    ratio: float = num(2e-4, gt=0, le=1)
    """r, in (0, 1]: pick max(1, floor(r*N)) tokens, N = valid tokens in the selection scope."""
    lb: float = num(1.0, inf_ok=True)
    """Lower (exclusive) bound of the token covariance for candidates: a number (-inf = none), < ub."""
    ub: float = num(5.0, inf_ok=True)
    """Upper (exclusive) bound of the token covariance for candidates: a number (inf = none), > lb."""
    seed: int = num(0, ge=0, le=SEED_MAX)
    """Seed of the random pick, in [0, 4294967295]; with the step and the token key it fixes the choice."""
    selection_scope: str = "global"
    """'global' (means and pick over the whole mini-batch, all ranks) or 'microbatch' (reference)."""

    def validate(self, prefix: str = "algorithm.clip_cov") -> None:
        check_fields(self, prefix)
        _require(self.lb < self.ub, f"{prefix}.lb must be < {prefix}.ub, got lb={self.lb} ub={self.ub}")
        _scope(f"{prefix}.selection_scope", self.selection_scope)


@dataclass
class KLCovConfig:
    """KL-Cov (Cui et al.): a |log rho| penalty on the k largest-covariance tokens, no clipping."""

    ratio: float = num(2e-3, gt=0, le=1)
    """Fraction of valid tokens penalised, in (0, 1]: k = max(1, floor(N*ratio)); 2e-3 (7B), 2e-4 (32B)."""
    coef: float = num(1.0, ge=0)
    """beta, >= 0: weight of |log rho| on the selected tokens."""
    selection_scope: str = "global"
    """'global' (means and top-k over the whole mini-batch, all ranks) or 'microbatch' (reference)."""

    def validate(self, prefix: str = "algorithm.kl_cov") -> None:
        check_fields(self, prefix)
        _scope(f"{prefix}.selection_scope", self.selection_scope)


@dataclass
class GepoConfig:
    """GEPO group-entropy advantage shaping (a reconstruction; see algorithms/gepo.py)."""

    enable: bool = False
    """Apply the GEPO transform to the advantages after the old-log-prob pass."""
    lam_pos: float = num(0.5, ge=0, le=1, why="A' = A*(1-lam) keeps the sign only for lam <= 1")
    """Shrink factor of A>0, in [0, 1], in groups whose entropy is below tau_lo (A' = A*(1-lam_pos))."""
    lam_neg: float = num(0.5, ge=0, le=1, why="A' = A*(1-lam) keeps the sign only for lam <= 1")
    """Shrink factor of A<0, in [0, 1], in groups whose entropy is above tau_hi (A' = A*(1-lam_neg))."""
    kappa: float = num(1.0, ge=0, inf_ok=True)
    """Threshold width in EMA standard deviations, >= 0: tau = mu -/+ kappa*sigma (inf disables)."""
    ema_rate: float = num(0.1, gt=0, le=1)
    """Weight of the newest step in the EMA of the group entropies, in (0, 1] (1 = last step only)."""
    warmup_steps: int = num(1, ge=1, why="the entropy history must exist before any shaping")
    """Steps of history observed before any shaping, >= 1."""

    def validate(self, prefix: str = "algorithm.gepo") -> None:
        check_fields(self, prefix)


@dataclass
class GspoConfig:
    """GSPO (Zheng et al.): one importance ratio per response, its geometric mean, clipped per response."""

    clip_ratio_low: float = num(3e-4, ge=0, lt=1, why="s is clipped below at 1 - eps_low, which must stay > 0")
    """eps_low, in [0, 1): the sequence ratio s is clipped below at 1 - eps_low (paper: 3e-4)."""
    clip_ratio_high: float = num(4e-4, ge=0)
    """eps_high, >= 0: s is clipped above at 1 + eps_high (paper: 4e-4; s is a geometric mean, so tiny)."""

    def validate(self, prefix: str = "algorithm.gspo") -> None:
        check_fields(self, prefix)


@dataclass
class CispoConfig:
    """CISPO (MiniMax-M1): every token keeps its gradient, its IS weight is clipped and detached."""

    clip_ratio_high: float = num(0.28, ge=0)
    """eps_high, >= 0: the detached weight is min(r, 1 + eps_high)."""
    clip_ratio_low: Optional[float] = num(None, ge=0, lt=1, why="the weight is clipped below at 1 - eps_low, "
                                                                "which must stay > 0")
    """Optional eps_low, in [0, 1): also clip the weight below at 1 - eps_low; null = no lower clip (the paper)."""

    def validate(self, prefix: str = "algorithm.cispo") -> None:
        check_fields(self, prefix)


FORKING_NORMALIZERS = ("all", "selected")


@dataclass
class ForkingTokensConfig:
    """Training on the high-entropy minority ("forking") tokens only (Wang et al., the 80/20 rule)."""

    rho: float = num(0.2, gt=0, le=1, why="the kept fraction of the batch's tokens; 0 keeps none")
    """rho, in (0, 1]: keep the k = min(N, max(1, ceil(rho*N))) highest-entropy tokens of the whole
    mini-batch (exact global quantile, ties: smaller token key); rho = 1 is the base loss."""
    normalizer: str = "all"
    """'all' (default): the kept tokens' losses are divided by the mini-batch's valid-token count, as
    in the base loss, so a kept token's gradient is the one it has in the base loss (the paper's form;
    the learning rate transfers); 'selected': divided by the kept count instead (the policy-gradient
    term scaled by N/k, a token mean over the kept tokens)."""

    def validate(self, prefix: str = "algorithm.forking_tokens") -> None:
        check_fields(self, prefix)
        _require(self.normalizer in FORKING_NORMALIZERS,
                 f"{prefix}.normalizer must be one of {FORKING_NORMALIZERS}, got {self.normalizer!r}")


#: Off-policy rules on the train/behaviour ratio k = exp(old_logp - engine_logp): weights, masks.
OFF_POLICY_WEIGHTS = ("tis", "mis_token", "mis_sequence")
OFF_POLICY_MASKS = ("band_mask", "geo_mask")


def parse_off_policy(value: Optional[str], prefix: str = "algorithm.off_policy_correction") -> tuple:
    """The rules of ``value``: () for 'none'/null, else one or two names joined by '+' (at most one
    weight and one mask, e.g. 'tis+band_mask'); ``ConfigError`` naming the field otherwise."""
    if value is None or value == "none":
        return ()
    rules = tuple(value.split("+"))
    known = OFF_POLICY_WEIGHTS + OFF_POLICY_MASKS
    bad = [r for r in rules if r not in known]
    _require(not bad, f"{prefix} must be 'none' or one of {known} (a weight and a mask may be joined by "
                      f"'+', e.g. 'tis+band_mask'), got {value!r}")
    _require(sum(r in OFF_POLICY_WEIGHTS for r in rules) <= 1 and sum(r in OFF_POLICY_MASKS for r in rules) <= 1,
             f"{prefix}={value!r} joins two weights or two masks; use at most one of {OFF_POLICY_WEIGHTS} "
             f"and one of {OFF_POLICY_MASKS}")
    return rules


@dataclass
class OffPolicyConfig:
    """Bounds of the off-policy corrections (``algorithm.off_policy_correction``; algorithms/off_policy.py)."""

    tis_cap: float = num(2.0, ge=1, why="a cap below 1 would down-weight on-policy tokens too")
    """C of 'tis', >= 1: each token's loss is weighted by min(k, C)."""
    mis_cap: float = num(2.0, ge=1, why="a cap below 1 would mask on-policy tokens too")
    """C of 'mis_token' / 'mis_sequence', >= 1: weight k (token) or the response's product of k
    (sequence) where it is <= C, 0 above."""
    band_low: float = num(0.5, gt=0, le=1)
    """a of 'band_mask', in (0, 1]: tokens with k < a are masked."""
    band_high: float = num(2.0, ge=1, inf_ok=True)
    """b of 'band_mask', >= 1 (inf disables): tokens with k > b are masked."""
    geo_cap: float = num(1.001, ge=1, why="the kept band [1/C, C] must hold k = 1")
    """C of 'geo_mask', >= 1: responses whose geometric-mean ratio exp(mean_t log k) leaves [1/C, C]
    are masked (verl's geometric rejection uses bounds this close to 1)."""

    def validate(self, prefix: str = "algorithm.off_policy") -> None:
        check_fields(self, prefix)


@dataclass
class AlgorithmConfig:
    """Advantage estimator, policy loss, aggregation, regularisers."""

    adv_estimator: str = "grpo"
    """Advantage registry name: 'grpo', 'dr_grpo', 'rloo'."""
    norm_adv_by_std: bool = True
    """GRPO only: divide by the group std (+1e-6); False gives Dr.GRPO's advantage."""
    policy_loss: str = "vanilla"
    """Policy-loss registry name: 'vanilla' (dual-clip surrogate: GRPO/DAPO/PPO), 'stare',
    'clip_cov', 'kl_cov', 'gspo', 'cispo', 'forking_tokens'."""
    loss_agg_mode: str = "token-mean"
    """'token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum', 'seq-mean-token-sum-norm';
    denominators are global over the optimizer mini-batch (all micro-batches and ranks)."""
    seq_mean_norm_const: Optional[float] = num(None, gt=0)
    """Constant divisor of 'seq-mean-token-sum-norm' (Dr.GRPO), > 0, e.g. the max response length."""
    clip_ratio_low: float = num(0.2, ge=0, lt=1, why="rho is clipped below at 1 - eps_low, which must stay > 0")
    """eps_low, in [0, 1): rho is clipped below at 1 - eps_low."""
    clip_ratio_high: float = num(0.28, ge=0)
    """eps_high, >= 0: rho is clipped above at 1 + eps_high (equal to eps_low for plain GRPO/PPO)."""
    clip_ratio_c: Optional[float] = num(3.0, gt=1, why="the dual clip caps an A<0 token's loss at -A*c; "
                                                       "c <= 1 would cut into the plain surrogate")
    """Dual clip c, > 1 (A<0 only: loss <= -A*c); None disables. STARE recipes use 10."""
    entropy_coeff: float = num(0.0, ge=0, why="a bonus: a negative coefficient would penalise entropy")
    """Entropy bonus, >= 0: loss -= entropy_coeff * agg(H)."""
    kl_loss_coef: float = num(0.0, ge=0)
    """KL-to-reference loss weight, >= 0; 0 disables (no reference log-probs needed)."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator: 'k1'/'kl', 'k2'/'mse', 'k3'/'low_var_kl', 'abs'; suffix '+' = value of that
    estimator with the gradient of k2 (straight-through)."""
    tis_cap: Optional[float] = num(None, ge=1, why="a cap below 1 would down-weight on-policy tokens too")
    """Deprecated: ``off_policy_correction: tis`` with ``off_policy.tis_cap``. Truncated importance
    sampling against the rollout engine, >= 1: each token's loss is weighted by
    min(pi_old / pi_engine, tis_cap) (needs engine log-probs); null disables."""
    off_policy_correction: Optional[str] = None
    """Correction for the train/behaviour mismatch k = exp(old_logp - engine_logp) (needs engine
    log-probs): 'none', 'tis', 'mis_token', 'mis_sequence', 'band_mask', 'geo_mask', or a weight and
    a mask joined by '+' ('tis+band_mask'); bounds in ``off_policy``. null = 'band_mask' with
    trainer.staleness > 0 (the asynchronous default), 'none' otherwise."""
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)
    stare: StareConfig = field(default_factory=StareConfig)
    clip_cov: ClipCovConfig = field(default_factory=ClipCovConfig)
    kl_cov: KLCovConfig = field(default_factory=KLCovConfig)
    gepo: GepoConfig = field(default_factory=GepoConfig)
    gspo: GspoConfig = field(default_factory=GspoConfig)
    cispo: CispoConfig = field(default_factory=CispoConfig)
    forking_tokens: ForkingTokensConfig = field(default_factory=ForkingTokensConfig)

    def validate(self, prefix: str = "algorithm") -> None:
        """Ranges of every field (sections included) and their consistency; not the registered
        names (see the module docstring)."""
        check_fields(self, prefix)
        if self.loss_agg_mode == "seq-mean-token-sum-norm":
            _require(self.seq_mean_norm_const is not None,
                     f"{prefix}.seq_mean_norm_const must be > 0 with loss_agg_mode "
                     f"'seq-mean-token-sum-norm' (e.g. the max response length), got None")
        self.stare.validate(f"{prefix}.stare")
        self.clip_cov.validate(f"{prefix}.clip_cov")
        self.kl_cov.validate(f"{prefix}.kl_cov")
        self.gepo.validate(f"{prefix}.gepo")
        self.gspo.validate(f"{prefix}.gspo")
        self.cispo.validate(f"{prefix}.cispo")
        self.forking_tokens.validate(f"{prefix}.forking_tokens")
        self.off_policy.validate(f"{prefix}.off_policy")
        parse_off_policy(self.off_policy_correction, f"{prefix}.off_policy_correction")
        _require(self.tis_cap is None or self.off_policy_correction is None,
                 f"{prefix}.tis_cap (deprecated) and {prefix}.off_policy_correction are both set; "
                 f"use off_policy_correction=tis with {prefix}.off_policy.tis_cap={self.tis_cap}")
