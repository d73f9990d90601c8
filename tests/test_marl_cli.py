"""`polyrl marl train | report` from the command line: bad options fail in one line before anything trains, a
diverging run stops in one line, a report or a resume never mixes runs trained with other settings, and every
PPO pass takes exactly --minibatches optimizer steps."""

from __future__ import annotations

import json
import re

import pytest
import torch

from polyrl.config import ConfigError
from tests.helpers import cli, one_line, step_rows

# the smallest run: 4 episodes of 6 steps, one pass of 2 minibatches, a 4-episode evaluation every step
TINY = ["--envs", "4", "--horizon", "6", "--hidden", "16", "--eval-every", "1", "--eval-episodes", "4",
        "--minibatches", "2", "--epochs", "1"]


# ---- report ---------------------------------------------------------------------------------------------------
def test_report_reuses_a_finished_run_only_with_the_same_settings(tmp_path, capsys):
    out, summary = str(tmp_path / "rep"), tmp_path / "rep" / "mappo" / "seed0" / "summary.json"
    rep = ["marl", "report", "--seeds", "1", "--methods", "mappo", *TINY, "--out", out]
    assert cli(capsys, *rep, "--steps", "1")[0] == 0
    first = summary.read_text()
    code, err = cli(capsys, *rep, "--steps", "2", "--lr", "0.5")
    assert code == 2
    one_line(err, "steps = 1, not 2", "--overwrite")
    assert summary.read_text() == first
    assert cli(capsys, *rep, "--steps", "2", "--lr", "0.5", "--overwrite")[0] == 0
    s = json.loads(summary.read_text())
    assert s["steps"] == 2 and s["config"]["lr"] == 0.5


