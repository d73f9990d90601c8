"""Micro-batch and padding invariance of the composed loss (ARCHITECTURE.md section 1).

Splitting a step's batch into micro-batches and summing their losses (as gradient accumulation
does) must give exactly the full-batch loss and gradient, for every aggregation, because each
micro-batch divides by the step's global Normalizer. Right-padding must change nothing.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import polyrl.methods  # noqa: F401
from polyrl.objectives import build_method, policy_loss
from polyrl.registry import AGGREGATIONS
from polyrl.types import Normalizer, group_token_counts
from tests.helpers import make_inputs

TRUST_REGIONS_UNDER_TEST = ["clip", "cispo", "dppo_tv", "cppo", "drpo", "sapo"]


def _grad_of(loss_fn, inp):
    loss = loss_fn(inp)
    (g,) = torch.autograd.grad(loss, inp.topk_logp)
    return loss.detach(), g


@pytest.mark.parametrize("agg", AGGREGATIONS.names())
@pytest.mark.parametrize("tr", TRUST_REGIONS_UNDER_TEST)
def test_one_microbatch_of_8_equals_8_of_1(agg, tr):
    method = build_method("inv", advantage="grpo", trust_region=tr, aggregation=agg, kl="k3", kl_coef=0.1)
    inp = make_inputs(B=8, T=9, seed=11, lengths=[9, 3, 7, 1, 5, 9, 2, 6], group_size=4)
    full_loss = policy_loss(inp, method).loss
    (full_grad,) = torch.autograd.grad(full_loss, inp.topk_logp)

    inp2 = make_inputs(B=8, T=9, seed=11, lengths=[9, 3, 7, 1, 5, 9, 2, 6], group_size=4)
    total = torch.zeros((), dtype=torch.float64)
    for i in range(8):
        total = total + policy_loss(inp2.rows(slice(i, i + 1)), method).loss
    (acc_grad,) = torch.autograd.grad(total, inp2.topk_logp)
    torch.testing.assert_close(total, full_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(acc_grad, full_grad, rtol=1e-10, atol=1e-14)


def _pad_right(inp, extra: int):
    """Append ``extra`` padded positions (mask 0, junk values) to every [B, T] field."""
    def pad(x, value):
        if x is None or x.dim() < 2:
            return x
        shape = list(x.shape)
        shape[1] = extra
        return torch.cat([x, torch.full(shape, value, dtype=x.dtype)], dim=1)

    leaf = pad(inp.topk_logp.detach(), -3.0).requires_grad_(True)
    mask = pad(inp.mask, 0.0)
    return dataclasses.replace(
        inp, logp=leaf[..., 0], topk_logp=leaf, old_logp=pad(inp.old_logp, 2.0),
        rollout_logp=pad(inp.rollout_logp, 2.0),
        ref_logp=pad(inp.ref_logp, 2.0), adv=pad(inp.adv, 9.0), mask=mask, entropy=pad(inp.entropy, 5.0),
        segment_ids=pad(inp.segment_ids, 99), turn_ids=pad(inp.turn_ids, 99), topk_ids=pad(inp.topk_ids, 0),
        old_topk_logp=pad(inp.old_topk_logp, -3.0), rollout_topk_logp=pad(inp.rollout_topk_logp, -3.0),
    )


@pytest.mark.parametrize("agg", [a for a in AGGREGATIONS.names() if a != "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("tr", TRUST_REGIONS_UNDER_TEST + ["troll", "sspo_clip", "bapo"])
def test_right_padding_changes_nothing(agg, tr):
    method = build_method("pad", advantage="grpo", trust_region=tr, aggregation=agg, kl="k3", kl_coef=0.1)
    inp = make_inputs(B=6, T=7, seed=12)
    loss = policy_loss(inp, method).loss
    (grad,) = torch.autograd.grad(loss, inp.topk_logp)
    padded = _pad_right(make_inputs(B=6, T=7, seed=12), extra=5)
    loss_p = policy_loss(padded, method).loss
    (grad_p,) = torch.autograd.grad(loss_p, padded.topk_logp)
    torch.testing.assert_close(loss_p, loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad_p[:, :7], grad, rtol=1e-10, atol=1e-14)
    assert (grad_p[:, 7:] == 0).all()


def test_normalizer_counts_and_group_tokens():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]], dtype=torch.float64)
    gids = torch.tensor([0, 0, 1, 2])
    n = Normalizer.from_batch(mask, gids, horizon=16)
    assert (n.num_tokens, n.num_seqs, n.num_prompts, n.horizon) == (6.0, 3.0, 2.0, 16.0)
    assert group_token_counts(mask, gids).tolist() == [3.0, 3.0, 0.0, 3.0]


def test_aggregations_by_hand():
    """Hand-computed values of every aggregation on a 3-sequence, 2-prompt batch."""
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [5.0, 6.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.float64)
    gids = torch.tensor([0, 0, 1])
    n = Normalizer.from_batch(mask, gids, horizon=10)
    gt = group_token_counts(mask, gids)
    agg = lambda name: float(AGGREGATIONS.fn(name)(loss, mask, n, gt))  # noqa: E731
    assert agg("token_mean") == pytest.approx(21 / 6)
    assert agg("seq_mean_token_mean") == pytest.approx((6 / 3 + 4 / 1 + 11 / 2) / 3)
    assert agg("seq_mean_token_sum") == pytest.approx(21 / 3)
    assert agg("seq_mean_token_sum_norm") == pytest.approx(21 / (3 * 10))
    assert agg("prompt_mean") == pytest.approx(((6 + 4) / 4 + 11 / 2) / 2)


def test_prompt_mean_duplicating_a_group_and_long_response_dilution():
    """ScaleRL properties: duplicating a prompt's whole group leaves prompt_mean unchanged, and a long
    response dilutes only its own group's other responses."""
    loss = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0], [5.0, 7.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 0], [1, 1, 0]], dtype=torch.float64)
    gids = torch.tensor([0, 0, 1, 1])
    fn = AGGREGATIONS.fn("prompt_mean")

    def total(loss, mask, gids):
        return float(fn(loss, mask, Normalizer.from_batch(mask, gids), group_token_counts(mask, gids)))

    base = total(loss, mask, gids)
    assert base == pytest.approx(((1 + 2 + 3) / 3 + (5 + 7 + 1 + 1) / 4) / 2)
    dup = total(torch.cat([loss, loss[:2]]), torch.cat([mask, mask[:2]]), torch.tensor([0, 0, 1, 1, 0, 0]))
    assert dup == pytest.approx(base)
    # Lengthen response 0 (group 0): group 1's term is untouched, group 0's other response is diluted.
    long_loss, long_mask = loss.clone(), mask.clone()
    long_loss[0, 2], long_mask[0, 2] = 2.0, 1.0
    w = lambda m, g: 1.0 / group_token_counts(m, g)  # weight of each token of a sequence  # noqa: E731
    assert w(long_mask, gids)[1] < w(mask, gids)[1]
    assert w(long_mask, gids)[2] == w(mask, gids)[2]
