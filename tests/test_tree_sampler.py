"""Tree rollouts: the utilization objective, the predictor, branch points, tree advantages and the sampler."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from polyrl.methods import get_method
from polyrl.objectives.group_layout import tree_advantages
from polyrl.objectives.objective import policy_loss
from polyrl.registry import ADVANTAGES
from polyrl.rollout.episodes import Episode, EpisodeRunner
from polyrl.rollout.generator import Sample, SamplingParams
from polyrl.rollout.tree import (
    SuccessPredictor,
    TreeSampler,
    allocate_by_gain,
    allocate_rollouts,
    branch_points,
    expected_useful,
    inclusion_probabilities,
    p_mixed,
    prefix_estimate,
    systematic_sample,
)
from polyrl.tasks.base import Prompt
from polyrl.tasks.rewards import RewardChannels
from polyrl.tinylm import build_char_tokenizer
from polyrl.types import LossInputs, Normalizer, TreeInfo


@pytest.mark.parametrize("posterior", [False, True])
def test_rollout_objective_dp_equals_brute_force(posterior):
    rng = random.Random(1)
    for _ in range(150):
        M, B = rng.randint(1, 4), rng.randint(0, 12)
        p = [rng.choice([0.0, 1.0, rng.random()]) for _ in range(M)]
        s = [rng.uniform(0.3, 20.0) for _ in range(M)] if posterior else None
        options = [0, *range(2, 7)]

        def value(a, p=p, s=s):
            return sum(n * float(p_mixed(torch.tensor(q, dtype=torch.float64), torch.tensor(n),
                                         None if s is None else torch.tensor(s[m])))
                       for m, (q, n) in enumerate(zip(p, a)))

        brute = max(value(a) for a in itertools.product(options, repeat=M) if sum(a) <= B)
        alloc = allocate_rollouts(torch.tensor(p), B, n_min=2, n_max=6, objective="rollouts",
                                  strength=None if s is None else torch.tensor(s, dtype=torch.float64))
        assert alloc.sum() <= B
        assert value(alloc.tolist()) == pytest.approx(brute, abs=1e-9)


def test_gain_table_dp_equals_brute_force():
    rng = random.Random(2)
    for _ in range(150):
        M, K, B = rng.randint(1, 4), rng.randint(1, 5), rng.randint(0, 10)
        gain = torch.tensor([[0.0] + [rng.choice([-math.inf, rng.uniform(-1, 3)]) for _ in range(K)]
                             for _ in range(M)], dtype=torch.float64)
        best = max(sum(float(gain[m, n]) for m, n in enumerate(a))
                   for a in itertools.product(range(K + 1), repeat=M) if sum(a) <= B)
        alloc = allocate_by_gain(gain, B).tolist()
        assert sum(alloc) <= B and all(gain[m, n] > -math.inf for m, n in enumerate(alloc))
        assert sum(float(gain[m, n]) for m, n in enumerate(alloc)) == pytest.approx(best, abs=1e-9)
    with pytest.raises(ValueError, match=r"gain\[:, 0\] = 0"):
        allocate_by_gain(torch.ones(2, 3), 4)


def test_expected_useful_rollouts_of_a_group_with_known_outcomes():
    p, s = torch.tensor(0.5), torch.tensor(2.0)  # Beta(1, 1)
    # already mixed: every extra rollout is useful, whatever p
    assert float(expected_useful(torch.tensor(0.1), s, torch.tensor(3), 1, 1, 0)) == pytest.approx(3.0)
    # empty group: n P_mix
    for n in range(5):
        want = n * float(p_mixed(p, torch.tensor(n), s))
        assert float(expected_useful(p, s, torch.tensor(n), 0, 0, 0)) == pytest.approx(want)
    # two failures so far (idle): the group becomes mixed iff a success comes; E[(1-p)^2] = 1/3 under Beta(1, 1)
    assert float(expected_useful(p, s, torch.tensor(2), 0, 2, 2)) == pytest.approx((2 + 2) * (1 - 1 / 3))
    # successes only, a sure p: (n + idle) (1 - p^n)
    sure = torch.tensor(1e9)
    assert float(expected_useful(torch.tensor(0.8), sure, torch.tensor(3), 2, 0, 2)) == pytest.approx(5 * (1 - 0.512))
    # Monte Carlo: one failure so far, p ~ Beta(1.2, 1.8), two more rollouts
    torch.manual_seed(1)
    q = torch.distributions.Beta(torch.tensor(1.2), torch.tensor(1.8)).sample((200_000,))
    hit = (torch.rand(200_000, 2) < q[:, None]).any(1).double().mean() * 3
    assert float(expected_useful(torch.tensor(0.4), torch.tensor(3.0), torch.tensor(2), 0, 1, 1)) == pytest.approx(
        float(hit), abs=0.01)


def test_rollout_objective_prefers_large_groups_on_uncertain_anchors():
    # groups objective: spread over at least three anchors; rollouts objective: one full group of eight
    p = torch.tensor([0.5, 0.5, 0.5, 0.5])
    assert int((allocate_rollouts(p, 8, n_max=8) > 0).sum()) >= 3
    assert sorted(allocate_rollouts(p, 8, n_max=8, objective="rollouts").tolist()) == [0, 0, 0, 8]
    with pytest.raises(ValueError, match="objective = 'x'"):
        allocate_rollouts(p, 8, objective="x")


def test_success_predictor_posterior_under_a_fitted_population_prior():
    counts: dict[int, list[float]] = {}
    pred = SuccessPredictor(counts, prior_strength=2.0, min_prompts=2)
    mean, strength = pred.prompts([7])
    assert mean.tolist() == [0.5] and strength.tolist() == [2.0]  # no history at all: Beta(1, 1)
    pred.record(1, [1, 1, 1, 1])
    pred.record(2, [0, 0, 0, 0])
    pred.record(3, [1, 0, 1, 0])
    # m = 6 / 12; E[p^2] = mean(12/12, 0, 2/12) = 7/18; var = 7/18 - 1/4 = 5/36; s0 = (1/4) / (5/36) - 1 = 0.8
    m, s0 = pred.prior()
    assert (m, s0) == (pytest.approx(0.5), pytest.approx(0.8))
    mean, strength = pred.prompts([1, 3, 9])
    assert mean.tolist() == pytest.approx([(0.4 + 4) / 4.8, (0.4 + 2) / 4.8, 0.5])
    assert strength.tolist() == pytest.approx([4.8, 4.8, 0.8])
    # a bimodal pool makes an unseen prompt worth less than one seen at 1/2, though both have mean 1/2
    value = p_mixed(mean, torch.tensor(4), strength)
    assert value[1] > value[2] + 0.2
    # too few prompts with two trials: the fixed prior strength
    assert SuccessPredictor({1: [1.0, 2.0]}, prior_strength=3.0).prior() == (0.5, 3.0)
    # evidence ages: after one half-life without a visit the counts weigh 1/2, and a record adds to the aged counts
    aging = SuccessPredictor({}, half_life=10)
    aging.now = 5
    aging.record(4, [1, 1])
    aging.now = 15
    assert aging.prompts([4])[1].item() == pytest.approx(aging.prior()[1] + 1.0)  # 2 trials, one half-life old
    aging.record(4, [0, 0])
    assert aging.counts[4] == [1.0, 3.0, 15.0]
    aging.now = 35  # two half-lives later: 1/4 of (1 success, 3 trials)
    assert aging.prompts([4])[1].item() == pytest.approx(aging.prior()[1] + 0.75)
    # without a half-life (and for counts saved before visits were stamped) nothing ages
    assert SuccessPredictor({4: [1.0, 3.0]}, half_life=10).prompts([4])[1].item() == pytest.approx(2.0 + 3.0)
    assert prefix_estimate(2, 2, 0.25, 2.0) == pytest.approx((2 + 0.5) / 4)


def test_beta_binomial_p_mixed_by_hand_and_limits():
    # Beta(1, 1) (uniform p), n = 2: E[p^2] = 1/3, so P_mix = 1 - 2/3 = 1/3 (= E[2 p (1 - p)])
    assert float(p_mixed(torch.tensor(0.5), torch.tensor(2), torch.tensor(2.0))) == pytest.approx(1 / 3)
    # a very confident posterior is the point value; n < 2 is never mixed
    p = torch.tensor([0.2, 0.5, 0.9])
    sure = p_mixed(p, torch.tensor(4), torch.full((3,), 1e9))
    assert sure.tolist() == pytest.approx(p_mixed(p, torch.tensor(4)).tolist())
    assert p_mixed(p, torch.tensor(1), torch.full((3,), 2.0)).tolist() == [0.0, 0.0, 0.0]
    # Monte Carlo: draw p ~ Beta, then 3 Bernoulli(p)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    q = torch.distributions.Beta(torch.tensor(0.6), torch.tensor(0.9)).sample((200_000,))
    draws = torch.rand(200_000, 3, generator=g) < q[:, None]
    mixed = (draws.any(1) & ~draws.all(1)).double().mean()
    predicted = float(p_mixed(torch.tensor(0.4), torch.tensor(3), torch.tensor(1.5)))
    assert predicted == pytest.approx(float(mixed), abs=0.005)


def test_branch_points_turn_boundaries_and_half_length():
    e = Episode(prompt=Prompt("x", "x", "y"), prompt_ids=[1], token_ids=[5, 6, 7, 8, 9, 10],
                loss_mask=[1, 1, 0, 0, 1, 1], turn_ids=[0, 0, 0, 0, 1, 1])
    assert branch_points(e, multi_turn=True) == [4]
    assert branch_points(e, multi_turn=False) == [3]
    short = Episode(prompt=Prompt("x", "x", "y"), prompt_ids=[1], token_ids=[5], loss_mask=[1], turn_ids=[0])
    assert branch_points(short, multi_turn=False) == []


def test_tree_advantages_by_hand():
    # prompt 0: roots r0 = 1, r1 = 0, r2 = 0; anchor after 2 tokens of r1 (shared by r2), continuations c0 = 1, c1 = 0
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    tree = TreeInfo(root_ids=torch.zeros(5, dtype=torch.long), sibling_ids=torch.tensor([-1, 0, 0, 0, 0]),
                    branch_at=torch.tensor([0, 2, 2, 2, 2]), is_root=torch.tensor([True, True, True, False, False]))
    mask = torch.ones(5, 4, dtype=torch.float64)

    def centred(r, g, m):
        return ADVANTAGES.fn("group_centered")(r, g, m, None, None)

    adv = tree_advantages(centred, rewards, tree, mask)
    root_mean, sib_mean = 1 / 3, 1 / 4  # roots {1, 0, 0}; siblings {r1, r2, c0, c1} = {0, 0, 1, 0}
    assert adv[0].tolist() == pytest.approx([1 - root_mean] * 4)  # no branch: root advantage everywhere
    assert adv[1].tolist() == pytest.approx([0 - root_mean] * 2 + [0 - sib_mean] * 2)  # prefix root, then sibling
    assert adv[3, 2:].tolist() == pytest.approx([1 - sib_mean] * 2)
    assert adv[3, :2].tolist() == pytest.approx([0.0, 0.0])  # a continuation has no root advantage


def test_sample_weights_scale_each_sequences_whole_loss_kl_included():
    g = torch.Generator().manual_seed(0)
    B, T = 4, 5
    logp = (-torch.rand(B, T, generator=g)).requires_grad_()
    old = logp.detach() + 0.1 * torch.randn(B, T, generator=g)
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    base = dict(logp=logp, old_logp=old, adv=torch.randn(B, generator=g), mask=mask,
                normalizer=Normalizer.from_batch(mask, torch.tensor([0, 0, 1, 1]), horizon=T),
                ref_logp=old - 0.2 * torch.rand(B, T, generator=g), group_ids=torch.tensor([0, 0, 1, 1]))
    w = torch.tensor([2.0, 0.5, 1.0, 0.0])
    grpo = get_method("grpo")  # clipped surrogate plus a k3 KL term in the loss
    plain = policy_loss(LossInputs(**base), grpo)
    weighted = policy_loss(LossInputs(**base, sample_weight=w), grpo)
    torch.testing.assert_close(weighted.per_token_loss, plain.per_token_loss * w[:, None])
    (grad,) = torch.autograd.grad(weighted.loss, logp)
    assert bool((grad[3] == 0).all()) and bool((grad[0] != 0).any())  # weight 0: the sequence, KL and all, is out


def test_inclusion_probabilities_by_hand():
    # proportional to the weights and summing to k ...
    assert inclusion_probabilities(torch.tensor([1.0, 1.0, 2.0, 0.0]), 2).tolist() == pytest.approx([.5, .5, 1, 0])
    # ... an item whose share would pass 1 is drawn for sure, and the others share the rest: 9 of 12 with k = 2
    # would be 1.5, so it is 1 and the other three get 1/3 each
    assert inclusion_probabilities(torch.tensor([9.0, 1.0, 1.0, 1.0]), 2).tolist() == pytest.approx([1, 1 / 3, 1 / 3,
                                                                                                    1 / 3])
    assert inclusion_probabilities(torch.tensor([1.0, 0.0, 3.0]), 5).tolist() == [1.0, 0.0, 1.0]  # only two can go


def test_systematic_sampling_draws_each_item_with_its_inclusion_probability():
    pi = inclusion_probabilities(torch.tensor([0.05, 0.3, 0.9, 0.2, 0.6, 0.05, 0.4]), 3)
    x = torch.tensor([3.0, -1.0, 2.0, 5.0, 0.5, 7.0, -2.0])  # any per-item quantity (a prompt's gradient)
    grid = [(j + 0.5) / 4000 for j in range(4000)]  # the offset u is uniform: average over a fine grid of it
    hits, estimate = torch.zeros(len(pi), dtype=torch.float64), 0.0
    for u in grid:
        drawn = systematic_sample(pi, u)
        assert len(drawn) == len(set(drawn)) == 3
        hits[drawn] += 1
        estimate += float((x[drawn] / pi[drawn]).sum())
    assert (hits / len(grid)).tolist() == pytest.approx(pi.tolist(), abs=1e-3)
    # weighting a drawn item by 1 / pi makes the sum over the draw unbiased for the sum over all items
    assert estimate / len(grid) == pytest.approx(float(x.sum()), abs=1e-2)
    with pytest.raises(ValueError, match="u = 1.0"):
        systematic_sample(pi, 1.0)


class ScriptedGenerator:
    """Emits '1' or '2' then EOS; a prompt's chance of '1' (the right answer) is set per prompt text."""

    def __init__(self, tokenizer, p_right: dict[str, float]):
        self.tok, self.p_right, self.rng = tokenizer, p_right, random.Random(0)

    def generate_ids(self, prompt_ids, params, keys=None):
        out = []
        for i, ids in enumerate(prompt_ids):
            text = self.tok.decode(ids, skip_special_tokens=True)
            head = text.split("=")[0] + "="
            rest = text[len(head):]
            n_more = 2 - len(rest)
            chars = [("1" if self.rng.random() < self.p_right[head] else "2") for _ in range(max(0, n_more))]
            comp = self.tok("".join(chars), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            comp = comp[: params.max_new_tokens]
            out.append(Sample(prompt_index=i, prompt_token_ids=list(ids), completion_token_ids=comp,
                              logprobs=[-0.5] * len(comp), finish_reason="stop", text=""))
        return out


class TwoCharTask:
    name = "two"

    def reward(self, prompt, text):
        return (1.0 if text.strip() == prompt.answer else 0.0), {}


TWO_CHAR = RewardChannels(TwoCharTask())  # the training reward: the task's checker alone


def test_tree_sampler_spends_the_budget_skips_decided_prompts_and_builds_sibling_groups():
    tok = build_char_tokenizer()
    prompts = [Prompt(f"p{k}", f"{k}=", "11") for k in range(8)]
    p_right = {f"{k}=": 0.0 for k in range(8)}
    p_right.update({"0=": 0.7, "1=": 0.7, "2=": 1.0, "3=": 1.0})
    counts = {0: [1.0, 2.0], 1: [1.0, 2.0], 2: [8.0, 8.0], 3: [8.0, 8.0], 4: [0.0, 8.0], 5: [0.0, 8.0],
              6: [0.0, 8.0], 7: [0.0, 8.0]}
    runner = EpisodeRunner(ScriptedGenerator(tok, p_right), tok, TwoCharTask())
    sampler = TreeSampler(runner, counts, root_frac=0.5, candidate_factor=2.0, prune=0.2)
    stream = iter(range(100))

    def draw(k):
        return [(i % 8, prompts[i % 8]) for i in (next(stream) for _ in range(k))]

    params = SamplingParams(n=8, max_new_tokens=4, seed=0)
    batch = sampler.collect(TWO_CHAR, get_method("grpo"), draw, num_groups=4, params=params, history={})
    assert len(batch.samples) <= 4 * 8
    roots = batch.tree.is_root
    # only the two uncertain prompts (history 1/2) get root rollouts; decided ones are pruned
    assert set(batch.group_ids[roots].tolist()) <= {0, 1}
    assert batch.stats["tree/continuations"] > 0
    sib = batch.tree.sibling_ids
    for a in sib[sib >= 0].unique().tolist():  # each sibling group shares its prefix up to branch_at
        members = (sib == a).nonzero().squeeze(1).tolist()
        cut = int(batch.tree.branch_at[members[0]])
        prefixes = {tuple(batch.samples[i].completion_token_ids[:cut]) for i in members}
        assert len(prefixes) == 1 and len(members) >= 3
    # continuations do not train on the copied prefix
    for i in (~roots).nonzero().squeeze(1).tolist():
        cut = int(batch.tree.branch_at[i])
        assert batch.samples[i].loss_mask[:cut] == [0] * cut and all(batch.samples[i].loss_mask[cut:])
    assert counts[0][1] > 2  # the predictor's history grew with the root outcomes


def _four_prompts(p_right: list[float]):
    """A scripted runner over prompts "0=" .. "3=" (answer "11"; prompt k answers right with p_right[k]) and a draw
    that cycles through them."""
    tok = build_char_tokenizer()
    prompts = [Prompt(f"p{k}", f"{k}=", "11") for k in range(4)]
    runner = EpisodeRunner(ScriptedGenerator(tok, {f"{k}=": p for k, p in enumerate(p_right)}), tok, TwoCharTask())
    return runner, lambda k: [(i % 4, prompts[i % 4]) for i in range(k)]


def test_without_branching_the_extension_only_grows_root_groups():
    runner, draw = _four_prompts([0.5, 0.5, 1.0, 0.0])
    counts = {0: [10.0, 20.0], 1: [10.0, 20.0], 2: [20.0, 20.0], 3: [0.0, 20.0]}
    params = SamplingParams(n=4, max_new_tokens=4, seed=0)
    sampler = TreeSampler(runner, counts, root_frac=0.5, candidate_factor=2.0, prune=0.05, max_group=4, branch=False)
    batch = sampler.collect(TWO_CHAR, get_method("grpo"), draw, num_groups=4, params=params, history={})
    # the same call with branching gives continuations (their uncertain prefixes "1" / "2" are anchors) ...
    branching = TreeSampler(runner, {k: list(v) for k, v in counts.items()}, root_frac=0.5, candidate_factor=2.0,
                            prune=0.05, max_group=4)
    with_branches = branching.collect(TWO_CHAR, get_method("grpo"), draw, num_groups=4, params=params,
                                      history={})
    assert with_branches.stats["tree/continuations"] > 0
    # ... without, every rollout is a root of a probed prompt: no sibling groups, no branch points
    assert bool(batch.tree.is_root.all()) and batch.stats["tree/continuations"] == 0
    assert (batch.tree.sibling_ids == -1).all() and int(batch.tree.branch_at.max()) == 0
    assert set(batch.group_ids.tolist()) <= {0, 1} and len(batch.samples) == 16  # the budget, on uncertain prompts


def test_a_mixed_probe_is_extended_past_the_group_size():
    runner, draw = _four_prompts([0.5, 1.0, 0.0, 0.0])
    counts = {0: [10.0, 20.0], 1: [20.0, 20.0], 2: [0.0, 20.0], 3: [0.0, 20.0]}
    sampler = TreeSampler(runner, counts, root_frac=0.25, candidate_factor=2.0, prune=0.05)
    params = SamplingParams(n=4, max_new_tokens=4, seed=0)
    batch = sampler.collect(TWO_CHAR, get_method("grpo"), draw, num_groups=2, params=params, history={})
    # a probe of two on the uncertain prompt, then the rest of the budget joins its root group (past G = 4);
    # the decided prompts get nothing
    assert batch.group_ids.tolist() == [0] * 8 and bool(batch.tree.is_root.all())
    assert batch.stats["tree/roots_extended"] == 6
    assert batch.stats["rollout/utilization"] == (1.0 if len(set(batch.scores.tolist())) == 2 else 0.0)
    # with max_group = G the prompt's root group stops at G; the rest of the budget goes elsewhere
    capped = TreeSampler(runner, dict(counts), root_frac=0.25, candidate_factor=2.0, prune=0.05, max_group=4)
    batch = capped.collect(TWO_CHAR, get_method("grpo"), draw, num_groups=2, params=params, history={})
    assert int((batch.group_ids[batch.tree.is_root] == 0).sum()) == 4


def test_shared_predictor_predicts_unseen_prompts_from_similar_ones():
    """With features, a prompt never seen gets the pass rate of the prompts like it; history alone cannot tell."""
    gen = torch.Generator().manual_seed(0)

    def embed(texts):  # class "a" prompts vs class "b" prompts, plus noise dimensions
        cls = torch.tensor([[1.0, 0.0] if t.startswith("a") else [0.0, 1.0] for t in texts])
        return torch.cat([cls, 0.1 * torch.randn(len(texts), 3, generator=gen)], 1)

    shared, history = SuccessPredictor({}, embed=embed), SuccessPredictor({})
    rates = {"a": 0.9, "b": 0.2}
    rng = torch.Generator().manual_seed(1)
    ids, texts = list(range(40)), [("a" if i % 2 else "b") + str(i) for i in range(40)]
    shared.prompts(ids, texts)  # features are taken when a prompt is first a candidate
    for i, t in zip(ids, texts):
        scores = (torch.rand(8, generator=rng) < rates[t[0]]).float().tolist()
        shared.record(i, scores)
        history.record(i, scores)
    mean, strength = shared.prompts([100, 101], ["a-new", "b-new"])
    assert mean[0] > 0.8 and mean[1] < 0.3
    assert strength[0] > history.prior()[1]  # the residual spread is smaller than the pool's
    h_mean, _ = history.prompts([100, 101])
    assert h_mean[0] == h_mean[1]
    # too few prompts seen: the pool prior, as without features
    few = SuccessPredictor({}, embed=embed)
    few.prompts([0, 1], ["a0", "b1"])
    few.record(0, [1, 1])
    assert few.prompts([5], ["a5"])[0].item() == pytest.approx(few.prior()[0])


def test_prompt_features_do_not_depend_on_batch_padding(tmp_path):
    """The shared predictor's features: a prompt's mean hidden state is the same alone or padded in a batch."""
    from polyrl.learner import prompt_embedder
    from polyrl.model import load_policy
    from polyrl.tinylm import build_tiny_llama

    model, tokenizer = load_policy(str(build_tiny_llama(tmp_path / "m", hidden=32, layers=2, heads=2, seed=0)))
    embed = prompt_embedder(model, tokenizer)
    both = embed(["12+34=", "123+456="])
    assert both.shape == (2, 32)
    assert torch.allclose(embed(["12+34="])[0], both[0], atol=1e-5)
    assert not torch.allclose(both[0], both[1], atol=1e-3)


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 5)])
def test_answer_likelihood_is_the_samplers_probability_of_the_answer(tmp_path, temperature, top_k):
    """The likelihood predictor: P(completion == answer) under the sampling distribution, as the sampler itself
    reports it for a completion it drew (ended by EOS, or by the cap when the answer is exactly that long), alone or
    padded in a batch; 0 for an answer longer than the cap."""
    from polyrl.learner import LocalLearner, answer_likelihood
    from polyrl.model import load_policy
    from polyrl.rollout.hf import HFGenerator
    from polyrl.tinylm import build_tiny_llama

    model, tokenizer = load_policy(str(build_tiny_llama(tmp_path / "m", hidden=32, layers=2, heads=2, seed=0)))
    learner = LocalLearner(model, lr=1e-4, weight_decay=0.0, warmup_steps=0, max_grad_norm=1.0,
                           temperature=temperature, top_p=1.0, top_k=top_k, fp32_head=False, micro_batch_size=4)
    generator = HFGenerator(model, tokenizer)
    texts = ["12+34=", "123+456=", "7+8="]
    # An untrained model rarely writes EOS within 6 tokens: 64 draws per prompt give a few that do.
    drawn = generator.generate(texts, SamplingParams(n=64, max_new_tokens=6, temperature=temperature,
                                                     top_k=top_k or None, seed=0))
    eos = tokenizer.eos_token_id  # completions that are exactly (their text's tokens, EOS)
    done = [s for s in drawn if s.text and s.completion_token_ids == [
        *tokenizer(s.text, add_special_tokens=False)["input_ids"], eos]]
    assert len(done) >= 3, f"only {len(done)} completions ended in EOS"
    prompts = [Prompt(f"p{i}", texts[s.prompt_index], s.text) for i, s in enumerate(done)]
    likelihood = answer_likelihood(learner, generator, max_new_tokens=6)
    got = likelihood(prompts)
    want = torch.tensor([math.exp(sum(s.logprobs)) for s in done], dtype=torch.float64)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-9)
    assert torch.allclose(likelihood(prompts[:1]), got[:1], rtol=1e-5)
    assert float(likelihood([Prompt("x", "7+8=", "99999")])) < float(got.max())
    # at the cap the answer needs no EOS (a capped completion is scored as it is); past the cap it cannot be written
    s, n = done[0], len(done[0].completion_token_ids) - 1
    capped = answer_likelihood(learner, generator, max_new_tokens=n)([prompts[0]])
    assert float(capped) == pytest.approx(math.exp(sum(s.logprobs[:-1])), rel=1e-4)
    assert float(answer_likelihood(learner, generator, max_new_tokens=n - 1)([prompts[0]])) == 0.0 or n == 1


