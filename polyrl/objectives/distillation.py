"""On-policy distillation's advantage: the task's group-centred reward plus a dense per-token teacher reward.

The per-token reward arrives as ``token_rewards`` [B, T]: the method's KL placed in the reward, which for the
``opd`` preset (k1 x kl_coef) is kl_coef (log pi_teacher(y_t) - log pi_old(y_t)) -- minus the reverse-KL
estimate of each token the student sampled (``polyrl.distill``: the teacher is the scored reference).

How the references combine the two signals (and which we pick):
- Tinker cookbook (Thinking Machines' "On-Policy Distillation" recipe, ``incorporate_kl_penalty``): task
  advantage = reward - group mean on every token; the teacher term kl_coef (mean_batch d - d_t) with
  d_t = log pi_student - log pi_teacher is ADDED to it -- centred by its mean over all loss tokens of the
  batch, never divided by a std; discounted future sum with ``kl_discount_factor`` (0 in the recipes).
- prime-rl (``adv_tau * A + teacher_tau * (teacher_logprob - trainer_logprob)``): added raw, not centred.
- OpenRLHF-style REINFORCE++ with gamma = 0 (``reinforce_pp``) would put the task reward on the last token only
  and whiten the sum by the batch's token std; neither reference does either, so ``opd`` is its own estimator.
We follow Tinker: centre = True by default (a constant baseline, which lowers the variance; center=False gives
prime-rl's raw term), no whitening, gamma = 0, the task advantage on every token.
"""

from __future__ import annotations

import torch
from torch import Tensor

from polyrl.objectives.advantages import _floats, _group_stats
from polyrl.registry import ADVANTAGES


def _discounted(x: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = sum over later loss tokens s >= t of gamma^(number of loss tokens between) x_s; 0 at padding."""
    if gamma == 0:
        return torch.where(mask > 0, x, torch.zeros_like(x))
    out = torch.zeros_like(x)
    acc = torch.zeros_like(x[:, 0])
    for t in range(x.shape[-1] - 1, -1, -1):
        on = mask[:, t] > 0
        acc = torch.where(on, x[:, t] + gamma * acc, acc)
        out[:, t] = torch.where(on, acc, torch.zeros_like(acc))
    return out


@ADVANTAGES.register("opd", paper="arXiv:2306.13649", ranges={"task_weight": ">=0", "gamma": "[0, 1]"},
                     tags=("needs_groups", "per_token_rewards"))
def opd(
    rewards: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
    *,
    task_weight: float = 1.0,
    gamma: float = 0.0,
    center: bool = True,
) -> Tensor:
    """Add the teacher's per-token reward to the group-centred task advantage (on-policy distillation). [B, T].

    A_t = task_weight (r_i - mean_g r) + sum_{s >= t} gamma^(s-t) (k_s - kbar), with k_t = token_rewards_t
    (log pi_teacher - log pi_old for k1 x 1 in the reward) and kbar its mean over all loss tokens of the
    batch (center=True), 0 otherwise. Thinking Machines' "On-Policy Distillation" (2025), GKD arXiv:2306.13649.
    Convention: Tinker's (centred, not whitened, discount 0, task advantage on every token); prime-rl adds
    the teacher term uncentred (center=False). A group of one has task advantage 0, as every group estimator.
    """
    r = _floats(rewards)
    if r.dim() != 1:
        raise ValueError(f"advantage 'opd' needs rewards [B], got shape {tuple(r.shape)}")
    m = _floats(mask).to(r.dtype) > 0
    n, mean, _ = _group_stats(r, group_ids)
    task = torch.where(n > 1, r - mean, torch.zeros_like(r))
    adv = torch.where(m, task_weight * task[:, None], torch.zeros(m.shape, dtype=r.dtype, device=r.device))
    if token_rewards is None:
        return adv
    k = torch.where(m, _floats(token_rewards).to(r.dtype), torch.zeros_like(adv))
    if center:
        k = torch.where(m, k - k.sum() / m.sum().clamp_min(1), k)
    return adv + _discounted(k, m.to(r.dtype), gamma)
