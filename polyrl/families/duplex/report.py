"""`polyrl duplex report`: imitation baseline vs GRPO over seeds, per-axis metrics with bootstrap intervals.

Per seed k, two runs in ``OUT/<method>/seed<k>/`` (the layout of `polyrl compare`, so a rerun skips finished
runs -- only those whose saved settings equal the ones asked for now; one trained with other settings is refused in
one line naming the setting, as a `polyrl compare` rerun's resume is, or retrained with ``overwrite``):
``imitation`` (cloning continued for ``steps`` more steps) and ``grpo``. Both start from the same cloned policy (same
seed, deterministic cloning), whose metrics are the baseline ("before"). The page
(``polyrl.safety.report.write_report``) holds, per axis metric, the mean over seeds with a percentile-bootstrap
interval (``polyrl.lab.stats.bootstrap_ci``) for the baseline, imitation-continued, GRPO and the scripted natural
agent, the paired GRPO - baseline difference with its interval, and whether that interval lies entirely on the
better side of 0. A single-axis task (``--task pause``) has no values for the other axes' metrics: they are left
out of the page.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Collection
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from polyrl.families.duplex.sim import METRIC_SIGN
from polyrl.families.reuse import check_reuse, finished, stale_setting

CLAIM = ("Multi-faceted interactivity alignment (arXiv:2606.11167): GRPO with rule-based per-axis rewards (pause "
         "handling, turn-taking, backchanneling, user interruption) plus a quality reward improves every axis of a "
         "full-duplex model. Issue 20: on a scripted frame simulator, training for <= 10 minutes improves every axis "
         "metric over a supervised imitation baseline over >= 5 seeds.")


def run_seed(cfg, method_name: str, run_dir: Path) -> dict[str, Any]:
    """Train one run (or read its summary when it finished with these settings); return the summary."""
    from rich.console import Console

    from polyrl.families.duplex.methods import get_duplex_method
    from polyrl.families.duplex.train import train_duplex
    from polyrl.runs import start_run_dir

    s = finished(run_dir)
    if s is not None and not stale_setting(s, cfg):
        return s
    start_run_dir(run_dir, overwrite=True)
    s = train_duplex(cfg, get_duplex_method(method_name), run_dir=run_dir, console=Console(file=io.StringIO()),
                     table_every=10**9)
    return {k: v for k, v in s.items() if k not in ("history", "policy")}


def _ci(values: list[float], level: float) -> dict[str, float]:
    """Mean and bootstrap interval of the values that exist (NaN = the metric's event never occurred); all NaN
    when none does, so that one empty cell cannot stop the report."""
    from polyrl.lab.stats import bootstrap_ci

    v = [x for x in values if not math.isnan(x)]
    if not v:
        return {"mean": math.nan, "lo": math.nan, "hi": math.nan, "n": 0}
    lo, hi = bootstrap_ci(v, level=level)
    return {"mean": float(np.mean(v)), "lo": lo, "hi": hi, "n": len(v)}


def analyse(summaries: dict[str, list[dict[str, Any]]], level: float = 0.9) -> dict[str, Any]:
    """Per metric: baseline / per-method / natural intervals and the paired GRPO - baseline difference."""
    base = [s["metrics_before"] for s in summaries["grpo"]]
    out: dict[str, Any] = {}
    for m, sign in METRIC_SIGN.items():
        if all(math.isnan(b[m]) for b in base):  # an axis the task has no segments of (e.g. --task pause)
            continue
        row: dict[str, Any] = {"better": "higher" if sign > 0 else "lower",
                               "baseline": _ci([b[m] for b in base], level),
                               "natural": _ci([s["natural_agent"][m] for s in summaries["grpo"]], level)}
        for name, runs in summaries.items():
            row[name] = _ci([s["metrics_after"][m] for s in runs], level)
        diff = [s["metrics_after"][m] - b[m] for s, b in zip(summaries["grpo"], base)]
        row["grpo_minus_baseline"] = d = _ci(diff, level)
        # one paired difference has no interval over seeds (it is [d, d]): it cannot show an improvement
        row["improved"] = d["n"] >= 2 and (bool(d["lo"] > 0) if sign > 0 else bool(d["hi"] < 0))
        if "imitation" in summaries:
            diff2 = [a["metrics_after"][m] - b["metrics_after"][m]
                     for a, b in zip(summaries["grpo"], summaries["imitation"])]
            row["grpo_minus_imitation"] = d2 = _ci(diff2, level)
            row["improved_vs_imitation"] = d2["n"] >= 2 and (bool(d2["lo"] > 0) if sign > 0
                                                             else bool(d2["hi"] < 0))
        out[m] = row
    return out


def _no_nan(x: Any) -> Any:
    """``x`` with every NaN float as None: results.json is strict JSON, and a metric whose event never occurred (an
    axis outside the task, a policy that never backchannels) is NaN."""
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_no_nan(v) for v in x]
    return None if isinstance(x, float) and math.isnan(x) else x


def _fmt(c: dict[str, float]) -> str:
    return "n/a" if c["n"] == 0 else f"{c['mean']:.3f} [{c['lo']:.3f}, {c['hi']:.3f}]"


def plot(rows: dict[str, Any], path: Path, level: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [("natural", "scripted natural agent", "#bbbbbb"), ("baseline", "imitation baseline", "#8c8cd9"),
             ("imitation", "imitation, continued", "#5a5ab0"), ("grpo", "GRPO", "#d9534f")]
    fig, axes = plt.subplots(1, len(rows), figsize=(max(3.1 * len(rows), 7.0), 3.5), squeeze=False)
    axes = axes[0]  # one metric (a single-axis task) still gives a row of axes
    for ax, (metric, row) in zip(axes, rows.items()):
        shown = [(k, lab, c) for k, lab, c in names if k in row]
        for i, (k, lab, c) in enumerate(shown):
            ci = row[k]
            ax.bar(i, ci["mean"], color=c, label=lab, yerr=[[ci["mean"] - ci["lo"]], [ci["hi"] - ci["mean"]]],
                   capsize=3)
        ax.set_xticks([])
        ax.set_title(f"{metric}\n({row['better']} is better)", fontsize=9)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle(f"per-axis metrics, mean over seeds with {int(level * 100)}% bootstrap intervals", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_duplex_report(cfg, *, seeds: int, out: str | Path, level: float = 0.9, methods=("imitation", "grpo"),
                        progress=None, overwrite: bool = False, given: Collection[str] = ()) -> dict[str, Any]:
    """Train every (method, seed), analyse, write ``report.html``, ``results.json`` and ``metrics.png`` in ``out``.

    A finished run in ``out`` is reused when its saved settings equal ``cfg`` (seed aside); one with other settings
    raises ConfigError before anything trains, or is retrained when ``overwrite``."""
    from polyrl.safety.report import table_html, write_report

    out = Path(out)
    check_reuse(cfg, seeds=seeds, out=out, methods=methods, overwrite=overwrite, given=given)
    t0 = time.perf_counter()
    summaries: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    for seed in range(seeds):
        for m in methods:
            s = run_seed(replace(cfg, seed=seed), m, out / m / f"seed{seed}")
            summaries[m].append(s)
            if progress:
                progress(f"{m}/seed{seed}: reward {s['reward_before']:.3f} -> {s['reward_after']:.3f} "
                         f"({s['wall_seconds']:.0f} s)")
    rows = analyse(summaries, level)
    elapsed = time.perf_counter() - t0  # this call (0 when every run was already finished)
    wall = sum(s["wall_seconds"] for runs in summaries.values() for s in runs)  # training time of all runs
    headers = ["metric", "better", "natural agent", "imitation baseline", *(["imitation, continued"]
               if "imitation" in methods else []), "GRPO", "GRPO - baseline (paired)", "improved"]
    table = [[m, r["better"], _fmt(r["natural"]), _fmt(r["baseline"]),
              *([_fmt(r["imitation"])] if "imitation" in methods else []), _fmt(r["grpo"]),
              _fmt(r["grpo_minus_baseline"]), "yes" if r["improved"] else "no"] for m, r in rows.items()]
    n_imp = sum(r["improved"] for r in rows.values())
    one = "With one seed there is no interval over seeds, so no metric counts as improved (run --seeds 2 or more). "
    verdict = (one if seeds == 1 else "") + (
               f"Over {seeds} seed{'s' * (seeds > 1)}, GRPO improved {n_imp} of {len(rows)} axis metrics over the "
               "imitation baseline "
               f"with the {int(level * 100)}% bootstrap interval of the paired difference on the better side of 0"
               + (f"; against imitation continued for the same {cfg.steps} steps: "
                  f"{sum(r.get('improved_vs_imitation', False) for r in rows.values())} of {len(rows)}"
                  if "imitation" in methods else "")
               + f". Summed wall time of the runs: {wall:.0f} s (GRPO runs "
               f"{np.mean([s['wall_seconds'] for s in summaries['grpo']]):.0f} s each on average).")
    fig = plot(rows, out / "metrics.png", level)
    rewards_tbl = [[name, _fmt(_ci([s["reward_before"] for s in runs], level)),
                    _fmt(_ci([s["reward_after"] for s in runs], level))] for name, runs in summaries.items()]
    results = {"seeds": seeds, "level": level, "config": {k: v for k, v in cfg.__dict__.items() if k != "seed"},
               "metrics": rows, "wall_seconds": wall, "elapsed_seconds": elapsed,
               "per_seed": {m: [{"before": s["metrics_before"], "after": s["metrics_after"],
                                 "wall_seconds": s["wall_seconds"]} for s in runs] for m, runs in summaries.items()}}
    notes = ["Simulator, rewards, quality term and the natural agent are our operationalisation (spec section 6 "
             "(d) is '[ours; operational]'; the paper's reward formulas were not retrieved).",
             "Metrics are measured on a fixed evaluation set of segments per seed with sampled (not greedy) actions.",
             "Baseline = the policy cloned from the noisy scripted natural agent; both methods start from it."]
    left_out = [m for m in METRIC_SIGN if m not in rows]
    if left_out:
        notes.append(f"Left out, no values on task {cfg.task!r} (no segments of their axis): {', '.join(left_out)}.")
    paths = write_report(out, title="polyrl duplex: full-duplex interactivity alignment", claim=CLAIM,
                         verdict=verdict, results=_no_nan(results),
                         tables={"Per-axis metrics (mean [interval] over seeds)": table_html(headers, table),
                                 "Mean combined reward, before -> after": table_html(
                                     ["method", "before", "after"], rewards_tbl)},
                         figures={"Per-axis metrics": fig}, notes=notes)
    return {"rows": rows, "verdict": verdict, "paths": paths, "wall_seconds": wall, "improved": n_imp}