def test_the_likelihood_predictor_replaces_the_history():
    """Probes go to the prompts the likelihood calls uncertain, whatever their pass-rate history says."""
    runner, draw = _four_prompts([0.5, 0.5, 1.0, 0.0])
    counts = {0: [20.0, 20.0], 1: [0.0, 20.0], 2: [10.0, 20.0], 3: [10.0, 20.0]}  # history: the opposite
    scripted = {"0=": 0.5, "1=": 0.5, "2=": 1.0, "3=": 0.0}
    params = SamplingParams(n=4, max_new_tokens=4, seed=0)
    for likelihood, probed in ((None, [2, 3]), (lambda ps: torch.tensor([scripted[p.text] for p in ps]), [0, 1])):
        sampler = TreeSampler(runner, {k: list(v) for k, v in counts.items()}, root_frac=0.5, candidate_factor=1.0,
                              prune=0.05, max_group=4, branch=False, likelihood=likelihood)
        batch = sampler.collect(TWO_CHAR, get_method("grpo"), draw, num_groups=4, params=params, history={})
        assert torch.bincount(batch.group_ids, minlength=4)[probed].tolist() == [4, 4]  # a full probe each
        if likelihood is not None:  # p = 1 and p = 0 are known decided: no rollout at all
            assert set(batch.group_ids.tolist()) == {0, 1}


