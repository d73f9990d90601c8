"""`polyrl duplex train | report` from the command line: every setting changes what runs or is refused in one line,
a diverging run stops in one line, and a report or a resume never mixes runs trained with other settings."""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest

from polyrl.config import ConfigError
from tests.helpers import cli, one_line, step_rows

# the smallest run: one cloning step, tiny groups, a 16-segment evaluation (well under a second)
TINY = ["--imitation-steps", "1", "--imitation-batch", "8", "--groups", "2", "--group-size", "2", "--frames", "40",
        "--hidden", "8", "--eval-segments", "16"]


# ---- report ---------------------------------------------------------------------------------------------------
def test_report_reuses_a_finished_run_only_with_the_same_settings(tmp_path, capsys):
    out, summary = str(tmp_path / "rep"), tmp_path / "rep" / "grpo" / "seed0" / "summary.json"
    rep = ["duplex", "report", "--seeds", "1", *TINY, "--out", out]
    assert cli(capsys, *rep, "--steps", "1")[0] == 0
    first = summary.read_text()
    code, err = cli(capsys, *rep, "--steps", "3", "--lr", "0.5")
    assert code == 2
    one_line(err, "steps = 1, not 3", "--overwrite")
    assert summary.read_text() == first  # nothing retrained, nothing reported
    assert cli(capsys, *rep, "--steps", "3", "--lr", "0.5", "--overwrite")[0] == 0
    s = json.loads(summary.read_text())
    assert s["steps"] == 3 and s["config"]["lr"] == 0.5
    assert json.loads((tmp_path / "rep" / "results.json").read_text())["config"]["steps"] == 3


def test_a_watching_setting_is_refused_when_every_run_is_reused(tmp_path, capsys):
    """`duplex report --tensorboard` over finished runs printed its report and recorded tensorboard: true in
    results.json, but nothing trained, so no event file was written. It applies when a run is left to train."""
    out = tmp_path / "rep"
    rep = ["duplex", "report", "--seeds", "2", *TINY, "--steps", "1", "--out", str(out)]
    assert cli(capsys, *rep)[0] == 0
    results = (out / "results.json").read_text()
    for flag in (["--tensorboard"], ["--threads", "2"]):
        code, err = cli(capsys, *rep, *flag)
        assert code == 2
        one_line(err, f"{flag[0][2:]} = ", "changes nothing here: every run in", "--overwrite")
    assert (out / "results.json").read_text() == results
    shutil.rmtree(out / "grpo" / "seed1")
    assert cli(capsys, *rep, "--tensorboard")[0] == 0  # one run trains again, and writes its event files
    assert (out / "grpo" / "seed1" / "tb").is_dir() and not (out / "grpo" / "seed0" / "tb").exists()


def test_stale_setting_names_the_first_difference_and_ignores_run_control():
    from dataclasses import asdict, replace

    from polyrl.families.duplex.report import stale_setting
    from polyrl.families.duplex.train import DuplexTrainConfig

    cfg = DuplexTrainConfig(steps=1)
    saved = {"config": asdict(cfg)}
    assert stale_setting(saved, replace(cfg, threads=2, tensorboard=True, checkpoint_every=5)) is None
    assert stale_setting(saved, replace(cfg, steps=3, lr=0.5)) == "steps = 1, not 3"
    assert stale_setting({}, cfg).startswith("config = unknown")


def test_report_offers_no_seed_and_refuses_one(tmp_path, capsys):
    from polyrl.cli import main

    with pytest.raises(SystemExit):
        main(["duplex", "report", "--help"])
    assert not re.search(r"--seed(?![s\w])", capsys.readouterr().out)
    code, err = cli(capsys, "duplex", "report", "--seed", "9", "--out", str(tmp_path / "r"))
    assert code == 2
    one_line(err, "seed = 9", "--seeds")
    (tmp_path / "c.toml").write_text("seed = 3\n")
    code, err = cli(capsys, "duplex", "report", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "r"))
    assert code == 2
    one_line(err, "seed = 3")
    assert not (tmp_path / "r").exists()
    # `duplex train` refuses another axis's setting on a single-axis task; the report ran with it unread
    code, err = cli(capsys, "duplex", "report", "--task", "pause", "--max-gap", "50", "--out", str(tmp_path / "r"))
    assert code == 2
    one_line(err, "max_gap = 50 does not apply to task 'pause'")
    assert not (tmp_path / "r").exists()


def test_report_on_a_single_axis_task_leaves_out_the_other_axes(tmp_path, capsys):
    assert cli(capsys, "duplex", "report", "--seeds", "1", "--steps", "1", "--task", "pause", *TINY,
                "--out", str(tmp_path))[0] == 0
    res = json.loads((tmp_path / "results.json").read_text())  # strict JSON: no NaN left in it
    assert list(res["metrics"]) == ["pause/takeover_rate"]
    assert (tmp_path / "metrics.png").is_file() and (tmp_path / "report.html").is_file()


