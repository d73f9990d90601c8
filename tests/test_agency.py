"""Agency transfer (spec §9 (e)): the arbiter's extremes, its baseline share, and its mixture log-probs.

Two tiny Llamas share the character tokenizer: the learner, and a baseline that is either an
unrelated model (another seed) or the learner with a perturbed LM head, whose top-3 supports
overlap the learner's, so some tokens have probability under both policies.
"""

from __future__ import annotations

import copy
import math
from collections import Counter

import pytest
import torch
from scipy.stats import chi2

from polyrl.model import load_policy, process_logits
from polyrl.rollout import HFGenerator, SamplingParams
from polyrl.rollout.agency import AgencyArbiter, parse_schedule
from polyrl.tinylm import build_tiny_llama

Z99 = 2.5758  # two-sided 99% normal quantile


def _perturbed(path, seed: int, scale: float = 0.3):
    """A tiny model with noisy weights: peaked, varied next-token distributions."""
    model, tokenizer = load_policy(path, threads=torch.get_num_threads())
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return model, tokenizer


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(learner, far baseline from another seed, near baseline sharing part of the support, tokenizer)."""
    root = tmp_path_factory.mktemp("agency")
    learner, tokenizer = _perturbed(build_tiny_llama(root / "l", hidden=32, layers=1, heads=2, seed=0), seed=10)
    far, _ = _perturbed(build_tiny_llama(root / "b", hidden=32, layers=1, heads=2, seed=1), seed=11)
    near = copy.deepcopy(learner)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(12)
        near.lm_head.weight.add_(torch.randn(near.lm_head.weight.shape, generator=gen) * 0.3)
    return learner, far, near, tokenizer


def _mixed(learner, baseline, tokenizer, beta: float, mode: str, **kwargs) -> HFGenerator:
    gen = HFGenerator(learner, tokenizer, **kwargs)
    gen.arbiter = AgencyArbiter(baseline, lambda step: beta, mode=mode)
    return gen


# ---------------------------------------------------------------- 1. the extremes reproduce one policy


@pytest.mark.parametrize("mode", ["token", "sequence"])
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_beta_one_is_the_baseline_and_beta_zero_the_learner(models, mode, temperature):
    learner, baseline, _, tok = models
    # Stop tokens make rows finish at different steps (rows and both caches get dropped mid-batch);
    # max_batch_size 3 splits the 8 rows into chunks that continue one random stream.
    params = SamplingParams(n=4, max_new_tokens=10, temperature=temperature, seed=5,
                            stop_token_ids=tuple(range(4, 30)))
    prompts = ["12+3=", "ab"]
    schedule = parse_schedule("linear:steps=10")
    gen = HFGenerator(learner, tok, max_batch_size=3)
    gen.arbiter = AgencyArbiter(baseline, schedule, mode=mode)
    for step, alone_model in ((0, baseline), (10, learner)):
        assert gen.arbiter.set_step(step) == (1.0 if step == 0 else 0.0)
        mixed = gen.generate(prompts, params)
        alone = HFGenerator(alone_model, tok, max_batch_size=3).generate(prompts, params)
        assert [s.completion_token_ids for s in mixed] == [s.completion_token_ids for s in alone]
        assert [s.finish_reason for s in mixed] == [s.finish_reason for s in alone]
        for m, a in zip(mixed, alone):
            torch.testing.assert_close(torch.tensor(m.logprobs), torch.tensor(a.logprobs), atol=1e-6, rtol=0)
            assert m.baseline_tokens == (len(m.completion_token_ids) if step == 0 else 0)
    lengths = {len(s.completion_token_ids) for s in alone}
    assert len(lengths) > 1, "the stop tokens should end rows at different steps"


def test_the_two_policies_sample_differently(models):
    """Guard for the test above: with this seed the baseline and the learner alone disagree."""
    learner, baseline, _, tok = models
    params = SamplingParams(n=4, max_new_tokens=10, seed=5)
    a = HFGenerator(learner, tok).generate(["12+3="], params)
    b = HFGenerator(baseline, tok).generate(["12+3="], params)
    assert [s.completion_token_ids for s in a] != [s.completion_token_ids for s in b]


# ---------------------------------------------------------------- 2. the baseline's share is beta


def _within_ci(successes: int, trials: int, p: float) -> bool:
    return abs(successes / trials - p) <= Z99 * math.sqrt(p * (1 - p) / trials)


def test_token_mode_baseline_share_is_beta(models):
    learner, baseline, _, tok = models
    beta = 0.3
    gen = _mixed(learner, baseline, tok, beta, "token")
    samples = gen.generate(["12+3=", "ab"], SamplingParams(n=300, max_new_tokens=8, seed=1))
    tokens = sum(len(s.completion_token_ids) for s in samples)
    chosen = sum(s.baseline_tokens for s in samples)
    assert tokens > 3000
    assert _within_ci(chosen, tokens, beta), (chosen, tokens)
    # per token, so a completion is usually written by both
    assert sum(0 < s.baseline_tokens < len(s.completion_token_ids) for s in samples) > len(samples) // 2


def test_sequence_mode_writes_whole_completions_with_share_beta(models):
    learner, baseline, _, tok = models
    beta = 0.3
    gen = _mixed(learner, baseline, tok, beta, "sequence")
    samples = gen.generate(["12+3=", "ab"], SamplingParams(n=1000, max_new_tokens=3, seed=2))
    assert all(s.baseline_tokens in (0, len(s.completion_token_ids)) for s in samples)
    assert all(s.completion_token_ids for s in samples)
    by_baseline = sum(s.baseline_tokens > 0 for s in samples)
    assert _within_ci(by_baseline, len(samples), beta), (by_baseline, len(samples))


# ---------------------------------------------------------------- 3. mixture log-probs are exact


def _processed_logp(model, ids: list[int], top_k: int) -> torch.Tensor:
    """Log-probs [V] of the next token: full forward pass (no cache, no padding), then process_logits."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    return process_logits(logits, top_k=top_k).log_softmax(-1).double()


