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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
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
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.console = console or Console()
        self.table_every = table_every
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a")
        self._rows: list[dict[str, Any]] = []
        self.history: list[dict[str, float]] = []
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tb"))
        self._wandb = None
        if wandb:
            os.environ.setdefault("WANDB_MODE", "offline")
            import wandb as wb  # optional dependency

            self._wandb = wb.init(dir=str(self.run_dir), config=dict(config or {}), mode="offline")

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        row = {"step": step}
        for k, v in metrics.items():
            f = _scalar(v)
            if f is not None:
                row[k] = f
        self.history.append(row)
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
        with open(self.run_dir / "samples.jsonl", "a") as f:
            for s in samples:
                f.write(json.dumps({"step": step, **s}) + "\n")

    def close(self) -> None:
        self.print_table()
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


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
