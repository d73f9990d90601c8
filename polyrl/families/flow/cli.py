"""`polyrl flow train | pretrain | methods`: RL for flow policies from the command line.

``add_parser(subparsers)`` is the family seam's entry (``polyrl.families.add_parser``, called by the CLI only
when the command is ``flow``); ``check_train_flags`` serves ``polyrl compare --family flow``. Bad values raise
``PartError`` or ``ConfigError`` (one line naming the field, the value and what is allowed; exit 2).
"""

from __future__ import annotations

import argparse
import math
import sys

from rich.console import Console
from rich.table import Table

from polyrl.config import ConfigError, Once
from polyrl.families import family_config, flag_values, parse_train_flags, record_of
from polyrl.families.flow import HELP as FLOW_HELP
from polyrl.runs import files_line

console = Console() if sys.stdout.isatty() else Console(width=200)


def _train_config(args: argparse.Namespace):
    """The run's settings: a TOML file beneath the flags, typed and range-checked (ConfigError in one line)."""
    from polyrl.families.flow.train import FlowTrainConfig, validate_config

    return family_config(flag_values(args, FlowTrainConfig), FlowTrainConfig, validate_config)


def _resolve(args: argparse.Namespace):
    """(settings, method) of `polyrl flow train`, each checked and checked together (one-line refusals)."""
    from polyrl.families.flow.methods import get_flow_method
    from polyrl.families.flow.train import check_memory
    from polyrl.registry import ADVANTAGES

    cfg = _train_config(args)
    method = get_flow_method(args.method, advantage=args.advantage, loss=args.loss, schedule=args.schedule,
                             eta=args.eta, reduce=args.reduce, cfm_samples=args.cfm_samples, sde_steps=args.sde_steps,
                             sde_window=args.sde_window)
    span = math.ceil(method.sde_window * cfg.sampler_steps - 1e-9)
    if method.sde_steps > span:
        raise ConfigError(f"sde_steps = {method.sde_steps} is not allowed with sampler_steps = {cfg.sampler_steps} "
                          f"and sde_window = {method.sde_window:g}; allowed: 1 to {span} (the window's steps)")
    if method.schedule == "cps" and cfg.sampler_steps < 2 and not method.needs_cfm:
        # cps's last step is noise-free: with one step a log-prob loss has no step to score (a CFM loss, FPO's,
        # still learns from the initial noise)
        raise ConfigError(f"sampler_steps = {cfg.sampler_steps} is not allowed with schedule 'cps'; allowed: >= 2 "
                          "(its last step has no noise, so a log-prob loss has nothing to learn from)")
    if cfg.group_size < 2 and "needs_groups" in ADVANTAGES.spec(method.advantage.name).tags:
        raise ConfigError(f"group_size = {cfg.group_size} is not allowed with advantage {method.advantage.name!r}; "
                          "allowed: >= 2 (a group estimator gives every lone sample A = 0, so nothing would train)")
    check_memory(cfg, method)
    return cfg, method


def cmd_flow_train(args: argparse.Namespace) -> int:
    from polyrl.families.flow.train import run_record, train_flow
    from polyrl.runs import new_run

    cfg, method = _resolve(args)
    record = run_record(cfg, method)
    parts = record["parts"]
    with new_run(args.run_dir or f"runs/flow/{method.name}-{cfg.task}-s{cfg.seed}", overwrite=args.overwrite,
                 inputs=vars(args), record=record) as run_dir:
        console.print(f"flow method: {method.name} = " + "; ".join(f"{k} {v}" for k, v in parts.items()))
        s = train_flow(cfg, method, run_dir=run_dir, console=console)
    if s.get("pretrained"):
        how = "cached" if s["pretrain_cached"] else f"trained in {s['pretrain_seconds']:.0f} s"
        console.print(f"pretrained policy: {s['pretrained']} ({how})")
    table = Table(title=f"{method.name} on {cfg.task}")
    for col in ("mean reward before", "after", "KL to pretrained", "steps", "updates/batch", "s/step", "wall s"):
        table.add_column(col, justify="right")
    table.add_row(f"{s['reward_before']:.3f}", f"{s['reward_after']:.3f}", f"{s['kl_after']:.3f}", str(cfg.steps),
                  str(cfg.updates_per_batch), f"{s['seconds_per_step']:.3f}", f"{s['wall_seconds']:.1f}")
    console.print(table)
    console.print(files_line(run_dir))
    return 0


def cmd_flow_pretrain(args: argparse.Namespace) -> int:
    from polyrl.families.flow.policy import PretrainSettings, pretrain
    from polyrl.runs import check_fits

    for name in ("steps", "hidden", "layers"):
        if getattr(args, name) < 1:
            raise ConfigError(f"{name} = {getattr(args, name)} is not allowed; allowed: an integer >= 1")
    if not 0 <= args.seed < 2**32:
        raise ConfigError(f"seed = {args.seed} is not allowed; allowed: an integer in [0, 2**32)")
    settings = PretrainSettings(target=args.target, steps=args.steps, hidden=args.hidden, layers=args.layers,
                                seed=args.seed)
    # float32 weights, gradients and Adam's two moments (16 B a parameter), and a batch's activations kept for the
    # backward (16 B a unit); `--layers 2000` measured 1.29 GB above `--layers 3` (peak resident), estimated 1.58 GB;
    # without the check the kernel's OOM killer ended `--layers 100000` with no message
    check_fits({f"hidden = {args.hidden} x layers = {args.layers}":
                16 * args.layers * args.hidden * (args.hidden + 1 + settings.batch_size)})
    res = pretrain(settings)
    how = "cached" if res.cached else f"trained in {res.seconds:.1f} s"
    console.print(f"flow policy for {args.target}: CFM loss {res.loss:.3f} ({how})\n{res.path}")
    return 0


