"""Adaptive and projected trust regions: BAPO and TROLL (objectives/projection.py)."""

from __future__ import annotations

import pytest
import torch

from polyrl.objectives.projection import bapo_bounds, troll_interpolate, troll_project
from polyrl.registry import TRUST_REGIONS, PartError
from polyrl.types import LossInputs, Normalizer

D = torch.float64
BAPO = dict(c_low_min=0.6, c_low_max=0.9, c_high_min=1.2, c_high_max=3.0, step=0.05, rho_0=0.5)


def make_inp(logp, anchor, adv, mask=None, **kw) -> LossInputs:
    mask = torch.ones_like(logp) if mask is None else mask
    norm = Normalizer(float(mask.sum()), float(mask.shape[0]), 1.0, 1.0)
    return LossInputs(logp=logp, old_logp=anchor, adv=adv, mask=mask, normalizer=norm, **kw)


def bapo_run(ratio, adv, mask=None, **settings):
    """Loss, metrics and d loss.sum() / d logp for BAPO on given ratios (anchor chosen to give them)."""
    logp = torch.full_like(ratio, -1.0).requires_grad_(True)
    anchor = -1.0 - ratio.log()
    inp = make_inp(logp, anchor, adv, mask)
    loss, m = TRUST_REGIONS.fn("bapo")(inp, logp - anchor, **settings)
    loss.sum().backward()
    return loss.detach(), m, logp.grad


def reference_search(ratio, adv, mask, *, c_low_min, c_low_max, c_high_min, c_high_max, step, rho_0):
    """The authors' sequential loop, in plain Python floats."""
    r, a = ratio[mask > 0].tolist(), adv[mask > 0].tolist()

    def share(lo, hi):
        e = [ai * (min(ri, hi) if ai >= 0 else max(ri, lo)) for ri, ai in zip(r, a, strict=True)]
        pos, neg = sum(x for x in e if x > 0), -sum(x for x in e if x < 0)
        return 1.0 if neg <= 0 else pos / (pos + neg)

    lo, hi = c_low_min, c_high_min
    while share(lo, hi) < rho_0 and lo < c_low_max:
        lo = min(lo + step, c_low_max)
    while share(lo, hi) < rho_0 and hi < c_high_max:
        hi = min(hi + step, c_high_max)
    return lo, hi, share(lo, hi)


# ---------------------------------------------------------------- BAPO


def test_bapo_balanced_batch_keeps_start_bounds_and_equals_clip():
    gen = torch.Generator().manual_seed(0)
    ratio = torch.exp(0.4 * torch.randn(4, 8, generator=gen, dtype=D))
    adv = torch.randn(4, 1, generator=gen, dtype=D).abs().expand(4, 8).clone()
    adv[0] = -0.1  # a few small negatives: the positive share stays far above 0.5
    loss, m, g = bapo_run(ratio, adv, **BAPO)
    assert m["c_low"].item() == 0.6 and m["c_high"].item() == 1.2 and m["pos_share"].item() >= 0.5
    logp = torch.full_like(ratio, -1.0).requires_grad_(True)
    anchor = -1.0 - ratio.log()
    ref, _ = TRUST_REGIONS.fn("clip")(
        make_inp(logp, anchor, adv), logp - anchor, eps_low=0.4, eps_high=0.2, dual_clip_c=3.0
    )
    ref.sum().backward()
    assert torch.allclose(loss, ref.detach()) and torch.allclose(g, logp.grad)
    assert (g == 0).any() and (g != 0).any()


