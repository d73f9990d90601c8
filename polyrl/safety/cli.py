"""`polyrl safety TOOL ...`: one subcommand per tool of ``polyrl.safety.TOOLS``.

Built only when the command is ``safety`` (a tool's module may import torch); every tool's ``add_parser`` adds
its own subcommand with ``fn`` set, and bad values raise ``ConfigError`` (one line, exit 2) like `polyrl train`.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from collections.abc import Callable
from pathlib import Path

from polyrl.safety import HELP, TOOLS


def add_parser(subparsers) -> None:
    """Add `polyrl safety` and each tool's subcommand."""
    p = subparsers.add_parser("safety", help=HELP, description=HELP)
    tools = p.add_subparsers(dest="tool", required=True)
    for name, (module, _) in TOOLS.items():
        importlib.import_module(f"polyrl.safety.{module}").add_parser(tools, name)
        tool = tools.choices[name]
        tool.set_defaults(fn=functools.partial(_settled, tool.get_default("fn")))


def _settled(fn: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a tool; however it ends (SIGTERM too), the finished run ``--overwrite`` set aside is deleted or put back
    (``options.settle_out``), and the folders it made for ``--out`` go if they stayed empty."""
    from polyrl.runs import missing_folders, remove_empty, signals_unwind
    from polyrl.safety.options import settle_out

    out = Path(args.out)
    made = missing_folders(out)
    with signals_unwind():
        try:
            return fn(args)
        finally:
            remove_empty(made)  # a refused or failed run leaves no empty --out behind
            try:
                if out.is_dir() and settle_out(out):
                    print(f"polyrl: the run did not finish; the earlier results in {out} are back", file=sys.stderr)
            except OSError as e:
                print(f"polyrl: warning: the earlier results in {out} are still hidden as .results.json.replaced "
                      f"and .report.html.replaced ({e.strerror or e})", file=sys.stderr)
