"""Rollout: sampling backends behind the ``Generator`` protocol, and the sources that turn them into batches.

The package imports nothing until a name is used (PEP 562), so that the settings modules of its features
(``tree.config``, ``agency.config``, ``source``'s ``PrefetchConfig``) stay importable without torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"Generator": "generator", "Sample": "generator", "SamplingParams": "generator", "HFGenerator": "hf"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
