"""Hand-computed values and autograd gradients of the ratio-based trust regions (float64).

Every test builds ``logp`` as a leaf with ``old_logp = 0`` so that ``log_ratio == logp`` and
``d loss / d logp`` is the per-token gradient weight; closed forms come from
shared/spec/objectives-llm.md sections 2, 7, 8, 13, 14, 16, 17, 19, 20.
"""

from __future__ import annotations

import math

import pytest
import torch

import polyrl.objectives  # noqa: F401  (registers every part)
from polyrl.objectives.trust_regions import entropy_scale
from polyrl.registry import TRUST_REGIONS, PartError
from polyrl.types import LossInputs, Normalizer

D = torch.float64
MINE = ["clip", "none", "cispo", "ce_gppo", "pspo", "sapo", "spo", "humanline", "s_ppo", "sspo_clip"]


def make(log_ratio, adv, mask=None, entropy=None, segment_ids=None) -> LossInputs:
    """LossInputs [B, T] (1-D inputs become one row) with old_logp = 0 and logp a grad leaf."""
    lr = torch.as_tensor(log_ratio, dtype=D)
    lr = lr[None] if lr.dim() == 1 else lr
    adv_t = torch.as_tensor(adv, dtype=D).expand_as(lr).clone()
    m = torch.ones_like(lr) if mask is None else torch.as_tensor(mask, dtype=D).reshape(lr.shape)
    ent = None if entropy is None else torch.as_tensor(entropy, dtype=D).reshape(lr.shape)
    seg = None if segment_ids is None else torch.as_tensor(segment_ids).reshape(lr.shape)
    return LossInputs(
        logp=lr.clone().requires_grad_(True),
        old_logp=torch.zeros_like(lr),
        adv=adv_t,
        mask=m,
        normalizer=Normalizer.from_batch(m, torch.arange(lr.shape[0])),
        entropy=ent,
        segment_ids=seg,
    )


def run(name: str, inp: LossInputs, **params):
    """Per-token loss, d loss.sum() / d logp and metrics of trust region ``name`` (params validated)."""
    part = TRUST_REGIONS.resolve(name, params)
    inp.logp.grad = None
    loss, metrics = TRUST_REGIONS.fn(name)(inp, inp.logp - inp.old_logp, **part.params)
    loss.sum().backward()
    return loss.detach(), inp.logp.grad.clone(), metrics


def grad_at(name: str, rho: float, adv: float, **params) -> float:
    _, g, _ = run(name, make([math.log(rho)], [adv]), **params)
    return float(g[0, 0])


def close(a, b, tol=1e-12):
    return torch.allclose(torch.as_tensor(a, dtype=D), torch.as_tensor(b, dtype=D), atol=tol, rtol=0)


# ----------------------------------------------------------------------------------------------- clip


def test_clip_gradient_regions():
    assert grad_at("clip", 1.5, 2.0) == 0.0  # A>0, rho > 1+eps_high: blocked
    assert close(grad_at("clip", 0.5, 2.0), -0.5 * 2.0)  # A>0, rho < 1-eps_low: unclipped branch
    assert grad_at("clip", 0.5, -2.0) == 0.0  # A<0, rho < 1-eps_low: blocked
    assert close(grad_at("clip", 1.5, -2.0), -1.5 * -2.0)  # A<0, rho > 1+eps_high: unclipped


def test_clip_dapo_clip_higher():
    assert close(grad_at("clip", 1.25, 1.0, eps_low=0.2, eps_high=0.28), -1.25)
    assert grad_at("clip", 1.25, 1.0, eps_low=0.2, eps_high=0.2) == 0.0
    assert grad_at("clip", 1.30, 1.0, eps_low=0.2, eps_high=0.28) == 0.0
    assert grad_at("clip", 1.30, 1.0, eps_low=0.2, eps_high=0.2) == 0.0


