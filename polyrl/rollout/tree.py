"""Rollout budget allocation for mixed-outcome groups (TRACE, arXiv:2606.11119) -- the allocation rule.

The paper's principle: spend rollouts on the anchors (prompts, or prefixes in a tree of turns) whose
continuations are most likely to contain both successes and failures, since only such groups give a
group-relative gradient. The exact objective was not readable; this module is OUR operationalisation
of that principle (shared/spec/methods-seedblog.md section 3, marked [ours] there):

    P_mix(p, n) = 1 - p^n - (1 - p)^n  for n >= 2, else 0   (chance a group of n has mixed outcomes)
    n* = argmax sum_m P_mix(p_m, n_m)  s.t.  sum_m n_m <= B,  n_m in {0} U [n_min, n_max]

The objective is separable over anchors, so a dynamic programme over (anchor, budget used) solves it
exactly. Anchors predicted to always succeed or always fail (p in {0, 1}) get nothing: "stop expanding
branches that clearly succeed or fail". Tree rollouts, the success predictor and tree advantages
(issue 5) build on this.
"""

from __future__ import annotations

import torch
from torch import Tensor


def p_mixed(p: Tensor, n: Tensor) -> Tensor:
    """Probability that n Bernoulli(p) rollouts contain both a success and a failure (0 for n < 2)."""
    p = p.to(torch.float64)
    n = torch.as_tensor(n, dtype=torch.float64)
    value = 1.0 - p.pow(n) - (1.0 - p).pow(n)
    return torch.where(n >= 2, value, torch.zeros_like(value))


def allocate_rollouts(p_hat: Tensor, budget: int, *, n_min: int = 2, n_max: int | None = None) -> Tensor:
    """Exact allocation [M] maximising the expected number of mixed-outcome groups under a rollout budget.

    ``p_hat`` [M]: predicted success probability per anchor; ``budget``: total rollouts B; each anchor
    gets 0 or between ``n_min`` and ``n_max`` (default: B) rollouts. Ties go to the smaller total, then
    to earlier anchors, so the result is deterministic.
    """
    if budget < 0:
        raise ValueError(f"budget = {budget} must be >= 0")
    if n_min < 1:
        raise ValueError(f"n_min = {n_min} must be >= 1")
    n_max = budget if n_max is None else n_max
    if n_max < n_min:
        raise ValueError(f"n_max = {n_max} must be >= n_min = {n_min}")
    p = p_hat.detach().to(torch.float64).cpu()
    if ((p < 0) | (p > 1)).any():
        raise ValueError("p_hat must lie in [0, 1]")
    M = p.numel()
    choices = [0, *range(n_min, min(n_max, budget) + 1)]
    gain = [[float(p_mixed(p[m], torch.tensor(n))) for n in choices] for m in range(M)]
    # best[m][b]: best value of anchors m.. with b rollouts left; take[m][b]: the choice index achieving it
    best = [[0.0] * (budget + 1) for _ in range(M + 1)]
    take = [[0] * (budget + 1) for _ in range(M)]
    for m in range(M - 1, -1, -1):
        for b in range(budget + 1):
            top, arg = -1.0, 0
            for k, n in enumerate(choices):
                if n > b:
                    break
                value = gain[m][k] + best[m + 1][b - n]
                if value > top + 1e-12:  # strict improvement only: prefer fewer rollouts on ties
                    top, arg = value, k
            best[m][b], take[m][b] = top, arg
    out, left = [], budget
    for m in range(M):
        n = choices[take[m][left]]
        out.append(n)
        left -= n
    return torch.tensor(out, dtype=torch.long)
