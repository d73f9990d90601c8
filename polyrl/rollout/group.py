"""Uniform groups as a rollout source: G completions per prompt, with dynamic-sampling refill and prefetch.

``GroupSource`` draws the step's prompts, samples a group for each with its runner (in this process, or
on Ray rollout workers) and scores, shapes, filters and refills them with ``collect``. With a ``Prefetch``
(``--async-staleness k``) the workers generate the batches of the next k steps while this one trains; each
sample carries its policy version, so ``async/staleness_max`` never exceeds k.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from torch import Tensor

from polyrl.objectives import Method
from polyrl.rollout.collect import RolloutBatch, collect
from polyrl.rollout.generator import Sample, SamplingParams
from polyrl.rollout.source import PromptStream, Runner
from polyrl.tasks.base import Prompt
from polyrl.tasks.rewards import RewardChannels


class GroupSource:
    """Groups of ``sampling(step).n`` completions for ``num_groups`` prompts per step (see the module docstring)."""

    def __init__(self, runner: Runner, rewards: RewardChannels, *, num_groups: int,
                 sampling: Callable[[int], SamplingParams], max_rounds: int, steps: int, prefetch=None) -> None:
        """``prefetch`` (a ``rollout.remote.Prefetch`` over the same runner's workers) generates ahead."""
        self.runner, self.rewards, self.num_groups, self.sampling = runner, rewards, num_groups, sampling
        self.max_rounds, self.steps, self.prefetch = max_rounds, steps, prefetch
        self.history: dict[int, float] = {}  # pool index -> best pass rate (no-positive-resampling)

    def collect(self, method: Method, stream: PromptStream, step: int) -> RolloutBatch:
        sample = self.runner.sample if self.prefetch is None else self._prefetched(step)
        batch = collect(sample, self.rewards, method, stream.take, num_groups=self.num_groups,
                        params=self.sampling(step), history=self.history, max_rounds=self.max_rounds)
        if self.prefetch is not None:  # generate the next k batches while this one trains
            for ahead in range(1, self.prefetch.staleness + 1):
                if step + ahead < self.steps and step + ahead not in self.prefetch.pending():
                    nxt = stream.peek((ahead - 1) * self.num_groups, self.num_groups)
                    self.prefetch.submit(step + ahead, [p for _, p in nxt], self.sampling(step + ahead), version=step)
            staleness = [step - s.policy_version for s in batch.samples]
            batch.stats["async/staleness_max"], batch.stats["async/staleness_mean"] = (max(staleness),
                                                                                        float(np.mean(staleness)))
        batch.stats.update(self.runner.take_stats())
        return batch

    def _prefetched(self, step: int) -> Callable[[list[Prompt], SamplingParams, int], list[Sample]]:
        """A sample function for ``collect``: the batch prefetched for ``step`` when it matches, else sampled now.

        The first step, a dynamic-sampling refill round, or a stream that moved (a refill drew extra prompts)
        sample with the current weights (version ``step``, staleness 0).
        """
        def sample(prompts: list[Prompt], params: SamplingParams, key_offset: int) -> list[Sample]:
            first = key_offset == 0 and step in self.prefetch.pending()  # a refill round is never prefetched
            got = self.prefetch.result(step, prompts, params) if first else None
            if got is None:
                got = self.runner.sample(prompts, params, key_offset)
                for s in got:
                    s.policy_version = step
            return got

        return sample

    def after_update(self, weights: Callable[[], dict[str, Tensor]], version: int) -> None:
        self.runner.after_update(weights, version)

    def state_dict(self) -> dict[str, Any]:
        """Pass-rate histories, and the prefetched batches in flight (waited for, so a resume trains on them)."""
        state: dict[str, Any] = {"history": dict(self.history)}
        if self.prefetch is not None:
            state["prefetch"] = self.prefetch.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = dict(state.get("history") or {})
        if self.prefetch is not None:
            self.prefetch.load_state_dict(state.get("prefetch") or {})

    def close(self) -> None:
        if self.prefetch is not None:
            self.prefetch.close()
        self.runner.close()
