"""Report of a compare analysis: PNG plots, ``results.json`` and one self-contained ``report.html``.

The HTML opens offline: plots are embedded as base64 data URIs, CSS is inline, there are no scripts and
no links. Every number shown in a table sits in an element whose ``data-key`` attribute is its JSON path
in ``results.json`` (e.g. ``methods.dapo.threshold.steps_mean``); the displayed text is that value
rounded to the displayed precision ("—" for null).
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from polyrl.lab.plots import AXIS_LABELS, write_plots

PLOT_TITLES = {
    "performance": "Training reward and held-out accuracy against steps, rollouts and tokens",
    "dynamics": "Entropy, response length and KL against steps",
    "zero_grad": "Zero-gradient (clipped or masked) token share by response-position quarter",
    "sigmoid": "ScaleRL sigmoid fits over the measured points",
}

# display formats: name -> formatter of a number
FORMATS: dict[str, Callable[[float], str]] = {
    "f3": "{:.3f}".format,
    "f2": "{:.2f}".format,
    "f1": "{:.1f}".format,
    "int": "{:,.0f}".format,
    "sci": "{:.3e}".format,
}


def _get(results: dict[str, Any], key: str) -> Any:
    obj: Any = results
    for part in key.split("."):
        if obj is None:
            return None
        obj = obj[int(part)] if isinstance(obj, list) else obj.get(part)
    return obj


def _fmt(value: Any, fmt: str) -> str:
    if value is None:
        return "—"
    if isinstance(value, str):
        return value
    return FORMATS[fmt](value)


def _cell(results: dict[str, Any], key: str, fmt: str = "f3", tag: str = "span") -> str:
    text = html.escape(_fmt(_get(results, key), fmt))
    return f'<{tag} data-key="{html.escape(key)}">{text}</{tag}>'


# ---------------------------------------------------------------- html

CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1320px;color:#222;
 padding:0 16px;line-height:1.4}
h1{font-size:22px;margin-bottom:4px}h2{font-size:17px;margin-top:30px;border-bottom:1px solid #ddd;padding-bottom:4px}
table{border-collapse:collapse;margin:8px 0;font-size:13px}
th,td{border:1px solid #d6d6d6;padding:4px 9px;text-align:right;vertical-align:top}
th{background:#f3f4f6}td.l,th.l{text-align:left}
tr:nth-child(even) td{background:#fafafa}
.ci{color:#666;font-size:12px}.muted{color:#666}.warn{color:#a3470a}
p.muted{font-size:13px;margin-top:2px}h3{font-size:14px;margin:18px 0 2px}
img{max-width:100%;border:1px solid #eee;margin:6px 0}
ul{font-size:13px;margin-top:4px}code{background:#f3f4f6;padding:0 3px}
"""


