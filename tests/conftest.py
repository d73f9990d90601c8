"""Shared test set-up: a test that registers a part or a preset (as a plugin would) leaves no trace for the next;
``tiny_model``, the 2-layer character-level Llama most engine tests train (built once per worker process).

The registries and the preset table are process-wide; tests that check the generated docs or the shipped
manifest against them must not see a part another test registered in the same worker process.
"""

from __future__ import annotations

import pytest

import polyrl.methods  # noqa: F401  (registers every built-in part and preset)
from polyrl.methods import PRESETS
from polyrl.registry import ALL_REGISTRIES
from polyrl.tinylm import build_tiny_llama


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A random-init Llama (hidden 32, 2 layers, character tokenizer) saved once; tests only read it."""
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny"), hidden=32, layers=2, heads=2, seed=0))


@pytest.fixture(autouse=True)
def _restore_registries():
    specs = [(registry, dict(registry._specs)) for registry in ALL_REGISTRIES]
    presets = dict(PRESETS)
    yield
    for registry, saved in specs:
        registry._specs.clear()
        registry._specs.update(saved)
    PRESETS.clear()
    PRESETS.update(presets)
