"""The composable maths: pure torch functions registered by kind, plus their composition.

Importing this package registers every built-in part.
"""

from polyrl.objectives import (  # noqa: F401  (imported for registration)
    advantages,
    aggregation,
    baselines,
    corrections,
    covariance,
    distillation,
    divergence,
    geometric,
    kl,
    preference,
    projection,
    ratios,
    token_advantages,
    token_baseline,
    trust_regions,
)
from polyrl.objectives.kl import kl_reward_penalty
from polyrl.objectives.objective import Method, build_method, override, policy_loss

__all__ = ["Method", "build_method", "override", "policy_loss", "kl_reward_penalty"]
