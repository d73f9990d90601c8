"""Regularisers and aggregation of the peers (verl, TRL), checked by hand: the abs KL estimator, token_sum, the entropy
bonus and its adaptive coefficient, the adaptive KL controller (state kept across a resume), the clipped value loss
with its aggregation modes and the high-entropy-minority token mask."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import polyrl.methods  # noqa: F401  (registers every part and preset)
from polyrl.build import method_from_overrides
from polyrl.objectives import build_method, override, policy_loss
from polyrl.objectives.controller import Controller, adaptive_entropy_coef, adaptive_kl_coef
from polyrl.objectives.kl import kl_in_reward
from polyrl.objectives.regularisers import high_entropy_mask
from polyrl.objectives.value import clipped_value_loss
from polyrl.registry import AGGREGATIONS, KL, PartError
from polyrl.trainer import train
from polyrl.types import Normalizer
from tests.helpers import make_inputs
from tests.test_trainer import QUIET, _cfg, _task

D = torch.float64


# --- abs KL -------------------------------------------------------------------------------------------------------

def test_abs_kl_is_the_absolute_log_ratio_with_sign_gradient():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=D, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.5]], dtype=D)
    kl = KL.fn("abs")(logp, ref, None)
    torch.testing.assert_close(kl, torch.tensor([[0.5, 1.0, 0.0]], dtype=D))
    (g,) = torch.autograd.grad(kl.sum(), logp)
    torch.testing.assert_close(g, torch.tensor([[1.0, -1.0, 0.0]], dtype=D))  # sign(logp - ref); 0 at equality


def test_abs_kl_clamps_the_log_ratio_like_every_estimator():
    kl = KL.fn("abs")(torch.tensor([[-40.0]], dtype=D), torch.tensor([[0.0]], dtype=D), None, clamp=20.0)
    assert float(kl) == 20.0


# --- token_sum ------------------------------------------------------------------------------------------------------

def test_token_sum_is_the_masked_sum_over_a_constant():
    loss = torch.tensor([[1.0, 2.0, 99.0], [3.0, float("nan"), float("nan")]], dtype=D)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=D)
    norm = Normalizer.from_batch(mask, torch.tensor([0, 0]))
    assert float(AGGREGATIONS.fn("token_sum")(loss, mask, norm, None)) == 6.0
    assert float(AGGREGATIONS.fn("token_sum")(loss, mask, norm, None, scale=4.0)) == 1.5
    with pytest.raises(PartError, match="scale"):
        AGGREGATIONS.resolve("token_sum", {"scale": 0.0})


# --- entropy bonus ----------------------------------------------------------------------------------------------------

def _with_entropy_leaf(inp):
    ent = inp.entropy.detach().clone().requires_grad_(True)
    return dataclasses.replace(inp, entropy=ent), ent


def test_entropy_bonus_subtracts_coef_times_entropy_aggregated_like_the_loss():
    base = build_method("b", advantage="grpo", trust_region="clip", aggregation="seq_mean_token_mean")
    bonus = override(base, entropy_coef=0.05)
    inp, ent = _with_entropy_leaf(make_inputs(seed=21))
    plain, out = policy_loss(inp, base), policy_loss(inp, bonus)
    m = inp.mask
    per_seq = (inp.entropy.detach() * m).sum(-1) / m.sum(-1)
    expected = plain.loss.detach() - 0.05 * per_seq.mean()
    torch.testing.assert_close(out.loss.detach(), expected)
    mean_entropy = (inp.entropy.detach() * m).sum() / m.sum()
    torch.testing.assert_close(out.metrics["objective/entropy_bonus"], 0.05 * mean_entropy)
    (g,) = torch.autograd.grad(out.loss, ent)  # the bonus reaches the entropy: -coef / (N |y_i|) on loss tokens
    torch.testing.assert_close(g, -0.05 * m / m.sum(-1, keepdim=True) / m.shape[0])
    assert not base.entropy_grad and bonus.entropy_grad


def test_entropy_bonus_is_micro_batch_invariant():
    method = build_method("b", advantage="grpo", trust_region="clip", aggregation="token_mean", entropy_coef=0.1)
    inp, ent = _with_entropy_leaf(make_inputs(B=6, T=5, seed=22))
    full = policy_loss(inp, method).loss
    (g_full,) = torch.autograd.grad(full, ent)
    inp2, ent2 = _with_entropy_leaf(make_inputs(B=6, T=5, seed=22))
    total = sum(policy_loss(inp2.rows(slice(i, i + 2)), method).loss for i in range(0, 6, 2))
    (g_acc,) = torch.autograd.grad(total, ent2)
    torch.testing.assert_close(total, full, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g_acc, g_full, rtol=1e-12, atol=1e-14)


def test_entropy_from_the_chunked_log_prob_path_carries_gradient(tiny_model):
    from polyrl.model import completion_logprobs, load_policy

    model = load_policy(tiny_model, threads=1)[0]
    ids = torch.randint(1, 10, (2, 9), generator=torch.Generator().manual_seed(0))
    comp = torch.ones(2, 5)
    out = completion_logprobs(model, ids, torch.ones_like(ids), comp, chunk_size=3)  # 4 chunks, checkpointed
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.entropy.sum(), params, allow_unused=True)
    assert sum(float(g.abs().sum()) for g in grads if g is not None) > 0


# --- adaptive KL (Ziegler et al.) -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kl,error", [(0.3, 0.2), (0.11, 0.1), (0.05, -0.2), (0.1, 0.0)])
def test_adaptive_kl_coef_by_hand(kl, error):
    beta = adaptive_kl_coef(0.05, kl, target=0.1, horizon=10_000, n_steps=64)
    assert math.isclose(beta, 0.05 * (1 + error * 64 / 10_000), rel_tol=1e-12)


def test_adaptive_kl_coef_refuses_a_horizon_that_would_flip_beta():
    with pytest.raises(ValueError, match="kl_horizon = 10 is too small"):
        adaptive_kl_coef(0.05, 1.0, target=0.1, horizon=10, n_steps=64)


def test_kl_in_reward_reports_the_per_sequence_kl_the_controller_reads():
    method = build_method("r", advantage="rloo", trust_region="clip", aggregation="token_mean", kl="k1", kl_coef=0.5,
                          kl_placement="reward")
    old = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, 0.0, 0.0]], dtype=D)
    ref = torch.tensor([[-1.5, -1.0, 0.0], [-3.0, 0.0, 0.0]], dtype=D)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=D)
    _, metrics = kl_in_reward(method, old, ref, mask)
    # k1 = old - ref: [0.5, -1.0] (mean -0.25) and [2.0] (mean 2.0); verl's current_kl = mean of the means
    assert math.isclose(metrics["reward/kl"], (-0.25 + 2.0) / 2, rel_tol=1e-12)
    assert math.isclose(metrics["reward/kl_penalty"], 0.5 * (0.5 - 1.0 + 2.0) / 3, rel_tol=1e-12)


def test_controller_adapts_kl_beta_and_applies_it_to_the_method():
    method = method_from_overrides("ppo_adaptive_kl", {})
    ctl = Controller(method)
    assert ctl.method.kl_coef == 0.05
    used = ctl.update({"reward/kl": 1.0, "objective/entropy": 0.4}, n_seqs=100)
    assert used == {"objective/kl_coef": 0.05}
    assert math.isclose(ctl.method.kl_coef, 0.05 * (1 + 0.2 * 100 / 10_000), rel_tol=1e-12)
    restored = Controller(method, ctl.state_dict())
    assert restored.method.kl_coef == ctl.method.kl_coef
    assert Controller(method_from_overrides("grpo", {})).method == method_from_overrides("grpo", {})  # nothing adapts


# --- adaptive entropy (Skywork-OR1) ---------------------------------------------------------------------------------

def test_adaptive_entropy_coef_steps_toward_the_target_and_clamps():
    assert adaptive_entropy_coef(0.002, 0.1, target=0.2, delta=0.001, ceiling=0.005) == (0.003, True)
    assert adaptive_entropy_coef(0.002, 0.3, target=0.2, delta=0.001, ceiling=0.005) == (0.001, False)
    assert adaptive_entropy_coef(0.0045, 0.1, target=0.2, delta=0.001, ceiling=0.005) == (0.005, True)  # ceiling
    assert adaptive_entropy_coef(0.0005, 0.9, target=0.2, delta=0.001, ceiling=0.005) == (0.0, False)  # floor 0
    assert adaptive_entropy_coef(0.002, 0.2, target=0.2, delta=0.001, ceiling=0.005) == (0.002, True)


def test_controller_entropy_coefficient_is_off_above_the_target():
    method = method_from_overrides("grpo_adaptive_entropy", {"entropy_delta": 0.002})
    ctl = Controller(method)
    assert ctl.method.entropy_coef == 0.0 and ctl.method.entropy_grad  # starts at 0 but keeps the entropy's gradient
    assert ctl.update({"objective/entropy": 0.1}, n_seqs=8) == {"objective/entropy_coef": 0.0}
    assert ctl.method.entropy_coef == 0.002
    ctl.update({"objective/entropy": 0.1}, n_seqs=8)
    assert ctl.method.entropy_coef == 0.004
    ctl.update({"objective/entropy": 0.5}, n_seqs=8)  # above the target: alpha steps down and the bonus is off
    assert ctl.alpha == pytest.approx(0.002) and ctl.method.entropy_coef == 0.0
    ctl.update({}, n_seqs=8)  # a step without update changes nothing
    assert ctl.alpha == pytest.approx(0.002)


# --- refusals ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("changes,match", [
    ({"kl_target": 0.1}, "kl_target = 0.1 needs a KL term"),
    ({"kl_horizon": 500}, "kl_horizon = 500 only applies with kl_target"),
    ({"entropy_target": 0.2}, "entropy_target = 0.2 needs entropy_coef_max > 0"),
    ({"entropy_delta": 0.01}, "entropy_delta = 0.01 only applies with entropy_target"),
    ({"entropy_coef_max": 0.01}, "entropy_coef_max = 0.01 only applies with entropy_target"),
    ({"entropy_target": 0.2, "entropy_coef_max": 0.01, "entropy_coef": 0.02}, "entropy_coef = 0.02 must be <="),
    ({"entropy_top": 1.0}, r"entropy_top = 1.0 must be in \[0, 1\)"),
    ({"entropy_coef": -0.1}, "entropy_coef = -0.1 must be a finite number >= 0"),
])
def test_settings_that_cannot_act_are_refused_in_one_line(changes, match):
    with pytest.raises(PartError, match=match) as e:
        method_from_overrides("dapo", changes)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("preset,changes,match", [
    ("dr_grpo", {"kl_placement": "reward"}, "kl_placement = 'reward' has no effect without a KL term"),
    ("dr_grpo", {"kl": "k2"}, "kl = 'k2' has no effect with kl_coef = 0"),
    ("grpo", {"kl": "none", "kl_coef": 0.5}, "kl_coef = 0.5 needs a KL estimator"),
    ("grpo", {"kl": "none", "kl_placement": "reward"}, "kl_placement = 'reward' has no effect without a KL term"),
    ("grpo", {"kl_coef": float("nan")}, "kl_coef = nan must be a finite number >= 0"),
    ("reinforce", {"trust_region": "clip:eps_low=0.01"}, "trust_region = 'clip' has no effect with ratio 'on_policy'"),
    ("rloo", {"anchor": "rollout"}, "anchor = 'rollout' has no effect with ratio 'on_policy'"),
    # a preference loss never reads the ratio: both ran labelled dpo+sequence+anchor=rollout, trained as dpo
    ("dpo", {"ratio": "sequence"}, "ratio = 'sequence' has no effect with trust_region 'dpo'"),
    ("kto", {"anchor": "rollout"}, "anchor = 'rollout' has no effect with trust_region 'kto'"),
    ("grpo", {"trust_region": "simpo", "ratio": "sequence"}, "ratio = 'sequence' has no effect with trust_region"),
    # a part given twice acted twice: tis weights e^0.5 * e^0.5 past its cap; rewards shaped twice
    ("grpo", {"correction": ["tis", "tis"]}, "correction 'tis' is given twice"),
    ("dapo", {"shaper": ["overlong_soft", "overlong_soft:penalty=2"]}, "shaper 'overlong_soft' is given twice"),
])
def test_overrides_the_method_would_not_act_on_are_refused(preset, changes, match):
    """Each of these ran before and trained exactly as the preset (the auditor compared the metrics)."""
    with pytest.raises(PartError, match=match) as e:
        method_from_overrides(preset, changes)
    assert "\n" not in str(e.value)


def test_overrides_that_act_are_kept():
    assert method_from_overrides("reinforce_pp", {"kl": "none"}).kl_placement == "loss"  # the placement goes too
    assert method_from_overrides("grpo", {"kl_coef": 0.0}).kl_coef == 0.0  # KL off by its coefficient
    assert method_from_overrides("reinforce", {"trust_region": "troll"}).trust_region.name == "troll"  # reads top-K
    assert method_from_overrides("reinforce", {"ratio": "token", "trust_region": "clip"}).ratio.name == "token"


# --- value loss -------------------------------------------------------------------------------------------------------

def test_clipped_value_loss_by_hand():
    v = torch.tensor([[1.0, 0.0, 2.0], [0.5, 9.0, 9.0]], dtype=D)
    v_old = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]], dtype=D)
    ret = torch.tensor([[2.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=D)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=D)
    # eps = 0.2: V_clip = [0.2, 0, 1.2 | 0.2]; max((V-R)^2, (V_clip-R)^2) = [max(1, 3.24), max(1, 1), max(4, 1.44) |
    # max(0.25, 0.64)] = [3.24, 1, 4 | 0.64]
    per_token = torch.tensor([[3.24, 1.0, 4.0], [0.64, 0.0, 0.0]], dtype=D)
    torch.testing.assert_close(clipped_value_loss(v, v_old, ret, mask, 0.2), 0.5 * per_token.sum() / 4)
    seq = 0.5 * ((3.24 + 1 + 4) / 3 + 0.64) / 2
    torch.testing.assert_close(clipped_value_loss(v, v_old, ret, mask, 0.2, "seq_mean_token_mean"),
                               torch.tensor(seq, dtype=D))
    torch.testing.assert_close(clipped_value_loss(v, v_old, ret, mask, 0.2, "seq_mean_token_sum"),
                               torch.tensor(0.5 * (8.24 + 0.64) / 2, dtype=D))
    torch.testing.assert_close(clipped_value_loss(v, v_old, ret, mask, 0.2, "token_sum"),
                               torch.tensor(0.5 * 8.88, dtype=D))
    unclipped = 0.5 * (1 + 1 + 4 + 0.25) / 4  # clip = 0: the plain squared error
    torch.testing.assert_close(clipped_value_loss(v, v_old, ret, mask, 0.0), torch.tensor(unclipped, dtype=D))
    with pytest.raises(ValueError, match="value_loss_agg = 'prompt_mean'"):
        clipped_value_loss(v, v_old, ret, mask, 0.2, "prompt_mean")


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum"])
def test_value_loss_split_over_ranks_adds_up_with_the_global_normalizer(agg):
    g = torch.Generator().manual_seed(3)
    v, v_old, ret = (torch.randn(5, 4, generator=g, dtype=D) for _ in range(3))
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]], dtype=D)
    norm = Normalizer.from_batch(mask, torch.zeros(5, dtype=torch.long))
    full = clipped_value_loss(v, v_old, ret, mask, 0.2, agg)
    parts = sum(clipped_value_loss(v[r], v_old[r], ret[r], mask[r], 0.2, agg, norm) for r in (slice(0, 2), slice(2, 5)))
    torch.testing.assert_close(parts, full, rtol=1e-12, atol=1e-14)


# --- high-entropy minority (80/20) --------------------------------------------------------------------------------

def test_high_entropy_mask_keeps_exactly_ceil_rho_n_highest_tokens():
    entropy = torch.tensor([[0.9, 0.1, 0.5, 50.0], [0.3, 0.8, 0.2, 0.7], [0.6, 0.05, 9.0, 9.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=D)  # 9 loss tokens; padded 50 and 9 ignored
    keep = high_entropy_mask(entropy, mask, 0.2)  # ceil(1.8) = 2: entropies 0.9 and 0.8
    assert keep.sum() == 2 and keep[0, 0] == 1 and keep[1, 1] == 1
    keep = high_entropy_mask(entropy, mask, 0.5)  # ceil(4.5) = 5: 0.9, 0.8, 0.7, 0.6, 0.5
    assert torch.equal(keep, torch.tensor([[1, 0, 1, 0], [0, 1, 0, 1], [1, 0, 0, 0]], dtype=D))
    n15 = torch.ones(3, 5, dtype=D)
    assert high_entropy_mask(torch.arange(15.0, dtype=D).reshape(3, 5), n15, 0.2).sum() == 3  # 0.2 * 15 = 3, not 4


def test_forking_tokens_preset_gives_gradient_only_to_the_kept_tokens():
    method = method_from_overrides("forking_tokens", {})
    inp = make_inputs(B=4, T=6, seed=23)
    out = policy_loss(inp, method)
    (g,) = torch.autograd.grad(out.loss, inp.topk_logp)
    n = int(inp.mask.sum())
    k = math.ceil(0.2 * n - 1e-9)
    nonzero = g[..., 0] != 0
    assert int(nonzero.sum()) == k
    top = torch.where(inp.mask > 0, inp.entropy, torch.full_like(inp.entropy, -1.0)).flatten().topk(k).indices
    assert nonzero.flatten()[top].all()
    torch.testing.assert_close(out.metrics["objective/entropy_top_kept"], torch.tensor(k / n, dtype=D))


# --- state across a resume ------------------------------------------------------------------------------------------

def test_resume_reproduces_the_adapted_coefficients_exactly(tiny_model, tmp_path):
    method = method_from_overrides("grpo_adaptive_entropy", {
        "filter": ["none"], "entropy_target": 5.0, "entropy_delta": 0.001, "kl": "k1", "kl_coef": 0.1,
        "kl_target": 0.001, "kl_horizon": 100})

    def run(d, steps, **kw):
        train(_cfg(steps=steps, **kw), method, model_dir=tiny_model, task=_task(), run_dir=str(tmp_path / d),
              console=QUIET)

    def coefs(d):
        rows = [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
        return [(r["objective/kl_coef"], r["objective/entropy_coef"]) for r in rows if "objective/kl_coef" in r]

    run("a", 4)
    run("b", 2)
    run("b", 4, resume=True)
    a, b = coefs("a"), coefs("b")
    assert len(a) == 4 and a == b  # not just close: the coefficients are state, restored exactly
    assert a[0] == (0.1, 0.0) and a[1][1] == 0.001 and a[3][1] == pytest.approx(0.003)  # entropy < 5: alpha climbs
    assert len({kl for kl, _ in a}) == 4  # beta moved every step
