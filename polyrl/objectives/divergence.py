"""Divergence trust regions: DPPO masks (binary / top-K, TV / KL), CPPO prefix budget, DRPO penalty.

Convention for the anchor (tested): q, the probability of the sampled token under the ratio's
anchor, is q = exp(sg(logp) - sg(log_ratio)); p = exp(sg(logp)); the ratio is r = exp(clamp(log_ratio)).
With the presets' token ratio anchored to the rollout policy (Method.anchor = "rollout") q is mu, as
the DPPO, CPPO and DRPO papers ask; anchoring to pi_old gives the papers' "recompute" ablation. The
top-K variants compare the (K+1)-bucket distributions (K columns + "rest" = 1 - sum) of
inp.topk_logp (pi_theta) and inp.rollout_topk_logp (mu) whatever the anchor, and take the direction
(p > q or p < q) from column 0 of those same tensors (the sampled token); the loop passes pi_old's top-K as mu's
(tag "rollout_topk": the sampler records none; a stale one, async or vLLM, is refused). Masks and budgets are
computed without gradient in float32 or wider; the gradient flows only through r.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from polyrl.objectives.trust_regions import LOG_RATIO_CLAMP, _frac
from polyrl.registry import TRUST_REGIONS
from polyrl.types import LossInputs

Metrics = dict[str, Tensor]


def _wide(x: Tensor) -> Tensor:
    """Detached copy in float32 or wider: keep/mask decisions are made in full precision."""
    x = x.detach()
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _log_pq(inp: LossInputs, log_ratio: Tensor) -> tuple[Tensor, Tensor]:
    """(log p, log q) of the sampled token: p under pi_theta, q under the ratio's anchor (detached)."""
    lp = _wide(inp.logp)
    return lp, lp - _wide(log_ratio)


def _ratio(log_ratio: Tensor) -> Tensor:  # r = exp(clamp(log_ratio)), with gradient
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()


def _direction_keep(adv: Tensor, div: Tensor, p: Tensor, q: Tensor, dl: float, dh: float) -> Tensor:
    """DPPO keep [B, T] bool: drop diverging moves (A>0 & p>q, A<0 & p<q) whose divergence exceeds delta."""
    return ~(((adv > 0) & (p > q) & (div > dh)) | ((adv < 0) & (p < q) & (div > dl)))


def dppo_binary_tv_keep(p: Tensor, q: Tensor, adv: Tensor, *, delta_low: float, delta_high: float) -> Tensor:
    """Binary-TV keep mask [B, T]: False iff (A>0 and p-q > delta_high) or (A<0 and p-q < -delta_low)."""
    return _direction_keep(adv, (p - q).abs(), p, q, delta_low, delta_high)


def binary_kl(log_q: Tensor, log_p: Tensor) -> Tensor:
    """KL(Bern(q) || Bern(p)) = q log(q/p) + (1-q) log((1-q)/(1-p)) from log-probabilities (>= 0, finite)."""
    tiny = torch.finfo(log_q.dtype).tiny
    lo = torch.log(torch.tensor(tiny, dtype=log_q.dtype))
    log_q, log_p = log_q.clamp(lo, 0.0), log_p.clamp(lo, 0.0)
    log1m = lambda x: torch.log((-torch.expm1(x)).clamp_min(tiny))  # log(1 - e^x), exact near 0 and 1
    q = log_q.exp()
    return (q * (log_q - log_p) + (1.0 - q) * (log1m(log_q) - log1m(log_p))).clamp_min(0.0)


def _buckets(topk_logp: Tensor) -> Tensor:
    """(K+1)-bucket probabilities [B, T, K+1]: the K top-K columns and the rest, 1 - sum (>= 0)."""
    probs = _wide(topk_logp).exp()
    rest = (1.0 - probs.sum(-1, keepdim=True)).clamp_min(0.0)
    return torch.cat([probs, rest], dim=-1)


def topk_divergence(pi_topk_logp: Tensor, mu_topk_logp: Tensor, kind: Literal["tv", "kl"]) -> Tensor:
    """(K+1)-bucket divergence [B, T]: TV = 0.5 sum |mu - pi| or KL(mu || pi) = sum mu log(mu / pi)."""
    pi, mu = _buckets(pi_topk_logp), _buckets(mu_topk_logp)
    if kind == "tv":
        return 0.5 * (mu - pi).abs().sum(-1)
    tiny = torch.finfo(pi.dtype).tiny
    return (torch.xlogy(mu, mu) - mu * pi.clamp_min(tiny).log()).sum(-1).clamp_min(0.0)


