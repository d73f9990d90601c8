"""KL estimators: exact enumeration on a categorical policy (spec sec 22, DeepSeek-V3.2 unbiased k3)."""

from __future__ import annotations

import math

import pytest
import torch

import polyrl.objectives  # noqa: F401  (registers every part)
from polyrl.registry import KL, PartError

D = torch.float64
V = 6


def setup():
    torch.manual_seed(0)
    logits = torch.randn(V, dtype=D, requires_grad=True)
    ref = torch.log_softmax(torch.randn(V, dtype=D), -1)
    old = torch.log_softmax(torch.randn(V, dtype=D), -1)
    return logits, ref, old


def expected_grad(name, weights=None):
    """sum_y q(y) grad k(y) with every y enumerated; q = pi (on-policy) or the given sampling weights."""
    logits, ref, old = setup()
    logp = torch.log_softmax(logits, -1)
    k = KL.fn(name)(logp[None], ref[None], old[None])[0]  # one "token" per outcome y
    q = logp.exp().detach() if weights is None else weights
    return torch.autograd.grad((q * k).sum(), logits)[0], (q * k).sum().detach()


def analytic(fn):
    logits, ref, old = setup()
    logp = torch.log_softmax(logits, -1)
    return torch.autograd.grad(fn(logp, ref), logits)[0]


def kl_pi_ref(logp, ref):
    return (logp.exp() * (logp - ref)).sum()


def kl_ref_pi(logp, ref):
    return (ref.exp() * (ref - logp)).sum()


def test_k1_expected_gradient_is_zero():
    g, _ = expected_grad("k1")
    assert torch.allclose(g, torch.zeros(V, dtype=D), atol=1e-14)


def test_k2_expected_gradient_is_reverse_kl_gradient():
    g, _ = expected_grad("k2")
    assert torch.allclose(g, analytic(kl_pi_ref), atol=1e-12)


def test_k3_expected_gradient_is_forward_kl_gradient_and_value_unbiased():
    g, value = expected_grad("k3")
    assert torch.allclose(g, analytic(kl_ref_pi), atol=1e-12)
    logits, ref, _ = setup()
    kl = kl_pi_ref(torch.log_softmax(logits.detach(), -1), ref)
    assert math.isclose(float(value), float(kl), rel_tol=1e-12)


@pytest.mark.parametrize("name", ["k1_plus", "k3_plus"])
def test_straight_through_value_of_estimator_gradient_of_k2(name):
    logp = torch.randn(3, 4, dtype=D, requires_grad=True)
    ref = torch.randn(3, 4, dtype=D)
    out = KL.fn(name)(logp, ref, None)
    base = KL.fn(name.removesuffix("_plus"))(logp, ref, None)
    assert torch.allclose(out, base)
    (g,) = torch.autograd.grad(out.sum(), logp)
    (g2,) = torch.autograd.grad(KL.fn("k2")(logp, ref, None).sum(), logp)
    assert torch.allclose(g, g2) and torch.allclose(g, logp.detach() - ref)
    # hence the expected gradient of k3_plus is the reverse-KL gradient
    if name == "k3_plus":
        eg, _ = expected_grad("k3_plus")
        assert torch.allclose(eg, analytic(kl_pi_ref), atol=1e-12)


def test_k3_nonnegative_zero_iff_equal():
    logp = torch.tensor([-1.0, -2.0, -0.5, -3.0], dtype=D)
    ref = torch.tensor([-1.0, -1.5, -0.5, -0.1], dtype=D)
    k = KL.fn("k3")(logp, ref, None)
    assert (k >= 0).all()
    assert torch.equal(k == 0, logp == ref)
    d = ref - logp
    assert torch.allclose(k, (torch.exp(d) - 1 - d).clamp(max=10.0))  # d = 2.9 gives 14.27: verl's bound 10
    assert float(k[3]) == 10.0
    assert torch.allclose(KL.fn("k1")(logp, ref, None), -d)
    assert torch.allclose(KL.fn("k2")(logp, ref, None), 0.5 * d**2)


