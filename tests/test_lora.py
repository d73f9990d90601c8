"""LoRA through PEFT (issue 18): only adapters train, the reference is the base with them off (no second copy),
the optimizer holds the adapters alone, checkpoints hold the adapter, resume is exact, and the merged export
reproduces the trained policy's log-probs."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console

from polyrl.batch import TokenBatch
from polyrl.build import build_components
from polyrl.cli import main
from polyrl.config import ConfigError, build_config, validate
from polyrl.methods import get_method
from polyrl.model import completion_logprobs, load_policy
from polyrl.rollout.generator import SamplingParams
from polyrl.rollout.hf import HFGenerator
from polyrl.tasks.arithmetic import AdditionTask
from polyrl.trainer import train

QUIET = Console(file=io.StringIO(), width=120)
LORA = dict(lora_rank=4, lora_alpha=8.0)


def _cfg(**kw):
    base = dict(steps=2, prompts_per_step=2, group_size=4, max_new_tokens=6, eval_prompts=8, eval_every=0,
                checkpoint_every=0, tensorboard=False, log_every=0, lr=1e-2, warmup_steps=0, threads=1,
                reward_funcs="tests.reward_fns:digit_fraction")
    return build_config({**base, **kw})


def _unique_numel(modules) -> int:
    """Parameters held by ``modules`` counted once each (a shared tensor is one copy)."""
    seen = {}
    for m in modules:
        for p in m.parameters():
            seen[p.data_ptr()] = p.numel()
    return sum(seen.values())


def test_reference_is_the_base_with_adapters_off_and_costs_no_parameters(tiny_model):
    method = get_method("grpo")  # a KL preset: it needs a reference
    assert method.needs_ref
    full = build_components(_cfg(), method, AdditionTask(), tiny_model).learner
    lora = build_components(_cfg(**LORA), method, AdditionTask(), tiny_model).learner
    base = _unique_numel([full.model])
    adapters = sum(p.numel() for p in lora.model.parameters() if p.requires_grad)
    assert _unique_numel([full.model, full.reference]) == 2 * base  # the full learner keeps a frozen copy
    assert _unique_numel([lora.model, lora.reference.model]) == base + adapters  # LoRA: none
    assert 0 < adapters < base // 4
    # The optimizer holds the adapters alone.
    held = {id(p) for group in lora.optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for n, p in lora.model.named_parameters() if "lora_" in n}

    # With adapters that changed, the reference still scores the base model's log-probs exactly.
    for name, p in lora.model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    gen = HFGenerator(full.model, load_policy(tiny_model, threads=1)[1])
    samples = gen.generate(["12+34=", "5+7="], SamplingParams(n=2, max_new_tokens=5, seed=1))
    batch = TokenBatch.from_samples(samples, gen.pad_id)
    ref = lora.ref_logprobs(batch, samples)
    base_logp = full.logprobs_nograd(batch).logp  # the untrained full model = the base
    torch.testing.assert_close(ref, base_logp, atol=1e-6, rtol=0)
    assert (lora.logprobs_nograd(batch).logp - base_logp).abs().max() > 1e-3  # the adapters do change the policy


def test_only_adapters_train_and_export_merges_them(tiny_model, tmp_path):
    run = tmp_path / "run"
    cfg = _cfg(**LORA, steps=3, checkpoint_every=3)
    summary = train(cfg, get_method("grpo"), model_dir=tiny_model, task=AdditionTask(), run_dir=str(run),
                    console=QUIET)
    assert summary["steps"] == 3 and summary["skipped_steps"] == 0
    ck = run / "checkpoints" / "step_000003"
    assert {p.name for p in (ck / "adapter").iterdir()} >= {"adapter_model.safetensors", "adapter_config.json"}
    assert not (ck / "model.safetensors").exists()  # the checkpoint holds the adapter, not the base
    from safetensors.torch import load_file

    adapter = load_file(str(ck / "adapter" / "adapter_model.safetensors"))
    assert adapter and all("lora_" in k for k in adapter)
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapter.items())  # B moved off zero

    # The trained policy = the base with the saved adapter (PEFT's own loader), vs polyrl's merged export.
    from peft import PeftModel

    base, tokenizer = load_policy(tiny_model, threads=1)
    trained = PeftModel.from_pretrained(base, str(ck / "adapter")).eval()
    out = tmp_path / "merged"
    assert main(["export", str(run), str(out), "--model", tiny_model]) == 0  # a run directory: its newest checkpoint
    merged, _ = load_policy(out, threads=1)
    assert not any("lora" in k for k in merged.state_dict())
    gen = HFGenerator(merged, tokenizer)
    samples = gen.generate(["12+34=", "50+7=", "3+3="], SamplingParams(n=2, max_new_tokens=6, seed=3))
    batch = TokenBatch.from_samples(samples, gen.pad_id)
    args = (batch.input_ids, batch.attention_mask, batch.completion_mask)
    with torch.no_grad():
        want = completion_logprobs(trained.get_base_model(), *args).logp
        got = completion_logprobs(merged, *args).logp
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    start, _ = load_policy(tiny_model, threads=1)
    assert (completion_logprobs(start, *args).logp - want).abs().max() > 1e-4  # training did move the policy


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_resume_is_exact(tiny_model, tmp_path, dropout):
    """With dropout too: rollouts and evaluations decode in eval mode, so the final evaluation of the first segment
    (which the unbroken run never does) leaves the random state its checkpoint saves as it was."""
    method, lora = get_method("grpo"), {**LORA, "lora_dropout": dropout}
    train(_cfg(**lora, steps=4), method, model_dir=tiny_model, task=AdditionTask(), run_dir=str(tmp_path / "a"),
          console=QUIET)
    train(_cfg(**lora, steps=2), method, model_dir=tiny_model, task=AdditionTask(), run_dir=str(tmp_path / "b"),
          console=QUIET)
    train(_cfg(**lora, steps=4, resume=True), method, model_dir=tiny_model, task=AdditionTask(),
          run_dir=str(tmp_path / "b"), console=QUIET)
    from safetensors.torch import load_file

    a, b = (load_file(str(tmp_path / r / "checkpoints" / "step_000004" / "adapter" / "adapter_model.safetensors"))
            for r in "ab")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_sampling_does_not_depend_on_the_modules_training_mode(tiny_model):
    """The learner leaves the shared policy module in train mode; a dropout layer there would make rollouts draw
    from torch's global generator. Decoding runs in eval mode and gives the module back in the mode it had."""
    from polyrl.learner.lora import add_adapters

    model, tok = load_policy(tiny_model, threads=1)
    add_adapters(model, rank=4, alpha=8.0, targets="all-linear", dropout=0.5)  # injected in place
    with torch.no_grad():  # trained adapters: B is no longer 0, so dropout on their input changes the logits
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    gen, params = HFGenerator(model, tok), SamplingParams(n=4, max_new_tokens=6, seed=7)
    model.eval()
    want = [s.completion_token_ids for s in gen.generate(["12+34="], params)]
    model.train()
    torch.manual_seed(0)
    got = [s.completion_token_ids for s in gen.generate(["12+34="], params)]
    torch.manual_seed(1)
    assert got == want == [s.completion_token_ids for s in gen.generate(["12+34="], params)] and model.training


