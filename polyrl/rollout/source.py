"""Where a training step's rollouts come from: the ``RolloutSource`` protocol and the prompt stream.

A source turns prompts into a scored ``RolloutBatch`` for a method at a step, and hears about every
optimizer step (new weights and their policy version) so that a source that samples elsewhere (a
generation process, Ray workers, vLLM) can refresh its copy. Whatever it remembers between steps
(pass-rate histories, pending prefetches) is its own state, saved and restored with the checkpoint.
The training loop calls these methods and never asks which source it has: uniform groups with
dynamic-sampling refill and optional asynchronous prefetch (``rollout.group``), tree rollouts
(``rollout.tree``), agency transfer around either (``rollout.agency``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:  # annotations only: this module (and its settings) imports no torch
    from torch import Tensor

    from polyrl.objectives import Method
    from polyrl.rollout.collect import RolloutBatch
    from polyrl.rollout.episodes import Episode
    from polyrl.rollout.generator import Sample, SamplingParams
    from polyrl.tasks.base import Prompt, Task

Draw = Callable[[int, int], "list[tuple[int, Prompt]]"]  # (position, k) -> k (pool index, prompt) pairs


@dataclass
class PrefetchConfig:
    """Generation ahead of the trainer: ``--async-staleness``, TOML ``[async]``, ``TrainConfig.prefetch``."""

    PREFIX: ClassVar[str] = "async"

    staleness: int = 0
    """asynchronous generation: rollout workers (Ray) sample up to k policy versions ahead (0 = synchronous)"""


class PromptStream:
    """The training prompts in a fixed, seeded order; ``pos`` counts the prompts drawn (exact resume)."""

    def __init__(self, draw_at: Draw, pos: int = 0) -> None:
        self.draw_at, self.pos = draw_at, pos

    @staticmethod
    def of(task: Task, seed: int, pool_size: int = 100_000) -> PromptStream:
        """The task's seeded shuffle of ``pool_size`` train prompts, cycled: position alone fixes the data."""
        pool = task.prompts("train", pool_size, seed)
        index = {p.id: i for i, p in enumerate(pool)}

        def draw_at(pos: int, k: int) -> list[tuple[int, Prompt]]:
            picked = [pool[(pos + j) % len(pool)] for j in range(k)]
            return [(index[p.id], p) for p in picked]

        return PromptStream(draw_at)

    def take(self, k: int) -> list[tuple[int, Prompt]]:
        """The next k prompts; the stream moves past them."""
        out = self.draw_at(self.pos, k)
        self.pos += k
        return out

    def peek(self, ahead: int, k: int) -> list[tuple[int, Prompt]]:
        """The k prompts ``ahead`` positions past the current one, without moving (prefetching)."""
        return self.draw_at(self.pos + ahead, k)


class Runner(Protocol):
    """Runs episodes for a source: ``rollout.episodes.EpisodeRunner`` in this process (its generator shares the
    policy module) or ``rollout.remote.RemoteRunner`` on Ray actors. Sources only call these."""

    tokenizer: Any
    tool: bool  # multi-turn tool task

    def new(self, prompts: list[Prompt], n: int) -> list[Episode]: ...  # n fresh episodes per prompt
    def run(self, episodes: list[Episode], params: SamplingParams, key_offset: int = 0) -> list[Episode]: ...
    def sample(self, prompts: list[Prompt], params: SamplingParams, key_offset: int = 0) -> list[Sample]: ...
    def to_samples(self, episodes: list[Episode], prompt_index: list[int]) -> list[Sample]: ...
    def after_update(self, weights: Callable[[], dict[str, Tensor]], version: int) -> None: ...  # new weights
    def take_stats(self) -> dict[str, float]: ...  # rollout/* and perf/* metrics since the last call
    def close(self) -> None: ...


class RolloutSource(Protocol):
    """Collects scored rollouts for the loop; every sampler and generation backend implements it."""

    def collect(self, method: Method, stream: PromptStream, step: int) -> RolloutBatch:
        """A batch for ``method`` at ``step`` from the prompts of ``stream`` (raises NoUsableGroups)."""
        ...

    def after_update(self, weights: Callable[[], dict[str, Tensor]], version: int) -> None:
        """The policy has taken an optimizer step: ``weights()`` gives its state dict, of policy ``version``."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What the source remembers between steps, for an exact resume."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None:
        """Stop what the source started (processes, actors)."""
        ...
