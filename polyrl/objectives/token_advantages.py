"""Token-level advantage estimators: REINFORCE++, REINFORCE++-baseline and GAE -> adv [B, T].

Split from ``advantages.py`` (300-line rule); the conventions of that module's docstring apply. Here:
outcome reward at the LAST loss token, plus ``token_rewards`` at every loss token; returns and GAE
step over loss tokens only (a padded position is skipped; V after the last loss token = 0); outputs
are 0 at padded positions. Whitening: REINFORCE++ uses the population variance over tokens with
scale 1/sqrt(max(var, eps)) (the author's OpenRLHF); GAE uses the Bessel variance with
1/sqrt(var + 1e-8) (verl masked_whiten). Formulas: shared/spec/objectives-llm.md sections 2 and 5.
"""

from __future__ import annotations

import torch
from torch import Tensor

from polyrl.objectives.advantages import _floats, _seq_rewards, group_centered
from polyrl.registry import ADVANTAGES


def _last_token(mask: Tensor) -> Tensor:
    """[B, T] bool: True at the last loss token of each row (no True in a row without loss tokens)."""
    m = mask > 0
    pos = torch.arange(m.shape[-1], device=m.device).expand_as(m)
    last = torch.where(m, pos, torch.full_like(pos, -1)).max(-1, keepdim=True).values
    return m & (pos == last)


def _token_rewards(outcome: Tensor, mask: Tensor, token_rewards: Tensor | None) -> Tensor:
    """Per-token rewards [B, T]: token_rewards at loss tokens + the outcome at the last loss token."""
    r = torch.where(_last_token(mask), outcome[:, None], torch.zeros_like(outcome)[:, None])
    if token_rewards is not None:
        tr = _floats(token_rewards).to(r.dtype)
        r = r + torch.where(mask > 0, tr, torch.zeros_like(tr))
    return r


def _gae(rt: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> Tensor:
    """Backward GAE over loss tokens only; V after the last loss token = 0. With V = 0, lam = 1: returns."""
    m = mask > 0
    v = torch.where(m, values, torch.zeros_like(values))
    adv = torch.zeros_like(rt)
    next_v = torch.zeros_like(rt[:, 0])
    next_a = torch.zeros_like(rt[:, 0])
    for t in range(rt.shape[-1] - 1, -1, -1):
        a = rt[:, t] + gamma * next_v - v[:, t] + gamma * lam * next_a
        adv[:, t] = torch.where(m[:, t], a, torch.zeros_like(a))
        next_v = torch.where(m[:, t], v[:, t], next_v)
        next_a = torch.where(m[:, t], a, next_a)
    return adv


def _whiten(x: Tensor, mask: Tensor, *, unbiased: bool, eps: float, floor: bool) -> Tensor:
    """Masked whitening over all loss tokens of the batch; 0 at padded positions.

    ``floor``: scale = 1/sqrt(max(var, eps)) (OpenRLHF); else 1/sqrt(var + eps) (verl masked_whiten).
    """
    m = mask > 0
    n = m.sum().to(x.dtype)
    mu = torch.where(m, x, torch.zeros_like(x)).sum() / n.clamp_min(1.0)
    dev = torch.where(m, x - mu, torch.zeros_like(x))
    var = (dev**2).sum() / ((n - 1.0) if unbiased else n).clamp_min(1.0)
    scale = var.clamp_min(eps).rsqrt() if floor else (var + eps).rsqrt()
    return dev * scale


def gae_advantages_and_returns(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    token_rewards: Tensor | None = None,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Compute un-whitened GAE advantages and critic targets returns = adv + V, both [B, T] (0 at padding)."""
    r = _seq_rewards(rewards, mask, None)
    v = _floats(values).to(r.dtype)
    adv = _gae(_token_rewards(r, mask, token_rewards), v, mask, gamma, lam)
    returns = torch.where(mask > 0, adv + v, torch.zeros_like(adv))
    return adv, returns


@ADVANTAGES.register(
    "gae", paper="arXiv:1506.02438", ranges={"gamma": "[0, 1]", "lam": "[0, 1]"}, tags=("needs_values",)
)
def gae(
    rewards: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> Tensor:
    """GAE: delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}. Returns [B, T].

    r_t = token_rewards_t + outcome at the last loss token; V after the last loss token = 0. Optional
    masked whitening with the Bessel variance, (A - mu) / sqrt(var + 1e-8) (verl masked_whiten).
    Critic targets: ``gae_advantages_and_returns``.
    """
    if values is None:
        raise ValueError("advantage 'gae' needs values [B, T] from a critic (values is None)")
    adv, _ = gae_advantages_and_returns(rewards, values, mask, token_rewards, gamma=gamma, lam=lam)
    return _whiten(adv, mask, unbiased=True, eps=1e-8, floor=False) if whiten else adv


@ADVANTAGES.register("reinforce_pp", paper="arXiv:2501.03262", ranges={"gamma": "[0, 1]", "eps": "(0, inf)"})
def reinforce_pp(
    rewards: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
    *,
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> Tensor:
    """REINFORCE++: returns G_t = sum_{s>=t} gamma^(s-t) r_s, then global token whitening. Returns [B, T].

    r_s = token_rewards_s (+ the outcome at the last loss token). Whitening over all loss tokens of the
    batch: (G - mu) / sqrt(max(var, eps)) with the POPULATION variance (the author's OpenRLHF; verl uses
    Bessel). Tokens are weighted equally, so longer sequences weigh more in mu and var.
    """
    outcome = _seq_rewards(rewards, mask, None)
    rt = _token_rewards(outcome, mask, token_rewards)
    returns = _gae(rt, torch.zeros_like(rt), mask, gamma, 1.0)
    return _whiten(returns, mask, unbiased=False, eps=eps, floor=True)


@ADVANTAGES.register("reinforce_pp_baseline", paper="arXiv:2501.03262", ranges={"eps": "(0, inf)"},
                     tags=("needs_groups",))
def reinforce_pp_baseline(
    rewards: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
    *,
    eps: float = 1e-8,
) -> Tensor:
    """REINFORCE++-baseline: (r_i - mean_g r) on every token (+ returns of token_rewards), then whitening.

    Same population-variance token whitening as ``reinforce_pp`` (gamma = 1). A zero-variance group
    (centred reward 0) gets -mu_tok/sigma_tok, non-zero when lengths differ (OpenRLHF reproduced, not
    filtered). Returns [B, T].
    """
    centred = group_centered(rewards, group_ids, mask)
    adv = _token_rewards(centred, mask, None)  # centred reward at the last loss token
    if token_rewards is not None:
        adv = adv + _token_rewards(torch.zeros_like(centred), mask, token_rewards)
    returns = _gae(adv, torch.zeros_like(adv), mask, 1.0, 1.0)
    return _whiten(returns, mask, unbiased=False, eps=eps, floor=True)
