"""The duplex family: hand-made timelines for each axis reward, the simulator, resume, CLI errors, a short run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from polyrl.config import ConfigError
from polyrl.families.duplex.rewards import (
    Timeline,
    backchannel_reward,
    combined_reward,
    interruption_reward,
    pause_reward,
    quality_batch,
    turn_taking_reward,
)
from polyrl.families.duplex.sim import RewardSettings, axis_metrics, make_segments, natural_agent, rewards
from polyrl.registry import PartError

torch.set_num_threads(1)


def tl(vad: str, act: str) -> Timeline:
    """'1' = user speaks; actions: '.' silent, 'S' speak, 'b' backchannel."""
    return Timeline(torch.tensor([c == "1" for c in vad]),
                    torch.tensor([{".": 0, "S": 1, "b": 2}[c] for c in act]))


# ---- pause handling -------------------------------------------------------------------------------------------
def test_pause_takeover_penalty_and_hold_bonus():
    vad = "1111100000111111"  # pause at frames [5, 10)
    assert pause_reward(tl(vad, "......SS........"), [(5, 10)]) == -1.0
    assert pause_reward(tl(vad, "................"), [(5, 10)]) == 1.0
    assert pause_reward(tl(vad, "..........SS...."), [(5, 10)]) == 1.0  # speaking after the pause is not in it
    assert pause_reward(tl(vad, ".......b........"), [(5, 10)]) == 1.0  # a backchannel does not take the floor
    assert pause_reward(tl(vad, "......S........."), [(5, 10)], takeover_penalty=-3.0) == -3.0


# ---- turn-taking ----------------------------------------------------------------------------------------------
def test_turn_taking_maximum_exactly_at_min_gap():
    vad = "1111110000000000000000"  # turn end (first silent frame) = 6
    r = {g: turn_taking_reward(tl(vad, "." * (6 + g) + "S" * (16 - g)), 6, min_gap=2, max_gap=10)
         for g in range(0, 14)}
    assert r[2] == 1.0 == max(r.values())
    assert r[0] == r[1] == -1.0  # early
    assert r[6] == pytest.approx(0.5)  # 1 - (6 - 2) / 8, hand-computed
    assert r[10] == pytest.approx(0.0)
    assert r[11] == -1.0  # late
    assert turn_taking_reward(tl(vad, "." * 22), 6) == -1.0  # no response
    # no response within a window that outlasts the timeline (turn end 15 of 20 frames): still late, not 0.625
    assert turn_taking_reward(tl("1" * 15 + "0" * 5, "." * 20), 15) == -1.0
    assert turn_taking_reward(tl(vad, "." * 22), 6, max_gap=20, late_penalty=-2.0) == -2.0
    assert turn_taking_reward(tl(vad, "..S..........SSSSSSSSS"), 6) == -1.0  # spoke over the user first


# ---- backchanneling -------------------------------------------------------------------------------------------
def test_backchannel_bonus_window_cap_and_overlap():
    vad = "1" * 30
    cues = [2, 12, 22]
    assert backchannel_reward(tl(vad, "." * 30), cues) == 0.0
    hit2 = "...b" + "." * 9 + "b" + "." * 16  # frame 3 (cue 2, in window) and 13 (cue 12)
    assert backchannel_reward(tl(vad, hit2), cues) == pytest.approx(0.6)
    late = "......b" + "." * 23  # frame 6: 4 frames after cue 2 = outside window 4 -> stray
    assert backchannel_reward(tl(vad, late), cues) == pytest.approx(-0.5)
    assert backchannel_reward(tl(vad, late), cues, window=5) == pytest.approx(0.3)
    all3 = "..b.........b.........b......."
    assert backchannel_reward(tl(vad, all3), cues, max_count=2) == pytest.approx(0.6)  # capped
    talk = "..b.....SSS...................."[:30]  # a hit plus speaking over the user
    assert backchannel_reward(tl(vad, talk), cues) == pytest.approx(0.3 - 0.5)


# ---- user interruption ----------------------------------------------------------------------------------------
def test_interruption_reward_decays_and_is_negative_past_stop_within():
    vad = "0" * 8 + "1" * 12 + "0" * 4  # barge-in at 8, user holds the floor until 20
    rs = {d: interruption_reward(tl(vad, "S" * (8 + d) + "." * (16 - d)), 8, stop_within=4, decay=0.25)
          for d in range(0, 12)}
    assert rs[0] == 1.0 and rs[1] == pytest.approx(0.75) and rs[4] == pytest.approx(0.0)
    assert all(rs[d] < 0 for d in range(5, 12))
    assert rs[11] == -1.0  # floor
    # past stop_within is negative even with a small decay (the min with -decay * (d - stop_within))
    assert interruption_reward(tl(vad, "S" * 14 + "." * 10), 8, stop_within=4, decay=0.1) == pytest.approx(-0.2)
    # stopping and resuming while the user still talks counts the resumed frames too
    assert interruption_reward(tl(vad, "S" * 9 + "...SS" + "." * 10), 8) == pytest.approx(1 - 0.25 * 3)


def test_quality_and_combined():
    a = torch.tensor([[1, 1, 1, 0, 1, 0, 0, 0], [0] * 8, [1, 0, 1, 0, 1, 0, 1, 1]])
    q = quality_batch(a, min_burst=3)
    assert q.tolist() == pytest.approx([3 / 4, 1.0, 2 / 5])  # last burst reaches the end: complete
    t = tl("1111100000111111", "......SSSS......")
    r = combined_reward("pause", t, {"pause_spans": [(5, 10)]}, quality_score=0.8, w_quality=0.5)
    assert r == pytest.approx(-1.0 + 0.4)
    assert combined_reward("pause", t, {"pause_spans": [(5, 10)]}, quality_score=None) == -1.0
    with pytest.raises(ValueError, match="axis"):
        combined_reward("nope", t, {}, quality_score=None)


# ---- simulator ------------------------------------------------------------------------------------------------
def test_batched_rewards_match_scalar_functions():
    rng = np.random.default_rng(3)
    seg = make_segments(64, 48, rng)
    acts = natural_agent(seg, rng)
    r = rewards(seg, acts, RewardSettings(w_quality=0.0))
    for i in range(64):
        t = Timeline(seg.user_vad[i], acts[i])
        ax = ["pause", "turn", "backchannel", "interrupt"][int(seg.axis[i])]
        meta = {"pause_spans": [(int(seg.pause_start[i]), int(seg.pause_end[i]))],
                "user_turn_end": int(seg.turn_end[i]), "cue_frames": torch.nonzero(seg.cues[i])[:, 0].tolist(),
                "barge_in": int(seg.barge_in[i]), "barge_end": int(seg.barge_end[i])}
        assert float(r[i]) == pytest.approx(combined_reward(ax, t, meta, quality_score=None))


def test_segments_follow_their_script():
    seg = make_segments(200, 48, np.random.default_rng(0))
    for i in range(200):
        vad = seg.user_vad[i]
        ax = int(seg.axis[i])
        if ax == 0:  # a real mid-turn pause: speech on both sides
            s, e = int(seg.pause_start[i]), int(seg.pause_end[i])
            assert not vad[s:e].any() and vad[s - 1] and vad[e] and 5 <= e - s <= 11
        elif ax == 1:
            e = int(seg.turn_end[i])
            assert vad[:e].all() and not vad[e:].any()
        elif ax == 2:
            assert vad.all() and 2 <= int(seg.cues[i].sum()) <= 3
        else:
            b = int(seg.barge_in[i])
            assert seg.forced[i, :b].all() and not seg.forced[i, b:].any() and vad[b] and not vad[:b].any()


def test_metrics_of_an_ideal_and_a_bad_agent():
    seg = make_segments(400, 48, np.random.default_rng(1))
    rs = RewardSettings()
    ideal = natural_agent(seg, np.random.default_rng(2), noise=0.0)
    m = axis_metrics(seg, ideal, rs)
    assert m["pause/takeover_rate"] == 0.0 and m["backchannel/overlap"] == 0.0
    assert m["interrupt/yield_frames"] == 1.0  # noise 0: exactly one frame after the barge-in
    bad = torch.where(seg.forced, 1, torch.ones_like(ideal))  # always speaking
    mb = axis_metrics(seg, bad, rs)
    assert mb["pause/takeover_rate"] == 1.0 and mb["backchannel/rate"] == 0.0
    assert mb["interrupt/yield_frames"] > 10 and mb["reward/mean"] < m["reward/mean"]


# ---- training, resume, CLI ------------------------------------------------------------------------------------
TINY = dict(steps=4, imitation_steps=3, imitation_batch=16, groups=4, group_size=4, frames=40, hidden=16,
            eval_segments=32, checkpoint_every=2)


def test_resume_two_plus_two_equals_four(tmp_path):
    from polyrl.families.duplex.methods import get_duplex_method
    from polyrl.families.duplex.train import DuplexTrainConfig, train_duplex

    m = get_duplex_method("grpo")
    full = train_duplex(DuplexTrainConfig(**TINY), m, run_dir=tmp_path / "a")
    train_duplex(DuplexTrainConfig(**{**TINY, "steps": 2}), m, run_dir=tmp_path / "b")
    resumed = train_duplex(DuplexTrainConfig(**TINY), m, run_dir=tmp_path / "b", resume=True)
    for p, q in zip(full["policy"].parameters(), resumed["policy"].parameters()):
        assert torch.equal(p, q)
    assert resumed["metrics_after"] == full["metrics_after"]
    rows_a = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    rows_b = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4]
    assert [r["reward/mean"] for r in rows_a] == [r["reward/mean"] for r in rows_b]
    # a different seed gives different parameters (the equality above could fail)
    other = train_duplex(DuplexTrainConfig(**{**TINY, "seed": 1}), m, run_dir=tmp_path / "c")
    assert not all(torch.equal(p, q) for p, q in zip(full["policy"].parameters(), other["policy"].parameters()))


def _cli(*args: str) -> int:
    from polyrl.cli import main

    return main(list(args))


@pytest.mark.parametrize("flags, field", [(["--group-size", "1"], "group_size"), (["--task", "chat"], "task"),
                                          (["--max-gap", "1"], "max_gap"), (["--lr", "-1"], "lr"),
                                          (["--method", "grpoo"], "grpoo"), (["--advantage", "gae"], "gae")])
def test_bad_settings_one_line(flags, field):
    from polyrl.families.duplex.cli import check_train_flags

    with pytest.raises((ConfigError, PartError)) as e:
        check_train_flags(flags)
    assert field in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("flags, field", [(["--groups", "2000"], "groups x group_size = 16000 segments"),
                                          (["--imitation-batch", "16000"], "imitation_batch = 16000"),
                                          (["--eval-segments", "400000"], "eval_segments = 400000"),
                                          (["--hidden", "256", "--groups", "500"], "at hidden 256")])
def test_sizes_past_the_machines_memory_are_refused_in_one_line(monkeypatch, flags, field):
    """With 2 GiB of memory: 8,000 segments of 48 frames train within it (1.9 GiB measured), twice that does not."""
    from polyrl.families.duplex.cli import check_train_flags

    monkeypatch.setattr("polyrl.runs.memory_bytes", lambda: 2 * 2**30)
    check_train_flags(["--groups", "1000"])  # the largest RL batch of these that fits
    with pytest.raises(ConfigError) as e:
        check_train_flags(flags)
    assert field in str(e.value) and "GiB" in str(e.value)
    assert "\n" not in str(e.value)


def test_an_evaluation_set_missing_an_axis_is_refused_for_every_seed_before_any_run(tmp_path, capsys):
    """--eval-segments 1 wrote nan for three of the four axes (bare NaN in summary.json), and `duplex report`
    then left those axes out of its table and verdict without a word. The axes are drawn at random per seed: 8
    segments cover all four for seeds 0-2 but not for seed 3, so a 4-seed report is refused before its first run."""
    from polyrl.families.duplex.cli import check_train_flags

    small = ["--steps", "1", "--imitation-steps", "1", "--groups", "2", "--group-size", "2", "--imitation-batch", "4"]
    with pytest.raises(ConfigError, match="eval_segments = 4 is not allowed: seed 0's evaluation set has no 'turn'"):
        check_train_flags(["--eval-segments", "4"])
    check_train_flags(["--eval-segments", "4", "--task", "turn"])  # one axis: every segment is a turn
    check_train_flags(["--eval-segments", "8"])
    assert _cli("duplex", "report", "--out", str(tmp_path / "rep"), "--seeds", "4", *small, "--eval-segments",
                "8") == 2
    err = capsys.readouterr().err
    assert "seed 3's evaluation set has no" in err and err.count("\n") == 1, err
    assert not (tmp_path / "rep").exists()
    assert _cli("duplex", "train", "--run-dir", str(tmp_path / "r"), *small, "--eval-segments", "8") == 0
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert all(np.isfinite(v) for v in summary["metrics_after"].values()), summary["metrics_after"]


def test_help_documents_every_field(capsys):
    from dataclasses import fields

    from polyrl.families.duplex.train import DuplexTrainConfig

    with pytest.raises(SystemExit):
        _cli("duplex", "train", "--help")
    out = capsys.readouterr().out
    for f in fields(DuplexTrainConfig):
        assert "--" + f.name.replace("_", "-") in out


def test_cli_train_and_resume_guard(tmp_path, capsys):
    run = str(tmp_path / "r")
    flags = ["--steps", "2", "--imitation-steps", "2", "--imitation-batch", "8", "--groups", "2", "--group-size",
             "2", "--frames", "40", "--hidden", "8", "--eval-segments", "16", "--run-dir", run]
    assert _cli("duplex", "train", *flags) == 0
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert set(s["metrics_after"]) >= {"pause/takeover_rate", "turn/gap_error", "backchannel/rate",
                                       "backchannel/overlap", "interrupt/yield_frames"}
    capsys.readouterr()
    assert _cli("duplex", "train", *flags, "--hidden", "9", "--resume") == 2
    err = capsys.readouterr().err
    assert "hidden" in err and err.count("\n") == 1
    assert _cli("duplex", "train", *flags[:1], "3", *flags[2:], "--resume") == 0
    rows = [json.loads(x)["step"] for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert rows == [1, 2, 3]
    # how the run is watched or where it runs may change, as marl and q allow (a bad --threads could not be mended)
    assert _cli("duplex", "train", *flags[:1], "4", *flags[2:], "--resume", "--threads", "2", "--checkpoint-every",
                "1") == 0
    history = [json.loads(x) for x in (tmp_path / "r" / "config_history.jsonl").read_text().splitlines()]
    assert history[-1]["changes"] == {"steps": [3, 4], "checkpoint_every": [20, 1], "threads": [1, 2]}, history


def test_an_imitation_run_resumes(tmp_path, capsys):
    """An imitation method has no advantage; the record wrote it as the string 'None', which the resume then passed
    back as an advantage to override with, refusing every resume of an imitation run."""
    run = tmp_path / "r"
    flags = ["--method", "imitation", "--imitation-steps", "2", "--imitation-batch", "8", "--groups", "2",
             "--frames", "40", "--hidden", "8", "--eval-segments", "16", "--run-dir", str(run)]
    assert _cli("duplex", "train", *flags, "--steps", "2") == 0
    assert json.loads((run / "config.json").read_text())["parts"] == {"kind": "imitation", "advantage": None}
    assert _cli("duplex", "train", *flags, "--steps", "3", "--resume") == 0, capsys.readouterr().err
    record = json.loads((run / "config.json").read_text())
    record["parts"]["advantage"] = "None"  # as the earlier records have it
    (run / "config.json").write_text(json.dumps(record))
    assert _cli("duplex", "train", *flags, "--steps", "4", "--resume") == 0, capsys.readouterr().err


def test_short_grpo_improves_interruption_and_pause(tmp_path):
    """A 40-step run: GRPO must cut the yield time after a barge-in and the takeover rate (spec 6 (e))."""
    from polyrl.families.duplex.methods import get_duplex_method
    from polyrl.families.duplex.train import DuplexTrainConfig, train_duplex

    cfg = DuplexTrainConfig(steps=40, imitation_steps=150, groups=16, eval_segments=256, hidden=32,
                            checkpoint_every=0)
    s = train_duplex(cfg, get_duplex_method("grpo"), run_dir=tmp_path / "g")
    b, a = s["metrics_before"], s["metrics_after"]
    assert a["interrupt/yield_frames"] < 0.5 * b["interrupt/yield_frames"]
    assert a["pause/takeover_rate"] < b["pause/takeover_rate"]
    assert s["reward_after"] > s["reward_before"] + 0.2
