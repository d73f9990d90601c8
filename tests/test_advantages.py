"""Advantage estimators: hand-computed numbers, invariances, exact enumeration (spec 1-6, 10, 12, B3)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import polyrl.objectives  # noqa: F401  (registers every part)
from polyrl.objectives.objective import build_method
from polyrl.objectives.token_advantages import gae_advantages_and_returns
from polyrl.registry import ADVANTAGES, PartError

D = torch.float64
GROUP_ESTIMATORS = ["grpo", "group_centered", "rloo", "maxrl", "gdpo", "group_centered_batch_std"]


def adv(name, rewards, group_ids, mask=None, values=None, token_rewards=None, **kw):
    rewards = torch.as_tensor(rewards, dtype=D)
    group_ids = torch.as_tensor(group_ids)
    if mask is None:
        mask = torch.ones(rewards.shape[0], 3, dtype=D)
    return ADVANTAGES.fn(name)(rewards, group_ids, mask, values, token_rewards, **kw)


def lengths_mask(lengths, T):
    return (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).to(D)


# ---------------------------------------------------------------- group-of-one and no-gradient conventions


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_group_of_one_gives_zero(name):
    r = [1.0, 0.0, 1.0, 0.7]  # the last sample is alone in its group
    a = adv(name, r, [0, 0, 0, 5])
    assert a[3] == 0.0
    assert a[:3].abs().sum() > 0  # the real group still has signal


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_all_equal_group_gives_zero(name):
    a = adv(name, [0.5, 0.5, 0.5, 1.0, 0.0], [0, 0, 0, 1, 1])
    assert torch.equal(a[:3], torch.zeros(3, dtype=D))


@pytest.mark.parametrize("name", ADVANTAGES.names())
def test_no_gradient_flows_into_advantages(name):
    r = torch.tensor([1.0, 0.0, 0.5, 1.0], dtype=D, requires_grad=True)
    v = torch.rand(4, 3, dtype=D, requires_grad=True)
    out = ADVANTAGES.fn(name)(r, torch.tensor([0, 0, 1, 1]), torch.ones(4, 3, dtype=D), v, None)
    assert not out.requires_grad


# ---------------------------------------------------------------- GRPO, Dr. GRPO, RLOO, REINFORCE


def test_grpo_zero_sum_and_unit_sample_std():
    torch.manual_seed(0)
    r = torch.rand(12, dtype=D)
    g = torch.arange(12) % 3  # three interleaved groups of 4
    a = adv("grpo", r, g, eps=0.0)
    for k in range(3):
        ak = a[g == k]
        assert abs(float(ak.sum())) < 1e-12
        assert math.isclose(float(ak.std(unbiased=True)), 1.0, rel_tol=1e-12)
    ap = adv("grpo", r, g, eps=0.0, std="population")
    assert math.isclose(float(ap[g == 0].std(unbiased=False)), 1.0, rel_tol=1e-12)


def test_grpo_hand_computed():
    # group (0, 1): mean 0.5, sample std sqrt(0.5) -> -/+ 0.5 / sqrt(0.5) = -/+ 1/sqrt(2)
    a = adv("grpo", [0.0, 1.0], [0, 0], eps=0.0)
    assert torch.allclose(a, torch.tensor([-1.0, 1.0], dtype=D) / math.sqrt(2))
    # population std 0.5 -> -/+ 1
    assert torch.allclose(
        adv("grpo", [0.0, 1.0], [0, 0], eps=0.0, std="population"), torch.tensor([-1.0, 1.0], dtype=D)
    )


def test_group_centered_scales_linearly_and_has_no_std():
    r = torch.tensor([0.0, 1.0, 3.0, 2.0, 5.0], dtype=D)
    g = [0, 0, 0, 1, 1]
    a = adv("group_centered", r, g)
    assert torch.allclose(a, torch.tensor([-4 / 3, -1 / 3, 5 / 3, -1.5, 1.5], dtype=D))
    assert torch.allclose(adv("group_centered", 7.0 * r, g), 7.0 * a)


def test_rloo_equals_scaled_centred_and_excludes_own_reward():
    r = torch.tensor([1.0, 0.0, 0.5, 2.0], dtype=D)
    g = [0, 0, 0, 0]
    k = 4
    a = adv("rloo", r, g)
    assert torch.allclose(a, k / (k - 1) * (r - r.mean()))
    assert abs(float(a.sum())) < 1e-12
    # d baseline_i / d r_i = 0: perturbing r_0 leaves sample 0's baseline (r_0 - A_0) unchanged and moves
    # every other baseline by h / (k - 1).
    h = 0.37
    r2 = r.clone()
    r2[0] += h
    a2 = adv("rloo", r2, g)
    base, base2 = r - a, r2 - a2
    assert math.isclose(float(base2[0]), float(base[0]), abs_tol=1e-12)
    assert torch.allclose(base2[1:] - base[1:], torch.full((3,), h / (k - 1), dtype=D))


def test_sequence_estimators_add_masked_token_rewards():
    mask = lengths_mask([2, 3], 3)
    tr = torch.tensor([[-0.1, -0.2, 1e9], [-0.3, 0.0, -0.1]], dtype=D)  # 1e9 is padding garbage
    a = adv("rloo", [1.0, 0.0], [0, 0], mask=mask, token_rewards=tr)
    r = torch.tensor([1.0 - 0.3, 0.0 - 0.4], dtype=D)
    assert torch.allclose(a, torch.tensor([r[0] - r[1], r[1] - r[0]], dtype=D))


def test_reinforce_baselines():
    r = [1.0, 0.0, 0.5]
    assert torch.allclose(adv("reinforce", r, [0, 1, 2]), torch.tensor([0.5, -0.5, 0.0], dtype=D))
    assert torch.allclose(adv("reinforce", r, [0, 1, 2], baseline="zero"), torch.tensor(r, dtype=D))


def test_group_centered_batch_std_uses_raw_reward_batch_std():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=D)
    a = adv("group_centered_batch_std", r, [0, 0, 1, 1], eps=0.0)
    s = float(r.std())  # Bessel std of the raw rewards: sqrt(0.25) = 0.5
    assert torch.allclose(a, torch.tensor([0.5 / s, -0.5 / s, 0.0, 0.0], dtype=D))


# ---------------------------------------------------------------- REINFORCE++ and REINFORCE++-baseline


def _pop_whiten(x, mask):
    m = mask > 0
    mu = x[m].mean()
    sd = x[m].std(unbiased=False)
    return torch.where(m, (x - mu) / sd, torch.zeros_like(x))


def test_reinforce_pp_masked_mean_zero_population_std_one():
    torch.manual_seed(1)
    mask = lengths_mask([3, 1, 4, 2], 5)
    a = adv(
        "reinforce_pp", torch.rand(4, dtype=D), [0, 0, 1, 1], mask=mask, token_rewards=-0.1 * torch.rand(4, 5)
    )
    m = mask > 0
    assert abs(float(a[m].mean())) < 1e-12
    assert math.isclose(float(a[m].std(unbiased=False)), 1.0, rel_tol=1e-9)
    assert torch.equal(a[~m], torch.zeros_like(a[~m]))


def test_reinforce_pp_kl_in_reward_returns_hand_computed():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]], dtype=D)
    tr = torch.tensor([[-0.1, -0.2, -0.3, 55.0], [-0.4, -0.5, 77.0, 88.0]], dtype=D)  # garbage at padding
    # gamma = 1: token rewards [-0.1, -0.2, -0.3 + 1] and [-0.4, -0.5 + 0]; the return at t is the sum
    # of the rewards from t on, so it contains every later KL penalty.
    g = torch.tensor([[0.4, 0.5, 0.7, 0.0], [-0.9, -0.5, 0.0, 0.0]], dtype=D)
    a = adv("reinforce_pp", [1.0, 0.0], [0, 1], mask=mask, token_rewards=tr)
    assert torch.allclose(a, _pop_whiten(g, mask))
    # gamma = 0.5 over loss tokens: G_t = r_t + 0.5 G_{t+1}
    g_half = torch.tensor(
        [[-0.1 - 0.1 + 0.175, -0.2 + 0.35, 0.7, 0.0], [-0.4 - 0.25, -0.5, 0.0, 0.0]], dtype=D
    )
    a_half = adv("reinforce_pp", [1.0, 0.0], [0, 1], mask=mask, token_rewards=tr, gamma=0.5)
    assert torch.allclose(a_half, _pop_whiten(g_half, mask))


def test_reinforce_pp_baseline_zero_variance_group_nonzero_when_lengths_differ():
    mask = lengths_mask([2, 3, 1, 4], 4)
    a = adv("reinforce_pp_baseline", [1.0, 1.0, 0.0, 1.0], [0, 0, 1, 1], mask=mask)
    # centred: group 0 -> 0 on 5 tokens, group 1 -> -0.5 on 1 token and +0.5 on 4 tokens
    x = torch.tensor([0.0] * 5 + [-0.5] + [0.5] * 4, dtype=D)
    mu, sd = x.mean(), x.std(unbiased=False)
    m = mask > 0
    assert torch.allclose(a[:2][m[:2]], torch.full((5,), float(-mu / sd), dtype=D))
    assert float(a[0, 0]) != 0.0
    assert abs(float(a[m].mean())) < 1e-12 and math.isclose(
        float(a[m].std(unbiased=False)), 1.0, rel_tol=1e-9
    )


def test_reinforce_pp_baseline_adds_token_returns():
    mask = lengths_mask([3, 3], 3)
    tr = torch.tensor([[-0.1, -0.2, -0.3], [0.0, 0.0, 0.0]], dtype=D)
    a = adv("reinforce_pp_baseline", [1.0, 0.0], [0, 0], mask=mask, token_rewards=tr)
    x = torch.tensor([[0.5 - 0.6, 0.5 - 0.5, 0.5 - 0.3], [-0.5, -0.5, -0.5]], dtype=D)
    assert torch.allclose(a, _pop_whiten(x, mask))


# ---------------------------------------------------------------- MaxRL


def test_maxrl_binary_values_and_zero_sum():
    a = adv("maxrl", [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0], [0, 0, 0, 0, 1, 1, 1, 1])
    n, k = 4, 2
    assert torch.allclose(a[:4], torch.tensor([n / k - 1, -1.0, -1.0, n / k - 1], dtype=D))
    assert abs(float(a[:4].sum())) < 1e-12
    assert torch.equal(a[4:], torch.zeros(4, dtype=D))  # K = 0 -> no gradient


@pytest.mark.parametrize("n", [2, 3, 5])
def test_maxrl_exact_bernoulli_expectation(n):
    """Bernoulli policy p = sigmoid(theta), N samples, all 2^N outcomes enumerated.

    S_i = d log pi(y_i) / d theta. The paper's raw estimator g = (1/K) sum_i r_i S_i (0 if K = 0) has
    E[g] = sum_{k=1..N} (1/k) d pass@k / d theta. The mean-scaled advantages give (constant 1/N)
    (1/N) sum_i A_i S_i = sum_i (r_i/K - 1/N) S_i (the control-variate form, 0 if K = 0). Because the
    control variate is dropped when K = 0, its expectation is E[g] - p (1-p)^N
    = sum_{k=1..N-1} (1/k) d pass@k / d theta: unbiased for the truncated objective J^(N-1)
    (N = 1 gives 0, spec sec 10 test 3).
    """
    theta = torch.tensor(0.3, dtype=D, requires_grad=True)
    p = torch.sigmoid(theta)

    def grad_j(t):  # d/dtheta sum_{k=1..t} (1/k) pass@k, pass@k = 1 - (1-p)^k
        j = sum((1.0 / k) * (1 - (1 - p) ** k) for k in range(1, t + 1))
        return float(torch.autograd.grad(j, theta, retain_graph=True)[0])

    e_adv = e_raw = 0.0
    for ys in itertools.product([0.0, 1.0], repeat=n):
        y = torch.tensor(ys, dtype=D)
        logpi = y * torch.nn.functional.logsigmoid(theta) + (1 - y) * torch.nn.functional.logsigmoid(-theta)
        s = torch.stack([torch.autograd.grad(lp, theta, retain_graph=True)[0] for lp in logpi])
        prob = float(torch.exp(logpi.detach().sum()))
        a = adv("maxrl", y, [0] * n)
        e_adv += prob * float((a * s).sum() / n)
        k = float(y.sum())
        if k > 0:
            g = float((y * s).sum() / k)
            e_raw += prob * g
            assert math.isclose(float((a * s).sum() / n), float(((y / k - 1.0 / n) * s).sum()), abs_tol=1e-12)
    assert math.isclose(e_raw, grad_j(n), rel_tol=1e-10)
    assert math.isclose(e_adv, grad_j(n - 1), rel_tol=1e-10, abs_tol=1e-14)
    pv = float(p.detach())
    assert math.isclose(e_raw - e_adv, pv * (1 - pv) ** n, rel_tol=1e-10)


# ---------------------------------------------------------------- GAE


def test_gae_lambda1_gamma1_zero_values_is_reward_to_go():
    mask = lengths_mask([3, 2], 4)
    tr = torch.tensor([[0.1, 0.2, 0.3, 9.0], [0.5, -0.5, 9.0, 9.0]], dtype=D)
    v0 = torch.zeros(2, 4, dtype=D)
    a = adv("gae", [1.0, 2.0], [0, 1], mask=mask, values=v0, token_rewards=tr, whiten=False)
    expected = torch.tensor([[1.6, 1.5, 1.3, 0.0], [2.0, 1.5, 0.0, 0.0]], dtype=D)
    assert torch.allclose(a, expected)


def test_gae_lambda0_is_td_error_and_returns():
    mask = lengths_mask([3], 4)
    v = torch.tensor([[0.5, -0.2, 0.4, 1e6]], dtype=D)  # garbage value at padding
    a, ret = gae_advantages_and_returns(torch.tensor([1.0], dtype=D), v, mask, gamma=0.9, lam=0.0)
    delta = torch.tensor([[0.0 + 0.9 * -0.2 - 0.5, 0.0 + 0.9 * 0.4 + 0.2, 1.0 + 0.0 - 0.4, 0.0]], dtype=D)
    assert torch.allclose(a, delta)
    assert torch.allclose(ret, torch.where(mask > 0, delta + v, torch.zeros_like(v)))
    a2 = adv("gae", [1.0], [0], mask=mask, values=v, gamma=0.9, lam=0.0, whiten=False)
    assert torch.allclose(a2, delta)


def test_gae_skips_non_loss_tokens_and_whitens_with_bessel():
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]], dtype=D)  # a non-loss token in the middle
    v = torch.tensor([[0.2, 123.0, 0.3, 0.1]], dtype=D)
    a = adv("gae", [1.0], [0], mask=mask, values=v, gamma=1.0, lam=1.0, whiten=False)
    assert torch.allclose(a, torch.tensor([[0.8, 0.0, 0.7, 0.9]], dtype=D))  # A_t = R - V_t, reward-to-go 1
    w = adv("gae", [1.0], [0], mask=mask, values=v)
    x = torch.tensor([0.8, 0.7, 0.9], dtype=D)
    assert torch.allclose(w[mask > 0], (x - x.mean()) / torch.sqrt(x.var(unbiased=True) + 1e-8))


def test_gae_without_values_raises_naming_values():
    with pytest.raises(ValueError, match="values"):
        adv("gae", [1.0], [0])
    assert "needs_values" in ADVANTAGES.spec("gae").tags


# ---------------------------------------------------------------- GDPO


def _sum_then_normalise(r, g):
    s = adv("grpo", r.sum(-1), g)
    return (s - s.mean()) / (s.std() + 1e-6)


def test_gdpo_invariant_to_affine_rescale_of_one_channel():
    torch.manual_seed(2)
    r = torch.rand(8, 2, dtype=D)
    g = [0, 0, 0, 0, 1, 1, 1, 1]
    r2 = r.clone()
    r2[:, 1] = 3.0 * r2[:, 1] + 5.0
    assert torch.allclose(adv("gdpo", r, g, eps=0.0), adv("gdpo", r2, g, eps=0.0))
    assert not torch.allclose(_sum_then_normalise(r, g), _sum_then_normalise(r2, g), atol=1e-3)


def test_gdpo_two_binary_channel_collapse_example():
    r = torch.tensor([[0.0, 0.0], [1.0, 1.0], [0.0, 0.0], [0.0, 1.0]], dtype=D)
    g = [0, 0, 1, 1]
    # sum-then-normalise: both groups become -/+ the same magnitude (distinction lost)
    sn = _sum_then_normalise(r, g)
    assert math.isclose(float(sn[1]), float(sn[3]), rel_tol=1e-5)
    # GDPO before batch standardisation: per-channel z (Bessel, eps 0) is -/+ 1/sqrt(2) in each informative
    # channel, so S = -/+ sqrt(2) (both channels differ) vs -/+ 1/sqrt(2) (one channel): ratio 2 : 1
    # (the spec's -/+2 vs -/+1 uses the population std; the ratio is the same).
    s = torch.tensor([-math.sqrt(2), math.sqrt(2), -1 / math.sqrt(2), 1 / math.sqrt(2)], dtype=D)
    a = adv("gdpo", r, g, eps=0.0)
    # batch standardisation is one shift (the mean is 0) and one scale: the 2 : 1 ratio survives it
    assert torch.allclose(a, s / s.std())
    assert math.isclose(float(a[1] / a[3]), 2.0, rel_tol=1e-12)
    assert abs(float(a.mean())) < 1e-12 and math.isclose(float(a.std()), 1.0, rel_tol=1e-12)


def test_gdpo_single_channel_is_grpo_then_batch_standardisation():
    torch.manual_seed(3)
    r = torch.rand(9, dtype=D)
    g = [0, 0, 0, 1, 1, 1, 2, 2, 2]
    z = adv("grpo", r, g)
    expected = (z - z.mean()) / (z.std() + 1e-6)
    assert torch.allclose(adv("gdpo", r, g), expected)
    assert torch.allclose(adv("gdpo", r[:, None], g), expected)


def test_gdpo_weights_and_errors():
    r = torch.tensor([[0.0, 0.0], [1.0, 1.0], [0.0, 0.0], [0.0, 1.0]], dtype=D)
    g = [0, 0, 1, 1]
    a = adv("gdpo", r, g, eps=0.0, weights="1,0")  # only channel 0: group 1 has no signal
    assert torch.equal(a[2:], torch.zeros(2, dtype=D)) and float(a[1]) > 0
    with pytest.raises(ValueError, match="3 entries but rewards have 2 channels"):
        adv("gdpo", r, g, weights="1,1,1")
    with pytest.raises(ValueError, match="token_rewards"):
        adv("gdpo", r, g, token_rewards=torch.zeros(4, 3, dtype=D))
    with pytest.raises(PartError, match="weights"):
        ADVANTAGES.resolve("gdpo", {"weights": "1,x"})
    assert ADVANTAGES.resolve("gdpo", {"weights": "1,0.5"}).params["weights"] == "1,0.5"
    # ';' also separates weights, so the CLI form gdpo:weights=1;0.5 parses (',' separates parameters there)
    method = build_method(
        "m", advantage="gdpo:weights=1;0,eps=0", trust_region="clip", aggregation="token_mean"
    )
    assert torch.equal(adv("gdpo", r, g, **method.advantage.params), a)


def test_padding_garbage_never_changes_token_level_outputs():
    mask = lengths_mask([2, 4, 3], 5)
    torch.manual_seed(4)
    v = torch.rand(3, 5, dtype=D)
    tr = -0.1 * torch.rand(3, 5, dtype=D)
    v2, tr2 = v.clone(), tr.clone()
    v2[mask == 0] = 1e30
    tr2[mask == 0] = -1e30
    for name in ["reinforce_pp", "reinforce_pp_baseline", "gae", "rloo", "grpo"]:
        a = adv(name, [1.0, 0.0, 0.5], [0, 0, 1], mask=mask, values=v, token_rewards=tr)
        b = adv(name, [1.0, 0.0, 0.5], [0, 0, 1], mask=mask, values=v2, token_rewards=tr2)
        assert torch.equal(a, b), name


@pytest.mark.parametrize("name", [s.name for s in ADVANTAGES if "needs_groups" in s.tags
                                  and "needs_sum_pi_sq" not in s.tags  # (token baselines: other inputs)
                                  and s.name != "reinforce_pp_baseline"])  # whitens after centring: -mu/sigma
def test_a_group_of_equal_rewards_has_advantage_exactly_zero(name):
    """Eight rewards of 0.1: their float64 mean was an ulp off 0.1, which gave grpo A ~ 1e-11 instead of 0 (and kept
    those rows' backward in the update). A group's mean is now its value when every reward in it is equal."""
    rewards = torch.cat([torch.full((8,), 0.1, dtype=D), torch.linspace(0.0, 1.0, 8, dtype=D)])
    group_ids = torch.arange(16) // 8
    got = ADVANTAGES.fn(name)(rewards, group_ids, torch.ones(16, 3, dtype=D), None, None)
    assert (got[:8] == 0).all(), got[:8]
    assert (got[8:] != 0).any()


def test_maxrl_refuses_a_negative_reward_instead_of_zeroing_its_group():
    """(r - mean) / mean is MaxRL's only for a pass rate: [1, -1, -1, -1] has mean -0.5, which the estimator used to
    turn into four zero advantages without a word."""
    from polyrl.errors import TrainingError

    with pytest.raises(TrainingError, match="advantage 'maxrl' needs rewards >= 0.*got -1"):
        adv("maxrl", [1.0, -1.0, -1.0, -1.0], [0, 0, 0, 0])
