"""When a family's report may reuse a finished run (`polyrl duplex report`, `polyrl marl report`).

A report trains METHOD/seedK under its ``--out`` and, on a rerun, reads back the runs that finished. A finished
run is reused only when its saved settings are the ones asked for now: otherwise the report would print settings
its runs were not trained with. ``check_reuse`` refuses such a run before anything trains (``--overwrite``
retrains it instead); ``check_report_options`` refuses the report options no family's report runs with.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

# Settings that change how a run is watched or where it runs, not its results: a finished run is reused across them.
NOT_RESULTS = ("threads", "tensorboard", "checkpoint_every")


def finished(run_dir: Path) -> dict[str, Any] | None:
    """The run's summary when it finished (None when it did not); a damaged one is a one-line ConfigError."""
    from polyrl.errors import ConfigError
    from polyrl.runs import read_json

    path = run_dir / "summary.json"
    if not path.is_file():
        return None
    summary = read_json(path, "", "its run's settings are unknown; pass --overwrite to retrain it, or another --out")
    if not isinstance(summary, dict):
        raise ConfigError(f"{path} is not a run summary (a {type(summary).__name__}); pass --overwrite to retrain it")
    return summary


def stale_setting(summary: dict[str, Any], cfg) -> str | None:
    """The first setting (besides ``NOT_RESULTS``) whose saved value differs from ``cfg``'s (a dataclass), as
    'name = saved, not asked'; None when the finished run is what ``cfg`` asks for (its results may be reused)."""
    saved = summary.get("config")
    if not isinstance(saved, dict):
        return "config = unknown (its summary.json records no settings)"
    for name, value in asdict(cfg).items():
        if name not in NOT_RESULTS and saved.get(name) != value:
            return f"{name} = {saved.get(name)!r}, not {value!r}"
    return None


def check_report_options(out: str, seeds: int, ci: float, given: dict[str, Any]) -> None:
    """Refuse (ConfigError, one line) what no family report can run with, before its first run trains: an --out that
    cannot be made, a seed count outside [1, MAX_SEEDS], a level outside (0, 1), a --seed (it trains seeds 0..N-1)."""
    from polyrl.errors import ConfigError
    from polyrl.runs import MAX_SEEDS, check_out_dir

    check_out_dir(out)
    if not 1 <= seeds <= MAX_SEEDS:  # 10^8 checked its seed directories silently for minutes
        raise ConfigError(f"seeds = {seeds} is not allowed; allowed: an integer in [1, {MAX_SEEDS}] (each seed is a "
                          "training run)")
    if not 0 < ci < 1:
        raise ConfigError(f"ci = {ci} is not allowed; allowed: in (0, 1)")
    if "seed" in given:
        raise ConfigError(f"seed = {given['seed']!r} is not allowed in a report: it trains seeds 0..N-1; set their "
                          "number with --seeds")


def check_reuse(cfg, *, seeds: int, out: Path, methods: list[str], overwrite: bool,
                given: Collection[str] = ()) -> None:
    """Before any training: refuse (ConfigError, one line) a finished run in ``out`` trained with other settings than
    ``cfg`` (seed replaced), unless ``overwrite`` (then the report retrains it); and a ``NOT_RESULTS`` setting
    ``given`` (flag or TOML) when every run is finished and reused, so that nothing trains and it changes nothing."""
    from polyrl.errors import ConfigError

    if overwrite:
        return
    reused = 0
    for m in methods:
        for seed in range(seeds):
            s = finished(out / m / f"seed{seed}")
            why = s is not None and stale_setting(s, replace(cfg, seed=seed))
            if why:
                raise ConfigError(f"{m}/seed{seed} in '{out}' was trained with {why}; pass --overwrite to retrain "
                                  "such runs, or another --out")
            reused += s is not None
    idle = [name for name in NOT_RESULTS if name in given]
    if idle and reused == len(methods) * seeds:
        raise ConfigError(f"{idle[0]} = {getattr(cfg, idle[0])!r} changes nothing here: every run in '{out}' is "
                          "finished and is reused, so none trains; drop it, or pass --overwrite to train them again")
