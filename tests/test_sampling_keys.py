"""Per-row sampling keys: a completion depends on (seed, key) only, never on the rows beside it.

Rollouts are split across worker processes, so the same seed must give the same completions whether a
list is generated in one call or in contiguous chunks (other batch sizes, other orders), for the plain
sampler, for episodes (single-turn and multi-turn tool use) and for the agency arbiter's coins.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from polyrl.model import load_policy, process_logits
from polyrl.rollout import HFGenerator, SamplingParams
from polyrl.rollout.agency import AgencyArbiter
from polyrl.rollout.episodes import EpisodeRunner
from polyrl.rollout.generator import draw_tokens
from polyrl.tasks import AdditionTask, CalculatorTask, Prompt
from polyrl.tinylm import build_tiny_llama

PROMPTS = ["12+34=", "7=", "hello 99+1=", "ab", "3*4=", "x"]


def _perturbed(path, seed: int):
    """A tiny model with noisy weights (peaked, varied distributions) and EOS and '>' likely enough."""
    model, tokenizer = load_policy(path, threads=torch.get_num_threads())
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
        model.lm_head.weight[tokenizer.eos_token_id] *= 2.5
        stop = tokenizer(">", add_special_tokens=False)["input_ids"][0]
        model.lm_head.weight[stop] *= 2.0
    return model, tokenizer


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(learner, baseline, tokenizer): two unrelated tiny Llamas on the same character tokenizer."""
    root = tmp_path_factory.mktemp("keys")
    learner, tokenizer = _perturbed(build_tiny_llama(root / "l", hidden=32, layers=1, heads=2, seed=0), seed=3)
    baseline, _ = _perturbed(build_tiny_llama(root / "b", hidden=32, layers=1, heads=2, seed=1), seed=4)
    return learner, baseline, tokenizer


