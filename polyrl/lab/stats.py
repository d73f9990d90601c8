"""Statistics over seeds (percentile bootstrap, curve aggregation, area under a curve) and the ScaleRL
sigmoid compute-performance law with its least-squares fit (arXiv:2510.13786).

R(C) = R0 + (A - R0) / (1 + (Cmid / C)^B): A = asymptotic performance, B > 0 = scaling exponent
(efficiency), Cmid = compute at half of the total gain. R0 (performance at the first point) is fixed,
not fitted. Evaluated as R0 + (A - R0) * expit(B * (ln C - ln Cmid)), which is the same function,
finite for C -> 0 (gives R0) and C -> infinity (gives A) without overflow.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np


def sigmoid_law(c, a: float, b: float, cmid: float, r0: float) -> np.ndarray:
    """R(C) = R0 + (A - R0) / (1 + (Cmid / C)^B), elementwise over compute ``c`` (C = 0 gives R0)."""
    from scipy.special import expit

    c = np.asarray(c, dtype=float)
    with np.errstate(divide="ignore"):
        z = b * (np.log(c) - math.log(cmid))
    return r0 + (a - r0) * expit(z)


AT_BOUND = 1e-6  # A within this of the bound 1 counts as "at the bound"


def fit_bounds(fit: dict, compute: np.ndarray) -> tuple[bool, bool]:
    """(A at the bound 1, half-gain compute Cmid beyond the last point) of a ``fit_sigmoid`` fit of accuracy; both
    at once: the data bound neither the ceiling nor the midpoint, so the fit found no asymptote (unidentified)."""
    return fit["A"] >= 1.0 - AT_BOUND, fit["Cmid"] > float(np.max(compute))


def fit_sigmoid(
    compute, perf, *, r0: float, a_max: float | None = 1.0, min_points: int = 4
) -> tuple[dict | None, str | None]:
    """Fit A, B, Cmid of the sigmoid law to points (C, R) with C > 0; return (fit, None) or (None, reason).

    Bounds: A in [r0, a_max] (``a_max`` None: unbounded above), B > 0, Cmid > 0. Compute is divided by
    its median before fitting (Cmid is reported back in the original unit, its standard error scaled by
    the same factor). Standard errors are sqrt(diag(pcov)) of ``scipy.optimize.curve_fit``; they are None
    when the covariance cannot be estimated (``se_note`` says so). Never raises on bad data.
    """
    from scipy.optimize import OptimizeWarning, curve_fit

    c = np.asarray(compute, dtype=float)
    r = np.asarray(perf, dtype=float)
    if c.shape != r.shape:
        return None, f"compute and performance have different shapes {c.shape} and {r.shape}"
    keep = np.isfinite(c) & np.isfinite(r) & (c > 0)
    c, r = c[keep], r[keep]
    if not math.isfinite(r0):
        return None, "R0 is not finite"
    if c.size < min_points:
        return None, f"only {c.size} points with compute > 0 (need {min_points})"
    if np.unique(c).size < 4:
        return None, f"only {np.unique(c).size} distinct compute values (need 4 for 3 parameters)"
    hi = np.inf if a_max is None else float(a_max)
    if r0 >= hi:
        return None, f"R0 = {r0:.4g} is already at the upper bound {hi:g} for A"
    scale = float(np.median(c))
    x = c / scale
    eps = 1e-9 * max(1.0, abs(r0))
    a0 = max(r0 + eps, min(float(r.max()), hi - eps))  # a start inside the bounds, even for a curve far below R0
    p0 = [a0, 1.0, 1.0]
    lower = [r0, 1e-6, 1e-9]
    upper = [hi, np.inf, np.inf]

    def model(x, a, b, cmid):
        return sigmoid_law(x, a, b, cmid, r0)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OptimizeWarning)
            warnings.simplefilter("ignore", RuntimeWarning)
            popt, pcov = curve_fit(model, x, r, p0=p0, bounds=(lower, upper), maxfev=20000)
    except (RuntimeError, ValueError, FloatingPointError) as e:
        return None, f"curve_fit failed: {e}"
    a, b, cmid = (float(v) for v in popt)
    if not all(math.isfinite(v) for v in (a, b, cmid)):
        return None, "fit produced non-finite parameters"
    if a - r0 <= 1e-6 * max(1.0, abs(r0)):
        return None, "no gain over R0 (fitted A = R0), so B and Cmid are not identifiable"
    se = np.sqrt(np.diag(pcov)) if np.all(np.isfinite(pcov)) else None
    note = None
    if se is None or not np.all(np.isfinite(se)):
        se, note = None, "covariance could not be estimated (parameters not identifiable from these points)"
    resid = r - model(x, a, b, cmid)
    return {
        "A": a,
        "B": b,
        "Cmid": cmid * scale,
        "A_se": None if se is None else float(se[0]),
        "B_se": None if se is None else float(se[1]),
        "Cmid_se": None if se is None else float(se[2]) * scale,
        "R0": float(r0),
        "rmse": float(np.sqrt(np.mean(resid**2))),
        "n_points": int(c.size),
        "se_note": note,
    }, None


def bootstrap_ci(values, *, level: float = 0.9, n_boot: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (resampling with replacement, seeded)."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"ci level must be in (0, 1), got {level}")
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        raise ValueError("bootstrap_ci needs at least one value")
    if v.size == 1 or np.all(v == v[0]):
        return float(v[0]), float(v[0])
    idx = np.random.default_rng(seed).integers(0, v.size, size=(n_boot, v.size))
    means = v[idx].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(lo), float(hi)


def summarize(values: list[float], ci: dict[str, Any]) -> dict[str, Any]:
    if not values:
        return {"mean": None, "lo": None, "hi": None, "n": 0}
    lo, hi = bootstrap_ci(values, **ci)
    return {"mean": float(np.mean(values)), "lo": lo, "hi": hi, "n": len(values)}


def curve(per_seed: list[tuple[np.ndarray, np.ndarray]], interpolate: bool, ci: dict, grid_max: int = 200):
    """Mean and bootstrap band over seeds of curves given as (x, y) per seed; None if no seed has points."""
    per_seed = [(x, y) for x, y in per_seed if x.size]
    if not per_seed:
        return None
    if interpolate:
        lo_x, hi_x = min(float(x[0]) for x, _ in per_seed), max(float(x[-1]) for x, _ in per_seed)
        size = min(grid_max, max(x.size for x, _ in per_seed))
        grid = np.linspace(lo_x, hi_x, max(size, 2)) if hi_x > lo_x else np.array([lo_x])
        grid = np.unique(np.concatenate([grid, [float(x[-1]) for x, _ in per_seed]]))  # every seed's own end
        cols = [np.where((grid >= x[0]) & (grid <= x[-1]), np.interp(grid, x, y), np.nan) for x, y in per_seed]
    else:
        grid = np.unique(np.concatenate([x for x, _ in per_seed]))
        cols = []
        for x, y in per_seed:
            col = np.full(grid.size, np.nan)
            col[np.searchsorted(grid, x)] = y
            cols.append(col)
    table = np.stack(cols, axis=1)
    out: dict[str, list] = {"x": [], "mean": [], "lo": [], "hi": [], "n": []}
    for gx, row in zip(grid, table):
        vals = row[~np.isnan(row)]
        if vals.size:
            s = summarize(vals.tolist(), ci)
            out["x"].append(float(gx))
            for k in ("mean", "lo", "hi", "n"):
                out[k].append(s[k])
    return out


def auc(steps: np.ndarray, vals: np.ndarray) -> float | None:
    if steps.size == 0:
        return None
    if steps.size == 1 or steps[-1] == steps[0]:
        return float(vals[-1])
    return float(np.trapezoid(vals, steps) / (steps[-1] - steps[0]))
