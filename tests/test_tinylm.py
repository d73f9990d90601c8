"""Tiny Llama + character tokenizer: round trip through from_pretrained; warm-start caching."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from polyrl.model import load_policy
from polyrl.tasks import AdditionTask
from polyrl.tinylm import DEFAULT_CHARSET, WarmstartError, _build, build_tiny_llama, warmstart

SMALL = dict(hidden=16, layers=1, heads=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny"), hidden=32, layers=2, heads=2, seed=0)


def test_tokenizer_round_trip(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (
        0, 1, 2, 3,
    )
    assert len(tokenizer) == 4 + len(DEFAULT_CHARSET)
    ids = tokenizer("12+34= ab\n")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 1 + len("12+34= ab\n")  # one token per character
    assert tokenizer.decode(ids, skip_special_tokens=True) == "12+34= ab\n"
    assert tokenizer.decode(ids[1:] + [tokenizer.eos_token_id]) == "12+34= ab\n<eos>"
    assert tokenizer("1€2")["input_ids"][2] == tokenizer.unk_token_id
    assert tokenizer("12<eos>")["input_ids"][-1] == tokenizer.eos_token_id  # special tokens are matched whole


def test_model_round_trip_and_seeding(model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.hidden_size == 32
    assert model.config.eos_token_id == 2 and model.config.vocab_size == 4 + len(DEFAULT_CHARSET)
    size = dict(hidden=32, layers=2, heads=2)
    same = AutoModelForCausalLM.from_pretrained(build_tiny_llama(tmp_path / "same", seed=0, **size))
    other = AutoModelForCausalLM.from_pretrained(build_tiny_llama(tmp_path / "other", seed=1, **size))
    for (name, a), b, c in zip(model.state_dict().items(), same.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b), name
        if name.endswith("proj.weight"):
            assert not torch.equal(a, c), name
    ids = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, same(ids).logits, rtol=0, atol=0)


def test_default_size_and_rng_untouched():
    state = torch.random.get_rng_state()
    model, _ = _build(DEFAULT_CHARSET, 128, 4, 4, None, 256, 0)
    assert torch.equal(torch.random.get_rng_state(), state)  # initialisation does not consume the global RNG
    params = sum(p.numel() for p in model.parameters())
    assert 0.9e6 < params < 1.2e6
    with pytest.raises(ValueError, match="divisible"):
        _build(DEFAULT_CHARSET, 30, 1, 4, None, 64, 0)


def test_warmstart_caches_and_loads(tmp_path):
    kwargs = dict(threshold=0.0, eval_every=2, max_steps=10, batch_size=4, eval_size=8, progress=False, **SMALL)
    first = warmstart(AdditionTask(), tmp_path, seed=0, **kwargs)
    assert not first.cached and first.steps == 2  # stops at the first evaluation reaching the threshold
    assert first.path.startswith(str(tmp_path / "addition-h16-l1-seed0-"))
    started = time.perf_counter()
    again = warmstart("addition", tmp_path, seed=0, **kwargs)
    assert time.perf_counter() - started < 1.0
    assert again.cached and again.path == first.path and again.steps == first.steps
    assert warmstart("addition", tmp_path, seed=1, **kwargs).path != first.path  # keyed by seed
    model, tokenizer = load_policy(first.path, threads=torch.get_num_threads())
    assert model.config.hidden_size == 16 and tokenizer.eos_token_id == 2
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no staging left


def test_warmstart_reports_failure_at_max_steps(tmp_path):
    with pytest.raises(WarmstartError, match="max_steps=3"):
        warmstart("addition", tmp_path, threshold=1.0, eval_every=2, max_steps=3, batch_size=4, eval_size=8,
                  progress=False, **SMALL)
    assert not list(tmp_path.iterdir())  # nothing cached after a failure
    with pytest.raises(ValueError, match="threshold"):
        warmstart("addition", tmp_path, threshold=1.5, progress=False)
