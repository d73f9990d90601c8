"""`polyrl duplex train | report | methods`: full-duplex turn-taking RL from the command line.

``add_parser(subparsers)`` is the family seam's entry; ``check_train_flags`` serves ``polyrl compare --family
duplex``. Bad values raise ``PartError`` or ``ConfigError`` (one line naming the field, the value and what is
allowed; exit 2). A setting that would change nothing is refused too: an RL-only one (``RL_ONLY``) with the imitation
method, ``--seed`` with ``report`` (it runs seeds 0..N-1). ``--resume`` continues with the run's saved settings
(method and advantage included); only ``--steps`` (not below the checkpoint's step), ``--threads``,
``--checkpoint-every`` and ``--tensorboard`` may change.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import asdict, replace

from rich.console import Console
from rich.table import Table

from polyrl.config import ConfigError, Once
from polyrl.families import family_config, flag_values, parse_train_flags, record_of
from polyrl.families.duplex import HELP as DUPLEX_HELP
from polyrl.runs import files_line

console = Console() if sys.stdout.isatty() else Console(width=200)


def _given(args: argparse.Namespace) -> dict:
    """The settings the user gave (TOML and flags), without the defaults: what a refusal may name."""
    from polyrl.families.duplex.train import DuplexTrainConfig

    return flag_values(args, DuplexTrainConfig)


def _train_config(args: argparse.Namespace):
    """The run's settings: a TOML file beneath the flags, typed and range-checked (ConfigError in one line)."""
    from polyrl.families.duplex.train import DuplexTrainConfig, validate_config

    return family_config(_given(args), DuplexTrainConfig, validate_config)


def _method(args: argparse.Namespace, default: str = "grpo", advantage: str | None = None):
    """The preset (``default`` when --method is not given) with its overrides (``advantage`` when --advantage is
    not given); an RL-only setting given with an imitation method is refused (one line)."""
    from polyrl.families.duplex.methods import get_duplex_method
    from polyrl.families.duplex.train import check_method_settings

    method = get_duplex_method(args.method or default, advantage=args.advantage or advantage)
    try:
        check_method_settings(method, _given(args))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return method


def _parts(method) -> dict:
    """What defines the method beyond its name (an --advantage override keeps the preset's name)."""
    return {"kind": method.kind, "advantage": None if method.advantage is None else str(method.advantage)}


def _record(cfg, method) -> dict:
    """The run's record (its ``config.json``): settings, preset and its parts."""
    return {"config": asdict(cfg), "method": method.name, "parts": _parts(method)}


def resume_settings(args: argparse.Namespace, run_dir: str):
    """(cfg, method) of the run in ``run_dir``: its saved settings beneath the given flags. A run continued with
    another method, advantage or setting would mix two runs under one record (config.json saying one thing,
    summary.json another), so only steps, threads, checkpoint_every and tensorboard may change: any other differing
    value is refused in one line naming it."""
    from polyrl.families.duplex.train import DuplexTrainConfig, validate_config
    from polyrl.runs import RESUME_MAY_CHANGE, effective_config, recover_noted, saved_record

    recover_noted(run_dir)  # an old run a killed --overwrite left aside is the one to resume
    saved = saved_record(run_dir)
    if saved is None:
        raise ConfigError(f"run_dir = '{run_dir}' holds no run to resume")
    current = effective_config(run_dir)  # config.json with the earlier resumes' changes (an extended steps stays)
    cfg = family_config({**current, **_given(args)}, DuplexTrainConfig, validate_config)
    # an imitation method has no advantage: earlier records wrote it as the string 'None'
    parts = {k: None if v == "None" else v for k, v in saved.get("parts", {}).items()}
    may = [k for k in RESUME_MAY_CHANGE if k in asdict(cfg)]  # extending the run or how it is watched, as marl, q

    def refuse(k, new, old):
        raise ConfigError(f"{k} = {new!r} differs from the run's own {k} = {old!r} in '{run_dir}'; a resume "
                          f"keeps the run's settings (only {', '.join(may)} may change)")

    own = saved.get("method", "grpo")
    if args.method and args.method != own:  # before the run's advantage is put on another preset, which may refuse it
        refuse("method", args.method, own)
    method = _method(args, default=own, advantage=parts.get("advantage"))
    old = {**current, "method": saved.get("method"), **parts}
    new = {**asdict(cfg), "method": method.name, **_parts(method)}
    changed = [k for k in new if k not in may and k in old and old[k] != new[k]]
    if changed:
        refuse(changed[0], new[changed[0]], old[changed[0]])
    return cfg, method, {k: [old[k], new[k]] for k in may if k in old and old[k] != new[k]}


def cmd_duplex_train(args: argparse.Namespace) -> int:
    from polyrl.runs import resume_hold

    cfg = _train_config(args)
    method = _method(args)
    run_dir = args.run_dir or f"runs/duplex/{method.name}-{cfg.task}-s{cfg.seed}"
    with resume_hold(run_dir if args.resume else None):  # a new run is held by new_run
        return _train(args, cfg, method, run_dir)


