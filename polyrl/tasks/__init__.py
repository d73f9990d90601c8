"""Verifiable tasks: a ``Task`` gives deterministic prompt splits and a programmatic reward."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from polyrl.tasks.arithmetic import AdditionTask
from polyrl.tasks.base import Prompt, Split, Task
from polyrl.tasks.calculator import CalculatorTask
from polyrl.tasks.code import COLUMNS_HELP as CODE_COLUMNS_HELP
from polyrl.tasks.code import CodeTask
from polyrl.tasks.countdown import CountdownTask
from polyrl.tasks.math import COLUMNS_HELP, MathTask


def _math(data_file: str | None = None, heldout_percent: int = 10) -> Task:
    if data_file is None:
        raise ValueError(f"task 'math' needs --data-file (a local JSONL or Parquet file with {COLUMNS_HELP})")
    return MathTask(data_file, heldout_percent=heldout_percent)


def _code(data_file: str | None = None, heldout_percent: int = 10) -> Task:
    if data_file is None:
        raise ValueError(f"task 'code' needs --data-file (a local JSONL file with {CODE_COLUMNS_HELP})")
    return CodeTask(data_file, heldout_percent=heldout_percent)


# Task name -> factory; ``data_file`` is passed to every factory that takes it.
TASKS: dict[str, Callable[..., Task]] = {
    "addition": AdditionTask,
    "addition_mixed": lambda: AdditionTask(digits=(2, 3)),
    "countdown": CountdownTask,
    "calculator": CalculatorTask,
    "math": _math,
    "code": _code,
}


def get_task(name: str, data_file: str | None = None, heldout_percent: int = 10) -> Task:
    """Build the task registered as ``name``; an unknown name lists the known ones."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    factory = TASKS[name]
    reads_file = "data_file" in inspect.signature(factory).parameters
    if data_file is not None and not reads_file:
        raise ValueError(f"task {name!r} does not read a data file (data_file = {data_file!r})")
    return factory(data_file=data_file, heldout_percent=heldout_percent) if reads_file else factory()


__all__ = ["TASKS", "AdditionTask", "CalculatorTask", "CodeTask", "Prompt", "Split", "Task", "get_task"]
