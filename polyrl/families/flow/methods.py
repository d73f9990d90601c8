"""Flow-method presets: each names an advantage estimator, a flow loss and the sampler it rolls out with.

``FLOW_METHODS`` maps a name to a builder; ``get_flow_method(name, **overrides)`` returns the validated
``FlowMethod``. Overrides use the part syntax of the language-model path (``loss="flow_dppo:kl_threshold=1e-4"``,
``advantage="rloo"``) or plain values (``schedule``, ``eta``, ``reduce``, ``cfm_samples``). Every bad
value raises ``PartError`` with one line naming the field, the value and what is allowed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import polyrl.objectives  # noqa: F401  (registers the advantage estimators)
from polyrl.families.flow.losses import FLOW_LOSSES
from polyrl.families.flow.sampler import REDUCES, SCHEDULES
from polyrl.registry import ADVANTAGES, Part, PartError, PartLike, add_preset, resolve_part, unknown

# Sequence-level estimators that return one advantage per sample [B] (token-level ones do not apply).
FLOW_ADVANTAGES = ("grpo", "group_centered", "group_centered_batch_std", "rloo", "maxrl", "reinforce")


@dataclass(frozen=True)
class FlowMethod:
    """A flow RL method as data: parts plus the sampler settings used for rollouts and replay."""

    name: str
    advantage: Part  # an ADVANTAGES part returning [B]
    loss: Part  # a FLOW_LOSSES part
    schedule: str = "flow_grpo"  # SDE noise schedule: flow_grpo | dance | cps
    eta: float = 0.7  # noise level of the schedule
    reduce: str = "mean"  # unit of step log-probs: mean (per dim) | sum
    cfm_samples: int = 0  # (t, eps) pairs stored per action for CFM-ratio losses (FPO); 0 = none
    sde_steps: int = 0  # sampler steps with noise per action, drawn in the SDE window; 0 = every step
    sde_window: float = 1.0  # the fraction of the schedule, from its noise end, the noisy steps are drawn in
    paper: str = ""
    summary: str = ""

    @property
    def needs_steps(self) -> bool:
        """The loss uses per-step log-probs and means (replayed through the SDE sampler)."""
        return _reads(self.loss, "steps")

    @property
    def needs_cfm(self) -> bool:
        """The loss uses stored (t, eps) pairs (``cfm_samples`` of them per action)."""
        return _reads(self.loss, "cfm")


def _reads(loss: Part, tag: str) -> bool:
    """Whether the flow loss reads what ``tag`` names: 'steps' (per-step log-probs, so ``reduce``) or 'cfm'
    (stored (t, eps) pairs, so ``cfm_samples``). The one place these two settings' relevance is decided."""
    return tag in FLOW_LOSSES.spec(loss.name).tags


def build_flow_method(name: str, *, advantage: PartLike, loss: PartLike, schedule: str = "flow_grpo",
                      eta: float = 0.7, reduce: str = "mean", cfm_samples: int = 0, sde_steps: int = 0,
                      sde_window: float = 1.0, paper: str = "", summary: str = "") -> FlowMethod:
    """Validate every field and return the FlowMethod (raises PartError with a one-line message)."""
    where = f"flow method {name!r}"
    adv = resolve_part(ADVANTAGES, advantage)
    if adv.name not in FLOW_ADVANTAGES:
        raise PartError(f"{where}: advantage = {adv.name!r} is not per-sample; allowed: {', '.join(FLOW_ADVANTAGES)}")
    part = resolve_part(FLOW_LOSSES, loss)
    if schedule not in SCHEDULES:
        raise PartError(f"{where}: schedule = {schedule!r}; allowed: {', '.join(map(repr, SCHEDULES))}")
    if reduce not in REDUCES:
        raise PartError(f"{where}: reduce = {reduce!r}; allowed: 'mean', 'sum'")
    try:
        eta = float(eta)
    except (TypeError, ValueError):
        raise PartError(f"{where}: eta = {eta!r} must be a number") from None
    if schedule == "cps" and not 0 < eta <= 1:
        raise PartError(f"{where}: eta = {eta} is out of range for schedule 'cps'; allowed: (0, 1]")
    if not (math.isfinite(eta) and eta > 0):
        raise PartError(f"{where}: eta = {eta} is out of range; allowed: > 0")
    if isinstance(cfm_samples, bool) or not isinstance(cfm_samples, int) or cfm_samples < 0:
        raise PartError(f"{where}: cfm_samples = {cfm_samples!r} must be an integer >= 0")
    if isinstance(sde_steps, bool) or not isinstance(sde_steps, int) or sde_steps < 0:
        raise PartError(f"{where}: sde_steps = {sde_steps!r} must be an integer >= 0 (0: every sampler step)")
    try:
        sde_window = float(sde_window)
    except (TypeError, ValueError):
        raise PartError(f"{where}: sde_window = {sde_window!r} must be a number") from None
    if not 0.0 < sde_window <= 1.0:
        raise PartError(f"{where}: sde_window = {sde_window} is out of range; allowed: (0, 1]")
    if sde_window != 1.0 and not sde_steps:
        raise PartError(f"{where}: sde_window = {sde_window} has no effect with sde_steps = 0 (every step has "
                        "noise); allowed: with sde_steps >= 1")
    method = FlowMethod(name, adv, part, schedule, eta, reduce, cfm_samples, sde_steps, sde_window, paper, summary)
    if method.needs_cfm and cfm_samples < 1:
        raise PartError(f"{where}: loss {part.name!r} needs cfm_samples >= 1, got {cfm_samples}")
    if not method.needs_cfm and cfm_samples:
        raise PartError(f"{where}: cfm_samples = {cfm_samples} does not apply to loss {part.name!r}; allowed: 0, "
                        f"or a loss tagged 'cfm' ({', '.join(_tagged('cfm'))})")
    return method


