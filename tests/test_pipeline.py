"""Asynchronous pipeline: the staleness bound, pushed weights reach the generation process, request matching,
and failures that surface instead of hanging."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from polyrl.batch import TokenBatch, logprobs_nograd
from polyrl.model import load_policy
from polyrl.rollout import HFGenerator, SamplingParams
from polyrl.rollout.episodes import EpisodeRunner
from polyrl.rollout.pipeline import JOIN_S, AsyncPipeline, PipelineError
from polyrl.tasks import get_task
from polyrl.tinylm import build_tiny_llama

TASK = get_task("addition")
PARAMS = SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=11)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model directory, weights(version) -> a distinct state dict per version)."""
    path = build_tiny_llama(tmp_path_factory.mktemp("tiny"), hidden=32, layers=1, heads=2, seed=0)
    model, _ = load_policy(path, threads=torch.get_num_threads())
    base = {name: t.clone() for name, t in model.state_dict().items()}

    def weights(version: int) -> dict[str, torch.Tensor]:
        if version == 0:
            return base
        gen = torch.Generator().manual_seed(version)
        return {name: t + 0.5 * torch.randn(t.shape, generator=gen) for name, t in base.items()}

    return str(path), weights


def local_samples(path: str, weights: dict[str, torch.Tensor], prompts, params):
    """What a synchronous EpisodeRunner/HFGenerator in this process samples at these weights."""
    model, tokenizer = load_policy(path, threads=torch.get_num_threads())
    generator = HFGenerator(model, tokenizer)
    generator.load_weights(weights)
    return EpisodeRunner(generator, tokenizer, TASK).sample(prompts, params)


def batch(step: int):
    return TASK.prompts("train", 2, seed=step)


@pytest.fixture(scope="module")
def pipelines(tiny, tmp_path_factory):
    """Started together: each spawn spends seconds importing torch and transformers, and they import in parallel.

    Tests share them; ``catch_up`` gives each test a fresh step. The close test (last) closes staleness 2's.
    """
    path, weights = tiny
    missing = str(tmp_path_factory.mktemp("empty") / "missing")
    started = {
        name: AsyncPipeline(model_dir, task_name="addition", data_file=None, staleness=k, weights=weights(0),
                            reference=name == 1, micro_batch_size=3)
        for name, model_dir, k in [(1, path, 1), (2, path, 2), ("broken", missing, 1)]
    }
    yield started
    for pipeline in started.values():
        pipeline.close()


def catch_up(pipeline: AsyncPipeline, weights) -> int:
    """Push new weights until the version reaches the next step the pipeline accepts; return that step."""
    step = pipeline.next_step
    for version in range(pipeline.version + 1, step + 1):
        pipeline.push(weights(version), version)
    return step


@pytest.mark.parametrize("k", [1, 2])
def test_staleness_is_bounded(pipelines, tiny, k):
    _, weights = tiny
    pipeline = pipelines[k]
    start = catch_up(pipeline, weights)
    lookahead = k + 2  # submitted further ahead than k: without the child's wait the bound would break
    for step in range(start, start + lookahead + 1):
        pipeline.submit(step, batch(step), PARAMS)
    staleness = []
    for m in range(start, start + 8):
        samples = pipeline.result(m, batch(m), PARAMS)
        assert samples is not None and len(samples) == 2 * PARAMS.n
        staleness += [m - s.policy_version for s in samples]
        assert all((s.ref_logprobs is not None) == (k == 1) for s in samples)  # scored only where asked
        time.sleep(0.2)  # the optimizer step: the generator runs ahead meanwhile
        pipeline.push(weights(m + 1), version=m + 1)
        pipeline.submit(m + lookahead + 1, batch(m + lookahead + 1), PARAMS)
    assert min(staleness) >= 0 and max(staleness) <= k
    assert max(staleness) >= 1, "the generator never ran ahead: the bound was not exercised"


