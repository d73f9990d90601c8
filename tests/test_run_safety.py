"""Run directories and checkpoints are never lost or corrupted: ``--overwrite`` clears only a polyrl run, a resume
reads only this run's own ``step_NNNNNN`` checkpoints, a re-saved step keeps the old copy until the new one is in
place, and damaged run-record files are refused in one line naming the file."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from polyrl.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    remove_partial_saves,
    resume_checkpoint,
    save_checkpoint,
    set_aside_newer,
)
from polyrl.cli import main
from polyrl.config import ConfigError
from polyrl.runs import clear_run_dir, effective_config, record_resume, start_run_dir


def _small(model, run):
    return ["train", "--model", model, "--prompts-per-step", "2", "--group-size", "2", "--eval-prompts", "4",
            "--max-new-tokens", "4", "--run-dir", str(run), "--no-tensorboard", "--threads", "1", "--log-every", "0",
            "--eval-every", "0"]


def _cli(args, capsys):
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err.strip()


def _one_line(code, err, *fragments):
    assert code == 2 and len(err.splitlines()) == 1, (code, err)
    assert "Traceback" not in err
    for f in fragments:
        assert f in err, err


def _save(run, step, value, **kw):
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.fill_(value)
    return save_checkpoint(run, step, model=model, **kw)


def _weight(ck):
    from safetensors.torch import load_file

    return float(load_file(str(Path(ck) / "model.safetensors"))["weight"][0, 0])


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory):
    """One finished 2-step run with a checkpoint at each step; tests work on copies of it."""
    run = tmp_path_factory.mktemp("trained") / "run"
    assert main(_small(tiny_model, run) + ["--steps", "2", "--checkpoint-every", "1"]) == 0
    return run


@pytest.fixture
def run(trained, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


# ---- 0. one command at a time on a run directory ----------------------------------------------------------

def test_a_second_command_on_a_run_directory_in_use_is_refused(run, tiny_model, capsys):
    """While one command holds a run directory (``runs.run_lock``), another --resume or --overwrite on it is refused
    in one line and changes nothing: two writers interleaved one run's metrics and checkpoints. The hold ends with
    the command."""
    from polyrl.runs import run_lock

    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    with run_lock(run):  # as a running command holds it
        for flag in ("--resume", "--overwrite"):
            code, err = _cli([*_small(tiny_model, run), "--steps", "3", flag], capsys)
            _one_line(code, err, f"run_dir = '{run}' is in use by another polyrl command")
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before
    assert _cli([*_small(tiny_model, run), "--steps", "3", "--resume"], capsys)[0] == 0  # free again
    with run_lock(run):  # the finished command let go of it
        pass


def test_a_family_run_in_use_is_not_set_aside_by_another_overwrite(tmp_path):
    """``new_run`` (flow, q, duplex, marl) holds its directory too: a second command's --overwrite would have moved a
    running run aside and deleted it."""
    from polyrl.runs import new_run, run_lock

    run = tmp_path / "run"
    with new_run(run, overwrite=False, record={"config": {}}):
        (run / "metrics.jsonl").write_text("{}\n")
        with pytest.raises(ConfigError, match="is in use by another polyrl command"):
            with new_run(run, overwrite=True):
                pass
        assert (run / "metrics.jsonl").is_file()
    with run_lock(run):
        pass


def test_an_overwrite_that_fails_before_its_first_row_puts_the_old_run_back(tmp_path, capsys):
    """A family command's logger makes its files at the first row: one that failed in step 1 (``flow --overwrite
    --lr 1e300``, Ctrl-C) had left an empty metrics.jsonl and tb/, which counted as a started run, so the finished
    run it was replacing was deleted and the directory held nothing to resume."""
    import io

    from rich.console import Console

    from polyrl.logging import RunLogger
    from polyrl.runs import new_run

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"config": {"lr": 0.1}}')
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    with pytest.raises(KeyboardInterrupt):
        with new_run(run, overwrite=True, record={"config": {"lr": 1e300}}):
            logger = RunLogger(run, tensorboard=True, console=Console(file=io.StringIO()))
            assert sorted(p.name for p in run.iterdir()) == ["config.json"]
            raise KeyboardInterrupt  # in step 1, before any row
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    assert "the old run there is as it was" in capsys.readouterr().err
    with new_run(run, overwrite=True, record={"config": {}}):  # a row written: the new run replaces the old one
        logger = RunLogger(run, tensorboard=True, console=Console(file=io.StringIO()))
        logger.log(1, {"loss": 0.25})
        logger.close()
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "metrics.jsonl", "tb"]
    assert json.loads((run / "metrics.jsonl").read_text()) == {"step": 1, "loss": 0.25}


def test_a_run_started_with_relative_paths_resumes_from_another_directory(tiny_model, tmp_path, capsys, monkeypatch):
    """Path settings are recorded absolute: a run started in d/ with ``--reward-funcs rew.py:r`` resumes from d's
    parent, given the file again by another relative name or not at all. Before, the record's 'rew.py' was looked
    for in the new directory, and 'd/rew.py' was refused as differing from it."""
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "rew.py").write_text("def r(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path / "d")
    assert main([*_small(tiny_model, "r"), "--steps", "1", "--reward-funcs", "rew.py:r"]) == 0
    record = json.loads((tmp_path / "d" / "r" / "config.json").read_text())["config"]
    assert record["reward_funcs"] == f"{tmp_path / 'd' / 'rew.py'}:r"
    monkeypatch.chdir(tmp_path)
    assert main([*_small(tiny_model, "d/r"), "--steps", "2", "--resume"]) == 0
    assert main([*_small(tiny_model, "d/r"), "--steps", "3", "--resume", "--reward-funcs", "d/rew.py:r"]) == 0
    capsys.readouterr()


def test_a_family_resume_holds_its_run_too(tmp_path, capsys):
    """q, duplex and marl --resume hold the run before they read it: an --overwrite meanwhile replaced the run the
    resume went on writing checkpoints into."""
    from polyrl.runs import run_lock

    run = tmp_path / "q"
    assert main(["q", "train", "--run-dir", str(run), "--steps", "2"]) == 0
    capsys.readouterr()
    with run_lock(run):
        code, err = _cli(["q", "train", "--run-dir", str(run), "--resume", "--steps", "3"], capsys)
    _one_line(code, err, f"run_dir = '{run}' is in use by another polyrl command")
    assert json.loads((run / "summary.json").read_text())["steps_done"] == 2


def test_the_lock_lies_beside_the_directory_and_leaves_no_folders(tmp_path, monkeypatch):
    """``--run-dir .`` keeps its lock beside the directory it means (inside, it was a foreign file that refused the
    run); folders made only to hold a refused command's lock are removed."""
    from polyrl.runs import run_lock

    (tmp_path / "d").mkdir()
    monkeypatch.chdir(tmp_path / "d")
    with run_lock("."):
        assert (tmp_path / ".d.lock").is_file() and not list((tmp_path / "d").iterdir())
    with run_lock(tmp_path / "typo" / "deep" / "x"):
        assert (tmp_path / "typo" / "deep" / ".x.lock").is_file()
    assert not (tmp_path / "typo").exists() and not (tmp_path / ".d.lock").exists()


