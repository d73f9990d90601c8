"""`polyrl duplex train | report | methods`: full-duplex turn-taking RL from the command line.

``add_parser(subparsers)`` is the family seam's entry; ``check_train_flags`` serves ``polyrl compare --family
duplex``. Bad values raise ``PartError`` or ``ConfigError`` (one line naming the field, the value and what is
allowed; exit 2).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

from rich.console import Console
from rich.table import Table

from polyrl.config import ConfigError
from polyrl.families import family_config, flag_values, parse_train_flags
from polyrl.families.duplex import HELP as DUPLEX_HELP

console = Console() if sys.stdout.isatty() else Console(width=200)


def _train_config(args: argparse.Namespace):
    """The run's settings: a TOML file beneath the flags, typed and range-checked (ConfigError in one line)."""
    from polyrl.families.duplex.train import DuplexTrainConfig, validate_config

    return family_config(flag_values(args, DuplexTrainConfig), DuplexTrainConfig, validate_config)


def cmd_duplex_train(args: argparse.Namespace) -> int:
    from polyrl.families.duplex.methods import get_duplex_method
    from polyrl.families.duplex.train import train_duplex
    from polyrl.runs import saved_record, start_run_dir, write_record

    cfg = _train_config(args)
    method = get_duplex_method(args.method, advantage=args.advantage)
    run_dir = args.run_dir or f"runs/duplex/{method.name}-{cfg.task}-s{cfg.seed}"
    if args.resume:
        if args.overwrite:
            raise ConfigError("resume and overwrite are exclusive; pass one of them")
        saved = saved_record(run_dir)
        if saved is None:
            raise ConfigError(f"run_dir = '{run_dir}' holds no run to resume")
        old = {k: v for k, v in saved["config"].items() if k != "steps"}
        new = {k: v for k, v in asdict(cfg).items() if k != "steps"}
        changed = [k for k in new if old.get(k) != new[k]]
        if changed or saved.get("method") != method.name:
            what = changed[0] if changed else "method"
            raise ConfigError(f"{what} differs from the run being resumed in '{run_dir}'; only steps may change")
    else:
        start_run_dir(run_dir, overwrite=args.overwrite)
        write_record(run_dir, {"config": asdict(cfg), "method": method.name,
                               "parts": {"kind": method.kind, "advantage": str(method.advantage)}})
    console.print(f"duplex method: {method.name} ({method.kind}, advantage {method.advantage})")
    s = train_duplex(cfg, method, run_dir=run_dir, resume=args.resume, console=console)
    table = Table(title=f"{method.name} on {cfg.task}: per-axis metrics (fixed evaluation set)")
    for col in ("metric", "natural agent", "imitation baseline", "after"):
        table.add_column(col, justify="right")
    for k, v in s["metrics_after"].items():
        table.add_row(k, f"{s['natural_agent'][k]:.3f}", f"{s['metrics_before'][k]:.3f}", f"{v:.3f}")
    console.print(table)
    console.print(f"wall {s['wall_seconds']:.1f} s, {s['seconds_per_step']:.3f} s/step; run files: {run_dir}/ "
                  "(summary.json, metrics.jsonl, checkpoints/)")
    return 0


def cmd_duplex_report(args: argparse.Namespace) -> int:
    from polyrl.families.duplex.report import write_duplex_report

    if args.seeds < 1:
        raise ConfigError(f"seeds = {args.seeds} is not allowed; allowed: an integer >= 1")
    if not 0 < args.ci < 1:
        raise ConfigError(f"ci = {args.ci} is not allowed; allowed: in (0, 1)")
    cfg = _train_config(args)
    res = write_duplex_report(cfg, seeds=args.seeds, out=args.out, level=args.ci, progress=console.print)
    table = Table(title="GRPO vs imitation baseline (paired, over seeds)")
    for col in ("metric", "better", "baseline", "GRPO", "difference [interval]", "improved"):
        table.add_column(col, justify="right")
    for m, r in res["rows"].items():
        d = r["grpo_minus_baseline"]
        table.add_row(m, r["better"], f"{r['baseline']['mean']:.3f}", f"{r['grpo']['mean']:.3f}",
                      f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]", "yes" if r["improved"] else "no")
    console.print(table)
    console.print(res["verdict"])
    console.print(f"report: {res['paths']['html']}")
    return 0


def cmd_duplex_methods(args: argparse.Namespace) -> int:
    from polyrl.families.duplex.methods import DUPLEX_METHODS

    table = Table(title=f"duplex presets ({len(DUPLEX_METHODS)})")
    for col in ("name", "kind", "advantage", "paper", "summary"):
        table.add_column(col, overflow="fold")
    for name in sorted(DUPLEX_METHODS):
        m = DUPLEX_METHODS[name]()
        table.add_row(name, m.kind, str(m.advantage), m.paper, m.summary)
    console.print(table)
    return 0


def add_train_args(p: argparse.ArgumentParser, *, run: bool = True) -> None:
    """Every `polyrl duplex train` option: the preset, a TOML file, one flag per ``DuplexTrainConfig`` field."""
    from polyrl.config import add_config_args
    from polyrl.families.duplex.methods import DUPLEX_METHODS
    from polyrl.families.duplex.train import DuplexTrainConfig

    if run:
        p.add_argument("--method", default="grpo", help=f"duplex preset: {', '.join(sorted(DUPLEX_METHODS))} "
                       "(default: grpo)")
    p.add_argument("--config", metavar="FILE.toml", help="TOML file of the settings below; flags override it")
    if run:
        p.add_argument("--run-dir", help="output directory (default: runs/duplex/METHOD-TASK-sSEED)")
        p.add_argument("--overwrite", action="store_true", help="replace an existing run in --run-dir")
        p.add_argument("--resume", action="store_true",
                       help="continue the run in --run-dir from its newest checkpoint (only --steps may change)")
    add_config_args(p, DuplexTrainConfig)
    if run:
        g = p.add_argument_group("part overrides")
        g.add_argument("--advantage", help="advantage estimator of an RL preset, e.g. grpo, rloo, group_centered")


def check_train_flags(argv: list[str]) -> None:
    """Resolve `polyrl duplex train` flags without running: ConfigError/PartError in one line (`polyrl compare`)."""
    args = parse_train_flags(argv, "polyrl duplex train", add_train_args)
    from polyrl.families.duplex.methods import get_duplex_method

    _train_config(args)
    get_duplex_method(args.method, advantage=args.advantage)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``duplex`` with ``train``, ``report`` and ``methods`` to ``subparsers`` (the family seam)."""
    duplex = subparsers.add_parser("duplex", help=DUPLEX_HELP)
    sub = duplex.add_subparsers(dest="duplex_command", required=True)

    p = sub.add_parser("train", help="imitate the scripted agent, then GRPO on the simulator; writes summary.json")
    add_train_args(p)
    p.set_defaults(fn=cmd_duplex_train)

    p = sub.add_parser("report", help="imitation vs GRPO over seeds 0..N-1: per-axis intervals in report.html "
                       "(the --seed flag is ignored)")
    p.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 (default: 5)")
    p.add_argument("--out", default="runs/duplex/report", help="output directory (default: runs/duplex/report); "
                   "finished runs in it are reused")
    p.add_argument("--ci", type=float, default=0.9, help="bootstrap interval level (default: 0.9)")
    add_train_args(p, run=False)
    p.set_defaults(fn=cmd_duplex_report)

    p = sub.add_parser("methods", help="list the duplex presets")
    p.set_defaults(fn=cmd_duplex_methods)
    return duplex
