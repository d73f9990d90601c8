"""Target-update presets for `polyrl q train --method NAME` (and `polyrl compare --family q --methods A,B`).

``Q_METHODS`` maps a name to a ``QMethod`` (target mode, period, lambda). ``periodic`` and ``lambda_geometric`` are
matched in mean target period: 1 / (1 - 0.99) = 100 online steps (geometric: in expectation). ``lambda_exact``
refreshes once per window of H = 688 steps (0.99^H <= 1e-3), to the geometric average of the iterates since its
last refresh (weights (1 - λ) λ^(m-1), mean index 99.3). ``get_q_method(name, lam=, period=)``
applies overrides and validates (ConfigError, one line).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from polyrl.config import ConfigError
from polyrl.families.q.core import TARGET_MODES


@dataclass(frozen=True)
class QMethod:
    name: str
    target_mode: str
    period: int = 1
    lam: float = 0.0
    paper: str = ""
    summary: str = ""


Q_METHODS: dict[str, QMethod] = {m.name: m for m in (
    QMethod("every_step", "every_step", summary="plain linear Q-learning: target = online after every step "
            "(lambda = 0)"),
    QMethod("periodic", "periodic", period=100, summary="hard target copy every 100 online steps (DQN-style)"),
    QMethod("lambda_geometric", "lambda_geometric", lam=0.99, paper="arXiv:2606.10835",
            summary="copy online -> target with probability 1 - lambda after each step (mean period 100)"),
    QMethod("lambda_exact", "lambda_exact", lam=0.99, paper="arXiv:2606.10835",
            summary="target = geometric average of the online iterates since the last refresh, window lambda^H "
            "<= 1e-3 (ours)"),
)}


def validate_method(m: QMethod) -> QMethod:
    if m.target_mode not in TARGET_MODES:
        raise ConfigError(f"target_mode = {m.target_mode!r} is not allowed; allowed: {', '.join(TARGET_MODES)}")
    if isinstance(m.period, bool) or not isinstance(m.period, int) or m.period < 1:
        raise ConfigError(f"period = {m.period!r} is not allowed; allowed: an integer >= 1")
    if not (isinstance(m.lam, (int, float)) and 0.0 <= m.lam < 1.0):
        raise ConfigError(f"lam = {m.lam!r} is not allowed; allowed: 0 <= lam < 1")
    return m


def get_q_method(name: str, *, lam: float | None = None, period: int | None = None) -> QMethod:
    """Preset ``name`` with optional ``lam`` / ``period`` overrides, validated."""
    if name not in Q_METHODS:
        raise ConfigError(f"method = {name!r} is not allowed; allowed: {', '.join(Q_METHODS)}")
    m = Q_METHODS[name]
    if lam is not None:
        if not m.target_mode.startswith("lambda_"):
            raise ConfigError(f"lam = {lam!r} does not apply to method {name!r} (target_mode {m.target_mode}); "
                              "allowed with: lambda_geometric, lambda_exact")
        m = replace(m, lam=lam)
    if period is not None:
        if m.target_mode != "periodic":
            raise ConfigError(f"period = {period!r} does not apply to method {name!r} (target_mode "
                              f"{m.target_mode}); allowed with: periodic")
        m = replace(m, period=period)
    return validate_method(m)


def method_from_record(name: str, parts: dict) -> QMethod:
    """The method a run's ``config.json`` names (its preset with the recorded target_mode, period and lam)."""
    if name not in Q_METHODS:
        raise ConfigError(f"method = {name!r} is not allowed; allowed: {', '.join(Q_METHODS)}")
    missing = [k for k in ("target_mode", "period", "lam") if not isinstance(parts, dict) or k not in parts]
    if missing:
        raise ConfigError(f"the run's config.json has no {', '.join(missing)} in its \"parts\"; its method is unknown, "
                          "so it cannot be resumed")
    return validate_method(replace(Q_METHODS[name], target_mode=parts["target_mode"], period=parts["period"],
                                   lam=parts["lam"]))
