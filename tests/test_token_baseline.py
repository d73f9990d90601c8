"""verl's optimal token baseline (polyrl/objectives/token_baseline.py) and the sampler statistic it reads.

Hand-computed advantages on a two-sample group; the property that with the same realized energy W_t in every sample
the baseline is the group mean (GRPO-centred); the TIR variant's packing of policy tokens; the hf sampler's
recorded sum_v pi_v^2 against a recomputation from the model's logits; the refusals; a few training steps.
"""

from __future__ import annotations

import json

import pytest
import torch

from polyrl.combinations import check_combinations
from polyrl.config import ConfigError, build_config
from polyrl.methods import get_method
from polyrl.objectives.group_layout import advantages
from polyrl.registry import ADVANTAGES
from polyrl.rollout.generator import SamplingParams
from tests.helpers import lengths_mask

otb, tir = ADVANTAGES.fn("optimal_token_baseline"), ADVANTAGES.fn("tir_optimal_token_baseline")
D = torch.float64


def t(*rows):
    return torch.tensor(rows, dtype=D)


# A: length 3, r = 1, pi = (.5, .25, .5), sum pi^2 = (.5, .25, .5) -> w = (.5, .75, .5), W = (.5, 1.25, 1.75)
# B: length 2, r = 0, pi = (.8, .5),      sum pi^2 = (.7, .3)      -> w = (.1, .3),      W = (.1, .4)
R, GIDS, MASK = t(1, 0), torch.tensor([0, 0]), lengths_mask([3, 2], 3)
PI, SQ = t([0.5, 0.25, 0.5], [0.8, 0.5, 0.9]), t([0.5, 0.25, 0.5], [0.7, 0.3, 0.9])  # B's 3rd column: padding


def test_otb_hand_numbers_two_sample_group():
    adv = otb(R, GIDS, MASK, None, None, SQ, PI.log(), eps=0.0)
    # B*_0 = (1 * .5 + 0 * .1) / .6 = 5/6; B*_1 = 1.25 / 1.65 = 25/33; B*_2 = 1.75 / 1.75 = 1 (only A is alive)
    torch.testing.assert_close(adv, t([1 / 6, 8 / 33, 0.0], [-5 / 6, -25 / 33, 0.0]))
    # verl's default eps = 1e-8 moves nothing visible; padding garbage in pi / sum pi^2 changes nothing
    torch.testing.assert_close(otb(R, GIDS, MASK, None, None, SQ, PI.log()), adv, atol=1e-7, rtol=0)
    # zero_tail: the lone longest sample's tail past the second longest gets baseline 0, so A_2 = G_2 = 1
    tail = otb(R, GIDS, MASK, None, None, SQ, PI.log(), zero_tail=True)
    torch.testing.assert_close(tail, t([1 / 6, 8 / 33, 1.0], [-5 / 6, -25 / 33, 0.0]))


def test_otb_group_of_one_is_zero_and_kl_enters_the_reward_to_go():
    adv = otb(t(1, 0, 1), torch.tensor([0, 0, 1]), lengths_mask([2, 2, 2], 2), None, None,
              torch.full((3, 2), 0.5, dtype=D), torch.full((3, 2), 0.5, dtype=D).log())
    torch.testing.assert_close(adv[2], t(0, 0))  # a group of one: no contrast (verl gives G_t)
    # equal W in both samples: B_t = mean of G_t, G_t = r + future token rewards (a KL penalty)
    tr = t([-0.1, -0.2], [0.0, -0.4])
    adv = otb(t(1, 0), GIDS, torch.ones(2, 2, dtype=D), None, tr, torch.full((2, 2), 0.5, dtype=D),
              torch.full((2, 2), 0.5, dtype=D).log())
    G = t([1 - 0.3, 1 - 0.2], [-0.4, -0.4])
    torch.testing.assert_close(adv, G - G.mean(0, keepdim=True))


