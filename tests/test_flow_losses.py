"""Flow losses: B4 identities, Flow-DPPO mask, GRPO-Guard RatioNorm, Flow-GRPO clip + KL, LOOP, FPO (float64)."""

from __future__ import annotations

import math

import pytest
import torch

from polyrl.families.flow.losses import (
    FLOW_LOSSES,
    FlowLossInputs,
    flow_dppo_loss,
    flow_grpo_loss,
    fpo_cfm_losses,
    fpo_loss,
    fpo_ratio,
    grpo_guard_loss,
    loo_advantages,
    ratio_norm,
    step_kl,
)
from polyrl.families.flow.sampler import gaussian_logp, gaussian_step_kl
from polyrl.registry import PartError

D64 = torch.float64
torch.set_num_threads(1)


def gaussian_pair(dim: int, n: int, kl_target: float, s: float, seed: int = 0):
    """Old mean m_old, new mean m_new with exact sum-KL = kl_target, samples x' = m_old + s eps (one row per sample)."""
    g = torch.Generator().manual_seed(seed)
    delta = torch.randn(dim, generator=g, dtype=D64)
    delta *= math.sqrt(2 * kl_target) * s / delta.norm()
    m_old = torch.randn(dim, generator=g, dtype=D64).expand(n, dim)
    eps = torch.randn(n, dim, generator=g, dtype=D64)
    return m_old, m_old + delta, m_old + s * eps, eps, delta


def test_exact_kl_matches_monte_carlo():
    s = 0.3
    m_q, m_p, x, _, _ = gaussian_pair(64, 100_000, 0.87, s)  # x ~ N(m_q, s^2): KL(q || p) by MC
    exact = gaussian_step_kl(m_q[:1], m_p[:1], s, "sum").item()
    lr = gaussian_logp(x, m_q, s, "sum") - gaussian_logp(x, m_p, s, "sum")
    se = lr.std().item() / math.sqrt(len(lr))
    assert exact == pytest.approx(0.87, rel=1e-9)
    assert abs(lr.mean().item() - exact) < 3 * se


@pytest.mark.parametrize("s", [0.05, 0.7])
def test_log_ratio_mean_is_minus_kl_and_variance_two_kl(s):
    n, kl = 100_000, 0.87
    m_old, m_new, x, _, _ = gaussian_pair(64, n, kl, s, seed=1)
    log_rho = gaussian_logp(x, m_new, s, "sum") - gaussian_logp(x, m_old, s, "sum")
    var = 2 * kl
    assert abs(log_rho.mean().item() + kl) < 3 * math.sqrt(var / n)
    assert abs(log_rho.var().item() - var) < 3 * var * math.sqrt(2 / (n - 1))
    assert abs(log_rho.exp().median().item() - math.exp(-kl)) < 0.01  # the "left-shifted" median
    mean_units = gaussian_logp(x, m_new, s, "mean") - gaussian_logp(x, m_old, s, "mean")
    assert torch.allclose(mean_units * 64, log_rho, atol=1e-9)


def _steps(x):
    """[N, D] -> [N, 1, D] / [N] -> [N, 1]: one sampler step per row."""
    return x.unsqueeze(1)


@pytest.mark.parametrize("s", [0.05, 0.7])
def test_ratio_norm_equals_eps_dot_delta_with_zero_mean_and_std_norm_delta(s):
    m_old, m_new, x, eps, delta = gaussian_pair(8, 50_000, 0.5 * s**2, s, seed=2)  # ||delta|| = s, any s
    std = torch.full((len(x), 1), s, dtype=D64)
    lp_new, lp_old = gaussian_logp(x, m_new, s, "sum"), gaussian_logp(x, m_old, s, "sum")
    hat = ratio_norm(_steps(lp_new), _steps(lp_old), _steps(m_new), _steps(m_old), std, "sum")[:, 0]
    assert torch.allclose(hat, eps @ delta, atol=1e-12)
    hat_mean = ratio_norm(_steps(lp_new / 8), _steps(lp_old / 8), _steps(m_new), _steps(m_old), std, "mean")[:, 0]
    assert torch.allclose(hat_mean, eps @ delta / 8, atol=1e-12)
    assert abs(hat.mean().item()) < 3 * delta.norm().item() / math.sqrt(len(x))
    assert hat.std().item() == pytest.approx(delta.norm().item(), rel=0.02)