def test_sampled_roots_weigh_each_prompt_by_its_inverse_inclusion_probability():
    tok = build_char_tokenizer()
    prompts = [Prompt(f"p{k}", f"{k}=", "11") for k in range(8)]
    p_right = {f"{k}=": [0.5, 0.5, 1.0, 1.0, 0.0, 0.0, 0.3, 0.9][k] for k in range(8)}
    counts = {0: [2.0, 4.0], 1: [2.0, 4.0], 2: [8.0, 8.0], 3: [8.0, 8.0], 4: [0.0, 8.0], 5: [0.0, 8.0]}
    runner = EpisodeRunner(ScriptedGenerator(tok, p_right), tok, TwoCharTask())
    ids = list(range(8))
    mean, strength = SuccessPredictor({k: list(v) for k, v in counts.items()}).prompts(ids)
    pi = inclusion_probabilities(p_mixed(mean, torch.full((8,), 4.0), strength).clamp_min(0.05), 2)
    assert 0 < float(pi.min()) < float(pi.max()) < 1  # decided prompts keep a small chance
    seen = set()
    for seed in range(12):
        sampler = TreeSampler(runner, {k: list(v) for k, v in counts.items()}, root_frac=0.5, candidate_factor=1.0,
                              roots="sample")
        batch = sampler.collect(TWO_CHAR, get_method("grpo"), lambda k: [(i, prompts[i]) for i in range(k)],
                                num_groups=8, params=SamplingParams(n=4, max_new_tokens=4, seed=seed), history={})
        roots = batch.group_ids[batch.tree.is_root]
        drawn = roots.unique().tolist()
        assert len(drawn) == 4 and all(int((roots == k).sum()) >= 4 for k in drawn)  # groups of G, only drawn ones
        assert set(batch.group_ids.tolist()) == set(drawn)  # the extension starts no undrawn prompt
        w = batch.sample_weight
        assert batch.stats["tree/weight_max"] == float(w.max())  # (mean 1 in expectation: the next test)
        # a prompt's samples together weigh 1 / pi: weight x samples x pi is the same for every drawn prompt
        per_prompt = [float(w[batch.group_ids == k].sum()) * float(pi[k]) for k in drawn]
        assert per_prompt == pytest.approx([per_prompt[0]] * len(drawn))
        seen |= set(drawn)
    assert seen & {2, 3, 4, 5}  # decided-looking prompts are still drawn now and then


