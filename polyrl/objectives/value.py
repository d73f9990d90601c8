"""The critic's loss for value-based presets (PPO with GAE): a pure function like every other part of the maths."""

from __future__ import annotations

import torch
from torch import Tensor

from polyrl.registry import AGGREGATIONS
from polyrl.types import Normalizer

VALUE_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum")  # need no groups


def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float,
                       agg: str = "token_mean", norm: Normalizer | None = None) -> Tensor:
    """Clip the value update: 0.5 * max((V - R)^2, (V_clip - R)^2) with V_clip = V_old + clamp(V - V_old, -eps, eps).

    arXiv:1707.06347 (PPO, as in OpenAI baselines, verl's compute_value_loss and TRL's PPOTrainer), per token,
    then aggregated over ``mask`` [B, T] by the aggregation part ``agg`` (verl's critic loss_agg_mode) with the
    denominators of ``norm`` (default: those of ``mask`` itself; a rank holding part of the rows passes the whole
    minibatch's, so the ranks' losses add up to the one-process loss). ``clip`` = 0: the unclipped 0.5 (V - R)^2.
    Convention: clipping around the rollout-time values V_old, range ``clip`` = eps_v (verl's cliprange_value); the
    0.5 factor is verl's and TRL's.
    """
    if agg not in VALUE_AGGREGATIONS:
        raise ValueError(f"value_loss_agg = {agg!r}; allowed: {', '.join(VALUE_AGGREGATIONS)}")
    loss = (values - returns) ** 2
    if clip > 0:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.maximum(loss, (v_clip - returns) ** 2)
    if norm is None and agg == "token_mean":  # any shape of mask (the MARL family's are [N])
        return 0.5 * torch.where(mask > 0, loss, torch.zeros_like(loss)).sum() / mask.sum().clamp_min(1.0)
    if norm is None:
        norm = Normalizer.from_batch(mask, torch.zeros(mask.shape[0], dtype=torch.long))
    return 0.5 * AGGREGATIONS.fn(agg)(loss, mask, norm, None)
