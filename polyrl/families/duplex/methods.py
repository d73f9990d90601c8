"""Duplex presets: after imitation of the scripted natural agent, either RL (an advantage + the PPO clip) or more
imitation for the same number of steps (the supervised baseline at equal compute).

``DUPLEX_METHODS`` maps a name to a builder; ``get_duplex_method(name, advantage=...)`` validates overrides
(PartError in one line).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import polyrl.objectives  # noqa: F401  (registers the advantage estimators and trust regions)
from polyrl.registry import ADVANTAGES, Part, PartError, PartLike, add_preset, resolve_part, unknown

# sequence-level estimators returning one advantage per rollout [B]
DUPLEX_ADVANTAGES = ("grpo", "group_centered", "group_centered_batch_std", "rloo", "maxrl", "reinforce")


@dataclass(frozen=True)
class DuplexMethod:
    name: str
    kind: str  # "rl" (advantage + clip) | "imitation" (behaviour cloning only)
    advantage: Part | None
    paper: str = ""
    summary: str = ""


def build_duplex_method(name: str, *, kind: str, advantage: PartLike | None = None, paper: str = "",
                        summary: str = "") -> DuplexMethod:
    where = f"duplex method {name!r}"
    if kind == "imitation":
        if advantage is not None:
            raise PartError(f"{where}: advantage = {advantage!r} does not apply to an imitation-only method")
        return DuplexMethod(name, kind, None, paper, summary)
    adv = resolve_part(ADVANTAGES, advantage)
    if adv.name not in DUPLEX_ADVANTAGES:
        raise PartError(f"{where}: advantage = {adv.name!r} is not per-rollout; "
                        f"allowed: {', '.join(DUPLEX_ADVANTAGES)}")
    return DuplexMethod(name, kind, adv, paper, summary)


DUPLEX_METHODS: dict[str, Callable[[], DuplexMethod]] = {}


def duplex_preset(fn: Callable[[], DuplexMethod]) -> Callable[[], DuplexMethod]:
    """Register a preset under its function name; its docstring becomes the summary (``add_preset``: a name already
    taken is refused, as is a method named otherwise than its preset)."""
    add_preset(DUPLEX_METHODS, fn, "duplex preset")
    return fn


@duplex_preset
def grpo() -> DuplexMethod:
    """GRPO over groups of rollouts of the same segment, PPO clip per frame, rule-based axis rewards + quality
    (arXiv:2606.11167; GRPO arXiv:2402.03300)."""
    return build_duplex_method("grpo", kind="rl", advantage="grpo", paper="arXiv:2606.11167")


@duplex_preset
def rloo() -> DuplexMethod:
    """As grpo with leave-one-out advantages (no std division)."""
    return build_duplex_method("rloo", kind="rl", advantage="rloo", paper="arXiv:2402.14740")


@duplex_preset
def imitation() -> DuplexMethod:
    """Supervised baseline: keep imitating the noisy scripted natural agent for the same number of steps."""
    return build_duplex_method("imitation", kind="imitation", paper="behaviour cloning")


def get_duplex_method(name: str, *, advantage: PartLike | None = None) -> DuplexMethod:
    if name not in DUPLEX_METHODS:
        raise unknown("duplex method", name, DUPLEX_METHODS)
    m = DUPLEX_METHODS[name]()
    if advantage is None:
        return m
    if m.kind == "imitation":
        raise PartError(f"duplex method {name!r}: advantage = {advantage!r} does not apply (imitation only)")
    return build_duplex_method(m.name, kind=m.kind, advantage=resolve_part(ADVANTAGES, advantage, m.advantage),
                               paper=m.paper, summary=m.summary)
