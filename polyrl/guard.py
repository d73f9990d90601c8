"""The collapse guard of `polyrl train --guard`: watch the collapse rule online, roll back on a collapse.

The monitor sees every logged row, as the offline analysis (``polyrl.collapse.first_collapse``)
does, so a run is judged the same way during training and in the lab's report.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from rich.console import Console

from polyrl.collapse import CollapseMonitor, CollapseRule
from polyrl.errors import TrainingError

if TYPE_CHECKING:
    from polyrl.learner.local import Learner
    from polyrl.trainer import TrainState


@dataclass
class GuardConfig:
    """The collapse guard's settings: flags ``--guard*``, the TOML table ``[guard]``, ``TrainConfig.guard``."""

    PREFIX: ClassVar[str] = "guard"

    enabled: bool = field(default=False, metadata={"flag": "guard"})
    """collapse guard: on a detected collapse roll back to the last good checkpoint and lower the lr"""
    lr_factor: float = 0.5
    """the guard multiplies the learning rate by this on every rollback"""
    max_rollbacks: int = 3
    """the guard stops the run after this many rollbacks"""


def live_rows(history: list[dict[str, float]]) -> list[dict[str, float]]:
    """The rows of the branch that survived, as the offline analysis reads them: a rollback to step r (its row of
    guard/* alone) discards the rows after r logged before it, the branch it left."""
    live: list[dict[str, float]] = []
    for row in history:
        if all(k == "step" or k.startswith("guard/") for k in row):
            live = [r for r in live if r["step"] <= row["step"]]
        else:
            live.append(row)
    return live


def make_monitor(history: list[dict[str, float]], up_to: int) -> CollapseMonitor:
    """A collapse monitor that has seen every row of the live history up to ``up_to`` (``live_rows``): replaying the
    branch a rollback left would latch the monitor, and no later collapse would be caught."""
    monitor = CollapseMonitor(CollapseRule())
    for row in live_rows(history):
        if row["step"] <= up_to:
            monitor.update(row["step"], row)
    return monitor


def roll_back(run: Path, state: TrainState, restore: Callable[[Path], TrainState], learner: Learner, *,
              history: list[dict[str, float]], base_lr: float, factor: float, max_rollbacks: int, reason: str,
              console: Console) -> TrainState:
    """Restore the newest checkpoint the run was judged healthy at and scale the learning rate down.

    Judged healthy: saved at or before the last evaluation before the collapse (``history``'s live rows), which the
    monitor passed; a newer checkpoint was never evaluated (rolling back to it again and again could not escape a
    collapse it already held). A run that has not evaluated since step 0, or kept no checkpoint that old: the newest
    (every row it logged was judged on entropy and KL). ``restore(path)`` loads a checkpoint into the learner
    and the rollout source and returns the loop's state; the learning rate becomes ``base_lr * factor **
    rollbacks``; more than ``max_rollbacks`` stop the run.
    """
    from polyrl.checkpoint import checkpoint_step, list_checkpoints  # torch: only when a rollback happens

    passed = max((r["step"] for r in live_rows(history) if "eval/accuracy" in r and 0 < r["step"] < state.step),
                 default=None)  # the last evaluation before the collapse
    saved = [p for p in list_checkpoints(run) if (p / "meta.json").exists() and checkpoint_step(p) <= state.step]
    healthy = [p for p in saved if passed is not None and checkpoint_step(p) <= passed]
    ck = (healthy or saved or [None])[-1]  # never forward, onto a branch left before
    if ck is None or state.rollbacks >= max_rollbacks:
        raise TrainingError(f"collapse at step {state.step} ({reason}) and "
                            + ("no checkpoint to roll back to" if ck is None else
                               f"already {state.rollbacks} rollbacks (guard_max_rollbacks)"))
    restored = restore(ck)
    restored.rollbacks = state.rollbacks + 1
    restored.skipped_total, restored.empty_steps = state.skipped_total, state.empty_steps
    learner.set_base_lr(base_lr * factor ** restored.rollbacks)
    console.print(f"[yellow]guard[/]: collapse at step {state.step} ({reason}); rolled back to step "
                  f"{restored.step}, lr x{factor ** restored.rollbacks:g} (rollback {restored.rollbacks})")
    return restored
