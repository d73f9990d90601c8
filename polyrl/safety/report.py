"""The report every safety experiment writes: ``results.json`` and a self-contained ``report.html``.

The page holds, in order: the claim being tested and the verdict (one paragraph each, written by the tool from
its measured numbers), tables of the measurements (with intervals over seeds), and the figures (PNG files,
embedded as base64 so the page is one file). The style is the lab's (``polyrl.lab.report.CSS``).
"""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path
from typing import Any

from polyrl.lab.report import CSS


def table_html(headers: list[str], rows: list[list[Any]]) -> str:
    """An HTML table of plain values (floats printed with 4 significant digits)."""
    def cell(v: Any) -> str:
        return html.escape(f"{v:.4g}" if isinstance(v, float) else str(v))

    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def write_report(out_dir: str | Path, *, title: str, claim: str, verdict: str, results: dict[str, Any],
                 tables: dict[str, str] | None = None, figures: dict[str, Path] | None = None,
                 notes: list[str] | None = None) -> dict[str, Path]:
    """Write ``results.json`` and ``report.html`` into ``out_dir``; return their paths.

    ``claim``: what the seed document or paper says; ``verdict``: what this run measured against it (plain text);
    ``tables``: heading -> HTML (``table_html``); ``figures``: heading -> PNG path; ``notes``: assumptions, caveats.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    res_path = out / "results.json"
    text = json.dumps(_json_safe(results), indent=1, allow_nan=False, default=float)
    parts = [f"<h2>Claim</h2><p>{html.escape(claim)}</p>", f"<h2>Verdict</h2><p>{html.escape(verdict)}</p>"]
    parts += [f"<h2>{html.escape(h)}</h2>{t}" for h, t in (tables or {}).items()]
    for heading, path in (figures or {}).items():
        data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
        parts.append(f'<h2>{html.escape(heading)}</h2><img alt="{html.escape(heading)}" '
                     f'src="data:image/png;base64,{data}">')
    if notes:
        parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>")
    page = (f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>{html.escape(title)}</title>"
            f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>{''.join(parts)}"
            "<p class=muted>Raw numbers: results.json next to this file.</p></body></html>")
    html_path = out / "report.html"
    html_path.write_text(page, encoding="utf-8")
    partial = out / ".results.json.partial"  # results.json last and whole: it marks a finished run (settle_out)
    partial.write_text(text)
    partial.replace(res_path)
    return {"results": res_path, "html": html_path}


def _json_safe(x: Any) -> Any:
    """``x`` with every nan or inf float (a run that diverged, an extreme setting) as None: JSON has no such numbers,
    and the JSON writer raised on them after the run's figures were written."""
    if getattr(x, "ndim", None) == 0:  # a numpy or torch scalar
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x
