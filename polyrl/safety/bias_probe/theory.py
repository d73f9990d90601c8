"""One-shot bias, analytic part: the Bernoulli policy-gradient onset time and the categorical bandit simulation.

Source: Deng, Zhu, Shi, Scott, Mihalcea, "It Takes One to Bias Them All: Breaking Bad with One-Shot GRPO",
arXiv:2606.10931 (spec §4, methods-seedblog.md). The paper's released simulation (``simulate_plot.py``) integrates
the mean-baseline gradient flow of a logistic policy; solving it for the time to reach p = 0.5, and the
std-normalised variant, are ours (spec §4(a) marks both [ours]).

The bandit simulation draws GRPO groups from a K-option softmax policy and updates its logits with polyrl's own
parts: the advantage estimator of ``polyrl.registry.ADVANTAGES`` (``grpo`` = group z-score, ``group_centered`` =
mean-centre only) and the composed loss ``polyrl.objectives.policy_loss`` of the ``grpo`` preset (PPO clip, k3 KL
to the initial policy, ``seq_mean_token_mean``), followed by a plain SGD step on the logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


def _check_p(p0: float) -> None:
    if not 0.0 < p0 < 1.0:
        raise ValueError(f"p0 must be in (0, 1), got {p0}")


def bernoulli_pg_onset_time(p0: float, eta: float, b: float = 1.0, std_normalized: bool = True) -> float:
    """Time for the Bernoulli policy-gradient flow to lift p from p0 to 0.5 (closed form).

    Policy: p = sigmoid(u), u = theta.x, b = ||x||^2, reward 1 on the target answer, mean baseline.
    Gradient flow (arXiv:2606.10931, released simulation):
      without std normalisation  du/dt = eta*b*p(1-p)        ->  2(u - a) + 2 sinh(u) - 2 sinh(a) = eta*b*t
      with GRPO std normalisation du/dt = eta*b*sqrt(p(1-p)) ->  4 sinh(u/2) - 4 sinh(a/2) = eta*b*t
    (1/(p(1-p)) = 2 + 2 cosh u and 1/sqrt(p(1-p)) = 2 cosh(u/2)), with a = logit(p0). At p = 0.5, u = 0:
      t_onset = 2(|a| + sinh|a|)/(eta*b)   (no std)      t_onset = 4 sinh(|a|/2)/(eta*b)   (std).
    Convention: solving for p = 0.5 and the std-normalised flow are ours (spec §4 [ours]); the std is the
    population std sqrt(p(1-p)) of the infinite group (no eps); p0 >= 0.5 gives 0. One SGD step of learning
    rate eta advances t by 1 (t counts steps).
    """
    _check_p(p0)
    if eta <= 0 or b <= 0:
        raise ValueError(f"eta and b must be > 0, got eta={eta}, b={b}")
    a = math.log(p0 / (1.0 - p0))
    if a >= 0:
        return 0.0
    m = -a
    return (4.0 * math.sinh(m / 2.0) if std_normalized else 2.0 * (m + math.sinh(m))) / (eta * b)


def bernoulli_pg_onset_ode(p0: float, eta: float, b: float = 1.0, std_normalized: bool = True) -> float:
    """The same onset time by numerical integration of du/dt = eta*b*f(sigmoid(u)) up to the event u = 0.

    f(p) = p(1-p) (no std) or sqrt(p(1-p)) (std). scipy ``solve_ivp`` (DOP853, rtol 1e-12, atol 1e-12) with a
    terminal event at u = 0. Used to check ``bernoulli_pg_onset_time`` (spec §4(e) test 1).
    """
    from scipy.integrate import solve_ivp
    from scipy.special import expit

    _check_p(p0)
    a = math.log(p0 / (1.0 - p0))
    if a >= 0:
        return 0.0

    def rhs(_t, u):
        p = float(expit(u[0]))
        f = math.sqrt(p * (1.0 - p)) if std_normalized else p * (1.0 - p)
        return [eta * b * f]

    def hit(_t, u):
        return u[0]

    hit.terminal, hit.direction = True, 1.0
    horizon = 10.0 * bernoulli_pg_onset_time(p0, eta, b, std_normalized) + 10.0
    sol = solve_ivp(rhs, (0.0, horizon), [a], method="DOP853", rtol=1e-12, atol=1e-12, events=hit)
    if not sol.t_events[0].size:
        raise RuntimeError("ODE did not reach p = 0.5 within the horizon")
    return float(sol.t_events[0][0])


def softmax_effective_b(k: int) -> float:
    """b of the target log-odds for a K-option softmax over free logits with the other options tied.

    With u = z_t - log sum_{j!=t} exp(z_j) and expected logit updates dz_t = c p(1-p), dz_j = -c p p_j,
    du = c p(1-p) (1 + sum_j q_j^2), q_j = p_j/(1-p); the other options stay tied (q_j = 1/(K-1)), so
    b = 1 + 1/(K-1) = K/(K-1) (1.5 for 3 options). Convention: ours, derived for the spec's 3-option bandit.
    """
    if k < 2:
        raise ValueError(f"need at least 2 options, got {k}")
    return k / (k - 1.0)


@dataclass
class BanditResult:
    onsets: np.ndarray  # [S] first step with P(target) >= 0.5; -1 when not reached within max_steps
    curves: np.ndarray  # [S, max_steps + 1] P(target) after each step (held after the last step run)
    steps_run: int


def simulate_bandit_onsets(p0: float, *, seeds: int = 20, k: int = 3, group: int = 16, lr: float = 0.5,
                           std_normalized: bool = True, kl_coef: float = 0.0, max_steps: int = 4000,
                           seed: int = 0, record_curves: bool = False) -> BanditResult:
    """GRPO on a K-option softmax bandit from P(target) = p0; the onset step of every seed.

    One row of logits per seed (all seeds in one batch, one group each): initial logits log p0 for the
    target and log((1-p0)/(K-1)) for the others; each step samples G answers per seed, reward 1 for the
    target, advantages from ``ADVANTAGES`` (``grpo`` with std normalisation, ``group_centered`` without),
    loss ``policy_loss`` of the ``grpo`` preset (k3 KL to the initial logits with ``kl_coef``), then
    logits -= lr * grad. The loss is multiplied by the number of seeds so each seed's step is exactly
    lr * (1/G) sum_i A_i grad log pi(y_i) (+ KL), as for one group alone.
    Convention: polyrl's grpo advantage (Bessel std, eps 1e-6, zero for all-equal groups); the spec's simulation
    (3 options, G=16, lr 0.5, 20 seeds) does not name its std; onset = first step t >= 1 after whose update
    P(target) >= 0.5 (0 when p0 >= 0.5).
    """
    from polyrl.methods import get_method
    from polyrl.objectives import policy_loss
    from polyrl.registry import ADVANTAGES
    from polyrl.types import LossInputs, Normalizer

    _check_p(p0)
    method = get_method("grpo", advantage="grpo" if std_normalized else "group_centered", kl_coef=kl_coef)
    adv_fn = ADVANTAGES.fn(method.advantage.name)
    gen = torch.Generator().manual_seed(seed)
    init = torch.full((seeds, k), math.log((1.0 - p0) / (k - 1)), dtype=torch.float64)
    init[:, 0] = math.log(p0)  # option 0 is the target
    ref_logprobs = init.log_softmax(-1)
    logits = init.clone().requires_grad_(True)
    group_ids = torch.arange(seeds).repeat_interleave(group)
    mask = torch.ones(seeds * group, 1, dtype=torch.float64)
    normalizer = Normalizer.from_batch(mask, group_ids)
    rows = group_ids
    onsets = np.full(seeds, 0 if p0 >= 0.5 else -1, dtype=int)
    curves = np.full((seeds, max_steps + 1), np.nan) if record_curves else np.zeros((seeds, 0))
    if record_curves:
        curves[:, 0] = p0
    step = 0
    for step in range(1, max_steps + 1):
        if (onsets >= 0).all() and not record_curves:
            step -= 1
            break
        logprobs = logits.log_softmax(-1)
        actions = torch.multinomial(logprobs.detach().exp(), group, replacement=True, generator=gen).reshape(-1)
        rewards = (actions == 0).to(torch.float64)
        adv = adv_fn(rewards, group_ids, mask, **method.advantage.params)
        logp = logprobs[rows, actions][:, None]
        inputs = LossInputs(logp=logp, old_logp=logp.detach(), adv=adv, mask=mask, normalizer=normalizer,
                            ref_logp=ref_logprobs[rows, actions][:, None], group_ids=group_ids)
        loss = policy_loss(inputs, method).loss * seeds
        (grad,) = torch.autograd.grad(loss, logits)
        with torch.no_grad():
            logits -= lr * grad
            p = logits.softmax(-1)[:, 0].numpy()
        newly = (onsets < 0) & (p >= 0.5)
        onsets[newly] = step
        if record_curves:
            curves[:, step] = p
    if record_curves:
        curves = curves[:, : step + 1]
    return BanditResult(onsets=onsets, curves=curves, steps_run=step)


def median_ci(values, level: float = 0.9, n_boot: int = 2000, seed: int = 0,
              sample_size: int | None = None) -> tuple[float, float, float]:
    """(median, lo, hi): percentile-bootstrap interval of the median over seeds (resampling with replacement).

    ``sample_size`` = m draws resamples of m seeds instead of len(values): (lo, hi) is then the 90% range of the
    median of a fresh m-seed experiment (used to ask whether the spec's 20-seed medians are consistent with our
    onset distribution, since their medians carry 20-seed noise of their own).
    Convention: the spec's table reports medians, so the interval is for the median (``bootstrap_ci`` of
    polyrl.lab.stats gives the mean's); censored seeds (no onset) enter as +inf, so an interval may be open.
    """
    v = np.asarray(values, dtype=float)
    idx = np.random.default_rng(seed).integers(0, v.size, size=(n_boot, sample_size or v.size))
    meds = np.median(v[idx], axis=1)
    lo, hi = np.quantile(meds, [(1 - level) / 2, 1 - (1 - level) / 2], method="nearest")
    return float(np.median(v)), float(lo), float(hi)


def grpo_expected_drift(p: float, group: int, std_normalized: bool = True, eps: float = 1e-6) -> float:
    """Expected per-step push c_G(p) on the target logit of one GRPO group of G samples (finite-group flow).

    With k ~ Binomial(G, p) target samples, E[(1/G) sum_i A_i (1[y_i = t] - p)] = E[(k/G)(1 - k/G) / s_k]
    where s_k = std_k + eps (Bessel std sqrt(k(G-k)/(G(G-1))), polyrl's grpo) with std normalisation and
    s_k = 1 without (then c = (1 - 1/G) p(1-p) exactly). Groups with k in {0, G} contribute 0, which is why
    small p0 waits for a first success. As G -> inf, c -> sqrt(p(1-p)) (std) and p(1-p) (no std).
    Convention: ours (a mean-field refinement of the spec's flow: the expected step, not its noise).
    """
    from scipy.stats import binom

    ks = np.arange(group + 1)
    pmf = binom.pmf(ks, group, p)
    frac = ks / group
    if std_normalized:
        std = np.sqrt(ks * (group - ks) / (group * (group - 1.0)))
        scale = std + eps
    else:
        scale = np.ones_like(frac)
    return float(np.sum(pmf * frac * (1.0 - frac) / scale))


def finite_group_onset_ode(p0: float, eta: float, b: float, group: int, std_normalized: bool = True) -> float:
    """Onset time of du/dt = eta*b*c_G(sigmoid(u)) (``grpo_expected_drift``), integrated to u = 0 (steps)."""
    from scipy.integrate import solve_ivp
    from scipy.special import expit

    _check_p(p0)
    a = math.log(p0 / (1.0 - p0))
    if a >= 0:
        return 0.0

    def rhs(_t, u):
        return [eta * b * grpo_expected_drift(float(expit(u[0])), group, std_normalized)]

    def hit(_t, u):
        return u[0]

    hit.terminal, hit.direction = True, 1.0
    horizon = 50.0 * bernoulli_pg_onset_time(p0, eta, b, std_normalized) + 50.0
    sol = solve_ivp(rhs, (0.0, horizon), [a], rtol=1e-8, atol=1e-10, events=hit)
    if not sol.t_events[0].size:
        raise RuntimeError("finite-group ODE did not reach p = 0.5 within the horizon")
    return float(sol.t_events[0][0])
