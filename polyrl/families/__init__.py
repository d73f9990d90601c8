"""RL families beside the language-model path: each is a folder here that registers itself.

A family (flow-matching policies today; Q-learning, full-duplex turn-taking, multi-agent formation next)
brings its policy, sampler, losses, tasks and loop, and reuses the shared seam: part resolution
(``polyrl.registry.resolve_part``, the advantage registry), settings as flags and TOML
(``polyrl.config.add_config_args`` / ``load_toml`` / ``build_config`` on its own config dataclass), the run
directory's record (``polyrl.runs``), logging (``polyrl.logging.RunLogger``) and the CLI. Its package
``__init__`` calls ``register_family`` and imports nothing heavy, so that ``polyrl --help`` stays fast; the
module named there is imported only when its command runs. ``flag_values``, ``family_config`` and
``parse_train_flags`` are the settings half of the seam every family's CLI calls (TOML beneath flags, typed and
validated in one line; flags checked for `polyrl compare --family`).
"""

from __future__ import annotations

import importlib
import pkgutil
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """One RL family: ``polyrl NAME ...`` is parsed by ``MODULE.add_parser(subparsers)``."""

    name: str  # the CLI command
    help: str  # one line for `polyrl --help`
    module: str  # dotted module with ``add_parser(subparsers)``, ``check_train_flags(flags)`` (the lab) and, for a
    # family that saves checkpoints, ``checkpointed(run_dir)`` (the lab resumes an interrupted run that has one)


FAMILIES: dict[str, Family] = {}


def register_family(name: str, help: str, module: str) -> Family:
    """Make ``polyrl NAME`` a family command (called from the family package's ``__init__``)."""
    if name in FAMILIES:
        raise ValueError(f"family {name!r} is registered twice")
    FAMILIES[name] = Family(name, help, module)
    return FAMILIES[name]


def discover() -> dict[str, Family]:
    """Import every family package under ``polyrl.families`` (each registers itself); return the registry."""
    for info in pkgutil.iter_modules(__path__):
        if info.ispkg:
            importlib.import_module(f"{__name__}.{info.name}")
    return FAMILIES


def add_parser(family: Family, subparsers):
    """The family's full parser (imports its module: it may import torch)."""
    return family_module(family.name).add_parser(subparsers)


def family_module(name: str):
    """The family's CLI module (``add_parser``; ``check_train_flags`` for `polyrl compare --family`)."""
    return importlib.import_module(FAMILIES[name].module)


def flag_values(args, cls) -> dict:
    """A family's settings as given: its TOML file (``args.config``, when the command has one) beneath the flags that
    were given (None = not given), by the field names of its config dataclass ``cls``. The file is read once per
    command (kept on ``args``), so every part of the command sees the same settings, however often it asks."""
    from dataclasses import fields

    from polyrl.config import load_toml

    path = getattr(args, "config", None)
    read = vars(args).setdefault("_toml_read", {})
    if path and (path, cls) not in read:
        read[path, cls] = load_toml(path, cls)
    values = dict(read[path, cls]) if path else {}
    values.update({f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None})
    return values


def family_config(values: dict, cls, validate):
    """``cls`` built from flat ``values`` (typed by ``polyrl.config.build_config``) and checked by ``validate``; a
    ValueError becomes a one-line ConfigError, as does a float setting beyond float32's range."""
    import dataclasses
    import math

    from polyrl.config import ConfigError, build_config
    from polyrl.errors import FLOAT32_MAX

    cfg = build_config(values, cls, strict=False)  # a resumed run's saved record among them
    seed = getattr(cfg, "seed", 0)
    if not 0 <= seed < 2**32:  # as train's; flow and marl took -1 (a pretrain cache entry named seed-1)
        raise ConfigError(f"seed = {seed} is not allowed; allowed: an integer in [0, 2**32)")
    for f in dataclasses.fields(cfg):  # an --lr 1e300 was an overflow traceback from the optimizer
        v = getattr(cfg, f.name)
        if isinstance(v, float) and math.isfinite(v) and abs(v) > FLOAT32_MAX:
            raise ConfigError(f"{f.name} = {v:g} is not allowed; allowed: a number of at most {FLOAT32_MAX:.3g} in "
                              "size (float32, in which the family trains)")
        if (f.name == "lr" or f.name.endswith("_lr")) and isinstance(v, float) and abs(v) > FLOAT32_MAX / 10:
            # Adam's first step is lr / (1 - beta1) = 10 lr, a float32 scalar: an --lr 1e38 was an overflow traceback
            raise ConfigError(f"{f.name} = {v:g} is not allowed; allowed: at most {FLOAT32_MAX / 10:.3g} (Adam's "
                              "first step is 10 x the learning rate, in float32)")
    try:
        validate(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return cfg


def parse_train_flags(argv: list[str], prog: str, add_train_args):
    """Parse a family's train flags without running them (``check_train_flags`` for `polyrl compare --family`): an
    unknown or malformed flag is a one-line ConfigError, not argparse's exit."""
    import argparse

    from polyrl.config import ConfigError

    p = argparse.ArgumentParser(prog=prog, add_help=False, exit_on_error=False, allow_abbrev=False)
    add_train_args(p)
    try:
        args, extra = p.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ConfigError(str(e)) from None
    if extra:
        raise ConfigError(f"unrecognized arguments: {' '.join(extra)}")
    return args


def record_of(record: dict) -> dict:
    """A run's record as its ``config.json`` reads back (tuples as lists): what `polyrl compare` checks a finished run
    against."""
    import json

    return json.loads(json.dumps(record, default=str))


@contextmanager
def diverged(where: str, scales: dict[str, float]):
    """Add where a divergence happened, and the settings that scale the loss or the step (flag -> value), to its
    one-line TrainingError: ``lower --lr (0.001) or --kl-coef (3e+38)``, so the one set too high shows."""
    from polyrl.errors import TrainingError

    try:
        yield
    except TrainingError as e:
        raise TrainingError(f"{e} at {where}; {lower(scales)}") from None


def lower(scales: dict[str, float]) -> str:
    """``lower --a (1) or --b (2)``: the advice of a divergence message, each setting named with its value."""
    named = [f"--{flag} ({value:g})" for flag, value in scales.items()]
    return "lower " + (named[0] if len(named) == 1 else ", ".join(named[:-1]) + " or " + named[-1])

