"""Learners: the model backends behind the training loop (``Learner`` protocol; ``LocalLearner`` in one process,
``FSDPLearner`` sharded over N processes).

``config`` holds the critic's settings (no torch); ``local`` the protocol and the single-process learner; ``fsdp``
the FSDP2 learner, ``dist`` its process group (``init_from_env``, ``close``) and row collectives, ``sharded`` its
DCP checkpoints and ``export_hf``; ``common`` what both learners share. Names are imported on first use (PEP 562),
so that the settings stay importable without torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"CriticConfig": "config", "FSDPLearner": "fsdp", "export_hf": "sharded",
            **{name: "local" for name in ("Learner", "LocalLearner", "ValueHead", "answer_likelihood",
                                          "prompt_embedder")}}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