def test_sampled_root_weights_give_every_candidate_its_uniform_share_in_expectation():
    """Averaged over systematic sampling's offset, each candidate's total weight is N / M: the loss of prompts drawn
    uniformly. Scaling by the batch's own mean weight (as before) depends on the draw: with one group drawn every
    weight was 1, and prompts kept their inclusion probability as their share."""
    from polyrl.rollout.tree.allocation import root_weights, systematic_sample

    for pi in (torch.tensor([0.25, 0.75, 0.5, 0.5], dtype=torch.float64),  # k = 2 of M = 4
               torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)):  # k = 1: one group drawn
        G, shares = 4, torch.zeros(4, dtype=torch.float64)
        offsets = torch.arange(2000, dtype=torch.float64) / 2000 + 1 / 4000
        for u in offsets.tolist():
            owner = torch.tensor([m for m in systematic_sample(pi, u) for _ in range(G)])
            shares.index_add_(0, owner, root_weights(owner, pi).double())
        shares /= len(offsets)
        N = G * round(float(pi.sum()))
        torch.testing.assert_close(shares, torch.full((4,), N / 4, dtype=torch.float64), rtol=2e-3, atol=2e-3)


def test_a_kl_penalty_in_the_reward_compares_siblings_after_their_branch_point():
    """A sibling group holds a root rollout and continuations of its prefix; the continuations' copied prefix has no
    loss tokens. With the same KL penalty on every token, the root rollout carried its prefix's penalty alone: r1 and
    c0 both solve the task, yet r1's advantage after the branch was -0.5 and c0's +1.0."""
    from polyrl.objectives.group_layout import advantages
    from polyrl.types import TreeInfo

    rewards = torch.tensor([0.0, 1.0, 1.0, 0.0])  # roots r0, r1; continuations c0, c1 of r1 after 2 tokens
    tree = TreeInfo(root_ids=torch.zeros(4, dtype=torch.long), sibling_ids=torch.tensor([-1, 0, 0, 0]),
                    branch_at=torch.tensor([0, 2, 2, 2]), is_root=torch.tensor([True, True, False, False]))
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 1, 1]], dtype=torch.float32)
    adv, _ = advantages(get_method("rloo"), rewards, torch.zeros(4, dtype=torch.long), mask,
                        token_rewards=torch.full((4, 4), -0.5), tree=tree)
    assert adv[1, 2:].tolist() == adv[2, 2:].tolist() == [0.5, 0.5]  # r1 and c0 alike: 1 - mean of the others
    assert adv[3, 2:].tolist() == [-1.0, -1.0]


