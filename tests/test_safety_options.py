"""The option rules all `polyrl safety` tools share (``polyrl.safety.options``): finite numbers, --threads,
--out / --overwrite, the --out help text, and bias-probe's LM options with --seeds 0.

Each check is called directly (no experiment runs), except the --out refusals, which go through the command
with tiny settings so that a tool that does not refuse finishes quickly and the test fails instead of hanging.
"""

from __future__ import annotations

import argparse
import math

import pytest

from polyrl.config import ConfigError
from polyrl.safety import TOOLS
from polyrl.safety.options import number_list, prepare_out, settle_out

# Tiny settings per tool: a run that is not refused ends in seconds.
TINY = {
    "bias-probe": ["--seeds", "0", "--sim-seeds", "2", "--max-steps", "20"],
    "probe": ["--seeds", "1", "--hidden", "16", "--layers", "2", "--sup-steps", "1", "--rl-steps", "1",
              "--eval-prompts", "16", "--sae-features", "4", "--alphas", "0,4"],
    "redteam": ["--seeds", "1", "--single-turn-steps", "0", "--multi-turn-steps", "0", "--co-train-steps", "1",
                "--no-control"],
    "ggro": ["--seeds", "2", "--prompts", "1", "--lm-steps", "1", "--max-new-tokens", "2", "--min-segment", "1",
             "--thresholds", "1", "--refinements", "2"],
    "unlearn": ["--seeds", "1", "--steps", "2", "--unlearn-steps", "1", "--sweep", "", "--episodes", "10"],
}


@pytest.fixture(scope="module")
def tools() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    from polyrl.safety.cli import add_parser

    ap = argparse.ArgumentParser(prog="polyrl")
    sub = ap.add_subparsers(dest="command")
    add_parser(sub)
    safety = sub.choices["safety"]
    tool_parsers = next(a for a in safety._actions if isinstance(a, argparse._SubParsersAction)).choices
    return ap, tool_parsers


def _parse(tools, tool: str, argv: list[str]) -> argparse.Namespace:
    return tools[0].parse_args(["safety", tool, *argv])


def _validate(tool: str, args: argparse.Namespace) -> None:
    """The tool's own option checks (what its command runs before any work)."""
    if tool == "bias-probe":
        from polyrl.safety.bias_probe.command import _check
        _check(args)
    elif tool == "ggro":
        from polyrl.safety.ggro.experiment import _check
        _check(args)
    elif tool == "probe":
        from polyrl.safety.probe.command import _experiment
        _experiment(args)
    elif tool == "redteam":
        from polyrl.safety.redteam.experiment import _check, _weights
        _check(args)
        _weights(args)
    else:
        from polyrl.safety.unlearn.command import config_from_args
        config_from_args(args)


def _float_options(tools, tool: str) -> list[str]:
    return [a.option_strings[0] for a in tools[1][tool]._actions if a.type is float]


# ---------------------------------------------------------------------------------------------- finding 1
@pytest.mark.parametrize("tool", list(TOOLS))
def test_threads_below_one_or_above_four_per_core_are_refused_by_every_tool(tools, tool, monkeypatch):
    monkeypatch.setattr("polyrl.runs.cores", lambda: 2)
    for threads in ("0", "9", "99999999999"):  # the last was an overflow traceback, 100000 a segfault
        with pytest.raises(ConfigError, match=rf"^--threads = {threads}: must be an integer in \[1, 8\] \(4 per"):
            _validate(tool, _parse(tools, tool, ["--threads", threads]))
    _validate(tool, _parse(tools, tool, ["--threads", "8"]))


# ---------------------------------------------------------------------------------------------- finding 2
@pytest.mark.parametrize("tool", list(TOOLS))
@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_every_float_option_of_every_tool_refuses_non_finite_values(tools, tool, bad):
    options = _float_options(tools, tool)
    assert options, f"{tool} has float options"
    for opt in options:
        with pytest.raises(ConfigError, match=f"^{opt} = {bad}: must be a finite number$"):
            _validate(tool, _parse(tools, tool, [opt, bad]))