def test_bapo_raises_c_low_then_c_high_hand_example():
    # One positive token with ratio 3 and two negative tokens with ratio 1 and A = -0.965 (neg = 1.93):
    # raising c_low cannot help (no negative ratio below it), so c_low goes to 0.9, then c_high to 1.95.
    ratio = torch.tensor([[3.0, 1.0, 1.0]], dtype=D)
    adv = torch.tensor([[1.0, -0.965, -0.965]], dtype=D)
    loss, m, g = bapo_run(ratio, adv, **BAPO, dual_clip_c=None)
    assert m["c_low"].item() == pytest.approx(0.9) and m["c_high"].item() == pytest.approx(1.95)
    assert m["pos_share"].item() == pytest.approx(1.95 / (1.95 + 1.93))
    assert loss.tolist() == [[pytest.approx(-1.95), pytest.approx(0.965), pytest.approx(0.965)]]
    assert g.tolist() == [[0.0, pytest.approx(0.965), pytest.approx(0.965)]]  # positive token still clipped


def test_bapo_search_matches_authors_loop_and_exit_conditions():
    gen = torch.Generator().manual_seed(1)
    hit_max = met_after_moving = 0
    for trial in range(60):
        ratio = torch.exp(0.6 * torch.randn(3, 10, generator=gen, dtype=D))
        adv = torch.randn(3, 1, generator=gen, dtype=D).expand(3, 10).clone() - 0.3 * (trial % 3)
        mask = (torch.rand(3, 10, generator=gen) < 0.8).to(D)
        lo, hi, share = bapo_bounds(ratio, adv, mask, **BAPO)
        ref = reference_search(ratio, adv, mask, **BAPO)
        assert (lo.item(), hi.item()) == pytest.approx(ref[:2], abs=1e-12)
        assert share.item() == pytest.approx(ref[2], abs=1e-12)
        assert 0.6 <= lo.item() <= 0.9 and 1.2 <= hi.item() <= 3.0
        at_max = lo.item() == 0.9 and hi.item() == 3.0
        assert share.item() >= 0.5 or at_max
        hit_max += int(at_max and share.item() < 0.5)
        met_after_moving += int(share.item() >= 0.5 and hi.item() > 1.2)
    assert hit_max > 0 and met_after_moving > 0  # both exits are exercised


def test_bapo_share_convention_counts_clipped_values():
    # Authors' measure: neg uses |A| max(r, c_low), so raising c_low never lowers neg (documented quirk).
    ratio = torch.tensor([[0.5, 0.7, 1.5]], dtype=D)
    adv = torch.tensor([[-1.0, -1.0, 1.0]], dtype=D)
    ones = torch.ones_like(ratio)
    shares = [
        bapo_bounds(ratio, adv, ones, **{**BAPO, "c_low_min": lo, "c_low_max": lo, "rho_0": 0.99})[2].item()
        for lo in (0.6, 0.7, 0.8, 0.9)
    ]
    assert shares == sorted(shares, reverse=True) and shares[0] > shares[-1]


def test_bapo_vanilla_at_one_and_padding_ignored():
    gen = torch.Generator().manual_seed(2)
    adv = torch.randn(2, 6, generator=gen, dtype=D)
    mask = torch.ones(2, 6, dtype=D)
    mask[1, 4:] = 0
    _, m, g = bapo_run(torch.ones(2, 6, dtype=D), adv, mask, **BAPO)
    assert torch.allclose(g, -adv)
    ratio = torch.exp(0.5 * torch.randn(2, 6, generator=gen, dtype=D))
    _, m1, _ = bapo_run(ratio, adv, mask, **BAPO)
    r2, a2 = ratio.masked_fill(mask == 0, 50.0), adv.masked_fill(mask == 0, -1e6)
    _, m2, _ = bapo_run(r2, a2, mask, **BAPO)
    assert all(torch.equal(m1[k], m2[k]) for k in ("c_low", "c_high", "pos_share"))
    assert all(v.dim() == 0 and not v.requires_grad for v in m1.values())


@pytest.mark.parametrize(
    "bad",
    [
        {"c_low_max": 1.0},
        {"c_low_min": 0.8, "c_low_max": 0.7},
        {"c_high_min": 1.0},
        {"c_high_min": 2.0, "c_high_max": 1.5},
        {"step": 0.0},
        {"step": 1e-6},
        {"rho_0": 1.0},
        {"rho_0": 0.0},
        {"dual_clip_c": 1.0},
    ],
)
def test_bapo_bad_settings(bad):
    with pytest.raises(PartError):
        TRUST_REGIONS.resolve("bapo", bad)


