"""Covariance trust regions: Clip-Cov and KL-Cov (arXiv:2505.22617, "The Entropy Mechanism of RL for LMs").

The paper shows that policy entropy falls by the covariance between a token's log-probability and its
advantage, and restrains the few tokens with the largest covariance. Per token,
cov_t = (A_t - mean A) (lp_t - mean lp), the means over the mask == 1 tokens of the micro-batch and lp the
current policy's detached log-prob (verl's compute_policy_loss_clip_cov / _kl_cov).

Convention (both parts): the selection is made over the tokens of the micro-batch the loss sees, as in
verl, so these two parts break the exact micro-batch invariance that every other part keeps: a different
micro-batch split changes the means, the count k and therefore which tokens are restrained.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

from polyrl.objectives.trust_regions import LOG_RATIO_CLAMP, _frac
from polyrl.registry import TRUST_REGIONS
from polyrl.types import LossInputs


def token_covariance(inp: LossInputs) -> Tensor:
    """[B, T] detached cov_t = (A_t - mean A)(lp_t - mean lp) over the mask == 1 tokens; 0 on padding."""
    m = inp.mask > 0
    n = m.sum().clamp_min(1)
    adv = torch.where(m, inp.adv.detach(), 0.0)
    lp = torch.where(m, inp.logp.detach(), 0.0)
    cov = (adv - adv.sum() / n) * (lp - lp.sum() / n)
    return torch.where(m, cov, 0.0)


def selection_count(ratio: float, mask: Tensor) -> int:
    """k = max(1, floor(ratio * number of mask == 1 tokens)) (verl's count)."""
    return max(int(ratio * int((mask > 0).sum())), 1)


def selection_seed(inp: LossInputs) -> int:
    """Seed from a hash of the micro-batch's mask, pi_old log-probs and advantages on mask == 1 tokens.

    The same micro-batch always draws the same tokens (runs are reproducible), different batches draw
    different ones, and values at padded positions never matter.
    """
    m = inp.mask > 0
    h = hashlib.blake2b(digest_size=8)
    h.update(m.cpu().numpy().tobytes())
    for x in (inp.old_logp, inp.adv):
        h.update(torch.where(m, x.detach(), 0.0).to(torch.float64).cpu().numpy().tobytes())
    return int.from_bytes(h.digest(), "little") & (2**63 - 1)


def _check_band(p: dict) -> str | None:
    if p["clip_cov_lb"] >= p["clip_cov_ub"]:
        return f"parameter 'clip_cov_lb' = {p['clip_cov_lb']} must be < 'clip_cov_ub' = {p['clip_cov_ub']}"
    return None


@TRUST_REGIONS.register(
    "clip_cov",
    paper="arXiv:2505.22617",
    ranges={"eps_low": "[0, 1]", "eps_high": ">=0", "clip_cov_ratio": "(0, 1]"},
    check=_check_band,
)
def clip_cov(
    inp: LossInputs,
    log_ratio: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Drop the loss of a random few tokens whose covariance lies in a band (Clip-Cov).

    arXiv:2505.22617. l_t = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A), then l_t = 0 (no value, no
    gradient) on k = max(1, floor(clip_cov_ratio * n)) tokens drawn uniformly from those with
    clip_cov_lb < cov_t < clip_cov_ub that the PPO clip has not already clipped (n: mask == 1 tokens).
    Defaults: verl's (clip_ratio 0.2, clip_cov_ratio 2e-4, lb 1, ub 5); the paper's 7B recipe sets eps_low =
    eps_high = 1 (PPO clip nearly off, Clip-Cov the only trust region). Convention: the draw is made over
    this micro-batch (breaks exact micro-batch invariance, module docstring); verl draws with the global
    torch RNG, we draw with a generator seeded from a hash of the micro-batch's mask, pi_old log-probs and
    advantages (``selection_seed``), so a run is reproducible. Metric cov_clip_frac: dropped tokens / n.
    """
    adv = inp.adv
    m = inp.mask > 0
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    unclipped = -ratio * adv
    clipped = -ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    clipped_by_ppo = (clipped > unclipped).detach()
    cov = token_covariance(inp)
    band = m & ~clipped_by_ppo & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    k = min(selection_count(clip_cov_ratio, inp.mask), int(band.sum()))
    gen = torch.Generator().manual_seed(selection_seed(inp))
    keys = torch.rand(band.shape, generator=gen, dtype=torch.float64).to(cov.device)
    keys = torch.where(band, keys, torch.full_like(keys, 2.0))  # candidates first, in random order
    chosen = torch.zeros(band.numel(), dtype=torch.bool, device=band.device)
    chosen[keys.reshape(-1).argsort()[:k]] = True
    chosen = chosen.view_as(band)
    loss = torch.where(chosen, torch.zeros_like(unclipped), torch.maximum(unclipped, clipped))
    metrics = {
        "clip_frac": _frac(clipped_by_ppo, inp.mask),
        "cov_clip_frac": _frac(chosen, inp.mask),
        "cov_band_frac": _frac(band, inp.mask),
    }
    return loss, metrics


@TRUST_REGIONS.register(
    "kl_cov",
    paper="arXiv:2505.22617",
    ranges={"kl_cov_ratio": "(0, 1]", "ppo_kl_coef": ">=0"},
    tags=("vanilla_at_one",),
)
def kl_cov(
    inp: LossInputs, log_ratio: Tensor, *, kl_cov_ratio: float = 2e-3, ppo_kl_coef: float = 1.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """Penalise |log rho| on the tokens with the largest covariance (KL-Cov).

    arXiv:2505.22617. l_t = -rho A + ppo_kl_coef |log rho| on the k = max(1, floor(kl_cov_ratio * n)) mask == 1
    tokens with the largest cov_t, l_t = -rho A (no clip) on every other token. Defaults kl_cov_ratio 2e-3,
    ppo_kl_coef 1: the paper's 7B recipe (verl's actor.yaml defaults are 2e-4 and 0.1). Convention: the top
    k is taken over this micro-batch (breaks exact micro-batch invariance, module docstring); ties are broken
    by position (torch.topk over the flattened valid tokens). At rho = 1 the penalty's gradient is 0
    (|x|'s subgradient at 0), so the gradient is exactly -A grad lp. Metric cov_kl_frac: penalised / n.
    """
    m = inp.mask > 0
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    loss = -ratio * inp.adv
    cov = token_covariance(inp).reshape(-1)
    valid = m.reshape(-1).nonzero().squeeze(-1)
    chosen = torch.zeros_like(m.reshape(-1))
    if valid.numel() > 0:
        k = selection_count(kl_cov_ratio, inp.mask)
        chosen[valid[cov[valid].topk(k).indices]] = True
    chosen = chosen.view_as(m)
    penalty = ppo_kl_coef * log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).abs()
    loss = torch.where(chosen, loss + penalty, loss)
    metrics = {
        "cov_kl_frac": _frac(chosen, inp.mask),
        "abs_log_ratio": _frac_mean(log_ratio.abs(), inp.mask),
    }
    return loss, metrics


def _frac_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Detached mean of ``x`` over the mask == 1 tokens."""
    m = mask > 0
    return torch.where(m, x.detach(), 0.0).sum() / m.sum().clamp_min(1)
