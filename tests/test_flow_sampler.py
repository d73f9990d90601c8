"""SDE sampler: marginal preservation on the analytic Gaussian velocity, step log-probs and their units.

Spec methods-seedblog.md F4/F5 (marginal test), B4 (Gaussian step policy) and the CPS formula.
"""

from __future__ import annotations

import math

import pytest
import torch

from polyrl.families.flow.sampler import (
    flow_sde_step,
    gaussian_logp,
    gaussian_step_kl,
    replay,
    sample_sde,
    sde_window,
    step_mean_std,
    timesteps,
)

D64 = torch.float64
torch.set_num_threads(1)


def gaussian_velocity(m: float, s: float):
    """Exact velocity for data N(m, s^2) (spec 'Shared harness'): affine in x."""

    def v(x, t, context=None):
        t = t.reshape(-1, *([1] * (x.dim() - 1))).to(x.dtype)
        return (t - (1 - t) * s**2) / ((1 - t) ** 2 * s**2 + t**2) * (x - (1 - t) * m) - m

    return v


@pytest.mark.parametrize("schedule, steps", [("flow_grpo", 100), ("dance", 100), ("flow_grpo", 10)])
def test_sde_preserves_the_data_marginal(schedule, steps):
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(50_000, 1, generator=g, dtype=D64)
    x = sample_sde(gaussian_velocity(1.5, 0.5), noise, steps=steps, eta=0.7, schedule=schedule, generator=g).samples
    assert abs(x.mean().item() - 1.5) < 0.01
    if steps >= 100:
        assert abs(x.std().item() - 0.5) < 0.01
    else:  # spec F4: with 10 steps the discretisation error is visible (std about 0.63)
        assert x.std().item() > 0.58


def test_cps_keeps_noise_coefficient_t_when_predictions_are_exact():
    """Point-mass data at m: x0_hat and eps_hat are exact, so x_t ~ (1-t) m + t N(0, 1) after every step."""
    m = 2.0
    v = gaussian_velocity(m, 1e-6)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(100_000, 1, generator=g, dtype=D64)
    ts = timesteps(10).to(D64)
    for k in range(9):
        x, _, _, std = flow_sde_step(x, v(x, ts[k].expand(x.shape[0])), ts[k], ts[k + 1], eta=0.7,
                                     schedule="cps", generator=g)
        t = ts[k + 1].item()
        assert abs(x.mean().item() - (1 - t) * m) < 0.01
        assert abs(x.std().item() - t) < 0.01
        assert torch.allclose(std, torch.full_like(std, t * math.sin(0.7 * math.pi / 2)))


def test_logp_matches_torch_normal_and_units_differ_by_d():
    g = torch.Generator().manual_seed(2)
    x, mean = torch.randn(5, 3, generator=g, dtype=D64), torch.randn(5, 3, generator=g, dtype=D64)
    std = torch.rand(5, generator=g, dtype=D64) + 0.1
    ref = torch.distributions.Normal(mean, std[:, None]).log_prob(x).sum(-1)
    assert torch.allclose(gaussian_logp(x, mean, std, "sum"), ref, atol=1e-12)
    assert torch.allclose(gaussian_logp(x, mean, std, "mean"), ref / 3, atol=1e-12)
    kl = gaussian_step_kl(x, mean, std, "sum")
    assert torch.allclose(kl, ((x - mean) ** 2).sum(-1) / (2 * std**2), atol=1e-12)
    assert torch.allclose(gaussian_step_kl(x, mean, std, "mean"), kl / 3, atol=1e-12)
    assert torch.allclose(gaussian_step_kl(mean, x, std), gaussian_step_kl(x, mean, std))  # symmetric


