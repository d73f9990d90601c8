"""Preference objectives as trust regions: DPO, IPO, SimPO, KTO and the Humanline variants of DPO and KTO.

They run on the same learner and aggregation as the RL presets. A sequence's *implicit reward* is read from
``inp.logp`` and ``inp.ref_logp``; which completion is preferred is read from the sign and order of its group
advantage ``inp.adv`` (any group-relative estimator keeps the order of the rewards), within ``inp.group_ids``.
The offline source (``rollout.preference``) gives groups of two, chosen (reward 1) and rejected (reward 0).

Pairs (DPO, IPO, SimPO, Humanline-DPO). ``pairs="all"``: every ordered pair (i, j) of one group whose advantages
differ by more than 1e-6, i chosen (the higher one); ``pairs="best_worst"``: one pair per group, the first
sequence with the group's highest advantage against the first with its lowest. A group's loss L_g is the mean of
its pair losses (0 without a pair); every sequence of the group that has loss tokens carries L_g, spread evenly
over its tokens, so ``seq_mean_token_sum`` gives (1/N) sum_g n_g L_g: with groups of two (offline) exactly the
papers' mean over pairs; online, the mean over groups, a group without a preference counting as zero (as a
zero-variance group does in GRPO). A group must lie inside one micro-batch (tag ``whole_groups``; the builder
refuses a micro-batch size that splits groups). Each sequence's loss is placed on its own tokens, so aggregation
and the contract's masking rules apply unchanged.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from polyrl.registry import TRUST_REGIONS
from polyrl.types import LossInputs

TIE = 1e-6  # advantages closer than this are a tie: no pair, no KTO label
Pairs = Literal["all", "best_worst"]


def _sum(x: Tensor, mask: Tensor) -> Tensor:
    """[B] sum of ``x`` over each sequence's loss tokens (padding never leaks in)."""
    return torch.where(mask > 0, x, torch.zeros_like(x)).sum(-1)


def _seq_adv(inp: LossInputs) -> Tensor:
    """[B] each sequence's advantage: the mean over its loss tokens (0 for a sequence without loss tokens)."""
    return _sum(inp.adv.detach(), inp.mask) / inp.mask.sum(-1).clamp_min(1.0)


def _ref(inp: LossInputs, name: str) -> Tensor:
    if inp.ref_logp is None:
        raise ValueError(f"trust region {name!r} needs LossInputs.ref_logp (the frozen reference's log-probs)")
    return inp.ref_logp


def _place(seq_loss: Tensor, mask: Tensor) -> Tensor:
    """[B, T] ``seq_loss`` [B] spread evenly over each sequence's loss tokens (their sum is the sequence's loss)."""
    per_token = seq_loss[:, None] / mask.sum(-1, keepdim=True).clamp_min(1.0)
    return torch.where(mask > 0, per_token.expand_as(mask), torch.zeros_like(mask, dtype=seq_loss.dtype))


def pair_weights(adv: Tensor, group_ids: Tensor, has: Tensor, pairs: Pairs = "all") -> Tensor:
    """[B, B] weight of pair (i chosen, j rejected): 1/(pairs of the group) for each pair formed, else 0."""
    same = (group_ids[:, None] == group_ids[None, :]) & has[:, None] & has[None, :]
    better = same & (adv[:, None] - adv[None, :] > TIE)
    if pairs == "best_worst":
        keep = torch.zeros_like(better)
        for g in torch.unique(group_ids[has]):
            rows = torch.nonzero((group_ids == g) & has).squeeze(-1)
            a = adv[rows]
            i, j = rows[int(torch.argmax(a))], rows[int(torch.argmin(a))]
            keep[i, j] = better[i, j]
        better = keep
    count = (better.to(adv.dtype).sum(-1, keepdim=True) * same.to(adv.dtype)).sum(0)  # [B] pairs in i's group
    return better.to(adv.dtype) / count.clamp_min(1.0)[:, None]


