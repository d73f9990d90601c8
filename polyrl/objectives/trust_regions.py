"""Ratio-based trust regions: the per-token surrogate given a log-ratio.

Each function takes ``(inp: LossInputs, log_ratio [B, T])`` and keyword settings, and returns
``(per_token_loss [B, T], metrics)`` where the loss is to be *minimised* and metrics are detached
0-dim tensors (the composition prefixes them with ``objective/``). Masking and aggregation happen in the
composition, not here. Log-ratios are clamped to [-20, 20] before ``exp`` so gradients stay finite; convention
(verl's too): past |log rho| = 20 a token has no gradient, even where the region keeps one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from polyrl.registry import TRUST_REGIONS
from polyrl.types import LossInputs

LOG_RATIO_CLAMP = 20.0


def _frac(cond: Tensor, mask: Tensor) -> Tensor:
    """Detached fraction of masked tokens where ``cond`` holds."""
    m = mask > 0
    return (cond & m).sum().detach().to(torch.float32) / m.sum().clamp_min(1)


def _check_clip(p: dict) -> str | None:
    c = p.get("dual_clip_c")
    if c is not None and c <= 1.0:
        return f"parameter 'dual_clip_c' = {c} must be > 1 (or None to disable dual-clip)"
    return None


@TRUST_REGIONS.register(
    "clip",
    paper="arXiv:1707.06347",
    ranges={"eps_low": "[0, 1)", "eps_high": ">=0"},
    check=_check_clip,
    tags=("vanilla_at_one", "zero_adv_inert"),
)
def clip(
    inp: LossInputs,
    log_ratio: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip_c: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with asymmetric bounds (DAPO clip-higher) and optional dual-clip.

    l_t = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A); with dual-clip c (arXiv:1912.09729),
    for A < 0: l_t = min(l_t, -c A), which caps the loss at c|A| with zero gradient when rho > c.
    Convention: dual-clip is off by default (PPO paper, TRL); verl always applies it with c = 3.
    """
    adv = inp.adv
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    unclipped = -ratio * adv
    clipped = -ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    loss = torch.maximum(unclipped, clipped)
    metrics = {"clip_frac": _frac(clipped > unclipped, inp.mask)}
    if dual_clip_c is not None:
        capped = torch.minimum(loss, -dual_clip_c * adv)
        loss = torch.where(adv < 0, capped, loss)
        capped_mask = (adv < 0) & (loss.detach() < torch.maximum(unclipped, clipped))
        metrics["dual_clip_frac"] = _frac(capped_mask, inp.mask)
    return loss, metrics


