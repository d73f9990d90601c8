"""Presets (filled in by issue 21)."""

from __future__ import annotations

PRESETS: tuple = ()