def _same(a, b) -> None:
    """Samples or episodes agree: tokens exactly, log-probs within 1e-5, and the rest of the bookkeeping."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        tokens = "completion_token_ids" if hasattr(x, "completion_token_ids") else "token_ids"
        assert getattr(x, tokens) == getattr(y, tokens)
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5, rel=0)
        for name in ("finish_reason", "loss_mask", "turn_ids", "baseline_tokens"):
            assert getattr(x, name) == getattr(y, name), name


# ---------------------------------------------------------------- (a) the generator's rows


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.8, top_k=5, top_p=0.9)])
def test_a_row_does_not_depend_on_its_batch(models, sampling):
    learner, _, tok = models
    params = SamplingParams(n=2, max_new_tokens=12, seed=7, **sampling)
    ids = tok(PROMPTS)["input_ids"]
    whole = HFGenerator(learner, tok).generate_ids(ids, params)
    keys = list(range(len(whole)))
    assert len({len(s.completion_token_ids) for s in whole}) > 1, "rows should finish at different steps"
    assert any(whole[2 * i].completion_token_ids != whole[2 * i + 1].completion_token_ids
               for i in range(len(PROMPTS))), "the copies of a prompt have different keys, so different draws"
    assert [s.completion_token_ids for s in HFGenerator(learner, tok).generate(PROMPTS, params)] == [
        s.completion_token_ids for s in whole]

    one_by_one = HFGenerator(learner, tok, max_batch_size=1).generate_ids(ids, params)
    _same(whole, one_by_one)
    alone = [s for i in range(len(ids)) for s in HFGenerator(learner, tok).generate_ids(
        [ids[i]], params, keys=keys[2 * i : 2 * i + 2])]
    _same(whole, alone)
    order = [3, 0, 5, 1, 4, 2]
    shuffled = HFGenerator(learner, tok, max_batch_size=4).generate_ids(
        [ids[i] for i in order], params, keys=[keys[2 * i + j] for i in order for j in range(2)])
    _same([whole[2 * i + j] for i in order for j in range(2)], shuffled)

    other = HFGenerator(learner, tok).generate_ids(ids, params, keys=[k + 100 for k in keys])
    assert [s.completion_token_ids for s in other] != [s.completion_token_ids for s in whole]


def test_keys_must_match_the_rows(models):
    learner, _, tok = models
    with pytest.raises(ValueError, match="3 keys for 4 rows"):
        HFGenerator(learner, tok).generate(["ab", "cd"], SamplingParams(n=2, seed=0), keys=[0, 1, 2])


# ---------------------------------------------------------------- (b) episodes: one call equals its chunks


class AnswersEveryCall(CalculatorTask):
    """A tool task whose environment answers any turn that ends with '>', so random models take several turns."""

    def respond(self, prompt: Prompt, transcript: str) -> str | None:
        return f"{len(transcript)}\n"


def _prompts() -> list[Prompt]:
    return [Prompt(id=f"p{i}", text=text, answer="0") for i, text in enumerate(PROMPTS[:4])]


@pytest.mark.parametrize("task", [AdditionTask(), AnswersEveryCall()], ids=["single-turn", "tool"])
def test_run_equals_its_chunks(models, task):
    learner, _, tok = models
    params = SamplingParams(max_new_tokens=14, temperature=1.0, seed=11)
    runner = EpisodeRunner(HFGenerator(learner, tok), tok, task)
    whole = runner.run(runner.new(_prompts(), 2), params)
    assert len(whole) == 8
    split = EpisodeRunner(HFGenerator(learner, tok, max_batch_size=2), tok, task)
    chunks = split.run(split.new(_prompts(), 2)[:3], params) + split.run(split.new(_prompts(), 2)[3:], params,
                                                                          key_offset=3)
    _same(whole, chunks)
    if isinstance(task, AnswersEveryCall):
        assert any(max(e.turn_ids) > 0 for e in whole), "some episode should call the tool and go on"
        assert any(0 in e.loss_mask for e in whole)


def test_sample_equals_its_prompt_chunks(models):
    learner, _, tok = models
    params = SamplingParams(n=2, max_new_tokens=10, seed=5)
    runner = EpisodeRunner(HFGenerator(learner, tok), tok, AdditionTask())
    prompts = _prompts()
    whole = runner.sample(prompts, params)
    first, rest = runner.sample(prompts[:1], params), runner.sample(prompts[1:], params, key_offset=2)
    _same(whole, first + rest)


# ---------------------------------------------------------------- (c) the draws follow the processed distribution


def test_first_token_frequencies_over_keys_follow_the_processed_distribution(models):
    learner, _, tok = models
    n, top_k, temperature = 4000, 4, 0.8
    params = SamplingParams(n=n, max_new_tokens=1, temperature=temperature, top_k=top_k, seed=9)
    samples = HFGenerator(learner, tok, max_batch_size=1000).generate(["12+"], params)
    with torch.no_grad():
        logits = learner(torch.tensor([tok("12+")["input_ids"]])).logits[0, -1].float()
    probs = process_logits(logits, temperature=temperature, top_k=top_k).softmax(-1)
    counts = Counter(s.completion_token_ids[0] for s in samples)
    assert set(counts) <= set(torch.nonzero(probs > 0).squeeze(1).tolist())  # filtered tokens never appear
    assert len(counts) == top_k
    for token, count in counts.items():
        p = float(probs[token])
        assert abs(count / n - p) < 4 * math.sqrt(p * (1 - p) / n), (token, count / n, p)
    for s in samples:
        assert s.logprobs[0] == pytest.approx(math.log(probs[s.completion_token_ids[0]]), abs=1e-5)


def test_inverse_cdf_never_picks_a_filtered_token():
    logp = torch.tensor([[-math.inf, 0.1, -math.inf, -math.inf, 0.3, -math.inf]]).log_softmax(-1)
    edges = torch.tensor([0.0, 1e-12, 0.5, 1 - 2**-24, 1.0])  # 1.0 is outside the contract, still safe
    tokens = draw_tokens(logp.expand(len(edges), -1), edges)
    assert tokens.tolist() == [1, 1, 4, 4, 4]
    grid = (torch.arange(10_000) + 0.5) / 10_000  # evenly spread uniforms give the probabilities back
    counts = torch.bincount(draw_tokens(logp.expand(len(grid), -1), grid), minlength=6) / len(grid)
    assert counts.tolist() == pytest.approx(logp.exp()[0].tolist(), abs=2e-4)


# ---------------------------------------------------------------- (d) the agency arbiter's coins


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_arbiter_coins_keep_the_chunk_invariance(models, mode):
    learner, baseline, tok = models

    def runner(max_batch_size: int) -> EpisodeRunner:
        gen = HFGenerator(learner, tok, max_batch_size=max_batch_size)
        gen.arbiter = AgencyArbiter(baseline, lambda step: 0.5, mode=mode)
        return EpisodeRunner(gen, tok, AnswersEveryCall())

    params = SamplingParams(max_new_tokens=12, seed=2)
    one = runner(256)
    whole = one.run(one.new(_prompts(), 2), params)
    split = runner(3)
    chunks = split.run(split.new(_prompts(), 2)[:3], params) + split.run(split.new(_prompts(), 2)[3:], params,
                                                                          key_offset=3)
    _same(whole, chunks)
    shares = [e.baseline_tokens / len(e.token_ids) for e in whole]
    assert any(0 < share for share in shares) and any(share < 1 for share in shares), "both policies act"

    ids = tok(PROMPTS)["input_ids"]
    gen = one.generator
    batch = gen.generate_ids(ids, SamplingParams(n=2, max_new_tokens=8, seed=4))
    alone = [s for i in range(len(ids)) for s in gen.generate_ids([ids[i]], SamplingParams(
        n=2, max_new_tokens=8, seed=4), keys=[2 * i, 2 * i + 1])]
    _same(batch, alone)
