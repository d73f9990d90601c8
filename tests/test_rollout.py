"""HF generator (KV-cache decode loop) against model.generate and completion_logprobs; tasks."""

from __future__ import annotations

import math
import warnings
from collections import Counter

import pytest
import torch

from polyrl.model import completion_logprobs, load_policy
from polyrl.rollout import HFGenerator, SamplingParams
from polyrl.shared_prompt import cache_keyword
from polyrl.tasks import TASKS, AdditionTask, Prompt, get_task
from polyrl.tinylm import build_tiny_llama

PROMPTS = ["12+34=", "7=", "hello 99+1=", "ab"]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    path = build_tiny_llama(tmp_path_factory.mktemp("tiny"), hidden=32, layers=2, heads=2, seed=0)
    threads = torch.get_num_threads()
    model, tokenizer = load_policy(path)
    torch.set_num_threads(threads)
    with torch.no_grad():  # peaked, varied distributions, and EOS likely enough to stop some rows
        gen = torch.Generator().manual_seed(3)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
        model.lm_head.weight[tokenizer.eos_token_id] *= 2.5
    return model, tokenizer


def left_pad(tokenizer, prompts):
    encoded = [tokenizer(p)["input_ids"] for p in prompts]
    width = max(map(len, encoded))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(e)) + e for e in encoded])
    attention = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
    return ids, attention


def rescore(model, tokenizer, samples, **sampling):
    """Recompute completion log-probs of samples with completion_logprobs (same layout as training)."""
    prompt_w = max(len(s.prompt_token_ids) for s in samples)
    comp_w = max(len(s.completion_token_ids) for s in samples)
    pad = tokenizer.pad_token_id
    ids = torch.full((len(samples), prompt_w + comp_w), pad)
    attention = torch.zeros_like(ids)
    mask = torch.zeros(len(samples), comp_w)
    for i, s in enumerate(samples):
        p, c = s.prompt_token_ids, s.completion_token_ids
        ids[i, prompt_w - len(p) : prompt_w + len(c)] = torch.tensor(p + c)
        attention[i, prompt_w - len(p) : prompt_w + len(c)] = 1
        mask[i, : len(c)] = 1
    with torch.no_grad():
        out = completion_logprobs(model, ids, attention, mask, **sampling)
    return out.logp, mask


def test_greedy_equals_model_generate_on_left_padded_batch(policy):
    model, tokenizer = policy
    samples = HFGenerator(model, tokenizer).generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.0))
    ids, attention = left_pad(tokenizer, PROMPTS)
    with torch.no_grad():
        expected = model.generate(
            input_ids=ids, attention_mask=attention, do_sample=False, max_new_tokens=12,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        )[:, ids.shape[1] :].tolist()
    reasons = set()
    for sample, row in zip(samples, expected):
        eos = tokenizer.eos_token_id
        reference = row[: row.index(eos) + 1] if eos in row else row
        assert sample.completion_token_ids == reference
        assert sample.finish_reason == ("stop" if eos in row else "length")
        reasons.add(sample.finish_reason)
    assert reasons == {"stop", "length"}  # both ways of finishing are exercised


def test_greedy_does_not_depend_on_micro_batching(policy):
    model, tokenizer = policy
    params = SamplingParams(n=2, max_new_tokens=10, temperature=0.0)
    whole = HFGenerator(model, tokenizer).generate(PROMPTS, params)
    split = HFGenerator(model, tokenizer, max_batch_size=3).generate(PROMPTS, params)
    assert [s.completion_token_ids for s in whole] == [s.completion_token_ids for s in split]
    assert [s.prompt_index for s in whole] == [0, 0, 1, 1, 2, 2, 3, 3]


SETTINGS = [dict(temperature=1.0), dict(temperature=0.7), dict(temperature=0.9, top_k=5, top_p=0.8)]


@pytest.mark.parametrize("sampling", SETTINGS)
def test_rollout_logprobs_equal_recomputed(policy, sampling):
    model, tokenizer = policy
    params = SamplingParams(n=4, max_new_tokens=16, seed=0, **sampling)
    samples = HFGenerator(model, tokenizer).generate(PROMPTS, params)
    logp, mask = rescore(model, tokenizer, samples, chunk_size=7, **sampling)
    rollout = torch.zeros_like(logp)
    for i, s in enumerate(samples):
        assert len(s.logprobs) == len(s.completion_token_ids) >= 1
        rollout[i, : len(s.logprobs)] = torch.tensor(s.logprobs)
    assert torch.isfinite(logp[mask == 1]).all()
    torch.testing.assert_close(logp, rollout, rtol=0, atol=1e-4)
    assert {s.finish_reason for s in samples} == {"stop", "length"}


def test_fp32_head_is_cast_once_with_the_same_rollouts(policy, monkeypatch):
    """With fp32_head on a bfloat16 model the sampler multiplies by one float32 copy of the head per call
    (float32_head): the rollouts equal those of casting the bfloat16 head at every token, as before."""
    import polyrl.rollout.hf as hf

    model, tokenizer = policy
    bf16 = type(model)(model.config).to(torch.bfloat16).eval()
    bf16.load_state_dict(model.state_dict())
    params = SamplingParams(n=3, max_new_tokens=6, temperature=1.0, seed=5)
    copies = []
    real = hf.float32_head
    monkeypatch.setattr(hf, "float32_head", lambda head: copies.append(head) or real(head))
    once = HFGenerator(bf16, tokenizer, fp32_head=True).generate(PROMPTS, params)
    assert len(copies) == 1 and copies[0].weight.dtype == torch.bfloat16
    monkeypatch.setattr(hf, "float32_head", lambda head: head)  # the bfloat16 head, cast by head_logits each call
    every = HFGenerator(bf16, tokenizer, fp32_head=True).generate(PROMPTS, params)
    assert [s.completion_token_ids for s in once] == [s.completion_token_ids for s in every]
    for a, b in zip(once, every):
        assert torch.equal(torch.as_tensor(a.logprobs), torch.as_tensor(b.logprobs))


