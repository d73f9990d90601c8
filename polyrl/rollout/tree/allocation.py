"""Rollout budget allocation for mixed-outcome groups (TRACE, arXiv:2606.11119) -- the allocation rule.

The paper's principle: spend rollouts on the anchors (prompts, or prefixes in a tree of turns) whose
continuations are most likely to contain both successes and failures, since only such groups give a
group-relative gradient. The exact objective was not readable; this module is OUR operationalisation
of that principle (shared/spec/methods-seedblog.md section 3, marked [ours] there):

    P_mix(p, n) = 1 - p^n - (1 - p)^n  for n >= 2, else 0   (chance a group of n has mixed outcomes)
    n* = argmax sum_m P_mix(p_m, n_m)  s.t.  sum_m n_m <= B,  n_m in {0} U [n_min, n_max]

The objective is separable over anchors, so a dynamic programme over (anchor, budget used) solves it
exactly. Anchors predicted to always succeed or always fail (p in {0, 1}) get nothing: "stop expanding
branches that clearly succeed or fail".

Sampled roots (``roots="sample"``, also ours): stage 1 draws groups of G at random instead, prompt m with
inclusion probability pi_m proportional to max(P_mix(p_m, G), floor) (``inclusion_probabilities``, exact by
systematic sampling), and stage 2 extends only the drawn prompts. The loss of every sample of prompt m, KL
term included, then weighs N / (M pi_m n_m) (n_m: the prompt's samples in the batch, N all of them, M the
candidates; ``root_weights``, ``RolloutBatch.sample_weight``: mean 1 in expectation), so the expected loss is that of
prompts drawn uniformly: the importance correction of prioritized replay, unbiased. The DP's choice pulls
the policy toward the prompts it prefers and away from the ones it stops drawing (on a small pool it
forgets them); the weights undo that, and the preference only changes the variance.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

EXACT_STRENGTH = 1e4  # pseudo-trials of a predicted rate known exactly (the likelihood predictor): Beta ~ a point


def p_mixed(p: Tensor, n: Tensor, strength: Tensor | None = None) -> Tensor:
    """Probability that n Bernoulli(p) rollouts contain both a success and a failure (0 for n < 2).

    With ``strength`` s the success probability is itself uncertain, p ~ Beta(p s, (1 - p) s) (a posterior
    from s pseudo-trials), and the value is the Beta-binomial predictive 1 - E[p^n] - E[(1 - p)^n], with
    E[p^n] = prod_{j<n} (a + j) / (s + j). An anchor seen once at 1/2 is then worth less than one seen
    many times at 1/2: the allocation prefers prompts it knows to be uncertain over prompts it knows nothing of.
    """
    p = torch.as_tensor(p, dtype=torch.float64)
    n = torch.as_tensor(n, dtype=torch.float64)
    if strength is None:
        value = 1.0 - p.pow(n) - (1.0 - p).pow(n)
    else:
        e_p, e_q = _beta_moments(p, torch.as_tensor(strength, dtype=torch.float64), n)
        value = 1.0 - e_p - e_q
    return torch.where(n >= 2, value, torch.zeros_like(value))


def _beta_moments(p: Tensor, s: Tensor, n: Tensor) -> tuple[Tensor, Tensor]:
    """(E[q^n], E[(1 - q)^n]) for q ~ Beta(p s, (1 - p) s): prod_{j<n} (a + j) / (s + j), broadcast."""
    p, s, n = torch.broadcast_tensors(p, s, n)
    e_p, e_q = torch.ones_like(p), torch.ones_like(p)
    for j in range(int(n.max()) if n.numel() else 0):
        on = n > j
        e_p = torch.where(on, e_p * (p * s + j) / (s + j), e_p)
        e_q = torch.where(on, e_q * ((1 - p) * s + j) / (s + j), e_q)
    return e_p, e_q


def allocate_rollouts(p_hat: Tensor, budget: int, *, n_min: int = 2, n_max: int | None = None,
                      objective: str = "groups", strength: Tensor | None = None) -> Tensor:
    """Exact allocation [M] maximising the expected number of mixed-outcome groups under a rollout budget.

    ``p_hat`` [M]: predicted success probability per anchor; ``budget``: total rollouts B; each anchor
    gets 0 or between ``n_min`` and ``n_max`` (default: B) rollouts. Ties go to the smaller total, then
    to earlier anchors, so the result is deterministic. ``objective="groups"`` maximises
    sum_m P_mix(p_m, n_m) (the spec's form; it favours many groups of two); ``"rollouts"`` maximises the
    expected number of rollouts that sit in mixed groups, sum_m n_m P_mix(p_m, n_m) -- the rollout
    utilization the tree sampler reports, so it is the sampler's default. ``strength`` [M] (optional): the
    predictions are Beta posteriors with that many pseudo-trials (``p_mixed``).
    """
    if objective not in ("groups", "rollouts"):
        raise ValueError(f"objective = {objective!r} is not allowed; use 'groups' or 'rollouts'")
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
    if strength is not None and (strength.shape != p.shape or bool((strength <= 0).any())):
        raise ValueError(f"strength must be positive with the shape of p_hat {tuple(p.shape)}")
    choices = torch.arange(min(n_max, budget) + 1, dtype=torch.float64)
    weight = choices if objective == "rollouts" else torch.ones_like(choices)
    table = weight * p_mixed(p[:, None], choices[None, :], None if strength is None else
                             strength.to(torch.float64)[:, None])
    table[:, 1:n_min] = -math.inf  # 0 or between n_min and n_max
    return allocate_by_gain(table, budget)


def allocate_by_gain(gain: Tensor, budget: int) -> Tensor:
    """Exact allocation [M] maximising sum_m gain[m, n_m] subject to sum_m n_m <= budget (dynamic programme).

    ``gain`` [M, K + 1]: the value of giving anchor m exactly n = 0..K rollouts (-inf: not allowed; column 0
    must be 0). Ties go to the smaller total, then to earlier anchors, so the result is deterministic.
    """
    if budget < 0:
        raise ValueError(f"budget = {budget} must be >= 0")
    g = gain.detach().to(torch.float64).cpu()
    if g.dim() != 2 or bool((g[:, 0] != 0).any()):
        raise ValueError(f"gain must be [M, K + 1] with gain[:, 0] = 0, got shape {tuple(g.shape)}")
    M, K = g.shape[0], g.shape[1] - 1
    rows = [[(n, float(g[m, n])) for n in range(min(K, budget) + 1) if g[m, n] > -math.inf] for m in range(M)]
    # best[m][b]: best value of anchors m.. with b rollouts left; take[m][b]: the n achieving it
    best = [[0.0] * (budget + 1) for _ in range(M + 1)]
    take = [[0] * (budget + 1) for _ in range(M)]
    for m in range(M - 1, -1, -1):
        for b in range(budget + 1):
            top, arg = -math.inf, 0
            for n, value in rows[m]:
                if n > b:
                    break
                value = value + best[m + 1][b - n]
                if value > top + 1e-12:  # strict improvement only: prefer fewer rollouts on ties
                    top, arg = value, n
            best[m][b], take[m][b] = top, arg
    out, left = [], budget
    for m in range(M):
        out.append(take[m][left])
        left -= out[-1]
    return torch.tensor(out, dtype=torch.long)


def inclusion_probabilities(weights: Tensor, k: int) -> Tensor:
    """Inclusion probabilities [M] proportional to ``weights`` that sum to ``k``, none above 1.

    An item whose share would exceed 1 is included for sure and the rest share what is left (the
    standard capping of sampling proportional to size). Items of weight 0 are never included.
    """
    w = weights.detach().to(torch.float64).cpu().clamp_min(0)
    k = min(k, int((w > 0).sum()))
    pi, sure = torch.zeros_like(w), torch.zeros_like(w, dtype=torch.bool)
    while k > 0:
        free = ~sure & (w > 0)
        pi[free] = (k - int(sure.sum())) * w[free] / w[free].sum()
        over = free & (pi >= 1)
        if not over.any():
            break
        sure |= over
        pi[over] = 1.0
    return pi


def systematic_sample(pi: Tensor, u: float) -> list[int]:
    """Indices drawn by systematic sampling at offset ``u`` in [0, 1): item i is drawn with probability exactly pi_i.

    The points u, u + 1, ... fall on the cumulative sum of ``pi`` (which must sum to an integer k, each pi_i <= 1), so
    exactly k distinct items are drawn, in order, and averaging over u gives each one its pi_i.
    """
    if not 0 <= u < 1:
        raise ValueError(f"u = {u} must be in [0, 1)")
    edges = torch.cumsum(pi.detach().to(torch.float64).cpu(), 0)
    k = round(float(edges[-1])) if len(edges) else 0
    points = torch.arange(k, dtype=torch.float64) + u
    return torch.searchsorted(edges, points, right=True).clamp_max(len(edges) - 1).tolist() if k else []


def expected_useful(p: Tensor, strength: Tensor, n: Tensor, successes: Tensor, failures: Tensor,
                    idle: Tensor) -> Tensor:
    """Expected rollouts newly in a mixed group when ``n`` more join a group that already has some outcomes.

    A group holding ``successes`` and ``failures`` (counts) is mixed once it has one of each; the new
    rollouts succeed with p ~ Beta(p s, (1 - p) s). Value: P(mixed after n) (n + idle) - P(mixed now) idle,
    where ``idle`` counts the group's rollouts not yet useful. An already mixed group gains exactly n (every
    extra rollout is useful); an empty group gains n P_mix (``p_mixed``); a group of successes only gains
    (n + idle) (1 - E[p^n]). This is what lets a probe be extended once its outcome is known.
    """
    p, s, n = (torch.as_tensor(x, dtype=torch.float64) for x in (p, strength, n))
    has_s, has_f = torch.as_tensor(successes) > 0, torch.as_tensor(failures) > 0
    idle = torch.as_tensor(idle, dtype=torch.float64)
    p, s, n, has_s, has_f, idle = torch.broadcast_tensors(p, s, n, has_s, has_f, idle)
    e_p, e_q = _beta_moments(p, s, n)
    mixed_now = (has_s & has_f).to(torch.float64)
    mixed_after = torch.where(has_s & has_f, torch.ones_like(p), torch.where(
        has_s, 1 - e_p, torch.where(has_f, 1 - e_q, (1 - e_p - e_q).clamp_min(0))))
    return mixed_after * (n + idle) - mixed_now * idle


def root_weights(owner: Tensor, pi: Tensor) -> Tensor:
    """Sample weights [N] of sampled roots: sample i of candidate m (``owner[i]``) weighs N / (M pi_m n_m), with M =
    len(``pi``) candidates, N samples and n_m of them m's. Then E[sum_i w_i loss_i] = (N / M) sum_m (m's mean loss),
    the loss of prompts drawn uniformly, and the weights average 1 in expectation. (Dividing by the batch's own mean
    weight instead depends on the draw: with one group drawn, every weight was 1 and nothing was corrected.)"""
    n_of = torch.bincount(owner, minlength=len(pi)).to(torch.float64)
    pi64 = pi.detach().to(torch.float64).cpu()
    return (owner.numel() / (len(pi) * pi64[owner] * n_of[owner])).to(torch.float32)
