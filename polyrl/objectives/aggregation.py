"""Loss aggregation: per-token losses [B, T] -> this micro-batch's share of the step loss.

Every mode divides a *sum* over the micro-batch by a global denominator from the step's
``Normalizer`` (computed once, before the micro-batch loop). Summing the returned values over the
micro-batches of a step therefore reproduces the full-batch loss exactly, and so does its gradient
(``tests/test_invariance.py``). Formulas: shared/spec/objectives-llm.md section 0.4.

Conventions chosen where frameworks disagree:
- seq_mean_token_sum_norm divides by N (sequences) *and* by the constant horizon (verl Aug-2026;
  TRL's dr_grpo is the same: sum / (batch_size * max_completion_length)).
- A sequence with no loss tokens counts in no denominator (``Normalizer.num_seqs`` skips it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from polyrl.registry import AGGREGATIONS
from polyrl.types import Normalizer


def _masked(per_token_loss: Tensor, mask: Tensor) -> Tensor:
    # where() rather than a product, so that garbage (even NaN) at padded positions never leaks in.
    return torch.where(mask > 0, per_token_loss, torch.zeros_like(per_token_loss))


@AGGREGATIONS.register("token_mean", paper="arXiv:2503.14476")
def token_mean(per_token_loss: Tensor, mask: Tensor, norm: Normalizer, group_tokens: Tensor | None) -> Tensor:
    """Average over every loss token of the step (DAPO): sum_{i,t} m*l / sum_{i,t} m."""
    return _masked(per_token_loss, mask).sum() / norm.num_tokens


@AGGREGATIONS.register("seq_mean_token_mean", paper="arXiv:2402.03300")
def seq_mean_token_mean(
    per_token_loss: Tensor, mask: Tensor, norm: Normalizer, group_tokens: Tensor | None
) -> Tensor:
    """Average tokens within each sequence, then sequences (GRPO paper): (1/N) sum_i sum_t m*l / |y_i|."""
    per_seq = _masked(per_token_loss, mask).sum(-1) / mask.sum(-1).clamp_min(1.0)
    return per_seq.sum() / norm.num_seqs


@AGGREGATIONS.register("seq_mean_token_sum", paper="arXiv:2402.14740")
def seq_mean_token_sum(
    per_token_loss: Tensor, mask: Tensor, norm: Normalizer, group_tokens: Tensor | None
) -> Tensor:
    """Sum tokens within each sequence, average sequences (REINFORCE/RLOO): (1/N) sum_i sum_t m*l."""
    return _masked(per_token_loss, mask).sum() / norm.num_seqs


@AGGREGATIONS.register("seq_mean_token_sum_norm", paper="arXiv:2503.20783")
def seq_mean_token_sum_norm(
    per_token_loss: Tensor, mask: Tensor, norm: Normalizer, group_tokens: Tensor | None
) -> Tensor:
    """Sum tokens, divide by a constant horizon, average sequences (Dr. GRPO): (1/N) sum_i sum_t m*l / L."""
    return _masked(per_token_loss, mask).sum() / (norm.num_seqs * norm.horizon)


@AGGREGATIONS.register("prompt_mean", paper="arXiv:2510.13786")
def prompt_mean(per_token_loss: Tensor, mask: Tensor, norm: Normalizer, group_tokens: Tensor | None) -> Tensor:
    """Token-average within each prompt's group, then average prompts (ScaleRL).

    (1/P) sum_p [ sum_{i in p} sum_t m*l / sum_{i in p} sum_t m ]; ``group_tokens`` [B] holds each
    sequence's group token total over the whole step, so a group split across micro-batches still
    uses its full denominator.
    """
    if group_tokens is None:
        raise ValueError("aggregation 'prompt_mean' needs LossInputs.group_tokens (per-sequence group token totals)")
    per_seq = _masked(per_token_loss, mask).sum(-1) / group_tokens.to(per_token_loss.dtype).clamp_min(1.0)
    return per_seq.sum() / norm.num_prompts


@AGGREGATIONS.register("token_sum", paper="arXiv:2503.20783", ranges={"scale": ">0"})
def token_sum(per_token_loss: Tensor, mask: Tensor, norm: Normalizer, group_tokens: Tensor | None, *,
              scale: float = 1.0) -> Tensor:
    """Sum every loss token of the step, divided by a constant only: sum_{i,t} m*l / scale.

    No data-dependent denominator at all (Dr. GRPO's argument taken to its end: every token weighs the same
    whatever the batch's lengths and sizes), so the gradient grows with the number of tokens per step; ``scale``
    (a constant) sets its size.
    Convention: verl has no "token-sum" mode (its modes are token-mean, seq-mean-token-sum, seq-mean-token-mean and
    seq-mean-token-sum-norm; the newest seq-mean-token-sum-norm is sum / loss_scale_factor per micro-batch, then
    x 1/grad-accumulation); TRL has none either. We divide by ``scale`` alone (default 1: the plain sum), which is
    micro-batch invariant exactly [assumed: the brief's "sum of per-token losses over the whole step batch"].
    """
    return _masked(per_token_loss, mask).sum() / scale