def test_the_lock_is_the_same_through_a_symlink_to_the_directory(tmp_path):
    """A run reached by a symlink is the same run: a second command through the link is refused (two trainers
    shared one run directory when the lock lay beside the link)."""
    from polyrl.runs import run_lock

    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with run_lock(tmp_path / "real"):
        with pytest.raises(ConfigError, match="is in use by another polyrl command"):
            with run_lock(tmp_path / "link"):
                pass


def test_absolute_paths_keep_what_names_no_file(tmp_path, monkeypatch):
    """A reward ``module:function`` stays as given even beside a folder of the module's name (made absolute, it
    could not be imported); a ``FILE.py:function`` and an existing data file become absolute."""
    from polyrl.runs import absolute_paths

    monkeypatch.chdir(tmp_path)
    (tmp_path / "myproj").mkdir()
    (tmp_path / "r.py").write_text("")
    (tmp_path / "auto").write_text("")
    (tmp_path / "d.jsonl").write_text("")
    out = absolute_paths({"reward_funcs": "task,myproj:reward,r.py:f", "chat_template": "auto",
                          "data_file": "d.jsonl", "lr": 1e-3})
    assert out == {"reward_funcs": f"task,myproj:reward,{tmp_path / 'r.py'}:f", "chat_template": "auto",
                   "data_file": str(tmp_path / "d.jsonl"), "lr": 1e-3}


# ---- 1. --overwrite deletes only a polyrl run ----------------------------------------------------------------

def test_overwrite_refuses_a_directory_that_is_not_a_run(tiny_model, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("important")
    code, err = _cli([*_small(tiny_model, "precious"), "--steps", "1", "--overwrite"], capsys)
    _one_line(code, err, "run_dir = 'precious'", "notes.txt", "no polyrl run", "--overwrite clears only")
    assert (precious / "notes.txt").read_text() == "important"


@pytest.mark.parametrize("family", [None, "flow"])
def test_a_new_run_does_not_start_among_foreign_files(family, tiny_model, tmp_path, capsys, monkeypatch):
    """`train --run-dir DIR` (or `flow train`) on a directory of other files started the run among them; a later
    `--overwrite` then saw a polyrl run there and deleted notes.txt with it. A file the command reads may be there."""
    monkeypatch.chdir(tmp_path)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("important")
    cmd = (_small(tiny_model, "precious") + ["--steps", "1"] if family is None else
           ["flow", "train", "--task", "reach", "--steps", "1", "--groups", "2", "--group-size", "2",
            "--eval-samples", "4", "--run-dir", "precious"])
    code, err = _cli(cmd, capsys)
    _one_line(code, err, "run_dir = 'precious'", "notes.txt", "no polyrl run", "choose an empty or new --run-dir")
    assert [p.name for p in precious.iterdir()] == ["notes.txt"]
    (precious / "notes.txt").unlink()
    (precious / "my.toml").write_text("steps = 1\n")
    code, err = _cli([*cmd, "--config", "precious/my.toml"], capsys)
    assert code == 0, err
    assert (precious / "my.toml").is_file() and (precious / "summary.json").is_file()


def test_clear_run_dir_clears_a_run_or_nothing_and_refuses_the_rest(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    clear_run_dir(empty)  # an empty directory: nothing to lose
    clear_run_dir(tmp_path / "missing")
    hf = tmp_path / "model"  # a model directory: its config.json is not a run record
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama"}')
    (hf / "model.safetensors").write_bytes(b"x")
    runs = tmp_path / "runs"  # a folder of runs is not one run
    (runs / "a").mkdir(parents=True)
    (runs / "a" / "config.json").write_text('{"config": {}}')
    (runs / "summary.json").write_text("{}")
    afile = tmp_path / "file"
    afile.write_text("x")
    for path, fragment in ((hf, "config.json, model.safetensors) and no polyrl run"),
                           (runs, "other runs in a"), (afile, "is a file"), (Path("."), "current directory")):
        with pytest.raises(ConfigError, match="^run_dir = ") as e:
            clear_run_dir(path)
        assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert (hf / "model.safetensors").exists() and (runs / "a" / "config.json").exists() and afile.exists()
    for inner in ("cmp/grpo/seed0", "checkpoints/step_000001/inner", "tb/inner"):  # a compare's; runs started in
        outer = tmp_path / "outer" / inner.replace("/", "_")  # a checkpoint or tb/: each one or two folders down
        _save(outer, 1, 0.0)
        (outer / "metrics.jsonl").write_text('{"step": 0}\n')
        (outer / inner).mkdir(parents=True, exist_ok=True)
        (outer / inner / "config.json").write_text('{"config": {}}')
        with pytest.raises(ConfigError, match=f"other runs in {inner}"):
            clear_run_dir(outer)
        assert (outer / inner / "config.json").exists()
    with pytest.raises(ConfigError, match="no polyrl run"):  # the families' run directories too
        start_run_dir(hf, overwrite=True)
    one = tmp_path / "one"  # a polyrl run (here only a checkpoint and its metrics) is cleared
    _save(one, 1, 0.0)
    (one / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.5}\n')
    assert start_run_dir(one, overwrite=True) == one and list(one.iterdir()) == []


def test_overwrite_still_clears_a_run(run, tiny_model, capsys):
    (run / "checkpoints" / "step_000002" / "stale.txt").write_text("x")
    code, err = _cli([*_small(tiny_model, run), "--steps", "1", "--overwrite"], capsys)
    assert code == 0, err
    assert [p.name for p in list_checkpoints(run)] == ["step_000001"]


def test_a_checkpoint_that_cannot_be_written_is_one_line_and_keeps_the_earlier_ones(tmp_path, monkeypatch):
    """A full disk or a read-only directory ended the run in a 115-line traceback (the old checkpoints were kept)."""
    import errno

    import polyrl.checkpoint as ck
    from polyrl.errors import CheckpointError

    _save(tmp_path, 1, 1.0)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ck, "save_model", full)
    with pytest.raises(CheckpointError) as e:
        _save(tmp_path, 2, 2.0)
    message = str(e.value)
    assert "step_000002 cannot be written (OSError: No space left on device)" in message and "\n" not in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]  # no partial save left
    assert _weight(tmp_path / "checkpoints" / "step_000001") == 1.0


