"""Architecture coverage (issue 18): tiny random-init models of real architectures through the whole pipeline.

Each row builds a model with ``polyrl.tinyhf`` (hidden 64, 2 layers, a locally trained byte-level BPE
tokenizer), then checks: it loads with ``load_policy``; ``HFGenerator`` (left padding, sampled, prompts of
different lengths, n=2) reports log-probs equal to a teacher-forced ``completion_logprobs`` (fp32, 1e-4);
polyrl's logits equal plain transformers' ``model(...).logits``; two RL steps through ``train`` give a
finite loss and change the weights; the final checkpoint, exported with ``export_hf``, reloads with
``AutoModelForCausalLM.from_pretrained`` and gives the logits of the trained policy.
"""

from __future__ import annotations

import io
import json
import math

import pytest
import torch
from rich.console import Console

from polyrl.config import ConfigError, build_config
from polyrl.learner.sharded import export_hf
from polyrl.methods import get_method
from polyrl.model import completion_logprobs, head_logits, linear_head, load_policy, logit_softcap
from polyrl.rollout.generator import SamplingParams
from polyrl.rollout.hf import HFGenerator
from polyrl.tasks.arithmetic import AdditionTask
from polyrl.tinyhf import ARCHITECTURES, END_OF_TURN, build_tiny, train_bpe_tokenizer
from polyrl.trainer import train

QUIET = Console(file=io.StringIO(), width=120)
PROMPTS = ["7+5=", "48+95=", "The answer to 123+456 is"]  # different lengths: left padding matters

# (arch, tied, variant): variant "pad_eos" = the pad token is EOS; "multi_eos" = two EOS ids in generation_config
ROWS = [
    ("llama", False, ""),
    ("llama", True, "pad_eos"),
    ("qwen2", True, "multi_eos"),
    ("qwen3", False, ""),
    ("mistral", False, "pad_eos"),
    ("gemma2", True, ""),
    ("gemma3_text", True, "multi_eos"),
    ("phi3", False, "multi_eos"),
    ("gpt2", True, "pad_eos"),
    ("olmo2", False, ""),
    ("lfm2", True, ""),
    ("qwen3_5", False, "multi_eos"),
]
PARAMS = [
    pytest.param(arch, tied, variant, id=f"{arch}-{'tied' if tied else 'untied'}{'-' + variant if variant else ''}",
                 marks=[] if arch in ARCHITECTURES else pytest.mark.skip(reason=f"transformers lacks {arch}"))
    for arch, tied, variant in ROWS
]


@pytest.fixture(scope="module")
def tokenizers():
    return {False: train_bpe_tokenizer(), True: train_bpe_tokenizer(pad_is_eos=True)}


