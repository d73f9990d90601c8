"""Uniform groups as a rollout source: G completions per prompt, with dynamic-sampling refill and prefetch.

``GroupSource`` draws the step's prompts, samples a group for each and scores, shapes, filters and
refills them with ``collect``. With a prefetching pipeline (``AsyncPipeline``, ``--async-staleness k``)
the batches of the next k steps are generated in another process while this one trains; weights are
pushed after every optimizer step and each sample carries its policy version, so
``async/staleness_max`` never exceeds k.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from torch import Tensor

from polyrl.objectives import Method
from polyrl.rollout.collect import RolloutBatch, collect
from polyrl.rollout.episodes import EpisodeRunner
from polyrl.rollout.generator import SamplingParams
from polyrl.rollout.pipeline import AsyncPipeline, prefetched
from polyrl.rollout.source import PromptStream
from polyrl.tasks.rewards import RewardChannels


class GroupSource:
    """Groups of ``sampling(step).n`` completions for ``num_groups`` prompts per step (see the module docstring)."""

    def __init__(self, runner: EpisodeRunner, rewards: RewardChannels, *, num_groups: int,
                 sampling: Callable[[int], SamplingParams], max_rounds: int, steps: int,
                 start_prefetch: Callable[[int], AsyncPipeline] | None = None) -> None:
        """``start_prefetch(version)`` starts the generation process with the current weights (of that policy
        version) at the first step, so that a resumed run prefetches with the weights it resumed with."""
        self.runner, self.rewards, self.num_groups, self.sampling = runner, rewards, num_groups, sampling
        self.max_rounds, self.steps, self.start_prefetch = max_rounds, steps, start_prefetch
        self.prefetch: AsyncPipeline | None = None
        self.history: dict[int, float] = {}  # pool index -> best pass rate (no-positive-resampling)

    def collect(self, method: Method, stream: PromptStream, step: int) -> RolloutBatch:
        if self.start_prefetch is not None and self.prefetch is None:
            self.prefetch = self.start_prefetch(step)
        sample = self.runner.sample if self.prefetch is None else prefetched(self.prefetch, self.runner, step)
        batch = collect(sample, self.rewards, method, stream.take, num_groups=self.num_groups,
                        params=self.sampling(step), history=self.history, max_rounds=self.max_rounds)
        if self.prefetch is not None:  # generate the next k batches while this one trains
            for ahead in range(1, self.prefetch.staleness + 1):
                if step + ahead < self.steps and step + ahead not in self.prefetch.pending():
                    nxt = stream.peek((ahead - 1) * self.num_groups, self.num_groups)
                    self.prefetch.submit(step + ahead, [p for _, p in nxt], self.sampling(step + ahead))
            staleness = [step - s.policy_version for s in batch.samples]
            batch.stats["async/staleness_max"], batch.stats["async/staleness_mean"] = (max(staleness),
                                                                                        float(np.mean(staleness)))
        return batch

    def after_update(self, weights: Callable[[], dict[str, Tensor]], version: int) -> None:
        if self.prefetch is not None:  # the generation process samples with these from now on
            self.prefetch.push(weights(), version)

    def state_dict(self) -> dict[str, Any]:
        return {"history": dict(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = dict(state.get("history") or {})

    def close(self) -> None:
        if self.prefetch is not None:
            self.prefetch.close()