def _table(headers: list[str], rows: list[list[Any]], left: tuple[int, ...] = (0,)) -> str:
    """HTML table; columns in ``left`` are left-aligned; a cell (html, colspan) spans columns."""

    def td(i: int, c: Any, tag: str = "td") -> str:
        text, span = c if isinstance(c, tuple) else (c, 1)
        attrs = (' class="l"' if i in left or span > 1 else "") + (f' colspan="{span}"' if span > 1 else "")
        return f"<{tag}{attrs}>{text}</{tag}>"

    head = "".join(td(i, h, "th") for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(td(i, c) for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _pm(results, key: str, fmt: str) -> str:
    return f"{_cell(results, key, fmt)} <span class=ci>± {_cell(results, key + '_se', fmt)}</span>"


def _interval(results, key: str, fmt: str = "f3") -> str:
    return f"<span class=ci>[{_cell(results, key + 'lo', fmt)}, {_cell(results, key + 'hi', fmt)}]</span>"


def _sections(results: dict[str, Any]) -> list[str]:
    s, methods = results["settings"], results["methods"]
    order = [r["method"] for r in results["ranking"]]  # every table lists methods in ranking order
    perf = html.escape(s["perf_metric"])
    out = []

    rows = []
    for i, r in enumerate(results["ranking"]):
        k, m = f"ranking.{i}.", r["method"]
        unfinished = methods[m]["unfinished_seeds"]
        rows.append(
            [
                _cell(results, k + "rank", "int"),
                _cell(results, k + "method"),
                f"{_cell(results, k + 'final_mean')} {_interval(results, k + 'final_')}",
                _cell(results, k + "auc"),
                f"{_cell(results, f'methods.{m}.final.n', 'int')} / {_cell(results, k + 'n_seeds', 'int')}",
                ", ".join(_cell(results, f"methods.{m}.unfinished_seeds.{j}", "int") for j in range(len(unfinished)))
                or "—",
            ]
        )
    hdr = ["rank", "method", f"final {perf} (mean, CI)", f"area under {perf} curve", "seeds used / run", "unfinished"]
    out.append(f"<h2>Ranking</h2>{_table(hdr, rows, left=(0, 1, 5))}")

    rows = []
    for m in order:
        k = f"methods.{m}.threshold."
        reached = f"{_cell(results, k + 'seeds_reached', 'int')} / {_cell(results, k + 'n_seeds', 'int')}"
        per_seed = ", ".join(
            f"s{e['seed']}: {_cell(results, f'{k}per_seed.{j}.step', 'int')}"
            for j, e in enumerate(methods[m]["threshold"]["per_seed"])
        )
        rows.append(
            [
                html.escape(m),
                _cell(results, k + "steps_mean", "f1"),
                _cell(results, k + "rollouts_mean", "int"),
                _cell(results, k + "tokens_mean", "int"),
                reached,
                per_seed,
            ]
        )
    thr = _cell(results, "settings.threshold", "f3")
    hdr = ["method", "steps (mean)", "rollouts (mean)", "tokens (mean)", "seeds reached", "step per seed"]
    note = "<p class=muted>Means over the seeds that reached the threshold (first logged crossing).</p>"
    out.append(f"<h2>Compute to reach {perf} &ge; {thr}</h2>{_table(hdr, rows, left=(0, 5))}{note}")

    rows = []
    for m in order:
        k = f"methods.{m}.collapse."
        firsts = [
            f"seed {_cell(results, f'{k}per_seed.{j}.seed', 'int')}: "
            f"step {_cell(results, f'{k}per_seed.{j}.step', 'int')} — {_cell(results, f'{k}per_seed.{j}.reason')}"
            for j, e in enumerate(methods[m]["collapse"]["per_seed"])
            if e["step"] is not None
        ]
        rows.append(
            [
                html.escape(m),
                f"{_cell(results, k + 'count', 'int')} / {_cell(results, k + 'n_seeds', 'int')}",
                _cell(results, k + "rate", "f2"),
                "<br>".join(firsts) or "<span class=muted>none</span>",
            ]
        )
    defn = f"<p class=muted>Definition: {_cell(results, 'settings.collapse_definition')}.</p>"
    hdr = ["method", "collapsed", "rate", "first collapse (seed: step, reason)"]
    out.append(f"<h2>Collapse</h2>{_table(hdr, rows, left=(0, 3))}")
    out.append(defn)

    rows = []
    for m in order:
        k = f"methods.{m}.sigmoid."
        if methods[m]["sigmoid"]["ok"]:
            rows.append(
                [
                    html.escape(m),
                    _pm(results, k + "A", "f3"),
                    _pm(results, k + "B", "f3"),
                    _pm(results, k + "Cmid", "sci"),
                    _cell(results, k + "R0", "f3"),
                    _cell(results, k + "rmse", "f3"),
                    _cell(results, k + "n_points", "int"),
                ]
            )
        else:
            reason = f"<span class=warn>no fit: {_cell(results, k + 'reason')}</span>"
            rows.append([html.escape(m), (reason, 3), _cell(results, k + "R0", "f3"), "", ""])
    hdr = ["method", "A (asymptote)", "B (exponent)", "C<sub>mid</sub>", "R<sub>0</sub> (fixed)", "RMSE", "points"]
    law = (
        f"<p class=muted>R(C) = R<sub>0</sub> + (A &minus; R<sub>0</sub>) / (1 + (C<sub>mid</sub>/C)<sup>B</sup>), "
        f"{perf} against {html.escape(AXIS_LABELS[s['compute']])}, all seeds pooled; ± = standard error from "
        "the curve_fit covariance (arXiv:2510.13786).</p>"
    )
    out.append(f"<h2>ScaleRL sigmoid fit</h2>{_table(hdr, rows)}{law}")

    rows = []
    for m in order:
        if methods[m]["zero_grad"]:
            rows.append([html.escape(m)] + [_cell(results, f"methods.{m}.zero_grad.q{i}.mean") for i in range(1, 5)])
    if rows:
        hdr = ["method", "q1 (start)", "q2", "q3", "q4 (end)"]
        out.append(f"<h2>Zero-gradient token share by position</h2>{_table(hdr, rows)}")
    return out


def render_html(results: dict[str, Any], plots: dict[str, Path], title: str = "polyrl compare") -> str:
    """The self-contained report page (see the module docstring)."""
    s = results["settings"]
    images = "".join(
        f'<h3>{html.escape(PLOT_TITLES.get(name, name))}</h3><img alt="{html.escape(name)}" src="data:image/png;base64,'
        f'{base64.b64encode(Path(p).read_bytes()).decode("ascii")}">'
        for name, p in plots.items()
    )
    est = [m for m, r in results["methods"].items() if r["tokens_estimated"]]
    notes = [
        f"Performance metric: {_cell(results, 'settings.perf_metric')}; intervals: "
        f"{_cell(results, 'settings.ci', 'f2')} percentile bootstrap over seeds; sigmoid compute axis: "
        f"{_cell(results, 'settings.compute')}.",
        "Final values, areas, thresholds, collapses and fits use finished seeds when any finished.",
    ]
    if est:
        notes.append(
            "<span class=warn>Token counts estimated as rollouts &times; mean length for: "
            f"{html.escape(', '.join(est))}.</span>"
        )
    body = "".join(_sections(results))
    return (
        f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>{html.escape(title)}</title>"
        f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>"
        f"<ul>{''.join(f'<li>{n}</li>' for n in notes)}</ul>"
        f"{body}<h2>Plots</h2>{images}"
        f"<p class=muted>Raw numbers: results.json next to this file. Threshold {s['threshold']:g}.</p>"
        "</body></html>"
    )


def write_report(results: dict[str, Any], out_dir: str | Path, *, title: str = "polyrl compare") -> dict[str, Path]:
    """Write plots (PNG), ``results.json`` and ``report.html`` into ``out_dir``; return {name: path}.

    Names: "results", "html" and one per plot ("performance", "dynamics", "zero_grad", "sigmoid").
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = write_plots(results, out / "plots")
    res_path = out / "results.json"
    res_path.write_text(json.dumps(results, indent=1, allow_nan=False))
    html_path = out / "report.html"
    html_path.write_text(render_html(results, plots, title), encoding="utf-8")
    return {"results": res_path, "html": html_path, **plots}


def print_ranking(results: dict[str, Any], console: Console | None = None) -> Table:
    """Print (and return) a rich table ranking the methods."""
    console = console or Console()
    perf = results["settings"]["perf_metric"]
    thr = results["settings"]["threshold"]
    table = Table(
        title=f"ranking by final {perf} (threshold {thr:g}, A = sigmoid asymptote)",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    for col in ("#", "method", "final", "CI", "AUC", "steps→thr", "reached", "collapsed", "A"):
        table.add_column(col, justify="left" if col == "method" else "right", no_wrap=True)
    for r in results["ranking"]:
        m = results["methods"][r["method"]]
        th, co, sg = m["threshold"], m["collapse"], m["sigmoid"]
        table.add_row(
            str(r["rank"]),
            r["method"],
            _fmt(r["final_mean"], "f3"),
            f"{_fmt(r['final_lo'], 'f3')}–{_fmt(r['final_hi'], 'f3')}",
            _fmt(r["auc"], "f3"),
            _fmt(th["steps_mean"], "f1"),
            f"{th['seeds_reached']}/{th['n_seeds']}",
            f"{co['count']}/{co['n_seeds']}",
            _fmt(sg.get("A"), "f3") if sg["ok"] else "no fit",
        )
    console.print(table)
    return table