def _tagged(tag: str) -> list[str]:
    """Names of the flow losses carrying ``tag`` (for the 'allowed' half of a refusal)."""
    return [spec.name for spec in FLOW_LOSSES if tag in spec.tags]


def _refuse_unread(name: str, loss: Part, given: dict[str, Any]) -> None:
    """Refuse an explicitly given sampler setting that the loss never reads, so that no flag is silently ignored.

    ``cfm_samples`` only feeds losses tagged 'cfm' (FPO's stored (t, eps) pairs); ``reduce`` is the unit of the
    step log-probs, which only losses tagged 'steps' read (rollouts and the path KL do not depend on it).
    """
    for key, tag in (("cfm_samples", "cfm"), ("reduce", "steps")):
        if key in given and not _reads(loss, tag):
            raise PartError(f"flow method {name!r}: {key} = {given[key]!r} has no effect with loss {loss.name!r}; "
                            f"allowed only with a loss tagged {tag!r}: {', '.join(_tagged(tag))}")


FLOW_METHODS: dict[str, Callable[[], FlowMethod]] = {}


def flow_preset(fn: Callable[[], FlowMethod]) -> Callable[[], FlowMethod]:
    """Register a preset under its function name; its docstring becomes the summary (``add_preset``: a name already
    taken is refused, as is a method named otherwise than its preset)."""
    add_preset(FLOW_METHODS, fn, "flow preset")
    return fn


@flow_preset
def flow_grpo() -> FlowMethod:
    """Flow-GRPO: SDE sampler, GRPO group z-score, per-step ratio clip (arXiv:2505.05470)."""
    return build_flow_method("flow_grpo", advantage="grpo", loss="flow_clip", paper="arXiv:2505.05470")


@flow_preset
def flow_dppo() -> FlowMethod:
    """Flow-DPPO: exact-KL asymmetric mask instead of clipping; group mean, batch std (arXiv:2606.11025). Every
    sampler step is stochastic and trained, as in the spec's toy experiment; the UniRL SD3.5 recipe's 3 noisy steps
    in the first half of 10 are ``--sde-steps 3 --sde-window 0.5``."""
    return build_flow_method("flow_dppo", advantage="group_centered_batch_std", loss="flow_dppo",
                             paper="arXiv:2606.11025")


@flow_preset
def grpo_guard() -> FlowMethod:
    """GRPO-Guard: per-step RatioNorm and 1/dt gradient reweighting on Flow-GRPO (arXiv:2510.22319)."""
    return build_flow_method("grpo_guard", advantage="grpo", loss="grpo_guard", paper="arXiv:2510.22319")


@flow_preset
def loop() -> FlowMethod:
    """LOOP: leave-one-out advantages with the per-step PPO clip (arXiv:2503.00897)."""
    return build_flow_method("loop", advantage="rloo", loss="flow_clip", paper="arXiv:2503.00897")


@flow_preset
def dance_grpo() -> FlowMethod:
    """DanceGRPO: Flow-GRPO's loss with the constant-sigma ``dance`` noise schedule (arXiv:2505.07818)."""
    return build_flow_method("dance_grpo", advantage="grpo", loss="flow_clip", schedule="dance", eta=0.7,
                             paper="arXiv:2505.07818")


@flow_preset
def fpo() -> FlowMethod:
    """FPO: PPO clip on the ratio of flow-matching losses, 8 shared (t, eps) per action (arXiv:2507.21053)."""
    return build_flow_method("fpo", advantage="grpo", loss="fpo", cfm_samples=8, paper="arXiv:2507.21053")


def get_flow_method(name: str, **overrides: Any) -> FlowMethod:
    """Preset ``name`` with overrides (advantage, loss, schedule, eta, reduce, cfm_samples, sde_steps, sde_window),
    validated.

    None means "not given". A given ``cfm_samples`` or ``reduce`` that the (final) loss does not read is refused.
    """
    if name not in FLOW_METHODS:
        raise unknown("flow method", name, FLOW_METHODS)
    m = FLOW_METHODS[name]()
    allowed = ("advantage", "loss", "schedule", "eta", "reduce", "cfm_samples", "sde_steps", "sde_window")
    for key in overrides:
        if key not in allowed:
            raise PartError(f"flow method {name!r}: cannot override {key!r}; allowed: {', '.join(allowed)}")
    fields = {k: v for k, v in overrides.items() if v is not None}
    adv = resolve_part(ADVANTAGES, fields.pop("advantage"), m.advantage) if "advantage" in fields else m.advantage
    loss = resolve_part(FLOW_LOSSES, fields.pop("loss"), m.loss) if "loss" in fields else m.loss
    _refuse_unread(name, loss, fields)
    # A preset's own cfm_samples (fpo: 8) is dropped when the loss is overridden by one that reads none.
    cfm_samples = m.cfm_samples if _reads(loss, "cfm") else 0
    base = dict(schedule=m.schedule, eta=m.eta, reduce=m.reduce, cfm_samples=cfm_samples, sde_steps=m.sde_steps,
                sde_window=m.sde_window)
    base.update(fields)
    return build_flow_method(m.name, advantage=adv, loss=loss, paper=m.paper, summary=m.summary, **base)
