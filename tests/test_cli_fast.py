"""The everyday commands start fast (no torch), the catalog manifest is fresh, and typos get a did-you-mean."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from polyrl.catalog import all_methods, method_dict
from polyrl.cli import main
from polyrl.config import ConfigError, load_toml
from polyrl.manifest import MANIFEST_PATH, build_manifest, load_manifest, render_manifest

DOCS = Path(__file__).resolve().parents[1] / "docs" / "methods.md"
WIDE_COLUMNS = ("method", "advantage", "ratio", "trust_region", "aggregation", "kl", "shapers/filters/corrections")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "polyrl", *args], capture_output=True, text=True, timeout=120)


def heavy_modules_after(argv: list[str]) -> list[str]:
    """Run ``main(argv)`` in a fresh interpreter; the heavy modules it imported (a usage exit is fine)."""
    code = (
        "import json, sys\n"
        "from polyrl.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(json.dumps([m for m in ('torch', 'transformers') if m in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "argv",
    [
        ["methods"],
        ["methods", "--json"],
        ["methods", "--wide"],
        ["parts"],
        ["parts", "kl"],
        ["explain", "grpo"],
        ["explain", "dapo", "--json"],
        ["--help"],
        ["train", "--help"],
        ["compare", "--help"],
        ["train", "--stpes", "5"],
    ],
)
def test_everyday_commands_import_no_torch(argv):
    assert heavy_modules_after(argv) == []


def test_manifest_is_fresh():
    assert MANIFEST_PATH.read_text() == render_manifest(build_manifest()), "polyrl/catalog.json is stale: make docs"


def test_methods_json_from_the_manifest_equals_the_live_registries():
    out = run("methods", "--json")
    assert out.returncode == 0, out.stderr
    live = json.loads(json.dumps([method_dict(m) for m in all_methods()], default=str))
    assert json.loads(out.stdout) == live


@pytest.mark.parametrize("argv", [["explain", "dapo"], ["parts"], ["methods"]])
def test_without_a_manifest_the_registries_print_the_same(argv, monkeypatch, capsys):
    assert main(argv) == 0
    from_manifest = capsys.readouterr().out
    monkeypatch.setattr("polyrl.manifest.load_manifest", lambda: None)  # e.g. a broken install
    assert main(argv) == 0
    assert capsys.readouterr().out == from_manifest


def test_explain_with_an_override_still_validates():
    out = run("explain", "dapo", "--trust-region", "clip:eps_hgih=0.3")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown parameter 'eps_hgih' (did you mean 'eps_high'?)" in lines[0], out.stderr


def test_explain_of_an_unknown_preset_names_the_nearest():
    out = run("explain", "grpp")
    assert out.returncode == 2 and "unknown method 'grpp' (did you mean 'grpo'?)" in out.stderr, out.stderr


def test_methods_table_fits_100_columns_and_wide_has_every_column():
    compact = run("methods")
    assert compact.returncode == 0, compact.stderr
    lines = compact.stdout.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 100
    manifest = load_manifest()
    for entry in manifest["methods"]:  # every preset and its main parts are there
        for name in (entry["name"], entry["dict"]["advantage"]["name"], entry["dict"]["aggregation"]["name"]):
            assert name in compact.stdout, name
    wide = run("methods", "--wide")
    assert wide.returncode == 0, wide.stderr
    header = next(line for line in wide.stdout.splitlines() if " method " in line)
    for col in WIDE_COLUMNS:
        assert f" {col} " in header, col
    assert max(len(line.rstrip()) for line in wide.stdout.splitlines()) > 100  # the compact table is not just wrapped


def test_misspelled_flag_gets_one_line_with_did_you_mean(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--stpes", "5"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == "polyrl: error: unrecognized arguments: --stpes (did you mean --steps?)"
    with pytest.raises(SystemExit):
        main(["methods", "--jsno"])
    assert capsys.readouterr().err.strip() == "polyrl: error: unrecognized arguments: --jsno (did you mean --json?)"
    with pytest.raises(SystemExit):
        main(["methods", "--zzz", "extra"])
    assert capsys.readouterr().err.strip() == "polyrl: error: unrecognized arguments: --zzz"


def test_misspelled_toml_key_gets_did_you_mean(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text("method = 'grpo'\nmax-grad-nrom = 0.5\n")
    with pytest.raises(ConfigError, match=r"'max-grad-nrom' \(did you mean 'max_grad_norm'\?\); allowed: "):
        load_toml(config)
    config.write_text("zzzzzz = 1\n")
    with pytest.raises(ConfigError) as err:
        load_toml(config)
    assert "did you mean" not in str(err.value)
    config.write_text("stpes = 5\n")
    assert main(["train", "--config", str(config)]) == 2
    assert "unknown field 'stpes' (did you mean 'steps'?)" in capsys.readouterr().err


def test_docs_check_finds_a_stale_manifest(tmp_path):
    stale = tmp_path / "catalog.json"
    stale.write_text("{}\n")
    out = run("docs", "--check", str(DOCS), "--manifest", str(stale))
    assert out.returncode == 1 and f"{stale} is stale" in out.stderr, out.stderr
    assert run("docs", "--write", str(tmp_path / "methods.md"), "--manifest", str(stale)).returncode == 0
    assert stale.read_text() == MANIFEST_PATH.read_text()


def test_checkpoint_error_is_one_class_wherever_imported():
    from polyrl.checkpoint import CheckpointError as from_checkpoint
    from polyrl.errors import CheckpointError as from_errors

    assert from_checkpoint is from_errors


def test_docs_paths_that_are_not_text_files_and_a_manifest_alone_are_one_line(tmp_path, capsys):
    binary = tmp_path / "bin.md"
    binary.write_bytes(bytes(range(128, 256)))
    for argv, fragment in [
        (["docs", "--check", str(tmp_path)], f"--check '{tmp_path}' is a directory; allowed: the path of a file"),
        (["docs", "--write", str(tmp_path / "m.md"), "--manifest", str(tmp_path)], "--manifest"),
        (["docs", "--check", str(DOCS), "--manifest", str(binary)], "cannot be read (not UTF-8 text)"),
        (["docs", "--manifest", str(tmp_path / "m.json")], "has no effect without --write or --check"),
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert fragment in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "m.json").exists() and not (tmp_path / "m.md").exists()


@pytest.mark.parametrize("command", [["train"], ["flow", "train"], ["q", "train"], ["duplex", "train"],
                                     ["marl", "train"], ["marl", "report"]])
def test_a_second_config_file_is_refused_not_dropped(tmp_path, capsys, command):
    first, second = tmp_path / "a.toml", tmp_path / "b.toml"
    first.write_text("steps = 1\n")
    second.write_text("seed = 3\n")
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--config", str(first), "--config", str(second)])
    assert exit_.value.code == 2
    assert "--config given twice" in capsys.readouterr().err
