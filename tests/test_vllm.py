"""``--generator vllm``: what is refused (CPU, always run), the mismatch metric every run logs, and -- marked ``gpu``,
run with ``pytest -m gpu tests/test_vllm.py`` on a CUDA machine with ``pip install 'polyrl[vllm]'`` -- the engine's
tokens and log-probs against the trainer's recomputation, in-place weight updates, and two training steps."""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest
import torch

from polyrl.build import add_train_args, resolve_train
from polyrl.config import ConfigError


def _resolve(argv, tmp_path):
    parser = argparse.ArgumentParser()
    add_train_args(parser)
    return resolve_train(parser.parse_args([*argv, "--run-dir", str(tmp_path / "never-written")]))


@pytest.mark.parametrize("argv,name", [
    (["--agency", "{model}"], "agency"),
    (["--rollout-workers", "1"], "rollout_workers"),
    (["--async-staleness", "1"], "async_staleness"),
    (["--nproc", "2"], "nproc"),
    (["--sampler", "tree", "--tree-predictor", "shared"], "tree_predictor"),
    (["--vllm-gpu-memory-utilization", "0"], "vllm_gpu_memory_utilization"),
    (["--vllm-gpu-memory-utilization", "1.5"], "vllm_gpu_memory_utilization"),
    (["--temperature", "2.5"], "temperature"),  # vLLM refuses it at its first request, after the engine started
    (["--temperature", "0.005"], "temperature"),  # vLLM samples at 0.01; the trainer would score at 0.005
])
def test_vllm_refuses_what_it_cannot_do_in_one_line(tiny_model, tmp_path, argv, name):
    argv = [a.format(model=tiny_model) for a in argv]
    with pytest.raises(ConfigError) as e:
        _resolve(["--model", tiny_model, "--generator", "vllm", *argv], tmp_path)
    assert name in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.skipif(torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None,
                    reason="this machine can run vLLM")
def test_vllm_without_a_gpu_or_the_package_is_refused(tiny_model, tmp_path):
    with pytest.raises(ConfigError, match=r"needs a CUDA GPU and `pip install 'polyrl\[vllm\]'`") as e:
        _resolve(["--model", tiny_model, "--generator", "vllm"], tmp_path)
    assert "\n" not in str(e.value)


def test_memory_share_without_vllm_is_refused(tiny_model, tmp_path):
    with pytest.raises(ConfigError, match="vllm_gpu_memory_utilization .* only applies with --generator vllm"):
        _resolve(["--model", tiny_model, "--vllm-gpu-memory-utilization", "0.5"], tmp_path)


