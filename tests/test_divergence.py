"""Divergence trust regions: DPPO (binary / top-K, TV / KL), CPPO and DRPO (objectives/divergence.py)."""

from __future__ import annotations

import math

import pytest
import torch

from polyrl.objectives.divergence import (
    _row_quantile,
    binary_kl,
    cppo_keep,
    cppo_thresholds,
    dppo_binary_tv_keep,
    drpo_token_weight,
    topk_divergence,
)
from polyrl.registry import TRUST_REGIONS, PartError
from polyrl.types import LossInputs, Normalizer

D = torch.float64


def make_inp(logp, anchor, adv, mask=None, **kw) -> LossInputs:
    mask = torch.ones_like(logp) if mask is None else mask
    norm = Normalizer(
        num_tokens=float(mask.sum()), num_seqs=float(mask.shape[0]), num_prompts=1.0, horizon=1.0
    )
    return LossInputs(
        logp=logp, old_logp=anchor, rollout_logp=anchor, adv=adv, mask=mask, normalizer=norm, **kw
    )


def run(name, p, q, adv, mask=None, **settings):
    """Loss, metrics and d loss.sum() / d logp for a token ratio anchored at q (p, q, adv: lists/tensors)."""
    logp = torch.as_tensor(p, dtype=D).log().reshape(1, -1).clone().requires_grad_(True)
    anchor = torch.as_tensor(q, dtype=D).log().reshape(1, -1)
    adv = torch.as_tensor(adv, dtype=D).reshape(1, -1).expand_as(logp).clone()
    inp = make_inp(logp, anchor, adv, mask)
    loss, metrics = TRUST_REGIONS.fn(name)(inp, logp - anchor, **settings)
    loss.sum().backward()
    return loss.detach(), metrics, logp.grad


# ---------------------------------------------------------------- DPPO


def test_rare_token_kept_by_dppo_but_zeroed_by_clip():
    # q = 0.01 -> p = 0.05, A > 0: ratio 5 is far outside PPO's clip, but |p - q| = 0.04 < 0.15.
    _, _, g_clip = run("clip", [0.05], [0.01], [1.0], eps_low=0.2, eps_high=0.28)
    assert g_clip.item() == 0.0
    loss, m, g = run("dppo_tv", [0.05], [0.01], [1.0])
    assert g.item() == pytest.approx(-5.0)  # -A r grad lp, r = 5 < C = 10
    assert loss.item() == pytest.approx(-5.0)
    assert m["mask_frac"].item() == 0.0


def test_dominant_token_masked_by_dppo_but_kept_by_clip():
    # q = 0.99 -> p = 0.80, A < 0: ratio 0.808 passes PPO's clip; p - q = -0.19 < -0.15 is masked.
    r = 0.80 / 0.99
    _, _, g_clip = run("clip", [0.80], [0.99], [-1.0], eps_low=0.2, eps_high=0.28)
    assert g_clip.item() == pytest.approx(r)
    loss, m, g = run("dppo_tv", [0.80], [0.99], [-1.0])
    assert g.item() == 0.0 and loss.item() == 0.0
    assert m["mask_frac"].item() == 1.0


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_direction_never_masks_moves_back_toward_anchor(name):
    grid = torch.linspace(0.001, 0.999, 60, dtype=D)
    p, q = torch.meshgrid(grid, grid, indexing="ij")
    p, q = p.reshape(-1), q.reshape(-1)
    for sign, closer in ((1.0, p < q), (-1.0, p > q)):
        _, m, g = run(name, p[closer], q[closer], [sign], delta_low=0.0, delta_high=0.0, trunc_c=None)
        assert m["mask_frac"].item() == 0.0
        assert torch.allclose(g, -sign * p[closer] / q[closer])
    # and the same zero thresholds do mask every diverging move
    for sign, away in ((1.0, p > q), (-1.0, p < q)):
        _, m, _ = run(name, p[away], q[away], [sign], delta_low=0.0, delta_high=0.0)
        assert m["mask_frac"].item() == 1.0


