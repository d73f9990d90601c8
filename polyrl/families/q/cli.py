"""`polyrl q train | search | methods`: λ-target linear Q-learning from the command line.

``add_parser(subparsers)`` is the family seam's entry; ``check_train_flags`` serves ``polyrl compare --family
q``. Bad values raise ``ConfigError`` (one line naming the field, the value and what is allowed; exit 2).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import fields
from pathlib import Path

from rich.console import Console
from rich.table import Table

from polyrl.config import ConfigError, Once
from polyrl.families import parse_train_flags, record_of
from polyrl.families.q import HELP as Q_HELP
from polyrl.runs import files_line

console = Console() if sys.stdout.isatty() else Console(width=200)
DEFAULT_METHOD = "lambda_geometric"


def _given(args: argparse.Namespace, cls) -> dict:
    return {f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None}


def resolve_train(args: argparse.Namespace):
    """(config, method, changes) for a new run or a ``--resume`` (the run's own settings; ConfigError in one line)."""
    from polyrl.config import build_config, load_toml
    from polyrl.families.q.methods import get_q_method, method_from_record
    from polyrl.families.q.train import QTrainConfig, validate_config

    if getattr(args, "resume", False):
        from polyrl.runs import effective_config, recover_noted, resume_values, saved_record

        if args.run_dir:
            recover_noted(args.run_dir)  # an old run a killed --overwrite left aside is the one to resume
        record = saved_record(args.run_dir) if args.run_dir else None
        if record is None:
            raise ConfigError(f"run_dir = {args.run_dir!r} holds no run (config.json) to resume; pass the run's "
                              "--run-dir or start without --resume")
        if args.method is not None and args.method != record.get("method"):
            raise ConfigError(f"method = {args.method!r} differs from the run's own method = {record.get('method')!r}")
        method = method_from_record(record.get("method"), record.get("parts"))
        for name in ("lam", "period"):  # the same value again is no change (`polyrl compare --family q` repeats them)
            given = getattr(args, name)
            if given is not None and given != getattr(method, name):
                raise ConfigError(f"{name} = {given!r} differs from the run's own {name} = {getattr(method, name)!r}; "
                                  "a resume keeps the run's method: drop it")
        # a --config TOML is compared like the flags: what it repeats is no change, what it changes is refused
        given = {**(load_toml(args.config, QTrainConfig) if args.config else {}), **_given(args, QTrainConfig)}
        values, changes = resume_values(effective_config(args.run_dir), given)
        cfg = build_config(values, QTrainConfig, strict=False)  # the run's saved record
    else:
        values = load_toml(args.config, QTrainConfig) if args.config else {}
        values.update(_given(args, QTrainConfig))
        cfg, changes = build_config(values, QTrainConfig), {}
        method = get_q_method(args.method or DEFAULT_METHOD, lam=args.lam, period=args.period)
    validate_config(cfg)
    return cfg, method, changes


def _default_run_dir(method, cfg) -> str:
    """Where a run goes without --run-dir (and where --resume without it looks)."""
    return f"runs/q/{method.name}-{cfg.task}-s{cfg.seed}"


def cmd_q_train(args: argparse.Namespace) -> int:
    from polyrl.config import build_config, load_toml
    from polyrl.families.q.methods import get_q_method
    from polyrl.families.q.train import QTrainConfig
    from polyrl.runs import resume_hold

    if getattr(args, "resume", False) and not args.run_dir:  # the run a command without --run-dir made
        values = load_toml(args.config, QTrainConfig) if args.config else {}
        cfg = build_config({**values, **_given(args, QTrainConfig)}, QTrainConfig)
        method = get_q_method(args.method or DEFAULT_METHOD, lam=args.lam, period=args.period)
        args.run_dir = _default_run_dir(method, cfg)

    with resume_hold(args.run_dir if args.resume and args.run_dir else None):  # a new run is held by new_run
        return _train(args)


def _train(args: argparse.Namespace) -> int:
    from polyrl.families.q.train import CHECKPOINT, load_checkpoint, run_record, train_q
    from polyrl.runs import new_run, record_resume

    cfg, method, changes = resolve_train(args)
    if args.resume:
        if args.overwrite:
            raise ConfigError("resume and overwrite were both given; pick one")
        from polyrl.runs import check_resume_steps

        step = load_checkpoint(args.run_dir)["step"]
        check_resume_steps(cfg.steps, step, args.run_dir)  # fewer steps than done: refused before anything is written
        record_resume(args.run_dir, step, CHECKPOINT, changes)
    where = (contextlib.nullcontext(Path(args.run_dir)) if args.resume else
             new_run(args.run_dir or _default_run_dir(method, cfg), overwrite=args.overwrite,
                     inputs=vars(args), record=run_record(cfg, method)))
    with where as run_dir:
        console.print(f"q method: {method.name} = target_mode {method.target_mode}; period {method.period}; "
                      f"lam {method.lam}")
        s = train_q(cfg, method, run_dir=run_dir, resume=args.resume, console=console)
    table = Table(title=f"{method.name} on {cfg.task} ({cfg.features} features)")
    for col in ("greedy return", "optimal", "mean |Q - Q*|", "samples", "target refreshes", "diverged", "wall s"):
        table.add_column(col, justify="right")
    fmt = (lambda v: "-" if v is None else f"{v:.3f}")
    table.add_row(fmt(s["reward_final"]), fmt(s["optimal_return"]), fmt(s["q_error_final"]), str(s["samples"]),
                  str(s["target_refreshes"]), str(s["diverged"]), f"{s['wall_seconds']:.1f}")
    console.print(table)
    console.print(files_line(run_dir))
    return 0


def cmd_q_search(args: argparse.Namespace) -> int:
    from polyrl.families.q.search import run_search

    if args.trials < 1:
        raise ConfigError(f"trials = {args.trials} is not allowed; allowed: an integer >= 1")
    try:
        res = run_search(args.out, seed=args.seed, max_trials=args.trials, overwrite=args.overwrite)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    table = Table(title=f"searched MDP: seed {res['seed']}, trial {res['trial']}, alpha {res['alpha']:.4g}")
    table.add_column("lambda", justify="right")
    table.add_column("rho(L_lambda)", justify="right")
    for lam, rho in res["rho_by_lambda"].items():
        table.add_row(lam, f"{rho:.4f}")
    console.print(table)
    console.print(f"max Re eig(gamma M - A) = {res['max_real_eig_gammaM_minus_A']:.4f} (> 0: every-step diverges "
                  f"for every alpha); rho(gamma A^-1 M) = {res['rho_projected_value_iteration']:.4f}; lambda=0.999 "
                  f"error after 300 target updates {res['lambda_0.999_error_after_300_target_updates']:.2e}")
    console.print(f"wrote {args.out}/search.json and {res['png']}")
    return 0


def cmd_q_methods(args: argparse.Namespace) -> int:
    from polyrl.families.q.methods import Q_METHODS

    table = Table(title=f"q presets ({len(Q_METHODS)})")
    for col in ("name", "target mode", "period", "lambda", "paper", "summary"):
        table.add_column(col, overflow="fold")
    for m in Q_METHODS.values():
        table.add_row(m.name, m.target_mode, str(m.period), str(m.lam), m.paper, m.summary)
    console.print(table)
    return 0


def add_train_args(p: argparse.ArgumentParser) -> None:
    """Every `polyrl q train` option: the preset, a TOML file, run control, one flag per ``QTrainConfig`` field."""
    from polyrl.config import add_config_args
    from polyrl.families.q.methods import Q_METHODS
    from polyrl.families.q.train import QTrainConfig

    p.add_argument("--method", default=None, help=f"target-update preset: {', '.join(Q_METHODS)} "
                   f"(default: {DEFAULT_METHOD})")
    p.add_argument("--config", metavar="FILE.toml", action=Once,
                   help="TOML file of the settings below; flags override it")
    p.add_argument("--run-dir", help="output directory (default: runs/q/METHOD-TASK-sSEED)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run in --run-dir")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its checkpoint.pkl "
                   "(its own settings; --steps may extend it)")
    add_config_args(p, QTrainConfig)
    g = p.add_argument_group("method overrides")
    g.add_argument("--lam", type=float, help="lambda of the lambda_* presets: 0 <= lam < 1 (mean period 1/(1-lam))")
    g.add_argument("--period", type=int, help="hard-copy period of the periodic preset (online steps, >= 1)")


