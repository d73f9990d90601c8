"""Training rewards: the task's checker and reward functions given by import path, called once per batch.

A reward function is any callable ``fn(prompts: list[str], completions: list[str], **kwargs) ->
list[float]`` named as ``package.module:function`` or ``path/to/file.py:function``. It is called once
per batch, as in TRL (``prompts[i]`` is the prompt of ``completions[i]``, so a prompt appears once per
completion of its group); ``kwargs`` carries ``answers`` (the reference answers, one per completion).
The special name ``task`` is the task's own checker. ``RewardChannels`` sums the channels with their
weights and keeps every channel's value for estimators that normalise channels separately (GDPO).

A reward that is not a finite number, a list of the wrong length, or an exception (or ``sys.exit``) inside a
reward function raises ``RewardError``: one line naming the function and the completion and prompt, with
the function's traceback kept for the run's log. Held-out accuracy never uses these channels: it is
the task's own ``reward`` (its verifier).
"""

from __future__ import annotations

import inspect
import math
import numbers
import traceback
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass

from polyrl.errors import RewardError, Terminated
from polyrl.plugins import import_module_or_file
from polyrl.tasks.base import Prompt, Task

# Rewards become float32 tensors, and a batch's statistics square them (a group's or the batch's std): 1e15^2 times
# the 10^6 rollouts a step may hold stays within float32 (3.4e38). At 1e30 GRPO's std overflowed and every
# advantage became 0, so the run trained on nothing; at 1e300 the reward itself was inf.
REWARD_LIMIT = 1e15

RewardFn = Callable[..., list[float]]