def test_binary_kl_nonnegative_and_zero_iff_equal():
    grid = torch.linspace(1e-6, 1 - 1e-6, 101, dtype=D)
    p, q = torch.meshgrid(grid, grid, indexing="ij")
    d = binary_kl(q.log(), p.log())
    assert (d >= 0).all()
    assert (d[p == q] == 0).all() and (d[p != q] > 0).all()
    # hand value: q = 0.5, p = 0.8
    assert binary_kl(
        torch.tensor(0.5, dtype=D).log(), torch.tensor(0.8, dtype=D).log()
    ).item() == pytest.approx(0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.5 / 0.2))
    # finite at the edges
    edges = torch.tensor([0.0, -1e-12, -50.0, -800.0], dtype=torch.float32)
    assert torch.isfinite(binary_kl(edges[:, None], edges[None, :])).all()


def test_dppo_kl_hand_example():
    # D(0.5 || 0.8) = 0.2231 > 0.05: masked for A > 0 (p > q); the same move with A < 0 is kept.
    _, m, g = run("dppo_kl", [0.8, 0.8], [0.5, 0.5], [1.0, -1.0])
    assert g.tolist() == [[0.0, pytest.approx(1.6)]]
    assert m["mask_frac"].item() == 0.5


def _random_policies(gen, n, V):
    pi = torch.softmax(2.0 * torch.randn(n, V, generator=gen, dtype=D), -1)
    mu = torch.softmax(2.0 * torch.randn(n, V, generator=gen, dtype=D), -1)
    return pi, mu


@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_data_processing_binary_le_topk_le_full(kind):
    gen = torch.Generator().manual_seed(0)
    n, V, K = 400, 10, 4
    pi, mu = _random_policies(gen, n, V)
    y = torch.randint(0, V, (n,), generator=gen)
    others = (
        mu.scatter(1, y[:, None], -1.0).topk(K - 1, dim=-1).indices
    )  # rollout's most probable other tokens
    ids = torch.cat([y[:, None], others], -1)
    topk = topk_divergence(pi.gather(1, ids).log()[None], mu.gather(1, ids).log()[None], kind)[0]
    p, q = pi.gather(1, y[:, None])[:, 0], mu.gather(1, y[:, None])[:, 0]
    if kind == "tv":
        binary, full = (p - q).abs(), 0.5 * (mu - pi).abs().sum(-1)
    else:
        binary, full = binary_kl(q.log(), p.log()), (mu * (mu / pi).log()).sum(-1)
    assert (binary <= topk + 1e-12).all() and (topk <= full + 1e-12).all()
    assert (topk > binary + 1e-6).any() and (full > topk + 1e-6).any()  # the inequalities are not all ties


def test_topk_tv_masks_what_binary_keeps_and_uses_topk_detached():
    # Sampled token barely moves (0.25 -> 0.30) but the rest of the top-K distribution moves a lot.
    pi = torch.tensor([[[0.30, 0.20, 0.45]]], dtype=D).log().requires_grad_(True)
    mu = torch.tensor([[[0.25, 0.70, 0.04]]], dtype=D).log()
    logp = pi[..., 0].detach().clone().requires_grad_(True)
    inp = make_inp(logp, mu[..., 0], torch.ones(1, 1, dtype=D), topk_logp=pi, rollout_topk_logp=mu)
    loss, m = TRUST_REGIONS.fn("dppo_topk_tv")(inp, logp - mu[..., 0])
    assert m["mask_frac"].item() == 1.0
    loss.sum().backward()
    assert logp.grad.item() == 0.0 and pi.grad is None  # the top-K tensors only decide the mask
    _, m_bin, _ = run("dppo_tv", [0.30], [0.25], [1.0])
    assert m_bin["mask_frac"].item() == 0.0
    _, m_kl = TRUST_REGIONS.fn("dppo_topk_kl")(inp, logp - mu[..., 0])
    assert m_kl["mask_frac"].item() == 1.0