def cmd_flow_methods(args: argparse.Namespace) -> int:
    from polyrl.families.flow.methods import FLOW_METHODS

    table = Table(title=f"flow presets ({len(FLOW_METHODS)})")
    for col in ("name", "advantage", "loss", "sampler", "paper", "summary"):
        table.add_column(col, overflow="fold")
    for name in sorted(FLOW_METHODS):
        m = FLOW_METHODS[name]()
        window = f" sde={m.sde_steps} in {m.sde_window:g}" if m.sde_steps else ""
        table.add_row(name, str(m.advantage), str(m.loss), f"{m.schedule} eta={m.eta} reduce={m.reduce}{window}",
                      m.paper, m.summary)
    console.print(table)
    return 0


def _pretrain_target(value: str) -> str:
    if value not in ("ring8", "ring8_cond"):
        raise argparse.ArgumentTypeError(f"target = {value!r}; allowed: 'ring8', 'ring8_cond'")
    return value


def add_train_args(p: argparse.ArgumentParser) -> None:
    """Every `polyrl flow train` option: the preset, a TOML file, one flag per ``FlowTrainConfig`` field, parts."""
    from polyrl.config import add_config_args
    from polyrl.families.flow.methods import FLOW_METHODS
    from polyrl.families.flow.train import FlowTrainConfig

    p.add_argument("--method", default="flow_dppo", help=f"flow preset: {', '.join(sorted(FLOW_METHODS))} "
                   "(default: flow_dppo)")
    p.add_argument("--config", metavar="FILE.toml", action=Once,
                   help="TOML file of the settings below; flags override it")
    p.add_argument("--run-dir", help="output directory (default: runs/flow/METHOD-TASK-sSEED)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run in --run-dir")
    add_config_args(p, FlowTrainConfig)
    g = p.add_argument_group("part overrides")
    g.add_argument("--loss", help="flow loss NAME or NAME:key=value,... e.g. flow_dppo:kl_threshold=1e-4")
    g.add_argument("--advantage", help="advantage estimator, e.g. grpo, rloo, group_centered_batch_std")
    g.add_argument("--schedule", help="SDE noise schedule: flow_grpo, dance or cps")
    g.add_argument("--eta", type=float, help="noise level of the schedule")
    g.add_argument("--reduce", help="step log-prob unit: mean (per dimension) or sum; only for losses that read "
                   "step log-probs (not fpo)")
    g.add_argument("--cfm-samples", dest="cfm_samples", type=int, help="(t, eps) pairs per action; only for "
                   "losses tagged cfm (fpo)")
    g.add_argument("--sde-steps", dest="sde_steps", type=int, help="sampler steps with noise per action, the rest "
                   "deterministic (std 0, no gradient); 0: every step (the presets)")
    g.add_argument("--sde-window", dest="sde_window", type=float, help="the noisy steps are drawn among the first "
                   "fraction of the schedule, from its noise end (with --sde-steps; UniRL's Flow-DPPO: 3 in 0.5)")


def check_train_flags(argv: list[str]) -> dict:
    """Resolve `polyrl flow train` flags (settings and method) without running: ConfigError/PartError in one line.

    `polyrl compare --family flow` checks every method's flags with this before the first run starts, and a finished
    run against the record returned (``record_of``).
    """
    from polyrl.families.flow.train import run_record

    return record_of(run_record(*_resolve(parse_train_flags(argv, "polyrl flow train", add_train_args))))


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``flow`` with its ``train``, ``pretrain`` and ``methods`` subcommands to ``subparsers`` (the family seam)."""
    flow = subparsers.add_parser("flow", help=FLOW_HELP)
    sub = flow.add_subparsers(dest="flow_command", required=True)

    p = sub.add_parser("train", help="fine-tune a flow policy on a toy task; writes metrics, plots and summary.json")
    add_train_args(p)
    p.set_defaults(fn=cmd_flow_train)

    p = sub.add_parser("pretrain", help="fit (or load from the cache) the rectified-flow policy of a target",
                       description="Fit (or load from the cache) the rectified-flow policy of a target and print its "
                       "CFM loss and path. `flow train` starts from the policy of the default settings (steps 2500, "
                       "hidden 128, layers 3, seed 0), so this command with those settings warms its cache; other "
                       "settings fit a policy to study here, which `flow train` does not read.")
    p.add_argument("--target", type=_pretrain_target, default="ring8", help="ring8 or ring8_cond (default: ring8)")
    p.add_argument("--steps", type=int, default=2500, help="flow-matching steps (default: 2500)")
    p.add_argument("--hidden", type=int, default=128, help="MLP width (default: 128)")
    p.add_argument("--layers", type=int, default=3, help="hidden layers (default: 3)")
    p.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    p.set_defaults(fn=cmd_flow_pretrain)

    p = sub.add_parser("methods", help="list the flow presets and their parts")
    p.set_defaults(fn=cmd_flow_methods)
    return flow
