"""The command line as a user runs it (subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from polyrl.methods import PRESETS


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "polyrl", *args], capture_output=True, text=True, timeout=120,
                          env=env)


def test_methods_lists_every_preset_and_json_is_complete():
    out = run("methods", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert {m["name"] for m in data} == set(PRESETS)
    table = run("methods")
    assert table.returncode == 0
    for name in PRESETS:
        assert name in table.stdout
    both = run("methods", "--json", "--wide")  # --wide was ignored: the same JSON
    assert both.returncode == 2 and both.stderr.strip().endswith("does not apply with --json (it widens the table); "
                                                                 "drop one of them"), both.stderr


def test_explain_dapo_shows_its_parts():
    out = run("explain", "dapo")
    assert out.returncode == 0, out.stderr
    for fragment in ("token_mean", "eps_low=0.2", "eps_high=0.28", "overlong_soft", "zero_variance", "2503.14476"):
        assert fragment in out.stdout, fragment


def test_explain_says_whether_zero_advantage_rows_skip_the_backward():
    """From the shipped manifest (grpo: its KL term keeps them) and from a live override (no KL: forward only)."""
    env = {**os.environ, "COLUMNS": "400"}
    line = [ln for ln in run("explain", "grpo", env=env).stdout.splitlines() if "zero_adv_rows" in ln]
    assert len(line) == 1 and "keep the backward: its KL term (k3 x 0.04)" in line[0], line
    line = [ln for ln in run("explain", "grpo", "--kl-coef", "0", env=env).stdout.splitlines() if "zero_adv_rows" in ln]
    assert len(line) == 1 and "forward only" in line[0], line


def test_explain_with_override_resolves_and_validates():
    out = run("explain", "grpo", "--trust-region", "dppo_tv:delta_low=0.1", "--aggregation", "prompt_mean", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["trust_region"]["name"] == "dppo_tv" and data["trust_region"]["params"]["delta_low"] == 0.1
    assert data["aggregation"]["name"] == "prompt_mean"
    # an unbounded parameter is written as the string 'inf': json.dumps wrote Infinity, which strict parsers refuse
    out = run("explain", "grpo", "--trust-region", "dppo_tv:delta_low=inf", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert data["trust_region"]["params"]["delta_low"] == "inf"


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["explain", "dapo", "--trust-region", "clip:eps_hgih=0.3"], "unknown parameter 'eps_hgih'"),
        (["explain", "dapo", "--trust-region", "clip:eps_low=-1"], "'eps_low' = -1.0"),
        (["explain", "nope"], "unknown method 'nope'"),
        (["explain", "grpo", "--aggregation", "mean"], "unknown aggregation 'mean'"),
        (["explain", "grpo", "--kl-coef", "-0.1"], "kl_coef = -0.1"),
        (["--plugin", "no_such_module_xyz", "methods"], "no_such_module_xyz"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_2(args, fragment):
    out = run(*args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], out.stderr
    assert "Traceback" not in out.stderr


def test_plugin_file_registers_a_part(tmp_path):
    plugin = tmp_path / "my_parts.py"
    plugin.write_text(
        "from polyrl.registry import TRUST_REGIONS\n"
        "@TRUST_REGIONS.register('plugin_none')\n"
        "def plugin_none(inp, log_ratio):\n"
        "    '''Plain importance-weighted policy gradient.'''\n"
        "    return -log_ratio.exp() * inp.adv, {}\n"
    )
    out = run("--plugin", str(plugin), "explain", "grpo", "--trust-region", "plugin_none")
    assert out.returncode == 0, out.stderr
    assert "plugin_none" in out.stdout


def test_docs_check_detects_staleness(tmp_path):
    stale = tmp_path / "methods.md"
    stale.write_text("old\n")
    manifest = ["--manifest", str(tmp_path / "catalog.json")]  # not the package's own
    assert run("docs", "--check", str(stale), *manifest).returncode == 1
    assert run("docs", "--write", str(stale), *manifest).returncode == 0
    assert run("docs", "--check", str(stale), *manifest).returncode == 0