@pytest.mark.parametrize("name", ["dppo_topk_tv", "dppo_topk_kl"])
def test_topk_missing_fields_raise(name):
    logp = torch.zeros(1, 2, dtype=D)
    inp = make_inp(logp, logp, torch.ones(1, 2, dtype=D), topk_logp=torch.zeros(1, 2, 3, dtype=D))
    with pytest.raises(ValueError, match="rollout_topk_logp"):
        TRUST_REGIONS.fn(name)(inp, logp)
    inp = make_inp(logp, logp, torch.ones(1, 2, dtype=D))
    with pytest.raises(ValueError, match="topk_logp and LossInputs.rollout_topk_logp"):
        TRUST_REGIONS.fn(name)(inp, logp)


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_kept_gradient_is_truncated_ratio(name):
    # A < 0 with p > q is never masked; r = 25 > C = 10 and r = 1.25 < C.
    p, q, a = [0.5, 0.5], [0.02, 0.4], [-1.0, -2.0]
    loss, m, g = run(name, p, q, a)
    assert g.tolist() == [[pytest.approx(10.0), pytest.approx(2.0 * 1.25)]]
    assert loss.tolist() == [[pytest.approx(10.0), pytest.approx(2.5)]]  # value -A min(r, C)
    assert m["trunc_frac"].item() == 0.5
    _, _, g_none = run(name, p, q, a, trunc_c=None)
    assert g_none.tolist() == [[pytest.approx(25.0), pytest.approx(2.5)]]
    _, _, g_plain = run("none", p, q, a)
    assert torch.allclose(g_none, g_plain)


def test_anchor_convention_q_from_log_ratio():
    # p = 0.5; rollout mu = 0.3 (|p - mu| = 0.2 > 0.15), recomputed pi_old = 0.45 (0.05): A > 0.
    logp = torch.tensor([[0.5]], dtype=D).log()
    mu, old = torch.tensor([[0.3]], dtype=D).log(), torch.tensor([[0.45]], dtype=D).log()
    one = torch.ones(1, 1, dtype=D)
    inp = LossInputs(logp, old, one, one, Normalizer(1.0, 1.0, 1.0, 1.0), rollout_logp=mu)
    _, m_mu = TRUST_REGIONS.fn("dppo_tv")(inp, logp - mu)
    _, m_old = TRUST_REGIONS.fn("dppo_tv")(inp, logp - old)
    assert m_mu["mask_frac"].item() == 1.0 and m_old["mask_frac"].item() == 0.0


def test_dppo_settings_validated():
    assert TRUST_REGIONS.resolve("dppo_tv", {"trunc_c": "none"}).params["trunc_c"] is None
    for bad in ({"delta_low": -0.1}, {"trunc_c": 0.0}, {"delta": 0.1}):
        with pytest.raises(PartError):
            TRUST_REGIONS.resolve("dppo_kl", bad)


# ---------------------------------------------------------------- CPPO

CPPO = dict(delta=0.15, w_min=0.8, delta_b=0.02)


def _random_batch(gen, B=6, T=12, spread=0.3):
    q = torch.rand(B, T, generator=gen, dtype=D) * 0.9 + 0.05
    p = (q + spread * (torch.rand(B, T, generator=gen, dtype=D) - 0.5)).clamp(1e-3, 1 - 1e-3)
    adv = torch.randn(B, 1, generator=gen, dtype=D).expand(B, T).clone()
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(D)
    return p, q, adv, mask


@pytest.mark.parametrize("delta_b,dynamic", [(1e9, False), (float("inf"), False), (float("inf"), True)])
def test_cppo_reduces_to_dppo_binary_tv(delta_b, dynamic):
    """methods-seedblog 1(e): w_min = 1 and delta_b = +inf give DPPO Binary-TV exactly, c_1 == delta."""
    gen = torch.Generator().manual_seed(1)
    p, q, adv, mask = _random_batch(gen, B=20, T=16, spread=0.6)
    keep = cppo_keep(p, q, adv, mask, delta=0.15, w_min=1.0, delta_b=delta_b, dynamic_budget=dynamic)
    assert torch.equal(cppo_thresholds(p, q, mask, delta=0.15, w_min=1.0, delta_b=delta_b,
                                       dynamic_budget=dynamic)[1][:, 0], torch.full((20,), 0.15, dtype=D))
    ref = dppo_binary_tv_keep(p, q, adv, delta_low=0.15, delta_high=0.15) & (mask > 0)
    assert torch.equal(keep, ref) and (~ref & (mask > 0)).any()


