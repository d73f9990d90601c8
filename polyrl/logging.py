"""Run logging with fixed metric names: console table, JSONL, TensorBoard, samples, summary and plot.

Metric namespaces: ``objective/*`` (loss internals), ``rollout/*`` (lengths, utilization),
``reward/*``, ``eval/*`` (held-out accuracy), ``perf/*`` (seconds, rollouts per second, memory).
Everything goes to ``run_dir/metrics.jsonl`` (one JSON object per step) and TensorBoard event files
in ``run_dir/tb``; W&B is used only when asked for, in offline mode.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

# Columns of the compact console table: (metric, header, format)
CONSOLE_COLUMNS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("eval/accuracy", "eval acc", "{:.3f}"),
    ("objective/kl", "kl", "{:.4f}"),
    ("objective/clip_frac", "clip", "{:.3f}"),
    ("objective/entropy", "entropy", "{:.3f}"),
    ("rollout/mean_len", "len", "{:.1f}"),
    ("perf/step_seconds", "s/step", "{:.2f}"),
)


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MiB (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def _scalar(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


class RunLogger:
    """Write metrics for one run; call ``log`` once per step and ``close`` at the end."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = True,
        wandb: bool = False,
        console: Console | None = None,
        table_every: int = 10,
        config: Mapping[str, Any] | None = None,
        history: list[dict[str, float]] | None = None,
        purge_step: int | None = None,
        enabled: bool = True,
    ):
        """``history``: rows already in ``metrics.jsonl`` (a resumed run); ``purge_step``: TensorBoard hides the
        events of this step and later that an earlier, killed attempt wrote (they are being redone).
        ``enabled=False`` (a training process other than rank 0): keep the history, write and print nothing."""
        self.enabled = enabled
        self.history: list[dict[str, float]] = list(history or [])
        if not enabled:
            return
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.console = console or Console()
        self.table_every = table_every
        # metrics.jsonl, tb/ and wandb/ are made by the first row: a run that fails before it wrote nothing but its
        # config.json, so an --overwrite it was replacing is put back (runs.run_started)
        self._jsonl: IO[str] | None = None
        self._tensorboard, self._purge_step = tensorboard, purge_step
        self._wandb_config = dict(config or {}) if wandb else None
        self._rows: list[dict[str, Any]] = []
        self._tb = None
        self._wandb = None

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        row = {"step": step}
        for k, v in metrics.items():
            f = _scalar(v)
            if f is not None:
                row[k] = f
        self.history.append(row)
        if not self.enabled:
            return
        if self._jsonl is None:
            self._open()
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k != "step":
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(row, step=step)
        self._rows.append(row)
        if self.table_every and len(self._rows) >= self.table_every:
            self.print_table()

    def _open(self) -> None:
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a")
        if self._tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=self._purge_step)
        if self._wandb_config is not None:
            os.environ.setdefault("WANDB_MODE", "offline")
            import wandb as wb  # optional dependency

            self._wandb = wb.init(dir=str(self.run_dir), config=self._wandb_config, mode="offline")

    def print_table(self) -> None:
        if not self._rows:
            return
        table = Table(show_edge=False, pad_edge=False)
        table.add_column("step", justify="right")
        cols = [c for c in CONSOLE_COLUMNS if any(c[0] in r for r in self._rows)]
        for _, header, _ in cols:
            table.add_column(header, justify="right")
        for r in self._rows:
            table.add_row(str(r["step"]), *[fmt.format(r[k]) if k in r else "" for k, _, fmt in cols])
        self.console.print(table)
        self._rows = []

    def samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Append example completions (prompt, completion, reward) to ``samples.jsonl``."""
        if not self.enabled:
            return
        with open(self.run_dir / "samples.jsonl", "a") as f:
            for s in samples:
                f.write(json.dumps({"step": step, **s}) + "\n")

    def rewind(self, step: int) -> None:
        """A rollback to ``step``: TensorBoard hides the events after it (written by the branch left, about to be
        redone) and samples.jsonl drops that branch's rows; metrics.jsonl keeps them, as the record of what ran (its
        readers skip a rolled-back branch: guard.live_rows, lab.analysis.read_rows)."""
        if not self.enabled:
            return
        if self._tb is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb.close()
            self._tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=step + 1)
        path = self.run_dir / "samples.jsonl"
        if path.exists():  # written whole, then swapped in: a kill meanwhile leaves the old file
            kept = [line for line in path.read_text().splitlines(keepends=True) if json.loads(line)["step"] <= step]
            (tmp := path.with_name(path.name + ".tmp")).write_text("".join(kept))
            tmp.replace(path)

    def close(self) -> None:
        if not self.enabled:
            return
        self.print_table()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


class StepProgress:
    """Progress of a loop of ``total`` steps: rich's live bar on a terminal, else a plain line every ``every_s``.

    Rich's live display writes nothing to a pipe, a log file or CI until it ends, so a long run that is not
    watched on a terminal would look dead; there it prints ``label k/N  info  elapsed`` lines instead.
    """

    def __init__(self, console: Console, label: str, total: int, completed: int = 0, every_s: float = 10.0):
        self.console, self.label, self.total, self.every_s = console, label, total, every_s
        self.done, self._started = completed, time.perf_counter()
        self._last = self._started
        self._bar = None
        if console.is_terminal:
            self._bar = Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.fields[info]}"), console=console)
            self._job = self._bar.add_task(label, total=total, completed=completed, info="")

    def __enter__(self) -> StepProgress:
        if self._bar is not None:
            self._bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def update(self, completed: int, info: str = "") -> None:
        self.done = completed
        if self._bar is not None:
            self._bar.update(self._job, completed=completed, info=info)
            return
        now = time.perf_counter()
        if now - self._last >= self.every_s or completed >= self.total:
            self._last = now
            self.console.print(f"{self.label} {completed}/{self.total}  {info}  {now - self._started:.0f} s",
                               highlight=False, soft_wrap=True)  # one line however long: a pipe's width is 80


def write_summary(run_dir: str | Path, summary: Mapping[str, Any]) -> Path:
    path = Path(run_dir) / "summary.json"
    path.write_text(json.dumps(dict(summary), indent=2, default=str))
    return path


def plot_curves(history: list[Mapping[str, float]], path: str | Path, keys=("reward/mean", "eval/accuracy")) -> Path:
    """PNG of the given metrics against steps (one panel each)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.5), squeeze=False)
    for ax, key in zip(axes[0], keys):
        pts = [(r["step"], r[key]) for r in history if key in r]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, lw=1.5)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
