"""Adaptive and projected trust regions: BAPO (bounds searched per batch) and TROLL (KL projection on top-K).

Both take ``(inp: LossInputs, log_ratio [B, T])`` like every trust region and return the per-token
loss to be *minimised* with detached metrics. The ratio is r = exp(clamp(log_ratio)); its anchor
(pi_old or the rollout policy mu) is chosen by the method, as for ``clip``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from polyrl.objectives.trust_regions import LOG_RATIO_CLAMP, _frac
from polyrl.registry import TRUST_REGIONS
from polyrl.types import LossInputs

Metrics = dict[str, Tensor]
_MAX_BAPO_STEPS = 1000


def _ladder(start: float, stop: float, step: float) -> list[float]:
    """Bounds visited by the authors' loop: start, start+step, ... capped at stop (stop included)."""
    out = [start]
    while out[-1] < stop:
        out.append(min(out[-1] + step, stop))
    return out


def bapo_bounds(
    ratio: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    c_low_min: float,
    c_low_max: float,
    c_high_min: float,
    c_high_max: float,
    step: float,
    rho_0: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Search BAPO's absolute bounds (c_low, c_high) and return them with the positive share (0-dim, no grad).

    e = A min(r, c_high) if A >= 0 else A max(r, c_low); pos = sum of e > 0, neg = sum of |e|, e < 0, over
    mask == 1; pos_share = pos / (pos + neg) (1 when neg = 0). From (c_low_min, c_high_min), raise c_low by
    step up to c_low_max, then c_high up to c_high_max, stopping at the first pair with pos_share >= rho_0.
    All candidates are evaluated at once, so there is no host synchronisation.
    """
    with torch.no_grad():
        valid = mask > 0
        r = ratio.detach().to(torch.promote_types(ratio.dtype, torch.float32))
        a = torch.where(valid, adv.detach().to(r.dtype), torch.zeros_like(r))
        a_pos, a_neg = a.clamp_min(0.0), (-a).clamp_min(0.0)
        lows, highs = _ladder(c_low_min, c_low_max, step), _ladder(c_high_min, c_high_max, step)
        pos_h = torch.stack([(a_pos * r.clamp_max(h)).sum() for h in highs])  # [n_high]
        neg_l = torch.stack([(a_neg * r.clamp_min(lo)).sum() for lo in lows])  # [n_low]
        # Candidate path of the authors' loop: (low_i, high_0) for all i, then (low_max, high_j), j >= 1.
        pos = torch.cat([pos_h[:1].expand(len(lows)), pos_h[1:]])
        neg = torch.cat([neg_l, neg_l[-1:].expand(len(highs) - 1)])
        cand_low = torch.tensor(lows + [lows[-1]] * (len(highs) - 1), dtype=r.dtype, device=r.device)
        cand_high = torch.tensor([highs[0]] * len(lows) + highs[1:], dtype=r.dtype, device=r.device)
        share = torch.where(
            neg > 0, pos / (pos + neg).clamp_min(torch.finfo(r.dtype).tiny), torch.ones_like(pos)
        )
        met = share >= rho_0
        idx = torch.where(
            met.any(), met.to(torch.int64).argmax(), torch.tensor(len(met) - 1, device=r.device)
        )
        return cand_low[idx], cand_high[idx], share[idx]


def _check_bapo(p: dict) -> str | None:
    lo_min, lo_max, hi_min, hi_max = p["c_low_min"], p["c_low_max"], p["c_high_min"], p["c_high_max"]
    if not lo_min <= lo_max < 1.0 < hi_min <= hi_max:
        got = f"{lo_min}, {lo_max}, {hi_min}, {hi_max}"
        return f"need c_low_min <= c_low_max < 1 < c_high_min <= c_high_max; got {got}"
    if ((lo_max - lo_min) + (hi_max - hi_min)) / p["step"] > _MAX_BAPO_STEPS:
        return (
            f"parameter 'step' = {p['step']} gives over {_MAX_BAPO_STEPS} candidate bounds; use a larger step"
        )
    return None


@TRUST_REGIONS.register(
    "bapo",
    paper="arXiv:2510.18927",
    ranges={
        "c_low_min": "(0, 1)",
        "c_low_max": "(0, 1)",
        "c_high_min": ">1",
        "c_high_max": ">1",
        "step": ">0",
        "rho_0": "(0, 1)",
        "dual_clip_c": ">1",
    },
    check=_check_bapo,
    tags=("vanilla_at_one",),
)
def bapo(
    inp: LossInputs,
    log_ratio: Tensor,
    *,
    c_low_min: float = 0.6,
    c_low_max: float = 0.9,
    c_high_min: float = 1.2,
    c_high_max: float = 3.0,
    step: float = 0.05,
    rho_0: float = 0.5,
    dual_clip_c: float | None = 3.0,
) -> tuple[Tensor, Metrics]:
    """Clip the ratio to absolute bounds searched so positive advantages get a share >= rho_0 (BAPO).

    arXiv:2510.18927. Bounds from ``bapo_bounds`` (authors' order: c_low first, then c_high), then
    l = -min(r A, clip(r, c_low, c_high) A), dual-clip min(l, -c A) for A < 0 (the authors' code, c = 3).
    Conventions: defaults are the README's "as in the paper" ranges [0.6, 0.9] / [1.2, 3.0] (the shipped
    yaml uses [0.6, 0.8] / [1.2, 2.0]); the share counts clipped loss values as the authors' code does, so
    raising c_low can only keep or raise neg (only raising c_high restores balance; spec 15(e)2's "raising
    c_low never increases neg" holds for a count of unclipped tokens, not for this one). The search runs
    on this call's tensors: the trainer passes a whole mini-batch per call, whereas the authors all-reduce
    pos/neg across data-parallel ranks so that every rank picks the same bounds.
    """
    adv = inp.adv
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    bounds = dict(c_low_min=c_low_min, c_low_max=c_low_max, c_high_min=c_high_min, c_high_max=c_high_max)
    c_low, c_high, share = bapo_bounds(ratio, adv, inp.mask, **bounds, step=step, rho_0=rho_0)
    unclipped = -ratio * adv
    clipped = -torch.clamp(ratio, c_low.to(ratio.dtype), c_high.to(ratio.dtype)) * adv
    loss = torch.maximum(unclipped, clipped)
    metrics = {
        "clip_frac": _frac(clipped > unclipped, inp.mask),
        "c_low": c_low,
        "c_high": c_high,
        "pos_share": share,
    }
    if dual_clip_c is not None:
        capped = torch.where(adv < 0, torch.minimum(loss, -dual_clip_c * adv), loss)
        metrics["dual_clip_frac"] = _frac(capped.detach() < loss.detach(), inp.mask)
        loss = capped
    return loss, metrics


def _interp(log_pi: Tensor, log_old: Tensor, lam: Tensor) -> Tensor:
    """Normalised log of pi^(1-lam) old^lam over the last dim (lam = eta / (eta + 1), broadcast [..., 1])."""
    mixed = (1.0 - lam) * log_pi + lam * log_old
    return mixed - mixed.logsumexp(-1, keepdim=True)


def _kl(log_a: Tensor, log_b: Tensor) -> Tensor:
    """KL(a || b) over the last dim."""
    return (log_a.exp() * (log_a - log_b)).sum(-1)


def troll_interpolate(log_pi: Tensor, log_old: Tensor, eta: Tensor | float) -> Tensor:
    """Geometric path log pi_eta = (log pi + eta log old)/(eta + 1) - log Z(eta), last dim (eta <= inf)."""
    eta = torch.as_tensor(eta, dtype=log_pi.dtype, device=log_pi.device)
    lam = torch.where(torch.isinf(eta), torch.ones_like(eta), eta / (eta + 1.0))
    lam = lam.expand(log_pi.shape[:-1])[..., None]
    return _interp(log_pi, log_old, lam)


def troll_project(
    log_pi: Tensor, log_old: Tensor, *, eps_kl: float, max_iter: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Project pi onto {KL(. || old) <= eps_kl} on the geometric path; return (log pi_tilde, eta, projected).

    Inputs are normalised log-probabilities [..., K]. Where KL(pi || old) <= eps_kl, pi_tilde is pi itself.
    Elsewhere lam = eta/(eta+1) in [0, 1] is found by bisection (no grad; KL(pi_lam || old) decreases in
    lam) keeping the upper end, so KL(pi_tilde || old) <= eps_kl always; pi_tilde carries the gradient of
    log_pi with eta held constant.
    """
    with torch.no_grad():
        lp, lo = log_pi.detach(), log_old.detach()
        projected = _kl(lp, lo) > eps_kl
        low, high = torch.zeros_like(lp[..., 0]), torch.ones_like(lp[..., 0])
        for _ in range(max_iter):
            mid = 0.5 * (low + high)
            inside = _kl(_interp(lp, lo, mid[..., None]), lo) <= eps_kl
            high, low = torch.where(inside, mid, high), torch.where(inside, low, mid)
        lam = torch.where(projected, high, torch.zeros_like(high))
        eta = torch.where(lam < 1.0, lam / (1.0 - lam), torch.full_like(lam, float("inf")))
    log_tilde = torch.where(projected[..., None], _interp(log_pi, log_old, lam[..., None]), log_pi)
    return log_tilde, eta, projected


@TRUST_REGIONS.register(
    "troll",
    paper="arXiv:2510.03817",
    ranges={"eps_kl": ">0", "alpha": ">=0", "max_iter": ">=1"},
    tags=("vanilla_at_one", "needs_topk"),
)
def troll(
    inp: LossInputs, log_ratio: Tensor, *, eps_kl: float = 0.05, alpha: float = 1.0, max_iter: int = 50
) -> tuple[Tensor, Metrics]:
    """Project each token's top-K distribution into a KL ball around pi_old and use its ratio (TROLL).

    arXiv:2510.03817. On S = the K columns (those finite in both: a top-k or top-p filter can leave fewer than K),
    pi_S, old_S = topk_logp, old_topk_logp renormalised on S;
    pi_tilde = troll_project(pi_S, old_S); l = -r (pi_tilde(y) / pi_S(y)) A + alpha KL(pi_S || sg(pi_tilde)),
    y = column 0 (the sampled token). Conventions: (1) the ratio is the composition's full-vocabulary
    r = pi(y)/anchor(y) times the projection factor pi_tilde(y)/pi_S(y) (identically 1 inside the region),
    i.e. the paper's pi_tilde_S(y)/old_S(y) times the mass ratio pi(S)/old(S): at pi == old this is exactly
    REINFORCE (-A grad lp), whereas pi_S(y)/old_S(y) alone would replace grad lp by grad log pi_S(y), which
    never lowers the mass outside S. (2) eta is a constant in the backward pass (the paper differentiates
    it implicitly); the gradient outside the region is still non-zero. (3) eps_kl = 0.05, alpha = 1 and K
    are [unverified] defaults; the projection is always against pi_old's top-K, whatever the ratio anchor.
    """
    missing = [n for n in ("topk_logp", "old_topk_logp") if getattr(inp, n) is None]
    if missing:
        raise ValueError(
            f"trust region 'troll' needs LossInputs.{' and LossInputs.'.join(missing)} [B, T, K]"
        )
    dtype = torch.promote_types(inp.topk_logp.dtype, torch.float32)
    # S = the columns both distributions keep: top-k / top-p can leave fewer than K tokens (log-prob -inf), and
    # exp(-inf) * (-inf - -inf) is nan. Others get a floor exp() takes to 0, so no nan reaches a gradient.
    kept = torch.isfinite(inp.topk_logp.detach()) & torch.isfinite(inp.old_topk_logp)
    floor = torch.tensor(-1e4, dtype=dtype, device=kept.device)
    log_pi = torch.log_softmax(torch.where(kept, inp.topk_logp.to(dtype), floor), dim=-1)
    log_old = torch.log_softmax(torch.where(kept, inp.old_topk_logp.detach().to(dtype), floor), dim=-1)
    log_tilde, _, projected = troll_project(log_pi, log_old, eps_kl=eps_kl, max_iter=max_iter)
    shrink = log_tilde[..., 0] - log_pi[..., 0]  # log pi_tilde(y) / pi_S(y); exactly 0 (no grad) inside
    ratio = (log_ratio + shrink).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    pull = (log_pi.exp() * (log_pi - log_tilde.detach())).sum(-1)  # KL(pi_S || sg(pi_tilde)), 0 inside
    loss = -ratio * inp.adv + alpha * torch.where(projected, pull, torch.zeros_like(pull))
    valid = inp.mask > 0
    kl_old = _kl(log_pi.detach(), log_old)
    metrics = {
        "proj_frac": _frac(projected, inp.mask),
        "topk_kl": torch.where(valid, kl_old, torch.zeros_like(kl_old)).sum() / valid.sum().clamp_min(1),
    }
    return loss, metrics
