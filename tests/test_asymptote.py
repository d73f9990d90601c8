"""Per-seed ScaleRL asymptotes for the evidence claim scalerl_loss_asymptote (polyrl/lab/asymptote.py)."""

from __future__ import annotations

import math

import numpy as np

from polyrl.lab.analysis import Run
from polyrl.lab.asymptote import fit_curves, paired_asymptote, seed_asymptote
from polyrl.lab.stats import sigmoid_law

PER_STEP = 64.0  # rollouts generated per step


def _run(a: float, *, b: float = 1.5, cmid: float = 1500.0, r0: float = 0.4, seed: int = 0, flat: bool = False):
    """A run whose held-out accuracy follows the sigmoid law exactly against cumulative generated rollouts."""
    rows = []
    for step in range(0, 201, 5):
        c = step * PER_STEP  # rollouts after the update of `step` (step 0: none)
        acc = r0 if flat else float(sigmoid_law(np.array([c]), a, b, cmid, r0)[0])
        rows.append({"step": step, "eval/accuracy": acc, "rollout/generated": PER_STEP if step else 0.0})
        for s in range(step + 1, min(step + 5, 201)):
            rows.append({"step": s, "rollout/generated": PER_STEP})
    return Run("x", seed, rows)


def test_seed_asymptote_recovers_a_on_an_exact_sigmoid():
    for a in (0.7, 0.85):
        out = seed_asymptote(_run(a))
        assert abs(out["sigmoid_A"] - a) < 1e-3
        assert out["sigmoid_fit_failed"] == 0.0 and out["sigmoid_A_at_bound"] == 0.0
        assert out["sigmoid_Cmid_beyond_data"] == 0.0  # Cmid 1500 < last compute 200 * 64
        assert abs(out["_fit"]["Cmid"] - 1500.0) < 1.0 and out["_fit"]["R0"] == 0.4
        assert out["_fit_y"][0] == [0.0, 0.4] and abs(out["_fit_y"][-1][1] - out["sigmoid_A"]) < 0.02


def test_seed_asymptote_reports_a_failed_fit_instead_of_a_number():
    out = seed_asymptote(_run(0.8, flat=True))  # never above R0: A = R0, B and Cmid not identifiable
    assert out["sigmoid_A"] is None and out["sigmoid_fit_failed"] == 1.0 and out["_fit_y"] is None
    assert "no gain over R0" in out["_fit"]["reason"]


def test_a_fit_at_the_bound_with_its_midpoint_beyond_the_data_is_unidentified():
    out = seed_asymptote(_run(1.0, cmid=30000.0))  # early on a curve toward 1 (last compute 12800): A fits at 1
    assert out["sigmoid_A_at_bound"] == 1.0 and out["sigmoid_Cmid_beyond_data"] == 1.0
    assert out["sigmoid_A"] is None and out["sigmoid_fit_failed"] == 1.0
    assert out["_fit"]["reason"].startswith("unidentified")


def _samples():
    arms = {"dapo": [_run(0.7, seed=s) for s in range(3)],
            "cispo": [_run(0.8, seed=0), _run(0.85, seed=1), _run(0.9, seed=2, flat=True)]}
    samples = {"arms": {}, "curves": {}}
    for arm, runs in arms.items():
        per = [seed_asymptote(r) for r in runs]
        samples["arms"][arm] = {k: [p[k] for p in per] for k in per[0]}
        samples["arms"][arm]["seeds"] = [r.seed for r in runs]
        samples["curves"][arm] = {"x": [0.0, 200.0], "y": [0.4, 0.7], "lo": [0.4, 0.6], "hi": [0.4, 0.8]}
    return samples


def test_paired_asymptote_leaves_out_failed_pairs_and_says_so():
    e = paired_asymptote(_samples(), "dapo", "cispo", name="A gain")
    assert e.n == 2 and "(1 of 3 seeds left out: a fit failed)" in e.name
    assert abs(e.estimate - ((0.8 - 0.7) + (0.85 - 0.7)) / 2) < 2e-3  # seeds 0 and 1 only


def test_paired_asymptote_without_any_pair_has_no_interval():
    s = _samples()
    s["arms"]["cispo"]["sigmoid_A"] = [None, None, None]
    e = paired_asymptote(s, "dapo", "cispo", name="A gain")
    assert e.n == 0 and math.isnan(e.lo) and "3 of 3 seeds left out" in e.name


def test_fit_curves_moves_the_extras_out_of_the_arms_table():
    s = fit_curves(_samples())
    assert all(k not in a for a in s["arms"].values() for k in ("_fit", "_fit_y"))
    assert [f["reason"] is None for f in s["sigmoid_fits"]["cispo"]] == [True, True, False]
    fit = s["curves"]["cispo fit (2 of 3 seeds)"]
    assert fit["linestyle"] == "--" and fit["color"] == s["curves"]["cispo"]["color"] == "C1"
    assert fit["x"][0] == 0.0 and fit["y"][0] == 0.4  # every fitted curve starts at its R0
