"""`polyrl` command line: train, warmstart, methods, explain, parts, docs.

Bad input prints one line naming the field, the value and what is allowed, and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from polyrl.checkpoint import CheckpointError
from polyrl.config import ConfigError
from polyrl.errors import TrainingError
from polyrl.registry import ALL_REGISTRIES, PartError

# Piped output (CI logs, tests, `| less`) gets a wide console instead of rich's 80-column default.
console = Console() if sys.stdout.isatty() else Console(width=200)


def add_method_args(p: argparse.ArgumentParser) -> None:
    """Part overrides shared by every command that takes a method (explain, later train/compare)."""
    g = p.add_argument_group("part overrides (NAME or NAME:key=value,key=value)")
    g.add_argument("--advantage", help="advantage estimator, e.g. rloo or grpo:eps=1e-4")
    g.add_argument("--ratio", help="ratio granularity, e.g. sequence")
    g.add_argument("--trust-region", help="trust region, e.g. dppo_tv:delta_low=0.1,delta_high=0.1")
    g.add_argument("--aggregation", help="loss aggregation, e.g. prompt_mean")
    g.add_argument("--correction", action="append", help="rollout-mismatch correction (repeatable; 'none' clears)")
    g.add_argument("--shaper", action="append", help="reward shaper (repeatable; 'none' clears)")
    g.add_argument("--filter", action="append", help="group filter (repeatable; 'none' clears)")
    g.add_argument("--kl", help="KL estimator (k1, k2, k3, k3_plus, ...; 'none' removes the KL term)")
    g.add_argument("--kl-coef", type=float, help="KL coefficient beta (>= 0)")
    g.add_argument("--kl-placement", choices=["loss", "reward"], help="KL in the loss or in the reward")
    g.add_argument("--anchor", choices=["old", "rollout"], help="ratio denominator: pi_old or the rollout policy")


def method_from_args(name: str, args: argparse.Namespace):
    """Resolve preset ``name`` with the overrides given on the command line (raises PartError)."""
    from polyrl.methods import get_method

    changes: dict[str, Any] = {}
    for key in ("advantage", "ratio", "trust_region", "aggregation", "kl", "kl_coef", "kl_placement", "anchor"):
        value = getattr(args, key, None)
        if value is not None:
            changes[key] = value
    for key, plural in (("correction", "corrections"), ("shaper", "shapers"), ("filter", "filters")):
        values = getattr(args, key, None)
        if values is not None:
            changes[plural] = [v for v in values if v != "none"]
    if changes.get("kl") == "none":
        changes["kl"], changes["kl_coef"] = None, 0.0
    return get_method(name, **changes)


def cmd_methods(args: argparse.Namespace) -> int:
    from polyrl.catalog import all_methods, method_dict, method_row

    methods = all_methods()
    if args.json:
        print(json.dumps([method_dict(m) for m in methods], indent=2, default=str))
        return 0
    table = Table(title=f"polyrl presets ({len(methods)})", show_lines=False)
    rows = [method_row(m) for m in methods]
    for col in rows[0]:
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(*r.values())
    console.print(table)
    console.print("Details: [bold]polyrl explain NAME[/]; overrides such as --trust-region dppo_tv:delta_low=0.1")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from polyrl.catalog import explain_lines, method_dict

    method = method_from_args(args.name, args)
    if args.json:
        print(json.dumps(method_dict(method), indent=2, default=str))
        return 0
    console.print(f"[bold]{method.name}[/] — {method.summary}")
    console.print(f"paper: {method.paper}")
    table = Table(show_header=True)
    for col in ("part", "resolved", "non-default settings", "what it is"):
        table.add_column(col, overflow="fold")
    for row in explain_lines(method):
        table.add_row(*row)
    console.print(table)
    return 0


def cmd_parts(args: argparse.Namespace) -> int:
    regs = [r for r in ALL_REGISTRIES if args.kind in (None, r.kind)]
    if not regs:
        raise PartError(f"unknown part kind {args.kind!r}; allowed: {', '.join(r.kind for r in ALL_REGISTRIES)}")
    for reg in regs:
        table = Table(title=reg.kind)
        for col in ("name", "settings (defaults)", "summary"):
            table.add_column(col, overflow="fold")
        for spec in reg:
            table.add_row(spec.name, ", ".join(f"{k}={v!r}" for k, v in spec.defaults.items()), spec.summary)
        console.print(table)
    return 0


def cmd_docs(args: argparse.Namespace) -> int:
    from polyrl.catalog import render_methods_markdown

    text = render_methods_markdown()
    if args.check:
        current = Path(args.check).read_text() if Path(args.check).exists() else ""
        if current != text:
            print(f"{args.check} is stale: run `polyrl docs --write {args.check}`", file=sys.stderr)
            return 1
        return 0
    if args.write:
        Path(args.write).parent.mkdir(parents=True, exist_ok=True)
        Path(args.write).write_text(text)
        console.print(f"wrote {args.write}")
        return 0
    print(text)
    return 0


def load_plugin(module: str) -> None:
    """Import a module by dotted name or a ``.py`` file path so that its parts and presets register."""
    from polyrl.plugins import import_module_or_file

    try:
        import_module_or_file(module)
    except ImportError as e:
        raise PartError(f"--plugin {module!r} could not be imported: {e}") from None


def cache_dir() -> Path:
    """Where warm starts are cached: $POLYRL_CACHE, else ~/.cache/polyrl."""
    return Path(os.environ.get("POLYRL_CACHE", Path.home() / ".cache" / "polyrl"))


def cmd_warmstart(args: argparse.Namespace) -> int:
    from polyrl.tinylm import warmstart

    result = warmstart(args.task, cache_dir() / "warmstart", threshold=args.threshold, seed=args.seed,
                       hidden=args.hidden, layers=args.layers)
    how = "cached" if result.cached else f"trained in {result.seconds:.0f} s, {result.steps} steps"
    console.print(f"warm start for {args.task}: accuracy {result.accuracy:.3f} ({how})\n{result.path}")
    return 0


def resolve_train(args: argparse.Namespace):
    """Config (TOML beneath flags), method with overrides, task and model directory, all validated."""
    from polyrl.config import ConfigError, TrainConfig, build_config, load_toml, validate
    from polyrl.tasks import get_task

    values = load_toml(args.config) if args.config else {}
    values.update({k: v for k, v in vars(args).items() if k in TrainConfig.__dataclass_fields__ and v is not None})
    cfg = build_config(values)
    validate(cfg)
    method = method_from_args(cfg.method, args)
    if method.needs_groups and cfg.group_size < 2:
        raise ConfigError(f"group_size = {cfg.group_size} is not allowed with advantage '{method.advantage.name}' "
                          "(a group estimator needs >= 2 completions per prompt)")
    if cfg.sampler == "tree" and (not method.needs_groups or method.needs_values or method.filters):
        raise ConfigError(f"sampler = 'tree' needs a group advantage estimator and no group filters; method "
                          f"{method.name!r} has advantage {method.advantage.name!r} and filters "
                          f"{[f.name for f in method.filters]} (try --advantage grpo --filter none)")
    if cfg.agency is not None and not method.corrections and getattr(args, "correction", None) is None:
        # The behaviour policy is the baseline/learner mixture: importance weights pi_theta / mu keep the update
        # on-policy for the learner (truncated at C = 2, verl's default); an explicit --correction overrides.
        from polyrl.objectives import override

        method = override(method, corrections=["tis"])
        console.print("agency transfer: adding the TIS correction (pi_theta / mixture, C = 2) to the method")
    try:
        task = get_task(cfg.task, data_file=cfg.data_file)
        if cfg.reward_funcs:
            from polyrl.tasks.rewards import WithRewardChannels

            weights = [float(w) for w in cfg.reward_weights.split(",")] if cfg.reward_weights else None
            task = WithRewardChannels(task, [s.strip() for s in cfg.reward_funcs.split(",")], weights)
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise ConfigError(f"task = {cfg.task!r}: {e}") from None
    if cfg.tree_predictor == "likelihood" and not getattr(task, "exact_answer", False):
        raise ConfigError(f"tree_predictor = 'likelihood' is not allowed with task = {cfg.task!r}"
                          f"{' and reward_funcs' if cfg.reward_funcs else ''}: it needs a reward that is 1 exactly "
                          "when the completion is the reference answer (addition, addition_mixed); use history or "
                          "shared")
    if cfg.model is not None:
        from polyrl.model import TOKENIZER_FILES

        if not any((Path(cfg.model) / f).is_file() for f in TOKENIZER_FILES):
            raise ConfigError(f"model = {cfg.model!r} has no tokenizer ({' or '.join(TOKENIZER_FILES)})")
    run_dir = cfg.run_dir or f"runs/{method.name}-{cfg.task}-s{cfg.seed}"
    from polyrl.checkpoint import latest_checkpoint, verify_checkpoint

    latest = latest_checkpoint(run_dir)
    if cfg.resume and cfg.overwrite:
        raise ConfigError("resume = true and overwrite = true contradict each other; choose one")
    if cfg.resume:
        if latest is None:
            raise ConfigError(f"resume = true but run_dir = {run_dir!r} has no checkpoint")
        verify_checkpoint(latest)
    elif cfg.overwrite:
        shutil.rmtree(run_dir, ignore_errors=True)
    elif latest is not None:
        raise ConfigError(f"run_dir = {run_dir!r} already holds checkpoints; pass --resume to continue it, "
                          "--overwrite to start over, or another --run-dir")
    return cfg, method, task, run_dir


def cmd_train(args: argparse.Namespace) -> int:
    from polyrl.catalog import method_dict
    from polyrl.config import to_dict
    from polyrl.trainer import train

    cfg, method, task, run_dir = resolve_train(args)
    model_dir = cfg.model
    if model_dir is None:
        from polyrl.tinylm import warmstart

        ws = warmstart(cfg.task, cache_dir() / "warmstart", seed=0)
        model_dir = ws.path
        console.print(f"warm start: {model_dir} ({'cached' if ws.cached else f'{ws.seconds:.0f} s'}, "
                      f"accuracy {ws.accuracy:.3f})")
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    resolved = {"config": {**to_dict(cfg), "model": model_dir, "run_dir": run_dir}, "method": method_dict(method)}
    (Path(run_dir) / "config.json").write_text(json.dumps(resolved, indent=2, default=str))
    console.print_json(json.dumps(resolved["config"]))
    console.print(f"method: {method.name} = " + "; ".join(f"{k} {v}" for k, v in method.parts().items() if v))
    summary = train(cfg, method, model_dir=model_dir, task=task, run_dir=run_dir, console=console)
    table = Table(title=f"{method.name} on {task.name}")
    for col in ("held-out accuracy before", "after", "steps", "s/step", "rollouts/s", "wall s"):
        table.add_column(col, justify="right")
    table.add_row(f"{summary['eval_before']:.3f}", f"{summary['eval_after']:.3f}", str(summary["steps"]),
                  f"{summary['seconds_per_step']:.2f}", f"{summary['rollouts_per_second']:.1f}",
                  f"{summary['wall_seconds']:.0f}")
    console.print(table)
    console.print(f"run files: {run_dir}/ (summary.json, metrics.jsonl, curves.png, tb/, checkpoints/)")
    return 0


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (naming the option and value) and exit code 2."""

    def error(self, message: str):  # type: ignore[override]
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def cmd_compare(args: argparse.Namespace) -> int:
    from polyrl.lab import CollapseRule, analyse, print_ranking, write_report
    from polyrl.lab.compare import parse_method_args, plan_runs, run_all, split_label, validate_runs

    presets = dict(split_label(m) for m in args.methods.split(",") if m.strip())  # label -> preset
    methods = list(presets)
    if not methods:
        raise ConfigError("methods = '' : give at least one preset, e.g. --methods grpo,dapo")
    if args.seeds < 1 or args.workers < 1:
        raise ConfigError(f"seeds = {args.seeds}, workers = {args.workers}: both must be >= 1")
    shared = ["--task", args.task, *args.extra]
    per_method = parse_method_args(args.method_args, methods)
    model = args.model
    if model is None:
        from polyrl.tinylm import warmstart

        model = warmstart(args.task, cache_dir() / "warmstart", seed=0).path
    validate_runs(methods, shared, per_method, model, presets)
    out = Path(args.out)
    specs = plan_runs(methods, list(range(args.seeds)), out, shared, per_method, model, workers=args.workers,
                      presets=presets)
    console.print(f"{len(specs)} run(s) to do of {len(methods) * args.seeds} (others finished); model {model}")
    failed = [s for s, code, _ in run_all(specs, workers=args.workers, console=console) if code != 0]
    results = analyse(out, threshold=args.threshold, collapse_rule=CollapseRule(drop_fraction=args.collapse_drop),
                      ci=args.ci)
    paths = write_report(results, out)
    print_ranking(results, console)
    console.print(f"report: {out / 'report.html'}  results: {out / 'results.json'}  ({len(paths)} files)")
    if failed:
        console.print(f"[red]{len(failed)} run(s) failed[/]: " + ", ".join(s.name for s in failed))
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="polyrl", description=__doc__.splitlines()[0])
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                        help="import MODULE first, so that its registered parts and presets are available")
    sub = parser.add_subparsers(dest="command", required=True)
    from polyrl.flow.cli import add_flow_parser
    add_flow_parser(sub)

    from polyrl.config import add_config_args

    p = sub.add_parser("train", help="RL-train a local Hugging Face causal LM with a preset (and overrides)")
    p.add_argument("--config", metavar="FILE.toml", help="TOML file of train settings; flags override it")
    add_config_args(p)
    add_method_args(p)
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("compare", help="run methods x seeds on one task and report stability and efficiency",
                       description="Any other option is passed to every `polyrl train` run (e.g. --steps 150 "
                                   "--epochs-per-batch 4 --lr 3e-4).")
    p.add_argument("--methods", required=True, help="comma-separated presets, e.g. grpo,dapo,cispo,dppo_tv; "
                   "LABEL=PRESET names a variant (uniform=grpo,tree=grpo with --method-args 'tree=--sampler tree')")
    p.add_argument("--seeds", type=int, default=3, help="seeds per method (0 .. N-1)")
    p.add_argument("--task", default="addition", help="task for every run")
    p.add_argument("--model", help="start every run from this model directory (default: the task's warm start)")
    p.add_argument("--out", required=True, help="output directory: one run directory per method and seed")
    p.add_argument("--workers", type=int, default=1, help="runs in parallel (each gets cores / workers threads)")
    p.add_argument("--method-args", action="append", metavar="METHOD=FLAGS",
                   help="extra train flags for one method, e.g. 'dppo_tv=--trust-region dppo_tv:delta_low=0.1'")
    p.add_argument("--threshold", type=float, default=0.6, help="held-out accuracy threshold for the efficiency table")
    p.add_argument("--collapse-drop", type=float, default=0.5,
                   help="collapse: metric falls below (1 - this) x its best so far")
    p.add_argument("--ci", type=float, default=0.9, help="bootstrap confidence level over seeds")
    p.set_defaults(fn=cmd_compare, extra=[])

    p = sub.add_parser("warmstart", help="build and supervised-train the tiny model for a task (cached)")
    p.add_argument("--task", default="addition", help="task name")
    p.add_argument("--threshold", type=float, default=0.30, help="stop when held-out greedy accuracy crosses it")
    p.add_argument("--seed", type=int, default=0, help="seed")
    p.add_argument("--hidden", type=int, default=128, help="hidden size")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.set_defaults(fn=cmd_warmstart)

    p = sub.add_parser("methods", help="list every preset with its parts")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(fn=cmd_methods)

    p = sub.add_parser("explain", help="show a preset's resolved parts, parameters, defaults and paper")
    p.add_argument("name", help="preset name (see `polyrl methods`)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_method_args(p)
    p.set_defaults(fn=cmd_explain)

    p = sub.add_parser("parts", help="list registered parts of one kind or of all kinds")
    p.add_argument("kind", nargs="?", help="one of: " + ", ".join(r.kind for r in ALL_REGISTRIES))
    p.set_defaults(fn=cmd_parts)

    p = sub.add_parser("docs", help="generate docs/methods.md from the presets and registries")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--write", metavar="PATH", help="write the markdown to PATH")
    g.add_argument("--check", metavar="PATH", help="exit 1 if PATH differs from the generated text")
    p.set_defaults(fn=cmd_docs)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if args.command != "compare":
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.extra = extra  # shared `polyrl train` flags, validated per method before any run
    try:
        for module in args.plugin:
            load_plugin(module)
        import polyrl.methods  # noqa: F401  (registers every built-in part and preset)

        return int(args.fn(args) or 0)
    except (PartError, ConfigError, CheckpointError, FileNotFoundError) as e:
        print(f"polyrl: error: {e}", file=sys.stderr)
        return 2
    except TrainingError as e:  # the run itself failed, not its configuration
        print(f"polyrl: training stopped: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