def _masked_surrogate(
    inp: LossInputs, log_ratio: Tensor, keep: Tensor, trunc_c: float | None
) -> tuple[Tensor, Metrics]:
    """l = -M A sg(min(r, C)/r) r: value -M A min(r, C), gradient -M A min(r, C) grad lp."""
    ratio = _ratio(log_ratio)
    metrics = {"mask_frac": _frac(~keep, inp.mask)}
    weight = ratio
    if trunc_c is not None:
        r = ratio.detach()
        weight = ratio * (r.clamp_max(trunc_c) / r)
        metrics["trunc_frac"] = _frac(r > trunc_c, inp.mask)
    return -keep.to(ratio.dtype) * inp.adv * weight, metrics


_DPPO = dict(  # registration shared by the four DPPO masks
    paper="arXiv:2602.04879",
    ranges={"delta_low": ">=0", "delta_high": ">=0", "trunc_c": ">0"},
    tags=("vanilla_at_one", "zero_adv_inert"),
)
_DPPO_TOPK = {**_DPPO, "tags": ("vanilla_at_one", "zero_adv_inert", "needs_topk", "rollout_topk")}


@TRUST_REGIONS.register("dppo_tv", **_DPPO)
def dppo_tv(
    inp: LossInputs,
    log_ratio: Tensor,
    *,
    delta_low: float = 0.15,
    delta_high: float = 0.15,
    trunc_c: float | None = 10.0,
) -> tuple[Tensor, Metrics]:
    """Mask tokens whose sampled-token probability moved too far from the anchor (DPPO Binary-TV).

    arXiv:2602.04879. M = 0 iff (A>0 and p-q > delta_high) or (A<0 and p-q < -delta_low);
    l = -M A sg(min(r, C)/r) r (gradient surrogate: gradient -M A min(r, C) grad lp, no ratio clip).
    Convention: C = 10 (Stable-RL authors' default; verl uses 20, its example 1e4); None disables it.
    """
    lp, lq = _log_pq(inp, log_ratio)
    keep = dppo_binary_tv_keep(lp.exp(), lq.exp(), inp.adv, delta_low=delta_low, delta_high=delta_high)
    return _masked_surrogate(inp, log_ratio, keep, trunc_c)


@TRUST_REGIONS.register("dppo_kl", **_DPPO)
def dppo_kl(
    inp: LossInputs,
    log_ratio: Tensor,
    *,
    delta_low: float = 0.05,
    delta_high: float = 0.05,
    trunc_c: float | None = 10.0,
) -> tuple[Tensor, Metrics]:
    """Mask tokens whose binary KL to the anchor is too large in the advantage's direction (DPPO Binary-KL).

    arXiv:2602.04879. D = q log(q/p) + (1-q) log((1-q)/(1-p)); M = 0 iff (A>0, p>q, D > delta_high) or
    (A<0, p<q, D > delta_low); l = -M A sg(min(r, C)/r) r as in dppo_tv (C = 10, Stable-RL default).
    """
    lp, lq = _log_pq(inp, log_ratio)
    keep = _direction_keep(inp.adv, binary_kl(lq, lp), lp.exp(), lq.exp(), delta_low, delta_high)
    return _masked_surrogate(inp, log_ratio, keep, trunc_c)


def _topk(inp: LossInputs, log_ratio: Tensor, kind: Literal["tv", "kl"], dl: float, dh: float, c: float | None):
    missing = " and ".join(f"LossInputs.{n}" for n in ("topk_logp", "rollout_topk_logp") if getattr(inp, n) is None)
    if missing:
        raise ValueError(f"trust region 'dppo_topk_{kind}' needs {missing} [B, T, K]")
    div = topk_divergence(inp.topk_logp, inp.rollout_topk_logp, kind)
    p, q = _wide(inp.topk_logp[..., 0]).exp(), _wide(inp.rollout_topk_logp[..., 0]).exp()
    return _masked_surrogate(inp, log_ratio, _direction_keep(inp.adv, div, p, q, dl, dh), c)


