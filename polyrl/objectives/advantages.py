"""Advantage estimators: rewards (+ group ids, mask, optional critic values) -> adv [B] or [B, T].

Signature of every part: ``fn(rewards, group_ids, mask, values=None, token_rewards=None, *, settings)``.
Everything is computed on detached inputs; nothing here carries gradient. Formulas:
shared/spec/objectives-llm.md sections 1-6, 10, 12 and methods-seedblog.md B3.

Conventions chosen where sources disagree (each is tested):
- Group of one: EVERY group estimator (grpo, group_centered, rloo, maxrl, gdpo per channel,
  group_centered_batch_std) returns 0 for a group with a single sample -- no contrast, no signal
  (verl's loop RLOO/GRPO give A = r, verl's vectorised RLOO gives 0, TRL NaN-guards the std).
- ``token_rewards`` [B, T] (e.g. a KL penalty, already negative) for SEQUENCE-level estimators is summed
  over the loss tokens and added to the sequence reward (RLOO paper: R_i = r_i - beta sum_t KL_t);
  token-level estimators (reinforce_pp, reinforce_pp_baseline, gae) add it per token, with the outcome
  reward placed at the last loss token. gdpo rejects token_rewards (no defined channel for them).
- Values at padded positions never matter.

The token-level estimators (reinforce_pp, reinforce_pp_baseline, gae and the helper
``gae_advantages_and_returns``) live in ``token_advantages.py``; ``polyrl.objectives`` imports both.
"""

from __future__ import annotations

import re
from typing import Literal

import torch
from torch import Tensor

from polyrl.errors import TrainingError
from polyrl.registry import ADVANTAGES


def _floats(x: Tensor) -> Tensor:
    x = x.detach()
    return x if x.is_floating_point() else x.to(torch.get_default_dtype())


def _div(num: Tensor, den: Tensor) -> Tensor:
    """num / den, and 0 where den == 0 (never NaN)."""
    ok = den > 0
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(num))


def _seq_rewards(rewards: Tensor, mask: Tensor, token_rewards: Tensor | None) -> Tensor:
    """Sequence rewards [B]: rewards + the masked sum of token_rewards over loss tokens."""
    r = _floats(rewards)
    if r.dim() != 1:
        raise ValueError(f"rewards must be [B] for this estimator, got shape {tuple(r.shape)}")
    if token_rewards is not None:
        tr = _floats(token_rewards).to(r.dtype)
        r = r + torch.where(mask > 0, tr, torch.zeros_like(tr)).sum(-1)
    return r