def test_analyse_reports_a_metric_with_no_values_as_n_a():
    from polyrl.families.duplex.report import _fmt, analyse

    nan = math.nan
    m = {"pause/takeover_rate": 0.5, "turn/gap_error": nan, "backchannel/rate": nan, "backchannel/overlap": nan,
         "interrupt/yield_frames": nan}
    after = {**m, "backchannel/rate": 0.1}  # values after, none before: still no crash
    s = {"metrics_before": m, "metrics_after": after, "natural_agent": m}
    rows = analyse({"imitation": [s], "grpo": [s]})
    assert list(rows) == ["pause/takeover_rate"] and _fmt(rows["pause/takeover_rate"]["grpo"]) == "0.500 [0.500, 0.500]"
    from polyrl.families.duplex.report import _ci

    assert _fmt(_ci([nan, nan], 0.9)) == "n/a"


# ---- train: divergence, settings the method does not read --------------------------------------------------------
def test_diverging_run_stops_inone_line(tmp_path, capsys):
    run = tmp_path / "r"
    code, err = cli(capsys, "duplex", "train", "--steps", "3", *TINY, "--lr", "1e30", "--run-dir", str(run))
    assert code == 1
    one_line(err, "training stopped: non-finite", "lower --lr (1e+30) or --kl-coef (0)")  # each with its value
    assert not run.exists()  # it logged no row: nothing kept, so the corrected command needs no --overwrite


@pytest.mark.parametrize("flag, value, field", [("--lr", "9", "lr"), ("--clip-eps", "0.9", "clip_eps"),
                                                ("--kl-coef", "5", "kl_coef"),
                                                ("--updates-per-batch", "7", "updates_per_batch"),
                                                ("--group-size", "99", "group_size")])
def test_rl_only_setting_with_imitation_is_refused(flag, value, field):
    from polyrl.families.duplex.cli import check_train_flags

    with pytest.raises(ConfigError) as e:
        check_train_flags(["--method", "imitation", flag, value])
    assert str(e.value).startswith(f"{field} = ") and "imitation" in str(e.value) and "\n" not in str(e.value)
    check_train_flags(["--method", "grpo", flag, value])  # an RL method reads it


def test_imitation_accepts_the_settings_it_reads(tmp_path, capsys):
    from polyrl.families.duplex.cli import check_train_flags

    check_train_flags(["--method", "imitation", "--imitation-lr", "0.01", "--max-grad-norm", "0.5", "--groups", "3"])
    (tmp_path / "c.toml").write_text("lr = 0.5\n")  # a TOML key is given as much as a flag
    code, err = cli(capsys, "duplex", "train", "--method", "imitation", "--config", str(tmp_path / "c.toml"),
                     "--run-dir", str(tmp_path / "r"))
    assert code == 2
    one_line(err, "lr = 0.5", "imitation")
    assert not (tmp_path / "r").exists()


# ---- resume ----------------------------------------------------------------------------------------------------
def test_resume_keeps_method_and_advantage(tmp_path, capsys):
    run = tmp_path / "r"
    assert cli(capsys, "duplex", "train", "--steps", "1", *TINY, "--run-dir", str(run))[0] == 0
    record, summary = (run / "config.json").read_text(), (run / "summary.json").read_text()
    for flags, field in ((["--advantage", "rloo"], "advantage"), (["--method", "rloo"], "method"),
                         (["--hidden", "9"], "hidden")):
        code, err = cli(capsys, "duplex", "train", "--steps", "2", *TINY, *flags, "--run-dir", str(run), "--resume")
        assert code == 2
        one_line(err, f"{field} = ", "differs")
    # it said "advantage ... does not apply (imitation only)": the run's advantage was put on the new preset first
    code, err = cli(capsys, "duplex", "train", "--method", "imitation", "--run-dir", str(run), "--resume")
    assert code == 2
    one_line(err, "method = 'imitation' differs from the run's own method = 'grpo'")
    assert (run / "config.json").read_text() == record and (run / "summary.json").read_text() == summary
    # without flags a resume continues with the run's own settings (not the defaults)
    assert cli(capsys, "duplex", "train", "--steps", "2", "--run-dir", str(run), "--resume")[0] == 0
    assert step_rows(run) == [1, 2] and json.loads((run / "summary.json").read_text())["config"]["hidden"] == 8


def test_resume_keeps_an_advantage_given_at_the_start(tmp_path, capsys):
    """A run started with --advantage rloo resumes as rloo without the flag (its saved part, re-read)."""
    run = tmp_path / "r"
    assert cli(capsys, "duplex", "train", "--steps", "1", *TINY, "--advantage", "rloo", "--run-dir", str(run))[0] == 0
    assert cli(capsys, "duplex", "train", "--steps", "2", "--run-dir", str(run), "--resume")[0] == 0
    assert step_rows(run) == [1, 2] and json.loads((run / "config.json").read_text())["parts"]["advantage"] == "rloo"


