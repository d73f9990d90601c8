"""SDE samplers for rectified flows, with the Gaussian step policy of every step (spec B4, F4, F5).

Time convention (Flow-GRPO, spec F4): ``x_t = (1 - t) x_0 + t eps``, t = 1 is noise, t = 0 is data,
the velocity is ``v = dx/dt = eps - x_0`` and sampling runs t = 1 -> 0 with ``dt = t_next - t < 0``.
Two quantities recovered from v are used below: ``x0_hat = x - t v`` and ``eps_hat = x + (1 - t) v``.

Each stochastic step is a Gaussian policy ``pi(x'|x) = N(m_theta(x, t), s^2 I)``. Its log-probability
is returned in one of two units (the ``reduce`` argument, used everywhere in ``polyrl.families.flow``):

- ``"sum"``: nats of the D-dimensional density, ``-||x'-m||^2/(2 s^2) - D log s - (D/2) log(2 pi)``;
- ``"mean"``: the same divided by D (nats per dimension; Flow-GRPO/UniRL reference code).

Ratios, clip ranges and KL thresholds inherit the unit: a per-dimension threshold ``tau`` equals a
summed threshold ``D * tau``. A step whose std is 0 (the last CPS step, ``t_next = 0``) is
deterministic: its log-probability is reported as 0 and it is marked not ``stochastic``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Schedule = Literal["flow_grpo", "dance", "cps"]
Reduce = Literal["mean", "sum"]
SCHEDULES: tuple[str, ...] = ("flow_grpo", "dance", "cps")
REDUCES: tuple[str, ...] = ("mean", "sum")


def _reduce(x: Tensor, reduce: str) -> Tensor:
    """Sum or mean over every dimension after the first (the latent dimensions)."""
    if reduce not in REDUCES:
        raise ValueError(f"reduce = {reduce!r}; allowed: 'mean', 'sum'")
    dims = tuple(range(1, x.dim()))
    return x.sum(dims) if reduce == "sum" else x.mean(dims)


def _per_row(std: Tensor | float, ref: Tensor) -> Tensor:
    """std as a tensor broadcastable against ``ref`` [N, *] (accepts a float, [N] or [N, 1, ...])."""
    s = torch.as_tensor(std, dtype=ref.dtype, device=ref.device)
    return s.reshape(-1, *([1] * (ref.dim() - 1))) if s.dim() >= 1 else s


def gaussian_logp(x: Tensor, mean: Tensor, std: Tensor | float, reduce: Reduce = "mean") -> Tensor:
    """Log-density of N(mean, std^2 I) at x; rows are samples, the rest are latent dims. Returns [N].

    sum: -||x - m||^2/(2 s^2) - D log s - (D/2) log(2 pi); mean: the sum divided by D (spec B4).
    """
    s = _per_row(std, x)
    elem = -((x - mean) ** 2) / (2 * s**2) - torch.log(s) - 0.5 * math.log(2 * math.pi)
    return _reduce(elem, reduce)


def gaussian_step_kl(mean_p: Tensor, mean_q: Tensor, std: Tensor | float, reduce: Reduce = "mean") -> Tensor:
    """Exact KL between N(mean_p, s^2 I) and N(mean_q, s^2 I): ||m_p - m_q||^2 / (2 s^2). Returns [N].

    arXiv:2606.11025 Eq. 14. Symmetric in p and q. ``reduce="mean"`` divides by D (per-dimension nats).
    """
    s = _per_row(std, mean_p)
    return _reduce((mean_p - mean_q) ** 2 / (2 * s**2), reduce)


def step_mean_std(x: Tensor, v: Tensor, t: Tensor | float, t_next: Tensor | float, *, eta: Tensor | float,
                  schedule: Schedule, t_clamp: float = 0.99) -> tuple[Tensor, Tensor]:
    """Mean [N, *] and std [N] of the Gaussian step x_t -> x_{t_next} for one noise schedule.

    flow_grpo (arXiv:2505.05470): sigma_t = eta sqrt(t/(1-t)) with t clamped at ``t_clamp``;
      m = x + [v + sigma_t^2/(2t) (x + (1-t) v)] dt, s = sigma_t sqrt(|dt|).
    dance (arXiv:2505.07818): the same with a constant sigma_t = eta.
    cps (arXiv:2509.05952): s = t_next sin(eta pi/2); m = x0_hat (1 - t_next) + eps_hat sqrt(t_next^2 - s^2).
    ``eta`` may differ per row ([N]); eta = 0 is the deterministic step of each schedule (the Euler ODE step for
    flow_grpo and dance, DDIM's for cps), with std 0.
    """
    t = torch.as_tensor(t, dtype=x.dtype, device=x.device).reshape(-1)
    t_next = torch.as_tensor(t_next, dtype=x.dtype, device=x.device).reshape(-1)
    t, t_next = t.expand(x.shape[0]), t_next.expand(x.shape[0])
    eta = torch.as_tensor(eta, dtype=x.dtype, device=x.device).reshape(-1).expand(x.shape[0])
    col = [-1] + [1] * (x.dim() - 1)
    tc, tn = t.reshape(col), t_next.reshape(col)
    eps_hat = x + (1 - tc) * v
    if schedule == "cps":
        s = t_next * torch.sin(eta * (math.pi / 2))
        x0_hat = x - tc * v
        mean = x0_hat * (1 - tn) + eps_hat * (tn**2 - s.reshape(col) ** 2).clamp_min(0).sqrt()
        return mean, s
    dt = t_next - t
    if schedule == "flow_grpo":
        tt = t.clamp(max=t_clamp)
        sigma = eta * (tt / (1 - tt)).sqrt()
    elif schedule == "dance":
        sigma = eta.clone()
    else:
        raise ValueError(f"schedule = {schedule!r}; allowed: {', '.join(SCHEDULES)}")
    sig2 = sigma.reshape(col) ** 2
    mean = x + (v + sig2 / (2 * tc) * eps_hat) * dt.reshape(col)
    return mean, sigma * (-dt).clamp_min(0).sqrt()


def flow_sde_step(x: Tensor, v: Tensor, t: Tensor | float, t_next: Tensor | float, *, eta: Tensor | float,
                  schedule: Schedule, generator: torch.Generator | None = None, prev_sample: Tensor | None = None,
                  reduce: Reduce = "mean", t_clamp: float = 0.99) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Take one SDE step (or score a given ``prev_sample``): returns (x_next, logp [N], mean, std [N]).

    x_next = mean + std * noise with the schedule's mean and std (``step_mean_std``); logp is the
    Gaussian step log-probability of x_next in the ``reduce`` unit, 0 where std == 0 (deterministic).
    """
    mean, std = step_mean_std(x, v, t, t_next, eta=eta, schedule=schedule, t_clamp=t_clamp)
    if prev_sample is None:
        noise = torch.randn(x.shape, generator=generator, dtype=x.dtype, device=x.device)
        prev_sample = mean + _per_row(std, x) * noise
    stochastic = std > 0
    safe = torch.where(stochastic, std, torch.ones_like(std))
    logp = torch.where(stochastic, gaussian_logp(prev_sample, mean, safe, reduce), torch.zeros_like(std))
    return prev_sample, logp, mean, std


def timesteps(n_steps: int, *, shift: float = 1.0) -> Tensor:
    """Times 1 = t_0 > t_1 > ... > t_n = 0, uniform then shifted: t -> shift t / (1 + (shift - 1) t) (SD3)."""
    if n_steps < 1:
        raise ValueError(f"n_steps must be >= 1, got {n_steps}")
    t = torch.linspace(1.0, 0.0, n_steps + 1, dtype=torch.float64)
    return (shift * t / (1 + (shift - 1) * t)).to(torch.get_default_dtype())


VelocityFn = Callable[[Tensor, Tensor, Tensor | None], Tensor]  # (x [N, D], t [N], context [N, C] | None) -> v


@dataclass
class Trajectory:
    """Rollout of N samples through S sampler steps; everything the losses need at replay."""

    states: Tensor  # [N, S+1, D] x at t_0 = 1 (noise) ... t_S = 0 (the sample)
    times: Tensor  # [S+1] sampler times, decreasing from 1 to 0
    logp: Tensor  # [N, S] step log-probs under the sampling policy, in ``reduce`` units
    mean: Tensor  # [N, S, D] step means under the sampling policy
    std: Tensor  # [N, S] step stds (0 for deterministic steps)
    context: Tensor | None  # [N, C] conditioning vector (the "prompt"), None when unconditional
    sde: Tensor | None = None  # [N, S] bool: steps sampled with noise (an SDE window); None: every step

    @property
    def samples(self) -> Tensor:
        return self.states[:, -1]

    @property
    def stochastic(self) -> Tensor:
        """[N, S] bool: steps with std > 0, the only ones that carry a log-probability."""
        return self.std > 0

    @property
    def dt(self) -> Tensor:
        """[S] step sizes t_{k+1} - t_k (negative)."""
        return self.times[1:] - self.times[:-1]


def sde_window(steps: int, count: int, window: float, generator: torch.Generator | None = None) -> Tensor:
    """[steps] bool: ``count`` distinct steps drawn uniformly among the first ceil(``window`` * steps) of the
    schedule (from the noise end), the rest deterministic; ``count`` 0: every step (MixGRPO / UniRL's SDE window,
    whose Flow-DPPO recipe is 3 of 10 in the first half). Training draws one per sampling call: a batch's actions of
    one environment step share it."""
    mask = torch.zeros(steps, dtype=torch.bool)
    if count == 0:
        return mask | True
    span = math.ceil(window * steps - 1e-9)
    if not 1 <= count <= span:
        raise ValueError(f"sde_steps = {count} does not fit the first {span} of {steps} sampler steps")
    mask[torch.randperm(span, generator=generator)[:count]] = True
    return mask


@torch.no_grad()
def sample_sde(velocity: VelocityFn, noise: Tensor, *, context: Tensor | None = None, steps: int = 10,
               eta: float = 0.7, schedule: Schedule = "flow_grpo", reduce: Reduce = "mean", shift: float = 1.0,
               generator: torch.Generator | None = None, sde: Tensor | None = None) -> Trajectory:
    """Sample N trajectories from initial ``noise`` [N, D] with the SDE sampler; no gradient. ``sde`` [steps] bool
    (``sde_window``): the steps that get noise, the others deterministic (std 0); None: every step."""
    ts = timesteps(steps, shift=shift).to(noise.dtype)
    x, states, logps, means, stds = noise, [noise], [], [], []
    for k in range(steps):
        t = ts[k].expand(x.shape[0])
        v = velocity(x, t, context)
        step_eta = eta if sde is None else eta * float(sde[k])
        x, lp, m, s = flow_sde_step(x, v, ts[k], ts[k + 1], eta=step_eta, schedule=schedule, generator=generator,
                                    reduce=reduce)
        states.append(x)
        logps.append(lp)
        means.append(m)
        stds.append(s)
    return Trajectory(states=torch.stack(states, 1), times=ts, logp=torch.stack(logps, 1),
                      mean=torch.stack(means, 1), std=torch.stack(stds, 1), context=context,
                      sde=None if sde is None else sde.expand(noise.shape[0], steps).clone())


def replay(velocity: VelocityFn, traj: Trajectory, *, eta: float, schedule: Schedule,
           reduce: Reduce = "mean") -> tuple[Tensor, Tensor]:
    """Step log-probs [N, S] and means [N, S, D] of the stored transitions under ``velocity`` (with grad).

    All N*S states go through the network in one batch. Std depends only on the times (and on which steps had
    noise, ``traj.sde``), so it is the stored one.
    """
    n, s1, d = traj.states.shape
    steps = s1 - 1
    x = traj.states[:, :-1].reshape(n * steps, d)
    t = traj.times[:-1].repeat(n)
    t_next = traj.times[1:].repeat(n)
    ctx = None if traj.context is None else traj.context.repeat_interleave(steps, 0)
    v = velocity(x, t, ctx)
    row_eta = eta if traj.sde is None else eta * traj.sde.reshape(-1).to(x.dtype)
    _, logp, mean, _ = flow_sde_step(x, v, t, t_next, eta=row_eta, schedule=schedule,
                                     prev_sample=traj.states[:, 1:].reshape(n * steps, d), reduce=reduce)
    return logp.reshape(n, steps), mean.reshape(n, steps, d)


@torch.no_grad()
def sample_ode(velocity: VelocityFn, noise: Tensor, *, context: Tensor | None = None, steps: int = 10) -> Tensor:
    """Euler ODE sample x_{t+dt} = x_t + v dt from t = 1 to 0 (the deterministic sampler, for pretraining checks)."""
    ts = timesteps(steps).to(noise.dtype)
    x = noise
    for k in range(steps):
        x = x + velocity(x, ts[k].expand(x.shape[0]), context) * (ts[k + 1] - ts[k])
    return x
