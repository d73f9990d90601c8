"""The evidence claim types (issue 22): Budget, Claim and Samples, shared by claims.py and claims_families.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Samples = dict[str, Any]  # {"arms": {arm: {stat: [per-seed floats]}}, "curves": {...}, "wall_seconds": float}


@dataclass(frozen=True)
class Budget:
    """How much one claim's experiment runs: seeds per arm and steps (or the family's unit) per run."""

    seeds: int
    steps: int

    def __post_init__(self):
        if self.seeds < 1 or self.steps < 1:
            raise ValueError(f"budget = {self}: seeds and steps must be >= 1")


@dataclass(frozen=True)
class Claim:
    """One seed-document claim, the experiment that tests it and the rule that decides it."""

    id: str
    title: str
    seed_text: str
    seed_source: str
    corrected: str
    setup: str
    quick: Budget
    full: Budget
    run: Callable[[Budget, Path, int], Samples]
    decide: Callable[[Samples], Any]
    limits: str
    stability: bool = False  # a claim about stability/collapse: the full budget must have >= 5 seeds per arm


def check_workers(workers: int) -> None:
    """Refuse ``workers < 1`` (ValueError, one line) instead of clamping it: a clamped value is silently ignored."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers = {workers!r} is not allowed; allowed: an integer >= 1")


def last_line(text: str) -> str:
    """The last non-empty line of a failed command's stderr (its one-line error), at most 400 characters."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][-400:] if lines else "no message"
