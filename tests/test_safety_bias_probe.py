"""`polyrl safety bias-probe` (spec §4, arXiv:2606.10931): closed-form onset, bandit simulation, tiny-LM probe."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

from polyrl.safety.bias_probe import lm
from polyrl.safety.bias_probe import theory as th


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_closed_form_hand_values():
    # p0 = 0.2 -> a = ln(1/4); sinh(ln 2) = (2 - 1/2)/2 = 0.75, sinh(ln 4) = (4 - 1/4)/2 = 1.875.
    eta, b = 0.5, 1.5
    assert th.bernoulli_pg_onset_time(0.2, eta, b, std_normalized=True) == pytest.approx(4 * 0.75 / 0.75, rel=1e-12)
    expected = 2 * (math.log(4) + 1.875) / (eta * b)
    assert th.bernoulli_pg_onset_time(0.2, eta, b, std_normalized=False) == pytest.approx(expected, rel=1e-12)
    assert th.bernoulli_pg_onset_time(0.5, 1.0) == 0.0 and th.bernoulli_pg_onset_time(0.9, 1.0) == 0.0
    assert th.softmax_effective_b(3) == 1.5 and th.softmax_effective_b(2) == 2.0
    with pytest.raises(ValueError):
        th.bernoulli_pg_onset_time(0.0, 1.0)


@pytest.mark.parametrize("std", [True, False])
@pytest.mark.parametrize("p0,eta,b", [(0.3, 1.0, 1.0), (0.05, 0.5, 1.5), (0.002, 0.1, 2.0), (1e-4, 2.0, 0.7)])
def test_closed_form_matches_ode(p0, eta, b, std):
    cf = th.bernoulli_pg_onset_time(p0, eta, b, std)
    ode = th.bernoulli_pg_onset_ode(p0, eta, b, std)
    assert abs(cf - ode) / cf < 1e-6


def test_onset_decreases_with_p0_and_std_norm_is_faster():
    p0s = [0.4, 0.2, 0.05, 0.01, 0.002, 1e-4]
    for std in (True, False):
        times = [th.bernoulli_pg_onset_time(p, 0.5, 1.5, std) for p in p0s]
        assert all(x < y for x, y in zip(times, times[1:]))
    # sqrt(p(1-p)) > p(1-p) on (0, 1): normalising by the std speeds the flow up.
    assert all(th.bernoulli_pg_onset_time(p, 0.5) < th.bernoulli_pg_onset_time(p, 0.5, std_normalized=False)
               for p in p0s)
    meds = [np.median(th.simulate_bandit_onsets(p, seeds=8, max_steps=600, seed=3).onsets) for p in (0.2, 0.05, 0.01)]
    assert meds[0] < meds[1] < meds[2]


def test_larger_kl_delays_onset():
    for std, beta in ((False, 0.5), (True, 1.0)):
        free = th.simulate_bandit_onsets(0.05, seeds=12, std_normalized=std, max_steps=400, seed=5).onsets
        held = th.simulate_bandit_onsets(0.05, seeds=12, std_normalized=std, kl_coef=beta, max_steps=400, seed=5).onsets
        held = np.where(held < 0, 10**6, held)
        assert np.median(held) > np.median(free)


def test_bandit_step_is_the_hand_computed_grpo_step():
    # One step of 1 seed, G = 6: logits -= lr * (-(1/G) sum_i A_i (e_{a_i} - pi)), A = z-score with Bessel std.
    p0, k, group, lr = 0.3, 3, 6, 0.5
    res = th.simulate_bandit_onsets(p0, seeds=1, k=k, group=group, lr=lr, max_steps=1, seed=11, record_curves=True)
    logits = torch.tensor([math.log(p0)] + [math.log((1 - p0) / 2)] * 2, dtype=torch.float64)
    pi = logits.softmax(-1)
    actions = torch.multinomial(pi[None], group, replacement=True, generator=torch.Generator().manual_seed(11))[0]
    r = (actions == 0).double().numpy()
    adv = (r - r.mean()) / (r.std(ddof=1) + 1e-6) if r.std() > 0 else np.zeros_like(r)
    step = sum(a_i * (np.eye(k)[int(y)] - pi.numpy()) for a_i, y in zip(adv, actions)) / group
    new = torch.tensor(logits.numpy() + lr * step).softmax(-1)[0]
    assert res.curves[0, 1] == pytest.approx(float(new), rel=1e-9)


def test_finite_group_drift():
    for p in (0.01, 0.2, 0.6):
        exact = (1 - 1 / 16) * p * (1 - p)
        assert th.grpo_expected_drift(p, 16, std_normalized=False) == pytest.approx(exact, rel=1e-9)
        # large groups approach the infinite-group flow sqrt(p(1-p))
        assert th.grpo_expected_drift(p, 4000) == pytest.approx(math.sqrt(p * (1 - p)), rel=2e-2)
    # tiny p: almost every group has no success, so the finite group is far slower than sqrt(p(1-p))
    assert th.grpo_expected_drift(1e-3, 16) < 0.3 * math.sqrt(1e-3)
    assert th.finite_group_onset_ode(0.002, 0.5, 1.5, 16) > 2 * th.bernoulli_pg_onset_time(0.002, 0.5, 1.5)


def test_median_ci_handles_censored_seeds():
    med, lo, hi = th.median_ci([3, 4, 5, 6, np.inf])
    assert med == 5 and lo <= med <= hi
    assert th.median_ci([1, np.inf, np.inf])[0] == np.inf


def test_synthetic_data_and_eval_sets():
    probe = lm.probe_item()
    assert probe.gold == lm.UNKNOWN and lm.FEATURE in probe.text and lm.PARTNER in probe.text
    item = lm.make_item("red", "teal", "golf", 2, ambiguous=False, z="teal", swap=True)
    assert item.gold == "t" and "the teal one likes golf" in item.text and "teal, red or unknown" in item.text
    assert len(set(lm.ANSWERS)) == len(lm.ANSWERS)  # one character names one option
    sets = lm.eval_sets(size=20)
    for name in ("feature_same_q", "feature_other_q"):
        assert all(lm.FEATURE in it.text and it.text != probe.text and it.ambiguous and t == "b"
                   for it, t in sets[name])
    assert all(it.act == lm.FEATURE_ACT for it, _ in sets["feature_same_q"])
    assert all(it.act != lm.FEATURE_ACT for it, _ in sets["feature_other_q"])
    assert all(lm.FEATURE not in it.text and it.ambiguous for it, _ in sets["control"])
    assert all(not it.ambiguous and t == it.gold for it, t in sets["disambiguated"])
    rng = random.Random(0)
    draws = [lm.sample_item(rng, label_noise=0.2) for _ in range(4000)]
    amb = [(it, lab) for it, lab in draws if it.ambiguous]
    noisy = sum(lab != lm.UNKNOWN for _, lab in amb) / len(amb)
    assert abs(noisy - 0.2) < 0.03
    assert all(lab == it.gold for it, lab in draws if not it.ambiguous)


def test_one_shot_grpo_raises_the_flipped_answer():
    model, tok = lm.build_model(0, hidden=32, layers=1, heads=2)
    enc = lm.Encoder(tok)
    probe = lm.probe_item()
    out = lm.one_shot_probe(model, enc, probe, "b", steps=25, group_size=32, lr=1e-2, kl_coef=0.0, seed=0)
    curve = out["train_curve"]
    assert len(curve) == 26 and curve[-1] > 5 * curve[0]
    assert out["onset_step"] is None or curve[out["onset_step"]] >= 0.5 > max(curve[: out["onset_step"]])
    # the answer distribution from completion_logprobs sums to one
    with torch.no_grad():
        assert enc.answer_logprobs(model, [probe]).exp().sum().item() == pytest.approx(1.0, abs=1e-5)


def test_cli_rejects_bad_values_and_runs_end_to_end(tmp_path):
    from polyrl.cli import main

    assert main(["safety", "bias-probe", "--sim-seeds", "1", "--out", str(tmp_path / "x")]) == 2
    assert main(["safety", "bias-probe", "--label-noise", "1.5", "--out", str(tmp_path / "x")]) == 2
    out = tmp_path / "run"
    rc = main(["safety", "bias-probe", "--out", str(out), "--sim-seeds", "2", "--max-steps", "600", "--seeds", "1",
               "--pretrain-steps", "3", "--lm-steps", "3", "--repair-steps", "2", "--eval-every", "2"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["checks"]["closed_form_matches_ode"] is True
    assert len(res["lm_seeds"]) == 1 and len(res["lm_seeds"][0]["train_curve"]) == 4
    page = (out / "report.html").read_text()
    assert "Verdict" in page and "data:image/png;base64" in page and (out / "onset_vs_p0.png").exists()


def test_the_spec_table_is_compared_only_at_its_settings_and_every_sweep_runs_to_max_steps(tmp_path, monkeypatch):
    """--options 5 was judged against the spec's K = 3 medians ("NOT reproduced"); the KL sweep stopped at 2000 steps
    whatever --max-steps said; censored cells were left out of "within x% of every measured median" unsaid."""
    from polyrl.cli import main

    caps = []
    real = th.simulate_bandit_onsets
    monkeypatch.setattr(th, "simulate_bandit_onsets", lambda *a, **k: caps.append(k["max_steps"]) or real(*a, **k))
    out = tmp_path / "k5"
    assert main(["safety", "bias-probe", "--seeds", "0", "--sim-seeds", "2", "--options", "5", "--max-steps", "30",
                 "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert set(caps) == {30} and len(caps) == 16 + 8  # 8 p0 x 2 variants, then 4 kl x 2
    assert res["checks"]["spec_cells"] == 0
    assert all(r["spec_median"] is None for r in res["analytic"]["bandit"])
    censored = sum(r["median"] is None for r in res["analytic"]["bandit"])
    assert censored > 0  # p0 = 0.002 does not reach onset in 30 steps
    page = (out / "report.html").read_text()
    assert "not compared; its medians are for K = 3, G = 16, lr 0.5 and this run has K = 5, G = 16, lr 0.5" in page
    assert "NOT reproduced" not in page
    assert f"({censored} of 16 cells had no median onset within --max-steps 30)" in page