def test_bapo_good_settings_resolve():
    part = TRUST_REGIONS.resolve("bapo", {"c_low_max": 0.8, "c_high_max": 2.0, "dual_clip_c": "none"})
    assert part.params["dual_clip_c"] is None and part.params["step"] == 0.05


# ---------------------------------------------------------------- TROLL


def kl(log_a, log_b):
    return (log_a.exp() * (log_a - log_b)).sum(-1)


def _random_pair(gen, n, K, scale):
    log_pi = torch.log_softmax(scale * torch.randn(n, K, generator=gen, dtype=D), -1)
    log_old = torch.log_softmax(scale * torch.randn(n, K, generator=gen, dtype=D), -1)
    return log_pi, log_old


def test_troll_projection_inside_is_identity_and_outside_lands_on_the_ball():
    gen = torch.Generator().manual_seed(3)
    log_pi, log_old = _random_pair(gen, 200, 6, 1.0)
    log_old[:100] = torch.log_softmax(log_pi[:100] + 0.3 * torch.randn(100, 6, generator=gen, dtype=D), -1)
    eps = 0.05
    tilde, eta, projected = troll_project(log_pi, log_old, eps_kl=eps, max_iter=50)
    inside = ~projected
    assert inside.any() and projected.any()
    assert torch.equal(tilde[inside], log_pi[inside]) and (eta[inside] == 0).all()
    d = kl(tilde, log_old)
    assert (d <= eps + 1e-6).all()
    assert torch.allclose(d[projected], torch.full_like(d[projected], eps), atol=1e-6)
    assert torch.allclose(tilde.exp().sum(-1), torch.ones(200, dtype=D))
    assert (eta[projected] > 0).all()
    # the bisection keeps the feasible end, so even a coarse search never leaves the ball
    coarse, _, _ = troll_project(log_pi, log_old, eps_kl=eps, max_iter=3)
    assert (kl(coarse, log_old) <= eps).all()
    # the result is the geometric interpolation at the returned eta
    assert torch.allclose(troll_interpolate(log_pi, log_old, eta)[projected], tilde[projected])


def test_troll_interpolation_endpoints():
    gen = torch.Generator().manual_seed(4)
    log_pi, log_old = _random_pair(gen, 5, 4, 2.0)
    assert torch.allclose(troll_interpolate(log_pi, log_old, 0.0), log_pi)
    assert torch.allclose(troll_interpolate(log_pi, log_old, 1e-9), log_pi, atol=1e-8)
    assert torch.allclose(troll_interpolate(log_pi, log_old, 1e9), log_old, atol=1e-8)
    assert torch.allclose(troll_interpolate(log_pi, log_old, float("inf")), log_old)
    ds = [kl(troll_interpolate(log_pi, log_old, e), log_old) for e in (0.0, 0.5, 2.0, 10.0)]
    assert all((a >= b).all() for a, b in zip(ds, ds[1:], strict=False))  # KL to old falls along the path


def logits_inputs(logits, old_logits, y, adv, K, mask=None):
    """LossInputs from full-vocabulary logits [B, T, V]: column 0 = sampled y, then old's top tokens."""
    lp_full, old_full = torch.log_softmax(logits, -1), torch.log_softmax(old_logits, -1)
    others = old_full.detach().scatter(-1, y[..., None], -1e9).topk(K - 1, dim=-1).indices
    ids = torch.cat([y[..., None], others], -1)
    logp = lp_full.gather(-1, y[..., None])[..., 0]
    old = old_full.gather(-1, y[..., None])[..., 0]
    topk, old_topk = lp_full.gather(-1, ids), old_full.gather(-1, ids)
    inp = make_inp(logp, old, adv, mask, topk_ids=ids, topk_logp=topk, old_topk_logp=old_topk)
    return inp, logp - old