def _policy_logits(model, input_ids, attention_mask):
    """Logits [B, L, V] as polyrl computes them: base model hidden states through head_logits."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=False).last_hidden_state
    return head_logits(hidden, linear_head(model), softcap=logit_softcap(model))


def _teacher_forced(model, samples, pad_id):
    """Left-padded prompts followed by right-padded completions, as the trainer lays them out."""
    width_p = max(len(s.prompt_token_ids) for s in samples)
    width_c = max(len(s.completion_token_ids) for s in samples)
    ids = torch.full((len(samples), width_p + width_c), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    comp = torch.zeros((len(samples), width_c), dtype=torch.long)
    for row, s in enumerate(samples):
        p, c = s.prompt_token_ids, s.completion_token_ids
        ids[row, width_p - len(p) : width_p] = torch.tensor(p)
        ids[row, width_p : width_p + len(c)] = torch.tensor(c)
        mask[row, width_p - len(p) : width_p + len(c)] = 1
        comp[row, : len(c)] = 1
    with torch.no_grad():
        out = completion_logprobs(model, ids, mask, comp, with_entropy=False)
    return out.logp, comp


@pytest.mark.parametrize("arch,tied,variant", PARAMS)
def test_architecture(arch, tied, variant, tokenizers, tmp_path):
    tokenizer = tokenizers[variant == "pad_eos"]
    model_dir = build_tiny(arch, tmp_path / "model", tied=tied, tokenizer=tokenizer, multi_eos=variant == "multi_eos")

    # loads; tied-ness as asked
    model, tok = load_policy(model_dir, threads=1)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    if variant == "pad_eos":
        assert tok.pad_token_id == tok.eos_token_id
    generator = HFGenerator(model, tok)
    if variant == "multi_eos":
        assert generator.eos_ids == sorted([tok.eos_token_id, tok.convert_tokens_to_ids(END_OF_TURN)])

    # polyrl's logits are transformers' logits (soft-capping, scaling, ...)
    batch = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    positions = (batch["attention_mask"].cumsum(-1) - 1).clamp_min(0)  # absolute positions (GPT-2) need them
    with torch.no_grad():
        ours = _policy_logits(model, batch["input_ids"], batch["attention_mask"])
        theirs = model(**batch, position_ids=positions).logits.float()
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-4, rtol=1e-4)

    # rollout log-probs = teacher-forced log-probs (fp32)
    samples = generator.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=12, temperature=1.0, seed=3))
    assert len(samples) == 2 * len(PROMPTS)
    for s in samples:
        assert s.finish_reason == "length" or s.completion_token_ids[-1] in generator.eos_ids
    logp, comp = _teacher_forced(model, samples, generator.pad_id)
    rollout = torch.zeros_like(logp)
    for row, s in enumerate(samples):
        rollout[row, : len(s.logprobs)] = torch.tensor(s.logprobs)
    torch.testing.assert_close(logp * comp, rollout, atol=1e-4, rtol=0)

    # two RL steps, finite loss, weights change; the final checkpoint exports to plain transformers
    cfg = build_config(dict(steps=2, prompts_per_step=2, group_size=2, max_new_tokens=6, eval_prompts=2,
                            eval_every=0, checkpoint_every=0, tensorboard=False, log_every=0, lr=1e-3,
                            warmup_steps=0, threads=1, reward_funcs="tests.reward_fns:digit_fraction"))
    run = tmp_path / "run"
    train(cfg, get_method("grpo"), model_dir=str(model_dir), task=AdditionTask(), run_dir=str(run), console=QUIET)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["objective/loss"] for r in rows if "objective/loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), rows
    checkpoint = run / "checkpoints" / "step_000002"
    exported = export_hf(checkpoint, tmp_path / "exported", model_dir)

    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32, local_files_only=True).eval()
    trained, _ = load_policy(exported, threads=1)
    changed = any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values()))
    assert changed, "two RL steps left every weight unchanged"
    with torch.no_grad():
        theirs = plain(**batch, position_ids=positions).logits.float()
        ours = _policy_logits(trained, batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-4, rtol=1e-4)


@pytest.mark.skipif("gemma2" not in ARCHITECTURES, reason="transformers lacks Gemma 2")
def test_gemma2_soft_cap_is_applied_on_both_paths(tokenizers, tmp_path):
    """Logits far beyond the cap (30): polyrl's sampler and trainer paths both match transformers' capped logits."""
    model, tok = load_policy(build_tiny("gemma2", tmp_path / "m", tied=False, tokenizer=tokenizers[False]), threads=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(200.0)
    batch = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    positions = (batch["attention_mask"].cumsum(-1) - 1).clamp_min(0)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        ours = _policy_logits(model, batch["input_ids"], batch["attention_mask"])
        theirs = model(**batch, position_ids=positions).logits.float()
        raw = head_logits(model.base_model(**batch, position_ids=positions).last_hidden_state, model.lm_head)
    assert raw[real].abs().max() > 60  # uncapped logits would differ wildly
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-4, rtol=1e-4)
    generator = HFGenerator(model, tok)
    samples = generator.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=0))
    logp, comp = _teacher_forced(model, samples, generator.pad_id)
    rollout = torch.zeros_like(logp)
    for row, s in enumerate(samples):
        rollout[row, : len(s.logprobs)] = torch.tensor(s.logprobs)
    torch.testing.assert_close(logp * comp, rollout, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", [pytest.param(a, marks=[] if a in ARCHITECTURES else pytest.mark.skip(
    reason=f"transformers lacks {a}")) for a in ("lfm2", "qwen3_5", "llama")])
def test_rows_that_finish_early_leave_the_others_decoding(arch, tokenizers, tmp_path):
    """Rows stop at different steps (most tokens are stop tokens here). A hybrid's cache (LFM2's convolutions,
    Qwen3.5's linear attention) keeps states that dropping finished rows leaves behind: the batch crashed there at
    the first finished row. Every row's log-probs still equal the teacher-forced ones."""
    model, tok = load_policy(build_tiny(arch, tmp_path / "m", tokenizer=tokenizers[False]), threads=1)
    generator = HFGenerator(model, tok)
    stops = tuple(range(4, len(tok) // 2))
    samples = generator.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=8, seed=1, stop_token_ids=stops))
    lengths = {len(s.completion_token_ids) for s in samples}
    assert len(lengths) > 1 and max(lengths) > 2, lengths  # some rows finished while others went on
    for s in samples:
        assert s.finish_reason == "length" or s.completion_token_ids[-1] in (*generator.eos_ids, *stops)
        assert not any(t in stops for t in s.completion_token_ids[:-1])  # nothing was written after a stop
    logp, comp = _teacher_forced(model, samples, generator.pad_id)
    rollout = torch.zeros_like(logp)
    for row, s in enumerate(samples):
        rollout[row, : len(s.logprobs)] = torch.tensor(s.logprobs)
    torch.testing.assert_close(logp * comp, rollout, atol=1e-4, rtol=0)


