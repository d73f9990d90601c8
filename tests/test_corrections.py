"""Rollout/trainer mismatch corrections (spec sec 23; DeepSeek-V3.2 off-policy sequence masking)."""

from __future__ import annotations

import math

import pytest
import torch

import polyrl.objectives  # noqa: F401  (registers every part)
from polyrl.objectives.objective import build_method, policy_loss
from polyrl.registry import CORRECTIONS, PartError
from polyrl.types import LossInputs, Normalizer

D = torch.float64


def w(name, old, roll, mask=None, adv=None, **kw):
    old = torch.as_tensor(old, dtype=D)
    roll = torch.as_tensor(roll, dtype=D)
    mask = torch.ones_like(old) if mask is None else mask
    adv = torch.ones_like(old) if adv is None else adv
    return CORRECTIONS.fn(name)(old, roll, mask, adv, **kw)


@pytest.mark.parametrize("name", CORRECTIONS.names())
def test_weights_carry_no_gradient_and_are_one_when_on_policy(name):
    old = torch.randn(3, 4, dtype=D, requires_grad=True)
    roll = old.detach().clone().requires_grad_(True)
    out = w(name, old, roll)
    assert not out.requires_grad
    assert torch.equal(out, torch.ones(3, 4, dtype=D))


def test_tis_caps_and_icepop_drops():
    lr = math.log(2.5)
    assert math.isclose(float(w("tis", [[lr]], [[0.0]], cap=2.0)), 2.0)
    assert float(w("icepop", [[lr]], [[0.0]], low=0.5, high=2.0)) == 0.0
    assert math.isclose(float(w("icepop", [[math.log(1.5)]], [[0.0]])), 1.5)
    assert math.isclose(float(w("tis", [[math.log(0.1)]], [[0.0]], cap_low=0.5)), 0.5)
    assert math.isclose(float(w("tis", [[math.log(0.1)]], [[0.0]])), 0.1)  # cap_low 0 by default


def test_sequence_ratio_is_exp_sum_and_geometric_is_exp_mean():
    old = [[0.1, 0.2, 0.3]]
    roll = [[0.0, 0.0, 0.0]]
    seq = w("seq_tis", old, roll, cap=10.0)
    assert torch.allclose(seq, torch.full((1, 3), math.exp(0.6), dtype=D))
    assert torch.allclose(w("seq_tis", old, roll, cap=1.5), torch.full((1, 3), 1.5, dtype=D))
    # mis keeps the sequence ratio exp(0.6) = 1.822 inside [0.5, 2], drops it outside [0.5, 1.8]
    assert torch.allclose(w("mis", old, roll), torch.full((1, 3), math.exp(0.6), dtype=D))
    assert torch.equal(w("mis", old, roll, high=1.8), torch.zeros(1, 3, dtype=D))
    # geometric mean exp(0.2) = 1.2214: inside [1.2, 1.3], outside [1.8, 1.9] (where exp(sum) lies)
    assert torch.equal(w("geo_rs", old, roll, low=1.2, high=1.3), torch.ones(1, 3, dtype=D))
    assert torch.equal(w("geo_rs", old, roll, low=1.8, high=1.9), torch.zeros(1, 3, dtype=D))
    assert torch.equal(w("geo_rs", old, roll), torch.zeros(1, 3, dtype=D))  # default band 0.999..1.001


@pytest.mark.parametrize("name", CORRECTIONS.names())
def test_padded_garbage_is_ignored(name):
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]], dtype=D)
    old = torch.tensor([[0.1, -0.05, 0.0, 0.0], [0.02, 0.0, -0.01, 0.0]], dtype=D)
    roll = torch.zeros(2, 4, dtype=D)
    adv = torch.tensor([[-1.0] * 4, [1.0] * 4], dtype=D)
    old2 = old.clone()
    old2[mask == 0] = 1e6
    roll2 = roll.clone()
    roll2[mask == 0] = -1e6
    a = w(name, old, roll, mask, adv)
    b = w(name, old2, roll2, mask, adv)
    assert torch.equal(a, b)
    assert torch.isfinite(b).all() and torch.equal(b[mask == 0], torch.zeros(3, dtype=D))


def test_offpolicy_seq_mask_drops_negative_advantage_stale_sequences():
    # mean over loss tokens of (rollout_logp - old_logp): row 0 -> 0.2, row 1 -> 0.2, row 2 -> 0.05
    roll = torch.tensor([[0.3, 0.1, 0.0], [0.2, 0.2, 0.0], [0.05, 0.05, 0.0]], dtype=D)
    old = torch.zeros(3, 3, dtype=D)
    mask = torch.tensor([[1.0, 1.0, 0.0]] * 3, dtype=D)
    adv = torch.tensor([-1.0, 1.0, -1.0], dtype=D)  # sequence-level advantages are accepted too
    out = w("offpolicy_seq_mask", old, roll, mask, adv, delta=0.1)
    assert torch.equal(out, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]], dtype=D))
    # the direction matters: pi_old above mu (negative divergence) is never masked
    assert torch.equal(
        w("offpolicy_seq_mask", roll, old, mask, adv, delta=0.1)[0], torch.tensor([1.0, 1.0, 0.0], dtype=D)
    )


def test_ranges_and_checks():
    with pytest.raises(PartError, match="below"):
        CORRECTIONS.resolve("icepop", {"low": 2.0, "high": 1.0})
    with pytest.raises(PartError, match="below"):
        CORRECTIONS.resolve("tis", {"cap": 1.0, "cap_low": 1.5})
    with pytest.raises(PartError, match="out of range"):
        CORRECTIONS.resolve("seq_tis", {"cap": 0.0})
    with pytest.raises(PartError, match="below"):
        CORRECTIONS.resolve("geo_rs", {"low": 1.001, "high": 0.999})


def test_tis_in_composition_equals_plain_loss_when_rollout_equals_old():
    torch.manual_seed(0)
    logp = torch.randn(2, 3, dtype=D, requires_grad=True)
    old = logp.detach() + 0.1 * torch.randn(2, 3, dtype=D)
    mask = torch.ones(2, 3, dtype=D)
    g = torch.tensor([0, 0])
    norm = Normalizer.from_batch(mask, g)
    adv = torch.tensor([1.0, -1.0], dtype=D)
    plain = build_method("p", advantage="grpo", trust_region="clip", aggregation="token_mean")
    tis = build_method(
        "t", advantage="grpo", trust_region="clip", aggregation="token_mean", corrections=["tis"]
    )
    inp = LossInputs(logp=logp, old_logp=old, adv=adv, mask=mask, normalizer=norm, rollout_logp=old.clone())
    assert torch.equal(policy_loss(inp, plain).loss, policy_loss(inp, tis).loss)
    # rollout ratio 2.5 everywhere with cap 2 doubles the loss
    inp2 = LossInputs(
        logp=logp, old_logp=old, adv=adv, mask=mask, normalizer=norm, rollout_logp=old - math.log(2.5)
    )
    assert torch.allclose(policy_loss(inp2, tis).loss, 2.0 * policy_loss(inp, plain).loss)
