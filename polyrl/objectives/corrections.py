"""Rollout/trainer mismatch corrections: detached per-token weights multiplied into the loss.

Signature: ``fn(old_logp, rollout_logp, mask, adv, *, settings) -> weights [B, T]`` (no gradient).
The token log-ratio is log(pi_old / mu) = old_logp - rollout_logp, clamped to [-20, 20] before exp;
sequence log-ratios are sums (TIS/MIS, "exp(sum)") or means (geometric, "exp(mean)") over LOSS tokens
only, also clamped to [-20, 20]. Padded positions never enter a sum and get weight 0.
Formulas: shared/spec/objectives-llm.md section 23; DeepSeek-V3.2 (arXiv:2512.02556) for the
off-policy sequence mask. Rejected tokens keep their place in the loss denominator (``Normalizer``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from polyrl.objectives.trust_regions import LOG_RATIO_CLAMP
from polyrl.registry import CORRECTIONS


def _token_log_ratio(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> Tensor:
    """Detached clamped log(pi_old/mu) [B, T], 0 at padded positions."""
    lr = (old_logp.detach() - rollout_logp.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.where(mask > 0, lr, torch.zeros_like(lr))


def _seq_log_ratio(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, mean: bool) -> Tensor:
    """Sum (or mean) over loss tokens of the token log-ratio, clamped, broadcast back to [B, T]."""
    lr = _token_log_ratio(old_logp, rollout_logp, mask).sum(-1, keepdim=True)
    if mean:
        lr = lr / (mask > 0).sum(-1, keepdim=True).clamp_min(1).to(lr.dtype)
    return lr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).expand_as(mask)


def _masked(weight: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask > 0, weight, torch.zeros_like(weight)).detach()


def _band(p: dict) -> str | None:
    if p["low"] >= p["high"]:
        return f"parameter 'low' = {p['low']} must be below 'high' = {p['high']}"
    return None


def _tis_check(p: dict) -> str | None:
    if p["cap_low"] >= p["cap"]:
        return f"parameter 'cap_low' = {p['cap_low']} must be below 'cap' = {p['cap']}"
    return None


@CORRECTIONS.register(
    "tis", paper="fengyao.notion.site/off-policy-rl", ranges={"cap": ">0", "cap_low": ">=0"}, check=_tis_check
)
def tis(
    old_logp: Tensor,
    rollout_logp: Tensor,
    mask: Tensor,
    adv: Tensor,
    *,
    cap: float = 2.0,
    cap_low: float = 0.0,
) -> Tensor:
    """Token truncated IS: w_t = min(max(pi_old/mu, cap_low), cap) (slime --tis-clip 2, --tis-clip-low 0)."""
    ratio = _token_log_ratio(old_logp, rollout_logp, mask).exp()
    return _masked(ratio.clamp(cap_low, cap), mask)


@CORRECTIONS.register("seq_tis", paper="richardli.xyz/rl-collapse", ranges={"cap": ">0"})
def seq_tis(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, adv: Tensor, *, cap: float = 2.0) -> Tensor:
    """Sequence truncated IS: w = min(exp(sum_t log(pi_old/mu)), cap) on every token of the response."""
    return _masked(_seq_log_ratio(old_logp, rollout_logp, mask, mean=False).exp().clamp_max(cap), mask)


@CORRECTIONS.register("icepop", paper="arXiv:2510.18855", ranges={"low": ">=0", "high": ">0"}, check=_band)
def icepop(
    old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, adv: Tensor, *, low: float = 0.5, high: float = 2.0
) -> Tensor:
    """Token masked IS (IcePop): w_t = pi_old/mu if low <= ratio <= high, else 0 (token dropped)."""
    ratio = _token_log_ratio(old_logp, rollout_logp, mask).exp()
    keep = (ratio >= low) & (ratio <= high)
    return _masked(torch.where(keep, ratio, torch.zeros_like(ratio)), mask)


@CORRECTIONS.register(
    "mis", paper="richardli.xyz/rl-collapse", ranges={"low": ">=0", "high": ">0"}, check=_band
)
def mis(
    old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, adv: Tensor, *, low: float = 0.5, high: float = 2.0
) -> Tensor:
    """Sequence masked IS: w = exp(sum_t log(pi_old/mu)) if within [low, high], else 0 (response dropped)."""
    ratio = _seq_log_ratio(old_logp, rollout_logp, mask, mean=False).exp()
    keep = (ratio >= low) & (ratio <= high)
    return _masked(torch.where(keep, ratio, torch.zeros_like(ratio)), mask)


@CORRECTIONS.register(
    "geo_rs", paper="richardli.xyz/rl-collapse", ranges={"low": ">0", "high": ">0"}, check=_band
)
def geo_rs(
    old_logp: Tensor,
    rollout_logp: Tensor,
    mask: Tensor,
    adv: Tensor,
    *,
    low: float = 0.999,
    high: float = 1.001,
) -> Tensor:
    """Geometric rejection sampling: w = 1 if exp(mean_t log(pi_old/mu)) is in [low, high], else 0."""
    geo = _seq_log_ratio(old_logp, rollout_logp, mask, mean=True).exp()
    keep = (geo >= low) & (geo <= high)
    return _masked(keep.to(geo.dtype), mask)


@CORRECTIONS.register("offpolicy_seq_mask", paper="arXiv:2512.02556", ranges={"delta": ">=0"})
def offpolicy_seq_mask(
    old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, adv: Tensor, *, delta: float = 0.1
) -> Tensor:
    """Off-policy sequence masking (DeepSeek-V3.2): w_t = 0 if A_t < 0 and mean_t log(mu/pi_old) > delta.

    The paper compares the sampling policy with the CURRENT policy pi_theta; here (a detached weight
    computed before the update) we compare the rollout engine's mu with the trainer's pi_old:
    mean over loss tokens of (rollout_logp - old_logp). The advantage test is per token, as in the
    paper; with a sequence-level advantage this masks the whole negative-advantage response.
    """
    div = -_seq_log_ratio(old_logp, rollout_logp, mask, mean=True)  # mean log(mu / pi_old), [B, T]
    a = adv.detach()
    a = a[:, None].expand_as(mask) if a.dim() == 1 else a
    drop = (a < 0) & (div > delta)
    return _masked((~drop).to(div.dtype), mask)
