"""The evidence report (issue 22): registry completeness, rendering, doc-matches-results and a tiny end-to-end run."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from polyrl.lab.claim_types import Budget
from polyrl.lab.claims import CLAIMS, arm_key
from polyrl.lab.evidence import decision_dict, render_markdown, run_evidence

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "evidence" / "results.json"


def test_every_claim_is_complete():
    assert len(CLAIMS) >= 9
    for cid, c in CLAIMS.items():
        assert c.id == cid and c.seed_text.strip() and c.setup.strip() and c.limits.strip() and c.title.strip()
        assert c.seed_source.startswith("seeds/") and c.quick.seeds >= 1 and c.full.seeds >= c.quick.seeds
        if c.stability:
            assert c.full.seeds >= 5, cid


def test_seed_text_is_verbatim_from_the_seed_documents():
    seeds = Path("/work/shared/seeds")
    if not seeds.is_dir():
        pytest.skip("seed documents not present on this machine")
    for c in CLAIMS.values():
        assert c.seed_text in (seeds / Path(c.seed_source).name).read_text(), c.id


def test_arm_key_shares_runs_and_separates_settings():
    assert arm_key("grpo", ["--a", "1"], ["--steps", "5"], 5) == arm_key("grpo", ["--a", "1"], ["--steps", "5"], 5)
    assert arm_key("grpo", [], [], 5) != arm_key("grpo", [], [], 6)
    assert arm_key("grpo", [], [], 5) != arm_key("dapo", [], [], 5)


def _results(verdict: str, seeds_needed):
    effect = {"name": "entropy gain", "estimate": 0.25, "lo": -0.5, "hi": 1.0, "level": 0.9, "n": 3, "sd": 0.4}
    decision = {"verdict": verdict, "reason": "the rule's sentence.", "effects": [effect], "numbers": {},
                "seeds_needed": seeds_needed}
    samples = {"arms": {"a": {"x": [1.0, 2.0]}, "b": {"x": [3.0, 5.0]}}, "curves": {}, "wall_seconds": 1.0}
    return {"budget": "quick", "generated_by": "polyrl evidence", "claims": {
        "dapo_clip_higher": {"samples": samples, "decision": decision, "budget": {"seeds": 2, "steps": 3},
                             "wall_seconds": 12.0}}}


def test_render_markdown_states_the_verdict_and_what_would_settle_it():
    md = render_markdown(_results("inconclusive", 17), CLAIMS)
    assert "**Verdict: inconclusive.** the rule's sentence." in md
    assert "Seeds that would settle it: 17 per arm." in md
    assert "| a | 1.5 |" in md and "| b | 4 |" in md  # per-arm means of the per-seed numbers
    assert "| entropy gain | 0.25 | [-0.5, 1] | 0.9 | 3 |" in md
    assert f"> {CLAIMS['dapo_clip_higher'].seed_text}" in md
    held = render_markdown(_results("holds", None), CLAIMS)
    assert "**Verdict: holds.**" in held and "Seeds that would settle it" not in held


def test_doc_matches_committed_results():
    if not RESULTS.exists():
        pytest.skip("docs/evidence/results.json not generated yet (polyrl evidence --budget full)")
    def no_nan(constant):  # JSON has no NaN or Infinity: a strict reader (a browser, jq) refuses the file
        raise AssertionError(f"results.json holds {constant}")

    results = json.loads(RESULTS.read_text(), parse_constant=no_nan)
    assert (ROOT / "docs" / "evidence.md").read_text() == render_markdown(results, CLAIMS)
    for cid, c in results["claims"].items():  # the committed verdicts are the rule's, decided from their samples
        assert decision_dict(CLAIMS[cid].decide(c["samples"])) == json.loads(json.dumps(c["decision"])), cid
    assert results["budget"] == "full"
    for cid, c in results["claims"].items():
        assert c["budget"]["seeds"] >= (5 if CLAIMS[cid].stability else 1), cid


def test_run_evidence_end_to_end_micro(tmp_path):
    t0 = time.perf_counter()
    res = run_evidence(["drgrpo_length_bias"], Budget(1, 3), workers=2, out=tmp_path, registry=CLAIMS)
    c = res["claims"]["drgrpo_length_bias"]
    assert set(c["samples"]["arms"]) == {"seq_mean", "dr_grpo"}
    assert len(c["samples"]["arms"]["dr_grpo"]["final_accuracy"]) == 1
    assert c["decision"]["verdict"] in ("holds", "holds partly", "does not hold at this scale", "inconclusive")
    assert (tmp_path / "drgrpo_length_bias" / "samples.json").exists()
    again = run_evidence(["drgrpo_length_bias"], Budget(1, 3), workers=2, out=tmp_path, registry=CLAIMS)
    same = json.dumps(again["claims"]["drgrpo_length_bias"]["samples"]) == json.dumps(c["samples"])
    assert same  # the saved samples are reused, not rerun
    assert time.perf_counter() - t0 < 60


def _evidence(capsys, *argv):
    from polyrl.cli import main

    rc = main(["evidence", *argv])
    cap = capsys.readouterr()
    return rc, [ln for ln in cap.err.strip().splitlines() if ln.strip()]


@pytest.mark.parametrize("argv, fragment", [
    (["--workers", "0", "--report-only"], "workers = 0 is not allowed; allowed: an integer >= 1"),
    (["--list", "--workers", "-3", "--report-only", "--budget", "full", "--write-docs"], "workers = -3"),
    (["--list", "--budget", "full", "--out", "/nonexistent", "--report-only", "--no-write-docs"],
     "--budget full, --out /nonexistent, --report-only, --no-write-docs: no effect with --list"),
    (["--list", "--workers", "4"], "--workers 4: no effect with --list"),
    (["--report-only", "--claims", "dapo_clip_higher"], "--claims dapo_clip_higher: no effect with --report-only"),
    (["--report-only", "--workers", "3"], "--workers 3: no effect with --report-only"),
])
def test_cli_refuses_bad_workers_and_ignored_options_in_one_line(argv, fragment, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text(json.dumps(_results("holds", None)))
    rc, err = _evidence(capsys, *argv, *([] if "--out" in argv or "--list" in argv else ["--out", str(out)]))
    assert rc == 2 and len(err) == 1 and fragment in err[0], err
    assert sorted(p.name for p in out.iterdir()) == ["results.json"]  # no report was written


def test_cli_list_takes_claims_and_report_only_reports_every_claim(tmp_path, capsys):
    """--report-only decides each claim again from its samples: a report after a change of the rule states the
    rule's verdict, not the one saved with the results."""
    assert _evidence(capsys, "--list", "--claims", "dapo_clip_higher")[0] == 0
    for empty in (",", ""):  # ran nothing and wrote an empty report (or, for "", every claim), exit 0
        code, err = _evidence(capsys, "--claims", empty, "--out", str(tmp_path / "none"))
        assert code == 2 and f"claims = {empty!r} names no claim" in err[-1] and not (tmp_path / "none").exists()
    results = _results("holds", None)
    claim = results["claims"]["dapo_clip_higher"]
    claim["samples"] = {"arms": {arm: {"entropy_last_quarter": [0.5, 0.52, 0.49], "final_accuracy": [0.6, 0.6, 0.6]}
                                 for arm in ("clip_higher", "symmetric")}, "curves": {}, "wall_seconds": 1.0}
    claim["samples"]["arms"]["clip_higher"]["entropy_last_quarter"] = [0.9, 1.3, 0.5]  # +0.4, +0.78, +0.01
    (tmp_path / "results.json").write_text(json.dumps(results))
    assert _evidence(capsys, "--report-only", "--out", str(tmp_path))[0] == 0
    md = (tmp_path / "evidence.md").read_text()
    assert "## dapo_clip_higher" in md and "**Verdict: inconclusive.**" in md and "the rule's sentence" not in md


