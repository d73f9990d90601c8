"""The critic's loss for value-based presets (PPO with GAE): a pure function like every other part of the maths."""

from __future__ import annotations

import torch
from torch import Tensor


def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float) -> Tensor:
    """Clip the value update: 0.5 * max((V - R)^2, (V_clip - R)^2) with V_clip = V_old + clamp(V - V_old, -eps, eps).

    arXiv:1707.06347 (PPO, as in OpenAI baselines); token mean over ``mask`` [B, T].
    Convention: clipping around the rollout-time values V_old, range ``clip`` = eps_v (verl's cliprange_value).
    """
    v_clip = old_values + (values - old_values).clamp(-clip, clip)
    loss = 0.5 * torch.maximum((values - returns) ** 2, (v_clip - returns) ** 2)
    return (loss * mask).sum() / mask.sum().clamp_min(1.0)