def test_a_meta_json_cannot_hide_a_missing_file_or_another_step(tmp_path):
    """verify_checkpoint trusted meta.json's file list and step: an edited list hid a deleted trainer_state.pt (the
    resume then failed on the missing file), and a step of 7 in step_000030 was resumed as step 7."""
    from polyrl.checkpoint import verify_checkpoint
    from polyrl.errors import CheckpointError

    for edit, needle in ((lambda m: m["files"].pop("trainer_state.pt"), "meta.json lists no trainer_state.pt"),
                         (lambda m: m["files"].pop("model.safetensors"), "lists no model.safetensors or"),
                         (lambda m: m.update(step=7), "its meta.json says step 7, its name step 3")):
        ck = _save(tmp_path / str(len(needle)), 3, 1.0)
        meta = json.loads((ck / "meta.json").read_text())
        edit(meta)
        (ck / "meta.json").write_text(json.dumps(meta))
        with pytest.raises(CheckpointError, match=needle):
            verify_checkpoint(ck)


def test_an_export_of_a_run_with_a_corrupt_newest_checkpoint_names_an_export_command(tmp_path, capsys):
    """It said "resume from it with --resume-from ...", a flag export does not have."""
    _save(tmp_path / "r", 1, 1.0)
    newest = _save(tmp_path / "r", 2, 2.0)
    (newest / "trainer_state.pt").write_bytes(b"damaged")
    code, err = _cli(["export", tmp_path / "r", tmp_path / "out"], capsys)
    assert code == 2 and "the newest intact checkpoint is" in err and "--resume-from" not in err, err
    assert f"export it with `polyrl export {tmp_path / 'r' / 'checkpoints' / 'step_000001'} {tmp_path / 'out'}`" in err


def test_overwrite_keeps_files_no_run_writes(run, tiny_model, capsys):
    """A user's notes or analysis folder inside a run directory were deleted with the run by --overwrite."""
    (run / "notes.txt").write_text("keep me")
    (run / "analysis").mkdir()
    (run / "my_plot.png").write_bytes(b"a figure the user drew")  # any .png counted as the run's own before
    code, err = _cli([*_small(tiny_model, run), "--steps", "1", "--overwrite"], capsys)
    assert code == 2 and "holds a polyrl run and 3 entries no run writes (analysis, my_plot.png, notes.txt)" in err, err
    assert (run / "notes.txt").read_text() == "keep me" and (run / "metrics.jsonl").exists()


def test_overwrite_refused_while_the_model_loads_keeps_the_old_run(run, tiny_model, capsys):
    """A setting that only the loaded model can refuse (LoRA targets) stops the command after --overwrite was
    accepted: the old run is put back as it was, and nothing is left beside it."""
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    code, err = _cli([*_small(tiny_model, run), "--steps", "1", "--overwrite", "--lora-rank", "2",
                      "--lora-targets", "no_such_proj"], capsys)
    _one_line(code, err, "lora_targets = 'no_such_proj'")
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in run.parent.iterdir()) == ["run"]
    code, err = _cli([*_small(tiny_model, run), "--steps", "1", "--overwrite"], capsys)  # the corrected command
    assert code == 0, err
    assert [p.name for p in list_checkpoints(run)] == ["step_000001"]
    assert sorted(p.name for p in run.parent.iterdir()) == ["run"]  # the old run is gone once the new one ran


def test_the_old_run_is_gone_once_the_new_one_has_started(run, tiny_model, capsys, monkeypatch):
    """Not at the end of the command: both runs are never on disk for the length of a training."""
    import polyrl.trainer
    from polyrl.runs import aside_path

    seen = []
    real = polyrl.trainer._train

    def first_step_sees(*a, **k):
        seen.append((aside_path(run).exists(), (run / "config.json").exists()))
        return real(*a, **k)

    monkeypatch.setattr(polyrl.trainer, "_train", first_step_sees)
    code, err = _cli([*_small(tiny_model, run), "--steps", "1", "--overwrite"], capsys)
    assert code == 0, err
    assert seen == [(False, True)] and not aside_path(run).exists()