@pytest.mark.parametrize("held, argv, fragment", [
    ("{", ["--report-only"], "cannot be read as JSON"),  # a JSONDecodeError traceback
    ("{}", ["--report-only"], "is not an evidence results.json"),  # KeyError: 'claims'
    ('{"methods": {}, "ranking": []}', ["--claims", "dapo_clip_higher"], "is not an evidence results.json"),
    ("[1]", ["--claims", "dapo_clip_higher"], "it holds list"),  # AttributeError: 'list' object has no 'update'
    ("QUICK", ["--report-only", "--budget", "full"], "holds the 'quick' budget's evidence"),  # wrote docs/ from it
    ("QUICK", ["--claims", "dapo_clip_higher", "--budget", "full"], "holds the 'quick' budget's evidence"),
])
def test_an_out_that_holds_no_evidence_of_this_budget_is_refused_before_anything_runs(held, argv, fragment,
                                                                                       tmp_path, capsys, monkeypatch):
    """A damaged results.json was a traceback; a compare's --out had the evidence merged into its results.json; and
    --report-only --budget full wrote docs/evidence from quick-budget results."""
    monkeypatch.chdir(tmp_path)  # docs/ would be written here
    monkeypatch.setattr("polyrl.lab.evidence.run_evidence", lambda *a, **k: pytest.fail("a claim ran"))
    out = tmp_path / "out"
    out.mkdir()
    text = json.dumps(_results("holds", None)) if held == "QUICK" else held
    (out / "results.json").write_text(text)
    rc, err = _evidence(capsys, *argv, "--out", str(out))
    assert rc == 2 and len(err) == 1 and fragment in err[0], err
    assert [p.name for p in out.iterdir()] == ["results.json"] and (out / "results.json").read_text() == text
    assert not (tmp_path / "docs").exists()


