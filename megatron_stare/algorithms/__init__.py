"""Advantages, policy losses (GRPO/DAPO, STARE, Clip-Cov, KL-Cov), GEPO, global aggregation.

Per step: ``compute_advantages`` -> (optional) ``GepoShaper`` -> ``StareController.update(H)`` ->
per mini-batch ``loss_fn.plan(...)`` once -> per micro-batch ``loss_fn(inp, plan)``.

The names below are loaded on first access (PEP 562): a module that needs one part of the package
(the reward pool's overlong penalty, the config checks' registries) must not load every loss.
The config sections are ``megatron_stare.config.algorithm``'s (light, no torch).
"""

from megatron_stare.config import algorithm as config

_EXPORTS = {
    "advantages": ("ADVANTAGE_ESTIMATORS", "compute_advantages", "register_advantage"),
    "aggregation": ("AGG_MODES", "LossDenominators", "MetricSums", "aggregate", "backward_scale",
                    "compute_loss_denominators", "global_token_mean", "sequence_token_counts"),
    "config": ("AlgorithmConfig", "CispoConfig", "ClipCovConfig", "ForkingTokensConfig", "GepoConfig", "GspoConfig",
               "KLCovConfig", "OffPolicyConfig", "StareConfig"),
    "gepo": ("GepoShaper", "group_token_mean"),
    "losses": ("POLICY_LOSSES", "LossOutput", "LossPlan", "MiniBatchInput", "PolicyLoss", "PolicyLossInput",
               "build_policy_loss", "register_policy_loss"),
    "stare": ("StareController", "StareState", "stare_k"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from megatron_stare.algorithms import advantages, aggregation, gepo, losses, stare

    modules = {"advantages": advantages, "aggregation": aggregation, "config": config, "gepo": gepo,
               "losses": losses, "stare": stare}
    return getattr(modules[_MODULE_OF[name]], name)