def test_ctrl_c_while_the_new_run_is_built_puts_the_old_one_back(run, tiny_model, capsys, monkeypatch):
    import polyrl.build

    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(polyrl.build, "build_components", interrupted)
    code, err = _cli([*_small(tiny_model, run), "--steps", "1", "--overwrite"], capsys)
    assert code == 130 and len(err.splitlines()) == 1, err
    assert f"the old run in {run} is as it was (start again with --overwrite)" in err
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in run.parent.iterdir()) == ["run"]


def test_a_failing_put_back_is_one_warning_and_the_refusal_stays_the_answer(run, tiny_model, capsys, monkeypatch):
    import polyrl.runs

    def refused(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(polyrl.runs, "settle_replaced", refused)
    code, err = _cli([*_small(tiny_model, run), "--steps", "1", "--overwrite", "--lora-rank", "2",
                      "--lora-targets", "no_such_proj"], capsys)
    lines = err.splitlines()
    assert code == 2 and len(lines) == 2 and "Traceback" not in err, err
    assert "warning: the old run of" in lines[0] and ".run.replaced (Permission denied)" in lines[0]
    assert "lora_targets = 'no_such_proj'" in lines[1]


def test_sigterm_unwinds_the_command_like_ctrl_c_and_nohup_still_holds():
    import signal

    from polyrl.runs import signals_unwind as _signals_unwind

    outside = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (a Ray test before may have left its own handler)
    try:
        with pytest.raises(SystemExit) as stopped, _signals_unwind():
            os.kill(os.getpid(), signal.SIGTERM)
        assert stopped.value.code == 128 + signal.SIGTERM and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, outside)
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    # Python's own Ctrl-C handler to start from (a process started in a shell's background inherits SIGINT ignored)
    interrupt = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with _signals_unwind():
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # as torch.distributed.run's launcher changes it
            os.kill(os.getpid(), signal.SIGHUP)  # ignored, not turned into an exit
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    finally:
        signal.signal(signal.SIGHUP, previous)
        signal.signal(signal.SIGINT, interrupt)


def test_an_old_run_left_aside_by_a_killed_command_is_put_back_or_dropped(tmp_path):
    from polyrl.runs import aside_path, recover_replaced, set_aside_run, settle_replaced

    def old_run(path):
        _save(path, 1, 0.5)
        (path / "metrics.jsonl").write_text('{"step": 0}\n')

    for new_run in ("nothing", "a stub", "started"):  # what the killed command had written in run_dir
        run = tmp_path / new_run.replace(" ", "_")
        old_run(run)
        aside = set_aside_run(run)
        assert aside == aside_path(run) and not run.exists() and aside.name.startswith(".")
        if new_run != "nothing":
            run.mkdir()
            (run / "config.json").write_text('{"config": {}}')  # written before the parts are built
        if new_run == "started":
            (run / "metrics.jsonl").write_text('{"step": 0}\n')
        note = recover_replaced(run)
        assert not aside.exists()
        if new_run == "started":  # the old run had been replaced: dropped, the new one untouched
            assert "deleted the run that an earlier --overwrite" in note
            assert not (run / "checkpoints").exists() and (run / "metrics.jsonl").exists()
        else:
            assert "put back the run in" in note and _weight(latest_checkpoint(run)) == 0.5
            assert not settle_replaced(run, aside)  # nothing left to settle
    assert recover_replaced(tmp_path / "never") is None
    foreign = tmp_path / "foreign"  # the user made run_dir again and put other files in it: both are kept
    old_run(foreign)
    aside = set_aside_run(foreign)
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="now holds files that are no polyrl run"):
        recover_replaced(foreign)
    assert (foreign / "notes.txt").exists() and (aside / "checkpoints").is_dir()


def test_an_interrupted_deletion_never_comes_back_as_the_old_run(tmp_path, monkeypatch):
    import shutil

    from polyrl.runs import aside_path, drop_replaced, recover_replaced, set_aside_run, settle_replaced

    run = tmp_path / "run"
    _save(run, 1, 0.5)
    aside = set_aside_run(run)
    real_rmtree = shutil.rmtree

    def interrupted(path, *a, **k):
        real_rmtree(Path(path) / "checkpoints")  # half deleted
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", interrupted)
    with pytest.raises(KeyboardInterrupt):
        drop_replaced(aside)
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    assert not settle_replaced(run, aside) and not run.exists()  # nothing half deleted is put back
    assert recover_replaced(run) is None and not any(tmp_path.iterdir())  # and the next command clears it
    (tmp_path / ".run.replaced").write_text("a file of the user's")
    _save(run, 1, 0.5)
    with pytest.raises(ConfigError, match="already exists and is not a run it set aside"):
        set_aside_run(run)
    assert aside_path(run).read_text() == "a file of the user's" and (run / "checkpoints").is_dir()


def test_resume_after_a_killed_overwrite_continues_the_old_run_with_its_own_settings(run, tiny_model, capsys):
    from polyrl.runs import set_aside_run

    set_aside_run(run)  # what a killed `--overwrite --group-size 4` leaves: the old run aside, the new one's record
    run.mkdir()
    record = json.loads((run.parent / ".run.replaced" / "config.json").read_text())
    record["config"]["group_size"] = 4
    (run / "config.json").write_text(json.dumps(record))
    code, err = _cli([*_small(tiny_model, run), "--resume", "--group-size", "4"], capsys)
    _one_line(code, err, "group_size", "4")  # refused against the old run's own group_size, as without the kill
    assert latest_checkpoint(run) is not None and not (run.parent / ".run.replaced").exists()


def test_setting_aside_names_and_refusals(tmp_path, monkeypatch):
    from polyrl.runs import aside_path, set_aside_run

    long = tmp_path / ("r" * 250)
    assert len(aside_path(long).name.encode()) <= 255 and aside_path(long) != aside_path(tmp_path / ("r" * 251))
    run = tmp_path / "run"
    _save(run, 1, 0.5)

    def refused(self, target):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "rename", refused)
    with pytest.raises(ConfigError, match=r"^run_dir = .*cannot set the old run aside as \.run\.replaced "
                                          r"\(Permission denied\); it is unchanged") as e:
        set_aside_run(run)
    assert "\n" not in str(e.value) and _weight(latest_checkpoint(run)) == 0.5


