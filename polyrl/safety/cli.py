"""`polyrl safety TOOL ...`: one subcommand per tool of ``polyrl.safety.TOOLS``.

Built only when the command is ``safety`` (a tool's module may import torch); every tool's ``add_parser`` adds
its own subcommand with ``fn`` set, and bad values raise ``ConfigError`` (one line, exit 2) like `polyrl train`.
"""

from __future__ import annotations

import importlib

from polyrl.safety import HELP, TOOLS


def add_parser(subparsers) -> None:
    """Add `polyrl safety` and each tool's subcommand."""
    p = subparsers.add_parser("safety", help=HELP, description=HELP)
    tools = p.add_subparsers(dest="tool", required=True)
    for name, (module, _) in TOOLS.items():
        importlib.import_module(f"polyrl.safety.{module}").add_parser(tools, name)