def test_clip_dual_clip():
    loss, g, m = run("clip", make([math.log(4.0)], [-1.5]), dual_clip_c=3.0)
    assert close(loss, 3.0 * 1.5) and g.item() == 0.0 and m["dual_clip_frac"].item() == 1.0
    assert close(grad_at("clip", 2.0, -1.5, dual_clip_c=3.0), -2.0 * -1.5)
    assert close(grad_at("clip", 4.0, 1.5, dual_clip_c=3.0), 0.0)  # A>0 untouched (blocked by the clip)
    for c in (1.0, 0.5):
        with pytest.raises(PartError, match="dual_clip_c"):
            TRUST_REGIONS.resolve("clip", {"dual_clip_c": c})


def test_rho_one_is_reinforce_for_vanilla_at_one_parts():
    params = {"sspo_clip": {}}
    for name in MINE:
        tags = TRUST_REGIONS.spec(name).tags
        for adv in (1.7, -0.6):
            inp = make([0.0, 0.0], [adv, adv], entropy=[1.0, 1.0])
            _, g, _ = run(name, inp, **params.get(name, {}))
            scale = 1.0 - 0.1 if name == "pspo" else 1.0
            assert ("vanilla_at_one" in tags) == (name != "pspo"), name
            assert close(g, torch.full_like(g, -scale * adv)), name


def test_masked_positions_never_change_unmasked_outputs():
    mask = [[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]]
    clean = [[0.3, -0.5, 0.0], [0.1, 0.0, 0.25]]
    dirty = [[0.3, -0.5, 1e6], [0.1, -1e6, 0.25]]
    for name in MINE:
        out = []
        for lr, ent in (
            (clean, [[1.0, 2.0, 0.0], [0.5, 0.0, 3.0]]),
            (dirty, [[1.0, 2.0, 1e9], [0.5, 1e9, 3.0]]),
        ):
            inp = make(lr, [[1.0], [-1.0]], mask=mask, entropy=ent, segment_ids=[[0, 1, 9], [0, 7, 0]])
            loss, g, metrics = run(name, inp)
            keep = inp.mask > 0
            out.append((loss[keep], g[keep], metrics))
        assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1]), name
        for k, v in out[0][2].items():
            assert v.dim() == 0 and not v.requires_grad and close(v, out[1][2][k]), (name, k)


# ---------------------------------------------------------------------------------------------- cispo


def test_cispo_gradient_is_clipped_weight():
    rhos = [0.05, 0.5, 0.8, 1.0, 1.1, 1.2, 1.5, 2.0, 10.0]
    for adv in (1.3, -0.7):
        inp = make([math.log(r) for r in rhos], [adv])
        _, g, m = run("cispo", inp)  # default: no lower bound, cap 1 + 0.2
        want = [-min(r, 1.2) * adv for r in rhos]
        assert close(g[0], want), adv
        assert close(m["clip_frac"], 3 / len(rhos), tol=1e-6)  # metrics are float32
        _, g, _ = run("cispo", inp, eps_low=0.2, eps_high=0.2)
        assert close(g[0], [-min(max(r, 0.8), 1.2) * adv for r in rhos])
    assert close(grad_at("cispo", 2.0, 1.0), -(1 + 0.2) * 1.0)  # PPO would give 0
    assert close(grad_at("cispo", 2.0, 1.0, eps_high=4.0), -2.0)  # cap is 1 + eps_high = 5 (not 4)
    assert close(grad_at("cispo", 1.0, -2.5), 2.5)
    _, g, _ = run("cispo", make([25.0], [1.0]))  # beyond the +-20 clamp the gradient is still the cap
    assert close(g, [[-1.2]])


def test_cispo_value_is_minus_capped_weight_times_adv():
    loss, _, _ = run("cispo", make([math.log(2.0), math.log(0.5)], [1.5]))
    assert close(loss, [[-1.2 * 1.5, -0.5 * 1.5]])


# -------------------------------------------------------------------------------------------- ce_gppo


