"""`polyrl marl train | methods | report`: the formation family from the command line.

``add_parser(subparsers)`` is the family seam's entry; ``check_train_flags`` serves ``polyrl compare --family marl``
(presets ``mappo`` and ``ippo``). Bad values raise ``ConfigError`` in one line naming the field, the value and what
is allowed (exit 2). ``--resume`` continues a run from its ``checkpoint.pt`` with its saved settings; only
``--steps`` (not below the checkpoint's step), ``--eval-every``, ``--checkpoint-every``, ``--threads`` and
``--tensorboard`` may change; ``--resume`` with ``--overwrite`` is refused. ``report`` takes no ``--seed`` (it runs
seeds 0..N-1) and reuses a finished run in ``--out`` only when its saved settings match.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from polyrl.config import ConfigError, Once
from polyrl.families import family_config, flag_values, parse_train_flags, record_of
from polyrl.families.marl import HELP as MARL_HELP
from polyrl.runs import files_line

console = Console() if sys.stdout.isatty() else Console(width=200)
MAY_CHANGE = ("steps", "eval_every", "checkpoint_every", "threads", "tensorboard")


def _given(args: argparse.Namespace) -> dict:
    from polyrl.families.marl.train import MarlTrainConfig

    return flag_values(args, MarlTrainConfig)


def _build(values: dict):
    from polyrl.families.marl.train import MarlTrainConfig, validate_config

    return family_config(values, MarlTrainConfig, validate_config)


def resume_config(run_dir: Path, given: dict):
    """The saved run's settings with the allowed changes from ``given`` (ConfigError on any other difference).

    The changes are appended to ``config_history.jsonl`` by the caller (``polyrl.runs.record_resume``); the run's
    settings are ``config.json`` with the earlier resumes' changes applied (an extended ``steps`` stays extended)."""
    from polyrl.runs import effective_config, recover_noted, saved_record

    recover_noted(run_dir)  # an old run a killed --overwrite left aside is the one to resume
    saved = saved_record(run_dir)
    if saved is None:
        raise ConfigError(f"run_dir = '{run_dir}' holds no run (no config.json) to resume; start it without --resume")
    if not (run_dir / "checkpoint.pt").is_file():  # it stopped before its first save (--checkpoint-every)
        raise ConfigError(f"run_dir = '{run_dir}' has no checkpoint.pt to resume from (the run stopped before its "
                          "first save); start it again with --overwrite")
    values, changes = effective_config(run_dir), {}
    for k, v in given.items():
        if k in values and values[k] != v:
            if k not in MAY_CHANGE:
                raise ConfigError(f"{k} = {v!r} differs from the run's {values[k]!r}; with --resume only "
                                  f"{', '.join(MAY_CHANGE)} may change")
            changes[k] = [values[k], v]
            values[k] = v
    return _build(values), saved["method"], changes


def _default_run_dir(method, cfg) -> str:
    """Where a run goes without --run-dir (and where --resume without it looks)."""
    return f"runs/marl/{method.name}-s{cfg.seed}"


def cmd_marl_train(args: argparse.Namespace) -> int:
    from polyrl.families.marl.methods import get_marl_method
    from polyrl.runs import resume_hold

    if args.resume and not args.run_dir:  # the run a command without --run-dir made, as for duplex and train
        args.run_dir = _default_run_dir(get_marl_method(args.method or "mappo"), _build(_given(args)))
    with resume_hold(args.run_dir if args.resume and args.run_dir else None):  # a new run is held by new_run
        return _train(args)


def _train(args: argparse.Namespace) -> int:
    from polyrl.families.marl.methods import get_marl_method
    from polyrl.families.marl.train import train_marl
    from polyrl.runs import new_run

    given = _given(args)
    if args.resume:
        if args.overwrite:
            raise ConfigError("resume and overwrite are exclusive; pass one of them")
        run_dir = Path(args.run_dir)
        cfg, method_name, changes = resume_config(run_dir, given)
        if args.method is not None and args.method != method_name:
            raise ConfigError(f"method = {args.method!r} differs from the run's {method_name!r}")
        method = get_marl_method(method_name)
        import torch

        from polyrl.runs import check_resume_steps, record_resume, unreadable

        try:
            step = torch.load(run_dir / "checkpoint.pt", weights_only=False)["step"]
        except Exception as e:  # cut short by a kill, or not this family's checkpoint
            raise unreadable(run_dir, "checkpoint.pt", e) from None
        check_resume_steps(cfg.steps, step, run_dir)  # before the summary goes: a refusal changes nothing
        (run_dir / "summary.json").unlink(missing_ok=True)
        record_resume(run_dir, step, "checkpoint.pt", changes)
    else:
        cfg = _build(given)
        method = get_marl_method(args.method or "mappo")
    where = (contextlib.nullcontext(run_dir) if args.resume else
             new_run(args.run_dir or _default_run_dir(method, cfg), overwrite=args.overwrite,
                     inputs=vars(args), record=_record(cfg, method)))
    with where as run_dir:
        console.print(f"marl method: {method.name} (critic {method.critic}); teams {cfg.teams}, "
                      f"{cfg.envs} episodes x {cfg.horizon} steps per batch")
        s = train_marl(cfg, method, run_dir=run_dir, console=console, resume=args.resume)
    table = Table(title=f"{method.name} formation")
    for col in ("success train dist", "success held-out", "reward first", "reward last", "steps", "wall s"):
        table.add_column(col, justify="right")
    table.add_row(f"{s['success_train']:.3f}", f"{s['success_heldout']:.3f}", f"{s['reward_first']:.3f}",
                  f"{s['reward_last']:.3f}", str(cfg.steps), f"{s['wall_seconds']:.1f}")
    console.print(table)
    console.print(files_line(run_dir))
    return 0


