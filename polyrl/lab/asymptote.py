"""Per-seed ScaleRL asymptotes for the evidence report (issue 22): one sigmoid fit per run, paired by seed.

The lab's compare analysis (polyrl/lab/analysis.py:_sigmoid) pools the seeds of a method into one fit; a claim
decided by seed pairs needs one asymptote A per run instead. Each run is fitted with the same law and the same
fitter (polyrl/lab/stats.py: sigmoid_law, fit_sigmoid): held-out accuracy against cumulative GENERATED rollouts
(``rollout/generated``, which counts DAPO's dynamic-sampling regenerations, as ``rollout/generated_tokens``
does; ``rollout/gen_tokens`` counts only the kept batch), R0 fixed at the run's first evaluation (step 0, compute
0), A bounded to [R0, 1].

A failed fit (fit_sigmoid returns a reason, e.g. "no gain over R0"; or an unidentified one: A at the bound 1 with the
half-gain compute Cmid beyond the data, where the data bound neither) gives A = None for that seed and is never
dropped silently: ``paired_asymptote`` leaves out every seed pair in which either fit failed, and names the count
in the effect; ``fit_curves`` records every seed's outcome and reason in ``samples["sigmoid_fits"]``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from polyrl.lab import verdicts
from polyrl.lab.claim_types import Samples

COMPUTE = "rollouts"


def seed_asymptote(run: Any, *, compute: str = COMPUTE) -> dict[str, Any]:
    """Fit R(C) = R0 + (A - R0) / (1 + (Cmid / C)^B) to one run's held-out accuracy against ``compute``.

    Returns the per-seed numbers the arms table shows: sigmoid_A (None when the fit failed), sigmoid_fit_failed
    (0.0 or 1.0), sigmoid_A_at_bound (1.0 when A sits at the upper bound 1, i.e. the data do not bound it) and
    sigmoid_Cmid_beyond_data (1.0 when the half-gain compute lies beyond the last evaluation: A is then a pure
    extrapolation); both None on failure. And, for ``fit_curves``, ``_fit`` (R0, B, Cmid, rmse and fit_sigmoid's
    reason, None when it succeeded) and ``_fit_y`` ([step, fitted accuracy] at each evaluation step, None on
    failure).
    """
    from polyrl.lab.analysis import ACC, _on_axis
    from polyrl.lab.stats import fit_bounds, fit_sigmoid, sigmoid_law

    x, y = _on_axis(run, ACC, compute)
    r0 = float(y[0]) if y.size else math.nan
    fit, reason = fit_sigmoid(x, y, r0=r0, a_max=1.0) if y.size else (None, f"no {ACC} points with {compute}")
    out: dict[str, Any] = {"sigmoid_A": None, "sigmoid_fit_failed": 1.0, "sigmoid_A_at_bound": None,
                           "sigmoid_Cmid_beyond_data": None, "_fit_y": None,
                           "_fit": {"R0": r0, "B": None, "Cmid": None, "rmse": None, "reason": reason}}
    if fit is None:
        return out
    steps = run.series(ACC)[0]
    comp = run.compute()
    c_at = np.interp(steps, comp["steps"], comp[compute]) if comp[compute] is not None else steps
    y_fit = sigmoid_law(c_at, fit["A"], fit["B"], fit["Cmid"], r0)
    at_bound, beyond = fit_bounds(fit, x)
    unidentified = at_bound and beyond  # the data bound neither the ceiling nor the midpoint: no asymptote found
    out.update(sigmoid_A=None if unidentified else fit["A"], sigmoid_fit_failed=float(unidentified),
               sigmoid_A_at_bound=float(at_bound), sigmoid_Cmid_beyond_data=float(beyond),
               _fit={"R0": r0, "B": fit["B"], "Cmid": fit["Cmid"], "rmse": fit["rmse"],
                     "reason": "unidentified: A at the bound 1 and Cmid beyond the data" if unidentified else None},
               _fit_y=[[float(s), float(v)] for s, v in zip(steps, y_fit, strict=True)])
    return out


def fit_curves(samples: Samples) -> Samples:
    """Move the per-seed fit extras out of the arms: add each arm's mean fitted curve ("<arm> fit", dashed, on
    the step axis) to ``curves`` and every seed's fit outcome to ``samples["sigmoid_fits"]``."""
    samples["sigmoid_fits"] = {}
    for i, (arm, a) in enumerate(list(samples["arms"].items())):
        ys, fits = a.pop("_fit_y", []), a.pop("_fit", [])
        samples["sigmoid_fits"][arm] = [{"seed": s, "A": A, **f}
                                        for s, A, f in zip(a.get("seeds", []), a.get("sigmoid_A", []), fits,
                                                           strict=True)]
        ok = [dict(map(tuple, y)) for y in ys if y is not None]
        xs = sorted({x for y in ok for x in y})
        if xs and arm in samples.get("curves", {}):
            samples["curves"][arm].setdefault("color", f"C{i}")
            samples["curves"][f"{arm} fit ({len(ok)} of {len(ys)} seeds)"] = {
                "x": xs, "y": [float(np.mean([y[x] for y in ok if x in y])) for x in xs],
                "label": "held-out accuracy", "linestyle": "--", "color": f"C{i}"}
    return samples


def paired_asymptote(samples: Samples, base: str, new: str, *, name: str) -> verdicts.Effect:
    """Mean per-seed A(new) - A(base) over the seeds where both fits succeeded (``verdicts.paired_difference``).

    The number of seeds left out because a fit failed is appended to ``name``; with no seed left the effect has
    no estimate and no interval (``decide`` then says "inconclusive").
    """
    a, b = samples["arms"][base], samples["arms"][new]
    pairs = [(x, y) for x, y in zip(a["sigmoid_A"], b["sigmoid_A"], strict=True)
             if x is not None and y is not None and math.isfinite(x) and math.isfinite(y)]
    left_out = len(a["sigmoid_A"]) - len(pairs)
    label = f"{name} ({left_out} of {len(a['sigmoid_A'])} seeds left out: a fit failed)"
    if not pairs:
        return verdicts.Effect(label, math.nan, math.nan, math.nan, 0.9, 0, None)
    return verdicts.paired_difference([p[0] for p in pairs], [p[1] for p in pairs], name=label)


def failed_fits(samples: Samples) -> dict[str, int]:
    """Failed sigmoid fits per arm (for ``decide``'s numbers)."""
    return {arm: int(sum(a.get("sigmoid_fit_failed", []))) for arm, a in samples["arms"].items()}
