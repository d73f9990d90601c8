"""The collapse guard of `polyrl train --guard`: watch the collapse rule online, roll back on a collapse.

The monitor sees every logged row, as the offline analysis (``polyrl.lab.collapse.first_collapse``)
does, so a run is judged the same way during training and in the lab's report.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from polyrl.checkpoint import latest_checkpoint, load_checkpoint
from polyrl.config import TrainConfig
from polyrl.errors import TrainingError
from polyrl.lab.collapse import CollapseMonitor, CollapseRule
from polyrl.learner import LocalLearner

if TYPE_CHECKING:
    from polyrl.trainer import TrainState


def make_monitor(history: list[dict[str, float]], up_to: int) -> CollapseMonitor:
    """A collapse monitor that has seen every logged row up to ``up_to``, as the offline analysis does."""
    monitor = CollapseMonitor(CollapseRule())
    for row in history:
        if row["step"] <= up_to:
            monitor.update(row["step"], row)
    return monitor


def roll_back(run: Path, state: TrainState, learner: LocalLearner, extra: dict, critic_opt, cfg: TrainConfig,
              reason: str, console: Console) -> TrainState:
    """Restore the newest checkpoint (saved while the run was healthy) and scale the learning rate down."""
    ck = latest_checkpoint(run)
    if ck is None or state.rollbacks >= cfg.guard_max_rollbacks:
        raise TrainingError(f"collapse at step {state.step} ({reason}) and "
                            + ("no checkpoint to roll back to" if ck is None else
                               f"already {state.rollbacks} rollbacks (guard_max_rollbacks)"))
    saved = load_checkpoint(ck, **learner.state(), extra_models=extra)
    critic_opt_state = saved.pop("critic_optimizer", None)
    if critic_opt is not None and critic_opt_state is not None:
        critic_opt.load_state_dict(critic_opt_state)
    restored = type(state)(**saved)
    restored.rollbacks = state.rollbacks + 1
    restored.skipped_total, restored.empty_steps = state.skipped_total, state.empty_steps
    learner.set_base_lr(cfg.lr * cfg.guard_lr_factor ** restored.rollbacks)
    console.print(f"[yellow]guard[/]: collapse at step {state.step} ({reason}); rolled back to step "
                  f"{restored.step}, lr x{cfg.guard_lr_factor ** restored.rollbacks:g} (rollback {restored.rollbacks})")
    return restored