def test_k3_unbiased_under_pi_old_sampling():
    logits, ref, old = setup()
    pi = torch.log_softmax(logits.detach(), -1)
    g, value = expected_grad("k3_unbiased", weights=old.exp())
    # value: sum_y pi_old(y) sg(pi/pi_old) k3(y) == KL(pi || ref) exactly
    assert math.isclose(float(value), float(kl_pi_ref(pi, ref)), rel_tol=1e-12)
    # gradient: the same as on-policy k3, i.e. grad KL(ref || pi)
    assert torch.allclose(g, analytic(kl_ref_pi), atol=1e-12)
    # without the weight, k3 under pi_old is biased
    _, biased = expected_grad("k3", weights=old.exp())
    assert abs(float(biased) - float(kl_pi_ref(pi, ref))) > 1e-3


def test_k3_unbiased_needs_old_logp_and_weight_is_detached():
    logp = torch.zeros(1, 2, dtype=D, requires_grad=True)
    with pytest.raises(ValueError, match="old_logp"):
        KL.fn("k3_unbiased")(logp, torch.zeros(1, 2, dtype=D), None)
    ref = torch.tensor([[-0.3, 0.2]], dtype=D)
    old = torch.tensor([[0.5, -0.5]], dtype=D)
    out = KL.fn("k3_unbiased")(logp, ref, old)
    (g,) = torch.autograd.grad(out.sum(), logp)
    wgt = torch.exp(-old)
    assert torch.allclose(
        g, wgt * (1 - torch.exp(ref))
    )  # d k3 / d logp = 1 - exp(ref - logp), weight constant


def test_clamp_keeps_values_and_gradients_finite():
    logp = torch.tensor([[-200.0, 0.0]], dtype=D, requires_grad=True)
    ref = torch.tensor([[0.0, -200.0]], dtype=D)
    for name in KL.names():
        out = KL.fn(name)(logp, ref, logp.detach())
        (g,) = torch.autograd.grad(out.sum(), logp)
        assert torch.isfinite(out).all() and torch.isfinite(g).all(), name
    assert math.isclose(float(KL.fn("k1")(logp.detach(), ref, None)[0, 0]), -20.0)
    with pytest.raises(PartError):
        KL.resolve("k3", {"clamp": 0.0})


def test_k3_value_clamp_has_verls_bound_and_zero_gradient_beyond():
    # d = ref - logp: 2.0 gives k3 = e^2 - 3 = 4.389 (inside the bound); 4.0 gives e^4 - 5 = 49.6 (clamped to 10)
    logp = torch.tensor([[0.0, 0.0, 0.0]], dtype=D, requires_grad=True)
    ref = torch.tensor([[2.0, 4.0, -30.0]], dtype=D)
    out = KL.fn("k3")(logp, ref, None)
    (g,) = torch.autograd.grad(out.sum(), logp)
    out = out.detach()
    assert math.isclose(float(out[0, 0]), math.exp(2.0) - 3.0, rel_tol=1e-12)
    assert float(out[0, 1]) == 10.0 and float(g[0, 1]) == 0.0  # beyond the bound: no pull at all
    assert math.isclose(float(g[0, 0]), 1.0 - math.exp(2.0), rel_tol=1e-12)  # d k3 / d logp = 1 - e^d inside
    assert float(out[0, 2]) == 10.0  # d = -30 is clamped to -20 first: k3 = e^-20 + 19 = 19.0, then to 10
    unclamped = KL.resolve("k3", {"value_clamp": float("inf")})
    raw = KL.fn("k3")(logp, ref, None, **unclamped.params).detach()
    assert math.isclose(float(raw[0, 1]), math.exp(4.0) - 5.0, rel_tol=1e-12)
    plus = KL.fn("k3_plus")(logp, ref, None)
    assert torch.equal(plus.detach(), out.detach())  # the same clamped value; its gradient is k2's