def test_overwrite_never_deletes_a_file_the_run_reads(run, tiny_model, tmp_path, capsys):
    inside = run / "model"
    shutil.copytree(tiny_model, inside)  # say, a model exported into the old run's directory
    code, err = _cli([*_small(inside, run), "--steps", "1", "--overwrite"], capsys)
    _one_line(code, err, f"run_dir = '{run}' holds model = '{inside}', which this run reads")
    assert inside.is_dir() and (run / "checkpoints" / "step_000002").is_dir()
    (tmp_path / "rw.py").write_text("def f(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    shutil.move(tmp_path / "rw.py", run / "rw.py")
    with pytest.raises(ConfigError, match="holds reward_funcs = "):
        clear_run_dir(run, inputs={"run_dir": str(run), "reward_funcs": f"task,{run / 'rw.py'}:f"})


# ---- 2. a resume reads only this run's checkpoints; a re-saved step is swapped, not deleted first -------------
def test_resume_from_another_runs_checkpoint_is_refused(run, trained, tmp_path, capsys):
    other = tmp_path / "other"
    _save(other, 2, 7.0)
    own = (run / "checkpoints" / "step_000002" / "model.safetensors").read_bytes()
    foreign = other / "checkpoints" / "step_000002"
    code, err = _cli(["train", "--run-dir", run, "--resume-from", foreign, "--steps", "3"], capsys)
    _one_line(code, err, f"resume_from = '{foreign}' is not a checkpoint of run_dir = '{run}'", "polyrl export")
    assert (run / "checkpoints" / "step_000002" / "model.safetensors").read_bytes() == own
    with pytest.raises(CheckpointError, match="is not a checkpoint of run_dir"):  # a copy beside them is not either
        shutil.copytree(run / "checkpoints" / "step_000001", run / "checkpoints" / "step_000001.bak")
        resume_checkpoint(run, run / "checkpoints" / "step_000001.bak")
    path, meta = resume_checkpoint(run, Path(os.path.relpath(run / "checkpoints" / "step_000001")))
    assert meta["step"] == 1


def test_a_renamed_checkpoint_is_refused(tmp_path):
    _save(tmp_path, 2, 1.0)
    os.replace(tmp_path / "checkpoints" / "step_000002", tmp_path / "checkpoints" / "step_000005")
    with pytest.raises(CheckpointError, match="meta.json says step 2, its name step 5"):
        resume_checkpoint(tmp_path, tmp_path / "checkpoints" / "step_000005")


def test_resaving_a_step_keeps_the_old_copy_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    _save(tmp_path, 1, 1.0)
    _save(tmp_path, 2, 2.0)
    real = os.replace

    def crash_on_the_swap(src, dst):
        if Path(src).name.startswith(".tmp_step_"):
            raise KeyboardInterrupt("killed")
        real(src, dst)

    monkeypatch.setattr("polyrl.checkpoint.os.replace", crash_on_the_swap)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 2, 3.0)
    monkeypatch.setattr("polyrl.checkpoint.os.replace", real)
    path, meta = resume_checkpoint(tmp_path)  # the old step 2 is back, not lost to the killed save
    assert path.name == "step_000002" and _weight(path) == 2.0
    remove_partial_saves(tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    _save(tmp_path, 2, 4.0)  # a save that completes replaces it and leaves nothing behind
    assert _weight(tmp_path / "checkpoints" / "step_000002") == 4.0
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001", "step_000002"]


# ---- 3. only step_NNNNNN directories are checkpoints ------------------------------------------------------------
def test_a_backup_copy_is_never_listed_loaded_or_pruned(tmp_path):
    root = tmp_path / "checkpoints"
    _save(tmp_path, 1, 1.0)
    _save(tmp_path, 2, 2.0)
    shutil.copytree(root / "step_000002", root / "step_000002.bak")
    shutil.copytree(root / "step_000001", root / "superseded_step_000009")
    assert latest_checkpoint(tmp_path).name == "step_000002"
    assert resume_checkpoint(tmp_path)[0].name == "step_000002"
    _save(tmp_path, 3, 3.0, keep_last=2)  # prunes step 1 only: not step 2, not the copies
    assert sorted(p.name for p in root.iterdir()) == ["step_000002", "step_000002.bak", "step_000003",
                                                      "superseded_step_000009"]
    assert [p.name for p in set_aside_newer(tmp_path, 2)] == ["superseded_step_000003"]
    assert (root / "step_000002.bak").is_dir()


def test_resume_past_a_backup_copy(run, capsys):
    shutil.copytree(run / "checkpoints" / "step_000002", run / "checkpoints" / "step_000002.bak")
    code, err = _cli(["train", "--run-dir", run, "--resume", "--steps", "3"], capsys)
    assert code == 0, err
    steps = [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in r]
    assert steps == [1, 2, 3]
    assert (run / "checkpoints" / "step_000002.bak" / "meta.json").is_file()


# ---- 4. damaged run records: one line naming the file ------------------------------------------------------------
@pytest.mark.parametrize("text,fragment", [
    ("[1]", "is not a polyrl run record (it holds a list, not an object)"),
    ('{"model_type": "llama", "vocab_size": 50}', 'is not a polyrl run record (it has no "config" object)'),
    ('{"config": [1]}', 'its "config" is a list, not an object'),
])
def test_a_config_json_that_is_not_a_run_record_is_refused(run, capsys, text, fragment):
    (run / "config.json").write_text(text)
    before = (run / "metrics.jsonl").read_text()
    code, err = _cli(["train", "--run-dir", run, "--resume", "--steps", "3"], capsys)
    _one_line(code, err, f"{run / 'config.json'}", fragment)
    assert (run / "metrics.jsonl").read_text() == before  # refused before anything was touched


def test_a_history_line_cut_by_a_kill_is_skipped_and_not_glued_to(tmp_path):
    (tmp_path / "config.json").write_text('{"config": {"steps": 2, "lr": 0.1}}')
    history = tmp_path / "config_history.jsonl"
    history.write_text('{"changes": {"steps": [2, 3]}}\n{"changes": {"steps": [3, 9')
    assert effective_config(tmp_path) == {"steps": 3, "lr": 0.1}
    record_resume(tmp_path, 3, "step_000003", {"steps": [3, 4]})
    assert effective_config(tmp_path) == {"steps": 4, "lr": 0.1}
    assert len(history.read_text().splitlines()) == 2
    history.write_text('{"changes": {"steps": [2, 3]}}\n{"chan\n{"changes": {}}\n')
    with pytest.raises(ConfigError, match=r"config_history.jsonl line 2 is not valid JSON"):
        effective_config(tmp_path)
    history.write_text('{"changes": {"steps": 3}}\n')
    with pytest.raises(ConfigError, match=r"config_history.jsonl line 1 is not a resume record"):
        effective_config(tmp_path)


def test_resume_with_a_cut_history_line(run, capsys):
    (run / "config_history.jsonl").write_text('{"time": "x", "resumed_at_step": 2, "chan')
    code, err = _cli(["train", "--run-dir", run, "--resume", "--steps", "3"], capsys)
    assert code == 0, err
    lines = [json.loads(x) for x in (run / "config_history.jsonl").read_text().splitlines()]
    assert [x["changes"] for x in lines] == [{"steps": [2, 3]}]


@pytest.mark.parametrize("drop,fragment", [
    ("files", "meta.json has files = None; allowed: an object of file name -> SHA-256"),
    ("step", "meta.json has step = None; allowed: an integer >= 0"),
])
def test_a_meta_json_without_files_or_step_is_one_line(run, capsys, drop, fragment):
    meta_path = run / "checkpoints" / "step_000002" / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta[drop]
    meta_path.write_text(json.dumps(meta))
    code, err = _cli(["train", "--run-dir", run, "--resume", "--steps", "3"], capsys)
    _one_line(code, err, f"checkpoint {meta_path.parent}: {fragment}",
              f"--resume-from {run / 'checkpoints' / 'step_000001'}")
    meta_path.write_text("[1]")
    code, err = _cli(["train", "--run-dir", run, "--resume-from", meta_path.parent, "--steps", "3"], capsys)
    _one_line(code, err, "meta.json holds a list")


def test_family_overwrite_keeps_a_file_the_command_reads(tmp_path, capsys):
    """`polyrl q train --config RUN/my.toml --overwrite` deleted my.toml with the old run (start_run_dir without
    the command's settings)."""
    run = tmp_path / "q1"
    assert main(["q", "train", "--steps", "2", "--run-dir", str(run)]) == 0
    (run / "my.toml").write_text("steps = 2\n")
    capsys.readouterr()
    code = main(["q", "train", "--config", str(run / "my.toml"), "--run-dir", str(run), "--overwrite"])
    err = capsys.readouterr().err
    assert code == 2 and "which this run reads" in err and err.count("\n") == 1, err
    assert (run / "my.toml").is_file() and (run / "summary.json").is_file()


def test_a_damaged_report_summary_is_one_line(tmp_path):
    """A summary.json cut short by a kill (it is not written atomically) stopped `duplex report` with a traceback."""
    from polyrl.families.reuse import finished

    (tmp_path / "summary.json").write_text('{"steps": 3, "con')
    with pytest.raises(ConfigError, match="summary.json cannot be read .*--overwrite") as e:
        finished(tmp_path)
    assert "\n" not in str(e.value)


FAMILY_TRAIN = {"flow": "polyrl.families.flow.train.train_flow", "q": "polyrl.families.q.train.train_q",
                "marl": "polyrl.families.marl.train.train_marl", "duplex": "polyrl.families.duplex.train.train_duplex"}


def _old_run(run):
    run.mkdir(parents=True)
    (run / "config.json").write_text('{"config": {"steps": 7}}')
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    return {p.name: p.read_bytes() for p in run.iterdir()}


@pytest.mark.parametrize("family", sorted(FAMILY_TRAIN))
def test_family_overwrite_puts_the_old_run_back_when_the_new_one_never_started(family, tmp_path, capsys, monkeypatch):
    """`polyrl flow train --overwrite` deleted the old run before pretraining its policy: Ctrl-C (or a failure) there
    lost it. The old run is now set aside and comes back byte for byte; nothing hidden is left beside it."""
    run = tmp_path / "old"
    before = _old_run(run)

    def stopped(*a, **k):
        assert not (run / "metrics.jsonl").exists() and (run / "config.json").exists()  # set aside, new record
        raise KeyboardInterrupt

    monkeypatch.setattr(FAMILY_TRAIN[family], stopped)
    code = main([family, "train", "--run-dir", str(run), "--overwrite"])
    err = capsys.readouterr().err
    assert code == 130 and "old run there is as it was" in err, err
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]