@pytest.mark.parametrize("fn", [otb, tir])
def test_a_group_of_equal_rewards_has_advantage_exactly_zero(fn):
    """verl's formula gives G eps / (sum W + eps) (~1e-9) where a group's G_t are all equal; polyrl gives 0 exactly,
    so that those rows' backward is skipped (update.py). Unequal groups keep the formula: here two samples with
    r = 1, 0 and the hand numbers of ``test_otb_hand_numbers_two_sample_group``."""
    rewards = torch.cat([torch.full((4,), 0.1, dtype=D), R])
    gids = torch.tensor([0, 0, 0, 0, 1, 1])
    mask = torch.cat([lengths_mask([3, 1, 2, 3], 3), MASK])
    pi, sq = torch.cat([torch.full((4, 3), 0.3, dtype=D), PI]), torch.cat([torch.full((4, 3), 0.2, dtype=D), SQ])
    adv = fn(rewards, gids, mask, None, None, sq, pi.log(), zero_tail=False)
    assert (adv[:4] == 0).all(), adv[:4]
    torch.testing.assert_close(adv[4:], t([1 / 6, 8 / 33, 0.0], [-5 / 6, -25 / 33, 0.0]), atol=1e-7, rtol=0)


def test_otb_with_equal_energy_in_every_sample_is_grpo_centred():
    g = torch.Generator().manual_seed(0)
    r, gids = torch.rand(12, generator=g, dtype=D), torch.arange(12) // 4
    pi = torch.rand(1, 7, generator=g, dtype=D).clamp_min(0.05).expand(12, 7)  # same uncertainty at each position
    sq = pi**2 + 0.1 * (1 - pi) ** 2  # a valid sum pi^2 >= pi^2
    adv = otb(r, gids, torch.ones(12, 7, dtype=D), None, None, sq, pi.log())
    centred = r - r.reshape(3, 4).mean(-1).repeat_interleave(4)
    torch.testing.assert_close(adv, centred[:, None].expand(12, 7), atol=1e-7, rtol=0)
    # unequal energies: the baseline leans toward the reward of the more uncertain sample
    pi2 = pi.clone()
    pi2[0] = 0.999
    adv2 = otb(r, gids, torch.ones(12, 7, dtype=D), None, None, sq, pi2.log())
    assert not torch.allclose(adv2[:4], centred[:4, None].expand(4, 7))


def test_tir_packs_policy_tokens_and_equals_otb_on_the_packed_layout():
    mask = t([1, 0, 1, 1], [1, 1, 0, 0])  # A: an environment token at position 1
    pi, sq = t([0.5, 0.9, 0.25, 0.5], [0.8, 0.5, 0.9, 0.9]), t([0.5, 0.9, 0.25, 0.5], [0.7, 0.3, 0.9, 0.9])
    adv = tir(R, GIDS, mask, None, None, sq, pi.log(), zero_tail=False, eps=0.0)
    # packed: A = the two-sample example's A, B = its B: same numbers, scattered back; 0 at environment tokens
    torch.testing.assert_close(adv, t([1 / 6, 0.0, 8 / 33, 0.0], [-5 / 6, -25 / 33, 0.0, 0.0]))
    torch.testing.assert_close(tir(R, GIDS, mask, None, None, sq, pi.log())[0, 3], torch.tensor(1.0, dtype=D))
    # single-turn masks: tir is otb with the same zero_tail
    for zero_tail in (False, True):
        torch.testing.assert_close(tir(R, GIDS, MASK, None, None, SQ, PI.log(), zero_tail=zero_tail),
                                   otb(R, GIDS, MASK, None, None, SQ, PI.log(), zero_tail=zero_tail))


def test_group_layout_passes_the_sampler_statistics_and_refuses_without_them():
    method = get_method("otb")
    adv, _ = advantages(method, R.float(), GIDS, MASK.float(), sum_pi_sq=SQ.float(), sampled_logp=PI.log().float())
    torch.testing.assert_close(adv, otb(R, GIDS, MASK, None, None, SQ, PI.log()).float())
    with pytest.raises(ValueError, match="needs the sampler's per-token sum_v pi_v\\^2"):
        advantages(method, R.float(), GIDS, MASK.float())


def _sampler(tiny_model):
    from polyrl.model import load_policy
    from polyrl.rollout.hf import HFGenerator

    policy, tokenizer = load_policy(tiny_model, threads=1)
    return policy, tokenizer, HFGenerator(policy, tokenizer)


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_k=5, top_p=0.9),
                                dict(temperature=0.0)])
