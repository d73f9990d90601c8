"""Presets with the peers' names (verl, TRL, prime-rl), one module per kind of part they are built around.

Each module lists its preset functions in ``PRESETS``; ``polyrl.methods`` registers them exactly like its
own (``@preset``), so they appear in ``polyrl methods``, ``polyrl explain`` and ``docs/methods.md``.
"""

from __future__ import annotations

MODULES = ("trust", "baselines", "regularisers", "distill", "preference")
