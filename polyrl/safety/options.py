"""The option rules every `polyrl safety` tool shares, in one place so no tool can forget one.

Each tool still checks its own ranges; what lives here is what used to be written five times and was missing
in some: float options must be finite (a check written ``not x > 0`` lets inf through and ``x < 0`` lets nan
through, which then failed deep in an ODE, in matplotlib or in the JSON writer after figures were written),
comma-separated number lists must be finite too, ``--threads`` must be >= 1, and an ``--out`` that already holds
a finished run is refused unless ``--overwrite`` is given (a rerun used to replace results.json silently).
Every refusal is a ``ConfigError``: one line naming the option, the value and what is allowed (exit 2).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from polyrl.config import ConfigError
from polyrl.errors import FLOAT32_MAX, FLOAT32_TINY
from polyrl.runs import max_threads, remove_path

RESULTS = "results.json"
REPORT = "report.html"


def refuse(option: str, value: object, allowed: str) -> NoReturn:
    """Raise the one-line ConfigError every check here uses: option, value, what is allowed."""
    raise ConfigError(f"{option} = {value!r}: must be {allowed}")


def check_distinct(option: str, text: str, values: list[float], label: Callable[[float], str] = "{:g}".format) -> None:
    """Refuse two values of a list option that the report shows alike (``label``, 6 significant digits by default):
    their results are keyed by that label, so one run would be computed and then overwritten by the other."""
    seen: dict[str, float] = {}
    for v in values:
        if label(v) in seen:
            raise ConfigError(f"{option} = {text!r}: {seen[label(v)]!r} and {v!r} are both {label(v)} in the report; "
                              "give distinct values")
        seen[label(v)] = v


def flag(dest: str) -> str:
    """The command-line spelling of an argparse ``dest`` (the safety tools' options are all long options)."""
    return "--" + dest.replace("_", "-")


def add_out_options(p: argparse.ArgumentParser, name: str) -> None:
    """``--out`` and ``--overwrite``; the default is spelled out (``%(prog)s`` would print the whole command)."""
    default = f"runs/safety-{name}"
    p.add_argument("--out", default=default,
                   help=f"output directory: report.html, results.json and figures (default {default})")
    p.add_argument("--overwrite", action="store_true",
                   help=f"replace a finished run in --out (one holding {RESULTS}); without it that --out is refused")


def check_common(args: argparse.Namespace) -> None:
    """Refuse nan/inf and values beyond float32's range in every float option, and ``--threads`` outside [1,
    ``runs.max_threads()``] (torch raises on 0 after work has begun; tens of thousands crashed the process)."""
    for dest, value in vars(args).items():
        if isinstance(value, float) and not math.isfinite(value):
            refuse(flag(dest), value, "a finite number")
        if isinstance(value, float) and value != 0 and not FLOAT32_TINY <= abs(value) <= FLOAT32_MAX:
            # the tools compute in float32, where such a value is inf or 0 (an --lm-lr 1e39 was an overflow
            # traceback from the optimizer, a --sim-lr 5e-324 an ODE that never ended)
            refuse(flag(dest), value, f"0 or a number of size {FLOAT32_TINY:.3g} to {FLOAT32_MAX:.3g} (float32)")
    threads = getattr(args, "threads", 1)
    if not 1 <= threads <= max_threads():
        refuse("--threads", threads, f"an integer in [1, {max_threads()}] (4 per core of this machine)")


def number_list(text: str, option: str, allowed: str, ok: Callable[[float], bool] = lambda v: True, *,
                count: int | None = None, allow_empty: bool = False) -> list[float]:
    """Comma-separated numbers, each finite and passing ``ok``; ``count``: exactly that many; ``allowed``: the
    words of the message (e.g. "comma-separated numbers > 0"). Empty pieces are skipped ("1,,2" is [1, 2])."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        refuse(option, text, allowed)
    if (not values and not allow_empty) or (count is not None and len(values) != count):
        refuse(option, text, allowed)
    if not all(math.isfinite(v) and ok(v) for v in values):
        refuse(option, text, allowed)
    return values


def prepare_out(args: argparse.Namespace, outputs: tuple[str, ...]) -> Path:
    """Create ``--out``, refusing one that holds a finished run (``results.json``) unless ``--overwrite``.

    Called after the options are checked and before any work, so a refused rerun changes nothing on disk. With
    ``--overwrite`` the old results.json, report.html and the tool's other ``outputs`` (its figures, probe's saved
    models) are set aside as hidden entries in ``--out``, so the folder visibly holds no finished run while the new
    one runs; ``settle_out`` deletes them once the new results.json is written (a figure or model the new run does
    not make is not left behind as if it were its own) and puts them back when the command ends before that (a
    refusal, a failure, Ctrl-C, SIGTERM; after a kill, the next command on that ``--out``). Anything else in
    ``--out`` (a user's own figure or notes) is left alone.
    """
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        refuse("--out", str(out), "a directory (this path is a file)")
    settle_out(out)
    if (out / "config.json").exists():  # no tool writes one: results and figures went into a run or a model folder
        refuse("--out", str(out), "a folder of this tool's results; it holds config.json (a polyrl run or a Hugging "
               "Face model directory, whose files the report would overwrite)")
    if (out / RESULTS).exists():
        if not getattr(args, "overwrite", False):
            raise ConfigError(f"--out = '{out}' already holds {RESULTS} from an earlier run; pass --overwrite to "
                              "replace it or choose another --out")
        for name in (RESULTS, REPORT, *outputs):  # results.json first: while it is there, the run counts as finished
            if (out / name).exists():
                (out / name).replace(_aside(out, name))
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        refuse("--out", str(out), f"a directory that can be created ({e.strerror})")
    return out


def _aside(out: Path, name: str) -> Path:
    return out / f".{name}.replaced"


def settle_out(out: Path) -> bool:
    """After a run in ``out`` (or a killed one): delete the finished run's files ``prepare_out`` set aside when a new
    results.json is there, else put them back. Returns whether something was put back."""
    aside = [(p.name[1:-len(".replaced")], p) for p in out.glob(".*.replaced")] if out.is_dir() else []
    if not aside:
        return False
    finished = (out / RESULTS).exists() and not (out / RESULTS).is_symlink()
    aside.sort(key=lambda entry: entry[0] == RESULTS)  # results.json back last: while hidden, no run counts as finished
    for name, path in aside:
        if finished:
            remove_path(path)
        else:
            remove_path(out / name)  # what the stopped run wrote there (a folder holding files cannot be replaced)
            path.replace(out / name)
    return not finished


def settings(args: argparse.Namespace, drop: tuple[str, ...] = ()) -> dict:
    """The run's settings for results.json: the options, without the command function and ``--overwrite`` (how
    this command was run is not a setting of the run) and without ``drop``."""
    return {k: v for k, v in vars(args).items() if k not in ("fn", "overwrite", *drop)}