def test_a_part_written_by_str_reads_back():
    """``str(Part)`` quotes string parameters (std='sample'); parse_part takes them back (a resume re-reads it)."""
    from polyrl.registry import ADVANTAGES, resolve_part

    part = ADVANTAGES.resolve("grpo", {"std": "population"})
    assert resolve_part(ADVANTAGES, str(part)) == part


def test_resume_refuses_fewer_steps_than_done(tmp_path, capsys):
    run = tmp_path / "r"
    assert cli(capsys, "duplex", "train", "--steps", "3", *TINY, "--run-dir", str(run))[0] == 0
    code, err = cli(capsys, "duplex", "train", "--steps", "1", *TINY, "--run-dir", str(run), "--resume")
    assert code == 2
    one_line(err, "steps = 1", ">= 3")
    assert step_rows(run) == [1, 2, 3] and json.loads((run / "summary.json").read_text())["steps"] == 3


def test_resume_remembers_an_extension_and_recovers_a_killed_overwrite(tmp_path, capsys):
    """A run extended with --resume --steps 2 was refused on its next plain --resume ("steps = 1 ... >= 2": the
    record's stale value, never given); and --resume read the new settings a killed --overwrite had left, not the
    old run it had set aside."""
    from polyrl.runs import aside_path

    run = tmp_path / "r"
    assert cli(capsys, "duplex", "train", "--steps", "1", *TINY, "--run-dir", str(run))[0] == 0
    assert cli(capsys, "duplex", "train", "--steps", "2", "--run-dir", str(run), "--resume")[0] == 0
    assert cli(capsys, "duplex", "train", "--run-dir", str(run), "--resume")[0] == 0
    assert step_rows(run) == [1, 2]
    history = [json.loads(line) for line in (run / "config_history.jsonl").read_text().splitlines()]
    assert [h["changes"] for h in history] == [{"steps": [1, 2]}, {}]
    code, err = cli(capsys, "duplex", "train", "--steps", "1", "--run-dir", str(run), "--resume")
    assert code == 2
    one_line(err, "steps = 1", ">= 2")
    run.rename(aside_path(run))  # as a SIGKILL of `--overwrite` before its new run started leaves it ...
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"config": {"steps": 5, "hidden": 99}, "method": "grpo"}))
    code, err = cli(capsys, "duplex", "train", "--steps", "3", "--run-dir", str(run), "--resume")
    assert code == 0 and "put back the run" in err, err  # ... and the resume continues the old run
    assert step_rows(run) == [1, 2, 3] and json.loads((run / "summary.json").read_text())["config"]["hidden"] == 8


@pytest.mark.parametrize("flags, words", [
    (["--task", "pause", "--decay", "0.9"], ["decay = 0.9", "task 'pause'", "'interrupt' axis"]),
    (["--task", "interrupt", "--max-gap", "30"], ["max_gap = 30", "'turn' axis"]),
    (["--imitation-steps", "0", "--imitation-lr", "1000"], ["imitation_lr = 1000.0", "imitation_steps = 0"]),
])
def test_settings_a_run_never_reads_are_refused(tmp_path, capsys, flags, words):
    """A single-axis task never scores another axis's reward settings, and no imitation phase reads imitation_lr:
    both ran to the same metrics as without them."""
    tiny = [t for t in TINY if t not in ("--imitation-steps", "1")]
    code, err = cli(capsys, "duplex", "train", "--steps", "1", *tiny, *flags, "--run-dir", str(tmp_path / "r"))
    assert code == 2 and not (tmp_path / "r").exists()
    one_line(err, *words, "does not apply")
    assert cli(capsys, "duplex", "train", "--steps", "1", *TINY, "--task", "interrupt", "--decay", "0.3",
               "--run-dir", str(tmp_path / "ok"))[0] == 0


def test_one_seed_improves_nothing_and_two_agreeing_seeds_do():
    """`duplex report --seeds 1` said GRPO "improved" a metric from one paired difference, whose bootstrap
    'interval' is the point [d, d]."""
    from polyrl.families.duplex.report import analyse
    from polyrl.families.duplex.sim import METRIC_SIGN

    def run(shift: float) -> dict:
        before = {m: 1.0 for m in METRIC_SIGN}
        return {"metrics_before": before, "natural_agent": before,
                "metrics_after": {m: 1.0 + shift * sign for m, sign in METRIC_SIGN.items()}}

    one = analyse({"grpo": [run(0.5)], "imitation": [run(0.0)]})
    assert not any(r["improved"] or r["improved_vs_imitation"] for r in one.values())
    two = analyse({"grpo": [run(0.5), run(0.4)], "imitation": [run(0.0), run(0.1)]})
    assert all(r["improved"] and r["improved_vs_imitation"] for r in two.values())
    mixed = analyse({"grpo": [run(0.5), run(-0.4)], "imitation": [run(0.0), run(0.0)]})
    assert not any(r["improved"] for r in mixed.values())
