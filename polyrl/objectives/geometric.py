"""Sequence-weighted trust regions: GMPO (geometric mean), VESPO (Gamma kernel), and verl's DRO penalty.

GMPO and VESPO turn a sequence's token log-ratios into one sequence weight; the weight multiplies the
sequence's loss, which is put on every token of the sequence so that the usual aggregations apply.
LUSPO (arXiv:2602.05261, TRL loss_type "luspo") needs no part of its own: it is GSPO's sequence ratio
with the PPO clip and a length-weighted sequence sum, i.e. ratio "sequence" + trust region "clip" +
aggregation "seq_mean_token_sum" (preset ``luspo`` in polyrl/presets/trust.py).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from polyrl.objectives.trust_regions import _V1, LOG_RATIO_CLAMP, _frac
from polyrl.registry import TRUST_REGIONS
from polyrl.types import LossInputs


def _seq_sum(x: Tensor, mask: Tensor) -> Tensor:
    """[B] sum of ``x`` over each row's mask == 1 tokens (padding never read)."""
    return torch.where(mask > 0, x, torch.zeros_like(x)).sum(-1)


def gmpo_clip(log_ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """Sign-aware clip of the token log-ratio: min(z, eps_high) if A > 0, max(z, -eps_low) if A < 0, z if A = 0."""
    z = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.where(adv > 0, z.clamp(max=eps_high), torch.where(adv < 0, z.clamp(min=-eps_low), z))


@TRUST_REGIONS.register("gmpo", paper="arXiv:2507.20673", ranges={"eps_low": ">=0", "eps_high": ">=0"}, tags=_V1)
def gmpo(
    inp: LossInputs, log_ratio: Tensor, *, eps_low: float = 0.4, eps_high: float = 0.4
) -> tuple[Tensor, dict[str, Tensor]]:
    """Maximise the geometric mean of the clipped token ratios of each sequence (GMPO).

    arXiv:2507.20673. z_t = clip of log rho_t in log space, sign-aware: A > 0 caps it at eps_high, A < 0 floors
    it at -eps_low (the range (e^-0.4, e^0.4) by default); R_i = exp(mean_t z_t) = (prod_t clip(rho_t))^(1/|y_i|);
    l_i = -A_i R_i with A_i the mean advantage of sequence i (sequence-level advantages, as verl "geo_mean").
    Gradient -A_i R_i / |y_i| grad lp_t on each unclipped token, 0 on a clipped one. Convention: l_i is put on
    every token of sequence i, so seq_mean_token_mean gives the paper's (1/N) sum_i l_i (the preset's
    choice; verl takes torch.mean over sequences), token_mean weights sequences by length, and
    seq_mean_token_sum gives sum_t = |y_i| l_i, whose gradient at rho = 1 is exactly -A grad lp.
    Metrics: clip_frac (tokens whose z was clipped), seq_ratio_mean (mean R_i).
    """
    m = inp.mask > 0
    n = m.sum(-1).clamp_min(1)  # [B]
    adv = torch.where(m, inp.adv, 0.0)
    z = gmpo_clip(log_ratio, adv, eps_low, eps_high)
    seq_ratio = (_seq_sum(z, inp.mask) / n).exp()  # [B] geometric mean of the clipped token ratios
    seq_adv = _seq_sum(adv, inp.mask) / n  # [B]
    loss = (-seq_adv * seq_ratio)[:, None].expand_as(log_ratio)
    has = m.any(-1)
    clipped = z.detach() != log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    metrics = {
        "clip_frac": _frac(clipped, inp.mask),
        "seq_ratio_mean": torch.where(has, seq_ratio.detach(), 0.0).sum() / has.sum().clamp_min(1),
    }
    return loss, metrics


def vespo_weight(
    log_ratio: Tensor, adv: Tensor, mask: Tensor, k_pos: float, lambda_pos: float, k_neg: float, lambda_neg: float
) -> Tensor:
    """[B, T] detached phi(W) = W^k exp(lambda (1 - W)) of each token's sequence, (k, lambda) by the sign of A.

    log W_i = clamp(sum_t clamp(log rho_t, -20, 20), log 1e-8, 20) (TRL's get_gamma_weights); A >= 0 takes
    (k_pos, lambda_pos). A non-finite phi (overflow) is 0, as in TRL.
    """
    with torch.no_grad():
        log_w = _seq_sum(log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), mask)
        log_w = log_w.clamp(math.log(1e-8), LOG_RATIO_CLAMP)[:, None]  # [B, 1]
        nonneg = adv >= 0
        k = torch.where(nonneg, k_pos, k_neg).to(log_w.dtype)
        lam = torch.where(nonneg, lambda_pos, lambda_neg).to(log_w.dtype)
        phi = torch.exp(lam + k * log_w - lam * log_w.exp())
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@TRUST_REGIONS.register(
    "vespo",
    paper="arXiv:2602.10693",
    ranges={"k_pos": ">=0", "lambda_pos": ">0", "k_neg": ">=0", "lambda_neg": ">0"},
    tags=_V1,
)
def vespo(
    inp: LossInputs,
    log_ratio: Tensor,
    *,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scale each sequence's REINFORCE gradient by a smooth Gamma kernel of its importance weight (VESPO).

    arXiv:2602.10693 (TRL loss_type "vespo"). l_t = -sg(phi(W_i)) A_t lp_t, phi(W) = W^k e^(lambda (1 - W)),
    W_i = prod_t rho_t of sequence i (the product, not a geometric mean): phi(1) = 1, so the gradient at
    rho = 1 is exactly -A grad lp; phi peaks at W = k / lambda and decays to 0 for W -> 0 and W -> inf.
    Defaults (k, lambda) = (2, 3) for A >= 0 and (3, 2) for A < 0: TRL's. Convention: W is the product of
    this method's ratios, so the preset anchors them to the rollout policy (W = pi_theta / mu, the paper's
    form); TRL instead multiplies pi_theta / pi_old by its truncated train/inference token IS ratios.
    Metric phi_mean: mean phi over loss tokens.
    """
    phi = vespo_weight(log_ratio, inp.adv, inp.mask, k_pos, lambda_pos, k_neg, lambda_neg)
    m = inp.mask > 0
    phi_mean = torch.where(m, phi, 0.0).sum() / m.sum().clamp_min(1)
    return -phi * inp.adv * inp.logp, {"phi_mean": phi_mean}


@TRUST_REGIONS.register("dro", paper="arXiv:2405.19107", ranges={"beta": ">0"},
                        tags=("vanilla_at_one",))  # not zero_adv_inert: A is not a factor of its squared residual
def dro(inp: LossInputs, log_ratio: Tensor, *, beta: float = 0.05) -> tuple[Tensor, dict[str, Tensor]]:
    """Replace the clip by a quadratic log-ratio penalty on a REINFORCE term (verl loss_mode "dro").

    l_t = -(lp_t A_t - (beta / 2) (log rho_t)^2): gradient -(A_t - beta log rho_t) grad lp_t, exactly -A grad lp
    at rho = 1. verl (docs/algo/dro.md, "Direct Reward Optimization") cites no paper; [assumed] it is the
    policy half of DRO, arXiv:2405.19107, with the reference replaced by pi_old. Convention: verl's form (the
    penalty on this method's log-ratio, anchor pi_old); verl has no default beta (it must be set), ours, 0.05,
    is the value in verl's usage example. Metric abs_log_ratio: mean |log rho|.
    """
    z = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    m = inp.mask > 0
    abs_lr = torch.where(m, z.detach().abs(), 0.0).sum() / m.sum().clamp_min(1)
    return -(inp.logp * inp.adv - 0.5 * beta * z.square()), {"abs_log_ratio": abs_lr}