def test_samples_equal_a_synchronous_generator_at_the_pushed_weights(pipelines, tiny):
    path, weights = tiny
    pipeline = pipelines[1]
    start = catch_up(pipeline, weights)
    prompts = batch(100)
    previous = None
    for step in (start + 1, start + 2):  # twice: the second request must see a push made after a generation
        pipeline.push(weights(step), step)
        pipeline.submit(step, prompts, PARAMS)
        samples = pipeline.result(step, prompts, PARAMS)
        expected = local_samples(path, weights(step), prompts, PARAMS)
        assert [s.policy_version for s in samples] == [step] * len(expected)
        assert [s.prompt_index for s in samples] == [s.prompt_index for s in expected]
        assert [s.completion_token_ids for s in samples] == [s.completion_token_ids for s in expected]
        for got, want in zip(samples, expected):
            torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), rtol=0, atol=1e-5)
        # the frozen reference (the starting weights) scored them in the generation process
        reference, _ = load_policy(path, threads=torch.get_num_threads())
        ref = logprobs_nograd(reference, TokenBatch.from_samples(samples, HFGenerator(reference, _).pad_id),
                              micro_batch_size=len(samples)).logp
        for i, got in enumerate(samples):
            want = ref[i, : len(got.completion_token_ids)]
            torch.testing.assert_close(torch.tensor(got.ref_logprobs), want, rtol=0, atol=1e-5)
            assert not torch.allclose(torch.tensor(got.ref_logprobs), torch.tensor(got.logprobs), atol=1e-3)
        tokens = [s.completion_token_ids for s in samples]
        assert tokens != previous  # the same prompts and seed: only the weights changed the samples
        previous = tokens


def test_mismatched_or_unsubmitted_requests_return_none(pipelines, tiny):
    _, weights = tiny
    pipeline = pipelines[1]
    first = catch_up(pipeline, weights)
    steps = [first, first + 1, first + 2]
    for step in steps:
        pipeline.submit(step, batch(step), PARAMS)
    assert pipeline.pending() == steps
    assert pipeline.result(first, batch(first + 50), PARAMS) is None  # other prompt ids
    assert pipeline.pending() == steps[1:]
    assert pipeline.result(first + 1, batch(first + 1), dataclasses.replace(PARAMS, seed=12)) is None  # other params
    assert pipeline.result(first + 3, batch(first + 3), PARAMS) is None  # never submitted: discards first + 2
    assert pipeline.pending() == []
    with pytest.raises(ValueError, match="submit: step must be >="):
        pipeline.submit(first + 2, batch(first + 2), PARAMS)
    # The discarded requests' messages are drained, not mistaken for the next request's result.
    step = catch_up(pipeline, weights)
    assert step == first + 3
    pipeline.submit(step, batch(step), PARAMS)
    samples = pipeline.result(step, batch(step), PARAMS)
    assert samples is not None and len(samples) == 2 * PARAMS.n and pipeline.pending() == []
    assert {s.policy_version for s in samples} == {step}


def test_child_error_is_raised_in_the_parent(pipelines):
    pipeline = pipelines["broken"]
    pipeline.submit(0, batch(0), PARAMS)
    with pytest.raises(PipelineError, match="FileNotFoundError: model directory not found"):
        pipeline.result(0, batch(0), PARAMS)
    with pytest.raises(PipelineError, match="model directory not found"):  # and stays failed
        pipeline.submit(1, batch(1), PARAMS)
    pipeline.close()
    assert not pipeline.alive and pipeline._process.exitcode == 1


def test_close_is_prompt_while_the_child_waits_for_weights(pipelines, tiny):
    _, weights = tiny
    pipeline = pipelines[2]
    step = catch_up(pipeline, weights) + 5
    pipeline.submit(step, batch(step), PARAMS)
    with pytest.raises(ValueError, match="would wait forever"):  # refused, not a hang
        pipeline.result(step, batch(step), PARAMS)
    time.sleep(0.2)  # the child takes the request and blocks waiting for version step - 2
    assert pipeline.alive
    start = time.monotonic()
    pipeline.close()
    assert time.monotonic() - start < JOIN_S  # it stopped by itself, not by terminate()
    assert not pipeline.alive and pipeline._process.exitcode == 0
    pipeline.close()  # idempotent
    with pytest.raises(PipelineError, match="closed"):
        pipeline.submit(step + 1, batch(step + 1), PARAMS)
