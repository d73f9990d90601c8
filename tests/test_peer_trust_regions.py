"""The peers' trust regions: Clip-Cov, KL-Cov (verl), GMPO (verl geo_mean), VESPO (TRL), DRO (verl), LUSPO preset.

Hand-computed values and gradients on tiny 2x3 batches (float64), plus each paper's property. As in
tests/test_trust_regions.py, ``logp`` is a grad leaf and ``old_logp`` is chosen so that the log-ratio is
known; gradients are d (sum of the masked per-token loss) / d logp.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import polyrl.objectives  # noqa: F401  (registers every part)
from polyrl.objectives import policy_loss
from polyrl.objectives.covariance import selection_count, token_covariance
from polyrl.presets import trust
from polyrl.registry import TRUST_REGIONS, PartError
from polyrl.types import LossInputs, Normalizer
from tests.helpers import make_inputs

D = torch.float64
E01 = math.exp(0.1)


def make(logp, log_ratio, adv, mask=None) -> LossInputs:
    """[B, T] inputs with logp a grad leaf and old_logp = logp - log_ratio; adv [B] or [B, T]."""
    lp = torch.as_tensor(logp, dtype=D)
    lr = torch.as_tensor(log_ratio, dtype=D).expand_as(lp)
    a = torch.as_tensor(adv, dtype=D)
    a = (a[:, None] if a.dim() == 1 else a).expand_as(lp).clone()
    m = torch.ones_like(lp) if mask is None else torch.as_tensor(mask, dtype=D)
    return LossInputs(logp=lp.clone().requires_grad_(True), old_logp=lp - lr, adv=a, mask=m,
                      normalizer=Normalizer.from_batch(m, torch.arange(lp.shape[0])))


def run(name: str, inp: LossInputs, **params):
    """(per-token loss, d sum(mask * loss) / d logp, metrics) of trust region ``name``, params validated."""
    part = TRUST_REGIONS.resolve(name, params)
    loss, metrics = TRUST_REGIONS.fn(name)(inp, inp.logp - inp.old_logp, **part.params)
    (grad,) = torch.autograd.grad(torch.where(inp.mask > 0, loss, 0.0).sum(), inp.logp)
    return loss.detach(), grad, metrics


def close(a, b, tol=1e-12):
    torch.testing.assert_close(torch.as_tensor(a, dtype=D), torch.as_tensor(b, dtype=D), atol=tol, rtol=0)


# lp = [[-0.1, -3.1, -1.1], [-0.6, -1.1, -2.1]]: mean -1.35; A = +2 / -2 per row (mean 0), so
# cov = A (lp + 1.35) = [[2.5, -3.5, 0.5], [-1.5, -0.5, 1.5]]: inside the band (1, 5) are (0,0) and (1,2).
LP = [[-0.1, -3.1, -1.1], [-0.6, -1.1, -2.1]]
ADV = [2.0, -2.0]
COV = [[2.5, -3.5, 0.5], [-1.5, -0.5, 1.5]]


def test_token_covariance_by_hand():
    close(token_covariance(make(LP, 0.1, ADV)), COV)
    # padding neither enters the means nor gets a covariance
    padded = make([[-0.1, -3.1, -1.1, 9.0], [-0.6, -1.1, -2.1, 9.0]], 0.1, ADV, mask=[[1, 1, 1, 0]] * 2)
    close(token_covariance(padded), [[2.5, -3.5, 0.5, 0.0], [-1.5, -0.5, 1.5, 0.0]])


def test_clip_cov_values_and_gradients_by_hand():
    # rho = e^0.1 is inside [0.8, 1.2]: PPO loss -rho A; k = floor(6/3) = 2 = both band tokens dropped.
    loss, grad, metrics = run("clip_cov", make(LP, 0.1, ADV), clip_cov_ratio=1 / 3)
    ppo = torch.tensor([[-2 * E01] * 3, [2 * E01] * 3], dtype=D)
    dropped = torch.tensor([[1, 0, 0], [0, 0, 1]], dtype=torch.bool)
    close(loss, torch.where(dropped, 0.0, ppo))
    close(grad, torch.where(dropped, 0.0, ppo))  # d(-rho A)/d lp = -rho A
    close(metrics["cov_clip_frac"], 2 / 6, 1e-7)
    close(metrics["cov_band_frac"], 2 / 6, 1e-7)
    # A token the PPO clip already clipped is no candidate: (0,0) at rho = e^0.5 > 1.2 with A > 0.
    lr = [[0.5, 0.1, 0.1], [0.1, 0.1, 0.1]]
    loss, grad, metrics = run("clip_cov", make(LP, lr, ADV), clip_cov_ratio=1 / 3)
    close(loss[0, 0], -1.2 * 2.0)
    close(grad[0, 0], 0.0)
    close(loss[1, 2], 0.0)
    close(grad[1, 2], 0.0)
    close(metrics["cov_clip_frac"], 1 / 6, 1e-7)
    close(metrics["clip_frac"], 1 / 6, 1e-7)
    # k = max(1, floor(0.2 * 6)) = 1: exactly one of the two band tokens, the same one on every call.
    first = run("clip_cov", make(LP, 0.1, ADV), clip_cov_ratio=0.2)[0] == 0
    assert int(first.sum()) == 1 and bool(first[0, 0] or first[1, 2])
    again = run("clip_cov", make(LP, 0.1, ADV), clip_cov_ratio=0.2)[0] == 0
    assert torch.equal(first, again)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("ratio", [0.02, 0.1, 0.3])
def test_clip_cov_drops_exactly_the_fraction_inside_the_band(seed, ratio):
    inp = make_inputs(B=8, T=9, seed=seed, spread=0.2)
    cov = token_covariance(inp)
    lb, ub = 0.05, 0.8
    band = (inp.mask > 0) & (cov > lb) & (cov < ub)
    params = {"clip_cov_ratio": ratio, "clip_cov_lb": lb, "clip_cov_ub": ub, "eps_low": 1.0, "eps_high": 1e6}
    loss, grad, metrics = run("clip_cov", inp, **params)  # the PPO clip never binds with these bounds
    dropped = (inp.mask > 0) & (loss == 0) & (grad == 0)
    k = min(selection_count(ratio, inp.mask), int(band.sum()))
    assert int(band.sum()) >= 2
    assert int(dropped.sum()) == k
    assert not (dropped & ~band).any()  # none outside the band
    kept = (inp.mask > 0) & ~dropped
    ratio_t = (inp.logp - inp.old_logp).detach().exp()
    close(loss[kept], (-ratio_t * inp.adv)[kept], 1e-12)
    close(metrics["cov_clip_frac"], k / float(inp.mask.sum()), 1e-7)


def test_clip_cov_band_is_validated():
    with pytest.raises(PartError, match="clip_cov_lb"):
        TRUST_REGIONS.resolve("clip_cov", {"clip_cov_lb": 5.0, "clip_cov_ub": 1.0})
    with pytest.raises(PartError, match="clip_cov_ratio"):
        TRUST_REGIONS.resolve("clip_cov", {"clip_cov_ratio": 0.0})


def test_kl_cov_values_and_gradients_by_hand():
    # top k = floor(6/3) = 2 covariances: (0,0) 2.5 and (1,2) 1.5; l = -rho A + coef |log rho| there.
    loss, grad, metrics = run("kl_cov", make(LP, 0.1, ADV), kl_cov_ratio=1 / 3, ppo_kl_coef=0.5)
    pg = torch.tensor([[-2 * E01] * 3, [2 * E01] * 3], dtype=D)
    top = torch.tensor([[1, 0, 0], [0, 0, 1]], dtype=torch.bool)
    close(loss, torch.where(top, pg + 0.5 * 0.1, pg))
    close(grad, torch.where(top, pg + 0.5, pg))  # d|x|/dx = sign(x) = 1
    close(metrics["cov_kl_frac"], 2 / 6, 1e-7)
    # no clip: a far off-policy token keeps -rho A (rho = e^1, A = -2 at (1,0), not in the top 2)
    loss, grad, _ = run("kl_cov", make(LP, [[0.1] * 3, [1.0, 0.1, 0.1]], ADV), kl_cov_ratio=1 / 3)
    close(loss[1, 0], 2 * math.e)
    close(grad[1, 0], 2 * math.e)


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize("ratio", [0.01, 0.1, 0.25])
def test_kl_cov_penalises_exactly_the_top_fraction_by_covariance(seed, ratio):
    inp = make_inputs(B=8, T=9, seed=seed, spread=0.2)
    coef = 0.7
    loss, _, metrics = run("kl_cov", inp, kl_cov_ratio=ratio, ppo_kl_coef=coef)
    lr = (inp.logp - inp.old_logp).detach()
    pg = -lr.exp() * inp.adv
    m = inp.mask > 0
    penalised = m & ~torch.isclose(loss, pg, rtol=0, atol=1e-14)
    k = selection_count(ratio, inp.mask)
    assert int(penalised.sum()) == k
    cov = token_covariance(inp)
    assert cov[penalised].min() > cov[m & ~penalised].max()  # exactly the top k
    close(loss[penalised], (pg + coef * lr.abs())[penalised])
    close(metrics["cov_kl_frac"], k / float(inp.mask.sum()), 1e-7)


def test_gmpo_values_and_gradients_by_hand():
    # row 0, A = +1: log rho [0.1, 0.6, -0.5] -> z [0.1, 0.4, -0.5] (only the top is capped), R = e^0 = 1.
    # row 1, A = -1: log rho [-0.6, 0.2, pad] -> z [-0.4, 0.2] (only the bottom is floored), R = e^-0.1.
    lr = [[0.1, 0.6, -0.5], [-0.6, 0.2, 5.0]]
    inp = make([[-1.0, -2.0, -0.5], [-0.7, -1.2, -3.0]], lr, [1.0, -1.0], mask=[[1, 1, 1], [1, 1, 0]])
    loss, grad, metrics = run("gmpo", inp)
    r1 = math.exp(-0.1)
    close(loss[0], [-1.0] * 3)
    close(loss[1, :2], [r1, r1])
    # sum over a row's n tokens of l_i = n l_i: gradient n (-A R / n) = -A R per unclipped token, 0 if clipped
    close(grad, [[-1.0, 0.0, -1.0], [0.0, r1, 0.0]])
    close(metrics["clip_frac"], 2 / 5, 1e-7)
    close(metrics["seq_ratio_mean"], (1.0 + r1) / 2, 1e-7)


def test_gmpo_sequence_ratio_is_the_geometric_mean_of_the_clipped_token_ratios():
    inp = make_inputs(B=6, T=7, seed=7, spread=1.0)
    loss, _, _ = run("gmpo", inp, eps_low=0.3, eps_high=0.2)
    lr = (inp.logp - inp.old_logp).detach()
    for i in range(6):
        m = inp.mask[i] > 0
        rho, a = lr[i][m].exp(), float(inp.adv[i, 0])
        clipped = rho.clamp(max=math.exp(0.2)) if a > 0 else rho.clamp(min=math.exp(-0.3))
        geo = float(torch.prod(clipped)) ** (1.0 / int(m.sum()))
        close(loss[i][m], torch.full((int(m.sum()),), -a * geo, dtype=D), 1e-12)


def test_gmpo_gradient_is_zero_outside_the_range_in_the_advantage_direction():
    # every token past the cap in A's direction: no gradient; the same ratios against A: full gradient
    out_pos = make([[-1.0, -2.0, -0.5]], [[0.5, 0.9, 0.45]], [1.0])
    out_neg = make([[-1.0, -2.0, -0.5]], [[-0.5, -0.9, -0.45]], [-1.0])
    for inp in (out_pos, out_neg):
        _, grad, metrics = run("gmpo", inp)
        close(grad, torch.zeros(1, 3, dtype=D))
        close(metrics["clip_frac"], 1.0, 1e-7)
    _, grad, _ = run("gmpo", make([[-1.0, -2.0, -0.5]], [[0.5, 0.9, 0.45]], [-1.0]))
    r = math.exp((0.5 + 0.9 + 0.45) / 3)
    close(grad, torch.full((1, 3), r, dtype=D))  # -A R per token, nothing clipped


def test_gmpo_preset_aggregates_to_the_mean_sequence_loss():
    lr = [[0.1, 0.6, -0.5], [-0.6, 0.2, 5.0]]
    inp = make([[-1.0, -2.0, -0.5], [-0.7, -1.2, -3.0]], lr, [1.0, -1.0], mask=[[1, 1, 1], [1, 1, 0]])
    out = policy_loss(inp, trust.gmpo())
    close(out.loss, (-1.0 + math.exp(-0.1)) / 2)


def _phi(log_w: float, k: float, lam: float) -> float:
    w = math.exp(log_w)
    return w**k * math.exp(lam * (1.0 - w))


def test_vespo_values_and_gradients_by_hand():
    # row 0, A = +1: log W = 0.1 + 0.2 - 0.1 = 0.2, (k, lambda) = (2, 3); row 1, A = -1: log W = -0.2, (3, 2)
    lp = [[-1.0, -2.0, -0.5], [-0.7, -1.2, -3.0]]
    inp = make(lp, [[0.1, 0.2, -0.1], [-0.3, 0.1, 7.0]], [1.0, -1.0], mask=[[1, 1, 1], [1, 1, 0]])
    loss, grad, metrics = run("vespo", inp)
    p0, p1 = _phi(0.2, 2.0, 3.0), _phi(-0.2, 3.0, 2.0)
    close(p0, math.exp(0.4 + 3 * (1 - math.exp(0.2))))
    close(loss[0], [p0 * x for x in (1.0, 2.0, 0.5)])  # -phi A lp
    close(loss[1, :2], [-p1 * 0.7, -p1 * 1.2])
    close(grad, [[-p0] * 3, [p1, p1, 0.0]])  # -phi A: phi is detached
    close(metrics["phi_mean"], (3 * p0 + 2 * p1) / 5, 1e-7)


def test_vespo_kernel_is_one_at_w_one_and_peaks_at_k_over_lambda():
    ws = torch.linspace(-4.0, 4.0, 801, dtype=D)
    for adv, (k, lam) in ((1.0, (2.0, 3.0)), (-1.0, (3.0, 2.0))):
        inp = make(torch.full((801, 1), -1.0), ws[:, None], torch.full((801,), adv))
        _, grad, _ = run("vespo", inp)
        phi = -grad[:, 0] / adv
        close(phi[400], 1.0)  # log W = 0
        assert abs(float(ws[int(phi.argmax())].exp()) - k / lam) < 0.01
        assert float(phi[0]) < 0.01 and float(phi[-1]) < 1e-3  # suppressed far off-policy


def test_dro_values_and_gradients_by_hand():
    # l = -(lp A - beta/2 (log rho)^2); d/d lp = -(A - beta log rho)
    inp = make([[-0.5, -1.0, -2.0], [-0.3, -0.4, -0.9]], [[0.2, -0.4, 0.0], [0.1, 0.3, -0.2]], [1.0, -2.0])
    loss, grad, _ = run("dro", inp, beta=0.5)
    lr = torch.tensor([[0.2, -0.4, 0.0], [0.1, 0.3, -0.2]], dtype=D)
    a = torch.tensor([[1.0] * 3, [-2.0] * 3], dtype=D)
    lp = inp.logp.detach()
    close(loss, -(lp * a - 0.25 * lr**2))
    close(grad, -(a - 0.5 * lr))
    close(loss[0, 0], -(-0.5 - 0.25 * 0.04))
    with pytest.raises(PartError, match="beta"):
        TRUST_REGIONS.resolve("dro", {"beta": 0.0})


def test_luspo_preset_is_trl_luspo():
    # TRL luspo: s_i = exp(mean_t log rho), l_i = -min(s A, clip(s, 1 - 2e-3, 1 + 2.5e-3) A), loss = mean_i |y_i| l_i
    lr = [[0.001, 0.002, 0.003], [-0.004, -0.006, 9.0]]
    inp = make([[-1.0, -2.0, -0.5], [-0.7, -1.2, -3.0]], lr, [1.0, 0.5], mask=[[1, 1, 1], [1, 1, 0]])
    out = policy_loss(inp, trust.luspo())
    s0, s1 = math.exp(0.002), math.exp(-0.005)
    l0 = -min(s0 * 1.0, min(max(s0, 1 - 2e-3), 1 + 2.5e-3) * 1.0)  # s0 < 1.0025: not clipped
    l1 = -min(s1 * 0.5, min(max(s1, 1 - 2e-3), 1 + 2.5e-3) * 0.5)  # s1 < 0.998 with A > 0: unclipped branch
    close(out.loss, (3 * l0 + 2 * l1) / 2)
    (grad,) = torch.autograd.grad(out.loss, inp.logp)
    # d/d lp_t of |y_i| l_i / N = -A s_i / N on every token of i (the sequence ratio's 1/|y_i| cancels)
    close(grad, [[-s0 / 2] * 3, [-0.5 * s1 / 2] * 2 + [0.0]])
    # past the clip in A's direction: no gradient at all
    clipped = make([[-1.0, -2.0, -0.5]], [[0.01, 0.02, 0.03]], [1.0])
    (grad,) = torch.autograd.grad(policy_loss(clipped, trust.luspo()).loss, clipped.logp)
    close(grad, torch.zeros(1, 3, dtype=D))


@pytest.mark.parametrize("fn", trust.PRESETS)
def test_presets_build_and_run(fn):
    method = fn()
    assert method.name == fn.__name__ and method.paper.startswith("https://arxiv.org/abs/")
    inp = make_inputs(seed=11)
    out = policy_loss(dataclasses.replace(inp), method)
    assert torch.isfinite(out.loss)