@pytest.mark.parametrize("values,needle", [
    ({"lora_alpha": 32.0}, "lora_alpha = 32.0 is not allowed; only applies with LoRA"),
    ({"lora_dropout": 0.1}, "lora_dropout = 0.1 is not allowed; only applies with LoRA"),
    ({"lora_rank": -1}, "lora_rank = -1 is not allowed"),
    ({"lora_rank": 4, "lora_dropout": 1.0}, "lora_dropout = 1.0 is not allowed; must be in [0, 1)"),
    ({"lora_rank": 4, "nproc": 2}, "lora_rank = 4 is not allowed; does not combine with nproc > 1"),
])
def test_bad_lora_settings_are_one_line(values, needle):
    with pytest.raises(ConfigError, match=None) as e:
        validate(build_config(values))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_bad_targets_and_moot_methods_are_refused(tiny_model, tmp_path, capsys):
    # a rank past the layers' smallest side adds size and no capacity (100000 grew memory until the run was killed)
    code = main(["train", "--model", tiny_model, "--lora-rank", "100000", "--steps", "1", "--run-dir",
                 str(tmp_path / "r1"), "--threads", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "lora_rank = 100000 is not allowed: no targeted layer has a smaller side above" in err, err
    assert len(err.splitlines()) == 1
    code = main(["train", "--model", tiny_model, "--lora-rank", "4", "--lora-targets", "nonexistent_proj",
                 "--steps", "1", "--run-dir", str(tmp_path / "r1"), "--threads", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "lora_targets = 'nonexistent_proj'" in err and len(err.splitlines()) == 1
    # one stray name beside a real one was ignored by PEFT (it refuses only when nothing matches)
    code = main(["train", "--model", tiny_model, "--lora-rank", "4", "--lora-targets", "q_proj,nope",
                 "--steps", "1", "--run-dir", str(tmp_path / "r1"), "--threads", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "nope matches no module" in err and "q_proj" in err and len(err.splitlines()) == 1
    for block in ("mlp", "layers"):  # PEFT's error was the block's repr cut to its first line: "LlamaMLP("
        code = main(["train", "--model", tiny_model, "--lora-rank", "4", "--lora-targets", block,
                     "--steps", "1", "--run-dir", str(tmp_path / "r1"), "--threads", "1"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and f"{block} is a block of modules, not a linear layer" in err and "q_proj" in err, err
        assert len(err.splitlines()) == 1
    assert not (tmp_path / "r1").exists()  # the refused run leaves no record, so the corrected command is no rerun
    (tmp_path / "r1").mkdir()  # a directory the user made is kept, empty
    main(["train", "--model", tiny_model, "--lora-rank", "4", "--lora-targets", "nonexistent_proj",
          "--steps", "1", "--run-dir", str(tmp_path / "r1"), "--threads", "1"])
    assert (tmp_path / "r1").is_dir() and not any((tmp_path / "r1").iterdir())
    code = main(["train", "--model", tiny_model, "--lora-rank", "4", "--lora-targets", "lm_head",
                 "--steps", "1", "--run-dir", str(tmp_path / "r2"), "--threads", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "names the LM head" in err
    code = main(["train", "--model", tiny_model, "--lora-rank", "4", "--method", "humanline_grpo",
                 "--steps", "1", "--run-dir", str(tmp_path / "r3"), "--threads", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "reference follows the policy" in err, err
    saved = tmp_path / "r3" / "config.json"
    assert not saved.exists() or json.loads(saved.read_text())


def test_rollout_workers_sample_with_the_merged_weights(tiny_model, tmp_path):
    """A Ray rollout worker holds the base architecture: it receives the merged weights and samples the batches the
    in-process LoRA run samples (same keys), so the runs' rewards agree step by step."""
    pytest.importorskip("ray")
    method = get_method("grpo")
    for name, extra in (("local", {}), ("workers", {"rollout_workers": 1, "ray_cpus": 1})):
        train(_cfg(**LORA, steps=3, **extra), method, model_dir=tiny_model, task=AdditionTask(),
              run_dir=str(tmp_path / name), console=QUIET)
    rows = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
                   if "reward/mean" in line] for name in ("local", "workers")}
    assert len(rows["local"]) == 3
    for a, b in zip(rows["local"], rows["workers"]):
        assert a["reward/mean"] == b["reward/mean"]
        assert abs(a["objective/loss"] - b["objective/loss"]) < 1e-4


def test_gpt2_conv1d_layers_are_targets_by_name(tmp_path):
    """GPT-2's linear layers are transformers' Conv1D (c_attn, c_proj, c_fc), which PEFT adapts: naming them takes
    them, and a wrong name lists them as allowed (the check once counted nn.Linear only and refused every name)."""
    from polyrl.learner.lora import add_adapters
    from polyrl.tinyhf import build_tiny

    model, _ = load_policy(build_tiny("gpt2", tmp_path / "gpt2"), threads=1)
    peft_model = add_adapters(model, rank=4, alpha=8.0, dropout=0.0, targets="c_attn")
    adapted = {name.split(".lora_A")[0].rsplit(".", 1)[-1] for name, _ in peft_model.named_parameters()
               if ".lora_A" in name}
    assert adapted == {"c_attn"}
    model, _ = load_policy(tmp_path / "gpt2", threads=1)
    with pytest.raises(ValueError, match=r"q_proj matches no module of the model; allowed: all-linear or names among "
                                         r"c_attn, c_fc, c_proj"):
        add_adapters(model, rank=4, alpha=8.0, dropout=0.0, targets="q_proj")