def test_troll_on_policy_is_exactly_reinforce():
    gen = torch.Generator().manual_seed(5)
    B, T, V, K = 2, 3, 12, 4
    logits = torch.randn(B, T, V, generator=gen, dtype=D).requires_grad_(True)
    y = torch.randint(0, V, (B, T), generator=gen)
    adv = torch.randn(B, T, generator=gen, dtype=D)
    inp, log_ratio = logits_inputs(logits, logits.detach(), y, adv, K)
    loss, m = TRUST_REGIONS.fn("troll")(inp, log_ratio)
    loss.sum().backward()
    pi = torch.softmax(logits.detach(), -1)
    vanilla = -adv[..., None] * (torch.nn.functional.one_hot(y, V).to(D) - pi)  # -A grad_logits log pi(y)
    assert torch.allclose(logits.grad, vanilla, atol=1e-12)
    assert m["proj_frac"].item() == 0.0 and torch.allclose(loss.detach(), -adv)


def test_troll_inside_region_gradient_is_unclipped_surrogate():
    gen = torch.Generator().manual_seed(6)
    K = 5
    old_topk = torch.log_softmax(torch.randn(1, 4, K, generator=gen, dtype=D), -1) - 0.01
    topk = (old_topk + 0.05 * torch.randn(1, 4, K, generator=gen, dtype=D)).requires_grad_(True)
    logp = topk[..., 0].detach().clone().requires_grad_(True)
    adv = torch.randn(1, 4, generator=gen, dtype=D)
    inp = make_inp(logp, old_topk[..., 0], adv, topk_logp=topk, old_topk_logp=old_topk)
    loss, m = TRUST_REGIONS.fn("troll")(inp, logp - old_topk[..., 0], eps_kl=0.05)
    loss.sum().backward()
    r = (logp - old_topk[..., 0]).exp().detach()
    assert m["proj_frac"].item() == 0.0
    assert torch.allclose(loss.detach(), -r * adv) and torch.allclose(logp.grad, -r * adv)
    assert torch.allclose(topk.grad, torch.zeros_like(topk), atol=1e-12)


def test_troll_active_projection_value_and_nonzero_gradient_where_clip_is_zero():
    gen = torch.Generator().manual_seed(7)
    V, K = 8, 4
    old_logits = torch.randn(1, 1, V, generator=gen, dtype=D)
    y = old_logits.argmin(-1)  # a rare token ...
    logits = old_logits.clone()
    logits[0, 0, y] += 3.0  # ... whose probability the policy has raised a lot: ratio far above 1.28
    logits.requires_grad_(True)
    adv = torch.ones(1, 1, dtype=D)
    inp, log_ratio = logits_inputs(logits, old_logits, y, adv, K)
    assert log_ratio.exp().item() > 5.0
    clip_loss, _ = TRUST_REGIONS.fn("clip")(inp, log_ratio, eps_low=0.2, eps_high=0.28)
    (g_clip,) = torch.autograd.grad(clip_loss.sum(), logits, retain_graph=True)
    assert torch.equal(g_clip, torch.zeros_like(g_clip))

    eps = 0.05
    loss0, m = TRUST_REGIONS.fn("troll")(inp, log_ratio, eps_kl=eps, alpha=0.0)
    assert m["proj_frac"].item() == 1.0
    (g,) = torch.autograd.grad(loss0.sum(), logits, retain_graph=True)
    assert g.abs().max().item() > 1e-3  # the projected surrogate still pushes
    # value: -(pi_tilde_S(y) / old_S(y)) * pi(S)/old(S) * A, with pi_tilde the projection on S
    log_pi_s = torch.log_softmax(inp.topk_logp.detach(), -1)
    log_old_s = torch.log_softmax(inp.old_topk_logp, -1)
    tilde, _, _ = troll_project(log_pi_s, log_old_s, eps_kl=eps, max_iter=50)
    mass = inp.topk_logp.detach().exp().sum(-1) / inp.old_topk_logp.exp().sum(-1)
    expected = -(tilde[..., 0] - log_old_s[..., 0]).exp() * mass
    assert torch.allclose(loss0.detach(), expected)
    assert -loss0.item() < log_ratio.exp().item()  # the projection shrinks the ratio
    # the regression term adds alpha KL(pi_S || pi_tilde) and is non-zero outside the region
    loss1, _ = TRUST_REGIONS.fn("troll")(inp, log_ratio, eps_kl=eps, alpha=2.0)
    assert (loss1 - loss0).item() == pytest.approx(2.0 * kl(log_pi_s, tilde).item())
    assert (loss1 - loss0).item() > 0
    # its gradient treats pi_tilde as a constant: that of alpha * sum pi_S (log pi_S - sg(log pi_tilde))
    (g_reg,) = torch.autograd.grad((loss1 - loss0).sum(), logits, retain_graph=True)
    log_pi_s_grad = torch.log_softmax(inp.topk_logp, -1)
    ref = 2.0 * (log_pi_s_grad.exp() * (log_pi_s_grad - tilde)).sum()
    (g_ref,) = torch.autograd.grad(ref, logits, retain_graph=True)
    assert torch.allclose(g_reg, g_ref) and g_ref.abs().max().item() > 1e-3
    # finite differences of the loss (eta re-solved each time) are non-zero too
    h = 1e-5
    bump = torch.zeros_like(logits)
    bump[0, 0, y] = h
    vals = []
    for s in (1.0, -1.0):
        inp_s, lr_s = logits_inputs((logits + s * bump).detach(), old_logits, y, adv, K)
        vals.append(TRUST_REGIONS.fn("troll")(inp_s, lr_s, eps_kl=eps, alpha=0.0)[0].item())
    assert abs(vals[0] - vals[1]) / (2 * h) > 1e-3


