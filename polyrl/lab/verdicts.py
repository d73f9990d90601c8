"""Effects with intervals and THE verdict rule of the evidence report (issue 22); numpy/scipy only.

An Effect is signed so that positive = the claimed direction. Intervals are two-sided at ``level``
(default 0.9). Differences and ratios of per-seed means get Student-t intervals (Welch's for two independent arms,
the delta method's standard error for a ratio): with the 2-5 seeds a claim's budget runs, a percentile bootstrap of
the seeds covers far less than ``level`` (simulated with no effect and normal noise, a 90 % bootstrap interval
excluded 0 in 49 % of 2-seed and 24 % of 5-seed cases; the t interval in 10 %). An interval needs two seeds per arm:
with fewer, lo and hi are NaN and ``decide`` says "inconclusive". Seeds that agree exactly (a deterministic quantity,
such as a compute ratio) give the point interval [estimate, estimate].

``sd`` is per-arm: ``seeds_needed``'s formula n = ((z_a + z_b) * sd / delta)^2 then gives seeds per arm
(paired: sd of the per-seed difference; unpaired: sqrt(sd_a^2 + sd_b^2); rates: sqrt(2 p(1 - p)) at the
pooled rate; ratios: delta method).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

Verdict = Literal["holds", "holds partly", "does not hold at this scale", "inconclusive"]

_TINY = 1e-12


@dataclass(frozen=True)
class Effect:
    """An effect in the CLAIMED direction (positive = as claimed) with its interval at ``level``."""

    name: str
    estimate: float
    lo: float
    hi: float
    level: float
    n: int
    sd: float | None


@dataclass(frozen=True)
class Decision:
    """A verdict, the sentence the rule built from the numbers, and every number behind it."""

    verdict: Verdict
    reason: str
    effects: tuple[Effect, ...]
    numbers: dict[str, Any]
    seeds_needed: int | None


def _check_level(level: float) -> None:
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")


def _check_direction(direction: int) -> None:
    if direction not in (1, -1):
        raise ValueError(f"direction must be +1 or -1, got {direction}")


def _z(level: float) -> float:
    from scipy.stats import norm

    return float(norm.ppf((1.0 + level) / 2.0))


def _t_interval(estimate: float, se: float, df: float, level: float) -> tuple[float, float]:
    """estimate -+ t_{(1+level)/2, df} se; NaN for a non-finite standard error, the point for se = 0."""
    from scipy.stats import t

    if not (math.isfinite(se) and math.isfinite(estimate) and df > 0):
        return math.nan, math.nan
    if se == 0:
        return estimate, estimate
    half = float(t.ppf((1.0 + level) / 2.0, df)) * se
    return estimate - half, estimate + half


def paired_difference(a, b, *, name: str, direction: int = +1, level: float = 0.9, seed: int = 0) -> Effect:
    """Mean per-seed difference d_i = direction * (b_i - a_i) with a Student-t interval.

    a, b: per-seed values of the baseline and the new arm, seed i in both. Interval: mean(d) -+ t_{n-1} sd / sqrt(n),
    sd = sample sd of d (ddof 1). Fewer than two seeds: lo = hi = NaN, sd None. ``seed``
    is unused (kept for callers; the interval draws nothing). Raises ValueError if the lengths differ or are 0.
    """
    _check_level(level)
    _check_direction(direction)
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired_difference needs equal-length 1-D arms, got {a.shape} and {b.shape}")
    if a.size == 0:
        raise ValueError("paired_difference needs at least one seed")
    d = direction * (b - a)
    est = float(d.mean())
    if d.size < 2:
        return Effect(name, est, math.nan, math.nan, level, int(d.size), None)
    sd = float(d.std(ddof=1))
    lo, hi = _t_interval(est, sd / math.sqrt(d.size), d.size - 1, level)
    return Effect(name, est, lo, hi, level, int(d.size), sd)


def unpaired_difference(a, b, *, name: str, direction: int = +1, level: float = 0.9, seed: int = 0) -> Effect:
    """direction * (mean(b) - mean(a)) with Welch's t interval (arms independent).

    se = sqrt(sd_a^2 / n_a + sd_b^2 / n_b), Welch-Satterthwaite degrees of freedom; n = the smaller arm; sd =
    sqrt(sd_a^2 + sd_b^2) (ddof 1), the sd of one draw from b minus one from a, so ``seeds_needed`` gives seeds per
    arm. An arm with fewer than two values: lo = hi = NaN, sd None.
    """
    _check_level(level)
    _check_direction(direction)
    a, b = np.asarray(a, dtype=float).ravel(), np.asarray(b, dtype=float).ravel()
    if a.size == 0 or b.size == 0:
        raise ValueError(f"unpaired_difference needs values in both arms, got {a.size} and {b.size}")
    est = float(direction * (b.mean() - a.mean()))
    n = int(min(a.size, b.size))
    if n < 2:
        return Effect(name, est, math.nan, math.nan, level, n, None)
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    df = (va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1)) if va + vb > 0 else 1.0
    lo, hi = _t_interval(est, math.sqrt(va + vb), df, level)
    sd = float(math.sqrt(a.var(ddof=1) + b.var(ddof=1)))
    return Effect(name, est, lo, hi, level, n, sd)


def binomial_interval(k: int, n: int, level: float = 0.9) -> tuple[float, float]:
    """Clopper-Pearson exact interval for a rate k/n: [B(a/2; k, n-k+1), B(1-a/2; k+1, n-k)], a = 1 - level.

    B = the beta quantile (scipy.stats.beta.ppf); lo = 0 when k = 0 and hi = 1 when k = n (so (0, n) gives
    [0, 1 - (a/2)^(1/n)]: both tails get a/2, the conventional two-sided form).
    """
    from scipy.stats import beta

    _check_level(level)
    if n < 1 or not 0 <= k <= n:
        raise ValueError(f"binomial_interval needs 0 <= k <= n and n >= 1, got k={k}, n={n}")
    alpha = 1.0 - level
    lo = 0.0 if k == 0 else float(beta.ppf(alpha / 2, k, n - k + 1))
    hi = 1.0 if k == n else float(beta.ppf(1 - alpha / 2, k + 1, n - k))
    return lo, hi


def _wilson(k: int, n: int, z: float) -> tuple[float, float]:
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def rate_reduction(k_base: int, n_base: int, k_new: int, n_new: int, *, name: str, level: float = 0.9) -> Effect:
    """p_base - p_new (positive = fewer events with the new method), Newcombe's hybrid score interval.

    Newcombe (1998, method 10): with Wilson score intervals [l1, u1] for p_base and [l2, u2] for p_new at
    z = z_{(1+level)/2}, d = p_base - p_new, lo = d - sqrt((p_base - l1)^2 + (u2 - p_new)^2),
    hi = d + sqrt((u1 - p_base)^2 + (p_new - l2)^2). Near-nominal coverage for small n and for 0 or n events,
    where the Wald interval collapses to a point. n = the smaller arm; sd = sqrt(2 p (1 - p)) at the pooled
    rate p (per-arm sd of the difference, for ``seeds_needed``; None when p is 0 or 1). The counts are
    appended to ``name``.
    """
    _check_level(level)
    for k, n in ((k_base, n_base), (k_new, n_new)):
        if n < 1 or not 0 <= k <= n:
            raise ValueError(f"rate_reduction needs 0 <= k <= n and n >= 1, got k={k}, n={n}")
    z = _z(level)
    p1, p2 = k_base / n_base, k_new / n_new
    l1, u1 = _wilson(k_base, n_base, z)
    l2, u2 = _wilson(k_new, n_new, z)
    d = p1 - p2
    lo = d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2)
    hi = d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)
    pooled = (k_base + k_new) / (n_base + n_new)
    sd = math.sqrt(2 * pooled * (1 - pooled)) or None
    label = f"{name} ({k_base}/{n_base} vs {k_new}/{n_new} runs)"
    return Effect(label, float(d), float(lo), float(hi), level, int(min(n_base, n_new)), sd)


def _censored(values, censor: float | None, arm: str) -> tuple[np.ndarray, int]:
    out, count = [], 0
    for v in values:
        if v is None or not math.isfinite(float(v)):
            if censor is None:
                raise ValueError(f"ratio_of_means: arm {arm} has a run that never reached the threshold; pass censor=")
            out.append(float(censor))
            count += 1
        else:
            out.append(float(v))
    return np.asarray(out, dtype=float), count


def ratio_of_means(a, b, *, name: str, level: float = 0.9, seed: int = 0, censor: float | None = None) -> Effect:
    """1 - mean(b) / mean(a) (positive = b needs fewer steps than a), with a t interval on the delta method.

    For steps-to-threshold: a run that never reached the threshold (None, NaN or inf) counts as ``censor``
    (e.g. steps + 1; required when any run is censored). Censoring makes the estimate conservative for
    the arm with more censored runs; the counts are appended to ``name``. Interval: estimate -+ t_{n-1} se with
    se = sqrt(sd_b^2 / n_b + r^2 sd_a^2 / n_a) / mean(a), r = mean(b) / mean(a), n = the smaller arm; sd (per arm,
    for ``seeds_needed``) = sqrt(sd_b^2 + r^2 sd_a^2) / mean(a). mean(a) <= 0 (every baseline run at its threshold
    from the start) has no ratio: NaN estimate and interval, so ``decide`` says "inconclusive".
    """
    _check_level(level)
    a, ca = _censored(a, censor, "a")
    b, cb = _censored(b, censor, "b")
    if a.size == 0 or b.size == 0:
        raise ValueError(f"ratio_of_means needs values in both arms, got {a.size} and {b.size}")
    label = name
    if a.mean() <= 0:
        return Effect(f"{name} (the baseline's mean is {_fmt(float(a.mean()))}: no ratio)", math.nan, math.nan,
                      math.nan, level, int(min(a.size, b.size)), None)
    r = b.mean() / a.mean()
    if ca or cb:
        label = (
            f"{name} ({ca} of {a.size} runs in a and {cb} of {b.size} in b never reached the threshold, "
            f"counted as {_fmt(float(censor))})"
        )
    n = int(min(a.size, b.size))
    if n < 2:
        return Effect(label, float(1 - r), math.nan, math.nan, level, n, None)
    se = math.sqrt(b.var(ddof=1) / b.size + r * r * a.var(ddof=1) / a.size) / a.mean()
    lo, hi = _t_interval(float(1 - r), se, n - 1, level)
    sd = math.sqrt(b.var(ddof=1) + r * r * a.var(ddof=1)) / a.mean()
    return Effect(label, float(1 - r), lo, hi, level, n, float(sd))


def seeds_needed(effect: Effect, *, target: float = 0.0, level: float = 0.9, power: float = 0.8) -> int | None:
    """Seeds per arm to separate the effect from ``target``: ceil(((z_{(1+level)/2} + z_power) sd / delta)^2).

    delta = max(|estimate - target|, 1e-12); normal approximation (assumes the observed estimate and sd
    are the truth). At least 2 (an sd needs two seeds). None when sd is None, 0 or not finite.
    """
    from scipy.stats import norm

    _check_level(level)
    _check_level(power)
    if effect.sd is None or not math.isfinite(effect.sd) or effect.sd <= 0 or not math.isfinite(effect.estimate):
        return None
    delta = max(abs(effect.estimate - target), _TINY)
    n = ((_z(level) + float(norm.ppf(power))) * effect.sd / delta) ** 2
    return max(2, math.ceil(n - 1e-9))


def _fmt(x: float) -> str:
    if not math.isfinite(x):
        return str(x)
    if abs(x) >= 1000:
        return f"{x:.0f}"
    return f"{x:.3g}"


def _describe(e: Effect) -> str:
    interval = f"[{_fmt(e.lo)}, {_fmt(e.hi)}]" if math.isfinite(e.lo) and math.isfinite(e.hi) else "[no interval]"
    return f"{e.name}: {_fmt(e.estimate)} {interval} ({e.level:.0%} interval, {e.n} seeds per arm)"


def decide(
    effect: Effect,
    *,
    claimed: float | None = None,
    also: tuple[Effect, ...] = (),
    numbers: dict[str, Any] | None = None,
) -> Decision:
    """Apply THE rule to the primary effect's interval [lo, hi] (positive = claimed direction).

    lo > 0 and (claimed is None or hi >= claimed)           -> "holds"
    lo > 0 and claimed is not None and hi < claimed         -> "holds partly" (real, smaller than claimed)
    hi < 0                                                  -> "does not hold at this scale" (the opposite)
    lo <= 0 <= hi and claimed is not None and hi < claimed  -> "does not hold at this scale" (size excluded)
    otherwise (also: no interval, fewer than two seeds)     -> "inconclusive", with seeds_needed(effect)
    ``claimed`` is the claimed size in the effect's units (None: the claim names no size). ``also`` are
    secondary effects named in the reason. ``numbers`` (per-arm means, counts, ...) are merged into
    Decision.numbers beside the effects and ``claimed``.
    """
    lo, hi = effect.lo, effect.hi
    c = None if claimed is None else _fmt(float(claimed))
    need = None
    if not (math.isfinite(lo) and math.isfinite(hi)):
        verdict: Verdict = "inconclusive"
        rule = "no interval (fewer than two seeds per arm or undefined): inconclusive"
    elif lo > 0 and (claimed is None or hi >= claimed):
        verdict = "holds"
        rule = (
            "the interval excludes 0 and the claim names no size: holds"
            if claimed is None
            else f"the interval excludes 0 and reaches the claimed {c}: holds"
        )
    elif lo > 0:
        verdict = "holds partly"
        rule = f"the interval excludes 0 but lies below the claimed {c}: holds partly (real, smaller than claimed)"
    elif hi < 0:
        verdict = "does not hold at this scale"
        rule = "the whole interval is below 0 (the opposite effect): does not hold at this scale"
    elif claimed is not None and hi < claimed:
        verdict = "does not hold at this scale"
        rule = f"the interval contains 0 and excludes the claimed {c}: does not hold at this scale"
    else:
        verdict = "inconclusive"
        rule = "the interval contains 0" + ("" if claimed is None else f" and the claimed {c}") + ": inconclusive"
    if verdict == "inconclusive":
        need = seeds_needed(effect, level=effect.level)
        rule += (
            f"; about {need} seeds per arm would separate an effect of this size from 0"
            if need is not None
            else "; the spread is unknown, so no sample size can be given"
        )
    reason = f"{_describe(effect)}; {rule}."
    if also:
        reason += " Also: " + "; ".join(_describe(e) for e in also) + "."
    nums: dict[str, Any] = {"primary": asdict(effect), "also": [asdict(e) for e in also], "claimed": claimed}
    nums.update(numbers or {})
    return Decision(verdict, reason, (effect, *also), nums, need)
