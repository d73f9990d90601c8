"""What the benchmarks share: run `polyrl train` in a subprocess and read a run directory's metrics back.

Scripts run as ``.venv/bin/python benchmarks/NAME.py`` find this module next to them (``from _runs import ...``).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def train_command(run_dir: Path, flags: Iterable[str]) -> list[str]:
    """`polyrl train FLAGS` into ``run_dir`` (replaced if it exists), quiet: no TensorBoard, no console table."""
    return [sys.executable, "-m", "polyrl", "train", *flags, "--no-tensorboard", "--log-every", "0",
            "--overwrite", "--run-dir", str(run_dir)]


def run_train(run_dir: Path, flags: Iterable[str], log: Path | None = None) -> float:
    """Run `polyrl train` (see ``train_command``) and return the process's wall-clock seconds.

    The output goes to ``log`` (default: ``run_dir`` plus ``.log``, beside the run directory, which ``--overwrite``
    clears); a failed run raises SystemExit with the command and the last lines of that output.
    """
    cmd = train_command(run_dir, flags)
    log = log or run_dir.with_name(run_dir.name + ".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with log.open("w") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - t0
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise SystemExit(f"polyrl train failed (exit {rc}): {' '.join(cmd)}\n{tail}\n(full output: {log})")
    return seconds


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every row of ``run_dir/metrics.jsonl`` (RL steps, evaluations, guard events), in order."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]


def step_rows(rows: list[dict[str, Any]], skip: int = 0) -> list[dict[str, Any]]:
    """The rows of timed RL steps (those with ``perf/step_seconds``), the first ``skip`` left out."""
    return [r for r in rows if "perf/step_seconds" in r][skip:]


def median_of(rows: list[dict[str, Any]], key: str) -> float | None:
    """Median of ``key`` over the rows that have it; None when none does."""
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else None