@pytest.fixture
def vllm_available(monkeypatch):
    """Pretend this machine has CUDA and the vllm package (resolving a run loads neither)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_vllm_adds_tis_unless_a_correction_is_given(tiny_model, tmp_path, vllm_available):
    plan = _resolve(["--model", tiny_model, "--generator", "vllm", "--vllm-gpu-memory-utilization", "0.5"], tmp_path)
    assert [c.name for c in plan.method.corrections] == ["tis"]
    assert any("TIS" in note for note in plan.notes)
    plan = _resolve(["--model", tiny_model, "--generator", "vllm", "--correction", "none"], tmp_path)
    assert plan.method.corrections == ()
    assert [c.name for c in _resolve(["--model", tiny_model], tmp_path).method.corrections] == []


def test_the_engine_stops_where_hf_generator_does_and_fits_its_context(monkeypatch):
    """vLLM's engine (a stand-in with its LLM's surface) gets max_model_len -1, so it fits the context to its memory
    (a long-context model at the default memory share stopped its start); its EOS set is HFGenerator's: the
    generation config's and the tokenizer's, the text config's only without a generation config (the model config's
    extra EOS made the two backends stop on different tokens; a composite config has no top-level eos_token_id)."""
    import sys
    import types

    from polyrl.rollout import vllm as backend

    class LLM:
        def __init__(self, **kw):
            self.kw = kw
            self.llm_engine = types.SimpleNamespace(model_config=config)

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM))
    tokenizer = types.SimpleNamespace(eos_token_id=2, pad_token_id=None)
    config = types.SimpleNamespace(hf_config=types.SimpleNamespace(eos_token_id=3), try_get_generation_config=dict,
                                   hf_text_config=types.SimpleNamespace(eos_token_id=5))
    generator = backend.VLLMGenerator("model_dir", tokenizer)
    assert generator.llm.kw["max_model_len"] == -1 and generator.eos_ids == [2, 5] and generator.pad_id == 2
    assert backend.VLLMGenerator("model_dir", tokenizer, max_model_len=4096).llm.kw["max_model_len"] == 4096
    config.try_get_generation_config = lambda: {"eos_token_id": [2, 4]}
    config.hf_text_config = types.SimpleNamespace()  # no eos_token_id on a composite config's top level
    assert backend.VLLMGenerator("model_dir", tokenizer).eos_ids == [2, 4]


def test_row_seeds_depend_on_seed_and_key_alone():
    from polyrl.rollout.vllm import row_seed  # imports no vllm: that happens when an engine is built

    seeds = [row_seed(7, key) for key in range(64)]
    assert len(set(seeds)) == 64 and all(0 <= s < 2**63 for s in seeds)
    assert seeds == [row_seed(7, key) for key in range(64)] and row_seed(8, 0) != seeds[0]


def test_an_hf_run_logs_a_zero_logp_mismatch(tiny_model, tmp_path):
    from polyrl.cli import main

    run_dir = tmp_path / "run"
    code = main(["train", "--model", tiny_model, "--steps", "2", "--prompts-per-step", "2", "--group-size", "2",
                 "--max-new-tokens", "4", "--eval-prompts", "2", "--eval-every", "0", "--checkpoint-every", "0",
                 "--log-every", "0", "--no-tensorboard", "--threads", "1", "--run-dir", str(run_dir)])
    assert code == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2
    assert all(0 <= r["rollout/logp_mismatch"] < 1e-4 for r in steps), [r["rollout/logp_mismatch"] for r in steps]


# --- GPU: a real engine ------------------------------------------------------------------------------------------

gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    from polyrl.tinyhf import build_tiny

    # head_dim 32: every attention backend of vLLM takes it
    return str(build_tiny("qwen2", tmp_path_factory.mktemp("qwen"), hidden_size=128, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=256, seed=0))


@pytest.fixture(scope="module")
def engine(qwen_dir):
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from transformers import AutoTokenizer

    from polyrl.rollout.vllm import VLLMGenerator

    return VLLMGenerator(qwen_dir, AutoTokenizer.from_pretrained(qwen_dir), dtype="float32",
                         gpu_memory_utilization=0.2, seed=0)


@gpu
@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, None), (0.7, 0.9, 20), (0.0, 1.0, None)])
def test_vllm_log_probs_equal_the_trainers_recomputation(engine, qwen_dir, temperature, top_p, top_k):
    from polyrl.batch import TokenBatch
    from polyrl.model import completion_logprobs, load_policy
    from polyrl.rollout.generator import SamplingParams

    model, tokenizer = load_policy(qwen_dir, dtype="float32")
    params = SamplingParams(n=4, max_new_tokens=24, temperature=temperature, top_p=top_p, top_k=top_k, seed=3)
    prompts = ["Question: how much is seven plus five?", "Hello world"]
    samples = engine.generate(prompts, params)
    assert len(samples) == 8 and [s.prompt_index for s in samples] == [0] * 4 + [1] * 4
    for s in samples:
        assert len(s.logprobs) == len(s.completion_token_ids) >= 1
        assert (s.finish_reason == "stop") == (s.completion_token_ids[-1] in engine.eos_ids)
    tb = TokenBatch.from_samples(samples, engine.pad_id)
    out = completion_logprobs(model, tb.input_ids, tb.attention_mask, tb.completion_mask,
                              temperature=temperature or 1.0, top_k=None if temperature == 0 else top_k,
                              top_p=None if temperature == 0 else top_p, with_entropy=False)
    gap = ((out.logp - tb.rollout_logp).abs() * tb.completion_mask).sum() / tb.completion_mask.sum()
    assert gap < 1e-3, float(gap)
    again = engine.generate(prompts, params)  # per-row seeds: the same call gives the same rows
    assert [s.completion_token_ids for s in again] == [s.completion_token_ids for s in samples]


@gpu
def test_vllm_loads_new_weights_in_place(engine, qwen_dir):
    from polyrl.model import load_policy
    from polyrl.rollout.generator import SamplingParams

    model, _ = load_policy(qwen_dir, dtype="float32")
    original = {k: v.clone() for k, v in model.state_dict().items()}
    params = SamplingParams(n=1, max_new_tokens=16, temperature=0.0)
    before = engine.generate(["Hello world"], params)
    moved = {k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v for k, v in original.items()}
    engine.load_weights(moved)
    after = engine.generate(["Hello world"], params)
    assert after[0].logprobs != before[0].logprobs
    engine.load_weights(original)
    assert engine.generate(["Hello world"], params)[0].logprobs == pytest.approx(before[0].logprobs, abs=1e-5)


@gpu
def test_two_training_steps_with_vllm(qwen_dir, tmp_path):
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from polyrl.cli import main

    run_dir = tmp_path / "run"
    code = main(["train", "--model", qwen_dir, "--generator", "vllm", "--vllm-gpu-memory-utilization", "0.2",
                 "--steps", "2", "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "8",
                 "--eval-prompts", "2", "--eval-every", "0", "--checkpoint-every", "0", "--log-every", "0",
                 "--no-tensorboard", "--run-dir", str(run_dir)])
    assert code == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2
    assert all(0 <= r["rollout/logp_mismatch"] < 1e-2 for r in steps), [r["rollout/logp_mismatch"] for r in steps]
