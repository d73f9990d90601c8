"""verl's optimal token baseline (OTB, arXiv:2602.07078): a per-position group baseline weighted by realized energy.

For a prompt group, the baseline of position t is B*_t = sum_i G_t^(i) W_t^(i) / (sum_i W_t^(i) + eps) over the
group's samples alive at t, with G_t the reward-to-go and W_t = sum_{j<=t} (1 - 2 pi_j + sum_v pi_v(j)^2) the
cumulative "logit-gradient proxy" of the squared score norm (pi_j: probability of the sampled token, sum_v pi_v^2
over the vocabulary at step j). Two inputs beyond the usual ones: ``sum_pi_sq`` [B, T] and ``sampled_logp`` [B, T]
(log pi_j). In training both come from the sampler (``SamplingParams.sum_pi_sq``, recorded only for estimators
tagged ``needs_sum_pi_sq``): the distribution the token was drawn from, after temperature, top-k and top-p, the
same one its reported rollout log-prob is under. verl takes both from the actor's recomputation (``old_log_probs``
and ``sum_pi_squared`` of ``compute_log_prob`` with ``calculate_sum_pi_squared``, temperature-scaled logits, no
top-k/top-p); at the rollout weights with the hf sampler the two agree up to the filters.
"""

from __future__ import annotations

import torch
from torch import Tensor

from polyrl.objectives.advantages import _floats
from polyrl.registry import ADVANTAGES


def _returns_to_go(rewards: Tensor, mask: Tensor, token_rewards: Tensor | None) -> Tensor:
    """G_t [B, T]: the outcome reward (at the last loss token, so every earlier one) + future masked token rewards."""
    r = _floats(rewards)
    if r.dim() != 1:
        raise ValueError(f"rewards must be [B] for this estimator, got shape {tuple(r.shape)}")
    G = r[:, None].expand(mask.shape).clone()
    if token_rewards is not None:
        tr = _floats(token_rewards).to(r.dtype)
        tr = torch.where(mask > 0, tr, torch.zeros_like(tr))
        G = G + tr.flip(-1).cumsum(-1).flip(-1)
    return G


def _weights(mask: Tensor, sum_pi_sq: Tensor | None, sampled_logp: Tensor | None, dtype: torch.dtype) -> Tensor:
    """W_t [B, T] = cumsum over loss tokens of w_j = 1 - 2 pi_j + sum pi^2 (w_j = 1 without sampler statistics)."""
    live = mask > 0
    if sum_pi_sq is None or sampled_logp is None:
        w = torch.ones(mask.shape, dtype=dtype, device=mask.device)
    else:
        w = 1.0 - 2.0 * _floats(sampled_logp).to(dtype).exp() + _floats(sum_pi_sq).to(dtype)
    return torch.where(live, w, torch.zeros_like(w)).cumsum(-1)


def _baseline(G: Tensor, W: Tensor, mask: Tensor, group_ids: Tensor, eps: float, zero_tail: bool) -> Tensor:
    """B*_t [B, T] per group and position; G_t itself for a group of one (advantage 0), and 0 with ``zero_tail`` on
    the tail of a group's unique longest sample past the second longest."""
    live = (mask > 0).to(G.dtype)
    _, inv = torch.unique(group_ids.detach(), return_inverse=True)
    inv = inv.reshape(-1)
    k = int(inv.max()) + 1 if inv.numel() else 0
    num = torch.zeros(k, G.shape[1], dtype=G.dtype, device=G.device).index_add_(0, inv, G * W * live)
    den = torch.zeros(k, G.shape[1], dtype=G.dtype, device=G.device).index_add_(0, inv, W * live)
    base = num[inv] / (den[inv] + eps)
    # Where every live sample of the group has the same G_t, the baseline is that G_t exactly: the weighted mean
    # of equal values, which eps (a guard against 0/0) would otherwise pull off by G eps / (sum W + eps), so that
    # such rows have A = 0 and their backward can be skipped (update.py).
    idx = inv[:, None].expand_as(G)
    hi = torch.full_like(num, -torch.inf).scatter_reduce(0, idx, torch.where(live > 0, G, -torch.inf), "amax")
    lo = torch.full_like(num, torch.inf).scatter_reduce(0, idx, torch.where(live > 0, G, torch.inf), "amin")
    n = torch.zeros(k, dtype=G.dtype, device=G.device).index_add_(0, inv, torch.ones_like(inv, dtype=G.dtype))
    base = torch.where((n[inv][:, None] > 1) & (hi[inv] != lo[inv]), base, G)  # a group of one: A = G - G = 0
    if zero_tail:
        lengths = live.sum(-1)
        for g in range(k):
            rows = (inv == g).nonzero().squeeze(1)
            if rows.numel() < 2:
                continue
            top = lengths[rows].topk(2).values
            longest = rows[lengths[rows] == top[0]]
            if longest.numel() == 1 and top[0] > top[1]:
                base[longest[0], int(top[1]):] = 0.0
    return base