@pytest.mark.skipif("lfm2" not in ARCHITECTURES, reason="transformers lacks LFM2")
def test_agency_with_a_hybrid_model_is_refused_before_training(tokenizers, tmp_path):
    """Agency transfer drops finished rows, which a hybrid's cache cannot: it was refused only at the first decode."""
    model_dir = build_tiny("lfm2", tmp_path / "m", tokenizer=tokenizers[False])
    cfg = build_config(dict(steps=1, prompts_per_step=2, group_size=2, max_new_tokens=6, eval_prompts=2,
                            eval_every=0, tensorboard=False, threads=1, agency=str(model_dir),
                            reward_funcs="tests.reward_fns:digit_fraction"))
    with pytest.raises(ConfigError, match="agency = .* is not allowed with this model"):
        train(cfg, get_method("grpo"), model_dir=str(model_dir), task=AdditionTask(), run_dir=str(tmp_path / "r"),
              console=QUIET)


@pytest.mark.skipif("gpt2" not in ARCHITECTURES, reason="transformers lacks GPT-2")
def test_a_config_s_dropout_is_off_so_training_scores_what_was_sampled(tokenizers, tmp_path):
    """GPT-2's config sets dropout 0.1 (resid, embd, attn); the training pass runs in train mode, where it made the
    trainer's log-probs differ from the rollout's (rollout/logp_mismatch 0.05)."""
    model_dir = build_tiny("gpt2", tmp_path / "m", tokenizer=tokenizers[False])
    assert json.loads((model_dir / "config.json").read_text())["resid_pdrop"] == 0.1
    cfg = build_config(dict(steps=1, prompts_per_step=2, group_size=2, max_new_tokens=6, eval_prompts=2,
                            eval_every=0, checkpoint_every=0, tensorboard=False, log_every=0, threads=1,
                            reward_funcs="tests.reward_fns:digit_fraction"))
    train(cfg, get_method("grpo"), model_dir=str(model_dir), task=AdditionTask(), run_dir=str(tmp_path / "r"),
          console=QUIET)
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    mismatch = [r["rollout/logp_mismatch"] for r in rows if "rollout/logp_mismatch" in r]
    assert len(mismatch) == 1 and mismatch[0] < 1e-5, rows


@pytest.mark.parametrize("stop_token", ["<eos>", END_OF_TURN])
def test_every_eos_id_of_the_generation_config_stops_a_row(tokenizers, tmp_path, stop_token):
    model, tok = load_policy(build_tiny("llama", tmp_path / "m", tied=False, tokenizer=tokenizers[False],
                                        multi_eos=True), threads=1)
    stop_id = tok.convert_tokens_to_ids(stop_token)
    with torch.no_grad():  # a head that always prefers stop_id (a bias: nn.Linear's own, used by every path)
        model.lm_head.weight.zero_()
        model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.lm_head.out_features))
        model.lm_head.bias[stop_id] = 50.0
    samples = HFGenerator(model, tok).generate(PROMPTS, SamplingParams(n=2, max_new_tokens=5, seed=0))
    assert all(s.completion_token_ids == [stop_id] and s.finish_reason == "stop" for s in samples)


