"""The tree sampler's settings: flags ``--tree-*``, the TOML table ``[tree]``, ``TrainConfig.tree``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal


@dataclass
class TreeConfig:
    """How ``--sampler tree`` spends each step's budget of prompts x group size completions."""

    PREFIX: ClassVar[str] = "tree"

    root_frac: float = 0.5
    """tree sampler: share of the rollout budget spent probing prompts (the rest extends them: roots or branches)"""
    candidates: float = 2.0
    """tree sampler: candidate prompts drawn per group slot (the allocation may skip some)"""
    prune: float = 0.05
    """tree sampler: prompts predicted to succeed with p < prune or p > 1 - prune get no probe, and prefixes so
    predicted no continuations (with tree_roots = 'sample' only prefixes are pruned: every prompt keeps a chance to be
    drawn); a prompt already probed is extended by expected gain alone, whatever its updated estimate"""
    half_life: float = 0.0
    """tree sampler: steps after which a prompt's pass-rate history counts half (0 = it never ages)"""
    max_group: int = 0
    """tree sampler: most rollouts in one prompt's root group in a step, its probe and the roots added to it (0 = 2 x
    group size); continuations below a prefix form sibling groups of their own, each at most the group size"""
    predictor: Literal["history", "shared", "likelihood"] = "history"
    """tree sampler: a prompt's success prior from the pool (history) or also from prompts like it (shared: a
    regression on the policy's features of the prompt, so unseen prompts are predicted too); likelihood: the policy's
    probability of the reference answer, which is the success rate itself on exact-answer tasks (addition)"""
    probe: Literal["groups", "rollouts"] = "rollouts"
    """tree sampler: what the probe allocation maximises: expected mixed groups (spreads probes of two over more
    prompts) or expected rollouts in mixed groups (fewer, fuller groups)"""
    roots: Literal["dp", "sample"] = "dp"
    """tree sampler: how prompts are chosen for probing: dp (the exact allocation, the most expected mixed groups)
    or sample (drawn in proportion to their chance of a mixed group, with importance weights on the loss, KL
    included, that keep its expectation that of prompts drawn uniformly)"""
    branch: bool = True
    """tree sampler: continue prefixes of the probes (turn boundaries, or half the completion) as sibling groups;
    --no-tree-branch spends the extension budget on the probed prompts' root groups only"""