@TRUST_REGIONS.register("none", paper="Williams 1992", tags=("vanilla_at_one", "zero_adv_inert"))
def none(inp: LossInputs, log_ratio: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """No trust region: l_t = -rho_t A_t (REINFORCE with the on_policy ratio, unclipped IS otherwise)."""
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    return -ratio * inp.adv, {}


_EPS = {"eps_low": "[0, 1)", "eps_high": ">=0"}
_V1 = ("vanilla_at_one", "zero_adv_inert")  # what they promise: tests/test_contract.py, Method.zero_adv_rows_inert


def _mean(x: Tensor, mask: Tensor) -> Tensor:
    """Detached mean of ``x`` over the mask == 1 tokens."""
    return torch.where(mask > 0, x.detach(), torch.zeros_like(x)).sum() / mask.sum().clamp_min(1.0)


def _unit_grad(log_ratio: Tensor) -> Tensor:
    """Value 1 with the gradient of ``log_ratio`` (= rho / sg(rho) without exp overflow)."""
    return 1.0 + log_ratio - log_ratio.detach()


def _unit_mean(x: Tensor, mask: Tensor, ids: Tensor | None) -> Tensor:
    """Detached mean of ``x`` over the mask == 1 tokens of each (row, id) unit, on every token [B, T]."""
    m = mask > 0
    x = torch.where(m, x.detach(), torch.zeros_like(x))
    ids = torch.zeros_like(x, dtype=torch.long) if ids is None else torch.where(m, ids.long(), 0)
    ids = ids - ids.min()
    n = int(ids.max()) + 1
    flat = (torch.arange(x.shape[0], device=x.device)[:, None] * n + ids).reshape(-1)
    sums = x.new_zeros(x.shape[0] * n).index_add(0, flat, x.reshape(-1))
    counts = x.new_zeros(x.shape[0] * n).index_add(0, flat, m.to(x.dtype).reshape(-1))
    return (sums / counts.clamp_min(1.0))[flat].view_as(x)


@TRUST_REGIONS.register("cispo", paper="arXiv:2506.13585", ranges=_EPS, tags=_V1)
def cispo(inp: LossInputs, log_ratio: Tensor, *, eps_high: float = 0.2,
          eps_low: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip the detached importance weight and keep every token's gradient (CISPO, MiniMax-M1).

    arXiv:2506.13585. Gradient surrogate l_t = -sg(r_hat) A (1 + log rho - sg(log rho)), r_hat = clip(rho,
    1 - eps_low, 1 + eps_high): value -r_hat A, gradient exactly -r_hat A grad lp (none through the clip).
    Convention: the cap is 1 + eps_high (paper form, verl, slime); TRL and ms-swift cap at eps_high itself
    (their 5.0 is our eps_high=4.0). eps_low=None: no lower bound (the paper's effectively infinite eps_low);
    eps_high = 0.2 [unverified].
    """
    ratio = log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    low = None if eps_low is None else 1.0 - eps_low
    capped = (ratio > 1.0 + eps_high) | (ratio < (0.0 if low is None else low))  # ratio > 0 always
    r_hat = ratio.clamp(low, 1.0 + eps_high)
    return -r_hat * inp.adv * _unit_grad(log_ratio), {"clip_frac": _frac(capped, inp.mask)}


@TRUST_REGIONS.register(
    "ce_gppo",
    paper="arXiv:2509.20712",
    ranges={**_EPS, "beta1": ">=0", "beta2": ">=0"},
    check=_check_clip,
    tags=_V1,
)
def ce_gppo(
    inp: LossInputs,
    log_ratio: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    beta1: float = 0.5,
    beta2: float = 1.0,
    dual_clip_c: float | None = 10.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Keep a scaled, constant-weight gradient on clipped tokens (CE-GPPO gradient-preserving clipping).

    arXiv:2509.20712. A<0 & rho<1-eps_low: l = -beta1 (1-eps_low) A rho/sg(rho); A>0 & rho>1+eps_high:
    l = -beta2 (1+eps_high) A rho/sg(rho) (constant value, gradient -beta (1 +- eps) A grad lp); else
    l = -rho A; then dual-clip for A<0: l = min(l, -c A). Convention (authors' code): beta1 is the A<0
    low-ratio side, beta2 the A>0 high-ratio side; dual-clip c = 10 by default (authors' scripts), None = off.
    """
    adv = inp.adv
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    low = (adv < 0) & (ratio.detach() < 1.0 - eps_low)
    high = (adv > 0) & (ratio.detach() > 1.0 + eps_high)
    one = _unit_grad(log_ratio)
    loss = torch.where(low, -beta1 * (1.0 - eps_low) * adv * one, -ratio * adv)
    loss = torch.where(high, -beta2 * (1.0 + eps_high) * adv * one, loss)
    metrics = {"clip_frac": _frac(low | high, inp.mask)}
    if dual_clip_c is not None:
        capped = (adv < 0) & (loss.detach() > -dual_clip_c * adv)
        loss = torch.where(capped, -dual_clip_c * adv, loss)
        metrics["dual_clip_frac"] = _frac(capped, inp.mask)
    return loss, metrics


@TRUST_REGIONS.register("pspo", paper="arXiv:2509.21282", ranges={"alpha": "[0, 1]"},
                        tags=("scaled_at_one", "zero_adv_inert"))
def pspo(inp: LossInputs, log_ratio: Tensor, *, alpha: float = 0.1) -> tuple[Tensor, dict[str, Tensor]]:
    """Smooth the ratio toward 1 instead of clipping it (PSPO probability smoothing).

    arXiv:2509.21282. pi_s = (1 - alpha) pi + alpha pi_old, so r_s = (1 - alpha) rho + alpha and l_t = -r_s A,
    no clip: gradient -(1 - alpha) rho A grad lp, never zero; at rho = 1 it is (1 - alpha) times REINFORCE's.
    [unverified] alpha = 0.1 is our assumption: the paper's default was not found.
    """
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    return -((1.0 - alpha) * ratio + alpha) * inp.adv, {}


@TRUST_REGIONS.register("sapo", paper="arXiv:2511.20347", ranges={"tau_pos": ">0", "tau_neg": ">0"}, tags=_V1)
def sapo(
    inp: LossInputs, log_ratio: Tensor, *, tau_pos: float = 1.0, tau_neg: float = 1.05
) -> tuple[Tensor, dict[str, Tensor]]:
    """Replace the hard clip by a temperature-controlled sigmoid gate (SAPO, Qwen).

    arXiv:2511.20347. f(rho) = sigmoid(tau (rho - 1)) 4/tau, tau = tau_pos if A > 0 else tau_neg; l_t = -f A.
    Gradient -4 s (1 - s) rho A grad lp (s the sigmoid): exactly -A grad lp at rho = 1, decaying smoothly
    off-policy; the value at rho = 1 is -2A/tau. Defaults from the ms-swift/TRL/AReaL docs (TRL aggregates
    loss_type "sapo" as seq_mean_token_mean). Metric gate_mean: mean of 4 s (1 - s), 1 on-policy.
    """
    adv = inp.adv
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    tau = torch.where(adv > 0, adv.new_tensor(tau_pos), adv.new_tensor(tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0))
    return -gate * (4.0 / tau) * adv, {"gate_mean": _mean(4.0 * gate * (1.0 - gate), inp.mask)}


@TRUST_REGIONS.register("spo", paper="arXiv:2401.16025", ranges={"eps": ">0"}, tags=_V1)
def spo(inp: LossInputs, log_ratio: Tensor, *, eps: float = 0.2) -> tuple[Tensor, dict[str, Tensor]]:
    """Replace the hard clip by a quadratic penalty on rho - 1 (SPO, Simple Policy Optimization).

    arXiv:2401.16025. l_t = -(rho A - |A| (rho - 1)^2 / (2 eps)): the objective peaks at rho = 1 + sign(A) eps
    and pulls rho back beyond it; gradient -(A - |A| (rho - 1) / eps) rho grad lp. [unverified] default
    eps = 0.2. Metric outside_frac: tokens with |rho - 1| > eps.
    """
    adv = inp.adv
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    loss = -(ratio * adv - adv.abs() * (ratio - 1.0) ** 2 / (2.0 * eps))
    return loss, {"outside_frac": _frac((ratio.detach() - 1.0).abs() > eps, inp.mask)}


def _check_humanline(p: dict) -> str | None:
    if not p["log_eps_p"] < 0.0 < p["log_eps_r"]:
        lo, hi = p["log_eps_p"], p["log_eps_r"]
        return f"parameters 'log_eps_p' = {lo} and 'log_eps_r' = {hi} must satisfy log_eps_p < 0 < log_eps_r"
    return None


@TRUST_REGIONS.register("humanline", paper="arXiv:2509.24207", ranges=_EPS, check=_check_humanline, tags=_V1)
def humanline(
    inp: LossInputs,
    log_ratio: Tensor,
    *,
    log_eps_p: float = -1.0,
    log_eps_r: float = 1.5,
    eps_low: float = 0.01,
    eps_high: float = 0.01,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clamp the log-ratio to a band, then apply the PPO clip (Humanline clipping).

    arXiv:2509.24207. z_t = clamp(log rho_t, log_eps_p, log_eps_r), zero gradient outside the band for both
    signs of A; l_t = -min(e^z A, clip(e^z, 1 - eps_low, 1 + eps_high) A). Convention: the band is applied to
    the method's log-ratio. Humanline's synced reference doubles as pi_old (HALOs), so the preset syncs the
    reference every step and anchors to pi_old; then lp - lp_ref == this log-ratio. Defaults: HALOs' (eps 0.01).
    """
    z = log_ratio.clamp(log_eps_p, log_eps_r)
    loss, metrics = clip(inp, z, eps_low=eps_low, eps_high=eps_high)
    out = (log_ratio.detach() < log_eps_p) | (log_ratio.detach() > log_eps_r)
    return loss, {**metrics, "band_frac": _frac(out, inp.mask)}


@TRUST_REGIONS.register("s_ppo", paper="arXiv:2511.20718", ranges={**_EPS, "bias_coef": ">=0"}, tags=_V1)
def s_ppo(
    inp: LossInputs, log_ratio: Tensor, *, eps_low: float = 0.2, eps_high: float = 0.2, bias_coef: float = 1.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """Down-weight heavily clipped sequences in the PPO clip loss (S-PPO clipping-bias correction).

    arXiv:2511.20718. [unverified] The paper's formula was not readable; this is our operationalisation:
    l_t = PPO clip loss * sg(1 / (1 + bias_coef b_i)), b_i = mean over sequence i's mask == 1 tokens of
    |rho_t - clip(rho_t, 1 - eps_low, 1 + eps_high)| (0 when nothing is clipped, so equal to clip on-policy).
    ST-PPO = this with ratio=turn. Metric clip_bias: mean b_i over sequences with loss tokens.
    """
    ratio = log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    bias = _unit_mean((ratio - ratio.clamp(1.0 - eps_low, 1.0 + eps_high)).abs(), inp.mask, None)  # [B, T]
    loss, metrics = clip(inp, log_ratio, eps_low=eps_low, eps_high=eps_high)
    has = (inp.mask > 0).any(-1)
    clip_bias = torch.where(has, bias[:, 0], 0.0).sum() / has.sum().clamp_min(1)
    return loss / (1.0 + bias_coef * bias), {**metrics, "clip_bias": clip_bias}


def _check_sspo(p: dict) -> str | None:
    if p["min_scale"] > p["max_scale"]:
        return f"parameter 'min_scale' = {p['min_scale']} must be <= 'max_scale' = {p['max_scale']}"
    if p["eps_low"] * p["max_scale"] >= 1.0:
        return f"parameter 'eps_low' = {p['eps_low']} times 'max_scale' = {p['max_scale']} must be < 1"
    return None


def entropy_scale(
    entropy: Tensor, mask: Tensor, ids: Tensor | None, ref: float, lo: float, hi: float
) -> Tensor:
    """SSPO bound scale per token [B, T]: clamp(H_k / ref, lo, hi), H_k the mean entropy of its segment."""
    return (_unit_mean(entropy, mask, ids) / ref).clamp(lo, hi)


@TRUST_REGIONS.register(
    "sspo_clip",
    paper="arXiv:2511.04256",
    ranges={**_EPS, "entropy_ref": ">0", "min_scale": ">=0", "max_scale": ">0"},
    check=_check_sspo,
    tags=_V1,
)
def sspo_clip(
    inp: LossInputs,
    log_ratio: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    entropy_ref: float = 1.0,
    min_scale: float = 0.5,
    max_scale: float = 2.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Widen the PPO clip on high-entropy segments and narrow it on low-entropy ones (SSPO).

    arXiv:2511.04256. [unverified] Assumed form (spec sec. 17): scale_k = clamp(H_k / entropy_ref, min_scale,
    max_scale), H_k = mean entropy of the token's segment (segment_ids; whole sequence when None); PPO clip
    with bounds [1 - eps_low scale_k, 1 + eps_high scale_k]. Full SSPO pairs it with ratio=segment.
    """
    if inp.entropy is None:
        raise ValueError("trust region 'sspo_clip' needs LossInputs.entropy [B, T] (entropy per token)")
    scale = entropy_scale(inp.entropy, inp.mask, inp.segment_ids, entropy_ref, min_scale, max_scale)
    adv = inp.adv
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    unclipped = -ratio * adv
    clipped = -torch.clamp(ratio, 1.0 - eps_low * scale, 1.0 + eps_high * scale) * adv
    metrics = {"clip_frac": _frac(clipped > unclipped, inp.mask), "clip_scale": _mean(scale, inp.mask)}
    return torch.maximum(unclipped, clipped), metrics
