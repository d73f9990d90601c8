"""The tree sampler as a rollout source: the step's budget of groups x G completions spent as a tree."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from polyrl.objectives import Method
from polyrl.rollout.collect import RolloutBatch
from polyrl.rollout.generator import SamplingParams
from polyrl.rollout.source import PromptStream
from polyrl.rollout.tree.sampler import TreeSampler
from polyrl.tasks.rewards import RewardChannels


class TreeSource:
    """``TreeSampler`` behind the ``RolloutSource`` protocol; its state is the pass-rate history it predicts from."""

    def __init__(self, sampler: TreeSampler, rewards: RewardChannels, *, num_groups: int,
                 sampling: Callable[[int], SamplingParams]) -> None:
        self.sampler, self.rewards, self.num_groups, self.sampling = sampler, rewards, num_groups, sampling
        self.history: dict[int, float] = {}  # pool index -> best pass rate

    def collect(self, method: Method, stream: PromptStream, step: int) -> RolloutBatch:
        batch = self.sampler.collect(self.rewards, method, stream.take, num_groups=self.num_groups,
                                     params=self.sampling(step), history=self.history, step=step)
        batch.stats.update(self.sampler.runner.take_stats())
        return batch

    def after_update(self, weights: Callable[[], dict[str, Tensor]], version: int) -> None:
        self.sampler.runner.after_update(weights, version)

    def state_dict(self) -> dict[str, Any]:
        counts = self.sampler.predictor.counts
        return {"history": dict(self.history), "pass_counts": {k: list(v) for k, v in counts.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = dict(state.get("history") or {})
        self.sampler.predictor.counts.clear()  # the predictor reads this mapping: update it in place
        self.sampler.predictor.counts.update(state.get("pass_counts") or {})

    def close(self) -> None:
        self.sampler.runner.close()