def test_cppo_hand_example():
    # D = 0.1 at each of 3 tokens; w = [1, 0.9, 0.8]; S = [0, 0.1, 0.19]; W = [0, 1, 1.9]
    p, q = torch.full((1, 3), 0.4, dtype=D), torch.full((1, 3), 0.3, dtype=D)
    z, c = cppo_thresholds(p, q, torch.ones(1, 3, dtype=D), **CPPO, dynamic_budget=False)
    assert z.tolist() == [[pytest.approx(0.1), pytest.approx(0.09), pytest.approx(0.08)]]
    assert c.tolist() == [[pytest.approx(0.15), pytest.approx(0.07), pytest.approx(-0.002)]]
    keep = cppo_keep(p, q, torch.ones(1, 3, dtype=D), torch.ones(1, 3, dtype=D), **CPPO, dynamic_budget=False)
    assert keep.tolist() == [[True, False, False]]
    # dynamic budget: P90 of [0.1]*3 = 0.1 -> clamped to 2 delta_b = 0.04: c_2 = 0.15 + 0.04 - 0.1
    _, c_dyn = cppo_thresholds(p, q, torch.ones(1, 3, dtype=D), **CPPO, dynamic_budget=True)
    assert c_dyn[0, 1].item() == pytest.approx(0.09)


@pytest.mark.parametrize("dynamic", [False, True])
def test_cppo_threshold_starts_at_delta_and_never_exceeds_it(dynamic):
    gen = torch.Generator().manual_seed(2)
    p, q, adv, mask = _random_batch(gen, B=30, T=20, spread=0.8)
    mask[::2, :3] = 0.0  # some rows start their loss tokens later (e.g. after a tool output)
    z, c = cppo_thresholds(p, q, mask, **CPPO, dynamic_budget=dynamic)
    valid = mask > 0
    first = valid & (torch.cumsum(mask, -1) == 1)
    assert (c[first] == 0.15).all() and (c[valid] <= 0.15).all() and (c[valid] < 0.15).any()
    keep = cppo_keep(p, q, adv, mask, **CPPO, dynamic_budget=dynamic)
    toward = adv * (p / q - 1) <= 0
    assert keep[valid & toward].all() and not keep[valid & ~toward].all()


def test_cppo_monotone_in_earlier_divergence_fixed_budget():
    gen = torch.Generator().manual_seed(3)
    flips_checked = 0
    for _ in range(300):
        p, q, adv, mask = _random_batch(gen, B=1, T=10, spread=0.4)
        mask = torch.ones_like(mask)
        keep = cppo_keep(p, q, adv, mask, **CPPO, dynamic_budget=False)
        j = int(torch.randint(0, 9, (1,), generator=gen))
        p2 = p.clone()
        direction = 1.0 if p[0, j] >= q[0, j] else -1.0
        p2[0, j] = (p[0, j] + direction * 0.2 * torch.rand(1, generator=gen, dtype=D).item()).clamp(
            1e-4, 1 - 1e-4
        )
        keep2 = cppo_keep(p2, q, adv, mask, **CPPO, dynamic_budget=False)
        later = slice(j + 1, None)
        assert not (~keep[0, later] & keep2[0, later]).any()
        flips_checked += int((keep[0, later] & ~keep2[0, later]).any())
    assert flips_checked > 0  # the perturbation does bind sometimes


def test_cppo_dynamic_budget_can_break_monotonicity():
    # Documented limitation: raising D_1 raises the P90 budget, which can loosen c_3 (w_min = 1 for clarity).
    # D = [a1, 0.1, 0.085, 0 x 17]: P90 = 0.9 a1 + 0.0085 (unclamped), c_3 = 0.15 + 2 P90 - a1 - 0.1.
    q, adv, ones = (torch.full((1, 20), v, dtype=D) for v in (0.5, 1.0, 1.0))
    settings = dict(delta=0.15, w_min=1.0, delta_b=0.02, dynamic_budget=True)
    d = torch.zeros(1, 20, dtype=D)
    d[0, :3] = torch.tensor([0.021, 0.1, 0.085], dtype=D)
    d2 = d.clone()
    d2[0, 0] = 0.03
    assert cppo_thresholds(q + d, q, ones, **settings)[1][0, 2].item() == pytest.approx(0.0838)
    assert cppo_thresholds(q + d2, q, ones, **settings)[1][0, 2].item() == pytest.approx(0.091)
    assert (
        not cppo_keep(q + d, q, adv, ones, **settings)[0, 2]
        and cppo_keep(q + d2, q, adv, ones, **settings)[0, 2]
    )
    assert not cppo_keep(q + d2, q, adv, ones, **{**settings, "dynamic_budget": False})[0, 2]


