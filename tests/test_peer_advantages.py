"""The peers' advantage estimators (polyrl/objectives/baselines.py) and GDPO's two whitening conventions.

Hand-computed numbers for each, plus the property each one is defined by: ReMax's baseline is exactly the reward
of the prompt's greedy (argmax) decode, which the uniform sampler adds and never trains on; OPO's is the
length-weighted group mean; Pass@k's advantages are the mean z-scores of the k-subsets holding the response.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from polyrl.combinations import check_combinations
from polyrl.config import ConfigError, build_config
from polyrl.methods import get_method
from polyrl.objectives.group_layout import advantages
from polyrl.registry import ADVANTAGES
from polyrl.rollout.collect import collect
from polyrl.rollout.generator import SamplingParams
from tests.helpers import lengths_mask

remax, opo, gpg, passk, gdpo, grpo = (ADVANTAGES.fn(n) for n in ("remax", "opo", "gpg", "passk", "gdpo", "grpo"))
D = torch.float64


def t(*xs):
    return torch.tensor(xs, dtype=D)


# --- ReMax ----------------------------------------------------------------------------------------


def test_remax_subtracts_the_greedy_reward_hand_numbers():
    r, greedy = t(1, 0, 1, 0), t(1, 1, 0, 0)
    adv = remax(r, torch.tensor([0, 0, 1, 1]), torch.ones(4, 3, dtype=D), None, None, greedy)
    torch.testing.assert_close(adv, t(0, -1, 1, 0))
    # a KL penalty in the reward is summed over the loss tokens of the sample (not the greedy decode's)
    mask = lengths_mask([1, 2, 3, 3], 3)
    kl = torch.full((4, 3), -0.1, dtype=D)
    adv = remax(r, torch.tensor([0, 0, 1, 1]), mask, None, kl, greedy)
    torch.testing.assert_close(adv, t(-0.1, -1.2, 0.7, -0.3))
    # not a group estimator: a group of one (one sample per prompt, the paper's setting) keeps r - r_greedy
    torch.testing.assert_close(remax(t(1.0), torch.tensor([7]), torch.ones(1, 2, dtype=D), None, None, t(0.0)),
                               t(1.0))


def test_remax_baseline_is_exactly_the_greedy_reward():
    g = torch.Generator().manual_seed(0)
    r, greedy = torch.rand(12, generator=g, dtype=D), torch.rand(12, generator=g, dtype=D)
    adv = remax(r, torch.arange(12) // 3, torch.ones(12, 4, dtype=D), None, None, greedy)
    assert torch.equal(r - adv, greedy)


def test_the_loop_entry_point_requires_the_greedy_rewards_and_passes_them():
    method = get_method("remax")
    r, gids, mask = torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.ones(2, 3)
    with pytest.raises(ValueError, match="greedy completion"):
        advantages(method, r, gids, mask)
    adv, _ = advantages(method, r, gids, mask, greedy_rewards=torch.tensor([0.0, 1.0]))
    torch.testing.assert_close(adv, torch.tensor([[1.0] * 3, [-1.0] * 3]))


class _Spy:
    """The runner's sample function, recording every call's params and samples."""

    def __init__(self, runner):
        self.runner, self.calls = runner, []

    def __call__(self, prompts, params, key_offset):
        out = self.runner.sample(prompts, params, key_offset)
        self.calls.append((params, out))
        return out


def test_collect_decodes_each_prompt_greedily_scores_it_and_keeps_it_out_of_the_batch(tiny_model):
    from polyrl.model import load_policy
    from polyrl.rollout.episodes import EpisodeRunner
    from polyrl.rollout.hf import HFGenerator
    from polyrl.rollout.source import PromptStream
    from polyrl.tasks.arithmetic import AdditionTask
    from polyrl.tasks.rewards import RewardChannels

    policy, tokenizer = load_policy(tiny_model, threads=1)
    task = AdditionTask()
    spy = _Spy(EpisodeRunner(HFGenerator(policy, tokenizer), tokenizer, task))
    rewards = RewardChannels(task, ["tests.reward_fns:digit_fraction"])  # dense: greedy rewards differ
    params = SamplingParams(n=4, max_new_tokens=6, seed=3)
    batch = collect(spy, rewards, get_method("remax"), PromptStream.of(task, 0).take, num_groups=3,
                    params=params, history={})
    (train_params, sampled), (greedy_params, greedy) = spy.calls
    assert (train_params, greedy_params.n, greedy_params.temperature) == (params, 1, 0.0)
    # not in the training batch: exactly the G sampled completions of each prompt, none of the greedy ones
    assert len(batch.samples) == 12 and all(a is b for a, b in zip(batch.samples, sampled))
    assert not any(s is g for s in batch.samples for g in greedy)
    # the greedy completion is argmax decoding: every token is the argmax of the policy given its prefix
    with torch.no_grad():
        for s in greedy:
            ids = torch.tensor([s.prompt_token_ids + s.completion_token_ids])
            logits = policy(ids).logits[0, len(s.prompt_token_ids) - 1:-1]
            assert logits.argmax(-1).tolist() == s.completion_token_ids
    # its reward (the same reward function, same shapers: none for remax) is each sample's baseline
    scores = rewards([p for p in batch.prompts[::4]], [g.text for g in greedy]).total
    assert batch.greedy_rewards.tolist() == pytest.approx([x for x in scores for _ in range(4)])
    assert batch.stats["rollout/greedy_reward"] == pytest.approx(sum(scores) / 3)
    assert len(set(scores)) > 1  # a real test: the prompts' greedy rewards differ


@pytest.mark.parametrize("setting", [{"sampler": "tree"}, {"agency": "/x"}, {"async_staleness": 1},
                                     {"preference_file": "pairs.jsonl"}])
def test_remax_refuses_the_layouts_without_a_greedy_decode(setting):
    cfg = build_config(setting)
    with pytest.raises(ConfigError, match=f"^{next(iter(setting))}") as e:  # the tree: also a group rule's line
        check_combinations(cfg, get_method("remax"), None)
    assert "\n" not in str(e.value) and " = " in str(e.value)
    check_combinations(build_config({}), get_method("remax"), None)  # the uniform synchronous sampler is fine


# --- OPO ------------------------------------------------------------------------------------------


def test_opo_hand_numbers():
    r, gids = t(1, 0, 1, 1), torch.tensor([0, 0, 0, 1])
    mask = lengths_mask([2, 4, 4, 3], 5)
    # group 0: b = (2*1 + 4*0 + 4*1) / 10 = 0.6; group 1 is a group of one -> 0
    torch.testing.assert_close(opo(r, gids, mask), t(0.4, -0.6, 0.4, 0.0))


def test_opo_baseline_is_the_length_weighted_mean():
    g = torch.Generator().manual_seed(1)
    r = torch.rand(12, generator=g, dtype=D)
    lengths = torch.randint(1, 9, (12,), generator=g)
    gids = torch.arange(12) // 4
    adv = opo(r, gids, lengths_mask(lengths.tolist(), 8))
    for grp in range(3):
        rows = gids == grp
        b = (lengths[rows] * r[rows]).sum() / lengths[rows].sum()
        torch.testing.assert_close(r[rows] - adv[rows], b.expand(4))
        torch.testing.assert_close((lengths[rows] * adv[rows]).sum(), torch.zeros((), dtype=D))
    # equal lengths: the plain group mean (Dr. GRPO's group_centered)
    torch.testing.assert_close(opo(r, gids, torch.ones(12, 3, dtype=D)),
                               ADVANTAGES.fn("group_centered")(r, gids, torch.ones(12, 3, dtype=D)))


# --- GPG ------------------------------------------------------------------------------------------

GPG_R, GPG_G, ONES = t(1, 0, 0, 0, 1, 1, 1, 1), torch.tensor([0] * 4 + [1] * 4), torch.ones(8, 2, dtype=D)


@pytest.mark.parametrize("settings,expected", [
    # group 0 centred: [.75, -.25, -.25, -.25]; group 1 has no variance (M = 4 of B = 8): alpha = 8/4 = 2
    ({}, [1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0]),
    ({"alpha": "one"}, [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]),
    ({"alpha": "nonzero"}, [1.2, -0.4, -0.4, -0.4, 0, 0, 0, 0]),  # verl: 8 / 5 nonzero rewards
    ({"f_norm": "std", "eps": 0.0}, [3.0, -1.0, -1.0, -1.0, 0, 0, 0, 0]),  # Bessel std of [1,0,0,0] = 0.5
])
def test_gpg_hand_numbers(settings, expected):
    torch.testing.assert_close(gpg(GPG_R, GPG_G, ONES, **settings), t(*expected))


def test_gpg_rescaling_equals_averaging_over_the_valid_groups_only():
    """AGE: the batch mean of A * x over all B samples equals the mean of (r - mean) * x over the valid ones."""
    x = torch.randn(8, dtype=D)
    valid = slice(0, 4)
    centred = GPG_R[valid] - GPG_R[valid].mean()
    torch.testing.assert_close((gpg(GPG_R, GPG_G, ONES) * x).mean(), (centred * x[valid]).mean())
    assert torch.equal(gpg(t(1.0), torch.tensor([0]), torch.ones(1, 2, dtype=D)), t(0.0))  # group of one


# --- Pass@k ---------------------------------------------------------------------------------------


def test_passk_hand_numbers():
    # n = 4, one positive, k = 2: R = 1 - C(3,2)/C(4,2) = 1/2, s = 1/2;
    # A_pos = (1 - 1/2) / (1/2) = 1; A_neg = (1 - 1/2 - C(2,1)/C(3,1)) / (1/2) = -1/3
    adv = passk(t(1, 0, 0, 0), torch.zeros(4, dtype=torch.long), torch.ones(4, 2, dtype=D), k=2, eps=0.0)
    torch.testing.assert_close(adv, t(1, -1 / 3, -1 / 3, -1 / 3))


def _subset_advantages(r: list[int], k: int) -> list[float]:
    """The paper's full-sampling definition: every k-subset's reward is its max, z-scored over the subsets
    (population std); a response's advantage is the mean z-score of the subsets that contain it."""
    subsets = list(itertools.combinations(range(len(r)), k))
    best = [max(r[i] for i in s) for s in subsets]
    mean = sum(best) / len(best)
    std = math.sqrt(sum((b - mean) ** 2 for b in best) / len(best))
    return [sum((b - mean) / std for s, b in zip(subsets, best) if i in s) / sum(i in s for s in subsets)
            for i in range(len(r))]