def test_family_overwrite_replaces_a_started_run_and_recovers_a_killed_one(tmp_path, capsys, monkeypatch):
    """A new run that started (it wrote more than config.json) replaces the old one even when it fails later; a copy
    left aside by a killed command is put back by the next command, which then refuses without --overwrite."""
    from polyrl.runs import aside_path

    run = tmp_path / "old"
    _old_run(run)

    def fails_after_a_step(*a, run_dir, **k):
        (Path(run_dir) / "metrics.jsonl").write_text('{"step": 1, "new": true}\n')
        raise ConfigError("stopped after a step")

    monkeypatch.setattr(FAMILY_TRAIN["q"], fails_after_a_step)
    assert main(["q", "train", "--run-dir", str(run), "--overwrite"]) == 2
    assert '"new"' in (run / "metrics.jsonl").read_text() and '"steps": 7' not in (run / "config.json").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    run.rename(aside_path(run))  # as a SIGKILL between the set-aside and the new run's start leaves it
    code = main(["q", "train", "--run-dir", str(run)])
    err = capsys.readouterr().err
    assert code == 2 and "put back the run" in err and "already holds a run" in err, err
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def test_family_run_refused_before_it_started_leaves_no_record(tmp_path, capsys, monkeypatch):
    """A new run stopped before it wrote anything but its config.json left that file, so the corrected command was
    refused as a rerun ("already holds a run"); the record and the directory the command made are now removed."""
    run = tmp_path / "new"

    def refused(*a, **k):
        raise ConfigError("refused while the parts were built")

    monkeypatch.setattr(FAMILY_TRAIN["q"], refused)
    assert main(["q", "train", "--run-dir", str(run)]) == 2
    assert not run.exists()
    monkeypatch.undo()
    capsys.readouterr()
    assert main(["q", "train", "--steps", "2", "--run-dir", str(run)]) == 0 and (run / "summary.json").is_file()