def test_cppo_on_policy_is_reinforce_and_mask_is_row_local():
    gen = torch.Generator().manual_seed(4)
    _, q, adv, mask = _random_batch(gen)
    logp = q.log().clone().requires_grad_(True)
    inp = make_inp(logp, q.log(), adv, mask)
    loss, m = TRUST_REGIONS.fn("cppo")(inp, logp - q.log())
    loss.sum().backward()
    assert m["mask_frac"].item() == 0.0 and torch.allclose(logp.grad, -adv * mask)
    # permutation and padding garbage
    p, q, adv, mask = _random_batch(gen, B=8, spread=0.8)
    keep = cppo_keep(p, q, adv, mask, **CPPO, dynamic_budget=True)
    perm = torch.randperm(8, generator=gen)
    assert torch.equal(
        cppo_keep(p[perm], q[perm], adv[perm], mask[perm], **CPPO, dynamic_budget=True), keep[perm]
    )
    pad = mask == 0
    garbage = [(p.masked_fill(pad, 1e6), q.masked_fill(pad, -7.0)), (p.masked_fill(pad, float("nan")), q)]
    for pg, qg in garbage:
        assert torch.equal(
            cppo_keep(pg, qg, adv.masked_fill(pad, 1e9), mask, **CPPO, dynamic_budget=True), keep
        )


def test_cppo_loss_metrics_and_padding():
    # one row of 4 loss tokens + 2 pads; token 0 diverges far (A > 0, p - q = 0.5): masked, first half.
    p = torch.tensor([[0.9, 0.5, 0.5, 0.5, 0.3, 0.3]], dtype=D)
    q = torch.tensor([[0.4, 0.5, 0.5, 0.5, 0.9, 0.9]], dtype=D)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]], dtype=D)
    loss, m, g = run("cppo", p, q, [1.0], mask=mask)
    assert m["mask_frac"].item() == 0.25
    assert m["mask_frac_first_half"].item() == 0.5 and m["mask_frac_second_half"].item() == 0.0
    assert g[0, :4].tolist() == [0.0, -1.0, -1.0, -1.0]


def test_row_quantile_matches_torch_quantile():
    gen = torch.Generator().manual_seed(5)
    x = torch.rand(7, 15, generator=gen, dtype=D)
    valid = torch.rand(7, 15, generator=gen) < 0.6
    valid[0] = False
    valid[1] = False
    valid[1, 4] = True
    out = _row_quantile(x, valid, 0.9)
    assert out[0].item() == 0.0
    for b in range(1, 7):
        assert out[b].item() == pytest.approx(torch.quantile(x[b][valid[b]], 0.9).item(), abs=1e-12)


# ---------------------------------------------------------------- DRPO


def test_drpo_gradient_closed_form_and_value():
    gen = torch.Generator().manual_seed(6)
    q = torch.rand(40, generator=gen, dtype=D) * 0.9 + 0.05
    p = (q + 0.5 * (torch.rand(40, generator=gen, dtype=D) - 0.5)).clamp(1e-3, 1 - 1e-3)
    a = torch.randn(40, generator=gen, dtype=D)
    loss, m, g = run("drpo", p, q, a, delta=0.2)
    r = p / q
    w = drpo_token_weight(p, q, a, 0.2)
    assert torch.allclose(g[0], -a * r * w)
    assert torch.allclose(loss[0], -a * r + a.abs() * q * (r - 1) ** 2 / 0.4)
    assert m["beyond_frac"].item() == pytest.approx((w < 0).double().mean().item())
    # hand value: A = 1, q = 0.5, p = 0.6: -1.2 + 0.5 * 0.04 / 0.4
    assert run("drpo", [0.6], [0.5], [1.0], delta=0.2)[0].item() == pytest.approx(-1.15)


