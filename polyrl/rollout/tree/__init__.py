"""TRACE-style tree rollouts (arXiv:2606.11119): spend each step's rollout budget on the prompts and prefixes whose
groups are likely to have mixed outcomes. The allocation rule is ours, not the paper's (shared/spec/methods-seedblog.md
section 3, marked [ours] there): ``allocation`` holds its maths, ``predictors`` the success predictors it feeds on,
``sampler`` the two-stage ``TreeSampler``, ``source`` the rollout source around it. Tree advantages are in
``polyrl.objectives.group_layout``.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "TreeConfig": "config",
    "SuccessPredictor": "predictors", "prefix_estimate": "predictors",
    "TreeSampler": "sampler", "branch_points": "sampler",
    "TreeSource": "source",
    **{name: "allocation" for name in ("allocate_by_gain", "allocate_rollouts", "expected_useful",
                                       "inclusion_probabilities", "p_mixed", "systematic_sample")},
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):  # imported on first use: ``tree.config`` stays free of torch
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
