"""pass@k (polyrl/lab/passk.py) and the two evidence claims that use it or were fixed with it (issue 22)."""

from __future__ import annotations

import json
import math

import pytest

from polyrl.lab.analysis import Run
from polyrl.lab.claim_types import Budget
from polyrl.lab.claims import CLAIMS, _agency_arms, _worst_after_start
from polyrl.lab.evidence import run_evidence
from polyrl.lab.passk import pass_at_k, pass_at_k_curve


def test_pass_at_k_hand_computed():
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(16, 3, 8) == pytest.approx(1 - 1287 / 12870)  # 1 - C(13,8)/C(16,8) = 0.9
    assert pass_at_k(4, 0, 2) == 0.0  # no success among the samples
    assert pass_at_k(4, 3, 2) == 1.0  # n - c = 1 < k: every pair holds a success
    assert pass_at_k(10, 7, 1) == pytest.approx(0.7)  # k = 1: the plain success rate c / n


def test_pass_at_k_matches_the_binomial_form_and_is_monotone_in_k():
    for n in (1, 4, 9, 16):
        for c in range(n + 1):
            values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
            for k, v in enumerate(values, start=1):
                assert v == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)
            assert all(b >= a - 1e-12 for a, b in zip(values, values[1:])), (n, c)


def test_pass_at_k_curve_averages_over_prompts_and_refuses_bad_input():
    assert pass_at_k_curve([0, 4, 1], 4, (1, 2)) == pytest.approx({1: (0 + 1 + 0.25) / 3, 2: (0 + 1 + 0.5) / 3})
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="at least one prompt"):
        pass_at_k_curve([], 4, (1,))


def test_agency_hand_over_completes_within_the_run():
    for budget, steps in ((Budget(3, 100), 67), (Budget(2, 15), 10)):
        flags = _agency_arms(budget)["agency"][1]
        assert flags[flags.index("--agency-schedule") + 1] == f"linear:steps={steps}"
        assert steps < budget.steps
    assert "linear:steps=67" in CLAIMS["agency_never_worse"].setup


def test_worst_after_start_leaves_out_step_zero():
    rows = [{"step": 0, "eval/accuracy": 0.4, "eval/learner_accuracy": 0.4},
            {"step": 5, "eval/accuracy": 0.42, "eval/learner_accuracy": 0.5},
            {"step": 10, "eval/accuracy": 0.45, "eval/learner_accuracy": 0.47}]
    worst = _worst_after_start(Run("grpo", 0, rows))
    assert worst == pytest.approx({"worst_accuracy_after_start": 0.42, "worst_learner_accuracy_after_start": 0.47})
    plain = _worst_after_start(Run("grpo", 0, [{"step": 0, "eval/accuracy": 0.4}, {"step": 5, "eval/accuracy": 0.3}]))
    assert plain["worst_accuracy_after_start"] == pytest.approx(0.3)
    assert math.isnan(plain["worst_learner_accuracy_after_start"])


def test_maxrl_passk_end_to_end_micro(tmp_path, monkeypatch):
    monkeypatch.setattr("polyrl.runs.cores", lambda: 1)  # its runs take one thread each: `make test` runs two workers
    res = run_evidence(["maxrl_passk"], Budget(1, 2), workers=1, out=tmp_path, registry=CLAIMS)
    c = res["claims"]["maxrl_passk"]
    for arm in ("grpo", "maxrl"):
        a = c["samples"]["arms"][arm]
        curve = [a[f"pass@{k}"][0] for k in (1, 2, 4, 8)]
        assert all(0.0 <= v <= 1.0 for v in curve) and curve == sorted(curve)
        assert c["samples"]["curves"][arm]["x"] == [1.0, 2.0, 4.0, 8.0]
    assert c["decision"]["effects"][0]["name"].startswith("pass@8 gain of MaxRL")
    cache = next((tmp_path / "runs").glob("maxrl-*/seed0/passk_n16_p8.json"))
    saved = json.loads(cache.read_text())
    assert len(saved["counts"]) == 8 and all(0 <= x <= 16 for x in saved["counts"])
    assert saved["checkpoint"] == "step_000002"  # the final checkpoint