def _exact_distribution(learner, baseline, prompt_ids, eos_id, beta, mode, top_k, steps=2):
    """Every completion of at most ``steps`` tokens with its mixture probability, and the per-token
    (log p_learner, log p_baseline) along it, enumerated from independent forward passes."""
    out = {}

    def walk(prefix: tuple[int, ...], lp_l: float, lp_b: float, factors: list, p_token: float):
        ll, lb = _processed_logp(learner, prompt_ids + list(prefix), top_k), _processed_logp(
            baseline, prompt_ids + list(prefix), top_k)
        support = torch.nonzero(torch.isfinite(ll) | torch.isfinite(lb)).squeeze(1).tolist()
        for tok in support:
            a, b = float(ll[tok]), float(lb[tok])
            y = prefix + (tok,)
            step_factors = factors + [(a, b)]
            mix_token = beta * math.exp(b) + (1 - beta) * math.exp(a)
            if len(y) == steps or tok == eos_id:
                seq = beta * math.exp(lp_b + b) + (1 - beta) * math.exp(lp_l + a)
                out[y] = (p_token * mix_token if mode == "token" else seq, step_factors)
            else:
                walk(y, lp_l + a, lp_b + b, step_factors, p_token * mix_token)

    walk((), 0.0, 0.0, [], 1.0)
    return out


@pytest.mark.parametrize("mode", ["token", "sequence"])
@pytest.mark.parametrize("which", ["near", "far"])
def test_mixture_logprob_matches_sampling_frequencies(models, mode, which):
    learner, far, near, tok = models
    baseline = near if which == "near" else far
    beta, n, top_k = 0.4, 4000, 3
    prompt = "12+3="
    prompt_ids = tok(prompt)["input_ids"]
    gen = _mixed(learner, baseline, tok, beta, mode, max_batch_size=n)
    samples = gen.generate([prompt], SamplingParams(n=n, max_new_tokens=2, top_k=top_k, seed=3))
    exact = _exact_distribution(learner, baseline, prompt_ids, tok.eos_token_id, beta, mode, top_k)
    assert sum(p for p, _ in exact.values()) == pytest.approx(1.0, abs=1e-6)  # float32 softmax

    # Reported log-probs against independently computed mixtures.
    reported: dict[tuple[int, ...], list[float]] = {}
    for s in samples:
        y = tuple(s.completion_token_ids)
        assert y in exact, f"completion {y} is outside the mixture's support"
        reported.setdefault(y, s.logprobs)
        assert s.logprobs == reported[y]  # a completion's log-probs do not depend on who wrote it
    for y, logprobs in reported.items():
        p, factors = exact[y]
        assert math.exp(sum(logprobs)) == pytest.approx(p, rel=1e-5)
        if mode == "token":  # each token: log(beta p_b + (1 - beta) p_l)
            want = [math.log(beta * math.exp(b) + (1 - beta) * math.exp(a)) for a, b in factors]
            assert logprobs == pytest.approx(want, abs=1e-5)
        else:  # the sequence mixture log(beta P_b(y) + (1 - beta) P_l(y)) in total
            P_l, P_b = math.exp(sum(a for a, _ in factors)), math.exp(sum(b for _, b in factors))
            assert sum(logprobs) == pytest.approx(math.log(beta * P_b + (1 - beta) * P_l), abs=1e-5)

    # Frequencies against exp(sum of reported log-probs): per outcome, then Pearson chi-square.
    counts = Counter(tuple(s.completion_token_ids) for s in samples)
    assert len(counts) >= 8, "the test needs several distinct completions"
    for y, c in counts.items():
        q = math.exp(sum(reported[y]))
        assert abs(c / n - q) <= 4.5 * math.sqrt(q * (1 - q) / n), (y, c / n, q)
    expected = {y: p * n for y, (p, _) in exact.items()}
    big = [y for y, e in expected.items() if e >= 5]
    observed = [counts.get(y, 0) for y in big] + [n - sum(counts.get(y, 0) for y in big)]
    wanted = [expected[y] for y in big] + [n - sum(expected[y] for y in big)]
    if wanted[-1] < 1e-9:
        observed, wanted = observed[:-1], wanted[:-1]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, wanted))
    assert chi2.sf(stat, df=len(wanted) - 1) > 1e-3, (stat, len(wanted))