@pytest.mark.parametrize("tool, argv, match", [
    ("ggro", ["--thresholds", "nan"], "--thresholds = 'nan'"),
    ("ggro", ["--thresholds", "1,inf"], "--thresholds = '1,inf'"),
    ("ggro", ["--refinements", "2,inf"], "--refinements = '2,inf'"),
    ("probe", ["--alphas", "1,inf", "--headline-alpha", "1"], "--alphas = '1,inf'"),
    ("probe", ["--alphas", "nan,1", "--headline-alpha", "1"], "--alphas = 'nan,1'"),
    ("redteam", ["--attacker-weights", "nan,1"], "--attacker-weights = 'nan,1'"),
    ("redteam", ["--attacker-weights", "inf,1"], "--attacker-weights = 'inf,1'"),
    ("redteam", ["--defender-weights", "1,nan"], "--defender-weights = '1,nan'"),
    ("unlearn", ["--sweep", "1,inf"], "--sweep = '1,inf'"),
])
def test_number_lists_refuse_non_finite_values(tools, tool, argv, match):
    with pytest.raises(ConfigError, match=f"^{match}: must be "):  # one line: option, value, allowed
        _validate(tool, _parse(tools, tool, argv))


def test_valid_options_still_pass(tools):
    for tool in TOOLS:
        _validate(tool, _parse(tools, tool, []))
    from polyrl.safety.redteam.experiment import _weights

    assert _weights(_parse(tools, "redteam", ["--attacker-weights", "4, 1"]))[2] == [4.0, 1.0]


def test_number_list_parses_counts_and_refuses_in_one_line():
    assert number_list("1, 2,,3", "--x", "numbers") == [1.0, 2.0, 3.0]
    assert number_list("", "--x", "numbers", allow_empty=True) == []
    for text, kw in (("", {}), ("1,x", {}), ("1,2", {"count": 3}), ("-1", {"ok": lambda v: v > 0}),
                     ("1e999", {}), ("-inf", {})):
        with pytest.raises(ConfigError, match=r"^--x = '.*': must be numbers$"):
            number_list(text, "--x", "numbers", **kw)


# ---------------------------------------------------------------------------------------------- finding 3
@pytest.mark.parametrize("opt, value", [("--lm-steps", "80"), ("--lm-group", "4"), ("--lm-lr", "0.01"),
                                        ("--lm-kl", "0"), ("--pretrain-steps", "3"), ("--label-noise", "0.2"),
                                        ("--repair-steps", "0"), ("--eval-every", "2")])
def test_bias_probe_refuses_lm_options_given_with_seeds_zero(tools, opt, value):
    # a value equal to the default is still refused: what counts is that it was given
    with pytest.raises(ConfigError, match=f"^{opt} given with --seeds = 0"):
        _validate("bias-probe", _parse(tools, "bias-probe", ["--seeds", "0", opt, value]))


def test_bias_probe_lm_options_resolve_to_their_defaults(tools):
    from polyrl.safety.bias_probe.command import LM_DEFAULTS

    args = _parse(tools, "bias-probe", ["--seeds", "0"])
    _validate("bias-probe", args)  # nothing given: accepted
    args = _parse(tools, "bias-probe", ["--seeds", "2", "--lm-steps", "7"])
    _validate("bias-probe", args)
    assert args.lm_steps == 7 and args.lm_lr == LM_DEFAULTS["lm_lr"] and args.repair_steps == 100
    with pytest.raises(ConfigError, match="^--lm-steps = 0"):
        _validate("bias-probe", _parse(tools, "bias-probe", ["--lm-steps", "0"]))


def test_bias_probe_seeds_zero_records_no_lm_settings(tools):
    from polyrl.safety.bias_probe.command import run_settings

    args = _parse(tools, "bias-probe", [*TINY["bias-probe"], "--overwrite"])
    _validate("bias-probe", args)
    recorded = run_settings(args)
    assert recorded["seeds"] == 0 and recorded["sim_seeds"] == 2
    assert not {"lm_steps", "lm_lr", "pretrain_steps", "label_noise", "overwrite", "fn"} & set(recorded)
    args = _parse(tools, "bias-probe", ["--seeds", "1"])
    _validate("bias-probe", args)
    assert run_settings(args)["lm_steps"] == 80


