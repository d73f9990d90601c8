"""polyrl.lab report: self-contained HTML whose table numbers equal results.json, plots, console ranking."""

from __future__ import annotations

import base64
import copy
import json
import re
from html.parser import HTMLParser

import pytest
from rich.console import Console

from polyrl.lab.analysis import analyse
from polyrl.lab.plots import PLOTS
from polyrl.lab.report import print_ranking, render_html, write_report
from tests.test_lab_analysis import rows_from_accuracy, sigmoid_runs, write_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class ReportParser(HTMLParser):
    """Collects every src/href value, tag names, and the text of each element carrying data-key."""

    def __init__(self):
        super().__init__()
        self.urls: list[tuple[str, str, str]] = []
        self.tags: set[str] = set()
        self.cells: list[tuple[str, str]] = []
        self.style = ""
        self._open: list[list] = []  # [key, depth, text parts]
        self._in_style = False

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        a = dict(attrs)
        for name in ("src", "href", "srcset", "data", "poster", "action"):
            if name in a:
                self.urls.append((tag, name, a[name] or ""))
        for cell in self._open:
            cell[1] += 1
        if "data-key" in a:
            self._open.append([a["data-key"], 1, []])
        self._in_style = tag == "style"

    def handle_endtag(self, tag):
        self._in_style = False
        for cell in self._open:
            cell[1] -= 1
        while self._open and self._open[-1][1] == 0:
            key, _, parts = self._open.pop()
            self.cells.append((key, "".join(parts).strip()))

    def handle_data(self, data):
        if self._in_style:
            self.style += data
        for cell in self._open:
            cell[2].append(data)


def lookup(results, key):
    obj = results
    for part in key.split("."):
        obj = obj[int(part)] if isinstance(obj, list) else obj[part]
    return obj


def mismatches(results, cells) -> list[str]:
    """Cells whose text is not the JSON value rounded to the displayed precision."""
    bad = []
    for key, text in cells:
        try:
            value = lookup(results, key)
        except (KeyError, IndexError, TypeError):
            bad.append(f"{key}: no such JSON path")
            continue
        if value is None or isinstance(value, str):
            if text != ("—" if value is None else value):
                bad.append(f"{key}: {text!r} != {value!r}")
            continue
        num = text.replace(",", "")
        if not re.fullmatch(r"-?\d+(\.\d+)?(e[+-]\d+)?", num):
            bad.append(f"{key}: {text!r} is not a number")
            continue
        mant, _, exp = num.partition("e")
        decimals = len(mant.partition(".")[2])
        tol = 0.5 * 10.0 ** (-decimals) * (10.0 ** int(exp) if exp else 1.0)
        if abs(float(num) - value) > tol * (1 + 1e-9):
            bad.append(f"{key}: {text!r} != {value!r}")
    return bad


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    sigmoid_runs(root, "dapo", a=0.8, b=1.5, cmid=5000.0)
    sigmoid_runs(root, "grpo", a=0.7, b=1.0, cmid=8000.0, seeds=(0, 1))
    zg = {f"position/zero_grad_frac_q{q}": 0.05 * q for q in range(1, 5)}
    write_run(root / "dapo" / "seed3", rows_from_accuracy({0: 0.2, 10: 0.4}, 10), finished=False)
    for seed, acc in enumerate(({0: 0.2, 10: 0.5, 20: 0.7, 30: 0.3}, {0: 0.2, 10: 0.5, 20: 0.7, 30: 0.7})):
        write_run(root / "cispo" / f"seed{seed}", rows_from_accuracy(acc, 30, **zg))  # too few points: no fit
    results = analyse(root, threshold=0.5, n_boot=100)
    paths = write_report(results, root / "report")
    return results, paths


def test_results_json_is_exactly_the_analysis(report):
    results, paths = report
    assert json.loads(paths["results"].read_text()) == results


def test_plots_are_pngs(report):
    _, paths = report
    for name in PLOTS:
        data = paths[name].read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000