@pytest.mark.parametrize("wrong", [0.0, 0.4])
def test_a_prefix_of_a_group_that_never_succeeded_is_pruned_whatever_a_failure_scores(wrong):
    """The prefix estimate counts successes (a score above 1/2), as the candidates' posterior does: with partial credit
    (a wrong answer scoring 0.4, as the code task's share of asserts) the raw mean kept never-solved prefixes open."""

    class Partial:
        name = "partial"

        def reward(self, prompt, text):
            return (1.0 if text.strip() == prompt.answer else wrong), {}

    tok, task = build_char_tokenizer(), Partial()
    prompts = [Prompt(f"p{k}", f"{k}=", "11") for k in range(2)]
    runner = EpisodeRunner(ScriptedGenerator(tok, {"0=": 0.0, "1=": 0.0}), tok, task)  # never right
    pruned = 0
    for seed in range(6):
        sampler = TreeSampler(runner, {}, root_frac=0.5, prune=0.05)
        batch = sampler.collect(RewardChannels(task), get_method("grpo"),
                                lambda k: [(i % 2, prompts[i % 2]) for i in range(k)], num_groups=2,
                                params=SamplingParams(n=4, max_new_tokens=4, seed=seed), history={})
        pruned += batch.stats["tree/anchors_pruned"]
    assert pruned == 6
