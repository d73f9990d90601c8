"""A run directory's record: the settings it started with, what a resume changed, and logs cut back to a checkpoint.

``config.json`` is written once, when a run starts, and never overwritten: it is the record of the
run's own settings. ``polyrl train --run-dir X --resume`` continues with exactly those; a flag given
with ``--resume`` that differs from the saved value is refused with one line naming both values,
except the few in ``RESUME_MAY_CHANGE`` (extending a run, logging cadence, threads, where it runs), whose changes are
appended to ``config_history.jsonl`` with the step they took effect at. After a kill, the logs hold
steps that the checkpoint does not: ``cut_logs`` drops them, so no step appears twice.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from polyrl.config import ConfigError

CONFIG = "config.json"
HISTORY = "config_history.jsonl"
LOGS = ("metrics.jsonl", "samples.jsonl")  # JSON lines with a "step" key

# Settings a resume may change: they extend the run, change how it is watched or where it runs (processes, rollout
# workers: batches and gradients do not depend on them), not what it computes.
RESUME_MAY_CHANGE = ("steps", "eval_every", "checkpoint_every", "log_every", "threads", "tensorboard", "wandb",
                     "max_bad_steps", "nproc", "rollout_workers", "ray_address", "ray_cpus", "rollout_worker_gpus")
# Run control, not settings: never compared.
RUN_CONTROL = ("resume", "resume_from", "overwrite", "run_dir")


def saved_record(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's ``config.json`` ({"config", "method", "overrides"}), or None when it has none."""
    path = Path(run_dir) / CONFIG
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError(f"run_dir = {str(run_dir)!r}: {CONFIG} is not valid JSON ({e}); the run's settings are "
                          "unknown, so it cannot be resumed") from None


def write_record(run_dir: str | Path, record: dict[str, Any]) -> None:
    """Write ``config.json`` for a new run; an existing one is the record of another run and is kept."""
    path = Path(run_dir) / CONFIG
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str))


def start_run_dir(run_dir: str | Path, *, overwrite: bool) -> Path:
    """A directory for a new run: one that already holds a run is refused unless ``overwrite`` (then cleared)."""
    import shutil

    run = Path(run_dir)
    if (run / "metrics.jsonl").exists() or (run / "summary.json").exists() or (run / CONFIG).exists():
        if not overwrite:
            raise ConfigError(f"run_dir = '{run}' already holds a run; pass --overwrite or another --run-dir")
        shutil.rmtree(run)
    run.mkdir(parents=True, exist_ok=True)
    return run


def resume_values(saved: dict[str, Any], given: dict[str, Any], *, what: str = "") -> tuple[dict, dict]:
    """Merge settings ``given`` with ``--resume`` into the run's ``saved`` ones.

    Returns (values, changes): the saved values with the allowed changes applied, and {name: [old, new]}.
    A differing value outside ``RESUME_MAY_CHANGE`` raises ConfigError naming both values.
    """
    # How to run this command (resume, overwrite, run_dir) is never the run's: the record's values are dropped.
    values = {k: v for k, v in saved.items() if k not in RUN_CONTROL}
    values.update({k: v for k, v in given.items() if k in RUN_CONTROL})
    changes = {}
    for name, new in given.items():
        if name in RUN_CONTROL or new is None:
            continue
        old = saved.get(name)
        if _same(old, new):
            continue
        if name not in RESUME_MAY_CHANGE:
            raise ConfigError(f"{name} = {new!r} differs from the run's own {name} = {old!r}{what}; a resume keeps "
                              f"the run's settings (may change: {', '.join(RESUME_MAY_CHANGE)}); drop the flag, or "
                              "start a new run with another --run-dir")
        values[name], changes[name] = new, [old, new]
    return values, changes


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def record_resume(run_dir: str | Path, step: int, checkpoint: str, changes: dict[str, list]) -> None:
    """Append one line to ``config_history.jsonl``: when, from which checkpoint, what changed."""
    line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "resumed_at_step": step, "checkpoint": checkpoint,
            "changes": changes}
    with open(Path(run_dir) / HISTORY, "a") as f:
        f.write(json.dumps(line, default=str) + "\n")


def effective_config(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's settings as they stand now: ``config.json`` with every recorded resume change applied (what the
    next resume continues with, so that ``--steps`` extended once stays extended)."""
    record = saved_record(run_dir)
    if record is None:
        return None
    config = dict(record.get("config", {}))
    history = Path(run_dir) / HISTORY
    if history.is_file():
        for line in history.read_text().splitlines():
            for name, (_, new) in json.loads(line).get("changes", {}).items():
                config[name] = new
    return config


def cut_logs(run_dir: str | Path, step: int) -> int:
    """Drop the rows logged after ``step`` (steps redone after a resume); return how many were dropped.

    A line cut short by a kill is dropped too, and so is a final evaluation logged at ``step`` itself (a row of
    eval/* alone after the step's own row): the resumed run evaluates again when it ends. The file is rewritten
    through a temporary sibling.
    """
    dropped = 0
    for name in LOGS:
        path = Path(run_dir) / name
        if not path.is_file():
            continue
        kept = []
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                dropped += 1
                continue
            final_eval = row.get("step") == step and step > 0 and all(k == "step" or k.startswith("eval/") for k in row)
            if row.get("step", 0) <= step and not (final_eval and name == "metrics.jsonl"):
                kept.append(line)
            else:
                dropped += 1
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept))
        tmp.replace(path)
    return dropped


def read_rows(run_dir: str | Path) -> list[dict[str, float]]:
    """The rows of ``metrics.jsonl`` (empty when there is none)."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
