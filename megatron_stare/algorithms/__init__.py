"""Advantages, policy losses (GRPO/DAPO, STARE, Clip-Cov, KL-Cov), GEPO, global aggregation.

Per step: ``compute_advantages`` -> (optional) ``GepoShaper`` -> ``StareController.update(H)`` ->
per mini-batch ``loss_fn.plan(...)`` once -> per micro-batch ``loss_fn(inp, plan)``.
"""

from megatron_stare.algorithms.advantages import ADVANTAGE_ESTIMATORS, compute_advantages, register_advantage
from megatron_stare.algorithms.aggregation import (
    AGG_MODES,
    LossDenominators,
    MetricSums,
    aggregate,
    backward_scale,
    compute_loss_denominators,
    global_token_mean,
    sequence_token_counts,
)
from megatron_stare.algorithms.config import AlgorithmConfig, ClipCovConfig, GepoConfig, KLCovConfig, StareConfig
from megatron_stare.algorithms.gepo import GepoShaper, group_token_mean
from megatron_stare.algorithms.losses import (
    POLICY_LOSSES,
    LossOutput,
    LossPlan,
    MiniBatchInput,
    PolicyLoss,
    PolicyLossInput,
    build_policy_loss,
    register_policy_loss,
)
from megatron_stare.algorithms.stare import StareController, StareState, stare_k

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGG_MODES", "POLICY_LOSSES", "AlgorithmConfig", "ClipCovConfig", "GepoConfig",
    "GepoShaper", "KLCovConfig", "LossDenominators", "LossOutput", "LossPlan", "MetricSums", "MiniBatchInput",
    "PolicyLoss", "PolicyLossInput", "StareConfig", "StareController", "StareState", "aggregate",
    "backward_scale", "build_policy_loss", "compute_advantages", "compute_loss_denominators",
    "global_token_mean", "group_token_mean", "register_advantage", "register_policy_loss", "sequence_token_counts", "stare_k",
]
