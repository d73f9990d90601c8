"""Plain data types shared by every layer.

Shapes: ``B`` = sequences (completions), ``T`` = completion tokens (right-padded), ``K`` = top-K
support size, ``C`` = reward channels. ``mask`` is a float tensor of 0/1 marking the tokens that
count for the loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import ClassVar

import torch
from torch import Tensor


@dataclass(frozen=True)
class Normalizer:
    """Global denominators for loss aggregation, computed once per optimizer step.

    Every aggregation divides a micro-batch's *sum* by these numbers, so that splitting the step's
    batch into micro-batches (or across data-parallel ranks) and summing the pieces gives exactly
    the loss and gradient of the whole batch.

    Convention: the counts come from the response mask *before* any trust-region mask or
    rejection-style correction, so a token dropped by DPPO, IcePop or MIS leaves the numerator but
    keeps its place in the denominator (slime's convention; verl removes it from both).
    """

    num_tokens: float  # loss tokens in the whole step batch
    num_seqs: float  # sequences with at least one loss token
    num_prompts: float  # distinct groups (prompts) with at least one loss token
    horizon: float  # constant length L for seq_mean_token_sum_norm (Dr. GRPO); max generation length

    @staticmethod
    def from_batch(mask: Tensor, group_ids: Tensor, horizon: float | None = None) -> Normalizer:
        """Build the step's normalizer from the full (not micro-batched) mask [B, T] and group ids [B]."""
        tokens_per_seq = mask.sum(dim=-1)  # [B]
        has_tokens = tokens_per_seq > 0
        return Normalizer(
            num_tokens=float(tokens_per_seq.sum().clamp_min(1.0)),
            num_seqs=float(has_tokens.sum().clamp_min(1)),
            num_prompts=float(max(1, torch.unique(group_ids[has_tokens]).numel())),
            horizon=float(horizon if horizon is not None else mask.shape[-1]),
        )


def group_token_counts(mask: Tensor, group_ids: Tensor) -> Tensor:
    """Total loss tokens of each sequence's group, per sequence [B] (for prompt_mean aggregation).

    Compute it on the full step batch before splitting into micro-batches.
    """
    tokens_per_seq = mask.sum(dim=-1)  # [B]
    _, inverse = torch.unique(group_ids, return_inverse=True)
    totals = torch.zeros(int(inverse.max()) + 1 if inverse.numel() else 0, dtype=tokens_per_seq.dtype)
    totals.index_add_(0, inverse, tokens_per_seq)
    return totals[inverse]


@dataclass
class LossInputs:
    """Everything any trust region, correction or KL estimator may need for one micro-batch.

    Only ``logp`` carries gradient. Optional fields are ``None`` when the rollout did not produce
    them; a part that needs a missing field raises a clear error.
    """

    logp: Tensor  # [B, T] log pi_theta of the sampled tokens (with grad)
    old_logp: Tensor  # [B, T] log pi_old, recomputed by the trainer before the update (no grad)
    adv: Tensor  # [B, T] advantages broadcast to tokens (no grad)
    mask: Tensor  # [B, T] 1.0 for tokens that count for the loss
    normalizer: Normalizer
    rollout_logp: Tensor | None = None  # [B, T] log mu reported by the rollout engine (defaults to old_logp)
    ref_logp: Tensor | None = None  # [B, T] log pi_ref of the frozen reference model
    entropy: Tensor | None = None  # [B, T] entropy of pi_theta at each position (no grad needed)
    group_ids: Tensor | None = None  # [B] prompt/group id of each sequence
    group_tokens: Tensor | None = None  # [B] total loss tokens of the sequence's group (whole step)
    segment_ids: Tensor | None = None  # [B, T] sub-sentence index of each token (SSPO)
    turn_ids: Tensor | None = None  # [B, T] agent-turn index of each token (ST-PPO)
    topk_ids: Tensor | None = None  # [B, T, K] token ids of the rollout policy's top-K support
    topk_logp: Tensor | None = None  # [B, T, K] log pi_theta at topk_ids (with grad)
    old_topk_logp: Tensor | None = None  # [B, T, K] log pi_old at topk_ids
    rollout_topk_logp: Tensor | None = None  # [B, T, K] log mu at topk_ids
    sample_weight: Tensor | None = None  # [B] weight of each sequence's whole loss, KL included (importance weights)

    def __post_init__(self) -> None:
        if self.rollout_logp is None:
            self.rollout_logp = self.old_logp
        if self.adv.dim() == 1:
            self.adv = self.adv[:, None].expand_as(self.logp)

    # The per-token inputs a part may read (logp too: a token the trainer's filters leave out is -inf there).
    PADDED: ClassVar[tuple[str, ...]] = ("logp", "old_logp", "rollout_logp", "ref_logp", "adv", "old_topk_logp",
                                         "rollout_topk_logp")

    def padding_zeroed(self) -> LossInputs:
        """The same inputs with 0 wherever mask == 0. Parts mask their loss, but a padded position's product in the
        backward (0 * nan) or a batch statistic (BAPO's search) would still carry a nan or inf placed there (an unfilled
        pi_old slot); ``torch.where`` passes logp's gradient there on as 0, never 0 * nan."""
        pad = self.mask == 0
        zeroed = {}
        for name in self.PADDED:
            x = getattr(self, name)
            if x is not None:
                where = pad if x.dim() == pad.dim() else pad[..., None]
                zeroed[name] = torch.where(where, torch.zeros((), dtype=x.dtype, device=x.device), x)
        return replace(self, **zeroed)

    def rows(self, index: Tensor | slice) -> LossInputs:
        """The same inputs restricted to some sequences (a micro-batch); the normalizer stays global."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value[index] if isinstance(value, Tensor) else value
        return LossInputs(**out)

    @property
    def positions(self) -> Tensor:
        """[B, T] zero-based index of each token among the loss tokens of its sequence."""
        return (torch.cumsum(self.mask, dim=-1) - 1.0).clamp_min(0.0) * self.mask


@dataclass
class LossOutput:
    """What ``policy_loss`` returns: a scalar to minimise, the per-token loss and detached metrics."""

    loss: Tensor  # [] this micro-batch's share of the step loss (sum / global normalizer)
    per_token_loss: Tensor  # [B, T] after corrections and KL, before aggregation
    surrogate: Tensor | None = None  # [B, T] the trust region's own per-token loss (diagnostics)
    metrics: dict[str, Tensor] = field(default_factory=dict)  # 0-dim, detached


@dataclass
class TreeInfo:
    """Where each sample sits in its rollout tree (B samples; ``polyrl.rollout.tree``)."""

    root_ids: Tensor  # [B] long: root group (pool index of the prompt); every sample has one
    sibling_ids: Tensor  # [B] long: sibling group of its deepest branching anchor, -1 if none
    branch_at: Tensor  # [B] long: completion index where the sibling part starts (0 if none)
    is_root: Tensor  # [B] bool: sampled from the prompt (False: a continuation of a prefix)