def test_report_prints_a_line_per_run_and_gives_one_seed_no_interval(tmp_path, capsys):
    """Each run's whole step table was printed at its end (six 150-row tables at the defaults), nothing while it
    trained; with one seed the MAPPO - IPPO difference was shown as an interval [d, d] without the caveat."""
    from polyrl.cli import main

    out = tmp_path / "rep"
    assert main(["marl", "report", "--seeds", "1", *TINY, "--steps", "3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "mappo seed 0: held-out success" in printed and "ippo seed 0: held-out success" in printed
    assert "s/step" not in printed  # no step table
    page = (out / "report.html").read_text()
    assert "on one seed, which gives no interval: no difference shown" in page


def test_stale_setting_ignores_run_control():
    from dataclasses import asdict, replace

    from polyrl.families.marl.report import stale_setting
    from polyrl.families.marl.train import MarlTrainConfig

    cfg = MarlTrainConfig(steps=1)
    assert stale_setting({"config": asdict(cfg)}, replace(cfg, threads=3, checkpoint_every=2)) is None
    assert stale_setting({"config": asdict(cfg)}, replace(cfg, lr=0.5)) == "lr = 0.002, not 0.5"


def test_report_offers_no_seed_and_refuses_one(tmp_path, capsys):
    from polyrl.cli import main

    with pytest.raises(SystemExit):
        main(["marl", "report", "--help"])
    assert not re.search(r"--seed(?![s\w])", capsys.readouterr().out)
    code, err = cli(capsys, "marl", "report", "--seed", "7", "--out", str(tmp_path / "r"))
    assert code == 2
    one_line(err, "seed = 7", "--seeds")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("flags, words", [(["--ci", "5"], ("ci = 5.0", "(0, 1)")),
                                          (["--methods", ","], ("methods = ','", "mappo, ippo")),
                                          (["--methods", "mappo,mappo"], ("methods = 'mappo,mappo'", "once")),
                                          (["--methods", "mappo,qmix"], ("methods = 'mappo,qmix'",))])
def test_report_options_are_checked_before_training(tmp_path, capsys, flags, words):
    code, err = cli(capsys, "marl", "report", "--seeds", "1", *flags, "--out", str(tmp_path / "r"))
    assert code == 2
    one_line(err, *words)
    assert not (tmp_path / "r").exists()  # nothing trained


# ---- train ----------------------------------------------------------------------------------------------------
def test_diverging_run_stops_inone_line(tmp_path, capsys):
    run = tmp_path / "r"
    code, err = cli(capsys, "marl", "train", "--steps", "3", *TINY, "--lr", "1e30", "--run-dir", str(run))
    assert code == 1
    one_line(err, "training stopped: non-finite", "step 1", "lower --lr (1e+30), --entropy-coef")
    code, err = cli(capsys, "marl", "train", "--steps", "3", *TINY, "--entropy-coef", "3e38", "--run-dir", str(run))
    assert code == 1
    one_line(err, "training stopped: non-finite", "step 1", "--entropy-coef (3e+38) or --value-coef (0.5)")
    assert not (run / "summary.json").exists()


def test_resume_refuses_fewer_steps_and_overwrite(tmp_path, capsys):
    run = tmp_path / "r"
    assert cli(capsys, "marl", "train", "--steps", "3", *TINY, "--run-dir", str(run))[0] == 0
    summary = (run / "summary.json").read_text()
    code, err = cli(capsys, "marl", "train", "--steps", "1", "--run-dir", str(run), "--resume")
    assert code == 2
    one_line(err, "steps = 1", ">= 3")
    code, err = cli(capsys, "marl", "train", "--steps", "4", "--run-dir", str(run), "--resume", "--overwrite")
    assert code == 2
    one_line(err, "resume and overwrite")
    assert step_rows(run) == [1, 2, 3] and (run / "summary.json").read_text() == summary  # the run as it was
    assert not (run / "config_history.jsonl").exists()

    (run / "checkpoint.pt").unlink()  # as a run stopped before its first save leaves it
    code, err = cli(capsys, "marl", "train", "--steps", "4", "--run-dir", str(run), "--resume")
    assert code == 2  # it said "no checkpoint.pt and config.json", with config.json there
    one_line(err, "has no checkpoint.pt to resume from", "--overwrite")
    code, err = cli(capsys, "marl", "train", "--steps", "4", "--run-dir", str(tmp_path / "none"), "--resume")
    assert code == 2
    one_line(err, "holds no run (no config.json) to resume; start it without --resume")

def test_resume_finds_the_default_run_directory(tmp_path, capsys, monkeypatch):
    """`marl train --resume` without --run-dir said "resume needs --run-dir"; like `duplex train`, it continues the
    run the same command without --run-dir made."""
    monkeypatch.chdir(tmp_path)
    assert cli(capsys, "marl", "train", "--steps", "2", *TINY)[0] == 0
    code, err = cli(capsys, "marl", "train", "--steps", "3", *TINY, "--resume")
    assert code == 0, err
    assert step_rows(tmp_path / "runs" / "marl" / "mappo-s0") == [1, 2, 3]


def test_resume_below_checkpoint_refused_by_train_marl_too(tmp_path):
    from polyrl.families.marl.methods import get_marl_method
    from polyrl.families.marl.train import MarlTrainConfig, train_marl

    cfg = MarlTrainConfig(steps=2, envs=4, horizon=4, hidden=8, eval_every=2, eval_episodes=2, minibatches=2,
                          epochs=1)
    train_marl(cfg, get_marl_method("mappo"), run_dir=tmp_path, table_every=0)
    from dataclasses import replace

    with pytest.raises(ConfigError, match="^steps = 1 is not allowed"):
        train_marl(replace(cfg, steps=1), get_marl_method("mappo"), run_dir=tmp_path, resume=True, table_every=0)
    assert step_rows(tmp_path) == [1, 2]


def test_every_pass_takes_exactly_minibatches_optimizer_steps():
    """10 episodes in 6 minibatches: torch.chunk gave 5 pieces (one optimizer step lost per pass)."""
    from polyrl.families.marl.methods import get_marl_method
    from polyrl.families.marl.train import Agent, MarlTrainConfig, rollout, train_dist, update

    cfg = MarlTrainConfig(envs=10, minibatches=6, epochs=2, horizon=3, hidden=8)
    torch.manual_seed(0)
    agent = Agent(get_marl_method("mappo"), cfg.hidden)
    g = torch.Generator().manual_seed(0)
    batch = rollout(agent, cfg, train_dist(cfg), cfg.envs, g)
    opt = torch.optim.SGD(agent.parameters(), lr=0.0)
    steps = []
    opt.register_step_post_hook(lambda *_: steps.append(1))
    update(agent, opt, batch, cfg, g)
    assert len(steps) == cfg.epochs * cfg.minibatches


def test_more_minibatches_than_episodes_is_refused():
    from polyrl.families.marl.cli import check_train_flags

    with pytest.raises(ConfigError, match=r"^minibatches = 11 is not allowed; allowed: <= envs \(10\)$"):
        check_train_flags(["--envs", "10", "--minibatches", "11"])


def test_resume_remembers_an_extension_and_refuses_damaged_files_in_one_line(tmp_path, capsys):
    """marl read config.json, not the run's settings after its resumes: the next plain --resume of an extended run was
    refused with the record's stale steps; a damaged config.json or checkpoint.pt was a traceback."""
    run = tmp_path / "r"
    assert cli(capsys, "marl", "train", "--steps", "1", *TINY, "--run-dir", str(run))[0] == 0
    assert cli(capsys, "marl", "train", "--steps", "2", "--run-dir", str(run), "--resume")[0] == 0
    assert cli(capsys, "marl", "train", "--run-dir", str(run), "--resume")[0] == 0
    assert step_rows(run) == [1, 2]
    ckpt = (run / "checkpoint.pt").read_bytes()
    (run / "checkpoint.pt").write_bytes(ckpt[:100])
    code, err = cli(capsys, "marl", "train", "--steps", "3", "--run-dir", str(run), "--resume")
    assert code == 2
    one_line(err, "checkpoint.pt cannot be read")
    (run / "checkpoint.pt").write_bytes(ckpt)
    (run / "config.json").write_text('{"config": {"steps"')
    code, err = cli(capsys, "marl", "train", "--steps", "3", "--run-dir", str(run), "--resume")
    assert code == 2
    one_line(err, "config.json cannot be read")
