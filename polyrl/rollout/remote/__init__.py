"""Rollout workers on Ray: generator actors that sample episodes for the trainer, synchronously or ahead of it.

Settings: ``launch.ScaleConfig``. ``worker`` (what runs inside an actor), ``pool`` (starting Ray and
the actors, the weight broadcast, dispatch, restarts), ``runner`` (the pool behind the runner interface the
sources already use), ``prefetch`` (the batches of the next k steps). Imports nothing until a name is used.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"WorkerPool": "pool", "RemoteRunner": "runner", "Prefetch": "prefetch",
            "WorkerSpec": "worker", "WorkerError": "pool"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
