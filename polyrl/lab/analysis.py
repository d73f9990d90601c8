"""Analyse a compare directory ``OUT/<method>/seed<k>/`` into plain JSON-serialisable results.

Conventions (each stated once here, used everywhere):

- Rows of ``metrics.jsonl`` are merged by step (a later row overrides an earlier one for the same key). A
  step number that goes backwards marks a resumed run: the earlier rows from that step on are dropped.
- Cumulative rollouts at step s = sum of ``rollout/generated`` over steps <= s; cumulative tokens likewise
  from ``rollout/generated_tokens`` (every token sampled, in groups a filter dropped too: DAPO's regenerations),
  else ``rollout/gen_tokens`` (the trained batch's; a sampler that logs no generated tokens), and a row with
  neither but with ``rollout/generated`` and ``rollout/mean_len`` counts their product and the run is marked
  ``tokens_estimated``. An evaluation at step s is taken
  after the update of step s, so it sees the compute of steps <= s; step 0 has compute 0.
- Performance metric: ``eval/accuracy`` when any run logs it, else ``reward/mean`` (``perf_metric``).
- Curves over seeds: against steps, seeds are aligned on the union of their logged steps and each point
  averages the seeds that logged it (``n``); against rollouts/tokens, each seed is linearly interpolated
  onto a common grid spanning all seeds and contributes only inside its own range.
- Intervals: percentile bootstrap over seeds of the mean (seeded, ``ci`` level); one seed gives [v, v].
- Final performance, area under the curve, threshold and collapse statistics use finished seeds when at
  least one seed finished, else all seeds (``final.finished_only`` says which).
- Threshold: first logged step whose performance is >= the threshold (no interpolation), per seed.
- Area under the curve: trapezoid of performance against steps divided by the step span (the average
  performance over training), per seed, then averaged.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from polyrl.collapse import CollapseRule, first_collapse
from polyrl.lab.stats import auc, bootstrap_ci, curve, fit_bounds, fit_sigmoid, summarize

ACC = "eval/accuracy"
REWARD = "reward/mean"
ENTROPY = "objective/entropy"
LENGTH = "rollout/mean_len"
ZERO_GRAD = tuple(f"position/zero_grad_frac_q{i}" for i in range(1, 5))
AXES = ("steps", "rollouts", "tokens")
_SEED_DIR = re.compile(r"^seed(\d+)$")


@dataclass
class Run:
    """One training run: its logged rows (in logging order), summary (None if unfinished) and config."""

    method: str
    seed: int
    rows: list[dict[str, Any]]
    summary: dict[str, Any] | None = None
    finished: bool | None = None
    config: dict[str, Any] | None = None
    path: str | None = None
    _merged: dict[int, dict[str, Any]] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.finished is None:
            self.finished = self.summary is not None

    def by_step(self) -> dict[int, dict[str, Any]]:
        """Rows merged by step, steps ascending."""
        if self._merged is None:
            merged: dict[int, dict[str, Any]] = {}
            for row in self.rows:
                merged.setdefault(int(row["step"]), {}).update(row)
            self._merged = dict(sorted(merged.items()))
        return self._merged

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of every step that logged ``key`` with a finite value."""
        pts = [(s, _num(r.get(key))) for s, r in self.by_step().items()]
        pts = [(s, v) for s, v in pts if v is not None]
        return np.array([p[0] for p in pts], dtype=float), np.array([p[1] for p in pts], dtype=float)

    def compute(self) -> dict[str, Any]:
        """Cumulative rollouts and tokens at each logged step: {"steps", "rollouts", "tokens", ...}."""
        steps, rollouts, tokens = [], [], []
        has_rollouts = has_tokens = estimated = False
        n_roll = n_tok = 0.0
        for s, r in self.by_step().items():
            gen, tok = _num(r.get("rollout/generated")), _num(r.get("rollout/generated_tokens"))
            tok = _num(r.get("rollout/gen_tokens")) if tok is None else tok
            if tok is None and gen is not None and _num(r.get(LENGTH)) is not None:
                tok, estimated = gen * _num(r.get(LENGTH)), True
            has_rollouts |= gen is not None
            has_tokens |= tok is not None
            n_roll += gen or 0.0
            n_tok += tok or 0.0
            steps.append(s)
            rollouts.append(n_roll)
            tokens.append(n_tok)
        return {
            "steps": np.array(steps, dtype=float),
            "rollouts": np.array(rollouts) if has_rollouts else None,
            "tokens": np.array(tokens) if has_tokens else None,
            "tokens_estimated": estimated,
        }


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl: malformed lines and rows without an integer step are skipped; rows a resumed
    run logged again replace the earlier ones (see the module docstring). A collapse guard's rollback to step s logs
    a row of guard/* alone at s: the steps after s are redone, and the row of step s itself (logged before its
    checkpoint) stays."""
    rows: list[dict[str, Any]] = []
    for line in Path(path).read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not isinstance(row, dict) or isinstance(row.get("step"), bool) or not isinstance(row.get("step"), int):
            continue
        if rows and row["step"] < rows[-1]["step"]:
            rollback = all(k == "step" or k.startswith("guard/") for k in row)
            rows = [r for r in rows if r["step"] < row["step"] or (rollback and r["step"] == row["step"])]
        rows.append(row)
    return rows


def load_runs(out_dir: str | Path) -> dict[str, list[Run]]:
    """Every ``<method>/seed<k>/metrics.jsonl`` under ``out_dir``: {method: [Run, ...]} sorted by name and seed."""
    out = Path(out_dir)
    runs: dict[str, list[Run]] = {}
    for mdir in sorted(p for p in out.iterdir() if p.is_dir()) if out.is_dir() else []:
        for sdir in sorted(p for p in mdir.iterdir() if p.is_dir()):
            m = _SEED_DIR.match(sdir.name)
            if not m or not (sdir / "metrics.jsonl").is_file():
                continue
            summary = _read_json(sdir / "summary.json")
            runs.setdefault(mdir.name, []).append(
                Run(
                    method=mdir.name,
                    seed=int(m.group(1)),
                    rows=read_rows(sdir / "metrics.jsonl"),
                    summary=summary,
                    finished=summary is not None,
                    config=_read_json(sdir / "config.json"),
                    path=str(sdir),
                )
            )
    for lst in runs.values():
        lst.sort(key=lambda r: r.seed)
    return runs


def _on_axis(run: Run, key: str, axis: str) -> tuple[np.ndarray, np.ndarray]:
    steps, vals = run.series(key)
    if axis == "steps":
        return steps, vals
    comp = run.compute()
    cum = comp[axis]
    if cum is None:
        return np.array([]), np.array([])
    x = np.interp(steps, comp["steps"], cum)
    keep = np.concatenate([[True], np.diff(x) > 0]) if x.size else np.array([], dtype=bool)
    return x[keep], vals[keep]  # equal compute (e.g. a train and an eval point) keeps the first


def _threshold(runs: list[Run], metric: str, threshold: float) -> dict[str, Any]:
    per_seed = []
    for run in runs:
        steps, vals = run.series(metric)
        hit = np.flatnonzero(vals >= threshold)
        entry: dict[str, Any] = {"seed": run.seed, "step": None, "rollouts": None, "tokens": None}
        if hit.size:
            s = float(steps[hit[0]])
            comp = run.compute()
            entry["step"] = int(s)
            for axis in ("rollouts", "tokens"):
                if comp[axis] is not None:
                    entry[axis] = float(np.interp(s, comp["steps"], comp[axis]))
        per_seed.append(entry)
    out: dict[str, Any] = {"metric": metric, "value": threshold}
    for axis, key in (("steps_mean", "step"), ("rollouts_mean", "rollouts"), ("tokens_mean", "tokens")):
        vals = [e[key] for e in per_seed if e[key] is not None]
        out[axis] = float(np.mean(vals)) if vals else None
    out["seeds_reached"] = sum(e["step"] is not None for e in per_seed)
    out["n_seeds"] = len(per_seed)
    out["per_seed"] = per_seed
    return out


def _sigmoid(runs: list[Run], metric: str, compute: str) -> dict[str, Any]:
    cs, rs, firsts = [], [], []
    for run in runs:
        x, y = _on_axis(run, metric, compute)
        if x.size:
            cs.append(x)
            rs.append(y)
            firsts.append(float(y[0]))
    base = {"metric": metric, "compute": compute}
    if not cs:
        return {**base, "ok": False, "reason": f"no {metric} points with {compute} logged"}
    r0 = float(np.mean(firsts))
    c, r = np.concatenate(cs), np.concatenate(rs)
    fit, reason = fit_sigmoid(c, r, r0=r0, a_max=1.0 if metric == ACC else None)
    points = {"C": c.tolist(), "R": r.tolist()}
    if fit is None:
        return {**base, "ok": False, "reason": reason, "R0": r0, "points": points}
    if metric == ACC and all(fit_bounds(fit, c)):  # as the evidence report's per-seed fits (lab/asymptote.py)
        return {**base, "ok": False, "reason": "unidentified: A at the bound 1 and Cmid beyond the data", "R0": r0,
                "points": points}
    return {**base, "ok": True, **fit, "points": points}


def _method(runs: list[Run], *, perf: str, threshold: float, rule: CollapseRule, ci: dict, compute: str):
    finished = [r for r in runs if r.finished]
    core = finished or runs
    curves: dict[str, Any] = {}
    for key in (REWARD, ACC):
        curves[key] = {axis: curve([_on_axis(r, key, axis) for r in runs], axis != "steps", ci) for axis in AXES}
    for key in (ENTROPY, LENGTH, "objective/approx_kl"):
        curves[key] = {"steps": curve([r.series(key) for r in runs], False, ci)}

    final_perf = [float(v[-1]) for r in core if (v := r.series(perf)[1]).size]
    final_reward = [float(np.mean(v[-10:])) for r in core if (v := r.series(REWARD)[1]).size]
    aucs = [x for r in core if (x := auc(*r.series(perf))) is not None]

    collapses = []
    for r in core:
        hit = first_collapse(r.rows, rule)
        collapses.append({"seed": r.seed, "step": hit[0] if hit else None, "reason": hit[1] if hit else None})
    n_collapsed = sum(c["step"] is not None for c in collapses)

    zero_grad = None
    per_q = {
        f"q{i + 1}": [float(np.mean(v)) for r in core if (v := r.series(k)[1]).size] for i, k in enumerate(ZERO_GRAD)
    }
    if any(per_q.values()):
        zero_grad = {q: summarize(v, ci) for q, v in per_q.items()}

    return {
        "seeds": [r.seed for r in runs],
        "n_seeds": len(runs),
        "unfinished_seeds": [r.seed for r in runs if not r.finished],
        "tokens_estimated": any(r.compute()["tokens_estimated"] for r in runs),
        "curves": curves,
        "final": {
            "metric": perf,
            "finished_only": bool(finished),
            **summarize(final_perf, ci),
            "per_seed": final_perf,
            "reward_last10": summarize(final_reward, ci),
        },
        "auc": {"metric": perf, "mean": float(np.mean(aucs)) if aucs else None, "per_seed": aucs},
        "threshold": _threshold(core, perf, threshold),
        "collapse": {
            "count": n_collapsed,
            "n_seeds": len(core),
            "rate": n_collapsed / len(core),
            "per_seed": collapses,
        },
        "zero_grad": zero_grad,
        "sigmoid": _sigmoid(core, perf, compute),
    }


def rank(methods: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Methods ordered by final performance mean, then area under the curve (higher first; missing last)."""

    def key(name):
        m = methods[name]
        f, a = m["final"]["mean"], m["auc"]["mean"]
        return (f is None, -(f or 0.0), a is None, -(a or 0.0), name)

    return [
        {
            "rank": i + 1,
            "method": name,
            "final_mean": methods[name]["final"]["mean"],
            "final_lo": methods[name]["final"]["lo"],
            "final_hi": methods[name]["final"]["hi"],
            "auc": methods[name]["auc"]["mean"],
            "n_seeds": methods[name]["n_seeds"],
        }
        for i, name in enumerate(sorted(methods, key=key))
    ]


def analyse_runs(
    runs: dict[str, list[Run]],
    *,
    threshold: float = 0.5,
    collapse_rule: CollapseRule | None = None,
    ci: float = 0.9,
    n_boot: int = 2000,
    seed: int = 0,
    compute: str | None = None,
) -> dict[str, Any]:
    """Results for already loaded runs (see ``analyse``)."""
    if compute is not None and compute not in AXES:
        raise ValueError(f"compute must be one of {AXES}, got {compute!r}")
    runs = {m: lst for m, lst in runs.items() if lst}
    if not runs:
        raise ValueError("no runs to analyse")
    if compute is None:  # tokens where the runs log them; a family's runs log rollouts (q) or neither (flow)
        every = [r for lst in runs.values() for r in lst]
        trained = [r for r in every if r.series(REWARD)[0].size] or every  # a run that failed before step 1 logs none
        logged = [axis for axis in ("tokens", "rollouts") if all(r.compute()[axis] is not None for r in trained)]
        compute = logged[0] if logged else "steps"
    rule = collapse_rule or CollapseRule()
    boot = {"level": ci, "n_boot": n_boot, "seed": seed}
    bootstrap_ci([0.0, 1.0], **boot)  # validates the settings once
    perf = ACC if any(r.series(ACC)[0].size for lst in runs.values() for r in lst) else REWARD
    methods = {
        m: _method(lst, perf=perf, threshold=threshold, rule=rule, ci=boot, compute=compute) for m, lst in runs.items()
    }
    return _jsonable(
        {
            "settings": {
                "perf_metric": perf,
                "threshold": threshold,
                "ci": ci,
                "n_boot": n_boot,
                "bootstrap_seed": seed,
                "compute": compute,
                "collapse_rule": asdict(rule),
                "collapse_definition": rule.describe(),
            },
            "methods": methods,
            "ranking": rank(methods),
        }
    )


def analyse(
    out_dir: str | Path,
    *,
    threshold: float = 0.5,
    collapse_rule: CollapseRule | None = None,
    ci: float = 0.9,
    n_boot: int = 2000,
    seed: int = 0,
    compute: str | None = None,
) -> dict[str, Any]:
    """Load every run under ``out_dir`` and return the per-method analysis as a plain JSON-serialisable dict.

    ``threshold``: performance level for the steps/rollouts/tokens-to-threshold table; ``ci``: bootstrap
    interval level; ``compute``: x axis of the sigmoid fit ("tokens", "rollouts" or "steps"; None: the first of
    them, in that order, that every run logs).
    """
    runs = load_runs(out_dir)
    if not runs:
        raise ValueError(f"no runs (<method>/seed<k>/metrics.jsonl) found under {out_dir}")
    results = analyse_runs(
        runs, threshold=threshold, collapse_rule=collapse_rule, ci=ci, n_boot=n_boot, seed=seed, compute=compute
    )
    results["out_dir"] = str(out_dir)
    return results


def _jsonable(obj: Any) -> Any:
    """Plain Python containers and numbers (numpy arrays as lists); non-finite floats become None."""
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, bool | str) or obj is None:
        return obj
    if isinstance(obj, int | np.integer):
        return int(obj)
    if isinstance(obj, float | np.floating):
        return float(obj) if math.isfinite(obj) else None
    raise TypeError(f"not JSON-serialisable: {type(obj).__name__}")