def test_drpo_boundary_and_on_policy():
    # w = 0 exactly on the TV boundary p - q = sign(A) delta
    _, _, g = run("drpo", [0.5, 0.1], [0.3, 0.3], [1.0, -2.0], delta=0.2)
    assert torch.allclose(g, torch.zeros_like(g), atol=1e-12)
    p, q, a = (torch.tensor(v, dtype=D) for v in (0.5, 0.3, 1.0))
    assert drpo_token_weight(p, q, a, 0.2).item() == pytest.approx(0.0, abs=1e-12)
    # beyond it the weight is negative: the gradient pulls back
    _, m, g = run("drpo", [0.7], [0.3], [1.0], delta=0.2)
    assert g.item() > 0 and m["beyond_frac"].item() == 1.0
    _, _, g = run("drpo", [0.3, 0.3], [0.3, 0.3], [1.5, -0.5])
    assert torch.allclose(g, torch.tensor([[-1.5, 0.5]], dtype=D))


def test_drpo_weight_bounded_where_spo_blows_up():
    gap, delta = 0.01, 0.2
    drpo_w, spo_w = [], []
    for q in (1e-1, 1e-2, 1e-3, 1e-4):
        _, _, g = run("drpo", [q + gap], [q], [1.0], delta=delta)
        drpo_w.append(g.item() / (-(q + gap) / q))
        logp = torch.tensor([math.log(q + gap)], dtype=D, requires_grad=True)
        r = (logp - math.log(q)).exp()
        (-r + (r - 1) ** 2 / (2 * delta)).sum().backward()  # SPO, eps = delta, A = 1
        spo_w.append(logp.grad.item() / (-r.item()))
    assert all(w == pytest.approx(1 - gap / delta) for w in drpo_w)
    assert (
        all(abs(b) > 5 * abs(a) for a, b in zip(spo_w[1:-1], spo_w[2:], strict=True)) and abs(spo_w[-1]) > 400
    )


def test_drpo_settings_validated():
    with pytest.raises(PartError):
        TRUST_REGIONS.resolve("drpo", {"delta": 0.0})
    for bad in ({"w_min": 0.0}, {"w_min": 1.5}, {"delta_b": -1.0}):
        with pytest.raises(PartError):
            TRUST_REGIONS.resolve("cppo", bad)


# ---------------------------------------------------------------- all parts of this module


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl", "dppo_topk_tv", "dppo_topk_kl", "cppo", "drpo"])
def test_vanilla_at_one_and_padding(name):
    gen = torch.Generator().manual_seed(7)
    topk = torch.log_softmax(torch.randn(3, 5, 4, generator=gen, dtype=D), -1)
    logp = topk[..., 0].clone().requires_grad_(True)
    adv = torch.randn(3, 5, generator=gen, dtype=D)
    mask = torch.ones(3, 5, dtype=D)
    mask[1, 3:] = 0
    inp = make_inp(logp, logp.detach(), adv, mask, topk_logp=topk, rollout_topk_logp=topk)
    loss, metrics = TRUST_REGIONS.fn(name)(inp, logp - logp.detach())
    loss.sum().backward()
    assert torch.allclose(logp.grad[mask > 0], -adv[mask > 0])
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())
    # garbage at padded positions changes nothing at loss tokens
    lg, ag = logp.detach().masked_fill(mask == 0, 1e4), adv.masked_fill(mask == 0, -1e6)
    tg = topk.masked_fill((mask == 0)[..., None], 50.0)
    shifted = lg - topk[..., 0] + 0.3  # an off-policy anchor
    inp_g = make_inp(lg, lg - shifted, ag, mask, topk_logp=tg, rollout_topk_logp=topk)
    inp_c = make_inp(
        logp.detach(), logp.detach() - shifted, adv, mask, topk_logp=topk, rollout_topk_logp=topk
    )
    loss_g, met_g = TRUST_REGIONS.fn(name)(inp_g, shifted)
    loss_c, met_c = TRUST_REGIONS.fn(name)(inp_c, shifted)
    assert torch.equal(loss_g[mask > 0], loss_c[mask > 0])
    assert all(torch.equal(met_g[k], met_c[k]) for k in met_c)