def load_callable(spec: str) -> RewardFn:
    """Import ``module:function`` or ``file.py:function``; a clear ValueError names what is missing."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward function {spec!r}: write it as package.module:function or path/file.py:function")
    try:
        module = import_module_or_file(module_name)
    except Terminated:
        raise
    except (Exception, SystemExit) as e:  # a missing module, a syntax error, a module that raises or exits as it loads
        raise ValueError(f"reward function {spec!r}: cannot import {module_name!r} ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward function {spec!r}: {module_name!r} has no callable {attr!r}")
    if inspect.iscoroutinefunction(fn):
        raise ValueError(f"reward function {spec!r} is async; it must return its rewards (a plain def)")
    try:  # found now, not after the model loaded and the first evaluation ran
        inspect.signature(fn).bind(prompts=[], completions=[], answers=[])
    except TypeError as e:
        raise ValueError(f"reward function {spec!r} cannot be called as fn(prompts=..., completions=..., "
                         f"answers=...) ({e}); give it those keywords (or **kwargs)") from None
    except ValueError:  # a builtin without an inspectable signature: it is called as it is
        pass
    return fn


def parse_reward_specs(funcs: str | None, weights: str | None) -> tuple[list[str], list[float] | None]:
    """``--reward-funcs a,b`` and ``--reward-weights 1,0.2`` -> specs (default: the task's checker) and weights."""
    if funcs is not None and not funcs.strip():
        raise ValueError(f"reward_funcs = {funcs!r} names no reward function; give task, module:function or "
                         "file.py:function")
    if weights is not None and not weights.strip():
        raise ValueError(f"reward_weights = {weights!r} gives no weights; give one number per reward function")
    specs = [s.strip() for s in funcs.split(",")] if funcs else ["task"]
    try:
        values = [float(w) for w in weights.split(",")] if weights else None
    except ValueError:
        raise ValueError(f"reward_weights = {weights!r} must be comma-separated numbers") from None
    if values is not None and not all(math.isfinite(v) for v in values):
        raise ValueError(f"reward_weights = {weights!r} must be finite numbers")
    if values is not None and not any(values):  # every reward 0: every advantage 0, and the run trains nothing
        raise ValueError(f"reward_weights = {weights!r} must not all be 0 (every reward would be 0)")
    return specs, values


@dataclass
class Rewards:
    """Weighted totals of one batch and, when there are several channels, each channel's values."""

    total: list[float]  # [B]
    channels: list[list[float]] | None  # [B][C], None with the task's checker alone


class RewardChannels:
    """The training reward sum_c w_c * r_c over reward channels (default: the task's checker alone)."""

    def __init__(self, task: Task, specs: Sequence[str] = ("task",), weights: Sequence[float] | None = None) -> None:
        if not specs:
            raise ValueError("reward_funcs: give at least one reward function (or 'task')")
        weights = list(weights) if weights is not None else [1.0] * len(specs)
        if len(weights) != len(specs):
            raise ValueError(f"reward_weights has {len(weights)} values for {len(specs)} reward functions")
        self.task, self.specs, self.weights = task, list(specs), [float(w) for w in weights]
        self._fns = [None if s == "task" else load_callable(s) for s in self.specs]

    def __call__(self, prompts: Sequence[Prompt], completions: Sequence[str],
                 prompt_index: Sequence[int] | None = None) -> Rewards:
        """Score a batch; ``prompts[i]`` is the prompt of ``completions[i]`` (``prompt_index[i]`` its place in
        the step's prompts, for error messages)."""
        where = list(prompt_index) if prompt_index is not None else [None] * len(completions)
        columns = [self._channel(spec, fn, prompts, completions, where) for spec, fn in zip(self.specs, self._fns)]
        total = [sum(w * col[i] for w, col in zip(self.weights, columns)) for i in range(len(completions))]
        for i, t in enumerate(total):
            if not abs(t) <= REWARD_LIMIT:  # weights times rewards: the same limit
                raise RewardError(",".join(self.specs), f"weighted by reward_weights = {self.weights} give {t:g}, "
                                  f"beyond +-{REWARD_LIMIT:g}, where a batch's float32 statistics overflow (scale "
                                  "them down)", completion=i, prompt_index=where[i])
        channels = [list(row) for row in zip(*columns)] if len(columns) > 1 else None
        return Rewards(total=total, channels=channels)

    def _channel(self, spec: str, fn: RewardFn | None, prompts: Sequence[Prompt], completions: Sequence[str],
                 where: list[int | None]) -> list[float]:
        def error(problem: str, i: int | None = None, trace: str | None = None) -> RewardError:
            return RewardError(spec, problem, completion=i, prompt_index=None if i is None else where[i],
                               traceback=trace)

        try:
            if fn is None:
                out = [self.task.reward(p, c)[0] for p, c in zip(prompts, completions)]
            else:
                out = fn(prompts=[p.text for p in prompts], completions=list(completions),
                         answers=[p.answer for p in prompts])
        except Terminated:  # SIGTERM while it ran: not the function's exit
            raise
        except (Exception, SystemExit) as e:  # a user's function failed: one line here, its traceback in the run's log
            first = (str(e).strip().splitlines() or [""])[0]  # one line; the whole message is in the traceback
            problem = f"called sys.exit({e.code!r})" if isinstance(e, SystemExit) else \
                f"raised {type(e).__name__}: {first}"
            raise error(problem, trace=traceback.format_exc()) from None
        if isinstance(out, (Mapping, Set, str, bytes)):  # iterable, but not one value per completion in order
            raise error(f"returned {type(out).__name__}, not a list of floats")
        try:
            values = list(out)
        except TypeError:
            raise error(f"returned {type(out).__name__}, not a list of floats") from None
        if len(values) != len(completions):
            raise error(f"returned {len(values)} values for {len(completions)} completions (one float each)")
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise error(f"returned {type(v).__name__} {v!r}, not a float", i)
            try:
                value = float(v)
            except OverflowError:  # an int (or Fraction) beyond float's range; str() of one may be refused
                digits = int(int(v).bit_length() * math.log10(2)) + 1
                raise error(f"returned {type(v).__name__} of about {digits} digits, beyond +-{REWARD_LIMIT:g}, where "
                            "a batch's float32 statistics overflow (scale the rewards down)", i) from None
            if not math.isfinite(value):
                raise error(f"returned {value}, not a finite float", i)
            if abs(value) > REWARD_LIMIT:
                raise error(f"returned {value:g}, beyond +-{REWARD_LIMIT:g}, where a batch's float32 statistics "
                            "overflow (scale the rewards down)", i)
        return [float(v) for v in values]
