"""Agency transfer's settings and schedules (no torch): flags ``--agency*``, TOML ``[agency]``, ``TrainConfig.agency``.

The schedule ``beta(step)`` is the baseline's share of the acting: 1 (the baseline acts) down to 0 (the
learner acts alone). See ``arbiter`` for how the two policies are mixed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Literal

AgencyMode = Literal["token", "sequence"]


def linear_schedule(step: int, steps: int) -> float:
    """beta = max(0, 1 - step / steps): all baseline at step 0, the learner alone from ``steps`` on."""
    return max(0.0, 1.0 - step / steps)


def exp_schedule(step: int, tau: float) -> float:
    """beta = exp(-step / tau)."""
    return math.exp(-step / tau)


def step_schedule(step: int, steps: int) -> float:
    """beta = 1 before ``steps``, then 0."""
    return 1.0 if step < steps else 0.0


SCHEDULES: dict[str, tuple[Callable[..., float], str, type]] = {
    "linear": (linear_schedule, "steps", int),
    "exp": (exp_schedule, "tau", float),
    "step": (step_schedule, "steps", int),
}


def parse_schedule(text: str) -> Callable[[int], float]:
    """``linear:steps=N`` | ``exp:tau=T`` | ``step:steps=N`` -> beta(step); bad text is a one-line error."""
    allowed = "linear:steps=N, exp:tau=T or step:steps=N"
    match = re.fullmatch(r"(\w+):(\w+)=([0-9.eE+-]+)", text.strip())
    if match is None or match.group(1) not in SCHEDULES:
        raise ValueError(f"agency_schedule = {text!r} is not allowed; use {allowed}")
    fn, key, kind = SCHEDULES[match.group(1)]
    if match.group(2) != key:
        raise ValueError(f"agency_schedule = {text!r}: schedule {match.group(1)!r} takes {key}=..., not "
                         f"{match.group(2)}=...")
    try:
        value = kind(match.group(3))
    except ValueError:
        raise ValueError(f"agency_schedule = {text!r}: {key} must be {kind.__name__}") from None
    if not value > 0:
        raise ValueError(f"agency_schedule = {text!r}: {key} must be > 0")
    return lambda step: fn(step, value)


@dataclass
class AgencyConfig:
    """A frozen baseline policy that acts first and hands over to the learner (``--agency DIR``)."""

    PREFIX: ClassVar[str] = "agency"

    baseline: str | None = field(default=None, metadata={"flag": "agency"})
    """agency transfer: local model directory of a frozen baseline policy that acts first"""
    schedule: str = "linear:steps=50"
    """agency transfer: the baseline's share beta(step): linear:steps=N, exp:tau=T or step:steps=N"""
    mode: Literal["token", "sequence"] = "token"
    """agency transfer: the arbiter picks the acting policy per token or per completion"""
