"""`polyrl` command line: methods, explain, parts, docs.

Bad input prints one line naming the field, the value and what is allowed, and exits with code 2.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

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
    try:
        if module.endswith(".py"):
            path = Path(module)
            if not path.is_file():
                raise PartError(f"--plugin {module!r}: no such file")
            spec = importlib.util.spec_from_file_location(path.stem, path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[path.stem] = mod
            spec.loader.exec_module(mod)
        else:
            importlib.import_module(module)
    except ImportError as e:
        raise PartError(f"--plugin {module!r} could not be imported: {e}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="polyrl", description=__doc__.splitlines()[0])
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                        help="import MODULE first, so that its registered parts and presets are available")
    sub = parser.add_subparsers(dest="command", required=True)

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
    args = parser.parse_args(argv)
    try:
        for module in args.plugin:
            load_plugin(module)
        import polyrl.methods  # noqa: F401  (registers every built-in part and preset)

        return int(args.fn(args) or 0)
    except PartError as e:
        print(f"polyrl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