def test_ce_gppo_out_of_range_positive():
    for rho in (1.5, 3.0):
        loss, g, _ = run("ce_gppo", make([math.log(rho)], [2.0]), beta2=0.7)
        assert close(g, [[-0.7 * 1.2 * 2.0]]) and close(loss, [[-0.7 * 1.2 * 2.0]])
    assert grad_at("ce_gppo", 1.5, 2.0, beta2=0.0) == 0.0  # beta2 = 0 recovers PPO's zero gradient


def test_ce_gppo_out_of_range_negative_and_dual_clip():
    loss, g, _ = run("ce_gppo", make([math.log(0.5)], [-2.0]), beta1=0.5)
    assert close(g, [[-0.5 * 0.8 * -2.0]]) and close(loss, [[-0.5 * 0.8 * -2.0]])
    loss, g, m = run("ce_gppo", make([math.log(12.0)], [-2.0]))  # A<0, rho > c = 10
    assert close(loss, [[10.0 * 2.0]]) and g.item() == 0.0 and m["dual_clip_frac"].item() == 1.0
    assert close(grad_at("ce_gppo", 5.0, -2.0), -5.0 * -2.0)  # 1+eps < rho < c: plain -rho A


def test_ce_gppo_in_range_equals_clip():
    lrs = [math.log(r) for r in (0.81, 0.9, 1.0, 1.1, 1.19)]
    for adv in (1.0, -1.0):
        a, ga, _ = run("ce_gppo", make(lrs, [adv]))
        b, gb, _ = run("clip", make(lrs, [adv]), dual_clip_c=10.0)
        assert close(a, b) and close(ga, gb)


def test_ce_gppo_unit_betas_give_cispo_weight():
    for rho, adv in ((0.3, -1.0), (0.6, -2.0), (1.5, 1.0), (4.0, 3.0)):
        g = grad_at("ce_gppo", rho, adv, beta1=1.0, beta2=1.0)
        assert close(g, -min(max(rho, 0.8), 1.2) * adv), (rho, adv)


# ----------------------------------------------------------------------------------------------- pspo


def test_pspo_smoothing_and_gradient():
    rhos = torch.tensor([0.3, 0.9, 1.0, 1.4, 3.0], dtype=D)
    for alpha in (0.0, 0.1, 0.6, 1.0):
        inp = make(rhos.log(), [2.0])
        loss, g, _ = run("pspo", inp, alpha=alpha)
        r_s = -loss[0] / 2.0
        assert close(r_s - 1.0, (1 - alpha) * (rhos - 1.0))
        assert close(g[0], -(1 - alpha) * rhos * 2.0)
    _, g0, _ = run("pspo", make(rhos.log(), [2.0]), alpha=0.0)
    _, gn, _ = run("none", make(rhos.log(), [2.0]))
    assert close(g0, gn)  # alpha = 0: unclipped surrogate
    assert torch.all(run("pspo", make(rhos.log(), [2.0]), alpha=1.0)[1] == 0.0)


# ----------------------------------------------------------------------------------------------- sapo


def test_sapo_gate_values():
    for adv in (1.0, -3.0):
        assert close(grad_at("sapo", 1.0, adv), -adv)
    # A < 0 uses tau_neg: loss = -sigmoid(2 * 0.5) * 4/2 * (-1) = 2 sigmoid(1)
    s = 1.0 / (1.0 + math.exp(-1.0))
    loss, g, _ = run("sapo", make([math.log(1.5)], [-1.0]), tau_pos=7.0, tau_neg=2.0)
    assert close(loss, [[2.0 * s]]) and close(g, [[4.0 * s * (1 - s) * 1.5]])
    loss, _, _ = run("sapo", make([math.log(1.5)], [1.0]), tau_pos=2.0, tau_neg=7.0)
    assert close(loss, [[-2.0 * s]])
    assert abs(grad_at("sapo", 30.0, 1.0)) < 1e-9  # far off-policy: gate closes smoothly


# ------------------------------------------------------------------------------------------------ spo