@TRUST_REGIONS.register("dppo_topk_tv", **_DPPO_TOPK)
def dppo_topk_tv(
    inp: LossInputs,
    log_ratio: Tensor,
    *,
    delta_low: float = 0.15,
    delta_high: float = 0.15,
    trunc_c: float | None = 10.0,
) -> tuple[Tensor, Metrics]:
    """Mask tokens whose top-K distribution moved too far from the rollout's in TV (DPPO Top-K TV).

    arXiv:2602.04879. TV = 0.5 sum_k |mu_k - pi_k| over K top-K buckets + rest; direction and surrogate as
    dppo_tv, with p, q = column 0 (sampled token) of topk_logp / rollout_topk_logp. K: [unverified].
    """
    return _topk(inp, log_ratio, "tv", delta_low, delta_high, trunc_c)


@TRUST_REGIONS.register("dppo_topk_kl", **_DPPO_TOPK)
def dppo_topk_kl(
    inp: LossInputs,
    log_ratio: Tensor,
    *,
    delta_low: float = 0.05,
    delta_high: float = 0.05,
    trunc_c: float | None = 10.0,
) -> tuple[Tensor, Metrics]:
    """Mask tokens whose top-K distribution moved too far from the rollout's in KL (DPPO Top-K KL).

    arXiv:2602.04879. KL(mu || pi) = sum_k mu_k log(mu_k / pi_k) over K top-K buckets + rest; direction and
    surrogate as dppo_kl, with p, q = column 0 of topk_logp / rollout_topk_logp. K: [unverified].
    """
    return _topk(inp, log_ratio, "kl", delta_low, delta_high, trunc_c)


def _row_quantile(x: Tensor, valid: Tensor, level: float) -> Tensor:
    """Per-row quantile [B] of x over valid entries (torch.quantile's linear rule); 0 for empty rows."""
    srt = torch.where(valid, x, torch.full_like(x, float("inf"))).sort(dim=-1).values
    last = (valid.sum(-1) - 1).clamp_min(0)  # [B]
    h = level * last.to(x.dtype)
    lo = h.floor().long()
    hi = torch.minimum(lo + 1, last)
    v_lo, v_hi = srt.gather(-1, lo[:, None])[:, 0], srt.gather(-1, hi[:, None])[:, 0]
    out = v_lo + (h - lo.to(x.dtype)) * (v_hi - v_lo)
    return torch.where(valid.any(-1), out, torch.zeros_like(out))


def cppo_thresholds(
    p: Tensor, q: Tensor, mask: Tensor, *, delta: float, w_min: float, delta_b: float, dynamic_budget: bool
) -> tuple[Tensor, Tensor]:
    """CPPO weighted divergence Z_t = w_t |p - q| and threshold c_t [B, T] (zeros at mask == 0)."""
    valid = mask > 0
    d = torch.where(valid, (p - q).abs(), torch.zeros_like(p))
    n = valid.sum(-1, keepdim=True).to(d.dtype)  # loss tokens per sequence
    pos = (torch.cumsum(valid.to(d.dtype), -1) - 1.0).clamp_min(0.0)  # zero-based loss-token index
    w = torch.where(valid, 1.0 - (1.0 - w_min) * pos / (n - 1.0).clamp_min(1.0), torch.zeros_like(d))
    z = w * d
    s_prev = F.pad(torch.cumsum(z, -1)[..., :-1], (1, 0))  # exclusive prefix sums, loss tokens only
    w_prev = F.pad(torch.cumsum(w, -1)[..., :-1], (1, 0))
    if dynamic_budget:
        budget = _row_quantile(d, valid, 0.9).clamp(delta_b, 2.0 * delta_b)[:, None]
    else:
        budget = torch.full_like(n, delta_b)
    c = (delta + torch.where(w_prev > 0, budget * w_prev, 0.0) - s_prev).clamp_max(delta)  # inf * 0 at t = 1: nan
    return z, torch.where(valid, c, torch.zeros_like(c))


