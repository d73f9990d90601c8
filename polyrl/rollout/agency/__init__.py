"""Agency transfer (arXiv:2606.09825): a frozen baseline policy acts first, the learner takes over.

``config`` holds the settings and schedules (no torch), ``arbiter`` the baseline/learner mixture and the
``AgencySource`` that samples through it. Names are imported on first use (PEP 562).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    **{name: "config" for name in ("AgencyConfig", "AgencyMode", "SCHEDULES", "exp_schedule", "linear_schedule",
                                   "parse_schedule", "step_schedule")},
    **{name: "arbiter" for name in ("AgencyArbiter", "AgencySource", "MixState")},
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
