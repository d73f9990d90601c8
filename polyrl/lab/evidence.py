"""`polyrl evidence`: run the claim registry, save results, render docs/evidence.md and an HTML report.

results = run_evidence(["dapo_clip_higher"], "quick", workers=2, out=Path("runs/evidence/quick"))
text = render_markdown(results, CLAIMS)      # a pure function of results + the registry's text
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from polyrl.lab.claim_types import Budget, Claim, check_workers

GENERATED_BY = "polyrl evidence"


def _budget(claim: Claim, budget: str | Budget) -> Budget:
    return budget if isinstance(budget, Budget) else getattr(claim, budget)


def _strict(obj: Any) -> Any:
    """Plain JSON values: numpy numbers and arrays as Python ones, NaN and infinities as null (JSON has neither; a
    claim's numbers read back as None, which its decision takes as NaN)."""
    if isinstance(obj, np.ndarray):
        return _strict(obj.tolist())
    if isinstance(obj, dict):
        return {str(k): _strict(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_strict(v) for v in obj]
    if isinstance(obj, bool | str) or obj is None:
        return obj
    if isinstance(obj, int | np.integer):
        return int(obj)
    value = float(obj)
    return value if math.isfinite(value) else None


def _dumps(obj: Any, **kw: Any) -> str:
    return json.dumps(_strict(obj), allow_nan=False, **kw)


def decision_dict(decision: Any) -> dict[str, Any]:
    return _strict(dataclasses.asdict(decision))


def _fingerprint(claim: Claim) -> str:
    return hashlib.sha1(claim.setup.encode()).hexdigest()[:12]


def run_evidence(ids: list[str], budget: str | Budget, *, workers: int, out: Path, registry: dict[str, Claim],
                 progress=None) -> dict[str, Any]:
    """Run each claim (skipping saved samples), decide it, write OUT/results.json; return the results dict."""
    check_workers(workers)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    res_path = out / "results.json"
    results = json.loads(res_path.read_text()) if res_path.exists() else {}
    results.update({"budget": budget if isinstance(budget, str) else dataclasses.asdict(budget),
                    "generated_by": GENERATED_BY})
    results.setdefault("claims", {})
    for i, cid in enumerate(ids):
        claim = registry[cid]
        b = _budget(claim, budget)
        cdir = out / cid
        cdir.mkdir(parents=True, exist_ok=True)
        spath = cdir / "samples.json"
        t0 = time.perf_counter()
        saved = json.loads(spath.read_text()) if spath.exists() else {}
        # Saved samples are reused for the same budget and the same experiment (the setup text names the arms'
        # flags); samples saved before the fingerprint existed carry none and are reused on the budget alone.
        if saved.get("budget") == dataclasses.asdict(b) and saved.get("setup", _fingerprint(claim)) == \
                _fingerprint(claim):
            samples = saved["samples"]
        else:
            samples = _strict(claim.run(b, cdir, workers))  # as a rerun reads them back from samples.json
            spath.write_text(_dumps({"budget": dataclasses.asdict(b), "setup": _fingerprint(claim),
                                     "samples": samples}, indent=1))
        decision = claim.decide(samples)
        results["claims"][cid] = {"samples": samples, "decision": decision_dict(decision),
                                  "budget": dataclasses.asdict(b),
                                  "wall_seconds": float(samples.get("wall_seconds", time.perf_counter() - t0))}
        res_path.write_text(_dumps(results, indent=1, sort_keys=True))
        if progress is not None:
            progress(i + 1, len(ids), cid, decision.verdict)
    return results


def redecide(results: dict[str, Any], registry: dict[str, Claim]) -> dict[str, Any]:
    """Each claim's decision made again from its saved samples (a verdict is a function of them), so a report after a
    change of the rule states the rule's verdicts without running a claim again."""
    for cid, c in results["claims"].items():
        if cid in registry:
            c["decision"] = decision_dict(registry[cid].decide(c["samples"]))
    return results


def _f(x: Any) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def _mean(v: list) -> float | None:
    v = [x for x in v if x is not None and isinstance(x, int | float) and math.isfinite(x)]
    return sum(v) / len(v) if v else None


def render_markdown(results: dict[str, Any], registry: dict[str, Claim], *, image_dir: str = "evidence") -> str:
    """docs/evidence.md: a summary table, then one section per claim (a pure function of its inputs)."""
    claims = dict(sorted(results.get("claims", {}).items()))
    lines = ["# Evidence: the seed documents' claims, tested", "",
             f"Generated by `{results.get('generated_by', GENERATED_BY)} --budget {results.get('budget')}` from "
             "docs/evidence/results.json; every verdict follows from the rule in polyrl/lab/verdicts.py.", "",
             "| claim | verdict | primary effect | interval | seeds |", "|---|---|---|---|---|"]
    for cid, c in claims.items():
        d = c["decision"]
        e = d["effects"][0] if d["effects"] else {}
        lines.append(f"| [{cid}](#{cid}) | {d['verdict']} | {_f(e.get('estimate'))} | "
                     f"[{_f(e.get('lo'))}, {_f(e.get('hi'))}] | {c['budget']['seeds']} |")
    for cid, c in claims.items():
        claim, d = registry.get(cid), c["decision"]
        lines += ["", f"## {cid}", ""]
        if claim is not None:
            lines += [f"**{claim.title}**", "", f"> {claim.seed_text}", "", f"Source: {claim.seed_source}", ""]
            if claim.corrected:
                lines += [f"Corrected statement: {claim.corrected}", ""]
            lines += [f"Setup: {claim.setup}", ""]
        lines += [f"Budget: {c['budget']['seeds']} seeds x {c['budget']['steps']} steps, "
                  f"{c['wall_seconds']:.0f} s.", "", f"![{cid}]({image_dir}/{cid}.png)", "",
                  "| effect | estimate | interval | level | n |", "|---|---|---|---|---|"]
        for e in d["effects"]:
            lines.append(f"| {e['name']} | {_f(e['estimate'])} | [{_f(e['lo'])}, {_f(e['hi'])}] | "
                         f"{_f(e['level'])} | {e['n']} |")
        arms = c["samples"].get("arms", {})
        stats = sorted({k for a in arms.values() for k, v in a.items() if k != "seeds" and isinstance(v, list)})
        if arms and stats:
            lines += ["", "| arm | " + " | ".join(stats) + " |", "|---" * (len(stats) + 1) + "|"]
            for arm, a in arms.items():
                lines.append(f"| {arm} | " + " | ".join(_f(_mean(a.get(s, []))) for s in stats) + " |")
        lines += ["", f"**Verdict: {d['verdict']}.** {d['reason']}"]
        if d["verdict"] == "inconclusive":
            lines += ["", f"Seeds that would settle it: {_f(d.get('seeds_needed'))} per arm."]
        if claim is not None:
            lines += ["", f"Limits: {claim.limits}"]
    return "\n".join(lines) + "\n"


def plot_claim(cid: str, samples: dict[str, Any], path: Path) -> Path:
    """One PNG per claim: curves when the samples have them, else per-arm per-seed points of the first stat."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    curves = samples.get("curves") or {}
    if curves:
        for arm, cv in curves.items():
            ax.plot(cv["x"], cv["y"], linestyle=cv.get("linestyle", "-"), color=cv.get("color"), label=arm)
            if cv.get("lo") and cv.get("hi"):
                band = {"color": cv["color"]} if cv.get("color") else {}  # else the patch colour cycle
                ax.fill_between(cv["x"], cv["lo"], cv["hi"], alpha=0.2, **band)
            ax.set_ylabel(cv.get("label", ""))
        ax.set_xlabel(next((cv["xlabel"] for cv in curves.values() if cv.get("xlabel")), "step"))
    else:
        for i, (arm, a) in enumerate(samples.get("arms", {}).items()):
            stat = next((k for k, v in a.items() if k != "seeds" and isinstance(v, list)), None)
            if stat:
                ax.scatter([i] * len(a[stat]), a[stat], label=f"{arm}: {stat}")
    ax.set_title(cid)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def render_html(results: dict[str, Any], registry: dict[str, Claim], plots: dict[str, Path]) -> str:
    """A self-contained HTML version of the markdown with the plots embedded as base64 PNG."""
    import html

    body = []
    for line in render_markdown(results, registry).splitlines():
        if line.startswith("![") and "(" in line:
            cid = line[2:line.index("]")]
            if cid in plots and Path(plots[cid]).exists():
                data = base64.b64encode(Path(plots[cid]).read_bytes()).decode()
                body.append(f'<img src="data:image/png;base64,{data}" alt="{html.escape(cid)}">')
                continue
        tag = "h1" if line.startswith("# ") else "h2" if line.startswith("## ") else "pre" if line.startswith("|") \
            else "blockquote" if line.startswith("> ") else "p"
        body.append(f"<{tag}>{html.escape(line.lstrip('#> '))}</{tag}>" if line else "")
    return "<!doctype html><meta charset='utf-8'><title>polyrl evidence</title>\n" + "\n".join(body)


def write_reports(results: dict[str, Any], registry: dict[str, Claim], out: Path, *, docs: Path | None = None) -> None:
    """Plots + evidence.md + evidence.html under OUT (and, with ``docs``, docs/evidence.md + docs/evidence/)."""
    out = Path(out)
    # Render what results.json will hold (keys sorted), so that the document is a function of the file alone.
    results = json.loads(_dumps(results, sort_keys=True))
    img = (docs / "evidence") if docs is not None else out / "evidence"
    plots = {cid: plot_claim(cid, c["samples"], img / f"{cid}.png") for cid, c in results["claims"].items()}
    md = render_markdown(results, registry)
    (out / "evidence.md").write_text(md)
    (out / "evidence.html").write_text(render_html(results, registry, plots))
    if docs is not None:
        (docs / "evidence").mkdir(parents=True, exist_ok=True)
        (docs / "evidence" / "results.json").write_text(_dumps(results, indent=1, sort_keys=True))
        (docs / "evidence.md").write_text(md)


DEFAULT_BUDGET, DEFAULT_WORKERS = "quick", 2


def _given(args: Any, names: tuple[str, ...]) -> list[str]:
    """The options among ``names`` given on the command line, as 'flag value'.

    The parser's defaults mark "not given": None, and False for the store_true flags (``write_docs`` is a
    --write-docs/--no-write-docs pair, so False there is given).
    """
    out = []
    for name in names:
        value = getattr(args, name)
        if value is None or (value is False and name != "write_docs"):
            continue
        flag = "--" + name.replace("_", "-")
        if name == "write_docs":
            flag = "--write-docs" if value else "--no-write-docs"
        out.append(flag if isinstance(value, bool) else f"{flag} {value}")
    return out


def check_args(args: Any) -> None:
    """Refuse, in one line, a bad ``--workers`` and options that ``--list`` or ``--report-only`` would ignore.

    ``--list`` only prints the claims (``--claims`` filters them) and runs nothing. ``--report-only`` renders every
    claim in OUT/results.json: in a normal run too the report covers all of them, not only ``--claims`` (filtering
    here would also drop the other claims from docs/evidence/results.json under ``--write-docs``).
    """
    from polyrl.config import ConfigError

    if args.workers is not None:
        try:
            check_workers(args.workers)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if args.list:
        unused = _given(args, ("budget", "workers", "out", "report_only", "write_docs"))
        if unused:
            raise ConfigError(f"{', '.join(unused)}: no effect with --list, which prints the claims (filtered by "
                              "--claims) and runs nothing; allowed with --list: --claims")
    elif args.report_only:
        unused = _given(args, ("claims", "workers"))
        if unused:
            raise ConfigError(f"{', '.join(unused)}: no effect with --report-only, which runs nothing and reports "
                              "every claim in OUT/results.json; allowed with it: --budget, --out, --write-docs")


def read_results(path: Path) -> dict[str, Any]:
    """An evidence ``results.json`` ({"budget", "claims", ...}); anything else (a compare's results, a damaged file) is
    a one-line ConfigError naming it, before a claim runs or a report is written over it."""
    from polyrl.config import ConfigError

    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} cannot be read as JSON ({type(e).__name__}); allowed: an evidence results.json "
                          "(use another --out, or delete it to run the claims again)") from None
    if not (isinstance(results, dict) and isinstance(results.get("claims"), dict) and "budget" in results):
        raise ConfigError(f"{path} is not an evidence results.json (an object with 'budget' and 'claims'; it holds "
                          f"{sorted(results)[:6] if isinstance(results, dict) else type(results).__name__}); use "
                          "another --out")
    return results


def cli_main(args: Any, console: Any) -> int:
    """`polyrl evidence`: --list, run the chosen claims at a budget (rich progress), write the reports."""
    from rich.table import Table

    from polyrl.config import ConfigError
    from polyrl.lab.claims import CLAIMS

    check_args(args)
    budget = args.budget or DEFAULT_BUDGET
    workers = DEFAULT_WORKERS if args.workers is None else args.workers
    ids = [c.strip() for c in args.claims.split(",") if c.strip()] if args.claims else list(CLAIMS)
    bad = [c for c in ids if c not in CLAIMS]
    if bad:
        raise ConfigError(f"claims = {','.join(bad)}: unknown; choose from {', '.join(CLAIMS)}")
    if args.list:
        table = Table(title=f"evidence claims ({len(ids)})")
        for col in ("id", "title", "quick", "full", "stability"):
            table.add_column(col)
        for cid in ids:
            c = CLAIMS[cid]
            table.add_row(cid, c.title, f"{c.quick.seeds}x{c.quick.steps}", f"{c.full.seeds}x{c.full.steps}",
                          "yes" if c.stability else "")
        console.print(table)
        return 0
    out = Path(args.out or f"runs/evidence/{budget}")
    write_docs = args.write_docs if args.write_docs is not None else budget == "full"
    docs_results = Path("docs") / "evidence" / "results.json"
    if write_docs and not (out / "results.json").exists() and docs_results.exists() \
            and json.loads(docs_results.read_text()).get("budget") == budget:
        # A fresh OUT (e.g. a new checkout): start from the committed results, so that running some claims
        # updates theirs and keeps every other claim's in docs/evidence/results.json.
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(docs_results.read_text())
    if (out / "results.json").exists():  # before anything runs or is written: it must be this command's kind
        held = read_results(out / "results.json")
        if held["budget"] != budget and (args.budget is not None or not args.report_only):
            raise ConfigError(f"out = {out}: its results.json holds the {held['budget']!r} budget's evidence, and "
                              f"this command gives budget = {budget!r}; use another --out (the default is "
                              "runs/evidence/BUDGET)")
    if args.report_only:
        if not (out / "results.json").exists():
            raise ConfigError(f"out = {out}: no results.json to report from; run without --report-only first")
        results = redecide(read_results(out / "results.json"), CLAIMS)
    else:
        from rich.progress import Progress

        with Progress(console=console) as bar:
            task = bar.add_task(f"evidence ({budget})", total=len(ids))

            def progress(done, total, cid, verdict):
                bar.update(task, completed=done)
                console.print(f"{cid}: [bold]{verdict}[/bold]")

            results = run_evidence(ids, budget, workers=workers, out=out, registry=CLAIMS,
                                   progress=progress)
    write_reports(results, CLAIMS, out, docs=Path("docs") if write_docs else None)
    console.print(f"wrote {out / 'evidence.md'} and {out / 'evidence.html'}" + (" and docs/evidence.md" if write_docs
                                                                                  else ""))
    return 0
