"""The family seam: an RL family is a folder that registers itself; the CLI builds its parser only when it runs."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from polyrl.cli import main
from polyrl.families import FAMILIES, discover, register_family


def test_the_flow_family_registers_itself_without_importing_torch():
    code = ("import sys; from polyrl.families import discover; fams = discover(); "
            "assert 'flow' in fams and fams['flow'].module == 'polyrl.families.flow.cli', fams; "
            "assert 'torch' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_a_registered_family_gets_its_cli_command(tmp_path, monkeypatch, capsys):
    (tmp_path / "toyfam_cli.py").write_text(textwrap.dedent('''
        def add_parser(subparsers):
            p = subparsers.add_parser("toyfam", help="a toy family")
            p.add_argument("--n", type=int, default=1)
            p.set_defaults(fn=lambda args: print(f"toy n={args.n}") or 0)
            return p
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    discover()
    register_family("toyfam", "a toy family", "toyfam_cli")
    try:
        assert main(["toyfam", "--n", "3"]) == 0
        assert "toy n=3" in capsys.readouterr().out
    finally:
        FAMILIES.pop("toyfam")


def test_flow_settings_come_from_a_toml_file_beneath_the_flags(tmp_path):
    from polyrl.families.flow.cli import _train_config
    from polyrl.families.flow.train import FlowTrainConfig

    (tmp_path / "f.toml").write_text("steps = 7\nlr = 0.001\n")
    import argparse

    from polyrl.config import add_config_args

    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    add_config_args(parser, FlowTrainConfig)
    cfg = _train_config(parser.parse_args(["--config", str(tmp_path / "f.toml"), "--lr", "0.002"]))
    assert cfg.steps == 7 and cfg.lr == 0.002 and cfg.task == FlowTrainConfig().task


def test_a_command_reads_its_toml_once_so_every_part_sees_the_same_settings(tmp_path):
    """duplex asks for the given settings several times (config, method checks, resume); a file edited meanwhile
    must not give one part of the command other settings than another."""
    import argparse

    from polyrl.config import add_config_args
    from polyrl.families import flag_values
    from polyrl.families.duplex.train import DuplexTrainConfig

    toml = tmp_path / "d.toml"
    toml.write_text("steps = 7\n")
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    add_config_args(parser, DuplexTrainConfig)
    args = parser.parse_args(["--config", str(toml), "--lr", "0.002"])
    first = flag_values(args, DuplexTrainConfig)
    toml.write_text("steps = 9\n")
    assert flag_values(args, DuplexTrainConfig) == first == {"steps": 7, "lr": 0.002}


def test_the_lab_compares_flow_presets_over_seeds(tmp_path, capsys):
    out = tmp_path / "cmp"
    flags = ["--task", "reach", "--steps", "3", "--groups", "4", "--group-size", "4", "--sampler-steps", "4",
             "--eval-samples", "32", "--no-tensorboard"]
    bad = main(["compare", "--family", "flow", "--methods", "flow_grpo,fpo", "--seeds", "1", "--out", str(out),
                "--method-args", "fpo=--lr -1", *flags])
    err = capsys.readouterr().err.strip()
    assert bad == 2 and len(err.splitlines()) == 1 and "the flags for method 'fpo'" in err and "lr" in err, err
    assert not out.exists()  # refused before the first run
    assert main(["compare", "--family", "flow", "--methods", "flow_grpo,fpo", "--seeds", "1", "--out", str(out),
                 *flags]) == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["methods"]) == {"flow_grpo", "fpo"} and (out / "report.html").is_file()
    assert json.loads((out / "fpo" / "seed0" / "summary.json").read_text())["method"] == "fpo"
    # A rerun asking for other settings or parts is refused in one line: its finished runs were kept and reported as
    # the new command's. The same command keeps them; more steps train a flow run (no checkpoint) again.
    capsys.readouterr()
    for extra, named in ((["--lr", "0.01"], "lr = 0.0005, and this compare gives lr = 0.01"),
                         (["--eta", "0.5"], "'eta': 0.7")):
        assert main(["compare", "--family", "flow", "--methods", "flow_grpo,fpo", "--seeds", "1", "--out", str(out),
                     *flags, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "seed0 finished with" in err and named in err, err
    from polyrl.families.flow.cli import check_train_flags
    from polyrl.lab.compare import plan_runs

    def plan(more: list[str]):
        expected = {"fpo": check_train_flags(["--method", "fpo", *flags, *more])}
        return plan_runs(["fpo"], [0], out, [*flags, *more], {}, None, command=("flow", "train"), resumable=False,
                         expected=expected)

    assert plan([]) == []
    assert plan(["--steps", "4"])[0].args[-1] == "--overwrite"


def test_the_lab_resumes_an_interrupted_family_run_that_saved_a_checkpoint(tmp_path, capsys):
    """`compare --family duplex` said an interrupted run would be resumed, then gave it --overwrite: 154 steps were
    discarded. A family run with a checkpoint (q, duplex, marl) now continues from it; flow saves none and restarts."""
    from polyrl.families.q.cli import DEFAULT_METHOD
    from polyrl.lab.compare import plan_runs

    out = tmp_path / "cmp"
    run = out / DEFAULT_METHOD / "seed0"
    assert main(["q", "train", "--method", DEFAULT_METHOD, "--seed", "0", "--steps", "2", "--checkpoint-every", "1",
                 "--run-dir", str(run)]) == 0
    (run / "summary.json").unlink()  # as a stop between the checkpoint and the end leaves it
    assert main(["compare", "--family", "q", "--methods", DEFAULT_METHOD, "--seeds", "1", "--out", str(out),
                 "--steps", "4", "--checkpoint-every", "1"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "step" in r] == [1, 2, 3, 4]
    assert json.loads((run / "config_history.jsonl").read_text())["changes"] == {"steps": [2, 4]}
    flow = plan_runs(["fpo"], [0], out, [], {}, None, command=("flow", "train"), resumable=False)
    assert flow[0].args[-1] == "--overwrite"
