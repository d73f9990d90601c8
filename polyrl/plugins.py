"""Import user code named as ``package.module`` or ``path/to/file.py`` (plugins, reward functions)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from polyrl.errors import Terminated

FILE_MODULE_PREFIX = "_polyrl_file_"  # the module names of .py files run by ``import_module_or_file``


def import_module_or_file(name: str) -> ModuleType:
    """Import a dotted module name, or execute a ``.py`` file as a module of its own.

    A file's module is registered under a private name made from its stem and its resolved path
    (``_polyrl_file_<hash>_<stem>``), never under the bare stem: a reward file named ``math.py`` or ``json.py`` would
    otherwise replace the standard library's module for the rest of the process. Raises ImportError with a message
    naming what is missing (the caller adds its own context), also for a module that calls ``sys.exit`` while it
    loads.
    """
    if name.endswith(".py"):
        path = Path(name)
        if not path.is_file():
            raise ImportError(f"file {name!r} does not exist")
        where = path.resolve()
        key = f"{FILE_MODULE_PREFIX}{hashlib.sha256(str(where).encode()).hexdigest()[:12]}_{path.stem}"
        if key in sys.modules:
            return sys.modules[key]  # executed once per process: a reward file's module-level set-up runs once
        spec = importlib.util.spec_from_file_location(key, where)
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module  # before it runs, as import does (dataclasses and pickle look a module up there)
        try:
            spec.loader.exec_module(module)
        except BaseException as e:
            del sys.modules[key]  # a failed import leaves no half-built module behind
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


def plugin_names(given: list[str]) -> list[str]:
    """The --plugin modules as a run records them and passes them on: a .py file by its absolute path, a module by
    its name."""
    return [str(Path(m).resolve()) if m.endswith(".py") else m for m in given]


def plugin_key(name: str) -> str:
    """What identifies a plugin wherever it lies: a file by its stem (a run copied elsewhere, its plugin too), a
    module by its last part (``pkg.my_parts`` and ``my_parts.py`` are the same plugin)."""
    return Path(name).stem if name.endswith(".py") else name.rpartition(".")[2]


def _exited(name: str, e: SystemExit) -> ImportError:
    """A module that calls ``sys.exit`` while it loads would end the whole command silently: an import error instead."""
    return ImportError(f"{name!r} called sys.exit({e.code!r}) while it was imported")


def file_modules() -> list[ModuleType]:
    """The modules this process ran from ``.py`` files. No other process can import them by their private names, so
    what is sent to one (a plugin task pickled for a Ray rollout worker) must carry their code, not a reference."""
    return [module for name, module in list(sys.modules.items()) if name.startswith(FILE_MODULE_PREFIX)]