# ---------------------------------------------------------------------------------------------- finding 4
@pytest.mark.parametrize("tool", list(TOOLS))
def test_out_with_a_finished_run_is_refused_without_overwrite(tools, tool, tmp_path):
    (tmp_path / "results.json").write_text('{"old": 1}')
    args = _parse(tools, tool, [*TINY[tool], "--out", str(tmp_path)])
    with pytest.raises(ConfigError, match=r"^--out = '.*' already holds results.json.*--overwrite"):
        args.fn(args)
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]
    assert (tmp_path / "results.json").read_text() == '{"old": 1}'


@pytest.mark.parametrize("tool", list(TOOLS))
def test_out_in_a_run_or_model_folder_is_refused_and_a_refused_run_leaves_no_empty_out(tools, tool, tmp_path,
                                                                                     capsys):
    """A tool's --out in a training run or an exported model wrote its results.json and curves.png over the run's
    own; a run refused after its --out was made (an empty forget set, a raising reward) left the empty folder."""
    from polyrl.cli import main

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "curves.png").write_text("the run's own")
    args = _parse(tools, tool, [*TINY[tool], "--out", str(tmp_path)])
    with pytest.raises(ConfigError, match=r"^--out = .*: must be a folder of this tool's results; it holds config"):
        args.fn(args)
    assert (tmp_path / "curves.png").read_text() == "the run's own"
    out = tmp_path / "new" / "out"
    if tool == "unlearn":  # refused once its --out was made: nothing poisoned among 10 episodes' hazard transitions
        assert main(["safety", tool, *TINY[tool], "--relabel-frac", "0.01", "--poison-ratio", "0.01", "--out",
                     str(out)]) == 2
        assert "the forget set is empty" in capsys.readouterr().err
        assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("tool", list(TOOLS))
def test_every_tool_has_overwrite(tools, tool):
    assert _parse(tools, tool, ["--overwrite"]).overwrite is True
    assert _parse(tools, tool, []).overwrite is False


def test_prepare_out_with_overwrite_sets_the_old_results_aside(tmp_path):
    """--overwrite hides the finished run's results.json, report.html and figures (the folder holds no finished run
    while the new one runs); settle_out puts them back unless a new results.json was written, then deletes them, so
    a figure the new run did not draw (bias-probe's lm_curves.png after a rerun with --seeds 0) is not left behind."""
    for name in ("results.json", "report.html", "curves.png", "lm_curves.png", "notes.txt", "mine.png"):
        (tmp_path / name).write_text("old")
    (tmp_path / "models" / "seed0").mkdir(parents=True)  # probe --keep-models: the old run's models went stale
    outputs = ("curves.png", "lm_curves.png", "models")
    args = argparse.Namespace(out=str(tmp_path / "."), overwrite=True)
    assert prepare_out(args, outputs).is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".curves.png.replaced", ".lm_curves.png.replaced",
                                                          ".models.replaced", ".report.html.replaced",
                                                          ".results.json.replaced", "mine.png", "notes.txt"]
    (tmp_path / "models" / "seed0").mkdir(parents=True)  # the stopped run had begun to keep its own models
    (tmp_path / "curves.png").write_text("the stopped run's")
    assert settle_out(tmp_path) is True  # the run stopped before its results: the old ones are back
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png", "lm_curves.png", "mine.png", "models",
                                                          "notes.txt", "report.html", "results.json"]
    assert (tmp_path / "curves.png").read_text() == "old" and (tmp_path / "models" / "seed0").is_dir()
    prepare_out(args, outputs)
    (tmp_path / "results.json").write_text("new")
    (tmp_path / "curves.png").write_text("new")
    assert settle_out(tmp_path) is False
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png", "mine.png", "notes.txt", "results.json"]
    assert (tmp_path / "results.json").read_text() == "new" and (tmp_path / "curves.png").read_text() == "new"
    assert (tmp_path / "mine.png").read_text() == "old"  # a figure of the user's: every *.png was deleted before
    new = argparse.Namespace(out=str(tmp_path / "a" / "b"), overwrite=False)
    assert prepare_out(new, outputs).is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="^--out = .*file.*: must be a directory"):
        prepare_out(argparse.Namespace(out=str(tmp_path / "file"), overwrite=True), outputs)


