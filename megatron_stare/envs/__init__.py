"""Environments of multi-turn rollouts (``base.py``) and the built-in calculator tool task."""

from megatron_stare.envs.base import ENVIRONMENTS, EnvError, EnvStep, Environment, register_env
from megatron_stare.envs.calculator import CalculatorEnv, ToolFailure, safe_eval
from megatron_stare.envs.lookup import get_env_class, make_env

__all__ = ["ENVIRONMENTS", "CalculatorEnv", "EnvError", "EnvStep", "Environment", "ToolFailure", "get_env_class",
           "make_env", "register_env", "safe_eval"]