def test_grpo_guard_ratio_is_one_at_old_and_dt_weight_divides():
    g = torch.Generator().manual_seed(3)
    mean = torch.randn(4, 3, 2, generator=g, dtype=D64)
    lp = torch.randn(4, 3, generator=g, dtype=D64)
    std = torch.rand(4, 3, generator=g, dtype=D64) + 0.1
    dt = torch.tensor([-0.5, -0.25, -0.25], dtype=D64)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0], dtype=D64)
    assert torch.equal(ratio_norm(lp, lp, mean, mean, std), torch.zeros(4, 3, dtype=D64))
    plain, _ = grpo_guard_loss(lp, lp, mean, mean, std, dt, adv, dt_weight=False)
    weighted, metrics = grpo_guard_loss(lp, lp, mean, mean, std, dt, adv)
    assert torch.allclose(plain, -adv[:, None].expand(4, 3))
    assert torch.allclose(weighted, plain / dt.abs())
    assert metrics["ratio_mean"].item() == pytest.approx(1.0)


def dppo_case(seed: int, b: int = 64, s_steps: int = 4, dim: int = 3, scale: float = 0.1):
    g = torch.Generator().manual_seed(seed)
    mean_old = torch.randn(b, s_steps, dim, generator=g, dtype=D64)
    mean_new = mean_old + scale * torch.randn(b, s_steps, dim, generator=g, dtype=D64)
    std = torch.rand(b, s_steps, generator=g, dtype=D64) * 0.5 + 0.05
    logp_old = torch.randn(b, s_steps, generator=g, dtype=D64)
    logp_new = (logp_old + 0.3 * torch.randn(b, s_steps, generator=g, dtype=D64)).requires_grad_(True)
    adv = torch.randn(b, generator=g, dtype=D64)
    return logp_new, logp_old, mean_new, mean_old, std, adv


def test_flow_dppo_with_infinite_threshold_is_the_unclipped_surrogate():
    lp, lo, mn, mo, std, adv = dppo_case(0)
    loss, metrics = flow_dppo_loss(lp, lo, mn, mo, std, adv, kl_threshold=math.inf)
    (g1,) = torch.autograd.grad(loss.sum(), lp)
    (g2,) = torch.autograd.grad((-adv[:, None] * (lp - lo).exp()).sum(), lp)
    assert torch.allclose(g1, g2, atol=1e-12) and metrics["mask_frac"].item() == 0


@pytest.mark.parametrize("seed", range(5))
def test_flow_dppo_never_masks_a_step_that_moves_back_toward_old(seed):
    lp, lo, mn, mo, std, adv = dppo_case(seed)
    loss, metrics = flow_dppo_loss(lp, lo, mn, mo, std, adv, kl_threshold=0.0)  # every step is "over"
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    rho, a = (lp - lo).exp().detach(), adv[:, None].expand_as(lp)
    corrective = ((a > 0) & (rho < 1)) | ((a < 0) & (rho > 1))
    assert corrective.any()
    assert torch.allclose(grad[corrective], (-a * rho)[corrective], atol=1e-12)  # full gradient kept
    toward_adv = ((a > 0) & (rho > 1)) | ((a < 0) & (rho < 1))
    assert torch.all(grad[toward_adv] == 0)
    assert metrics["mask_frac"].item() == pytest.approx(toward_adv.double().mean().item(), abs=1e-6)


def test_flow_dppo_mask_by_hand_and_units():
    lo = torch.zeros(1, 4, dtype=D64)
    lp = torch.log(torch.tensor([[1.2, 0.8, 1.2, 0.8]], dtype=D64)).requires_grad_(True)
    mo = torch.zeros(1, 4, 2, dtype=D64)
    mn = torch.tensor([[[0.1, 0.0], [0.1, 0.0], [0.01, 0.0], [0.01, 0.0]]], dtype=D64)  # KL_mean 2.5e-3 / 2.5e-5
    std = torch.full((1, 4), 1.0, dtype=D64)
    loss, m = flow_dppo_loss(lp, lo, mn, mo, std, torch.tensor([1.0], dtype=D64), kl_threshold=1e-3)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    assert grad[0].tolist() == pytest.approx([0.0, -0.8, -1.2, -0.8])  # only step 0: over KL and rho > 1 with A > 0
    assert m["pos_removed_frac"].item() == 0.25 and m["kl_mask_frac"].item() == 0.5
    for seed in range(3):
        case = dppo_case(seed, scale=0.05)
        for tau in (1e-4, 1e-3, 1e-2):
            _, a = flow_dppo_loss(*case, kl_threshold=tau, kl_reduce="mean")
            _, b = flow_dppo_loss(*case, kl_threshold=tau * 3, kl_reduce="sum")
            assert a["mask_frac"] == b["mask_frac"] and a["kl_mask_frac"] == b["kl_mask_frac"]