def test_spo_objective_peaks_at_boundary():
    rhos = torch.linspace(0.5, 1.6, 11001, dtype=D)
    for adv, peak in ((1.5, 1.2), (-1.5, 0.8)):
        loss, _, _ = run("spo", make(rhos.log(), [adv]), eps=0.2)
        assert abs(float(rhos[torch.argmax(-loss[0])]) - peak) < 1e-9
    assert grad_at("spo", 1.5, 1.0) > 0  # A>0 beyond 1+eps: descent lowers lp (restoring)
    assert grad_at("spo", 0.5, -1.0) < 0  # A<0 below 1-eps: descent raises lp
    assert close(grad_at("spo", 1.5, 1.0), -(1.0 - 1.0 * 0.5 / 0.2) * 1.5)
    assert close(grad_at("spo", 1.0, 0.8), -0.8)


# ------------------------------------------------------------------------------------------- humanline


def test_humanline_clips_at_halos_eps_by_default():
    """HALOs' grpo.yaml: eps 0.01 -- at rho = 1.05 with A = 1 the PPO clip has already cut the surrogate's gradient."""
    assert grad_at("humanline", 1.05, 1.0) == 0.0
    assert grad_at("humanline", 1.005, 1.0) != 0.0
    assert grad_at("clip", 1.05, 1.0) != 0.0  # clip's own default (0.2) keeps it


def test_humanline_band_kills_both_signs():
    for adv in (1.0, -1.0):
        _, g, m = run("humanline", make([2.0], [adv]))
        assert g.item() == 0.0 and m["band_frac"].item() == 1.0
    assert close(grad_at("clip", math.exp(2.0), -1.0), math.exp(2.0))  # plain clip keeps it
    assert grad_at("humanline", math.exp(-1.5), 1.0) == 0.0  # below log_eps_p = -1
    assert grad_at("clip", math.exp(-1.5), 1.0) != 0.0


def test_humanline_inside_band_equals_clip():
    lrs = [-0.9, -0.3, 0.0, 0.1, 0.5, 1.4]
    for adv in (0.7, -0.7):
        a, ga, m = run("humanline", make(lrs, [adv]), eps_low=0.2, eps_high=0.28)
        b, gb, _ = run("clip", make(lrs, [adv]), eps_low=0.2, eps_high=0.28)
        assert close(a, b) and close(ga, gb) and m["band_frac"].item() == 0.0


# ---------------------------------------------------------------------------------------------- s_ppo


def test_s_ppo_equals_clip_when_nothing_clipped():
    lrs = [[math.log(r) for r in (0.85, 1.0, 1.15)], [math.log(r) for r in (0.9, 1.1, 1.19)]]
    a, ga, m = run("s_ppo", make(lrs, [[1.0], [-2.0]]))
    b, gb, _ = run("clip", make(lrs, [[1.0], [-2.0]]))
    assert close(a, b) and close(ga, gb) and m["clip_bias"].item() == 0.0