def test_overwrite_keeps_the_old_results_until_the_new_ones_exist(tmp_path, capsys, monkeypatch):
    """`safety redteam --overwrite` with a channel it could not import, `bias-probe --overwrite` whose ODE overflowed:
    the finished run's results.json and report.html were deleted before the command stopped. They now come back
    byte for byte however the command ends (here Ctrl-C), a leftover of a killed command comes back on the next one,
    and a finished rerun replaces them."""
    from polyrl.cli import main

    out = tmp_path / "bp"
    argv = ["safety", "bias-probe", *TINY["bias-probe"], "--out", str(out)]
    assert main(argv) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def stopped(*a, **k):
        assert not (out / "results.json").exists()
        raise KeyboardInterrupt

    monkeypatch.setattr("polyrl.safety.bias_probe.command.run_experiment", stopped)
    assert main([*argv, "--overwrite"]) == 130
    assert "earlier results in" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    code = main(["safety", "redteam", *TINY["redteam"], "--out", str(out), "--overwrite",
                 "--attacker-channels", "nosuchmod:fn", "--attacker-weights", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "--attacker-channels: reward function 'nosuchmod:fn': cannot import" in err, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    (out / "results.json").replace(out / ".results.json.replaced")  # as a SIGKILL mid-run leaves it
    monkeypatch.undo()
    assert main(argv) == 2  # put back first, then refused without --overwrite
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert main([*argv, "--overwrite", "--max-steps", "21"]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(before)
    assert (out / "results.json").read_bytes() != before["results.json"]


def test_results_with_non_finite_numbers_are_written_as_null(tmp_path):
    """A run whose numbers overflowed (`unlearn --lam-forget 1e300`) stopped in the JSON writer after its figures."""
    import json

    import numpy as np
    import torch

    from polyrl.safety.report import write_report

    paths = write_report(tmp_path, results={"a": float("nan"), "b": [1.5, float("inf")], "c": np.float32("nan"),
                                            "d": torch.tensor(2.0), "e": 3}, title="t", claim="c", verdict="v")
    assert json.loads(paths["results"].read_text()) == {"a": None, "b": [1.5, None], "c": None, "d": 2.0, "e": 3}
    assert not list(tmp_path.glob(".*"))


def test_bias_probe_extreme_settings_run_or_are_refused_in_one_line(tools):
    """--sim-lr 1e6 overflowed math.exp inside the onset ODE (a traceback); --options above 2**24 failed in torch."""
    from polyrl.safety.bias_probe import theory

    for eta in (0.5, 1e6):
        t = theory.bernoulli_pg_onset_ode(0.1, eta, 1.5, True)
        assert 0 < t < 100 / eta + 1 and math.isfinite(theory.finite_group_onset_ode(0.1, eta, 1.5, 4, True))
    args = _parse(tools, "bias-probe", ["--options", str(2**24 + 1)])
    with pytest.raises(ConfigError, match=r"^--options = 16777217; allowed: an integer in \[2, 16777216\]"):
        _validate("bias-probe", args)


# ---------------------------------------------------------------------------------------------- finding 5
@pytest.mark.parametrize("tool", list(TOOLS))
def test_out_help_names_the_real_default(tools, tool):
    text = " ".join(tools[1][tool].format_help().split())
    assert f"(default runs/safety-{tool})" in text
    assert f"runs/safety-{tools[1][tool].prog}" not in text and "%(prog)" not in text
    assert tools[0].parse_args(["safety", tool]).out == f"runs/safety-{tool}"


def test_a_stop_between_the_two_set_asides_loses_nothing(tmp_path, monkeypatch):
    """report.html was set aside before results.json: a stop in between left the old results.json in place, so the
    next command took the run for finished and deleted the old report."""
    from pathlib import Path

    for name in ("results.json", "report.html"):
        (tmp_path / name).write_text(f"old {name}")
    real, calls = Path.replace, []

    def stop_after_one(self, target):
        if calls:
            raise KeyboardInterrupt
        calls.append(self.name)
        return real(self, target)

    monkeypatch.setattr(Path, "replace", stop_after_one)
    with pytest.raises(KeyboardInterrupt):
        prepare_out(argparse.Namespace(out=str(tmp_path), overwrite=True), ())
    monkeypatch.undo()
    assert calls == ["results.json"]
    settle_out(tmp_path)
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {"results.json": "old results.json",
                                                                   "report.html": "old report.html"}


def test_unlearn_refuses_sweep_values_the_report_cannot_tell_apart_and_an_unpoisoned_dataset(tools):
    """--sweep 0.3,0.3000001 ran both and reported one (rows are keyed by lam_f at 6 digits); --relabel-frac 0
    --poison-ratio 0 left the forget set empty, and the 'unlearned' rows were the plain agent's whatever lam_forget."""
    for argv, words in ((["--sweep", "0.3,0.3000001"], "are both lam_f=0.3"),
                        (["--lam-forget", "2", "--sweep", "2.0000001"], "are both lam_f=2"),
                        (["--relabel-frac", "0", "--poison-ratio", "0"], "nothing is poisoned")):
        with pytest.raises(ConfigError, match=words):
            _validate("unlearn", _parse(tools, "unlearn", argv))
    _validate("unlearn", _parse(tools, "unlearn", ["--lam-forget", "2", "--sweep", "2,2.5"]))  # 2 is the base run


@pytest.mark.parametrize("tool, argv, words", [
    ("ggro", ["--thresholds", "1,1.0000001"], "1.0 and 1.0000001 are both 1 in the report"),
    ("ggro", ["--thresholds", "1.5", "--refinements", "4,2,4"], "4.0 and 4.0 are both 4 in the report"),
    ("probe", ["--alphas", "0,1,1,4"], "1.0 and 1.0 are both 1 in the report"),
])
def test_list_values_the_report_cannot_tell_apart_are_refused(tools, tool, argv, words):
    """ggro --thresholds 1,1.0000001 ran both settings and kept one in results.json (stats keyed "H=1,S=2"); a
    refinement or steering strength given twice ran the same setting twice."""
    with pytest.raises(ConfigError, match=words):
        _validate(tool, _parse(tools, tool, argv))
    _validate(tool, _parse(tools, tool, [argv[0], argv[1].replace("1.0000001", "1.01").replace("4,2,4", "4,2")
                                         .replace("1,1,4", "1,4")]))


@pytest.mark.parametrize("tool", list(TOOLS))
def test_overwrite_sets_aside_what_the_tool_wrote_and_nothing_of_the_users(tool, tmp_path):
    """--overwrite deleted every *.png in --out (a user's own figure too) and left probe's old saved models beside the
    new results; it now sets aside exactly the tool's declared outputs, and a tiny run writes nothing else."""
    import importlib
    import sys

    from polyrl.cli import main

    module = importlib.import_module(f"polyrl.safety.{TOOLS[tool][0]}")
    outputs = sys.modules[module.add_parser.__module__].OUTPUTS
    argv = ["safety", tool, *TINY[tool], "--out", str(tmp_path)]
    assert main([*argv, *(["--keep-models"] if tool == "probe" else [])]) == 0
    written = {p.name for p in tmp_path.iterdir()}
    assert written - {"results.json", "report.html"} <= set(outputs), written
    (tmp_path / "mine.png").write_text("the user's")
    if tool == "probe":
        (tmp_path / "models" / "seed7").mkdir()  # a seed an earlier, larger run kept
    assert main([*argv, "--overwrite"]) == 0  # probe without --keep-models this time: no models folder
    assert (tmp_path / "mine.png").read_text() == "the user's"
    assert not list(tmp_path.glob(".*")) and not (tmp_path / "models").exists()