@pytest.mark.parametrize("r,k", [([1, 0, 0, 0, 0, 0], 2), ([1, 1, 0, 0, 0, 0, 0, 0], 4), ([1, 0, 1, 0, 0], 3),
                                 ([0, 0, 0, 0, 0, 0, 0, 1], 4), ([1, 0, 0, 1, 0, 0, 1], 1)])
def test_passk_equals_the_mean_over_k_subsets(r, k):
    adv = passk(t(*r), torch.zeros(len(r), dtype=torch.long), torch.ones(len(r), 2, dtype=D), k=k, eps=0.0)
    torch.testing.assert_close(adv, t(*_subset_advantages(r, k)))


def test_passk_with_k1_is_grpo_with_population_std():
    g = torch.Generator().manual_seed(2)
    r = torch.randint(0, 2, (24,), generator=g).to(D)
    gids, mask = torch.arange(24) // 6, torch.ones(24, 2, dtype=D)
    torch.testing.assert_close(passk(r, gids, mask, k=1), grpo(r, gids, mask, std="population"))


def test_passk_gives_zero_where_no_subset_can_differ():
    mask = torch.ones(6, 2, dtype=D)
    # all negative, all positive, and fewer negatives than k (every 4-subset holds a positive)
    for r in ([0] * 6, [1] * 6, [1, 1, 1, 0, 0, 0]):
        assert torch.equal(passk(t(*r), torch.zeros(6, dtype=torch.long), mask, k=4), torch.zeros(6, dtype=D))
    assert torch.equal(passk(t(1.0), torch.tensor([3]), torch.ones(1, 2, dtype=D)), t(0.0))