def _group_stats(r: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample group size n [B], group sum and group sum of squared deviations ([B] or [B, C])."""
    _, inv = torch.unique(group_ids.detach(), return_inverse=True)
    inv = inv.reshape(-1)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    counts = torch.zeros(n_groups, dtype=r.dtype, device=r.device)
    counts.index_add_(0, inv, torch.ones_like(inv, dtype=r.dtype))
    sums = torch.zeros((n_groups, *r.shape[1:]), dtype=r.dtype, device=r.device).index_add_(0, inv, r)
    n = counts[inv].reshape(-1, *([1] * (r.dim() - 1)))
    # A group of equal rewards has its value as mean exactly: the sum of n copies over n can be an ulp off (eight
    # 0.1s gave every row A ~ 1e-11 instead of 0, which also kept their backward in the update, update.py).
    idx = inv.reshape(-1, *([1] * (r.dim() - 1))).expand_as(r)
    hi = torch.full_like(sums, -torch.inf).scatter_reduce(0, idx, r, "amax")
    lo = torch.full_like(sums, torch.inf).scatter_reduce(0, idx, r, "amin")
    mean = torch.where(hi[inv] == lo[inv], r, sums[inv] / n)
    sq = torch.zeros_like(sums).index_add_(0, inv, (r - mean) ** 2)
    return n, mean, sq[inv]


def _group_z(r: Tensor, group_ids: Tensor, eps: float, unbiased: bool) -> Tensor:
    """(r - group mean) / (group std + eps); 0 for groups of one."""
    n, mean, sq = _group_stats(r, group_ids)
    std = (sq / ((n - 1.0) if unbiased else n).clamp_min(1.0)).sqrt()
    return torch.where(n > 1, _div(r - mean, std + eps), torch.zeros_like(r))


def _batch_std(x: Tensor, eps: float) -> Tensor:
    """(x - batch mean) / (Bessel batch std + eps), over all B sequences; 0 when B == 1."""
    if x.numel() < 2:
        return torch.zeros_like(x)
    return _div(x - x.mean(), x.std() + eps)


@ADVANTAGES.register("reinforce", paper="Williams 1992; arXiv:2402.14740")
def reinforce(
    rewards: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
    *,
    baseline: Literal["batch_mean", "zero"] = "batch_mean",
) -> Tensor:
    """REINFORCE with a constant baseline: A = r - b, b = mean of the batch's rewards or 0. Returns [B]."""
    r = _seq_rewards(rewards, mask, token_rewards)
    return r - r.mean() if baseline == "batch_mean" else r


@ADVANTAGES.register("grpo", paper="arXiv:2402.03300", ranges={"eps": "[0, inf)"}, tags=("needs_groups",))
def grpo(
    rewards: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
    *,
    eps: float = 1e-6,
    std: Literal["sample", "population"] = "sample",
) -> Tensor:
    """Group z-score (GRPO): A_i = (r_i - mean_g r) / (std_g r + eps). Returns [B].

    Convention: Bessel-corrected sample std by default (verl, TRL; the paper does not say), eps = 1e-6
    (verl; TRL uses 1e-4); 0 for all-equal groups and for groups of one.
    """
    r = _seq_rewards(rewards, mask, token_rewards)
    return _group_z(r, group_ids, eps, unbiased=std == "sample")


@ADVANTAGES.register("group_centered", paper="arXiv:2503.20783", tags=("needs_groups",))
def group_centered(
    rewards: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
) -> Tensor:
    """Group-centred reward (Dr. GRPO): A_i = r_i - mean_g r, no std division. Returns [B]."""
    r = _seq_rewards(rewards, mask, token_rewards)
    n, mean, _ = _group_stats(r, group_ids)
    return torch.where(n > 1, r - mean, torch.zeros_like(r))


@ADVANTAGES.register("rloo", paper="arXiv:2402.14740", tags=("needs_groups",))
def rloo(
    rewards: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
) -> Tensor:
    """Leave-one-out baseline (RLOO): A_i = r_i - mean_{j != i} r_j = k/(k-1) (r_i - mean_g r). Returns [B].

    Convention: 0 for a group of one (verl's vectorised version; its loop version leaves A = r).
    """
    r = _seq_rewards(rewards, mask, token_rewards)
    n, mean, _ = _group_stats(r, group_ids)
    return torch.where(n > 1, n / (n - 1.0).clamp_min(1.0) * (r - mean), torch.zeros_like(r))


@ADVANTAGES.register("maxrl", paper="arXiv:2602.02710", ranges={"eps": "[0, inf)"}, tags=("needs_groups",))
def maxrl(
    rewards: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
    *,
    eps: float = 0.0,
) -> Tensor:
    """Mean-scaled advantage (MaxRL): A_i = (r_i - mean_g r) / (mean_g r + eps); 0 if mean_g r == 0. [B].

    For binary rewards with K successes of N: N/K - 1 for successes, -1 for failures; (1/N) sum_i A_i S_i
    equals sum_i (r_i/K - 1/N) S_i (the paper's control-variate estimator). Needs rewards >= 0 (a pass rate): a
    negative one is refused (TrainingError) rather than silently zeroing its group, whose mean may then be <= 0.
    """
    r = _seq_rewards(rewards, mask, token_rewards)
    if bool((r < 0).any()):
        raise TrainingError(f"advantage 'maxrl' needs rewards >= 0 (it divides by the group's mean, a pass rate); "
                            f"got {float(r.min()):g}: use a reward in [0, 1] without negative shaping, or another "
                            "advantage (grpo)")
    n, mean, _ = _group_stats(r, group_ids)
    adv = torch.where(mean == 0, torch.zeros_like(r), _div(r - mean, mean + eps))
    return torch.where(n > 1, adv, torch.zeros_like(r))


@ADVANTAGES.register(
    "group_centered_batch_std", paper="arXiv:2510.13786", ranges={"eps": "[0, inf)"}, tags=("needs_groups",)
)
def group_centered_batch_std(
    rewards: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
    *,
    eps: float = 1e-6,
) -> Tensor:
    """ScaleRL batch-level normalisation: A_i = (r_i - mean_g r) / (std_batch r + eps). Returns [B].

    [unverified] The std is the Bessel std of the RAW rewards over the whole batch (TRL
    scale_rewards="batch"); the alternative reading (std of the group-centred advantages) is unresolved.
    """
    r = _seq_rewards(rewards, mask, token_rewards)
    n, mean, _ = _group_stats(r, group_ids)
    std = r.std() if r.numel() > 1 else torch.zeros((), dtype=r.dtype)
    return torch.where(n > 1, _div(r - mean, std + eps), torch.zeros_like(r))


def parse_channel_weights(text: str) -> list[float]:
    """'1,0.5' or '1;0.5' -> [1.0, 0.5] (';' because ',' separates parameters in name:key=value,...)."""
    return [float(w) for w in re.split(r"[,;]", text)] if text.strip() else []


def _check_gdpo(p: dict) -> str | None:
    try:
        parse_channel_weights(p["weights"])
    except ValueError:
        return f"parameter 'weights' = {p['weights']!r} must be numbers separated by ',' or ';' like '1;0.5'"
    return None


@ADVANTAGES.register(
    "gdpo", paper="arXiv:2601.05242", ranges={"eps": "[0, inf)"}, check=_check_gdpo, tags=("needs_groups", "channels")
)
def gdpo(
    rewards: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
    *,
    eps: float = 1e-6,
    weights: str = "",
    whiten: Literal["responses", "tokens"] = "responses",
) -> Tensor:
    """GDPO: per-channel group z-score, weighted sum S = sum_c w_c Ahat_c, then batch z-score of S. [B].

    rewards [B, C] ([B] is C = 1); weights "1,0.5" or "1;0.5" (the CLI form ``gdpo:weights=1;0.5``;
    empty = all 1). whiten = "responses": (S - mean_i S) / (std_i S + eps) over the batch's responses (the
    paper's equation and its TRL code); "tokens": each response weighted by its number of loss tokens n_i,
    m = sum n_i S_i / N, var = sum n_i (S_i - m)^2 / (N - 1), N = sum n_i (verl's masked_whiten of the
    per-token advantages, as the paper's verl code). Convention: Bessel (sample) std for the per-channel and
    the batch statistics, as ``grpo``; a group of one gives 0 in every channel and in the result.
    """
    if token_rewards is not None:
        raise ValueError("advantage 'gdpo' takes no token_rewards (put the KL in the loss or in a channel)")
    r = _floats(rewards)
    r = r[:, None] if r.dim() == 1 else r
    w = parse_channel_weights(weights) or [1.0] * r.shape[1]
    if len(w) != r.shape[1]:
        raise ValueError(
            f"advantage 'gdpo': weights={weights!r} has {len(w)} entries but rewards have "
            f"{r.shape[1]} channels"
        )
    s = (_group_z(r, group_ids, eps, unbiased=True) * torch.tensor(w, dtype=r.dtype, device=r.device)).sum(-1)
    n, _, _ = _group_stats(s, group_ids)
    # A group of one has S = 0; it stays exactly 0 (with "responses" the batch mean of S is 0 anyway).
    return torch.where(n > 1, _batch_std(s, eps) if whiten == "responses" else _token_std(s, mask, eps),
                       torch.zeros_like(s))


def _token_std(x: Tensor, mask: Tensor, eps: float) -> Tensor:
    """(x - m) / (std + eps) with every x_i counted once per loss token (Bessel over the N tokens); 0 if N < 2."""
    w = (mask.detach() > 0).to(x.dtype).sum(-1)
    N = w.sum()
    if N < 2:
        return torch.zeros_like(x)
    m = (w * x).sum() / N
    return _div(x - m, ((w * (x - m) ** 2).sum() / (N - 1)).sqrt() + eps)
