"""Bad inputs to ``polyrl export``, ``load_policy`` and ``--config``: one line naming the setting, never a traceback,
and never a run directory, checkpoint or unrelated directory written over."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from polyrl.checkpoint import save_checkpoint, verify_checkpoint
from polyrl.cli import main
from polyrl.config import ConfigError, load_toml
from polyrl.learner.sharded import EXPORT_MARKER
from polyrl.model import load_policy


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory):
    """A run directory as polyrl leaves it: its record naming the model, two checkpoints of the tiny model."""
    from transformers import AutoModelForCausalLM

    run = tmp_path_factory.mktemp("exports") / "run"
    model = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True)
    for step in (1, 2):
        save_checkpoint(run, step, model=model)
    (run / "config.json").write_text(json.dumps({"config": {"model": tiny_model, "steps": 2}, "method": {},
                                                 "overrides": {}}))
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    return run


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _one_line_error(capsys, *words: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("polyrl: error: ") and "\n" not in err and "Traceback" not in err, err
    for word in words:
        assert word in err, err
    return err


def _damaged(tiny_model, tmp_path, how: str) -> Path:
    bad = tmp_path / how
    shutil.copytree(tiny_model, bad)
    if how == "config":
        (bad / "config.json").write_text("{bad")
    elif how == "no_weights":
        (bad / "model.safetensors").unlink()
    elif how == "truncated":
        (bad / "model.safetensors").write_bytes((Path(tiny_model) / "model.safetensors").read_bytes()[:100])
    elif how == "tokenizer":
        (bad / "tokenizer.json").write_text("{bad")
    return bad


def test_export_never_writes_into_a_run_or_checkpoint(run, tmp_path, capsys):
    before = _digest(run)
    checkpoint = run / "checkpoints" / "step_000002"
    other = tmp_path / "other"  # another run: its checkpoint and its directory are refused as destinations too
    shutil.copytree(run, other)
    cases = [
        ([str(run), str(run)], "is the run directory"),
        ([str(run), str(run / "hf")], "inside the run directory"),
        ([str(checkpoint), str(checkpoint)], "is the checkpoint being exported"),
        ([str(checkpoint), str(checkpoint / "hf")], "is the checkpoint being exported or inside it"),
        ([str(run), str(other / "checkpoints" / "step_000001")], "checkpoint directory"),
        ([str(run), str(other)], "is a polyrl run directory"),
        ([str(run), str(run.parent)], "holds the checkpoint being exported"),
    ]
    for argv, why in cases:
        assert main(["export", *argv]) == 2, argv
        _one_line_error(capsys, f"out = {argv[1]!r}", why)
    assert _digest(run) == before  # the run record and both checkpoints untouched
    verify_checkpoint(checkpoint)
    verify_checkpoint(other / "checkpoints" / "step_000001")


def test_export_takes_the_checkpoints_folder_and_names_a_folder_inside_a_checkpoint(run, tmp_path, capsys):
    """`export RUN/checkpoints` and `export RUN/checkpoints/step_N/adapter` said the checkpoint was "incomplete or
    corrupt"; a folder of checkpoints is its run's, and a folder inside one is named as such. A step_N folder whose
    meta.json is gone is still incomplete."""
    (run / "checkpoints" / "step_000002" / "inner").mkdir()
    assert main(["export", str(run / "checkpoints" / "step_000002" / "inner"), str(tmp_path / "a")]) == 2
    _one_line_error(capsys, "inner is not a checkpoint (it is inside checkpoint", "step_000002)",
                    "allowed: a run directory or its checkpoints/step_NNNNNN")
    assert main(["export", str(run / "checkpoints"), str(tmp_path / "b")]) == 0
    assert json.loads((tmp_path / "b" / EXPORT_MARKER).read_text())["checkpoint"].endswith("step_000002")
    broken = run / "checkpoints" / "step_000009"
    broken.mkdir()
    assert main(["export", str(broken), str(tmp_path / "c")]) == 2
    _one_line_error(capsys, "has no readable meta.json", "incomplete or corrupt")
    shutil.rmtree(broken)
    (run / "checkpoints" / "step_000002" / "inner").rmdir()


def test_export_destination_must_be_new_empty_or_a_previous_export(run, tiny_model, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    assert main(["export", str(run), str(afile)]) == 2
    _one_line_error(capsys, f"out = {str(afile)!r}", "existing file")
    assert afile.read_text() == "keep me"
    for name in ("config.json", "notes.txt"):  # a model directory, or anything else, is not written over
        busy = tmp_path / f"busy_{name}"
        busy.mkdir()
        (busy / name).write_text("mine")
        assert main(["export", str(run), str(busy)]) == 2
        _one_line_error(capsys, f"out = {str(busy)!r}", "not a previous polyrl export")
        assert [p.name for p in busy.iterdir()] == [name]
    before = _digest(Path(tiny_model))
    assert main(["export", str(run), tiny_model]) == 2  # the base model itself
    _one_line_error(capsys, "not a previous polyrl export")
    assert _digest(Path(tiny_model)) == before

    out = tmp_path / "new" / "hf"  # the README's use: a new directory (parents made)
    assert main(["export", str(run), str(out)]) == 0
    first = json.loads((out / EXPORT_MARKER).read_text())
    assert first["checkpoint"] == str((run / "checkpoints" / "step_000002").resolve())
    assert main(["export", str(run / "checkpoints" / "step_000001"), str(out)]) == 0  # a previous export: replaced
    assert json.loads((out / EXPORT_MARKER).read_text())["checkpoint"].endswith("step_000001")
    assert sorted(p.name for p in out.parent.iterdir()) == ["hf"]  # no temporary or old copy left beside it
    assert out.stat().st_mode & 0o777 == 0o777 & ~_umask()  # not mkdtemp's 0700: a serving account reads it
    load_policy(out, threads=1)
    # an export killed midway: its temporary copy, and the previous export it was swapping out with `out` gone
    (out.parent / ".hf.export-abc123").mkdir()
    out.rename(out.parent / ".old_hf_4242")
    assert main(["export", str(run), str(out)]) == 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["hf"]  # both settled (they stayed, full-size, for good)
    assert json.loads((out / EXPORT_MARKER).read_text())["checkpoint"].endswith("step_000002")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["export", str(run), str(empty)]) == 0
    assert (empty / "model.safetensors").is_file() and (empty / EXPORT_MARKER).is_file()


@pytest.mark.parametrize("how", ["missing", "config", "no_weights", "truncated", "tokenizer"])
def test_export_with_a_missing_or_damaged_model_is_one_line(run, tiny_model, tmp_path, capsys, how):
    model = tmp_path / "nonexist" if how == "missing" else _damaged(tiny_model, tmp_path, how)
    out = tmp_path / "out"
    assert main(["export", str(run), str(out), "--model", str(model)]) == 2
    _one_line_error(capsys, f"model = {str(model)!r}")
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("how", ["config", "no_weights", "truncated", "tokenizer"])
def test_load_policy_names_the_damaged_model_directory(tiny_model, tmp_path, how):
    bad = _damaged(tiny_model, tmp_path, how)
    with pytest.raises(ConfigError, match="cannot be loaded") as err:
        load_policy(bad, threads=1)
    message = str(err.value)
    assert message.startswith(f"model = {str(bad)!r}: ") and "\n" not in message, message
    with pytest.raises(ConfigError, match=f"^agency_baseline = {str(bad)!r}: "):
        load_policy(bad, threads=1, setting="agency_baseline")


def test_load_policy_missing_directory_is_a_config_error_and_still_file_not_found(tmp_path):
    with pytest.raises(ConfigError, match="model directory not found") as err:
        load_policy(tmp_path / "nowhere")
    assert isinstance(err.value, FileNotFoundError)  # callers that catch FileNotFoundError still do


def test_train_with_damaged_weights_is_one_line(tiny_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("POLYRL_CACHE", str(tmp_path / "cache"))
    bad = _damaged(tiny_model, tmp_path, "truncated")
    assert main(["train", "--model", str(bad), "--steps", "1", "--run-dir", str(tmp_path / "r")]) == 2
    _one_line_error(capsys, f"model = {str(bad)!r}", "SafetensorError")


def test_config_that_is_a_directory_or_not_text_is_one_line(tmp_path, capsys):
    with pytest.raises(ConfigError, match=f"^config = {str(tmp_path)!r}: is a directory"):
        load_toml(tmp_path)
    binary = tmp_path / "run.toml"
    binary.write_bytes(b"\xff\xfe\x00steps = 1")
    with pytest.raises(ConfigError, match=f"^config = {str(binary)!r}: is not UTF-8 text"):
        load_toml(binary)
    with pytest.raises(ConfigError, match="does not exist"):
        load_toml(tmp_path / "missing.toml")
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="is not a regular file"):  # refused, not read (which would block)
        load_toml(fifo)
    assert main(["train", "--config", str(binary)]) == 2
    _one_line_error(capsys, "config = ", "is not UTF-8 text")
    assert main(["train", "--config", str(tmp_path)]) == 2
    _one_line_error(capsys, "config = ", "is a directory")