def cppo_keep(
    p: Tensor,
    q: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    delta: float,
    w_min: float,
    delta_b: float,
    dynamic_budget: bool,
) -> Tensor:
    """CPPO keep [B, T] bool: [A (r-1) <= 0] or [Z_t <= c_t]; False at mask == 0."""
    z, c = cppo_thresholds(
        p, q, mask, delta=delta, w_min=w_min, delta_b=delta_b, dynamic_budget=dynamic_budget
    )
    diverging = ((adv > 0) & (p > q)) | ((adv < 0) & (p < q))
    return (~diverging | (z <= c)) & (mask > 0)


@TRUST_REGIONS.register(
    "cppo",
    paper="arXiv:2606.10968",
    ranges={"delta": ">=0", "w_min": "(0, 1]", "delta_b": ">=0"},
    tags=("vanilla_at_one", "zero_adv_inert"),
)
def cppo(
    inp: LossInputs,
    log_ratio: Tensor,
    *,
    delta: float = 0.15,
    w_min: float = 0.8,
    delta_b: float = 0.02,
    dynamic_budget: bool = True,
) -> tuple[Tensor, Metrics]:
    """Mask diverging tokens against a position-weighted prefix budget of Binary-TV (CPPO).

    arXiv:2606.10968 (Eq. 8-11, 22). D = |p - q|, w linear from 1 (first loss token) to w_min (last),
    Z = w D, c_t = min(delta, delta + b W_{t-1} - S_{t-1}) with prefix sums over loss tokens only,
    b = clamp(P90 of the sequence's D, delta_b, 2 delta_b) (dynamic) or delta_b; keep = [A(r-1) <= 0] or
    [Z <= c]; l = -sg(keep) A r. Monotonicity in earlier D_j holds for the fixed budget only (a larger D_j
    can raise the dynamic P90 budget). Top-K CPPO scores are not implemented (Binary-TV, as the code).
    """
    p, q = (x.exp() for x in _log_pq(inp, log_ratio))
    keep = cppo_keep(
        p, q, inp.adv, inp.mask, delta=delta, w_min=w_min, delta_b=delta_b, dynamic_budget=dynamic_budget
    )
    ratio = _ratio(log_ratio)
    first = 2.0 * inp.positions < inp.mask.sum(-1, keepdim=True)  # position relative to the sequence's length
    metrics = {
        "mask_frac": _frac(~keep, inp.mask),
        "mask_frac_first_half": _frac(~keep, inp.mask * first),
        "mask_frac_second_half": _frac(~keep, inp.mask * ~first),
    }
    return -keep.to(ratio.dtype) * inp.adv * ratio, metrics


def drpo_token_weight(p: Tensor, q: Tensor, adv: Tensor, delta: float) -> Tensor:
    """DRPO gradient weight w = 1 - sign(A) (p - q) / delta (0 on the TV boundary, < 0 beyond it)."""
    return 1.0 - torch.sign(adv) * (p - q) / delta


@TRUST_REGIONS.register("drpo", paper="arXiv:2606.09821", ranges={"delta": ">0"},
                        tags=("vanilla_at_one", "zero_adv_inert"))
def drpo(inp: LossInputs, log_ratio: Tensor, *, delta: float = 0.2) -> tuple[Tensor, Metrics]:
    """Replace DPPO's hard mask by a smooth Binary-TV penalty (DRPO).

    arXiv:2606.09821. l = -A r + |A| sg(q) (r - 1)^2 / (2 delta); gradient -A r w grad lp with
    w = 1 - sign(A) (p - q) / delta. Convention: delta = 0.2, not the paper's 12.5, with which |p - q| <= 1
    never reaches the boundary (w stays in [0.92, 1.08]); 0.2 lets the boundary bind.
    """
    lp, lq = _log_pq(inp, log_ratio)
    p, q = lp.exp(), lq.exp()
    ratio = _ratio(log_ratio)
    adv = inp.adv
    loss = -adv * ratio + adv.abs() * q.to(ratio.dtype) * (ratio - 1.0) ** 2 / (2.0 * delta)
    w = drpo_token_weight(p, q, adv, delta)
    valid = inp.mask > 0
    metrics = {
        "weight_mean": torch.where(valid, w, torch.zeros_like(w)).sum() / valid.sum().clamp_min(1),
        "beyond_frac": _frac(w < 0, inp.mask),
    }
    return loss, metrics