def test_troll_missing_fields_and_settings():
    logp = torch.zeros(1, 2, dtype=D)
    with pytest.raises(ValueError, match="topk_logp and LossInputs.old_topk_logp"):
        TRUST_REGIONS.fn("troll")(make_inp(logp, logp, torch.ones(1, 2, dtype=D)), logp)
    inp = make_inp(logp, logp, torch.ones(1, 2, dtype=D), topk_logp=torch.zeros(1, 2, 3, dtype=D))
    with pytest.raises(ValueError, match="old_topk_logp"):
        TRUST_REGIONS.fn("troll")(inp, logp)
    for bad in ({"eps_kl": 0.0}, {"alpha": -1.0}, {"max_iter": 0}, {"max_iter": 2.5}):
        with pytest.raises(PartError):
            TRUST_REGIONS.resolve("troll", bad)


def test_troll_padding_and_metrics():
    gen = torch.Generator().manual_seed(8)
    B, T, V, K = 2, 4, 10, 3
    logits = torch.randn(B, T, V, generator=gen, dtype=D)
    old_logits = logits + torch.randn(B, T, V, generator=gen, dtype=D)
    y = torch.randint(0, V, (B, T), generator=gen)
    adv = torch.randn(B, T, generator=gen, dtype=D)
    mask = torch.ones(B, T, dtype=D)
    mask[0, 2:] = 0
    inp, lr = logits_inputs(logits, old_logits, y, adv, K, mask)
    loss, m = TRUST_REGIONS.fn("troll")(inp, lr)
    pad = mask == 0
    inp.topk_logp = inp.topk_logp.masked_fill(pad[..., None], 30.0)
    inp.adv = adv.masked_fill(pad, 1e6)
    loss_g, m_g = TRUST_REGIONS.fn("troll")(inp, lr.masked_fill(pad, 1e3))
    assert torch.equal(loss[~pad], loss_g[~pad]) and all(torch.equal(m[k], m_g[k]) for k in m)
    assert 0.0 < m["proj_frac"].item() <= 1.0 and all(
        v.dim() == 0 and not v.requires_grad for v in m.values()
    )