def test_sampler_records_sum_pi_sq_of_the_distribution_it_drew_from(tiny_model, kw):
    from polyrl.model import process_logits

    policy, tokenizer, gen = _sampler(tiny_model)
    prompts = ["12+34=", "7+8="]
    assert all(s.sum_pi_sq is None for s in gen.generate(prompts, SamplingParams(n=2, max_new_tokens=5, seed=1)))
    samples = gen.generate(prompts, SamplingParams(n=2, max_new_tokens=5, seed=1, sum_pi_sq=True, **kw))
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_token_ids + s.completion_token_ids])
            logits = policy(ids).logits[0, len(s.prompt_token_ids) - 1:-1].float()
            if kw["temperature"] > 0:
                logits = process_logits(logits, temperature=kw["temperature"], top_k=kw.get("top_k"),
                                        top_p=kw.get("top_p", 1.0))
            lp = logits.log_softmax(-1)
            expected = (2 * lp).exp().sum(-1)
            assert len(s.sum_pi_sq) == len(s.completion_token_ids)
            torch.testing.assert_close(torch.tensor(s.sum_pi_sq), expected, atol=1e-6, rtol=0)
            # the sampled token's probability is the one the reported log-prob is of (pi_j of W_t)
            picked = lp.gather(-1, torch.tensor(s.completion_token_ids)[:, None]).squeeze(1)
            torch.testing.assert_close(torch.tensor(s.logprobs), picked, atol=1e-5, rtol=0)
            assert all(p * p <= q + 1e-6 <= 1 + 2e-6 for p, q in zip(picked.exp().tolist(), s.sum_pi_sq))


def test_collect_asks_the_sampler_and_the_token_batch_carries_it(tiny_model):
    from polyrl.batch import TokenBatch
    from polyrl.rollout.collect import collect
    from polyrl.rollout.episodes import EpisodeRunner
    from polyrl.rollout.source import PromptStream
    from polyrl.tasks.arithmetic import AdditionTask
    from polyrl.tasks.rewards import RewardChannels

    _, tokenizer, gen = _sampler(tiny_model)
    task = AdditionTask()
    runner = EpisodeRunner(gen, tokenizer, task)
    params = SamplingParams(n=3, max_new_tokens=5, seed=2)
    batch = collect(runner.sample, RewardChannels(task), get_method("otb"), PromptStream.of(task, 0).take,
                    num_groups=2, params=params, history={})
    tb = TokenBatch.from_samples(batch.samples, gen.pad_id)
    assert tb.sum_pi_sq is not None and tb.sum_pi_sq.shape == tb.completion_mask.shape
    assert bool((tb.sum_pi_sq[tb.completion_mask > 0] > 0).all()) and bool((tb.sum_pi_sq * (1 - tb.completion_mask)
                                                                              == 0).all())
    assert tb.rows(slice(0, 2)).sum_pi_sq.shape[0] == 2
    plain = collect(runner.sample, RewardChannels(task), get_method("grpo"), PromptStream.of(task, 0).take,
                    num_groups=2, params=params, history={})
    assert TokenBatch.from_samples(plain.samples, gen.pad_id).sum_pi_sq is None  # off unless asked


@pytest.mark.parametrize("setting", [{"sampler": "tree"}, {"agency": "/x"}, {"async_staleness": 1},
                                     {"rollout_workers": 2}, {"preference_file": "pairs.jsonl"}])
def test_otb_refuses_the_layouts_without_sampler_statistics(setting):
    with pytest.raises(ConfigError, match=f"^{next(iter(setting))}|^rollout_workers") as e:
        check_combinations(build_config(setting), get_method("otb"), None)
    assert "\n" not in str(e.value)
    check_combinations(build_config({}), get_method("otb"), None)


@pytest.mark.parametrize("name", ["otb", "otb_tir"])
def test_otb_trains_a_few_steps(name, tiny_model, tmp_path):
    from polyrl.trainer import train
    from tests.test_trainer import QUIET, _cfg, _task

    train(_cfg(steps=3), get_method(name), model_dir=tiny_model, task=_task(), run_dir=str(tmp_path), console=QUIET)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "objective/adv_abs_mean" in r]
    assert len(steps) == 3 and all(r["objective/adv_abs_mean"] > 0 for r in steps)
    assert all(abs(r["objective/loss"]) < 1e3 and r["perf/grad_norm"] > 0 for r in steps)  # finite, and it learns