@pytest.mark.skipif("gpt2" not in ARCHITECTURES, reason="transformers lacks GPT-2")
def test_a_prompt_beyond_learned_positions_is_refused_in_one_line(tokenizers, tmp_path):
    """GPT-2's position table has n_positions = 256 rows: a prompt that fits with its max_new_tokens samples, one
    token more is a ConfigError naming the lengths (vLLM's rule: prompt + max_new_tokens <= the context; two more
    was an IndexError deep in the embedding, the last sampled token being never fed back)."""
    model, tok = load_policy(build_tiny("gpt2", tmp_path / "m", tokenizer=tokenizers[False]), threads=1)
    ids = tok("1+2=" * 200, add_special_tokens=False)["input_ids"][:250]
    generator = HFGenerator(model, tok)
    samples = generator.generate_ids([ids], SamplingParams(n=1, max_new_tokens=6, temperature=0.0))
    assert len(samples[0].prompt_token_ids) + 6 == 256 and len(samples[0].completion_token_ids) <= 6
    with pytest.raises(ConfigError) as e:
        generator.generate_ids([ids], SamplingParams(n=1, max_new_tokens=7, temperature=0.0))
    message = str(e.value)
    assert "has 250 tokens" in message and "needs 257 positions" in message and "(256," in message, message
    assert "\n" not in message
    with pytest.raises(ConfigError):
        generator.generate_ids([ids], SamplingParams(n=1, max_new_tokens=8, temperature=0.0))


@pytest.mark.skipif("gpt2" not in ARCHITECTURES, reason="transformers lacks GPT-2")
def test_a_data_file_prompt_beyond_the_context_is_refused_before_the_first_step(tokenizers, tmp_path, capsys):
    """The sampler refuses a prompt too long for a learned position table only when a step reaches it (hours into a
    run); the builder checks every prompt of a data file first and names how many, the longest and its length."""
    from polyrl.cli import main

    model_dir = build_tiny("gpt2", tmp_path / "m", tokenizer=tokenizers[False])
    rows = [{"question": f"what is 2 plus {i}?" * (120 if i == 3 else 1), "answer": str(2 + i)} for i in range(40)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["train", "--model", str(model_dir), "--task", "math", "--data-file", str(data), "--steps", "1",
            "--prompts-per-step", "2", "--group-size", "2", "--eval-prompts", "2", "--threads", "1",
            "--no-tensorboard", "--run-dir", str(tmp_path / "run")]
    assert main([*argv, "--max-new-tokens", "256"]) == 2  # no room for any prompt: refused before the data is read
    err = capsys.readouterr().err.strip()
    assert err.endswith("max_new_tokens = 256 leaves no room for a prompt in the context of model = "
                        f"{str(model_dir)!r} (256 positions, max_position_embeddings); allowed: below 256"), err
    assert main([*argv, "--max-new-tokens", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "data_file: 1 of its" in err and "do not fit the model's context of 256 positions" in err, err
    assert len(err.splitlines()) == 1 and not (tmp_path / "run").exists()
    short = [r for i, r in enumerate(rows) if i != 3]
    data.write_text("".join(json.dumps(r) + "\n" for r in short))
    assert main([*argv, "--max-new-tokens", "8"]) == 0, capsys.readouterr().err


def test_a_rotary_model_runs_past_its_positions_with_a_note(tokenizers, tmp_path, capsys):
    """Rotary positions have no table to run out of: a prompt and max_new_tokens past max_position_embeddings sample
    (as transformers' generate does, and as runs started that way resume), and the run notes the untrained
    positions; only a learned table (GPT-2) refuses."""
    from polyrl.cli import main
    from polyrl.model import context_length

    model_dir = build_tiny("llama", tmp_path / "m", tokenizer=tokenizers[False])
    model, tok = load_policy(model_dir, threads=1)
    assert context_length(model) is None and model.config.max_position_embeddings == 256
    ids = tok("1+2=" * 200, add_special_tokens=False)["input_ids"][:250]
    samples = HFGenerator(model, tok).generate_ids([ids], SamplingParams(n=1, max_new_tokens=8, temperature=0.0))
    assert len(samples[0].completion_token_ids) >= 1
    argv = ["train", "--model", str(model_dir), "--steps", "1", "--prompts-per-step", "2", "--group-size", "2",
            "--eval-prompts", "2", "--threads", "1", "--no-tensorboard", "--max-new-tokens", "260", "--run-dir",
            str(tmp_path / "run"), "--reward-funcs", "tests.reward_fns:digit_fraction"]
    assert main(argv) == 0
    assert "reaches past the 256 positions the model was trained on" in capsys.readouterr().out