def test_the_flow_dppo_part_gates_on_the_kl_in_the_samplers_unit():
    """The part always gated on the per-dimension KL, so --reduce sum changed the ratio's unit but not the
    threshold's (the module says every threshold follows --reduce); an explicit kl_reduce still wins."""
    lp, lo, mn, mo, std, adv = dppo_case(1, scale=0.05)
    mask = torch.ones_like(lo)
    part = FLOW_LOSSES.fn("flow_dppo")
    for reduce in ("mean", "sum"):
        inp = FlowLossInputs(adv=adv, reduce=reduce, logp=lp, old_logp=lo, mean=mn, old_mean=mo, std=std, mask=mask)
        _, got = part(inp, kl_threshold=1e-3)
        _, want = flow_dppo_loss(lp, lo, mn, mo, std, adv, mask, kl_threshold=1e-3, kl_reduce=reduce)
        assert got["kl_mask_frac"] == want["kl_mask_frac"]
        _, pinned = part(inp, kl_threshold=1e-3, kl_reduce="mean")
        assert pinned["kl_mask_frac"] == flow_dppo_loss(lp, lo, mn, mo, std, adv, mask, kl_threshold=1e-3,
                                                        kl_reduce="mean")[1]["kl_mask_frac"]
    by_unit = [part(FlowLossInputs(adv=adv, reduce=r, logp=lp, old_logp=lo, mean=mn, old_mean=mo, std=std,
                                   mask=mask), kl_threshold=1e-3)[1]["kl_mask_frac"] for r in ("mean", "sum")]
    assert by_unit[0] != by_unit[1]  # the same tau masks more steps against the 3x larger summed KL


def test_flow_grpo_clip_by_hand_and_exact_kl_gradient():
    lo = torch.zeros(1, 3, dtype=D64)
    lp = torch.log(torch.tensor([[1.5, 0.5, 1.1]], dtype=D64)).requires_grad_(True)
    loss, m = flow_grpo_loss(lp, lo, torch.tensor([1.0], dtype=D64), clip=0.2)
    assert loss[0].tolist() == pytest.approx([-1.2, -0.5, -1.1])
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    assert grad[0].tolist() == pytest.approx([0.0, -0.5, -1.1])
    assert m["clip_frac"].item() == pytest.approx(1 / 3)
    mean = torch.tensor([[[0.3, -0.1], [0.0, 0.2], [0.1, 0.1]]], dtype=D64, requires_grad=True)
    ref = torch.zeros(1, 3, 2, dtype=D64)
    std = torch.tensor([[0.5, 0.2, 1.0]], dtype=D64)
    loss, m = flow_grpo_loss(lo, lo, torch.tensor([0.0], dtype=D64), clip=0.2, kl_beta=0.1, mean_new=mean,
                             mean_ref=ref, std=std, reduce="mean")
    (gm,) = torch.autograd.grad(loss.sum(), mean)
    assert torch.allclose(gm, 0.1 * mean.detach() / std[..., None] ** 2 / 2)
    assert torch.allclose(loss, 0.1 * step_kl(mean.detach(), ref, std, "mean"))
    with pytest.raises(ValueError, match="mean_ref"):
        flow_grpo_loss(lo, lo, torch.ones(1, dtype=D64), kl_beta=0.1, mean_new=mean, std=std)


def test_loo_advantages():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.2, 0.4, 0.9, 0.5]], dtype=D64)
    a = loo_advantages(r)
    k = r.shape[1]
    assert torch.allclose(a, k / (k - 1) * (r - r.mean(-1, keepdim=True)))
    assert torch.allclose(a.sum(-1), torch.zeros(2, dtype=D64))
    assert a[0, 0].item() == pytest.approx(1 - 1 / 3)  # by hand: 1 - mean(0, 0, 1)
    r2 = r.clone()
    r2[1, 2] += 5.0  # the baseline of sample i does not depend on r_i
    assert (loo_advantages(r2) - r2)[1, 2].item() == pytest.approx((a - r)[1, 2].item())


