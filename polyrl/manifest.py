"""The catalog manifest, ``polyrl/catalog.json``: everything `polyrl methods`, `parts` and `explain NAME` print.

Those commands should answer at once, but the presets and parts are registered by modules that import torch
(about a second). So ``polyrl docs --write`` renders what they print from the live registries into this JSON
file, shipped inside the package, and the CLI reads it instead; a test fails when it is stale. With ``--plugin``
(which may register more presets and parts) or with part overrides the CLI uses the live registries.

This module imports nothing heavy at the top: ``build_manifest`` and ``method_entry`` import the registries.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MANIFEST_PATH = Path(__file__).with_name("catalog.json")
FORMAT = 1


def method_entry(method: Any) -> dict[str, Any]:
    """What the CLI prints about one resolved ``Method``: its table rows, its JSON and its explain lines."""
    from polyrl.catalog import explain_lines, method_dict, method_row, method_row_compact

    return {
        "name": method.name,
        "summary": method.summary,
        "paper": method.paper,
        "row": method_row(method),
        "compact": method_row_compact(method),
        "dict": method_dict(method),
        "explain": [list(line) for line in explain_lines(method)],
    }


def part_kinds() -> list[dict[str, Any]]:
    """Every registry's parts with their defaults (as `polyrl parts` shows them) and summary lines."""
    from polyrl.registry import ALL_REGISTRIES

    return [{"kind": reg.kind,
             "parts": [{"name": spec.name, "settings": ", ".join(f"{k}={v!r}" for k, v in spec.defaults.items()),
                        "summary": spec.summary} for spec in reg]}
            for reg in ALL_REGISTRIES]


def build_manifest() -> dict[str, Any]:
    """The manifest from the live registries (imports torch); every preset as ``method_entry`` shows it."""
    from polyrl.catalog import all_methods

    return {
        "format": FORMAT,
        "generated_by": "polyrl docs --write docs/methods.md (make docs); do not edit by hand",
        "methods": [method_entry(m) for m in all_methods()],
        "parts": part_kinds(),
    }


def render_manifest(manifest: dict[str, Any]) -> str:
    """The file's text. ``default=str`` as in the CLI's JSON output, so both print the same after a round trip."""
    return json.dumps(manifest, indent=1, default=str) + "\n"


def load_manifest(path: Path = MANIFEST_PATH) -> dict[str, Any] | None:
    """The shipped manifest, or None when it is missing, unreadable or of another format (use the registries)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == FORMAT else None
