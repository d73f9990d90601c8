"""Contract tests generated over every registered part (ARCHITECTURE.md section 1).

A part added with one decorator line is picked up here automatically.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import polyrl.methods  # noqa: F401  (registers every part)
from polyrl.objectives import build_method, policy_loss
from polyrl.objectives.method_checks import moot_on_policy
from polyrl.registry import (
    ADVANTAGES,
    AGGREGATIONS,
    CORRECTIONS,
    FILTERS,
    KL,
    RATIOS,
    SHAPERS,
    TRUST_REGIONS,
)
from tests.helpers import make_inputs

TR_NAMES = TRUST_REGIONS.names()


def _method(tr: str, ratio: str = "token", agg: str = "token_mean"):
    return build_method("contract", advantage="grpo", ratio=ratio, trust_region=tr, aggregation=agg)


def _garbage(inp, seed: int = 1):
    """Copy of ``inp`` with wild values at every masked (padding) position."""
    g = torch.Generator().manual_seed(seed)
    pad = inp.mask == 0
    noise = lambda x, scale: torch.where(pad, torch.randn(x.shape, generator=g, dtype=x.dtype) * scale, x)  # noqa: E731
    leaf = inp.topk_logp.detach().clone()
    leaf[..., 0] = noise(leaf[..., 0], 7.0)
    leaf.requires_grad_(True)
    return dataclasses.replace(
        inp,
        logp=leaf[..., 0],
        topk_logp=leaf,
        old_logp=noise(inp.old_logp, 7.0),
        rollout_logp=noise(inp.rollout_logp, 7.0),
        ref_logp=noise(inp.ref_logp, 7.0),
        adv=noise(inp.adv, 50.0),
        entropy=noise(inp.entropy, 30.0).abs(),
        segment_ids=torch.where(pad, torch.randint(0, 5, inp.mask.shape, generator=g), inp.segment_ids),
        turn_ids=torch.where(pad, torch.randint(0, 5, inp.mask.shape, generator=g), inp.turn_ids),
    )


@pytest.mark.parametrize("name", TR_NAMES)
def test_trust_region_shapes_metrics_and_masking(name):
    inp = make_inputs(seed=3)
    out = policy_loss(inp, _method(name))
    assert out.per_token_loss.shape == inp.mask.shape
    assert out.per_token_loss.dtype == torch.float64
    assert out.loss.dim() == 0 and torch.isfinite(out.loss)
    for key, value in out.metrics.items():
        assert isinstance(value, torch.Tensor) and value.dim() == 0, key
        assert not value.requires_grad, f"metric {key} carries gradient"
    # Garbage at padded positions changes neither the loss nor the gradient of real tokens.
    g1 = torch.autograd.grad(out.loss, inp.topk_logp, allow_unused=True)[0]
    noisy = _garbage(inp)
    out2 = policy_loss(noisy, _method(name))
    torch.testing.assert_close(out2.loss, out.loss, rtol=1e-10, atol=1e-12)
    g2 = torch.autograd.grad(out2.loss, noisy.topk_logp, allow_unused=True)[0]
    if g1 is not None:
        real = inp.mask > 0
        torch.testing.assert_close(g2[real], g1[real], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", TR_NAMES)
def test_nan_at_padded_positions_reaches_neither_loss_nor_gradient(name):
    """aggregation.py's promise, for the whole composition: a NaN log-prob or advantage where mask == 0 (a padded
    pi_old, an unfilled slot) leaves the loss and every gradient, padded positions' included, finite."""
    inp = make_inputs(seed=3)
    out = policy_loss(inp, _method(name))
    g1 = torch.autograd.grad(out.loss, inp.topk_logp, allow_unused=True)[0]
    pad = inp.mask == 0
    nan = lambda x: None if x is None else torch.where(pad, torch.full_like(x, float("nan")), x)  # noqa: E731
    nan_k = lambda x: torch.where(pad[..., None], torch.full_like(x, float("nan")), x)  # noqa: E731
    noisy = dataclasses.replace(inp, old_logp=nan(inp.old_logp), rollout_logp=nan(inp.rollout_logp),
                                ref_logp=nan(inp.ref_logp), adv=nan(inp.adv), old_topk_logp=nan_k(inp.old_topk_logp),
                                rollout_topk_logp=nan_k(inp.rollout_topk_logp))
    out2 = policy_loss(noisy, _method(name))
    torch.testing.assert_close(out2.loss, out.loss, rtol=1e-10, atol=1e-12)
    g2 = torch.autograd.grad(out2.loss, noisy.topk_logp, allow_unused=True)[0]
    if g1 is not None:
        assert torch.isfinite(g2).all(), f"{name}: nan gradient at {(~torch.isfinite(g2)).nonzero().tolist()[:4]}"
        torch.testing.assert_close(g2, g1, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", TR_NAMES)
@pytest.mark.parametrize("extreme", [20.0, -20.0])
def test_trust_region_gradients_finite_at_extreme_log_ratios(name, extreme):
    inp = make_inputs(seed=4)
    inp = dataclasses.replace(inp, old_logp=inp.logp.detach() - extreme, rollout_logp=inp.logp.detach() - extreme,
                              ref_logp=inp.logp.detach() - extreme)
    out = policy_loss(inp, _method(name))
    (grad,) = torch.autograd.grad(out.loss, inp.topk_logp, allow_unused=True)
    assert torch.isfinite(out.loss)
    if grad is not None:
        assert torch.isfinite(grad).all()


@pytest.mark.parametrize("name", [s.name for s in TRUST_REGIONS if "vanilla_at_one" in s.tags])
def test_vanilla_gradient_at_ratio_one(name):
    """At pi_theta == pi_old == mu == ref the gradient is the plain -A * grad(logp) (summed per token)."""
    inp = make_inputs(seed=5, same_policies=True)
    out = policy_loss(inp, build_method("c", advantage="grpo", trust_region=name, aggregation="seq_mean_token_sum"))
    (grad,) = torch.autograd.grad(out.loss, inp.topk_logp)
    expected = torch.zeros_like(grad)
    expected[..., 0] = -inp.adv * inp.mask / inp.normalizer.num_seqs
    torch.testing.assert_close(grad, expected, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("name", TR_NAMES)
def test_trust_regions_moot_under_the_on_policy_ratio_give_the_plain_gradient(name):
    """``moot_on_policy`` (an override of an on_policy method with such a trust region is refused as having no effect)
    holds exactly for those whose gradient under ratio 'on_policy' is the plain policy gradient ('none'), over
    policies that differ (pi_theta, pi_old, mu, ref) and every aggregation."""
    same = True
    for seed, agg in enumerate(AGGREGATIONS.names()):
        inp = make_inputs(seed=20 + seed, spread=1.0)
        grads = [torch.autograd.grad(policy_loss(inp, _method(tr, "on_policy", agg)).loss, inp.topk_logp)[0]
                 for tr in (name, "none")]
        same = same and torch.allclose(*grads, rtol=1e-9, atol=1e-12)
    assert same == moot_on_policy(name)


def _zero_adv_rows_break(method) -> float:
    """The largest way ``method`` breaks what ``zero_adv_inert`` promises (0.0: it keeps it), over one batch with
    rows 1, 4 and 6 at A = 0: (a) eight one-row micro-batches give the whole batch's loss and gradient; (b) the
    zero-advantage rows get no gradient; (c) the other rows alone give the same loss and gradient."""
    inp = make_inputs(B=8, T=9, seed=11, lengths=[9, 3, 7, 1, 5, 9, 2, 6], group_size=4, spread=1.0)
    adv = inp.adv.clone()
    adv[[1, 4, 6]] = 0.0
    inp = dataclasses.replace(inp, adv=adv)
    full = policy_loss(inp, method).loss
    (g_full,) = torch.autograd.grad(full, inp.topk_logp)
    one_by_one = sum(policy_loss(inp.rows(slice(i, i + 1)), method).loss for i in range(8))
    (g_split,) = torch.autograd.grad(one_by_one, inp.topk_logp)
    live = policy_loss(inp.rows(torch.tensor([0, 2, 3, 5, 7])), method).loss
    (g_live,) = torch.autograd.grad(live, inp.topk_logp)
    return max(float((one_by_one - full).detach().abs()), float((g_split - g_full).abs().max()),
               float(g_full[[1, 4, 6]].abs().max()), float((live - full).detach().abs()),
               float((g_live - g_full).abs().max()))


@pytest.mark.parametrize("name", [s.name for s in TRUST_REGIONS if "zero_adv_inert" in s.tags])
def test_zero_advantage_rows_are_inert(name):
    """What lets the update run all-zero-advantage rows without a backward (update.py): for every ratio and
    aggregation, rows are independent and a row with A = 0 everywhere has no gradient and adds no loss."""
    for ratio in RATIOS.names():
        for agg in AGGREGATIONS.names():
            method = build_method("inert", advantage="grpo", ratio=ratio, trust_region=name, aggregation=agg)
            assert _zero_adv_rows_break(method) < 1e-12, (ratio, agg)
    for corr in CORRECTIONS.names():
        method = build_method("inert", advantage="grpo", trust_region=name, aggregation="token_mean",
                              corrections=[corr])
        assert _zero_adv_rows_break(method) < 1e-12, corr


@pytest.mark.parametrize("name", ["bapo", "clip_cov", "dro", "kto", "troll", "dpo"])
def test_untagged_trust_regions_break_zero_advantage_inertness(name):
    """The check above can fail: these couple rows (bapo's adaptive bounds, clip_cov's batch covariance, kto's
    reference point, dpo's pairs) or give A = 0 rows a gradient (dro's squared residual, troll's projection)."""
    assert "zero_adv_inert" not in TRUST_REGIONS.spec(name).tags
    method = build_method("coupled", advantage="grpo", trust_region=name, aggregation="token_mean")
    assert _zero_adv_rows_break(method) > 1e-9


@pytest.mark.parametrize("name", [s.name for s in TRUST_REGIONS if "ignores_ratio" in s.tags])
def test_trust_regions_that_ignore_the_ratio_give_one_loss_for_every_ratio_and_anchor(name):
    """What lets --ratio and --anchor be refused with them (method_checks.check_overrides): the loss and its gradient
    are the same whichever ratio and anchor feed it, over policies that differ (pi_theta, pi_old, mu, ref)."""
    inp = make_inputs(seed=5, spread=1.0)
    losses = []
    for ratio in RATIOS.names():
        for anchor in ("old", "rollout"):
            method = dataclasses.replace(_method(name, ratio), anchor=anchor)
            loss = policy_loss(inp, method).loss
            losses.append((loss.detach(), torch.autograd.grad(loss, inp.topk_logp)[0]))
    for loss, grad in losses[1:]:
        torch.testing.assert_close(loss, losses[0][0], rtol=0, atol=0)
        torch.testing.assert_close(grad, losses[0][1], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["clip", "cispo", "dppo_tv"])
def test_trust_regions_that_read_the_ratio_differ_by_ratio_or_anchor(name):
    """The check above can fail: a trust region that reads the ratio gives another loss under another ratio or
    anchor."""
    assert "ignores_ratio" not in TRUST_REGIONS.spec(name).tags
    inp = make_inputs(seed=5, spread=1.0)
    losses = {policy_loss(inp, dataclasses.replace(_method(name, r), anchor=a)).loss.item()
              for r in ("token", "sequence") for a in ("old", "rollout")}
    assert len(losses) > 1


@pytest.mark.parametrize("name", RATIOS.names())
def test_ratio_is_zero_at_same_policy_and_ignores_padding(name):
    inp = make_inputs(seed=6, same_policies=True)
    fn = RATIOS.fn(name)
    lr = fn(inp.logp, inp.old_logp, inp.mask, inp.segment_ids, inp.turn_ids)
    assert lr.shape == inp.mask.shape
    torch.testing.assert_close(lr * inp.mask, torch.zeros_like(lr))
    inp2 = make_inputs(seed=6)
    noisy = _garbage(inp2)
    a = fn(inp2.logp, inp2.old_logp, inp2.mask, inp2.segment_ids, inp2.turn_ids)
    b = fn(noisy.logp, noisy.old_logp, noisy.mask, noisy.segment_ids, noisy.turn_ids)
    real = inp2.mask > 0
    torch.testing.assert_close(a[real], b[real])


@pytest.mark.parametrize("name", ADVANTAGES.names())
def test_advantage_shapes_and_no_grad(name):
    inp = make_inputs(seed=7)
    B, T = inp.mask.shape
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 2, (B,), generator=g).double().requires_grad_(True)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = ADVANTAGES.fn(name)(rewards, inp.group_ids, inp.mask, values, None)
    assert adv.shape in ((B,), (B, T))
    assert not adv.requires_grad
    assert torch.isfinite(adv).all()


@pytest.mark.parametrize("name", CORRECTIONS.names())
def test_correction_is_detached_and_one_without_mismatch(name):
    inp = make_inputs(seed=8)
    old = inp.old_logp.clone().requires_grad_(True)
    w = CORRECTIONS.fn(name)(old, inp.old_logp, inp.mask, inp.adv)
    assert w.shape == inp.mask.shape and not w.requires_grad
    torch.testing.assert_close(w * inp.mask, inp.mask)


@pytest.mark.parametrize("name", KL.names())
def test_kl_zero_at_reference_and_shape(name):
    inp = make_inputs(seed=9, same_policies=True)
    kl = KL.fn(name)(inp.logp, inp.ref_logp, inp.old_logp)
    assert kl.shape == inp.mask.shape
    torch.testing.assert_close(kl, torch.zeros_like(kl))


@pytest.mark.parametrize("name", AGGREGATIONS.names())
def test_aggregation_is_scalar_and_masked(name):
    inp = make_inputs(seed=10)
    loss = torch.randn(inp.mask.shape, dtype=torch.float64)
    out = AGGREGATIONS.fn(name)(loss, inp.mask, inp.normalizer, inp.group_tokens)
    assert out.dim() == 0
    loss2 = torch.where(inp.mask > 0, loss, torch.full_like(loss, float("nan")))
    torch.testing.assert_close(AGGREGATIONS.fn(name)(loss2, inp.mask, inp.normalizer, inp.group_tokens), out)


@pytest.mark.parametrize("name", SHAPERS.names())
def test_shaper_keeps_shape_and_short_answers(name):
    r = torch.tensor([1.0, 0.0, 1.0])
    out = SHAPERS.fn(name)(r, torch.tensor([1, 2, 64]), torch.tensor([False, False, True]), 64)
    assert out.shape == r.shape
    assert out[2] < r[2]  # the longest (truncated) answer is never rewarded more


@pytest.mark.parametrize("name", FILTERS.names())
def test_filter_returns_bool_per_sample(name):
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])
    keep = FILTERS.fn(name)(r, torch.tensor([0, 0, 1, 1]), torch.tensor([False, True, False, False]), {})
    assert keep.dtype == torch.bool and keep.shape == r.shape