def _velocity(seed: int = 0):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.SiLU(), torch.nn.Linear(32, 2)).double()
    return net, lambda x, t, c: net(torch.cat([x, t[:, None], c], -1))


def test_fpo_ratio_is_one_at_old_parameters_and_gradient_is_advantage_weighted_cfm():
    net, vel = _velocity()
    g = torch.Generator().manual_seed(4)
    b, n = 6, 5
    acts, ctx = torch.randn(b, 2, generator=g, dtype=D64), torch.randn(b, 1, generator=g, dtype=D64)
    t, eps = torch.rand(b, n, generator=g, dtype=D64), torch.randn(b, n, 2, generator=g, dtype=D64)
    adv = torch.randn(b, generator=g, dtype=D64)
    with torch.no_grad():
        old = fpo_cfm_losses(vel, acts, ctx, t, eps)
    new = fpo_cfm_losses(vel, acts, ctx, t, eps)
    for per_sample in (False, True):
        loss, m = fpo_loss(new, old, adv, clip=0.2, per_sample_ratio=per_sample)
        assert m["ratio_min"].item() == 1.0 and m["ratio_max"].item() == 1.0
        ratio = fpo_ratio(vel, old, acts, ctx, t, eps, per_sample_ratio=per_sample)
        assert torch.equal(ratio, torch.ones(b, n, dtype=D64) if per_sample else torch.ones(b, dtype=D64))
    with torch.no_grad():
        net[2].bias += 0.1  # any other parameters: the ratio moves away from 1
    assert not torch.allclose(fpo_ratio(vel, old, acts, ctx, t, eps), torch.ones(b, dtype=D64))
    with torch.no_grad():
        net[2].bias -= 0.1
    loss, _ = fpo_loss(new, old, adv, clip=0.2)
    g1 = torch.autograd.grad(loss.mean(), list(net.parameters()))
    g2 = torch.autograd.grad((adv * fpo_cfm_losses(vel, acts, ctx, t, eps).mean(-1)).mean(), list(net.parameters()))
    assert all(torch.allclose(x, y, atol=1e-12) for x, y in zip(g1, g2))
    # the CFM loss by hand for one (t, eps): x_t = (1 - t) a + t eps, target eps - a
    x = (1 - t[0, 0]) * acts[0] + t[0, 0] * eps[0, 0]
    want = ((vel(x[None], t[0, :1], ctx[:1])[0] - (eps[0, 0] - acts[0])) ** 2).sum()
    assert old[0, 0].item() == pytest.approx(want.item(), abs=1e-12)


def test_registered_parts_validate_and_name_missing_inputs():
    with pytest.raises(PartError, match="'kl_threshold' = -1.0 is out of range"):
        FLOW_LOSSES.resolve("flow_dppo", {"kl_threshold": -1})
    with pytest.raises(PartError, match="unknown parameter 'clipp'"):
        FLOW_LOSSES.resolve("flow_clip", {"clipp": 0.1})
    with pytest.raises(ValueError, match="FlowLossInputs.old_mean"):
        FLOW_LOSSES.fn("flow_dppo")(FlowLossInputs(adv=torch.ones(2), reduce="mean", logp=torch.zeros(2, 1),
                                                   old_logp=torch.zeros(2, 1), mean=torch.zeros(2, 1, 2)))
    with pytest.raises(ValueError, match="FlowLossInputs.cfm_loss"):
        FLOW_LOSSES.fn("fpo")(FlowLossInputs(adv=torch.ones(2), reduce="mean"))
    lp, lo, mn, mo, std, adv = dppo_case(0)
    mask = torch.ones_like(lo)
    mask[:, -1] = 0  # a deterministic last step never counts
    inp = FlowLossInputs(adv=adv, reduce="mean", logp=lp, old_logp=lo, mean=mn, old_mean=mo, std=std, mask=mask)
    loss, _ = FLOW_LOSSES.fn("flow_dppo")(inp, kl_threshold=1e-3)
    per, _ = flow_dppo_loss(lp, lo, mn, mo, std, adv, kl_threshold=1e-3)
    assert loss.item() == pytest.approx(per[:, :-1].mean().item())
