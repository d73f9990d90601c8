"""sample -> score -> shape -> filter -> refill: the one place where dynamic sampling lives.

``collect`` draws prompts, samples a group of completions for each, scores them with the task,
applies the method's reward shapers and filters, and -- when filters drop whole groups (DAPO's
dynamic sampling, ScaleRL's zero-variance filter) -- draws more prompts until the batch has the
requested number of groups or ``max_rounds`` generation rounds were spent. Sample-level drops
(overlong filtering) keep the group for the advantage statistics and zero the sample's loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from polyrl.objectives import Method
from polyrl.registry import ADVANTAGES, FILTERS
from polyrl.rollout.generator import Sample, SamplingParams, written_tokens
from polyrl.rollout.score import mixed_groups, shape
from polyrl.tasks.base import Prompt
from polyrl.tasks.rewards import RewardChannels
from polyrl.types import TreeInfo


class NoUsableGroups(RuntimeError):
    """Every sampled group was filtered out within the allowed generation rounds; ``stats`` says what was spent."""

    def __init__(self, message: str, stats: dict[str, float]):
        super().__init__(message)
        self.stats = stats

    def __reduce__(self):  # pickled whole: rank 0 sends it to the other training processes
        return type(self), (self.args[0], self.stats)


@dataclass
class RolloutBatch:
    """A group-ordered batch of scored completions, ready for the trainer (B = groups * group size)."""

    group_ids: Tensor  # [B] long: integer id of the prompt in the training pool (one group per prompt)
    prompts: list[Prompt]  # [B] the prompt of each sample
    samples: list[Sample]  # [B] token ids, rollout log-probs, finish reason, text
    scores: Tensor  # [B] raw task rewards
    rewards: Tensor  # [B] rewards after the method's shapers
    keep: Tensor  # [B] bool: sample counts for the loss (sample-level filters)
    truncated: Tensor  # [B] bool: generation hit max_new_tokens
    lengths: Tensor  # [B] completion lengths in tokens
    channels: Tensor | None = None  # [B, C] separate reward channels (RewardChannels), else None
    stats: dict[str, float] = field(default_factory=dict)  # rollout/* and reward/* metrics
    tree: TreeInfo | None = None  # tree rollouts: root/sibling groups and branch points (rollout/tree)
    sample_weight: Tensor | None = None  # [B] importance weight of each sample's loss, mean 1 (None: all 1)
    greedy_rewards: Tensor | None = None  # [B] shaped reward of the greedy completion of each sample's prompt (ReMax)


# EpisodeRunner.sample(prompts, params, key_offset): n samples per prompt, row i keyed key_offset + i
SampleFn = Callable[[list[Prompt], SamplingParams, int], list[Sample]]


def collect(
    sample: SampleFn,
    rewards: RewardChannels,
    method: Method,
    draw_prompts: Callable[[int], list[tuple[int, Prompt]]],
    *,
    num_groups: int,
    params: SamplingParams,
    history: MutableMapping[int, float],
    max_rounds: int = 1,
) -> RolloutBatch:
    """Sample ``num_groups`` groups of ``params.n`` completions that survive the method's filters.

    ``sample(prompts, params, key_offset)`` returns ``params.n`` completions per prompt (an ``EpisodeRunner``'s
    ``sample``: single-turn or multi-turn); a refill round's rows are keyed after the rows generated before it, so
    its random numbers are not the first round's again. ``draw_prompts(k)`` returns the next k (pool index,
    Prompt) pairs of the training stream.
    ``history`` (pool index -> best pass rate so far) is updated with every scored group, so
    no-positive-resampling removes a prompt once it was solved often enough.
    An advantage tagged ``needs_sum_pi_sq`` (OTB) has the sampler record sum_v pi_v^2 of every sampled token.
    An advantage tagged ``needs_greedy`` (ReMax) also gets one greedy completion per prompt, sampled with the
    same weights and scored and shaped as the others; only its reward is kept (``greedy_rewards``), never trained on.
    """
    G = params.n
    kept_groups: list[tuple[int, Prompt, list[Sample], Tensor, Tensor, Tensor, Tensor | None, Tensor, Tensor]] = []
    generated = useful = rounds = 0
    tokens_generated = 0
    greedy = "needs_greedy" in ADVANTAGES.spec(method.advantage.name).tags
    if "needs_sum_pi_sq" in ADVANTAGES.spec(method.advantage.name).tags:  # OTB: the sampler records sum_v pi_v^2
        params = dataclasses.replace(params, sum_pi_sq=True)
    kept_greedy: list[tuple[float, float]] = []  # (raw score, shaped reward) of each kept group's greedy completion
    while len(kept_groups) < num_groups and rounds < max_rounds:
        rounds += 1
        need = num_groups - len(kept_groups)
        drawn = draw_prompts(need)
        samples = sample([p for _, p in drawn], params, generated)
        scored = rewards([drawn[s.prompt_index][1] for s in samples], [s.text for s in samples],
                         prompt_index=[s.prompt_index for s in samples])
        scores = torch.tensor(scored.total, dtype=torch.float32)
        channels = None if scored.channels is None else torch.tensor(scored.channels, dtype=torch.float32)
        lengths = torch.tensor([len(s.completion_token_ids) for s in samples])
        truncated = torch.tensor([s.finish_reason == "length" for s in samples])
        gids = torch.tensor([drawn[s.prompt_index][0] for s in samples])
        shaped = shape(method, scores, lengths, truncated, params.max_new_tokens)
        if greedy:
            g_scores, g_shaped = _greedy_rewards(sample, rewards, method, drawn, params)
        keep = torch.ones(len(samples), dtype=torch.bool)
        for filt in method.filters:
            # Filters judge the task scores, not the shaped rewards: DAPO's dynamic sampling drops groups whose
            # *accuracy* is all-0 or all-1 (verl filter_groups.metric=acc); a length penalty must not rescue them.
            keep &= FILTERS.fn(filt.name)(scores, gids, truncated, history, **filt.params)
        generated += len(samples)
        tokens_generated += written_tokens(samples)
        useful += int(mixed_groups(scores, G).sum()) * G
        for g, (pool_idx, prompt) in enumerate(drawn):
            rows = slice(g * G, (g + 1) * G)
            history[pool_idx] = max(history.get(pool_idx, 0.0), float(scores[rows].clamp(0, 1).mean()))
            if keep[rows].any() and len(kept_groups) < num_groups:
                kept_groups.append((pool_idx, prompt, samples[rows], scores[rows], shaped[rows], keep[rows],
                                    None if channels is None else channels[rows], lengths[rows], truncated[rows]))
                if greedy:
                    kept_greedy.append((float(g_scores[g]), float(g_shaped[g])))
    if not kept_groups:
        raise NoUsableGroups(
            f"every sampled group was filtered out in {rounds} generation round(s) "
            f"(filters: {', '.join(f.name for f in method.filters)})",
            {"rollout/gen_rounds": float(rounds), "rollout/generated": float(generated),
             "rollout/generated_tokens": float(tokens_generated), "rollout/utilization": 0.0},
        )
    samples = [s for grp in kept_groups for s in grp[2]]
    scores = torch.cat([grp[3] for grp in kept_groups])
    variance_groups = int(mixed_groups(scores, G).sum())
    stats = {
        "rollout/gen_rounds": float(rounds),
        "rollout/generated": float(generated),
        "rollout/generated_tokens": float(tokens_generated),  # every round's, filtered groups too (the compute)
        "rollout/groups": float(len(kept_groups)),
        "rollout/utilization": useful / max(1, generated),
        "rollout/useful_groups_per_token": (useful / G) / max(1, tokens_generated),
        "rollout/mixed_group_frac": variance_groups / len(kept_groups),
    }
    if kept_groups[0][6] is not None:  # several reward channels: each one's mean (GDPO normalises them separately)
        for c, mean in enumerate(torch.cat([grp[6] for grp in kept_groups]).mean(0).tolist()):
            stats[f"reward/channel{c}_mean"] = mean
    if greedy:
        stats["rollout/greedy_reward"] = sum(score for score, _ in kept_greedy) / len(kept_greedy)
    return RolloutBatch(
        group_ids=torch.tensor([grp[0] for grp in kept_groups for _ in range(G)]),
        prompts=[grp[1] for grp in kept_groups for _ in range(G)],
        samples=samples,
        scores=scores,
        rewards=torch.cat([grp[4] for grp in kept_groups]),
        keep=torch.cat([grp[5] for grp in kept_groups]),
        channels=None if kept_groups[0][6] is None else torch.cat([grp[6] for grp in kept_groups]),
        truncated=torch.cat([grp[8] for grp in kept_groups]),
        lengths=torch.cat([grp[7] for grp in kept_groups]),
        stats=stats,
        greedy_rewards=torch.tensor([shaped for _, shaped in kept_greedy for _ in range(G)]) if greedy else None,
    )


def _greedy_rewards(sample: SampleFn, rewards: RewardChannels, method: Method,
                    drawn: list[tuple[int, Prompt]], params: SamplingParams) -> tuple[Tensor, Tensor]:
    """Raw scores and shaped rewards [len(drawn)] of one greedy (argmax) completion per drawn prompt."""
    greedy = sample([p for _, p in drawn], dataclasses.replace(params, n=1, temperature=0.0), 0)  # argmax: no draws
    scored = rewards([drawn[s.prompt_index][1] for s in greedy], [s.text for s in greedy],
                     prompt_index=[s.prompt_index for s in greedy])
    scores = torch.tensor(scored.total, dtype=torch.float32)
    lengths = torch.tensor([len(s.completion_token_ids) for s in greedy])
    truncated = torch.tensor([s.finish_reason == "length" for s in greedy])
    return scores, shape(method, scores, lengths, truncated, params.max_new_tokens)
