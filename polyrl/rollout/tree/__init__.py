"""TRACE-style tree rollouts (arXiv:2606.11119): spend each step's rollout budget on the prompts and prefixes whose
groups are likely to have mixed outcomes. The allocation rule is ours, not the paper's (shared/spec/methods-seedblog.md
section 3, marked [ours] there): ``allocation`` holds its maths, ``predictors`` the success predictors it feeds on,
``sampler`` the two-stage ``TreeSampler``, ``source`` the rollout source around it. Tree advantages are in
``polyrl.objectives.group_layout``.
"""

from polyrl.rollout.tree.allocation import (
    allocate_by_gain,
    allocate_rollouts,
    expected_useful,
    inclusion_probabilities,
    p_mixed,
    systematic_sample,
)
from polyrl.rollout.tree.predictors import SuccessPredictor, prefix_estimate
from polyrl.rollout.tree.sampler import TreeSampler, branch_points
from polyrl.rollout.tree.source import TreeSource

__all__ = [
    "SuccessPredictor",
    "TreeSampler",
    "TreeSource",
    "allocate_by_gain",
    "allocate_rollouts",
    "branch_points",
    "expected_useful",
    "inclusion_probabilities",
    "p_mixed",
    "prefix_estimate",
    "systematic_sample",
]