def test_s_ppo_downweights_clipped_sequence():
    lrs = [[math.log(1.5), 0.0, 0.0], [math.log(1.1), 0.0, 0.0]]
    mask = [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
    adv = [[-1.0], [1.0]]
    a, ga, m = run("s_ppo", make(lrs, adv, mask=mask), bias_coef=2.0)
    b, gb, _ = run("clip", make(lrs, adv, mask=mask))
    b0 = (1.5 - 1.2) / 2  # two loss tokens in sequence 0; the padded one does not count
    assert close(a[0], b[0] / (1 + 2.0 * b0)) and close(ga[0], gb[0] / (1 + 2.0 * b0))
    assert close(a[1], b[1]) and close(ga[1], gb[1])
    assert close(m["clip_bias"], b0 / 2)


# ------------------------------------------------------------------------------------------ sspo_clip


def test_sspo_scale_monotone_in_entropy():
    h = torch.linspace(0.0, 5.0, 101, dtype=D)[:, None]  # one token per sequence
    scale = entropy_scale(h, torch.ones_like(h), None, 1.0, 0.5, 2.0)[:, 0]
    assert torch.all(scale[1:] >= scale[:-1]) and scale[0] == 0.5 and scale[-1] == 2.0
    seg = entropy_scale(
        torch.tensor([[1.0, 3.0, 0.2, 0.4, 1.2]], dtype=D),
        torch.ones(1, 5, dtype=D),
        torch.tensor([[0, 0, 1, 1, 2]]),
        1.0,
        0.5,
        2.0,
    )
    assert close(seg, [[2.0, 2.0, 0.5, 0.5, 1.2]])  # segment means 2.0, 0.3, 1.2, then clamped


def test_sspo_clip_bounds_follow_entropy():
    for adv in (1.0, -1.0):
        lrs = [math.log(r) for r in (0.5, 0.85, 1.0, 1.15, 1.3, 2.0)]
        a, ga, m = run("sspo_clip", make(lrs, [adv], entropy=[1.0] * 6))
        b, gb, _ = run("clip", make(lrs, [adv]))
        assert close(a, b) and close(ga, gb) and close(m["clip_scale"], 1.0)
    assert grad_at_sspo(1.3, entropy=0.5) == 0.0  # scale 0.5: upper bound 1.1
    assert close(grad_at_sspo(1.3, entropy=2.0), -1.3)  # scale 2: upper bound 1.4
    # segment mean entropies 0.3 (scale 0.5, bound 1.1) and 2.0 (scale 2, bound 1.4); the row mean is 1.15
    inp = make([math.log(1.3)] * 4, [1.0], entropy=[0.2, 0.4, 1.5, 2.5], segment_ids=[0, 0, 1, 1])
    _, g, m = run("sspo_clip", inp)
    assert close(g, [[0.0, 0.0, -1.3, -1.3]]) and close(m["clip_scale"], 1.25)
    with pytest.raises(ValueError, match="entropy"):
        run("sspo_clip", make([0.0], [1.0]))


def grad_at_sspo(rho: float, entropy: float) -> float:
    _, g, _ = run("sspo_clip", make([math.log(rho)], [1.0], entropy=[entropy]))
    return float(g[0, 0])


# ------------------------------------------------------------------------------------- resolve errors


@pytest.mark.parametrize(
    "name, params, words",
    [
        ("clip", {"eps_low": -0.1}, ["eps_low", "-0.1"]),
        ("cispo", {"eps_high": -1.0}, ["eps_high", "-1.0"]),
        ("ce_gppo", {"beta1": -0.5}, ["beta1", "-0.5"]),
        ("ce_gppo", {"dual_clip_c": 0.5}, ["dual_clip_c", "0.5"]),
        ("pspo", {"alpha": 1.5}, ["alpha", "1.5"]),
        ("sapo", {"tau_neg": 0.0}, ["tau_neg", "0.0"]),
        ("spo", {"eps": 0.0}, ["eps", "0.0"]),
        ("humanline", {"log_eps_p": 0.5}, ["log_eps_p", "0.5"]),
        ("humanline", {"log_eps_r": -0.2}, ["log_eps_r", "-0.2"]),
        ("s_ppo", {"bias_coef": -1.0}, ["bias_coef", "-1.0"]),
        ("sspo_clip", {"min_scale": 3.0}, ["min_scale", "3.0"]),
        ("sspo_clip", {"eps_low": 0.6}, ["eps_low", "0.6", "max_scale"]),
        ("cispo", {"eps_hgih": 0.3}, ["eps_hgih", "eps_high"]),
        ("pspo", {"alpah": "0.2"}, ["alpah", "alpha"]),
    ],
)
def test_resolve_errors_name_parameter_and_value(name, params, words):
    with pytest.raises(PartError) as err:
        TRUST_REGIONS.resolve(name, params)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_defaults_resolve_and_cli_strings():
    for name in MINE:
        TRUST_REGIONS.resolve(name)
    assert TRUST_REGIONS.resolve("cispo", {"eps_low": "none"}).params["eps_low"] is None
    assert TRUST_REGIONS.resolve("ce_gppo").params == {
        "eps_low": 0.2,
        "eps_high": 0.2,
        "beta1": 0.5,
        "beta2": 1.0,
        "dual_clip_c": 10.0,
    }