def _pairwise(inp: LossInputs, score: Tensor, pair_loss, pairs: Pairs,
              beta: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token loss from per-sequence scores [B] and a pair loss f(score_chosen - score_rejected) [B, B].
    ``reward_margin`` is the mean implicit-reward margin beta (score_c - score_r) of the pairs formed, as TRL's
    ``rewards/margins``."""
    if inp.group_ids is None:
        raise ValueError("preference trust regions need LossInputs.group_ids (pairs are formed within groups)")
    has = inp.mask.sum(-1) > 0
    w = pair_weights(_seq_adv(inp), inp.group_ids, has, pairs)  # [B, B], no grad
    diff = score[:, None] - score[None, :]  # [B, B]
    formed = w > 0
    losses = torch.where(formed, pair_loss(torch.where(formed, diff, torch.zeros_like(diff))), 0.0)
    by_chosen = (w * losses).sum(-1)  # [B] the weighted losses of the pairs where i is chosen
    same = (inp.group_ids[:, None] == inp.group_ids[None, :]).to(score.dtype)
    group_loss = torch.where(has, same @ by_chosen, torch.zeros_like(by_chosen))  # [B] L_g of each sequence's group
    n = formed.sum().clamp_min(1)
    margins = torch.where(formed, diff.detach(), 0.0)
    metrics = {"pairs": formed.sum().to(torch.float32), "reward_margin": beta * margins.sum() / n,
               "reward_accuracy": (formed & (margins > 0)).sum().to(torch.float32) / n}
    return _place(group_loss, inp.mask), metrics


def _band(z: Tensor, mask: Tensor, lo: float, hi: float) -> tuple[Tensor, Tensor]:
    """Humanline clamp of per-token log-ratios (zero gradient outside [lo, hi]) and the detached fraction clamped."""
    out = ((z.detach() < lo) | (z.detach() > hi)) & (mask > 0)
    return z.clamp(lo, hi), out.sum().to(torch.float32) / (mask > 0).sum().clamp_min(1)


_DPO = {"beta": ">0"}
_BAND = {"log_eps_p": "<=0", "log_eps_r": ">=0"}
# "labels": each sequence's advantage is read as its preference label (its order in the group, or its sign);
# "ignores_ratio": the loss reads log-probs (the policy's, the reference's), never log_ratio: --ratio and --anchor
# change nothing, so they are refused (tests/test_contract.py checks it)
_TAGS = ("needs_ref", "whole_groups", "labels", "ignores_ratio")


@TRUST_REGIONS.register("dpo", paper="arXiv:2305.18290", ranges=_DPO, tags=_TAGS)
def dpo(inp: LossInputs, log_ratio: Tensor, *, beta: float = 0.1,
        pairs: Pairs = "all") -> tuple[Tensor, dict[str, Tensor]]:
    """Direct Preference Optimization: -log sigmoid(beta (h_c - h_r)) over the group's preference pairs.

    arXiv:2305.18290. h = sum_t (lp_t - lp_ref_t), the sequence's log-ratio to the frozen reference (the implicit
    reward is beta h). Convention: TRL's and HALOs' sigmoid loss, beta 0.1, mean over pairs (no label smoothing).
    """
    h = _sum(inp.logp - _ref(inp, "dpo"), inp.mask)
    return _pairwise(inp, h, lambda d: -F.logsigmoid(beta * d), pairs, beta)


@TRUST_REGIONS.register("ipo", paper="arXiv:2310.12036", ranges=_DPO, tags=_TAGS)
def ipo(inp: LossInputs, log_ratio: Tensor, *, beta: float = 0.1,
        pairs: Pairs = "all") -> tuple[Tensor, dict[str, Tensor]]:
    """Identity Preference Optimization: (h_c - h_r - 1/(2 beta))^2 over the group's preference pairs.

    arXiv:2310.12036. h = mean_t (lp_t - lp_ref_t), the log-ratio averaged over the sequence's tokens.
    Convention: TRL's (loss_type "ipo" averages the log-probs over tokens); beta (tau in the paper) 0.1.
    """
    n = inp.mask.sum(-1).clamp_min(1.0)
    h = _sum(inp.logp - _ref(inp, "ipo"), inp.mask) / n
    return _pairwise(inp, h, lambda d: (d - 1.0 / (2.0 * beta)) ** 2, pairs, beta)


@TRUST_REGIONS.register("simpo", paper="arXiv:2405.14734", ranges={"beta": ">0", "gamma": ">=0"},
                        tags=("whole_groups", "labels", "ignores_ratio"))
def simpo(inp: LossInputs, log_ratio: Tensor, *, beta: float = 2.0, gamma: float = 1.0,
          pairs: Pairs = "all") -> tuple[Tensor, dict[str, Tensor]]:
    """SimPO: -log sigmoid(beta (s_c - s_r) - gamma), s = mean_t lp_t, with no reference model.

    arXiv:2405.14734. The reward is the length-normalised log-likelihood; gamma is the target margin.
    Convention: the paper's recipe beta 2.0, gamma = 0.5 beta = 1.0 (TRL's CPO simpo defaults are beta 0.1,
    simpo_gamma 0.5); reads no ref_logp, so the preset scores no reference.
    """
    s = _sum(inp.logp, inp.mask) / inp.mask.sum(-1).clamp_min(1.0)
    return _pairwise(inp, s, lambda d: -F.logsigmoid(beta * d - gamma), pairs, beta)


@TRUST_REGIONS.register("humanline_dpo", paper="arXiv:2509.24207", ranges={**_DPO, **_BAND}, tags=_TAGS)
def humanline_dpo(inp: LossInputs, log_ratio: Tensor, *, beta: float = 0.1, log_eps_p: float = -1.0,
                  log_eps_r: float = 1.5, pairs: Pairs = "all") -> tuple[Tensor, dict[str, Tensor]]:
    """Humanline DPO: the DPO loss with h = sum_t clamp(lp_t - lp_ref_t, log_eps_p, log_eps_r).

    arXiv:2509.24207. A token whose log-ratio lies outside the band adds a constant to h and no gradient.
    Convention: HALOs' band defaults (-1.0, 1.5); the preset syncs the reference to the policy every step (HALOs),
    so with one optimizer step per batch h = 0 when the loss is computed and the band binds from the second
    epoch on (--epochs-per-batch) [assumed: the clamp form of spec section 20, not HALOs' older Beta sampling].
    """
    z, frac = _band(inp.logp - _ref(inp, "humanline_dpo"), inp.mask, log_eps_p, log_eps_r)
    loss, metrics = _pairwise(inp, _sum(z, inp.mask), lambda d: -F.logsigmoid(beta * d), pairs, beta)
    return loss, {**metrics, "band_frac": frac}


def _kto(inp: LossInputs, h: Tensor, beta: float, desirable_weight: float,
         undesirable_weight: float) -> tuple[Tensor, dict[str, Tensor]]:
    has = inp.mask.sum(-1) > 0
    adv = _seq_adv(inp)
    good, bad = has & (adv > TIE), has & (adv < -TIE)
    z0 = (torch.where(has, h.detach(), 0.0).sum() / has.sum().clamp_min(1)).clamp_min(0.0)
    loss = torch.where(good, desirable_weight * (1 - torch.sigmoid(beta * (h - z0))), 0.0)
    loss = loss + torch.where(bad, undesirable_weight * (1 - torch.sigmoid(beta * (z0 - h))), 0.0)
    metrics = {"z0": z0.to(torch.float32), "desirable_frac": good.sum().to(torch.float32) / has.sum().clamp_min(1)}
    return _place(loss, inp.mask), metrics


_KTO = {"beta": ">0", "desirable_weight": ">=0", "undesirable_weight": ">=0"}


@TRUST_REGIONS.register("kto", paper="arXiv:2402.01306", ranges=_KTO, tags=("needs_ref", "labels", "ignores_ratio"))
def kto(inp: LossInputs, log_ratio: Tensor, *, beta: float = 0.1, desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0) -> tuple[Tensor, dict[str, Tensor]]:
    """Kahneman-Tversky Optimization: w_D (1 - sigmoid(beta (h - z0))) if desirable, w_U (1 - sigmoid(beta (z0 - h))).

    arXiv:2402.01306. h = sum_t (lp_t - lp_ref_t); desirable = group advantage > 0, undesirable = < 0, a tie has
    no loss. z0 = max(0, mean of sg(h) over the micro-batch's sequences), detached. Convention: HALOs and TRL
    estimate z0 from mismatched (prompt, completion) pairs with an extra forward pass; we use the batch's own
    completions (for samples of the policy, the Monte Carlo estimate of KL(pi || pi_ref); [assumed] for offline
    rows). Like HALOs' per-micro-batch z0, the loss depends on the micro-batch size. Defaults: beta 0.1, w 1, 1.
    """
    return _kto(inp, _sum(inp.logp - _ref(inp, "kto"), inp.mask), beta, desirable_weight, undesirable_weight)


@TRUST_REGIONS.register("humanline_kto", paper="arXiv:2509.24207", ranges={**_KTO, **_BAND},
                        tags=("needs_ref", "labels", "ignores_ratio"))
def humanline_kto(inp: LossInputs, log_ratio: Tensor, *, beta: float = 0.1, desirable_weight: float = 1.0,
                  undesirable_weight: float = 1.0, log_eps_p: float = -1.0,
                  log_eps_r: float = 1.5) -> tuple[Tensor, dict[str, Tensor]]:
    """Humanline KTO: the KTO loss with h = sum_t clamp(lp_t - lp_ref_t, log_eps_p, log_eps_r).

    arXiv:2509.24207. z0 is the mean clamped reward [assumed: the spec gives the clamp, not where z0 is taken].
    Convention: HALOs' band defaults (-1.0, 1.5); the preset syncs the reference every step, as humanline_dpo.
    """
    z, frac = _band(inp.logp - _ref(inp, "humanline_kto"), inp.mask, log_eps_p, log_eps_r)
    loss, metrics = _kto(inp, _sum(z, inp.mask), beta, desirable_weight, undesirable_weight)
    return loss, {**metrics, "band_frac": frac}