def _train(args: argparse.Namespace, cfg, method, run_dir: str) -> int:
    from polyrl.families.duplex.train import train_duplex
    from polyrl.runs import new_run

    if args.resume:
        if args.overwrite:
            raise ConfigError("resume and overwrite are exclusive; pass one of them")
        from polyrl.checkpoint import resume_checkpoint
        from polyrl.runs import check_resume_steps, record_resume

        cfg, method, changes = resume_settings(args, run_dir)
        path, meta = resume_checkpoint(run_dir)
        check_resume_steps(cfg.steps, meta["step"], run_dir)  # before anything is written: a refusal changes nothing
        record_resume(run_dir, meta["step"], f"checkpoints/{path.name}", changes)
    where = (contextlib.nullcontext(run_dir) if args.resume else
             new_run(run_dir, overwrite=args.overwrite, inputs=vars(args),
                     record=_record(cfg, method)))
    with where as run:
        console.print(f"duplex method: {method.name} ({method.kind}, advantage {method.advantage})")
        s = train_duplex(cfg, method, run_dir=run, resume=args.resume, console=console)
    table = Table(title=f"{method.name} on {cfg.task}: per-axis metrics (fixed evaluation set)")
    for col in ("metric", "natural agent", "imitation baseline", "after"):
        table.add_column(col, justify="right")
    for k, v in s["metrics_after"].items():
        table.add_row(k, f"{s['natural_agent'][k]:.3f}", f"{s['metrics_before'][k]:.3f}", f"{v:.3f}")
    console.print(table)
    console.print(f"wall {s['wall_seconds']:.1f} s, {s['seconds_per_step']:.3f} s/step; {files_line(run_dir)}")
    return 0


def cmd_duplex_report(args: argparse.Namespace) -> int:
    from polyrl.families.duplex.methods import get_duplex_method
    from polyrl.families.duplex.report import write_duplex_report
    from polyrl.families.duplex.train import check_eval_axes, check_method_settings
    from polyrl.families.reuse import check_report_options
    from polyrl.runs import run_lock, signals_unwind

    check_report_options(args.out, args.seeds, args.ci, _given(args))
    cfg = _train_config(args)
    try:  # as `duplex train` checks them: GRPO's run reads every setting the imitation baseline's does
        check_method_settings(get_duplex_method("grpo"), _given(args))
        for seed in range(args.seeds):  # every seed's evaluation set, before the first run trains
            check_eval_axes(replace(cfg, seed=seed))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    with signals_unwind(), run_lock(args.out, "out"):  # a second report on --out deleted this one's runs
        res = write_duplex_report(cfg, seeds=args.seeds, out=args.out, level=args.ci, progress=console.print,
                                  overwrite=args.overwrite, given=_given(args))
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
        p.add_argument("--method", help=f"duplex preset: {', '.join(sorted(DUPLEX_METHODS))} "
                       "(default: grpo; with --resume: the run's own)")
    p.add_argument("--config", metavar="FILE.toml", action=Once,
                   help="TOML file of the settings below; flags override it")
    if run:
        p.add_argument("--run-dir", help="output directory (default: runs/duplex/METHOD-TASK-sSEED)")
        p.add_argument("--overwrite", action="store_true", help="replace an existing run in --run-dir")
        p.add_argument("--resume", action="store_true",
                       help="continue the run in --run-dir from its newest checkpoint with its saved settings "
                       "(only --steps, not below the checkpoint's step, --threads, --checkpoint-every and "
                       "--tensorboard may change)")
    add_config_args(p, DuplexTrainConfig)
    if run:
        g = p.add_argument_group("part overrides")
        g.add_argument("--advantage", help="advantage estimator of an RL preset, e.g. grpo, rloo, group_centered")


def checkpointed(run_dir) -> bool:
    """Whether a run there saved a checkpoint to resume (`polyrl compare --family duplex` resumes it)."""
    from pathlib import Path

    from polyrl.checkpoint import latest_checkpoint

    return latest_checkpoint(run_dir) is not None and (Path(run_dir) / "config.json").is_file()


def check_train_flags(argv: list[str]) -> dict:
    """Resolve `polyrl duplex train` flags without running: ConfigError/PartError in one line (`polyrl compare`,
    which checks a finished run against the record returned)."""
    args = parse_train_flags(argv, "polyrl duplex train", add_train_args)
    return record_of(_record(_train_config(args), _method(args)))


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``duplex`` with ``train``, ``report`` and ``methods`` to ``subparsers`` (the family seam)."""
    duplex = subparsers.add_parser("duplex", help=DUPLEX_HELP)
    sub = duplex.add_subparsers(dest="duplex_command", required=True)

    p = sub.add_parser("train", help="imitate the scripted agent, then GRPO on the simulator; writes summary.json")
    add_train_args(p)
    p.set_defaults(fn=cmd_duplex_train)

    p = sub.add_parser("report", help="imitation vs GRPO over seeds 0..N-1 (--seeds): per-axis intervals in "
                       "report.html", conflict_handler="resolve")
    p.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 (default: 5)")
    p.add_argument("--out", default="runs/duplex/report", help="output directory (default: runs/duplex/report); "
                   "a finished run in it is reused only when its saved settings equal these, else refused in one "
                   "line (pass --overwrite, or another --out)")
    p.add_argument("--overwrite", action="store_true", help="retrain the finished runs in --out whose saved "
                   "settings differ from these (matching ones are still reused)")
    p.add_argument("--ci", type=float, default=0.9, help="bootstrap interval level (default: 0.9)")
    add_train_args(p, run=False)
    # seeds are 0..N-1: a --seed would be ignored, so it is left out of the help and refused when given
    p.add_argument("--seed", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(fn=cmd_duplex_report)

    p = sub.add_parser("methods", help="list the duplex presets")
    p.set_defaults(fn=cmd_duplex_methods)
    return duplex
