"""Reward functions given by import path (plain callables, as in TRL) and weighted reward channels.

A reward function is any callable ``fn(prompts: list[str], completions: list[str], **kwargs) ->
list[float]`` named as ``package.module:function`` or ``path/to/file.py:function``; ``kwargs``
carries ``answers`` (the reference answers). The special name ``task`` is the task's own checker.
``WithRewardChannels`` wraps a task so that its reward is the weighted sum of the channels while
every channel's value is kept (``info["channels"]``) for estimators that normalise channels
separately (GDPO).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from polyrl.plugins import import_module_or_file
from polyrl.tasks.base import Prompt, Split, Task

RewardFn = Callable[..., list[float]]


def load_callable(spec: str) -> RewardFn:
    """Import ``module:function`` or ``file.py:function``; a clear ValueError names what is missing."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward function {spec!r}: write it as package.module:function or path/file.py:function")
    try:
        module = import_module_or_file(module_name)
    except ImportError as e:
        raise ValueError(f"reward function {spec!r}: cannot import {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward function {spec!r}: {module_name!r} has no callable {attr!r}")
    return fn


class WithRewardChannels:
    """A task whose reward is sum_c w_c * r_c over reward channels; the channels are reported separately."""

    def __init__(self, task: Task, specs: Sequence[str], weights: Sequence[float] | None = None) -> None:
        if not specs:
            raise ValueError("reward_funcs: give at least one reward function (or 'task')")
        weights = list(weights) if weights is not None else [1.0] * len(specs)
        if len(weights) != len(specs):
            raise ValueError(f"reward_weights has {len(weights)} values for {len(specs)} reward functions")
        self.task, self.name = task, task.name
        self.specs, self.weights = list(specs), [float(w) for w in weights]
        self._fns = [None if s == "task" else load_callable(s) for s in specs]

    def prompts(self, split: Split, n: int, seed: int) -> list[Prompt]:
        return self.task.prompts(split, n, seed)

    def reward(self, prompt: Prompt, completion_text: str) -> tuple[float, dict[str, Any]]:
        channels = []
        for spec, fn in zip(self.specs, self._fns):
            if fn is None:
                channels.append(float(self.task.reward(prompt, completion_text)[0]))
                continue
            out = fn(prompts=[prompt.text], completions=[completion_text], answers=[prompt.answer])
            if not isinstance(out, (list, tuple)) or len(out) != 1:
                raise ValueError(f"reward function {spec!r} must return a list with one float per completion")
            channels.append(float(out[0]))
        total = sum(w * c for w, c in zip(self.weights, channels))
        return total, {"channels": channels}