def test_passk_refuses_k_not_below_the_group_size():
    with pytest.raises(ConfigError, match="k < group_size"):
        check_combinations(build_config({"group_size": 4}), get_method("passk"), None)
    check_combinations(build_config({"group_size": 8}), get_method("passk"), None)


# --- GDPO whitening ---------------------------------------------------------------------------------

# Two groups of two, one channel: per-group z-scores (Bessel std sqrt(1/2)) are S = [a, -a, a, -a], a = 1/sqrt(2).
GD_R, GD_G = t(1, 0, 1, 0), torch.tensor([0, 0, 1, 1])
GD_MASK = lengths_mask([1, 3, 2, 2], 3)


def test_gdpo_whitens_over_responses_by_default():
    # mean 0, Bessel std over the 4 responses sqrt(4 a^2 / 3) = sqrt(2/3): A = +-a / sqrt(2/3) = +-sqrt(3)/2
    h = math.sqrt(3) / 2
    torch.testing.assert_close(gdpo(GD_R, GD_G, GD_MASK, eps=0.0), t(h, -h, h, -h))
    torch.testing.assert_close(gdpo(GD_R, GD_G, GD_MASK, eps=0.0, whiten="responses"), t(h, -h, h, -h))


def test_gdpo_whitens_over_tokens_with_each_response_weighted_by_its_loss_tokens():
    # weights n = [1, 3, 2, 2], N = 8: m = a (1 - 3 + 2 - 2) / 8 = -a/4;
    # S - m = [5a/4, -3a/4, 5a/4, -3a/4]; var = a^2 (25/16 + 3*9/16 + 2*25/16 + 2*9/16) / 7 = a^2 (120/16) / 7
    a = 1 / math.sqrt(2)
    std = a * math.sqrt(120 / 16 / 7)
    expected = t(1.25 * a / std, -0.75 * a / std, 1.25 * a / std, -0.75 * a / std)
    torch.testing.assert_close(gdpo(GD_R, GD_G, GD_MASK, eps=0.0, whiten="tokens"), expected)
    # equal lengths: the two conventions agree only up to Bessel's N vs B (here 8/7 vs 4/3 of the same sum)
    ones = torch.ones(4, 2, dtype=D)
    ratio = gdpo(GD_R, GD_G, ones, eps=0.0, whiten="tokens") / gdpo(GD_R, GD_G, ones, eps=0.0)
    torch.testing.assert_close(ratio, torch.full((4,), math.sqrt((8 - 1) / 8 * 4 / (4 - 1)), dtype=D))


