"""The family/safety evidence claims: complete text fields, valid budgets, decide() on hand-made samples."""

from __future__ import annotations

from pathlib import Path

import pytest

from polyrl.lab.claims_families import FAMILY_CLAIMS

SEEDS = Path("/work/shared/seeds")
BY_ID = {c.id: c for c in FAMILY_CLAIMS}


def test_ids_unique_and_complete():
    assert len(BY_ID) == len(FAMILY_CLAIMS) == 6
    assert set(BY_ID) == {"flow_dppo_epochs", "grpo_guard_ratio", "one_shot_onset", "ggro_vs_bon", "safe_rule",
                          "lambda_target"}


@pytest.mark.parametrize("claim", FAMILY_CLAIMS, ids=lambda c: c.id)
def test_text_fields_and_budgets(claim):
    for field in ("id", "title", "seed_text", "seed_source", "corrected", "setup", "limits"):
        assert getattr(claim, field).strip(), field
    assert claim.seed_source.startswith("seeds/") and claim.seed_source.endswith(".txt")
    for b in (claim.quick, claim.full):
        assert b.seeds >= 1 and b.steps >= 1
    assert claim.full.seeds >= claim.quick.seeds and claim.full.steps >= claim.quick.steps
    if getattr(claim, "stability", claim.id in ("flow_dppo_epochs", "lambda_target")):
        assert claim.full.seeds >= 5


@pytest.mark.skipif(not SEEDS.is_dir(), reason="seed documents not on this machine")
@pytest.mark.parametrize("claim", FAMILY_CLAIMS, ids=lambda c: c.id)
def test_seed_text_is_verbatim(claim):
    text = (SEEDS / Path(claim.seed_source).name).read_text()
    assert claim.seed_text in text


def _flow(grpo8, dppo8):
    arms = {f"{m}@{u}": {"collapsed": [0.0] * 5, "reward_gain": [0.5] * 5}
            for m in ("flow_grpo", "flow_dppo") for u in (1, 2, 4, 8)}
    arms["flow_grpo@8"]["collapsed"] = grpo8
    arms["flow_dppo@8"]["collapsed"] = dppo8
    return {"arms": arms}


def test_flow_dppo_decide():
    # 5/5 vs 0/5: Wilson bounds at z=1.645 are 5/(5+z^2)=0.649 and z^2/(5+z^2)=0.351, so
    # lo = 1 - sqrt(0.351^2 + 0.351^2) = 0.504 > 0 -> holds.
    d = BY_ID["flow_dppo_epochs"].decide(_flow([1.0] * 5, [0.0] * 5))
    assert d.verdict == "holds"
    assert d.effects[0].estimate == pytest.approx(1.0)
    assert d.effects[0].lo == pytest.approx(0.504, abs=0.01)
    assert d.numbers["collapses flow_grpo@8"] == "5/5"
    # 0/5 vs 0/5: no difference, interval around 0 -> inconclusive.
    assert BY_ID["flow_dppo_epochs"].decide(_flow([0.0] * 5, [0.0] * 5)).verdict == "inconclusive"
    # The opposite: 0/5 vs 5/5 -> does not hold.
    assert BY_ID["flow_dppo_epochs"].decide(_flow([0.0] * 5, [1.0] * 5)).verdict == "does not hold at this scale"


def test_grpo_guard_decide():
    s = {"arms": {"flow_grpo": {"ratio_mean": [0.99, 0.988, 0.989], "ratio_shift": [0.01, 0.012, 0.011]},
                  "grpo_guard": {"ratio_mean": [1.001, 0.998, 1.001], "ratio_shift": [0.001, 0.002, 0.001]}}}
    d = BY_ID["grpo_guard_ratio"].decide(s)
    assert d.verdict == "holds"
    assert d.effects[0].estimate == pytest.approx((0.009 + 0.010 + 0.010) / 3)
    s["arms"]["grpo_guard"]["ratio_shift"] = [0.02, 0.03, 0.025]  # Guard shifted more: the opposite
    assert BY_ID["grpo_guard_ratio"].decide(s).verdict == "does not hold at this scale"


def test_one_shot_decide():
    s = {"arms": {"p0=0.2": {"onset_step": [5.0, 6.0, 4.0]}, "p0=0.05": {"onset_step": [12.0, 14.0, 13.0]}}}
    d = BY_ID["one_shot_onset"].decide(s)
    assert d.verdict == "does not hold at this scale"  # 1 - onset = -12 on average, interval below 0
    assert d.effects[0].estimate == pytest.approx(-12.0)
    assert d.numbers["mean onset p0=0.2"] == pytest.approx(5.0)


def test_ggro_decide():
    s = {"arms": {"best_of_16": {"proxy": [1.0, 2.0, 3.0]},
                  "ggro": {"proxy": [2.0, 3.5, 4.0], "cost_ratio_vs_bon16": [0.05, 0.05, 0.05]}}}
    assert BY_ID["ggro_vs_bon"].decide(s).verdict == "holds"  # beats by 1.17 > 0 and 0.11 - 0.05 = 0.06 > 0
    s["arms"]["ggro"]["cost_ratio_vs_bon16"] = [0.4, 0.45, 0.5]
    d = BY_ID["ggro_vs_bon"].decide(s)
    assert d.verdict == "does not hold at this scale"  # the compute part: 0.11 - 0.45 < 0 limits the claim
    assert d.effects[0].estimate == pytest.approx(0.11 - 0.45)
    assert len(d.effects) == 2


def test_safe_rule_decide():
    u = {"shortcut_removed_pct": [95.0, 96.0, 97.0, 95.0, 96.0], "return_loss_pct": [0.5, 0.6, 0.4, 0.5, 0.6]}
    assert BY_ID["safe_rule"].decide({"arms": {"unlearned": u}}).verdict == "holds"
    u = {"shortcut_removed_pct": [50.0, 55.0, 52.0], "return_loss_pct": [0.5, 0.6, 0.4]}
    assert BY_ID["safe_rule"].decide({"arms": {"unlearned": u}}).verdict == "holds partly"  # real, below 92
    u = {"shortcut_removed_pct": [95.0, 96.0, 97.0], "return_loss_pct": [20.0, 18.0, 19.0]}
    d = BY_ID["safe_rule"].decide({"arms": {"unlearned": u}})
    assert d.verdict == "does not hold at this scale"  # 1.1 - 19 < 0
    assert d.effects[0].estimate == pytest.approx(1.1 - 19.0)


def test_lambda_target_decide():
    s = {"arms": {"every_step": {"diverged": [1.0] * 5, "reward_final": [0.0] * 5},
                  "lambda_geometric": {"diverged": [0.0] * 5, "reward_final": [0.1, 0.2, 0.1, 0.3, 0.2]}}}
    assert BY_ID["lambda_target"].decide(s).verdict == "holds"


def test_lambda_target_quick_run(tmp_path):
    claim = BY_ID["lambda_target"]
    samples = claim.run(claim.quick, tmp_path, 1)
    arms = samples["arms"]
    assert len(arms["every_step"]["diverged"]) == claim.quick.seeds
    assert all(v in (0.0, 1.0) for v in arms["every_step"]["diverged"] + arms["lambda_geometric"]["diverged"])
    assert samples["wall_seconds"] > 0
    # Resume: a second call reuses the summaries and gives the same numbers.
    assert claim.run(claim.quick, tmp_path, 1)["arms"] == arms
    assert claim.decide(samples).verdict in ("holds", "holds partly", "does not hold at this scale", "inconclusive")