def test_flow_grpo_step_formula_by_hand():
    x, v = torch.tensor([[1.0, -2.0]], dtype=D64), torch.tensor([[0.5, 0.25]], dtype=D64)
    t, tn, eta = 0.6, 0.5, 0.7
    sigma = eta * math.sqrt(t / (1 - t))
    mean, std = step_mean_std(x, v, t, tn, eta=eta, schedule="flow_grpo")
    want = x + (v + sigma**2 / (2 * t) * (x + (1 - t) * v)) * (tn - t)
    assert torch.allclose(mean, want, atol=1e-12)
    assert std.item() == pytest.approx(sigma * math.sqrt(t - tn), abs=1e-12)
    _, std1 = step_mean_std(x, v, 1.0, 0.9, eta=eta, schedule="flow_grpo", t_clamp=0.99)  # clamped at t = 1
    assert std1.item() == pytest.approx(eta * math.sqrt(99) * math.sqrt(0.1), abs=1e-9)
    _, std_d = step_mean_std(x, v, t, tn, eta=0.3, schedule="dance")
    assert std_d.item() == pytest.approx(0.3 * math.sqrt(0.1), abs=1e-12)


def test_last_cps_step_is_deterministic_with_zero_logp():
    x, v = torch.randn(4, 2, dtype=D64), torch.randn(4, 2, dtype=D64)
    x_next, logp, mean, std = flow_sde_step(x, v, 0.1, 0.0, eta=0.7, schedule="cps")
    assert torch.equal(x_next, mean) and torch.all(std == 0) and torch.all(logp == 0)
    assert torch.allclose(mean, x - 0.1 * v)  # x0_hat


@pytest.mark.parametrize("schedule", ["flow_grpo", "dance", "cps"])
def test_replay_reproduces_rollout_logp_and_mean(schedule):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).double()

    def vel(x, t, c):
        return net(torch.cat([x, t[:, None].to(x.dtype), c], -1))

    g = torch.Generator().manual_seed(3)
    ctx = torch.randn(6, 1, generator=g, dtype=D64)
    traj = sample_sde(vel, torch.randn(6, 2, generator=g, dtype=D64), context=ctx, steps=5, schedule=schedule,
                      generator=g)
    logp, mean = replay(vel, traj, eta=0.7, schedule=schedule)
    assert torch.allclose(logp, traj.logp, atol=1e-10) and torch.allclose(mean, traj.mean, atol=1e-10)
    assert traj.stochastic[:, -1].all() == (schedule != "cps")
    logp.sum().backward()  # replay carries gradient into the velocity network
    assert net[0].weight.grad is not None and net[0].weight.grad.abs().sum() > 0


def test_an_sde_window_draws_its_steps_in_the_window():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        mask = sde_window(10, 3, 0.5, g)
        assert int(mask.sum()) == 3 and not mask[5:].any()
    assert sde_window(10, 0, 0.5).all()  # 0: every step
    assert sde_window(7, 4, 0.5, g)[:4].all()  # ceil(0.5 * 7) = 4 steps: all of them
    with pytest.raises(ValueError, match="does not fit the first 4 of 7"):
        sde_window(7, 5, 0.5)


@pytest.mark.parametrize("schedule", ["flow_grpo", "dance", "cps"])
def test_steps_outside_the_sde_window_are_the_deterministic_step(schedule):
    """Outside the window eta = 0: std 0, log-prob 0 (not stochastic, so no loss reads it) and the schedule's
    deterministic mean (Euler's x + v dt; DDIM's x0_hat (1 - t') + eps_hat t' for cps); replay gives the same."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).double()

    def vel(x, t, c=None):
        return net(torch.cat([x, t[:, None].to(x.dtype)], -1))

    g = torch.Generator().manual_seed(3)
    window = torch.tensor([False, True, True, False, False])
    traj = sample_sde(vel, torch.randn(6, 2, generator=g, dtype=D64), steps=5, schedule=schedule, generator=g,
                      sde=window)
    assert torch.equal(traj.stochastic, window.expand(6, 5) & (traj.std > 0))
    assert traj.stochastic[:, 1:3].all() and (traj.logp[:, ~window] == 0).all()
    ts = traj.times
    for k in (0, 3, 4):
        x, t, tn = traj.states[:, k], ts[k], ts[k + 1]
        v = vel(x, t.expand(6))
        want = x + v * (tn - t) if schedule != "cps" else (x - t * v) * (1 - tn) + (x + (1 - t) * v) * tn
        assert torch.allclose(traj.states[:, k + 1], want, atol=1e-12)
    logp, mean = replay(vel, traj, eta=0.7, schedule=schedule)
    assert torch.allclose(logp, traj.logp, atol=1e-10) and torch.allclose(mean, traj.mean, atol=1e-10)
