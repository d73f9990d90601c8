"""What every rollout source means by a reward, a success and a mixed group: defined once, used by all of them.

A completion's *score* is its training reward from the reward channels (``tasks.rewards.RewardChannels``);
the method's shapers turn scores into the *rewards* the advantage estimator sees (``shape``). A completion
*succeeds* when its score exceeds 1/2 (the tasks' verifiers score 0 or 1; held-out accuracy counts the
same way). A group is *mixed* when its scores differ (by more than 1e-6): only a mixed group gives a
group-relative estimator a gradient, so utilization counts the completions in mixed groups.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from polyrl.objectives import Method
from polyrl.registry import SHAPERS

SUCCESS = 0.5  # a score above this is a success
MIXED_TOL = 1e-6  # scores further apart than this differ


def shape(method: Method, scores: Tensor, lengths: Tensor, truncated: Tensor, max_new_tokens: int) -> Tensor:
    """Rewards [B]: the method's shapers applied in order to the scores [B] (a copy; scores stay raw)."""
    rewards = scores.clone()
    for shaper in method.shapers:
        rewards = SHAPERS.fn(shaper.name)(rewards, lengths, truncated, max_new_tokens, **shaper.params)
    return rewards


def succeeded(score: float) -> bool:
    """Whether one completion's score counts as a success."""
    return score > SUCCESS


def mixed(scores: Sequence[float]) -> bool:
    """Whether a group of scores has both better and worse completions (a group-relative signal)."""
    return len(scores) >= 2 and max(scores) - min(scores) > MIXED_TOL


def mixed_groups(scores: Tensor, group_size: int) -> Tensor:
    """[groups] bool: which consecutive groups of ``group_size`` scores are mixed."""
    g = scores.view(-1, group_size)
    return (g.max(dim=1).values - g.min(dim=1).values) > MIXED_TOL