def test_sequence_mode_first_token_logprob_is_the_marginal_mixture(models):
    """Before any token, the posterior over the writer is the prior: log mu_1 = log(beta p_b + (1-beta) p_l)."""
    learner, _, near, tok = models
    beta = 0.4
    prompt_ids = tok("12+3=")["input_ids"]
    gen = _mixed(learner, near, tok, beta, "sequence")
    samples = gen.generate(["12+3="], SamplingParams(n=50, max_new_tokens=2, top_k=3, seed=4))
    ll, lb = _processed_logp(learner, prompt_ids, 3), _processed_logp(near, prompt_ids, 3)
    for s in samples:
        t = s.completion_token_ids[0]
        want = math.log(beta * math.exp(float(lb[t])) + (1 - beta) * math.exp(float(ll[t])))
        assert s.logprobs[0] == pytest.approx(want, abs=1e-5)


# ---------------------------------------------------------------- 4. schedules


def test_linear_schedule_values():
    beta = parse_schedule("linear:steps=10")
    assert [beta(s) for s in (0, 5, 10, 11, 100)] == [1.0, 0.5, 0.0, 0.0, 0.0]


def test_exp_and_step_schedules():
    exp = parse_schedule("exp:tau=2")
    assert exp(0) == 1.0 and exp(2) == pytest.approx(math.exp(-1.0))
    step = parse_schedule(" step:steps=3 ")
    assert [step(s) for s in (0, 2, 3, 4)] == [1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("cosine:steps=10", "is not allowed"),
        ("linear", "is not allowed"),
        ("linear:steps=abc", "is not allowed"),
        ("linear:tau=10", "takes steps="),
        ("exp:steps=10", "takes tau="),
        ("linear:steps=2.5", "steps must be int"),
        ("linear:steps=0", "must be > 0"),
        ("exp:tau=-1", "must be > 0"),
    ],
)
def test_bad_schedules_name_the_value(text, fragment):
    with pytest.raises(ValueError) as info:
        parse_schedule(text)
    message = str(info.value)
    assert repr(text) in message and fragment in message and "\n" not in message


def test_arbiter_rejects_unknown_mode(models):
    with pytest.raises(ValueError, match="agency_mode = 'turn' is not allowed"):
        AgencyArbiter(models[1], lambda step: 1.0, mode="turn")


def test_arbiter_follows_its_schedule_and_freezes_the_baseline(models):
    learner, _, near, _ = models
    baseline = copy.deepcopy(near).train()
    arbiter = AgencyArbiter(baseline, parse_schedule("linear:steps=4"))
    assert arbiter.beta == 1.0 and arbiter.active
    assert arbiter.set_step(1) == 0.75 and arbiter.beta == 0.75
    assert arbiter.set_step(4) == 0.0 and not arbiter.active
    assert not baseline.training and not any(p.requires_grad for p in baseline.parameters())


def test_evaluating_the_mixture_is_the_same_in_every_run(models):
    """Greedy tokens need no randomness but the arbiter's coins do: the evaluator seeds them by the step."""
    from polyrl.evaluation import Evaluator
    from polyrl.rollout.episodes import EpisodeRunner
    from polyrl.tasks.arithmetic import AdditionTask

    learner, far, _, tokenizer = models

    class DigitShare(AdditionTask):  # a dense reward, so that different coins show in the score
        def reward(self, prompt, text):
            return sum(ch.isdigit() for ch in text) / max(1, len(text)), {}

    task = DigitShare()
    gen = _mixed(learner, far, tokenizer, 0.5, "token")
    evaluate = Evaluator(EpisodeRunner(gen, tokenizer, task), task, task.prompts("test", 16, seed=0), 6, gen.arbiter)
    gen.arbiter.schedule = lambda step: 0.5
    first, again = evaluate(3)[0], evaluate(3)[0]
    assert first == again
    assert evaluate(4)[0]["eval/reward_mean"] != first["eval/reward_mean"]  # another step draws other coins


def test_the_baseline_share_counts_the_trained_samples_only():
    """A filter (overlong_filter) leaves a sample in the batch with keep False: its baseline tokens are not trained,
    and counting them over the kept samples' tokens gave a share of 3.67 at beta = 1."""
    import types

    from polyrl.rollout.agency.arbiter import AgencySource
    from polyrl.rollout.generator import Sample

    class Arbiter:  # beta = 1: the baseline chose every token
        beta = 1.0

        def set_step(self, step):
            return 1.0

    def sample(n):
        return Sample(0, [1], list(range(n)), [0.0] * n, "length" if n == 8 else "stop", "", baseline_tokens=n)

    class Inner:
        def collect(self, method, stream, step):
            return types.SimpleNamespace(samples=[sample(3), sample(8)], keep=torch.tensor([True, False]), stats={})

    assert AgencySource(Inner(), Arbiter()).collect(None, None, 0).stats["agency/baseline_share"] == 1.0
