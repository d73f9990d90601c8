"""Importance-ratio granularity: which log-ratio each token's loss sees.

Every function returns ``log_ratio`` [B, T]. Coarser granularities (sequence, segment, turn) put
the *same value* on every token of the unit -- the mean of the token log-ratios, i.e. the log of
the geometric mean of the token ratios -- while the gradient stays per token. The anchor (pi_old
or the rollout policy mu) is chosen by the method; ratio functions never detach ``logp``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from polyrl.registry import RATIOS


def _unit_mean(log_ratio: Tensor, mask: Tensor, unit_ids: Tensor) -> Tensor:
    """Replace each token's value by the masked mean of its unit (same row, same id) [B, T]."""
    B, T = log_ratio.shape
    ids = unit_ids.long()
    ids = ids - ids.min()  # non-negative local ids
    n_units = int(ids.max()) + 1
    flat = torch.arange(B, device=ids.device)[:, None] * n_units + ids  # [B, T] unique per (row, unit)
    m = mask.to(log_ratio.dtype)
    sums = torch.zeros(B * n_units, dtype=log_ratio.dtype, device=log_ratio.device)
    sums = sums.index_add(0, flat.reshape(-1), (torch.where(m > 0, log_ratio, 0.0) * m).reshape(-1))
    counts = torch.zeros(B * n_units, dtype=log_ratio.dtype, device=log_ratio.device)
    counts = counts.index_add(0, flat.reshape(-1), m.reshape(-1))
    means = sums / counts.clamp_min(1.0)
    return means[flat]


@RATIOS.register("token", paper="arXiv:1707.06347")
def token(
    logp: Tensor, anchor_logp: Tensor, mask: Tensor, segment_ids: Tensor | None, turn_ids: Tensor | None
) -> Tensor:
    """Token ratio (PPO/GRPO): log rho_t = lp_t - lp_anchor_t."""
    return logp - anchor_logp.detach()


@RATIOS.register("sequence", paper="arXiv:2507.18071")
def sequence(
    logp: Tensor, anchor_logp: Tensor, mask: Tensor, segment_ids: Tensor | None, turn_ids: Tensor | None
) -> Tensor:
    """Sequence ratio (GSPO): log s_i = mean_t (lp - lp_anchor) on every token of y_i; gradient (1/|y_i|) grad lp."""
    return _unit_mean(logp - anchor_logp.detach(), mask, torch.zeros_like(mask, dtype=torch.long))


@RATIOS.register("sequence_token", paper="arXiv:2507.18071")
def sequence_token(
    logp: Tensor, anchor_logp: Tensor, mask: Tensor, segment_ids: Tensor | None, turn_ids: Tensor | None
) -> Tensor:
    """GSPO-token: value log s_i = sg(mean_t log rho_t), gradient of each token's own lp_t."""
    seq = sequence(logp, anchor_logp, mask, segment_ids, turn_ids).detach()
    return seq + logp - logp.detach()


@RATIOS.register("segment", paper="arXiv:2511.04256")
def segment(
    logp: Tensor, anchor_logp: Tensor, mask: Tensor, segment_ids: Tensor | None, turn_ids: Tensor | None
) -> Tensor:
    """Sub-sentence ratio (SSPO): geometric mean of the token ratios of each segment (ids from segment_ids).

    [unverified] The paper's exact form was not readable; we take the assumed form of the spec
    (sec. 17): s_{i,k} = exp(mean_{t in k} log rho_t).
    """
    if segment_ids is None:
        raise ValueError("ratio 'segment' needs LossInputs.segment_ids [B, T] (sub-sentence index of each token)")
    return _unit_mean(logp - anchor_logp.detach(), mask, segment_ids)


@RATIOS.register("turn", paper="arXiv:2511.20718")
def turn(
    logp: Tensor, anchor_logp: Tensor, mask: Tensor, segment_ids: Tensor | None, turn_ids: Tensor | None
) -> Tensor:
    """Turn ratio (ST-PPO): r_k = exp(mean_{t in turn k} log rho_t) on every agent token of turn k."""
    if turn_ids is None:
        raise ValueError("ratio 'turn' needs LossInputs.turn_ids [B, T] (agent-turn index of each token)")
    return _unit_mean(logp - anchor_logp.detach(), mask, turn_ids)


@RATIOS.register("on_policy", paper="Williams 1992")
def on_policy(
    logp: Tensor, anchor_logp: Tensor, mask: Tensor, segment_ids: Tensor | None, turn_ids: Tensor | None
) -> Tensor:
    """Ratio identically 1 with the gradient of lp (REINFORCE): log_ratio = lp - sg(lp)."""
    return logp - logp.detach()