def test_a_signal_while_a_reward_function_runs_is_not_reported_as_its_exit():
    """SIGTERM during scoring ended `polyrl train` with "reward function ... called sys.exit(143)" and exit code 2;
    a function's own sys.exit is still that one line."""
    from polyrl.errors import RewardError, Terminated
    from polyrl.tasks.arithmetic import AdditionTask
    from polyrl.tasks.rewards import RewardChannels

    task = AdditionTask()
    prompts = task.prompts("train", 2, 0)
    channels = RewardChannels(task, ["tests.reward_fns:digit_fraction"])

    def signalled(**kw):
        raise Terminated(143)

    def exits(**kw):
        raise SystemExit(3)

    channels._fns = [signalled]
    with pytest.raises(Terminated):
        channels(prompts, ["1", "2"])
    channels._fns = [exits]
    with pytest.raises(RewardError, match=r"called sys.exit\(3\)"):
        channels(prompts, ["1", "2"])


def test_train_refusals_found_in_review(tiny_model, run, tmp_path, capsys, monkeypatch):
    """Inputs that ran with an effect nobody asked for, or ended in a traceback; each is now one line, exit 2, and
    leaves the run as it was."""
    monkeypatch.chdir(tmp_path)
    before = {p.name for p in run.rglob("*")}
    record = (run / "config.json").read_text()
    dup = tmp_path / "dup.toml"
    dup.write_text("lora_rank = 2\n[lora]\nrank = 4\n")
    cases = [
        # an empty --run-dir meant the default run directory, which --overwrite then replaced
        ([*_small(tiny_model, ""), "--overwrite"], ["run_dir = ''", "is not allowed"]),
        # fewer steps than the checkpoint: nothing trained, and the record said 1 beside a 2-step checkpoint
        (["train", "--run-dir", run, "--resume", "--steps", "1"], ["steps = 1 is not allowed", ">= 2"]),
        (["train", "--run-dir", run, "--no-resume", "--resume-from", run / "checkpoints" / "step_000002"],
         ["resume = false and resume_from", "contradict"]),
        ([*_small(tiny_model, tmp_path / "n"), "--config", dup], ["'lora.rank' and 'lora_rank' both set"]),
        ([*_small(tiny_model, tmp_path / "n"), "--advantage", "grpo:eps=inf"], ["'eps' = inf is out of range"]),
        ([*_small(tiny_model, tmp_path / "n"), "--advantage", "grpo:eps=1,eps=2"], ["'eps' is given twice"]),
        ([*_small(tiny_model, tmp_path / "n"), "--max-new-tokens", "99999999999999999999"], ["below 2**63"]),
        ([*_small(tiny_model, tmp_path / "n"), "--threads", "99999999999"], ["threads = 99999999999"]),
        ([*_small(tiny_model, tmp_path / "n"), "--train-prompts", "1000000000"], ["train_prompts = 1000000000"]),
        # a 1e8-prompt step ran out the clock building its batch
        ([*_small(tiny_model, tmp_path / "n"), "--prompts-per-step", "100000000"], ["at most 1000000 rollouts"]),
        ([*_small(tiny_model, tmp_path / "n"), "--eval-prompts", "100000000"], ["eval_prompts = 100000000"]),
        ([*_small(tiny_model, tmp_path / "n"), "--agency", ""], ["agency = ''"]),
        ([*_small(tiny_model, tmp_path / ("a" * 300))], ["is 300 bytes long"]),
        ([*_small(tiny_model, tmp_path / "n"), "--method", "opd", "--teacher", run],
         ["teacher = ", "no tokenizer"]),
    ]
    for argv, words in cases:
        code, err = _cli(argv, capsys)
        _one_line(code, err, *words)
    assert {p.name for p in run.rglob("*")} == before and (run / "config.json").read_text() == record
    assert not (tmp_path / "n").exists()


def test_nan_next_token_distribution_stops_training_in_one_line():
    """--lr 1e39 (inf in float32) or --temperature 1e-50 gave NaN logits, and sampling failed with "index 85 is out
    of bounds"; it is now a TrainingError naming the cause."""
    from polyrl.errors import TrainingError
    from polyrl.rollout.generator import SamplingParams
    from polyrl.rollout.hf import _pick

    logits = torch.zeros(2, 5)
    token, logp, _ = _pick(logits, SamplingParams(temperature=1.0), torch.tensor([0.1, 0.9]))
    assert token.tolist() == [0, 4] and torch.allclose(logp, torch.full((2,), -math.log(5)))
    logits[1, 2] = float("nan")
    with pytest.raises(TrainingError, match="nan while sampling"):
        _pick(logits, SamplingParams(temperature=1.0), torch.tensor([0.1, 0.9]))
    for temperature in (1e-50, 0.0):  # logits / T overflow; greedy takes the nan as its maximum
        finite = torch.tensor([[1.0, 2.0, 3.0]]) if temperature else torch.tensor([[1.0, float("nan"), 3.0]])
        with pytest.raises(TrainingError, match="nan while sampling"):
            _pick(finite, SamplingParams(temperature=temperature), torch.tensor([0.5]))