def test_gdpo_tokens_keeps_a_group_of_one_at_zero():
    r, gids = t(1, 0, 1), torch.tensor([0, 0, 1])
    adv = gdpo(r, gids, lengths_mask([1, 3, 2], 3), whiten="tokens")
    assert adv[2] == 0 and adv[0] > 0 > adv[1]


def test_collect_counts_the_tokens_of_every_round_filtered_groups_included(tiny_model):
    """The lab's token axis read rollout/gen_tokens, the kept batch's tokens: DAPO, which samples again for the groups
    its filter drops, was drawn as spending fewer tokens than GRPO. rollout/generated_tokens counts every sample."""
    from polyrl.model import load_policy
    from polyrl.rollout.collect import written_tokens
    from polyrl.rollout.episodes import EpisodeRunner
    from polyrl.rollout.hf import HFGenerator
    from polyrl.rollout.source import PromptStream
    from polyrl.tasks.arithmetic import AdditionTask
    from polyrl.tasks.rewards import RewardChannels

    policy, tokenizer = load_policy(tiny_model, threads=1)
    task = AdditionTask()
    spy = _Spy(EpisodeRunner(HFGenerator(policy, tokenizer), tokenizer, task))
    rewards = RewardChannels(task, ["tests.reward_fns:digit_fraction"])  # partial credit: some groups mixed, some not
    batch = collect(spy, rewards, get_method("dapo"), PromptStream.of(task, 0).take, num_groups=6,
                    params=SamplingParams(n=2, max_new_tokens=6, seed=3), history={}, max_rounds=8)
    every = [s for _, out in spy.calls for s in out]
    assert batch.stats["rollout/generated"] == len(every)
    assert batch.stats["rollout/generated_tokens"] == written_tokens(every)
    kept = written_tokens(batch.samples)
    assert len(spy.calls) > 1 and batch.stats["rollout/generated_tokens"] > kept  # groups were dropped and redrawn