def test_samples_are_consistent_and_seeded(policy):
    model, tokenizer = policy
    generator = HFGenerator(model, tokenizer)
    params = SamplingParams(n=3, max_new_tokens=8, seed=11)
    samples = generator.generate(PROMPTS, params)
    eos = tokenizer.eos_token_id
    for s in samples:
        assert s.prompt_token_ids == tokenizer(PROMPTS[s.prompt_index])["input_ids"]
        assert eos not in s.completion_token_ids[:-1]
        if s.finish_reason == "stop":
            assert s.completion_token_ids[-1] == eos
        else:
            assert len(s.completion_token_ids) == 8 and s.completion_token_ids[-1] != eos
        assert s.text == tokenizer.decode(s.completion_token_ids, skip_special_tokens=True)
    again = generator.generate(PROMPTS, params)
    other = generator.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=8, seed=12))
    assert [s.completion_token_ids for s in again] == [s.completion_token_ids for s in samples]
    assert [s.completion_token_ids for s in other] != [s.completion_token_ids for s in samples]


def test_sampling_frequencies_follow_the_processed_distribution(policy):
    """Empirical first-token frequencies match exp(rollout logprob); filtered tokens never appear."""
    model, tokenizer = policy
    params = SamplingParams(n=3000, max_new_tokens=1, temperature=0.8, top_k=4, seed=5)
    samples = HFGenerator(model, tokenizer, max_batch_size=1024).generate(["12+"], params)
    counts = Counter(s.completion_token_ids[0] for s in samples)
    probs = {s.completion_token_ids[0]: math.exp(s.logprobs[0]) for s in samples}
    assert len(counts) <= 4
    assert sum(probs.values()) == pytest.approx(1.0, abs=0.02)  # the sampled tokens carry all the mass
    for token, count in counts.items():
        p = probs[token]
        assert abs(count / 3000 - p) < 4 * math.sqrt(p * (1 - p) / 3000) + 1e-3


def test_load_weights(policy, tmp_path):
    model, tokenizer = policy
    other_path = build_tiny_llama(tmp_path, hidden=32, layers=2, heads=2, seed=7)
    other, _ = load_policy(other_path, threads=torch.get_num_threads())
    copy, _ = load_policy(other_path, threads=torch.get_num_threads())
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    generator = HFGenerator(copy, tokenizer)
    generator.load_weights(model.state_dict())
    expected = HFGenerator(model, tokenizer).generate(PROMPTS, greedy)
    assert [s.completion_token_ids for s in generator.generate(PROMPTS, greedy)] == [
        s.completion_token_ids for s in expected
    ]
    with pytest.raises(RuntimeError, match="Missing key"):
        generator.load_weights({"lm_head.weight": other.lm_head.weight})


def test_decoding_passes_the_cache_without_deprecation_warnings(policy):
    model, tokenizer = policy
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # transformers warns on the deprecated `past_key_values`
        warnings.simplefilter("error", DeprecationWarning)
        samples = HFGenerator(model, tokenizer).generate(PROMPTS, SamplingParams(max_new_tokens=4, temperature=0.0))
    assert len(samples) == len(PROMPTS)


def test_cache_keyword_follows_the_model_signature():
    class Current:
        def forward(self, input_ids, *, cache=None, use_cache=None): ...

    class Older:
        def forward(self, input_ids, *, past_key_values=None, use_cache=None): ...

    assert (cache_keyword(Current), cache_keyword(Older)) == ("cache", "past_key_values")


def test_sampling_params_validation():
    for bad in (dict(n=0), dict(max_new_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=0)):
        with pytest.raises(ValueError, match="SamplingParams"):
            SamplingParams(**bad)


def test_addition_reward():
    task = AdditionTask()
    prompt = Prompt(id="addition/12+34", text="12+34=", answer="46")
    assert task.reward(prompt, "46") == (1.0, {"correct": True})
    assert task.reward(prompt, " 46 \n")[0] == 1.0
    for wrong in ("47", "4", "460", "46+1", "", "4 6"):
        assert task.reward(prompt, wrong)[0] == 0.0


def test_addition_splits_are_disjoint_and_deterministic():
    task = get_task("addition")
    assert isinstance(TASKS["addition"](), AdditionTask)
    train = task.prompts("train", 20_000, seed=0)  # more than the split holds: cycles
    test = task.prompts("test", 2_000, seed=0)
    train_ids, test_ids = {p.id for p in train}, {p.id for p in test}
    assert not train_ids & test_ids
    assert len(train_ids) + len(test_ids) == 90 * 90  # every operand pair is in exactly one split
    assert 0.05 < len(test_ids) / 8100 < 0.15
    assert task.prompts("test", 5, seed=3) == AdditionTask().prompts("test", 5, seed=3)
    assert task.prompts("test", 5, seed=3) != task.prompts("test", 5, seed=4)
    first = task.prompts("train", 50, seed=1)
    assert len({p.id for p in first}) == 50  # no repetition while n fits the split
    for p in first:
        a, b = p.text[:-1].split("+")
        assert p.text.endswith("=") and p.answer == str(int(a) + int(b)) and 10 <= int(a) <= 99
    with pytest.raises(ValueError, match="split"):
        task.prompts("valid", 1, seed=0)
    with pytest.raises(ValueError, match="unknown task"):
        get_task("subtraction")