def test_a_refused_run_beside_its_own_toml_can_be_run_again(tiny_model, tmp_path, capsys, monkeypatch):
    """A run directory holding the command's own --config TOML: a run refused while it was built left its config.json
    (the TOML made it look started), and the corrected command was refused with and without --overwrite."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "train.toml").write_text("steps = 1\n")
    argv = [*_small(tiny_model, "r"), "--config", "r/train.toml", "--lora-rank", "2"]
    code, err = _cli([*argv, "--lora-targets", "q_proj,bogus_proj"], capsys)
    _one_line(code, err, "bogus_proj matches no module")
    assert [p.name for p in (tmp_path / "r").iterdir()] == ["train.toml"]
    assert _cli(argv, capsys)[0] == 0 and (tmp_path / "r" / "summary.json").is_file()
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "flow.toml").write_text("steps = 1\n")

    def refused(*a, **k):
        raise ConfigError("refused while its parts were built")

    monkeypatch.setattr(FAMILY_TRAIN["flow"], refused)
    flow = ["flow", "train", "--task", "reach", "--config", "f/flow.toml", "--run-dir", "f"]
    assert _cli(flow, capsys)[0] == 2
    assert [p.name for p in (tmp_path / "f").iterdir()] == ["flow.toml"]
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    assert _cli([*flow, "--groups", "2", "--group-size", "2", "--eval-samples", "4"], capsys)[0] == 0


def test_a_resume_from_flag_wins_over_a_toml_resume_false(run, tmp_path, capsys):
    """Flags override the TOML: `resume = false` there and `--resume-from` given is a resume, not a contradiction
    (which stays one for --no-resume on the command line)."""
    toml = tmp_path / "r.toml"
    toml.write_text("resume = false\n")
    code, err = _cli(["train", "--config", toml, "--run-dir", run, "--resume-from",
                      run / "checkpoints" / "step_000002", "--steps", "3"], capsys)
    assert code == 0, err
    assert json.loads((run / "summary.json").read_text())["steps"] == 3


def test_a_resume_without_the_runs_plugin_names_the_plugin(tmp_path, tiny_model):
    """It said "unknown trust_region 'resume_tr' (did you mean ...?)", as if the run had a typo: config.json did not
    record the --plugin the run was trained with."""
    import subprocess
    import sys

    plugin = tmp_path / "resume_parts.py"
    plugin.write_text("from polyrl.registry import TRUST_REGIONS\n\n@TRUST_REGIONS.register('resume_tr')\n"
                      "def resume_tr(inp, log_ratio):\n    return -log_ratio.exp() * inp.adv, {}\n")
    run = tmp_path / "r"

    def polyrl(*argv):
        return subprocess.run([sys.executable, "-m", "polyrl.cli", *map(str, argv)], capture_output=True, text=True,
                              timeout=300)

    first = polyrl("--plugin", plugin, *_small(tiny_model, run), "--steps", "1", "--trust-region", "resume_tr")
    assert first.returncode == 0, first.stderr
    assert json.loads((run / "config.json").read_text())["plugins"] == [str(plugin)]
    refused = polyrl("train", "--resume", "--steps", "2", "--run-dir", run)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert f"was trained with --plugin {plugin}" in refused.stderr and "--resume" in refused.stderr
    resumed = polyrl("--plugin", plugin, "train", "--resume", "--steps", "2", "--run-dir", run)
    assert resumed.returncode == 0, resumed.stderr


def test_a_late_rank_of_an_overwrite_leaves_the_set_aside_run_to_rank_0(tmp_path, monkeypatch):
    """`train --overwrite --nproc 2` with rank 1 starting after rank 0 had set the old run aside: rank 1 took it for the
    leftover of a killed --overwrite and refused, the command failed and the old run stayed hidden."""
    from polyrl.build import _recover_replaced
    from polyrl.runs import aside_path

    run = tmp_path / "r"
    run.mkdir()
    aside_path(run).mkdir()
    monkeypatch.setattr("polyrl.launch.world", lambda: (1, 2))
    _recover_replaced(str(run), [], overwrite=True)  # rank 0's own set-aside: nothing to say
    assert aside_path(run).is_dir()
    with pytest.raises(ConfigError, match="an earlier --overwrite left the old run in"):
        _recover_replaced(str(run), [], overwrite=False)  # a resume must not read a directory being put back


def test_a_refusal_of_a_rank_other_than_0_is_printed_and_says_whose(tmp_path):
    """Only rank 0's refusals were printed: one that only rank 1 raises (the set-aside run above) ended the launch with
    exit 2 and no reason."""
    import subprocess
    import sys

    (tmp_path / "run").mkdir()
    (tmp_path / ".run.replaced").mkdir()
    proc = subprocess.run([sys.executable, "-m", "polyrl", "train", "--run-dir", "run", "--resume", "--steps", "1"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RANK": "1", "WORLD_SIZE": "2"})
    assert proc.returncode == 2 and proc.stderr.startswith("polyrl: rank 1: error: run_dir = 'run': an earlier"), \
        proc.stderr


def test_a_resume_knows_the_runs_plugin_by_its_name_wherever_it_lies(tmp_path):
    """The recorded plugin was compared as an absolute path: a run copied to another machine, or its plugin given as
    a module instead of a file, could never be resumed."""
    from polyrl.build import _check_plugins

    (tmp_path / "config.json").write_text(json.dumps({"config": {}, "plugins": ["/home/old/proj/my_parts.py"]}))
    _check_plugins(str(tmp_path), ["elsewhere/my_parts.py"])
    _check_plugins(str(tmp_path), ["pkg.my_parts"])
    with pytest.raises(ConfigError, match="was trained with --plugin /home/old/proj/my_parts.py"):
        _check_plugins(str(tmp_path), ["other_parts.py"])