def checkpointed(run_dir: Path) -> bool:
    """Whether a run there saved a checkpoint to resume (`polyrl compare --family q` resumes it)."""
    from polyrl.families.q.train import CHECKPOINT

    return (Path(run_dir) / CHECKPOINT).is_file() and (Path(run_dir) / "config.json").is_file()


def check_train_flags(argv: list[str]) -> dict:
    """Resolve `polyrl q train` flags without running (ConfigError in one line); used by `polyrl compare --family q`,
    which checks a finished run against the record returned."""
    args = parse_train_flags(argv, "polyrl q train", add_train_args)
    args.resume = False
    from polyrl.families.q.train import run_record

    cfg, method, _ = resolve_train(args)
    return record_of(run_record(cfg, method))


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``q`` with its ``train``, ``search`` and ``methods`` subcommands to ``subparsers`` (the family seam)."""
    q = subparsers.add_parser("q", help=Q_HELP)
    sub = q.add_subparsers(dest="q_command", required=True)

    p = sub.add_parser("train", help="linear Q-learning on the gridworld with a target rule; writes metrics, "
                       "curves.png, checkpoint.pkl and summary.json")
    add_train_args(p)
    p.set_defaults(fn=cmd_q_train)

    p = sub.add_parser("search", help="seeded search for an MDP where every-step Q-learning diverges and "
                       "lambda -> 1 converges; writes search.json and spectral_radius.png")
    p.add_argument("--seed", type=int, default=0, help="seed of the search (default: 0)")
    p.add_argument("--trials", type=int, default=10_000, help="random MDPs to try at most (default: 10000)")
    p.add_argument("--out", default="runs/q/search", help="output directory (default: runs/q/search)")
    p.add_argument("--overwrite", action="store_true", help="replace a search.json / spectral_radius.png in --out")
    p.set_defaults(fn=cmd_q_search)

    p = sub.add_parser("methods", help="list the target-update presets")
    p.set_defaults(fn=cmd_q_methods)
    return q
