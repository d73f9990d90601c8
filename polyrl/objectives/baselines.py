"""Advantage estimators built around a baseline other than the plain group mean: ReMax, OPO, GPG, Pass@k.

Same signature and conventions as ``advantages.py`` (detached inputs, ``token_rewards`` summed over the loss
tokens into the sequence reward, a group of one gives 0 for every group estimator). ``remax`` takes one more
input, ``greedy_rewards`` [B]: the reward of the greedy completion of each sample's prompt, which the uniform
sampler decodes and scores when the estimator is tagged ``needs_greedy`` (``rollout.collect``) and
``group_layout.advantages`` hands over.

verl's optimal token baseline (B_t = sum_i G_t W_t / sum_i W_t, W_t = sum_{j<=t} (1 - 2 pi_j + sum_v pi_v^2))
is in ``token_baseline.py``: it takes the sampler's per-token probabilities. Not here: RAE and hierarchical GRPO
have no definition in the sources read (verl, TRL, their papers' summaries).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from polyrl.objectives.advantages import _div, _group_stats, _seq_rewards
from polyrl.registry import ADVANTAGES

SUCCESS = 0.5  # a reward above this counts as a positive response (polyrl.rollout.score.SUCCESS)


@ADVANTAGES.register("remax", paper="arXiv:2310.10505", tags=("needs_greedy",))
def remax(
    rewards: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
    greedy_rewards: Tensor | None = None,
) -> Tensor:
    """Greedy-decode baseline (ReMax, arXiv:2310.10505): A_i = r_i - r(x_i, y_greedy(x_i)). Returns [B].

    ``greedy_rewards`` [B]: the (shaped) reward of the greedy completion of sample i's prompt, decoded at the
    rollout weights; not a group estimator (one sample per prompt is the paper's setting), so a group of one
    keeps r - r_greedy. Without ``greedy_rewards`` (a direct call) the baseline is 0; training always passes it.
    Convention: sequence level, a KL penalty in ``token_rewards`` summed into r_i (not into the greedy reward,
    whose log-probs are never scored); verl gives each token its return-to-go minus the greedy reward, which is
    the same for an outcome-only reward.
    """
    r = _seq_rewards(rewards, mask, token_rewards)
    if greedy_rewards is None:
        return r
    return r - greedy_rewards.detach().to(r.dtype).reshape(r.shape)


@ADVANTAGES.register("opo", paper="arXiv:2505.23585", tags=("needs_groups",))
def opo(
    rewards: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
) -> Tensor:
    """Length-weighted group baseline (OPO, arXiv:2505.23585): A_i = r_i - sum_j |y_j| r_j / sum_j |y_j|. [B].

    |y_j| = number of loss tokens of sample j; no std division. Convention: 0 for a group of one (verl
    gives A = r there) and baseline 0 for a group without loss tokens.
    """
    r = _seq_rewards(rewards, mask, token_rewards)
    lengths = (mask.detach() > 0).to(r.dtype).sum(-1)
    n, _, sq = _group_stats(r, group_ids)
    _, wmean, _ = _group_stats(torch.stack([lengths * r, lengths], -1), group_ids)  # group means of l*r and l
    baseline = torch.where(sq == 0, r, _div(wmean[:, 0], wmean[:, 1]))  # a group of equal rewards: A = 0 exactly
    return torch.where(n > 1, r - baseline, torch.zeros_like(r))


@ADVANTAGES.register("gpg", paper="arXiv:2504.02546", ranges={"eps": "[0, inf)"}, tags=("needs_groups",))
def gpg(
    rewards: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
    *,
    f_norm: Literal["one", "std"] = "one",
    alpha: Literal["valid", "one", "nonzero"] = "valid",
    eps: float = 1e-6,
) -> Tensor:
    """Group-centred, rescaled advantage (GPG, arXiv:2504.02546): A_i = alpha (r_i - mean_g r) / F_norm. [B].

    F_norm = 1 (the paper's choice) or the group's Bessel std + eps. alpha (Accurate Gradient Estimation):
    "valid" = B / (B - M), M = samples in groups whose rewards are all equal (groups of one included), the
    paper's; "one" = no rescaling; "nonzero" = B / #(samples with a nonzero reward), verl's
    compute_gpg_outcome_advantage. Convention: the paper's alpha and F_norm = 1 by default (verl counts nonzero
    rewards, which is B/(B-M) only when every all-equal group is all 0); 0 for zero-variance groups.
    """
    r = _seq_rewards(rewards, mask, token_rewards)
    n, mean, sq = _group_stats(r, group_ids)
    valid = (n > 1) & (sq > 0)
    adv = torch.where(valid, r - mean, torch.zeros_like(r))
    if f_norm == "std":
        adv = _div(adv, (sq / (n - 1.0).clamp_min(1.0)).sqrt() + eps)
    B = float(r.numel())
    if alpha == "valid":
        scale = B / max(float(valid.sum()), 1.0)
    elif alpha == "nonzero":
        scale = B / max(float((r != 0).sum()), 1.0)
    else:
        scale = 1.0
    return adv * scale


def _passk_group(pos: int, n: int, k: int) -> tuple[float, float]:
    """(R, q) of a group with ``pos`` positives of ``n``: R = P(a k-subset holds a positive) = mean pass@k reward;
    q = P(a k-subset holding a given negative is all negative) = C(n_neg-1, k-1) / C(n-1, k-1)."""
    n_neg = n - pos
    mean = 1.0 - math.comb(n_neg, k) / math.comb(n, k)
    neg_all = math.comb(n_neg - 1, k - 1) / math.comb(n - 1, k - 1) if n_neg >= 1 else 0.0
    return mean, neg_all


@ADVANTAGES.register("passk", paper="arXiv:2508.10751", ranges={"k": ">=1", "eps": "[0, inf)"},
                     tags=("needs_groups", "k_below_group", "pass_fail"))  # pass_fail: reads r > 0.5 as a pass
def passk(
    rewards: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
    *,
    k: int = 4,
    eps: float = 1e-6,
) -> Tensor:
    """Analytical Pass@k advantages (arXiv:2508.10751): A_pos = (1-R)/s, A_neg = (1-R-C(n_neg-1,k-1)/C(n-1,k-1))/s.

    Returns [B]. R = 1 - C(n_neg, k)/C(n, k) is the mean pass@k reward over the group's k-subsets,
    s = sqrt(R (1 - R)) + eps their (population) std; a response's advantage is the mean z-score of the
    k-subsets that contain it. With k = 1 this is grpo with std="population" (same eps). Positive = reward > 0.5
    [assumed for non-binary rewards; the paper's are 0/1]. verl has no analytical pass@k (its grpo_passk is
    arXiv:2503.19595's max minus second max).
    Convention: a group smaller than k uses k = its size [assumed] (training refuses k >= group_size, tag
    k_below_group); 0 for a group of one and when s = 0.
    """
    r = _seq_rewards(rewards, mask, token_rewards)
    good = r > SUCCESS
    _, inv = torch.unique(group_ids.detach(), return_inverse=True)
    inv = inv.reshape(-1)
    adv = torch.zeros_like(r)
    for g in range(int(inv.max()) + 1 if inv.numel() else 0):
        rows = inv == g
        n, pos = int(rows.sum()), int((good & rows).sum())
        if n < 2:
            continue
        mean, neg_all = _passk_group(pos, n, min(k, n))
        sigma = math.sqrt(max(mean * (1.0 - mean), 0.0))
        if sigma == 0.0:
            continue
        a_pos, a_neg = (1.0 - mean) / (sigma + eps), (1.0 - mean - neg_all) / (sigma + eps)
        adv[rows] = torch.where(good[rows], torch.full_like(r[rows], a_pos), torch.full_like(r[rows], a_neg))
    return adv