def test_run_evidence_and_pmap_refuse_workers_below_one(tmp_path):
    from polyrl.lab.claims_families import _pmap

    with pytest.raises(ValueError, match="workers = 0 is not allowed"):
        run_evidence(["drgrpo_length_bias"], Budget(1, 3), workers=0, out=tmp_path / "o", registry=CLAIMS)
    assert not (tmp_path / "o").exists()
    with pytest.raises(ValueError, match="workers = 0 is not allowed"):
        _pmap(lambda x: x, [(1,)], 0)
    assert _pmap(lambda x: x * 2, [(1,), (2,)], 1) == [2, 4]


def test_evidence_refuses_a_file_as_out_and_a_second_command_on_one_out(tmp_path, capsys):
    """--out FILE was a FileExistsError traceback; two commands on one --out each read results.json at their start
    and the later write lost the other's claims (now the second is refused: compare's run_lock)."""
    from polyrl.runs import run_lock

    (tmp_path / "file").write_text("x")
    rc, err = _evidence(capsys, "--claims", "lambda_target", "--out", str(tmp_path / "file"))
    assert rc == 2 and len(err) == 1 and "--out = " in err[0] and "file" in err[0], err
    out = tmp_path / "out"
    out.mkdir()
    with run_lock(out, "out"):
        rc, err = _evidence(capsys, "--claims", "lambda_target", "--out", str(out))
    assert rc == 2 and len(err) == 1 and "out = " in err[0], err
    assert list(out.iterdir()) == []


def test_a_failed_run_inside_a_claim_stops_in_one_line(tmp_path, capsys):
    """A run that failed came out as a RuntimeError traceback (the lab raised RuntimeError, which main re-raises)."""
    (tmp_path / "lambda_target").mkdir()
    (tmp_path / "lambda_target" / "every_step-s0").write_text("a file where the run directory goes")
    rc, err = _evidence(capsys, "--claims", "lambda_target", "--out", str(tmp_path), "--workers", "1")
    assert rc == 1 and err[-1].startswith("polyrl: training stopped: polyrl q train every_step failed"), err
    assert not any("Traceback" in line for line in err)


def test_the_agency_claim_finds_its_warm_start_from_any_directory_and_shows_it_relative(tmp_path, monkeypatch):
    """The baseline's path was relative to the current directory: from anywhere but the checkout every agency run
    failed ("must be an existing local model directory") after the baselines had trained."""
    from polyrl.lab.claims import _agency_arms

    monkeypatch.chdir(tmp_path)
    flags = _agency_arms(Budget(1, 3))["agency"][1]
    path = Path(flags[flags.index("--agency") + 1])
    assert path.is_absolute() and (path / "config.json").exists()
    setup = CLAIMS["agency_never_worse"].setup
    assert "agency = `grpo --agency polyrl/warmstarts/addition --agency-schedule" in setup  # the same text anywhere


def test_reports_draw_their_figures_into_out_and_copy_them_to_docs(tmp_path):
    """With docs the figures went only to docs/evidence/, and OUT/evidence.md linked images that did not exist."""
    from polyrl.lab.evidence import write_reports

    out, docs = tmp_path / "out", tmp_path / "docs"
    out.mkdir()
    write_reports(_results("holds", None), CLAIMS, out, docs=docs)
    assert "evidence/dapo_clip_higher.png" in (out / "evidence.md").read_text()
    assert (out / "evidence" / "dapo_clip_higher.png").exists()
    assert (docs / "evidence" / "dapo_clip_higher.png").exists()
    assert (docs / "evidence.md").read_text() == (out / "evidence.md").read_text()


def test_a_terminated_evidence_command_stops_the_runs_it_started(tmp_path, monkeypatch, capsys):
    """SIGTERM ended `polyrl evidence` at once and its `polyrl train` child, re-parented, trained on into OUT/runs
    (compare unwinds on SIGTERM and stops its runs; evidence now does the same)."""
    import os
    import signal
    import subprocess
    import sys

    from polyrl.cli import main
    from polyrl.lab import compare as lab

    started, real = [], subprocess.Popen

    def popen(argv, **kw):  # a training run that would go on for a minute
        started.append(real([sys.executable, "-c", "import time; time.sleep(60)"], **kw))
        return started[-1]

    monkeypatch.setattr(lab.subprocess, "Popen", popen)
    monkeypatch.setattr(lab, "STOP_GRACE_S", 5.0)
    monkeypatch.setattr("polyrl.lab.claims.subprocess.run", lambda *a, **k: subprocess.CompletedProcess(a, 0, "", ""))
    # SIGTERM as a fresh command finds it (default action): a test before may have left Ray's handler installed,
    # which signals_unwind keeps, as it keeps any handler someone set
    term = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.setitimer(signal.ITIMER_REAL, 1.5)
    previous = signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
    try:
        code = main(["evidence", "--claims", "drgrpo_length_bias", "--out", str(tmp_path / "ev"), "--workers", "1"])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        signal.signal(signal.SIGTERM, term)
    assert code == 128 + signal.SIGTERM
    assert len(started) == 1 and started[0].poll() == -signal.SIGTERM  # stopped, not left training
