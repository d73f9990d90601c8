"""Episodes: single-turn completions, multi-turn tool use, and continuations of a prefix, one driver.

An episode is a prompt plus a completion that may interleave agent turns and environment text:

    prompt | agent turn 0 ... <stop token> | environment tokens | agent turn 1 ... EOS

Each agent turn is sampled by the generator until EOS, the task's tool stop token, or the
length cap (``max_new_tokens`` counts every completion token, environment tokens included).
When a turn ends with the stop token, the task's ``respond`` returns the environment's text
(a calculator result, say), which is tokenized and appended with ``loss_mask = 0`` and rollout
log-prob 0: the policy did not choose those tokens, so they get no gradient and never enter a
ratio. Every token carries the index of its agent turn (``turn_ids``), which the turn-level ratio
(ST-PPO) and the tree sampler's turn-boundary branching read.

A run of several turns re-encodes the growing prefix each turn (no cache across the environment
call), as multi-turn rollouts in verl/TRL do without a prefix cache; it is exact and simple.

Every episode has a sampling key, ``key_offset`` plus its position in the list given to ``run``, and its
draws depend only on the seed, that key and its own progress (turn round, budget left), never on the
other episodes decoded with it: running a list in one call equals running its contiguous chunks with
their offsets (``run(episodes[a:b], params, key_offset=a)``), so rollouts can be split across workers.

``Episode.start_*`` lets an episode begin from an existing partial completion: the tree sampler
continues prefixes of earlier rollouts this way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from polyrl.rollout.generator import Generator, Sample, SamplingParams
from polyrl.tasks.base import Prompt
from polyrl.tasks.chat import prompt_ids


@runtime_checkable
class ToolTask(Protocol):
    """A multi-turn task: a stop character closes a tool call and the environment answers it."""

    name: str
    tool_stop: str  # one character that ends an agent turn with a tool call, e.g. ">"
    max_turns: int  # agent turns per episode at most

    def respond(self, prompt: Prompt, transcript: str) -> str | None:
        """The environment's text after a turn that ended with ``tool_stop`` (None ends the episode)."""
        ...


@dataclass
class Episode:
    """A (possibly partial) episode: the prompt and the completion built so far."""

    prompt: Prompt
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turn_ids: list[int] = field(default_factory=list)
    turn: int = 0  # index of the next agent turn
    finish_reason: str = "length"
    done: bool = False
    baseline_tokens: int = 0
    ref_logprobs: list[float] | None = None  # per completion token under the frozen reference (rollout workers)
    sum_pi_sq: list[float] | None = None  # per completion token: sum_v pi_v^2 when the sampler records it (OTB)

    def to_sample(self, prompt_index: int, text: str) -> Sample:
        return Sample(prompt_index=prompt_index, prompt_token_ids=list(self.prompt_ids),
                      completion_token_ids=list(self.token_ids), logprobs=list(self.logprobs),
                      ref_logprobs=None if self.ref_logprobs is None else list(self.ref_logprobs),
                      finish_reason=self.finish_reason, text=text, loss_mask=list(self.loss_mask),
                      turn_ids=list(self.turn_ids), baseline_tokens=self.baseline_tokens,
                      sum_pi_sq=None if self.sum_pi_sq is None else list(self.sum_pi_sq))


def prefix_episode(episode: Episode, length: int) -> Episode:
    """The first ``length`` completion tokens of ``episode`` as a new partial episode, marked as context.

    The copied tokens get ``loss_mask = 0``: they were already trained on in the episode they came from.
    """
    return Episode(prompt=episode.prompt, prompt_ids=list(episode.prompt_ids), token_ids=episode.token_ids[:length],
                   logprobs=episode.logprobs[:length], loss_mask=[0] * length, turn_ids=episode.turn_ids[:length],
                   turn=(episode.turn_ids[length - 1] + 1 if length and episode.loss_mask[length - 1] == 0
                         else episode.turn_ids[length - 1] if length else 0))


