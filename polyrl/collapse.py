"""Training collapse: one documented, configurable definition used offline and online.

A run *collapses* at the first observation where any of these holds for ``patience`` consecutive
observations of the same signal:

1. **Performance drop.** The performance metric (``metric``, default ``eval/accuracy``) falls below
   ``(1 - drop_fraction) * best`` where ``best`` is the best value seen *before* this observation and
   ``best > min_best`` (a run that never learned cannot collapse). While ``metric`` has not been seen
   yet, ``fallback`` (default ``reward/mean``) is tracked instead; the first observation of ``metric``
   switches to it for good (its best-so-far starts fresh and the fallback is ignored from then on).
2. **Entropy spike** (``entropy_spike`` not None): ``objective/entropy`` exceeds ``entropy_spike`` times
   the median of all *previous* entropy observations, once at least ``min_history`` of them exist.
3. **KL spike** (``kl_spike`` not None): ``objective/approx_kl`` exceeds the absolute level ``kl_spike``.

An *observation* of a signal is a row (or ``update`` call) that carries its key with a finite value;
non-finite values are ignored (the run logger drops them from ``metrics.jsonl`` too). Rows are read in
the order they were logged, so an evaluation row sharing a step with a training row counts separately.
Within one observation the checks run in the order above and the first that fires gives the reason.

``first_collapse`` evaluates the definition on a finished log (array style); ``CollapseMonitor`` evaluates
it incrementally for the trainer's ``--guard``. Both give the same answer on the same sequence.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import accumulate
from typing import Any


@dataclass(frozen=True)
class CollapseRule:
    """Settings of the collapse definition (see the module docstring)."""

    metric: str = "eval/accuracy"
    fallback: str | None = "reward/mean"
    drop_fraction: float = 0.5
    min_best: float = 0.2
    patience: int = 1
    entropy_spike: float | None = 3.0
    entropy_key: str = "objective/entropy"
    min_history: int = 3
    kl_spike: float | None = 0.5
    kl_key: str = "objective/approx_kl"

    def __post_init__(self):
        if not 0.0 < self.drop_fraction <= 1.0:
            raise ValueError(f"drop_fraction must be in (0, 1], got {self.drop_fraction}")
        if self.patience < 1:
            raise ValueError(f"patience must be >= 1, got {self.patience}")
        if self.min_history < 1:
            raise ValueError(f"min_history must be >= 1, got {self.min_history}")
        if self.entropy_spike is not None and self.entropy_spike <= 1.0:
            raise ValueError(f"entropy_spike must be > 1 (a factor over the median) or None, got {self.entropy_spike}")
        if self.kl_spike is not None and self.kl_spike <= 0.0:
            raise ValueError(f"kl_spike must be > 0 or None, got {self.kl_spike}")

    def describe(self) -> str:
        """One-paragraph human description of this rule (used in reports)."""
        perf = f"{self.metric}" + (f" (or {self.fallback} until {self.metric} is logged)" if self.fallback else "")
        parts = [
            f"{perf} falls below {1 - self.drop_fraction:g} x its best so far, once the best exceeded {self.min_best:g}"
        ]
        if self.entropy_spike is not None:
            parts.append(f"{self.entropy_key} exceeds {self.entropy_spike:g} x the median of its previous values")
        if self.kl_spike is not None:
            parts.append(f"{self.kl_key} exceeds {self.kl_spike:g}")
        return "collapsed when " + "; or ".join(parts) + f" (for {self.patience} consecutive observation(s))"


def _finite(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _drop_reason(key: str, value: float, best: float, drop: float) -> str:
    return f"{key} fell to {value:.4g} < {1 - drop:g} x best {best:.4g}"


class CollapseMonitor:
    """Online collapse detection: feed each logged row with ``update``; a reason string means collapse."""

    def __init__(self, rule: CollapseRule | None = None):
        self.rule = rule or CollapseRule()
        self._on_primary = False
        self._best: float | None = None
        self._perf_run = 0
        self._entropies: list[float] = []
        self._ent_run = 0
        self._kl_run = 0
        self.collapsed: tuple[int, str] | None = None

    def update(self, step: int, metrics: Mapping[str, Any]) -> str | None:
        """Account for one observation; return the reason if the run collapses at this step, else None.

        After the first collapse, later calls keep returning None (the first collapse is in ``collapsed``).
        """
        r = self.rule
        reasons: list[str] = []
        primary = _finite(metrics.get(r.metric))
        fallback = _finite(metrics.get(r.fallback)) if r.fallback else None
        if primary is not None and not self._on_primary:
            self._on_primary, self._best, self._perf_run = True, None, 0
        key, value = (r.metric, primary) if self._on_primary else (r.fallback, fallback)
        if value is not None:
            best = self._best
            if best is not None and best > r.min_best and value < (1 - r.drop_fraction) * best:
                self._perf_run += 1
                if self._perf_run >= r.patience:
                    reasons.append(_drop_reason(key, value, best, r.drop_fraction))
            else:
                self._perf_run = 0
            self._best = value if best is None else max(best, value)
        ent = _finite(metrics.get(r.entropy_key)) if r.entropy_spike is not None else None
        if ent is not None:
            if len(self._entropies) >= r.min_history:
                med = statistics.median(self._entropies)
                if ent > r.entropy_spike * med:
                    self._ent_run += 1
                    if self._ent_run >= r.patience:
                        reasons.append(f"{r.entropy_key} spiked to {ent:.4g} > {r.entropy_spike:g} x median {med:.4g}")
                else:
                    self._ent_run = 0
            self._entropies.append(ent)
        kl = _finite(metrics.get(r.kl_key)) if r.kl_spike is not None else None
        if kl is not None:
            if kl > r.kl_spike:
                self._kl_run += 1
                if self._kl_run >= r.patience:
                    reasons.append(f"{r.kl_key} reached {kl:.4g} > {r.kl_spike:g}")
            else:
                self._kl_run = 0
        if reasons and self.collapsed is None:
            self.collapsed = (int(step), reasons[0])
            return reasons[0]
        return None


def _runs_of_true(flags: list[bool]) -> list[int]:
    """Length of the run of consecutive True values ending at each index."""
    out, run = [], 0
    for f in flags:
        run = run + 1 if f else 0
        out.append(run)
    return out


def first_collapse(rows: Iterable[Mapping[str, Any]], rule: CollapseRule | None = None) -> tuple[int, str] | None:
    """First (step, reason) at which the logged ``rows`` (in logging order) collapse under ``rule``, else None."""
    r = rule or CollapseRule()
    rows = list(rows)
    steps = [int(row["step"]) for row in rows]
    n = len(rows)

    switch = next((i for i, row in enumerate(rows) if _finite(row.get(r.metric)) is not None), n)
    segments = [(r.metric, range(switch, n))]
    if r.fallback:
        segments.insert(0, (r.fallback, range(0, switch)))
    perf_hits: dict[int, str] = {}
    for key, idx in segments:
        obs = [(i, v) for i in idx if (v := _finite(rows[i].get(key))) is not None]
        bests = [None, *accumulate((v for _, v in obs[:-1]), max)]
        drops = [b is not None and b > r.min_best and v < (1 - r.drop_fraction) * b for (_, v), b in zip(obs, bests)]
        for (i, v), b, run in zip(obs, bests, _runs_of_true(drops)):
            if run >= r.patience:
                perf_hits[i] = _drop_reason(key, v, b, r.drop_fraction)
    ent_hits: dict[int, str] = {}
    if r.entropy_spike is not None:
        obs = [(i, v) for i in range(n) if (v := _finite(rows[i].get(r.entropy_key))) is not None]
        vals = [v for _, v in obs]
        meds = [statistics.median(vals[:j]) if j >= r.min_history else None for j in range(len(vals))]
        flags = [m is not None and v > r.entropy_spike * m for v, m in zip(vals, meds)]
        # an observation without enough history neither fires nor resets the consecutive count
        runs, run = [], 0
        for f, m in zip(flags, meds):
            if m is not None:
                run = run + 1 if f else 0
            runs.append(run if f else 0)
        for (i, v), m, run in zip(obs, meds, runs):
            if run >= r.patience:
                ent_hits[i] = f"{r.entropy_key} spiked to {v:.4g} > {r.entropy_spike:g} x median {m:.4g}"
    kl_hits: dict[int, str] = {}
    if r.kl_spike is not None:
        obs = [(i, v) for i in range(n) if (v := _finite(rows[i].get(r.kl_key))) is not None]
        for (i, v), run in zip(obs, _runs_of_true([v > r.kl_spike for _, v in obs])):
            if run >= r.patience:
                kl_hits[i] = f"{r.kl_key} reached {v:.4g} > {r.kl_spike:g}"
    for i in range(n):  # first row where any signal fires; check order decides the reason
        for hits in (perf_hits, ent_hits, kl_hits):
            if i in hits:
                return steps[i], hits[i]
    return None