@pytest.mark.parametrize("preset,trust_region", [("troll", None), ("dppo_tv", "dppo_topk_tv")])
def test_later_epochs_compare_the_policy_on_pi_olds_top_k_support(tiny_model, preset, trust_region):
    """pi_old's top-K comes from before the update; after an optimizer step the policy's own top-K ids differ, so every
    pass must evaluate the policy at pi_old's ids (the trust region compares the two column by column)."""
    from types import SimpleNamespace

    import polyrl.update as update
    from polyrl.methods import get_method
    from polyrl.objectives import override
    from tests.helpers import random_batch, tiny_learner

    method = get_method(preset) if trust_region is None else override(get_method(preset), trust_region=trust_region)
    learner = tiny_learner(tiny_model)
    g = torch.Generator().manual_seed(3)
    B, P, T = 8, 4, 6
    tb = random_batch(B, P, T, g)
    old = learner.logprobs_nograd(tb, topk=4)
    adv = torch.randn(B, generator=g)[:, None].expand(B, T).clone()
    scored = update.Scored(tb=tb, mask=tb.loss_mask, adv=adv, group_ids=torch.arange(B) // 4,
                           segment_ids=torch.zeros(B, T, dtype=torch.long), old_logp=old.logp.clone(),
                           old_topk=old.topk_logp.clone(), old_topk_ids=old.topk_ids, ref_logp=None)
    seen, loss = [], update.policy_loss

    def spy(inp, m):
        seen.append((inp.topk_ids.clone(), inp.topk_logp.detach().clone()))
        return loss(inp, m)

    update.policy_loss = spy
    try:
        update.update_policy(learner, method, scored, SimpleNamespace(bad_steps=0, skipped_total=0),
                             epochs=3, minibatches=1, micro_batch_size=8, horizon=T, topk=4, reuse_old=False, seed=0,
                             max_bad_steps=5)
    finally:
        update.policy_loss = loss
    assert len(seen) == 3
    for ids, _ in seen:
        assert torch.equal(ids, old.topk_ids)
    # the policy moved: its log-probs at those ids changed after the first optimizer step, and its own top-K did too
    assert not torch.allclose(seen[2][1], old.topk_logp)
    assert not torch.equal(learner.logprobs_nograd(tb, topk=4).topk_ids, old.topk_ids)


def test_troll_columns_outside_both_filtered_supports_are_left_out_of_s():
    """top-k / top-p can leave fewer than K tokens: columns -inf in both distributions. The loss and gradient equal
    TROLL on the finite columns alone (exp(-inf) * (-inf - -inf) was nan in the backward and skipped the step)."""
    g = torch.Generator().manual_seed(5)
    B, T, K, cut = 3, 4, 8, 5
    base = torch.randn(B, T, K, generator=g, dtype=D).log_softmax(-1)
    old = (base + 0.8 * torch.randn(B, T, K, generator=g, dtype=D)).log_softmax(-1)
    adv = torch.randn(B, T, generator=g, dtype=D)

    def run_troll(cur, anchor):
        leaf = cur.clone().requires_grad_(True)
        inp = make_inp(leaf[..., 0], anchor[..., 0], adv, topk_logp=leaf, old_topk_logp=anchor)
        loss, metrics = TRUST_REGIONS.fn("troll")(inp, leaf[..., 0] - anchor[..., 0], eps_kl=0.05)
        loss.sum().backward()
        return loss.detach(), metrics["topk_kl"], leaf.grad

    inf = torch.full((B, T, K - cut), float("-inf"), dtype=D)
    wide = run_troll(torch.cat([base[..., :cut], inf], -1), torch.cat([old[..., :cut], inf], -1))
    narrow = run_troll(base[..., :cut], old[..., :cut])
    assert torch.isfinite(wide[0]).all() and torch.isfinite(wide[1]) and torch.isfinite(wide[2]).all()
    torch.testing.assert_close(wide[0], narrow[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(wide[1], narrow[1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(wide[2][..., :cut], narrow[2], rtol=1e-12, atol=1e-12)
    assert torch.equal(wide[2][..., cut:], torch.zeros(B, T, K - cut, dtype=D))