class EpisodeRunner:
    """Samples episodes with a generator; ``task`` may be a ToolTask (multi-turn) or a plain task."""

    def __init__(self, generator: Generator, tokenizer, task, *, own_weights: bool = False) -> None:
        """``own_weights``: the generator holds its own copy of the policy (the learner's is sharded across
        processes), so ``after_update`` loads the trainer's weights into it; otherwise it shares the module."""
        self.own_weights = own_weights
        self.generator = generator
        self.tokenizer = tokenizer
        self.task = task
        self.tool = isinstance(task, ToolTask)
        self.stop_ids: tuple[int, ...] = ()
        if self.tool:
            ids = tokenizer(task.tool_stop, add_special_tokens=False)["input_ids"]
            if len(ids) != 1:
                raise ValueError(f"task {task.name!r}: tool_stop = {task.tool_stop!r} must be one token of the "
                                 f"tokenizer, got {len(ids)} tokens")
            # After other text a SentencePiece-style tokenizer (Metaspace: Llama 2, Mistral) writes the character
            # as another token than alone ("▁>" alone, ">" after "7"): both end a turn.
            inside = tokenizer("0" + task.tool_stop, add_special_tokens=False)["input_ids"][-1:]
            inside = [i for i in inside if tokenizer.decode([i]) == task.tool_stop]
            self.stop_ids = tuple(sorted({ids[0], *inside}))
        self.max_turns = task.max_turns if self.tool else 1

    def new(self, prompts: list[Prompt], n: int) -> list[Episode]:
        """``n`` fresh episodes per prompt, grouped by prompt."""
        ids = prompt_ids(self.tokenizer, prompts)  # a rendered chat template brings its own special tokens
        return [Episode(prompt=p, prompt_ids=list(i)) for p, i in zip(prompts, ids) for _ in range(n)]

    def sample(self, prompts: list[Prompt], params: SamplingParams, key_offset: int = 0) -> list[Sample]:
        """``params.n`` episodes per prompt as Samples (``prompt_index`` indexes ``prompts``).

        Episode ``i`` (prompt ``i // n``, copy ``i % n``) has key ``key_offset + i``: the prompts ``[a:b]`` of a
        list sampled on their own with ``key_offset = a * n`` give the same samples as within the whole list.
        """
        episodes = self.run(self.new(prompts, params.n), params, key_offset)
        return self.to_samples(episodes, [i // params.n for i in range(len(episodes))])

    def to_samples(self, episodes: list[Episode], prompt_index: list[int]) -> list[Sample]:
        texts = self.tokenizer.batch_decode([e.token_ids for e in episodes], skip_special_tokens=True)
        return [e.to_sample(i, t) for e, i, t in zip(episodes, prompt_index, texts)]

    def after_update(self, weights, version: int) -> None:
        """The policy took an optimizer step: a generator with its own copy loads ``weights()``."""
        if self.own_weights:
            self.generator.load_weights(weights())

    def take_stats(self) -> dict[str, float]:
        """Nothing to report in-process (rollout workers report restarts, utilisation, weight sync)."""
        return {}

    def close(self) -> None:
        """Nothing started."""

    def run(self, episodes: list[Episode], params: SamplingParams, key_offset: int = 0) -> list[Episode]:
        """Continue every episode until it ends; returns the same (mutated) list.

        Episode ``i`` samples with key ``key_offset + i`` (see the module docstring).
        """
        one = dataclasses.replace(params, n=1, stop_token_ids=self.stop_ids)
        turn_round = 0
        while True:
            live = [(key_offset + i, e) for i, e in enumerate(episodes) if not e.done and e.turn < self.max_turns
                    and len(e.token_ids) < params.max_new_tokens]
            if not live:
                break
            # Live episodes may have different budgets left; decode them in groups of equal remaining budget.
            # The seed of a group depends on the round and the budget, each episode's own progress, and the
            # keys follow the episodes: an episode's draws do not depend on which others share its group.
            by_left: dict[int, list[tuple[int, Episode]]] = {}
            for key, e in live:
                by_left.setdefault(params.max_new_tokens - len(e.token_ids), []).append((key, e))
            for left, group in sorted(by_left.items()):
                seed = None if params.seed is None else params.seed + 7919 * turn_round + left
                step_params = dataclasses.replace(one, max_new_tokens=left, seed=seed)
                outs = self.generator.generate_ids([e.prompt_ids + e.token_ids for _, e in group], step_params,
                                                   keys=[key for key, _ in group])
                for (_, e), s in zip(group, outs):
                    self._extend(e, s, params.max_new_tokens)
            turn_round += 1
        for e in episodes:
            e.done = True
        return episodes

    def _reply_ids(self, reply: str) -> list[int]:
        """The environment's reply as tokens of the text it continues (it follows the tool call's stop character).
        Alone, a SentencePiece-style tokenizer starts it with a word marker ("2146" became " 2146" in the
        transcript); encoded after the stop character, then cut where that character's own tokens end, it does
        not. A reply that merges with the stop character is encoded alone."""
        stop = self.tokenizer(self.task.tool_stop, add_special_tokens=False)["input_ids"]
        after = self.tokenizer(self.task.tool_stop + reply, add_special_tokens=False)["input_ids"]
        if after[: len(stop)] == stop:
            return after[len(stop):]
        return self.tokenizer(reply, add_special_tokens=False)["input_ids"]

    def _extend(self, e: Episode, s: Sample, cap: int) -> None:
        if s.sum_pi_sq is not None:  # environment tokens before this turn hold 0 (they carry no loss)
            e.sum_pi_sq = (e.sum_pi_sq or [0.0] * len(e.token_ids)) + s.sum_pi_sq
        e.token_ids += s.completion_token_ids
        e.logprobs += s.logprobs
        e.loss_mask += [1] * len(s.completion_token_ids)
        e.turn_ids += [e.turn] * len(s.completion_token_ids)
        e.baseline_tokens += s.baseline_tokens
        e.finish_reason = s.finish_reason
        called = bool(self.stop_ids) and s.finish_reason == "stop" and s.completion_token_ids[-1] in self.stop_ids
        turn = e.turn
        e.turn += 1
        if not called or e.turn >= self.max_turns:
            e.done = True
            return
        transcript = self.tokenizer.decode(e.token_ids, skip_special_tokens=True)
        reply = self.task.respond(e.prompt, transcript)
        if reply is None:
            e.done = True
            return
        env = self._reply_ids(reply)[: cap - len(e.token_ids)]  # the cap counts environment tokens too
        e.token_ids += env
        e.logprobs += [0.0] * len(env)
        if e.sum_pi_sq is not None:
            e.sum_pi_sq += [0.0] * len(env)
        e.loss_mask += [0] * len(env)
        e.turn_ids += [turn] * len(env)
        e.finish_reason = "length"  # until the next agent turn says otherwise