@ADVANTAGES.register("optimal_token_baseline", paper="arXiv:2602.07078", ranges={"eps": "[0, inf)"},
                     tags=("needs_groups", "needs_sum_pi_sq"))
def optimal_token_baseline(
    rewards: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
    sum_pi_sq: Tensor | None = None,
    sampled_logp: Tensor | None = None,
    *,
    eps: float = 1e-8,
    zero_tail: bool = False,
) -> Tensor:
    """Optimal token baseline (OTB, arXiv:2602.07078): A_t = (G_t - sum_i G_t W_t / (sum_i W_t + eps)) mask_t. [B, T].

    W_t = sum_{j<=t, loss tokens} (1 - 2 pi_j + sum_v pi_v^2), pi_j = exp(sampled_logp_j); the sums over i run
    over the group's samples whose position t is a loss token (a sample past its end, or at an environment token,
    adds nothing). G_t = r + sum_{t'>=t} token_rewards_t' (outcome reward at the last loss token, so G_t = r
    for every token without a KL penalty in the reward). ``zero_tail``: on the unique longest sample's positions
    past the group's second-longest, the baseline is 0 (there it would be the sample's own G_t, advantage ~0).
    Convention: verl's compute_optimal_token_baseline_advantage (eps 1e-8, zero_tail False, no std
    normalisation, no rollout-IS factor rho^2 on w: the sampler's own probabilities need none), except that a
    group of one gives 0 as every polyrl group estimator (verl: A = G_t), and so does a position where the group's
    live G_t are all equal (verl: G_t eps / (sum W + eps), ~1e-9); pi and sum pi^2 are the sampler's
    (after temperature/top-k/top-p) where verl recomputes them with the actor. A direct call without
    ``sum_pi_sq``/``sampled_logp`` uses w_j = 1 [assumed; training always passes both].
    """
    m = mask.detach()
    G = _returns_to_go(rewards, m, token_rewards)
    W = _weights(m, sum_pi_sq, sampled_logp, G.dtype)
    return (G - _baseline(G, W, m, group_ids, eps, zero_tail)) * (m > 0).to(G.dtype)


@ADVANTAGES.register("tir_optimal_token_baseline", paper="arXiv:2602.07078", ranges={"eps": "[0, inf)"},
                     tags=("needs_groups", "needs_sum_pi_sq"))
def tir_optimal_token_baseline(
    rewards: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
    sum_pi_sq: Tensor | None = None,
    sampled_logp: Tensor | None = None,
    *,
    eps: float = 1e-8,
    zero_tail: bool = True,
) -> Tensor:
    """Multi-turn OTB (arXiv:2602.07078): optimal_token_baseline with positions counted in loss tokens only. [B, T].

    Each sample's loss tokens are packed left (the k-th token the policy chose is position k, whatever environment
    tokens came before it), B*_k is computed on the packed layout, then scattered back; environment and padding
    tokens get 0. Convention: verl's compute_multi_turn_optimal_token_baseline_advantage (its TIR, tool-integrated
    reasoning, variant: zero_tail True by default, eps 1e-8); group of one gives 0, sampler probabilities, w_j = 1
    without them [assumed], as ``optimal_token_baseline``. For a single-turn rollout it equals
    ``optimal_token_baseline`` with the same ``zero_tail``.
    """
    m = mask.detach()
    live = m > 0
    G = _returns_to_go(rewards, m, token_rewards)
    W = _weights(m, sum_pi_sq, sampled_logp, G.dtype)
    B, _ = m.shape
    L = max(1, int(live.sum(-1).max())) if B else 1
    rows, cols = live.nonzero(as_tuple=True)
    packed_col = (live.long().cumsum(-1) - 1)[rows, cols]
    Gp = torch.zeros(B, L, dtype=G.dtype, device=G.device)
    Wp, Mp = torch.zeros_like(Gp), torch.zeros_like(Gp)
    Gp[rows, packed_col], Wp[rows, packed_col], Mp[rows, packed_col] = G[rows, cols], W[rows, cols], 1.0
    base = _baseline(Gp, Wp, Mp, group_ids, eps, zero_tail)
    adv = torch.zeros_like(G)
    adv[rows, cols] = Gp[rows, packed_col] - base[rows, packed_col]
    return adv