def cmd_marl_methods(args: argparse.Namespace) -> int:
    from polyrl.families.marl.methods import MARL_METHODS

    table = Table(title=f"marl presets ({len(MARL_METHODS)})")
    for col in ("name", "critic", "paper", "summary"):
        table.add_column(col, overflow="fold")
    for m in MARL_METHODS.values():
        table.add_row(m.name, m.critic, m.paper, m.summary)
    console.print(table)
    return 0


def report_methods(text: str) -> list[str]:
    """``--methods``: known presets, each once, at least one (ConfigError in one line naming --methods)."""
    from polyrl.families.marl.methods import MARL_METHODS

    names = [m.strip() for m in text.split(",") if m.strip()]
    allowed = f"allowed: a comma-separated list of {', '.join(MARL_METHODS)}, each at most once"
    bad = [m for m in names if m not in MARL_METHODS]
    if not names or bad or len(set(names)) < len(names):
        raise ConfigError(f"methods = {text!r} is not allowed; {allowed}")
    return names


def cmd_marl_report(args: argparse.Namespace) -> int:
    """Check every report option before the first run trains (a bad one fails in one line, not after training)."""
    from polyrl.families.marl.report import run_report
    from polyrl.families.reuse import check_report_options
    from polyrl.runs import run_lock, signals_unwind

    given = _given(args)
    check_report_options(args.out, args.seeds, args.ci, given)
    methods = report_methods(args.methods)
    cfg = _build(given)
    with signals_unwind(), run_lock(args.out, "out"):  # a second report on --out deleted this one's runs
        paths = run_report(cfg, seeds=args.seeds, out=Path(args.out), methods=methods, console=console, ci=args.ci,
                           overwrite=args.overwrite, given=given)
    console.print(f"report: {paths['html']}  results: {paths['results']}")
    return 0


def add_train_args(p: argparse.ArgumentParser) -> None:
    """Every `polyrl marl train` option: the preset, a TOML file, one flag per ``MarlTrainConfig`` field."""
    from polyrl.config import add_config_args
    from polyrl.families.marl.methods import MARL_METHODS
    from polyrl.families.marl.train import MarlTrainConfig

    p.add_argument("--method", help=f"preset: {', '.join(MARL_METHODS)} (default: mappo)")
    p.add_argument("--config", metavar="FILE.toml", action=Once,
                   help="TOML file of the settings below; flags override it")
    p.add_argument("--run-dir", help="output directory (default: runs/marl/METHOD-sSEED)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run in --run-dir")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its checkpoint.pt")
    add_config_args(p, MarlTrainConfig)


def checkpointed(run_dir: Path) -> bool:
    """Whether a run there saved a checkpoint to resume (`polyrl compare --family marl` resumes it)."""
    return (Path(run_dir) / "checkpoint.pt").is_file() and (Path(run_dir) / "config.json").is_file()


def _record(cfg, method) -> dict:
    """The run's record (its ``config.json``): settings, preset and its parts."""
    parts = {"critic": method.critic, "advantage": "gae", "trust_region": "clip", "aggregation": "token_mean",
             "value_loss": "clipped_value_loss"}
    return {"config": asdict(cfg), "method": method.name, "parts": parts}


def check_train_flags(argv: list[str]) -> dict:
    """Resolve `polyrl marl train` flags without running (ConfigError in one line); used by `polyrl compare`, which
    checks a finished run against the record returned."""
    args = parse_train_flags(argv, "polyrl marl train", add_train_args)
    from polyrl.families.marl.methods import get_marl_method

    return record_of(_record(_build(_given(args)), get_marl_method(args.method or "mappo")))


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``marl`` with ``train``, ``methods`` and ``report`` (the family seam)."""
    from polyrl.config import add_config_args
    from polyrl.families.marl.train import MarlTrainConfig

    marl = subparsers.add_parser("marl", help=MARL_HELP)
    sub = marl.add_subparsers(dest="marl_command", required=True)
    p = sub.add_parser("train", help="train a shared formation policy; writes metrics, curves and summary.json")
    add_train_args(p)
    p.set_defaults(fn=cmd_marl_train)
    p = sub.add_parser("methods", help="list the marl presets")
    p.set_defaults(fn=cmd_marl_methods)
    p = sub.add_parser("report", help="train mappo and the no-central-critic ablation (ippo) per seed; write "
                       "report.html with held-out success rates and intervals", conflict_handler="resolve")
    p.add_argument("--seeds", type=int, default=3, help="seeds per method (0 .. N-1; default: 3)")
    p.add_argument("--out", default="runs/marl/report", help="output directory (default: runs/marl/report); a "
                   "finished run in it is reused only when its saved settings equal these, else refused in one line "
                   "(pass --overwrite, or another --out)")
    p.add_argument("--overwrite", action="store_true", help="retrain the finished runs in --out whose saved "
                   "settings differ from these (matching ones are still reused)")
    p.add_argument("--methods", default="mappo,ippo", help="presets to compare (default: mappo,ippo)")
    p.add_argument("--ci", type=float, default=0.9, help="bootstrap confidence level over seeds (default: 0.9)")
    p.add_argument("--config", metavar="FILE.toml", action=Once,
                   help="TOML file of the train settings; flags override it")
    add_config_args(p, MarlTrainConfig)
    # seeds are 0..N-1: a --seed would be ignored, so it is left out of the help and refused when given
    p.add_argument("--seed", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(fn=cmd_marl_report)
    return marl
