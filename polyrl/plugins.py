"""Import user code named as ``package.module`` or ``path/to/file.py`` (plugins, reward functions)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from polyrl.errors import Terminated


def import_module_or_file(name: str) -> ModuleType:
    """Import a dotted module name, or execute a ``.py`` file as a module named after its stem.

    Raises ImportError with a message naming what is missing (the caller adds its own context), also for a module
    that calls ``sys.exit`` while it loads.
    """
    if name.endswith(".py"):
        path = Path(name)
        if not path.is_file():
            raise ImportError(f"file {name!r} does not exist")
        loaded = sys.modules.get(path.stem)
        if loaded is not None and getattr(loaded, "__file__", None) == str(path.resolve()):
            return loaded  # executed once per process: a reward file's module-level set-up runs once
        spec = importlib.util.spec_from_file_location(path.stem, path.resolve())
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        try:
            spec.loader.exec_module(module)
        except BaseException as e:
            del sys.modules[path.stem]  # a failed import leaves no half-built module behind
            if isinstance(e, SystemExit) and not isinstance(e, Terminated):
                raise _exited(name, e) from None
            raise
        return module
    try:
        return importlib.import_module(name)
    except Terminated:
        raise
    except SystemExit as e:
        raise _exited(name, e) from None


def _exited(name: str, e: SystemExit) -> ImportError:
    """A module that calls ``sys.exit`` while it loads would end the whole command silently: an import error instead."""
    return ImportError(f"{name!r} called sys.exit({e.code!r}) while it was imported")
