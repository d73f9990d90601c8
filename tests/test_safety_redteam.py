"""AdvGRPO (`polyrl safety redteam`, spec methods-seedblog.md §10): GDPO properties with hand-computed values,
the toy game's exact metrics, the judges by import path, the alternating curriculum, and the CLI."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from polyrl.config import ConfigError
from polyrl.safety.redteam import game
from polyrl.safety.redteam.experiment import add_parser
from polyrl.safety.redteam.trainer import (
    AdversarialCoTrainer,
    CoTrainConfig,
    gdpo_advantages,
    role_method,
    summed_advantages,
    total_updates,
)

J = "polyrl.safety.redteam.judges:"
R2 = math.sqrt(2.0)


def _pairs() -> torch.Tensor:
    """Spec §10 (e) 2: two groups of G = 2 with two binary channels: (0,0) vs (1,1), and (0,0) vs (0,1)."""
    return torch.tensor([[[0.0, 0.0], [1.0, 1.0]], [[0.0, 0.0], [0.0, 1.0]]])


# --- spec §10 (e) 1-3: GDPO --------------------------------------------------------------------------------


def test_collapse_example_population_std_matches_spec():
    """Sum-then-normalise gives +-1 for both pairs; GDPO (no batch step) gives +-2 vs +-1 (population std)."""
    r = _pairs()
    summed = summed_advantages(r, eps=0.0, std="population")
    torch.testing.assert_close(summed, torch.tensor([[-1.0, 1.0], [-1.0, 1.0]], dtype=torch.float64))
    dec = gdpo_advantages(r, eps=0.0, batch_norm=False, std="population")
    torch.testing.assert_close(dec, torch.tensor([[-2.0, 2.0], [-1.0, 1.0]], dtype=torch.float64))


def test_collapse_example_registered_gdpo_hand_values():
    """The registered gdpo (Bessel std, then batch z-score): S = +-sqrt2, +-1/sqrt2; batch std sqrt(5/3)."""
    r = _pairs()
    a = gdpo_advantages(r, eps=0.0)
    big, small = R2 / math.sqrt(5 / 3), (1 / R2) / math.sqrt(5 / 3)  # 1.0954, 0.5477
    torch.testing.assert_close(a, torch.tensor([[-big, big], [-small, small]], dtype=torch.float64))
    s = summed_advantages(r, eps=0.0)  # Bessel: +-1/sqrt2 for both pairs, the distinction is gone
    torch.testing.assert_close(s[0], s[1])
    torch.testing.assert_close(s[0], torch.tensor([-1 / R2, 1 / R2], dtype=torch.float64))
    # the composed path (per-channel grpo, then batch z-score) equals the registered estimator
    torch.testing.assert_close(gdpo_advantages(r, eps=0.0, batch_norm=True, std="population"),
                               gdpo_advantages(r, eps=0.0))


def test_gdpo_affine_invariance_of_one_channel_and_summed_is_not():
    g = torch.Generator().manual_seed(0)
    r = torch.randint(0, 4, (5, 6, 3), generator=g).double()
    r[..., 2] = torch.rand(5, 6, generator=g, dtype=torch.float64) * 10
    r2 = r.clone()
    r2[..., 1] = 7.5 * r2[..., 1] - 3.0  # positive affine map of channel 1 only
    torch.testing.assert_close(gdpo_advantages(r, eps=0.0), gdpo_advantages(r2, eps=0.0))
    w = [1.0, 0.5, 2.0]
    torch.testing.assert_close(gdpo_advantages(r, w, eps=0.0), gdpo_advantages(r2, w, eps=0.0))
    assert not torch.allclose(summed_advantages(r, eps=0.0), summed_advantages(r2, eps=0.0), atol=1e-3)
    # hand counterexample for the sum: group {(0, 0), (1, 0), (0, 1)}; scaling channel 1 by 10 flips the ranking
    h = torch.tensor([[[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]]])
    assert summed_advantages(h)[0, 1] == pytest.approx(summed_advantages(h)[0, 2])
    h10 = h.clone()
    h10[..., 1] *= 10
    s10 = summed_advantages(h10, eps=0.0)[0]  # sums 0, 1, 10: mean 11/3, std sqrt(273)/3
    sd = math.sqrt(((0 - 11 / 3) ** 2 + (1 - 11 / 3) ** 2 + (10 - 11 / 3) ** 2) / 2)
    torch.testing.assert_close(s10, torch.tensor([-11 / 3, -8 / 3, 19 / 3], dtype=torch.float64) / sd)
    assert gdpo_advantages(h10, eps=0.0)[0, 1] == pytest.approx(gdpo_advantages(h10, eps=0.0)[0, 2])


def test_gdpo_one_channel_is_grpo_then_batch_standardisation():
    g = torch.Generator().manual_seed(1)
    r = torch.rand(4, 5, 1, generator=g, dtype=torch.float64)
    grpo = summed_advantages(r, eps=0.0).reshape(-1)
    expect = (grpo - grpo.mean()) / grpo.std()
    torch.testing.assert_close(gdpo_advantages(r, eps=0.0).reshape(-1), expect)


def test_role_method_uses_registered_estimators():
    assert role_method("gdpo", [4.0, 1.0]).advantage.name == "gdpo"
    assert role_method("gdpo", [4.0, 1.0]).advantage.params["weights"] == "4.0;1.0"
    assert role_method("summed", [4.0, 1.0]).advantage.name == "grpo"
    assert role_method("summed", [1.0]).trust_region.name == "clip"


# --- the toy game and its judges --------------------------------------------------------------------------


def test_judges_hand_values():
    from polyrl.safety.redteam import judges

    tr = ["roleplay/light->refuse; direct/none->comply", "encoded/heavy->safe_complete"]
    assert judges.attack_success([], tr, []) == [1.0, 0.0]
    assert judges.prompt_quality([], tr, []) == [(6.0 + 9.0) / 2, 1.0]  # encoded 2 - 3 clipped to 1
    assert judges.prompt_quality_unit([], tr, []) == [(7.5 - 1) / 9, 0.0]
    assert judges.safety([], ["comply", "comply", "refuse"], ["harmful", "benign", "harmful"]) == [0.0, 1.0, 1.0]
    assert judges.helpfulness([], ["comply", "safe_complete", "refuse"], []) == [10.0, 6.0, 1.0]


def test_exact_asr_matches_monte_carlo():
    torch.manual_seed(0)
    a, d = game.AttackerPolicy(), game.DefenderPolicy()
    with torch.no_grad():
        a.style_logits.normal_()
        a.obf_logits.normal_()
        d.logits.normal_()
    gen = torch.Generator().manual_seed(3)
    for turns in (1, 2):
        ep = game.sample_episodes(a, d, 40000, turns, gen)
        mc = float(((ep.reply == game.COMPLY) & (ep.sent > 0)).any(1).float().mean())
        assert mc == pytest.approx(game.exact_asr(a, d, turns), abs=0.015)
    # the second message is sent exactly when the first was not complied with
    assert torch.equal(ep.sent[:, 1] > 0, ep.reply[:, 0] != game.COMPLY)


def test_exact_benign_hand_value():
    d = game.DefenderPolicy(prior=0.0)  # uniform replies: mean Likert (10 + 6 + 1) / 3, refusal 1/3
    help_score, refusal = game.exact_benign(d, (10.0, 6.0, 1.0))
    assert help_score == pytest.approx(17 / 3)
    assert refusal == pytest.approx(1 / 3)


# --- the co-trainer ------------------------------------------------------------------------------------------


def _trainer(estimator: str, steps: dict[str, int], unit: bool = False, seed: int = 0) -> AdversarialCoTrainer:
    cfg = CoTrainConfig(steps=steps, attacker_groups=8, defender_prompts=16)
    hp = "helpfulness_unit" if unit else "helpfulness"
    return AdversarialCoTrainer(game.AttackerPolicy(), game.DefenderPolicy(),
                                attacker_channels=[J + "attack_success", J + "prompt_quality"],
                                defender_channels=[J + "safety", J + hp], attacker_weights=[4, 1],
                                defender_weights=[2, 1], estimator=estimator, config=cfg, seed=seed)


def test_curriculum_order_and_alternation():
    steps = {"single_turn": 2, "multi_turn": 2, "co_train": 3}
    tr = _trainer("gdpo", steps)
    seen = []
    tr.attacker_step = lambda turns, f=tr.attacker_step: (seen.append(("attacker", turns)), f(turns))[1]
    tr.defender_step = lambda turns, f=tr.defender_step: (seen.append(("defender", turns)), f(turns))[1]
    before = tr.defender.logits.detach().clone()
    hist = tr.run()
    assert seen == [("attacker", 1)] * 2 + [("attacker", 2)] * 2 + [("attacker", 2), ("defender", 2)] * 3
    assert [h["phase"] for h in hist] == ["init"] + ["single_turn"] * 2 + ["multi_turn"] * 2 + ["co_train"] * 6
    assert len(hist) == 1 + total_updates(tr.cfg)
    assert not torch.equal(before, tr.defender.logits.detach())


def test_attacker_phases_leave_the_defender_frozen():
    tr = _trainer("gdpo", {"single_turn": 3, "multi_turn": 3, "co_train": 0})
    d0, a0 = tr.defender.logits.detach().clone(), tr.attacker.style_logits.detach().clone()
    tr.run()
    assert torch.equal(d0, tr.defender.logits.detach())
    assert not torch.equal(a0, tr.attacker.style_logits.detach())


def test_bad_channel_import_path_is_a_clear_error():
    with pytest.raises(ValueError, match="no_such_judge"):
        AdversarialCoTrainer(game.AttackerPolicy(), game.DefenderPolicy(),
                             attacker_channels=[J + "no_such_judge"], defender_channels=[J + "safety"])


def _harmful_cued_comply(estimator: str, unit: bool) -> float:
    """P(comply | direct style, harm cue) after defender-only training against a fixed direct-style attacker."""
    tr = _trainer(estimator, {}, unit=unit)
    with torch.no_grad():
        tr.attacker.style_logits[:, 0] = 8.0  # attacker always 'direct', no obfuscation
        tr.attacker.obf_logits[:, :, 0] = 8.0
    for _ in range(25):
        tr.defender_step(1)
    return float(tr.defender.probs()[0, 1, game.COMPLY])


def test_defender_summed_native_scale_learns_to_comply_gdpo_does_not():
    """Safety (binary, weight 2) + helpfulness (Likert 1..10): summed R(comply) = 10 > R(safe) = 8, so the summed
    defender complies with cued attacks; GDPO's per-channel z-scores (and the summed reward on [0, 1] scales)
    prefer the safe reply."""
    assert _harmful_cued_comply("summed", unit=False) > 0.5
    assert _harmful_cued_comply("gdpo", unit=False) < 0.05
    assert _harmful_cued_comply("summed", unit=True) < 0.05


# --- the command ----------------------------------------------------------------------------------------------


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_parser(ap.add_subparsers(dest="tool"), "redteam")
    return ap.parse_args(["redteam", *argv])


@pytest.mark.parametrize("argv, match", [(["--seeds", "0"], "--seeds"), (["--lr", "-1"], "--lr"),
                                         (["--attacker-weights", "1,x"], "--attacker-weights"),
                                         (["--defender-weights", "1"], "--defender-weights")])
def test_bad_values_raise_config_error(argv, match, tmp_path):
    args = _parse([*argv, "--out", str(tmp_path)])
    with pytest.raises(ConfigError, match=match):
        args.fn(args)


def test_command_writes_report_and_results(tmp_path):
    args = _parse(["--seeds", "2", "--single-turn-steps", "2", "--multi-turn-steps", "2", "--co-train-steps", "4",
                   "--no-control", "--out", str(tmp_path)])
    assert args.fn(args) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["variants"] == ["summed", "decoupled"]
    assert len(res["per_seed"]["decoupled"]) == 2
    assert len(res["curves"]["summed"][0]) == 1 + 2 + 2 + 8
    d = res["decoupled_minus_summed"]["asr_multi"]
    assert d["lo"] <= d["mean"] <= d["hi"]
    page = (tmp_path / "report.html").read_text()
    assert "data:image/png;base64," in page and "Verdict" in page


def test_the_rescaled_control_runs_only_when_a_channel_has_a_rescaled_variant(tmp_path):
    """With no 1..10 judge among the channels the "[0, 1]-scaled" control was the summed run again, reported as a
    control and costing a third of the run."""
    j = "polyrl.safety.redteam.judges:"
    small = ["--seeds", "1", "--single-turn-steps", "1", "--multi-turn-steps", "1", "--co-train-steps", "2"]
    for channels, variants in (([f"{j}attack_success", f"{j}safety"], ["summed", "decoupled"]),
                               ([f"{j}attack_success", f"{j}helpfulness"], ["summed", "decoupled", "summed-unit"])):
        out = tmp_path / str(len(variants))
        args = _parse([*small, "--attacker-channels", channels[0], "--attacker-weights", "1",
                       "--defender-channels", channels[1], "--defender-weights", "1", "--out", str(out)])
        assert args.fn(args) == 0
        assert json.loads((out / "results.json").read_text())["variants"] == variants
        assert ("Control not run: no channel is a 1..10 judge" in (out / "report.html").read_text()) == (
            len(variants) == 2)