def test_html_is_self_contained(report):
    results, paths = report
    text = paths["html"].read_text(encoding="utf-8")
    p = ReportParser()
    p.feed(text)
    assert not {"script", "link", "iframe", "object", "embed"} & p.tags
    imgs = [u for tag, _, u in p.urls if tag == "img"]
    assert len(imgs) == len(PLOTS)
    for src in imgs:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]).startswith(PNG_MAGIC)
    assert all(u.startswith("data:") for _, _, u in p.urls)
    assert "url(" not in p.style and "@import" not in p.style and p.style
    assert not re.search(r"(src|href)\s*=\s*[\"']?\s*(https?:)?//", text, re.I)


def test_every_table_number_equals_results_json(report):
    results, paths = report
    p = ReportParser()
    p.feed(paths["html"].read_text(encoding="utf-8"))
    keys = {k for k, _ in p.cells}
    assert mismatches(results, p.cells) == []
    for m in ("dapo", "grpo", "cispo"):
        for k in ("threshold.steps_mean", "threshold.tokens_mean", "threshold.seeds_reached", "collapse.count"):
            assert f"methods.{m}.{k}" in keys
    for i in range(3):
        assert {f"ranking.{i}.method", f"ranking.{i}.final_mean", f"ranking.{i}.auc"} <= keys
    for k in ("A", "A_se", "B", "B_se", "Cmid", "Cmid_se"):
        assert f"methods.dapo.sigmoid.{k}" in keys
    assert "methods.cispo.sigmoid.reason" in keys and "methods.dapo.unfinished_seeds.0" in keys
    assert "methods.cispo.collapse.per_seed.0.reason" in keys and "methods.cispo.collapse.per_seed.0.step" in keys
    assert "methods.cispo.zero_grad.q4.mean" in keys
    # the table order is the ranking order
    ranked = [r["method"] for r in results["ranking"]]
    assert [t for k, t in p.cells if re.fullmatch(r"ranking\.\d+\.method", k)] == ranked
    assert [k.split(".")[1] for k, _ in p.cells if k.endswith(".threshold.steps_mean")] == ranked


def test_consistency_check_detects_a_changed_number(report):
    results, paths = report
    p = ReportParser()
    p.feed(render_html(results, {}))
    tampered = copy.deepcopy(results)
    tampered["methods"]["dapo"]["threshold"]["steps_mean"] += 0.5
    tampered["methods"]["dapo"]["sigmoid"]["Cmid"] *= 1.01
    tampered["ranking"][0]["method"] = "other"
    bad = mismatches(tampered, p.cells)
    assert len(bad) == 3 and any("steps_mean" in b for b in bad) and any("Cmid" in b for b in bad)


def test_report_facts(report):
    results, _ = report
    m = results["methods"]
    assert m["cispo"]["collapse"]["count"] == 1 and m["cispo"]["collapse"]["per_seed"][0]["step"] == 30
    assert m["cispo"]["sigmoid"]["ok"] is False
    assert m["dapo"]["unfinished_seeds"] == [3] and m["dapo"]["final"]["n"] == 3
    assert results["ranking"][0]["method"] == "dapo"


def test_print_ranking(report):
    results, _ = report
    console = Console(record=True, width=100)
    print_ranking(results, console)
    out = console.export_text()
    positions = [out.index(r["method"]) for r in results["ranking"]]
    assert positions == sorted(positions)
    assert f"{results['ranking'][0]['final_mean']:.3f}" in out and "no fit" in out


def test_curve_tail_reached_by_fewer_seeds_is_dotted_without_a_band():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from polyrl.lab.plots import _band

    fig, ax = plt.subplots()
    c = {"x": [-100, 0, 400, 800, 900], "mean": [0.9, 0.2, 0.4, 0.6, 0.1], "lo": [0.9, 0.1, 0.3, 0.5, 0.1],
         "hi": [0.9, 0.3, 0.5, 0.7, 0.1], "n": [1, 3, 3, 2, 1]}
    assert _band(ax, c, "C0", "m")
    solid, head, tail = ax.lines
    assert list(solid.get_xdata()) == [0, 400] and solid.get_linestyle() == "-"
    assert list(head.get_xdata()) == [-100, 0] and head.get_linestyle() == ":"
    assert list(tail.get_xdata()) == [400, 800, 900] and tail.get_linestyle() == ":"
    band = ax.collections[0].get_paths()[0].vertices[:, 0]
    assert band.min() == 0 and band.max() == 400  # the band covers only the points every seed reaches
    plt.close(fig)
