"""`polyrl flow train | pretrain | methods`: RL for flow policies from the command line.

``add_flow_parser(subparsers)`` is called by ``polyrl.cli.build_parser``. Bad values raise
``PartError`` or ``ConfigError`` (one line naming the field, the value and what is allowed; exit 2).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import asdict, fields
from pathlib import Path

from rich.console import Console
from rich.table import Table

from polyrl.config import ConfigError

console = Console() if sys.stdout.isatty() else Console(width=200)
FLOW_HELP = "RL for flow-matching / diffusion policies (Flow-GRPO, Flow-DPPO, FPO)"  # also polyrl.cli's placeholder


def _train_config(args: argparse.Namespace):
    from polyrl.flow.train import FlowTrainConfig, validate_config

    values = {f.name: getattr(args, f.name) for f in fields(FlowTrainConfig) if getattr(args, f.name, None) is not None}
    cfg = FlowTrainConfig(**values)
    try:
        validate_config(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return cfg


def cmd_flow_train(args: argparse.Namespace) -> int:
    from polyrl.flow.methods import get_flow_method
    from polyrl.flow.train import train_flow

    cfg = _train_config(args)
    method = get_flow_method(args.method, advantage=args.advantage, loss=args.loss, schedule=args.schedule,
                             eta=args.eta, reduce=args.reduce, cfm_samples=args.cfm_samples)
    run_dir = Path(args.run_dir or f"runs/flow/{method.name}-{cfg.task}-s{cfg.seed}")
    if (run_dir / "metrics.jsonl").exists() or (run_dir / "summary.json").exists():
        if not args.overwrite:
            raise ConfigError(f"run_dir = '{run_dir}' already holds a run; pass --overwrite or another --run-dir")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    parts = {"advantage": str(method.advantage), "loss": str(method.loss), "schedule": method.schedule,
             "eta": method.eta, "reduce": method.reduce, "cfm_samples": method.cfm_samples}
    (run_dir / "config.json").write_text(json.dumps({"config": asdict(cfg), "method": method.name, "parts": parts},
                                                    indent=2))
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
    console.print(f"run files: {run_dir}/ (summary.json, metrics.jsonl, samples.png, curves.png, tb/)")
    return 0


def cmd_flow_pretrain(args: argparse.Namespace) -> int:
    from polyrl.flow.policy import PretrainSettings, pretrain

    for name in ("steps", "hidden", "layers"):
        if getattr(args, name) < 1:
            raise ConfigError(f"{name} = {getattr(args, name)} is not allowed; allowed: an integer >= 1")
    res = pretrain(PretrainSettings(target=args.target, steps=args.steps, hidden=args.hidden, layers=args.layers,
                                    seed=args.seed))
    how = "cached" if res.cached else f"trained in {res.seconds:.1f} s"
    console.print(f"flow policy for {args.target}: CFM loss {res.loss:.3f} ({how})\n{res.path}")
    return 0


def cmd_flow_methods(args: argparse.Namespace) -> int:
    from polyrl.flow.methods import FLOW_METHODS

    table = Table(title=f"flow presets ({len(FLOW_METHODS)})")
    for col in ("name", "advantage", "loss", "sampler", "paper", "summary"):
        table.add_column(col, overflow="fold")
    for name in sorted(FLOW_METHODS):
        m = FLOW_METHODS[name]()
        table.add_row(name, str(m.advantage), str(m.loss), f"{m.schedule} eta={m.eta} reduce={m.reduce}", m.paper,
                      m.summary)
    console.print(table)
    return 0


def _pretrain_target(value: str) -> str:
    if value not in ("ring8", "ring8_cond"):
        raise argparse.ArgumentTypeError(f"target = {value!r}; allowed: 'ring8', 'ring8_cond'")
    return value


def add_flow_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``flow`` with its ``train``, ``pretrain`` and ``methods`` subcommands to ``subparsers``."""
    from polyrl.flow.methods import FLOW_METHODS
    from polyrl.flow.tasks import TASKS
    from polyrl.flow.train import FlowTrainConfig

    d = FlowTrainConfig()
    flow = subparsers.add_parser("flow", help=FLOW_HELP)
    sub = flow.add_subparsers(dest="flow_command", required=True)

    p = sub.add_parser("train", help="fine-tune a flow policy on a toy task; writes metrics, plots and summary.json")
    p.add_argument("--method", default="flow_dppo", help=f"flow preset: {', '.join(sorted(FLOW_METHODS))} "
                   "(default: flow_dppo)")
    p.add_argument("--task", help=f"task: {', '.join(TASKS)} (default: {d.task})")
    p.add_argument("--steps", type=int, help=f"rollout batches to train on (default: {d.steps})")
    p.add_argument("--run-dir", help="output directory (default: runs/flow/METHOD-TASK-sSEED)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run in --run-dir")
    p.add_argument("--seed", type=int, help=f"seed of rollouts, evaluation and from-scratch init (default: {d.seed})")
    p.add_argument("--updates-per-batch", dest="updates_per_batch", type=int,
                   help=f"passes over each rollout batch, pi_old frozen first (default: {d.updates_per_batch})")
    p.add_argument("--minibatches", type=int, help=f"optimizer steps per pass (default: {d.minibatches})")
    p.add_argument("--lr", type=float, help=f"Adam learning rate (default: {d.lr})")
    p.add_argument("--max-grad-norm", dest="max_grad_norm", type=float,
                   help=f"gradient clipping, 0 = off (default: {d.max_grad_norm})")
    p.add_argument("--group-size", dest="group_size", type=int,
                   help=f"samples per context, G (default: {d.group_size})")
    p.add_argument("--groups", type=int, help=f"contexts (prompts) per rollout batch (default: {d.groups})")
    p.add_argument("--sampler-steps", dest="sampler_steps", type=int,
                   help=f"SDE steps per sample (default: {d.sampler_steps})")
    p.add_argument("--eval-samples", dest="eval_samples", type=int,
                   help=f"episodes for the mean reward before and after (default: {d.eval_samples})")
    p.add_argument("--no-tensorboard", dest="tensorboard", action="store_false", default=None,
                   help="skip TensorBoard event files")
    g = p.add_argument_group("part overrides")
    g.add_argument("--loss", help="flow loss NAME or NAME:key=value,... e.g. flow_dppo:kl_threshold=1e-4")
    g.add_argument("--advantage", help="advantage estimator, e.g. grpo, rloo, group_centered_batch_std")
    g.add_argument("--schedule", help="SDE noise schedule: flow_grpo, dance or cps")
    g.add_argument("--eta", type=float, help="noise level of the schedule")
    g.add_argument("--reduce", help="step log-prob unit: mean (per dimension) or sum")
    g.add_argument("--cfm-samples", dest="cfm_samples", type=int, help="(t, eps) pairs per action for FPO")
    p.set_defaults(fn=cmd_flow_train)

    p = sub.add_parser("pretrain", help="fit (or load from the cache) the rectified-flow policy of a target")
    p.add_argument("--target", type=_pretrain_target, default="ring8", help="ring8 or ring8_cond (default: ring8)")
    p.add_argument("--steps", type=int, default=2500, help="flow-matching steps (default: 2500)")
    p.add_argument("--hidden", type=int, default=128, help="MLP width (default: 128)")
    p.add_argument("--layers", type=int, default=3, help="hidden layers (default: 3)")
    p.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    p.set_defaults(fn=cmd_flow_pretrain)

    p = sub.add_parser("methods", help="list the flow presets and their parts")
    p.set_defaults(fn=cmd_flow_methods)
    return flow
