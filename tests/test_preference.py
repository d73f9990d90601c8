"""Preference objectives (DPO, IPO, SimPO, KTO, Humanline DPO/KTO) and the offline preference source.

The 2-pair batch: groups (0, 0, 1, 1), advantages (+1, -1, -1, +1), so the pairs are (0 chosen, 1 rejected) and
(3 chosen, 2 rejected); lengths (3, 2, 3, 1); per-token log-ratios lp - lp_ref in DIFF (PAD marks padding, which
must never matter). Sequence sums h = (0.6, 0.4, -0.2, 0.3), token means (0.2, 0.2, -0.2/3, 0.3).
"""

from __future__ import annotations

import argparse
import io
import json
import math

import pytest
import torch
from rich.console import Console

from polyrl.build import add_train_args, resolve_train
from polyrl.config import ConfigError, build_config
from polyrl.methods import get_method
from polyrl.objectives import policy_loss
from polyrl.objectives.preference import pair_weights
from polyrl.rollout.preference import PreferenceSource
from polyrl.rollout.preference_data import read_pairs
from polyrl.tasks.arithmetic import AdditionTask
from polyrl.trainer import train
from polyrl.types import LossInputs, Normalizer, group_token_counts

PAD = 9.0
DIFF = [[0.1, 0.2, 0.3], [0.5, -0.1, PAD], [0.0, 0.0, -0.2], [0.3, PAD, PAD]]
LENGTHS = [3, 2, 3, 1]
ADV = [1.0, -1.0, -1.0, 1.0]
GROUPS = [0, 0, 1, 1]


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _inputs(diff=DIFF, lengths=LENGTHS, adv=ADV, groups=GROUPS, logp=None) -> LossInputs:
    B, T = len(diff), len(diff[0])
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths], dtype=torch.float64)
    base = torch.full((B, T), -1.0, dtype=torch.float64) if logp is None else torch.tensor(logp, dtype=torch.float64)
    lp = base.clone().requires_grad_(True)
    gids = torch.tensor(groups)
    ref = lp.detach() - torch.tensor(diff, dtype=torch.float64)
    return LossInputs(logp=lp, old_logp=lp.detach(), adv=torch.tensor(adv, dtype=torch.float64), mask=mask,
                      normalizer=Normalizer.from_batch(mask, gids), ref_logp=ref,
                      group_ids=gids, group_tokens=group_token_counts(mask, gids))


def _loss_and_grad(name: str, inp: LossInputs):
    out = policy_loss(inp, get_method(name))
    (grad,) = torch.autograd.grad(out.loss, inp.logp)
    return out, grad


def _expected_grad(per_seq: list[float]) -> torch.Tensor:
    """The same gradient on every real token of each sequence, zero on padding."""
    return torch.tensor([[g if t < n else 0.0 for t in range(3)] for g, n in zip(per_seq, LENGTHS)],
                        dtype=torch.float64)


def test_dpo_hand_computed_loss_and_gradient():
    out, grad = _loss_and_grad("dpo", _inputs())
    # mean over pairs of -log sigmoid(0.1 (h_c - h_r)): margins 0.2 and 0.5
    assert out.loss.item() == pytest.approx((math.log1p(math.exp(-0.02)) + math.log1p(math.exp(-0.05))) / 2, 1e-12)
    assert out.loss.item() == pytest.approx(0.6758284138699602, 1e-12)
    a, b = 0.05 * sig(-0.02), 0.05 * sig(-0.05)  # (1/2 pairs) * beta * sigmoid(-beta d)
    assert a == pytest.approx(0.024750008333000017, 1e-12)
    torch.testing.assert_close(grad, _expected_grad([-a, a, b, -b]), rtol=1e-10, atol=1e-14)
    assert out.metrics["objective/reward_accuracy"].item() == 1.0
    assert out.metrics["objective/reward_margin"].item() == pytest.approx(0.035)  # beta (h_c - h_r), TRL's margin


def test_ipo_hand_computed_loss_and_gradient():
    out, grad = _loss_and_grad("ipo", _inputs())
    d_b = 0.3 + 0.2 / 3  # token-mean margins: pair A 0.2 - 0.2 = 0, pair B 0.3 - (-0.2/3)
    assert out.loss.item() == pytest.approx(((0 - 5) ** 2 + (d_b - 5) ** 2) / 2, 1e-12)
    assert out.loss.item() == pytest.approx(23.23388888888889, 1e-12)
    ga, gb = (0 - 5.0), (d_b - 5.0)  # d/dd of (d - 1/(2 beta))^2, times 1/2 pairs: (d - 5)
    torch.testing.assert_close(grad, _expected_grad([ga / 3, -ga / 2, -gb / 3, gb / 1]), rtol=1e-10, atol=1e-14)


def test_simpo_hand_computed_loss_and_gradient_reads_no_reference():
    logp = [[-0.9, -0.8, -0.7], [-0.5, -1.1, 0.0], [-1.0, -1.0, -1.2], [-0.7, 0.0, 0.0]]  # means -0.8 -0.8 -16/15 -0.7
    inp = _inputs(logp=logp)
    inp.ref_logp = None
    out, grad = _loss_and_grad("simpo", inp)
    d_b = -0.7 + 16 / 15
    x_a, x_b = 2.0 * 0 - 1.0, 2.0 * d_b - 1.0  # beta (s_c - s_r) - gamma
    assert out.loss.item() == pytest.approx((math.log1p(math.exp(-x_a)) + math.log1p(math.exp(-x_b))) / 2, 1e-12)
    ga, gb = -2.0 * sig(-x_a) / 2, -2.0 * sig(-x_b) / 2
    torch.testing.assert_close(grad, _expected_grad([ga / 3, -ga / 2, -gb / 3, gb]), rtol=1e-10, atol=1e-14)


def test_kto_hand_computed_loss_gradient_and_detached_reference_point():
    out, grad = _loss_and_grad("kto", _inputs())
    h, z0, beta = [0.6, 0.4, -0.2, 0.3], 0.275, 0.1  # z0 = max(0, mean h), no gradient
    x = [beta * (h[0] - z0), beta * (z0 - h[1]), beta * (z0 - h[2]), beta * (h[3] - z0)]
    assert out.loss.item() == pytest.approx(sum(1 - sig(v) for v in x) / 4, 1e-12)
    assert out.loss.item() == pytest.approx(0.4956257267433847, 1e-12)
    assert out.metrics["objective/z0"].item() == pytest.approx(z0, 1e-6)
    ds = [sig(v) * (1 - sig(v)) for v in x]
    per_seq = [-beta * ds[0] / 4, beta * ds[1] / 4, beta * ds[2] / 4, -beta * ds[3] / 4]
    torch.testing.assert_close(grad, _expected_grad(per_seq), rtol=1e-10, atol=1e-14)


def test_kto_reference_point_is_clamped_at_zero_and_ties_have_no_loss():
    diff = [[-0.5, 0.0, 0.0], [-0.3, 0.0, PAD], [0.0, 0.0, 0.0], [0.0, PAD, PAD]]  # mean h < 0: z0 = 0
    out, grad = _loss_and_grad("kto", _inputs(diff=diff, adv=[1.0, -1.0, 0.0, 0.0]))
    assert out.metrics["objective/z0"].item() == 0.0
    assert out.loss.item() == pytest.approx(((1 - sig(-0.05)) + (1 - sig(0.03))) / 4, 1e-12)
    assert grad[2:].abs().sum() == 0  # advantage 0: neither desirable nor undesirable


def test_dpo_at_the_reference_is_log2_with_gradient_minus_half_beta():
    zeros = [[0.0] * 3 for _ in range(4)]
    out, grad = _loss_and_grad("dpo", _inputs(diff=zeros))
    assert out.loss.item() == pytest.approx(math.log(2), 1e-12)
    # one pair: -beta/2 (grad h_c - grad h_r); two pairs averaged: half of it on each pair's tokens
    torch.testing.assert_close(grad, _expected_grad([-0.025, 0.025, 0.025, -0.025]), rtol=1e-12, atol=1e-15)
    one = _inputs(diff=zeros[:2], lengths=LENGTHS[:2], adv=ADV[:2], groups=GROUPS[:2])
    out, grad = _loss_and_grad("dpo", one)
    assert out.loss.item() == pytest.approx(math.log(2), 1e-12)
    torch.testing.assert_close(grad[0, :3], torch.full((3,), -0.05, dtype=torch.float64))
    torch.testing.assert_close(grad[1, :2], torch.full((2,), 0.05, dtype=torch.float64))


def test_dpo_is_invariant_to_a_constant_added_to_both_implicit_rewards():
    out, grad = _loss_and_grad("dpo", _inputs())
    shifted = [[d + 0.7 / n for d in row] for row, n in zip(DIFF, LENGTHS)]  # h_i + 0.7 for every sequence
    out2, grad2 = _loss_and_grad("dpo", _inputs(diff=shifted))
    assert out2.loss.item() == pytest.approx(out.loss.item(), 1e-12)
    torch.testing.assert_close(grad2, grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("name", ["humanline_dpo", "humanline_kto"])
@pytest.mark.parametrize("chosen", [0, 1])
def test_humanline_tokens_outside_the_band_have_zero_gradient(name, chosen):
    """Tokens at 2.0 > log eps_R = 1.5 and -1.5 < log eps_P = -1 give no gradient, whatever the sign of A."""
    diff = [[2.0, 0.5, 0.0], [-1.5, 0.2, PAD]]
    adv = [1.0, -1.0] if chosen == 0 else [-1.0, 1.0]
    out, grad = _loss_and_grad(name, _inputs(diff=diff, lengths=[2, 2], adv=adv, groups=[0, 0]))
    assert grad[0, 0] == 0 and grad[1, 0] == 0
    assert grad[0, 1] != 0 and grad[1, 1] != 0
    assert out.metrics["objective/band_frac"].item() == pytest.approx(0.5)
    if name == "humanline_dpo":  # h_c - h_r with the clamped tokens: (1.5 + 0.5) - (-1 + 0.2) = 2.8
        sign = 1.0 if chosen == 0 else -1.0
        assert out.loss.item() == pytest.approx(math.log1p(math.exp(-0.1 * 2.8 * sign)), 1e-12)
        assert grad[0, 1].item() == pytest.approx(-sign * 0.1 * sig(-0.1 * 2.8 * sign), 1e-12)


@pytest.mark.parametrize("name,base", [("humanline_dpo", "dpo"), ("humanline_kto", "kto")])
def test_humanline_inside_the_band_equals_the_base_loss(name, base):
    out, grad = _loss_and_grad(name, _inputs())
    out2, grad2 = _loss_and_grad(base, _inputs())
    assert out.loss.item() == pytest.approx(out2.loss.item(), 1e-12)
    torch.testing.assert_close(grad, grad2)


@pytest.mark.parametrize("name", ["dpo", "ipo", "simpo", "humanline_dpo"])
def test_splitting_whole_groups_into_micro_batches_changes_nothing(name):
    full = _inputs()
    out, grad = _loss_and_grad(name, full)
    total, grads = 0.0, []
    for rows in (torch.tensor([0, 1]), torch.tensor([2, 3])):
        part = _inputs()
        micro = part.rows(rows)
        loss = policy_loss(micro, get_method(name)).loss
        grads.append(torch.autograd.grad(loss, part.logp)[0][rows])
        total += loss.item()
    assert total == pytest.approx(out.loss.item(), 1e-12)
    torch.testing.assert_close(torch.cat(grads), grad, rtol=1e-12, atol=1e-15)


def test_pairs_all_against_best_worst():
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.5, 0.5])  # group 0: two chosen, two rejected; group 1: a tie
    gids, has = torch.tensor([0, 0, 0, 0, 1, 1]), torch.ones(6, dtype=torch.bool)
    w = pair_weights(adv, gids, has, "all")
    expected = torch.zeros(6, 6)
    expected[0, 2] = expected[0, 3] = expected[1, 2] = expected[1, 3] = 0.25
    torch.testing.assert_close(w, expected)
    w = pair_weights(adv, gids, has, "best_worst")
    expected = torch.zeros(6, 6)
    expected[0, 2] = 1.0  # the first best against the first worst
    torch.testing.assert_close(w, expected)


# --- offline source ----------------------------------------------------------------------------------------------
ROWS = [{"prompt": "1+2=", "chosen": "3", "rejected": "4"}, {"prompt": "5+5=", "chosen": "10", "rejected": "11"},
        {"prompt": "2+2=", "chosen": "4", "rejected": "5"}]


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_read_pairs_and_bad_rows_are_refused_in_one_line(tmp_path):
    rows = read_pairs(_write(tmp_path / "ok.jsonl", ROWS))
    assert [r.chosen for r in rows] == ["3", "10", "4"]
    for bad, field in [({"prompt": "1+2=", "chosen": "3"}, "'rejected'"),
                       ({"prompt": "1+2=", "chosen": [{"role": "assistant", "content": "3"}], "rejected": "4"},
                        "'chosen'"),
                       ({"prompt": 7, "chosen": "3", "rejected": "4"}, "'prompt'"),
                       ("{not json", "not valid JSON"),
                       ({"prompt": "1+2=", "chosen": "3", "rejected": "3"}, "'rejected'")]:
        with pytest.raises(ValueError) as e:
            read_pairs(_write(tmp_path / "bad.jsonl", [ROWS[0], bad]))
        assert "row 2" in str(e.value) and field in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_rows_whose_strings_hold_unicode_line_separators_load(tmp_path):
    """U+2028 and U+0085 are line breaks to str.splitlines, not to JSON Lines; a byte-order mark is tolerated."""
    rows = [{"prompt": f"Line\u2028{a}+1=", "chosen": str(a + 1), "rejected": f"\x85{a}"} for a in range(3)]
    path = tmp_path / "u.jsonl"
    path.write_text("\ufeff" + "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    got = read_pairs(path)
    assert [(r.prompt, r.chosen, r.rejected, r.line) for r in got] == [
        (r["prompt"], r["chosen"], r["rejected"], i + 1) for i, r in enumerate(rows)]


def test_source_tokenises_pairs_and_resumes_exactly(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    rows = read_pairs(_write(tmp_path / "p.jsonl", ROWS))
    src = PreferenceSource(rows, tok, lambda p: p, pairs_per_step=2, seed=0, max_new_tokens=8)
    batch = src.collect(get_method("dpo"), None, 0)
    assert batch.scores.tolist() == [1.0, 0.0, 1.0, 0.0] and batch.group_ids.tolist() == [0, 0, 1, 1]
    first = rows[[r.prompt for r in rows].index(batch.prompts[0].text)]
    s = batch.samples[0]
    assert s.prompt_token_ids == tok(first.prompt)["input_ids"]
    assert s.completion_token_ids == tok(first.chosen, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert batch.samples[1].text == first.rejected and len(s.logprobs) == len(s.completion_token_ids)
    state = src.state_dict()
    nxt = src.collect(get_method("dpo"), None, 1)
    again = PreferenceSource(rows, tok, lambda p: p, pairs_per_step=2, seed=0, max_new_tokens=8)
    again.load_state_dict(state)
    assert [x.text for x in again.collect(get_method("dpo"), None, 1).samples] == [x.text for x in nxt.samples]
    seen = {p.text for p in batch.prompts} | {p.text for p in nxt.prompts}
    assert seen == {r.prompt for r in rows}  # one pass covers every row before any repeats


def test_a_row_beyond_the_models_context_is_refused_naming_its_line(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)  # a character tokenizer: one token per character, plus BOS
    rows = read_pairs(_write(tmp_path / "p.jsonl", [ROWS[0], {"prompt": "1+1=", "chosen": "2" * 30, "rejected": "3"}]))
    fits = PreferenceSource(rows, tok, lambda p: p, pairs_per_step=2, seed=0, max_new_tokens=8, context=36)
    fits.collect(get_method("dpo"), None, 0)  # BOS + 4 prompt + 30 chosen + EOS = 36 positions
    with pytest.raises(ConfigError) as e:  # before any step: when reached, hours in, an --overwrite had dropped a run
        PreferenceSource(rows, tok, lambda p: p, pairs_per_step=2, seed=0, max_new_tokens=8, context=35)
    assert str(e.value).startswith("preference_file row 2: the prompt and its chosen completion are 36 tokens"), e.value


def _resolve(argv, tmp_path):
    parser = argparse.ArgumentParser()
    add_train_args(parser)
    return resolve_train(parser.parse_args([*argv, "--run-dir", str(tmp_path / "never-written")]))


@pytest.mark.parametrize("argv,needle", [
    (["--method", "dpo", "--group-size", "4", "--micro-batch-size", "6"], "micro_batch_size = 6"),
    (["--method", "ipo", "--minibatches", "2"], "minibatches = 2"),
    (["--method", "dpo", "--group-size", "4", "--preference-file", "{file}"], "group_size = 4"),
    (["--method", "dpo", "--preference-file", "{bad}"], "row 2 field 'rejected'"),
    (["--method", "dpo", "--preference-file", "{file}", "--micro-batch-size", "3"], "micro_batch_size = 3"),
    (["--method", "dpo", "--preference-file", "{file}", "--correction", "tis"], "preference_file"),
    # a shaper changes the labels: a chosen row past --max-new-tokens tied with, or fell below, its rejected one
    (["--method", "dpo", "--preference-file", "{file}", "--shaper", "overlong_soft"], "shapers"),
    # TRL's DPO scores the model's own distribution; a temperature silently rescaled the loss and its gradient
    (["--method", "dpo", "--preference-file", "{file}", "--temperature", "0.5"], "temperature = 0.5"),
    # the pairs are ordered by each sequence's advantage: a critic's (GAE) could name the rejected row chosen
    (["--method", "dpo", "--preference-file", "{file}", "--advantage", "gae"], "advantage = 'gae'"),
    (["--method", "kto", "--advantage", "reinforce_pp"], "advantage = 'reinforce_pp'"),
])
def test_builder_refuses_split_groups_and_moot_offline_settings(tiny_model, tmp_path, argv, needle):
    file = _write(tmp_path / "p.jsonl", ROWS)
    bad = _write(tmp_path / "b.jsonl", [ROWS[0], {"prompt": "", "chosen": "1"}])
    argv = [a.format(file=file, bad=bad) for a in argv]
    with pytest.raises(ConfigError) as e:
        _resolve(["--model", tiny_model, *argv], tmp_path)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    _resolve(["--model", tiny_model, "--method", "kto", "--micro-batch-size", "3"], tmp_path)  # KTO pairs nothing


def test_rows_the_tokenizer_cannot_tell_apart_are_refused_before_the_first_step(tiny_model, tmp_path, capsys):
    """The warm start's character tokenizer reads "ééé" and "ààà" as the same <unk> tokens: DPO trained on pairs
    identical token for token, silently."""
    from polyrl.cli import main

    base = ["train", "--model", tiny_model, "--method", "dpo", "--steps", "1", "--threads", "1", "--no-tensorboard",
            "--eval-prompts", "2", "--run-dir", str(tmp_path / "run"), "--preference-file"]
    unknown = _write(tmp_path / "u.jsonl", [*ROWS, {"prompt": "1+1=", "chosen": "ééé", "rejected": "ààà"}])
    assert main([*base, str(unknown)]) == 2
    err = capsys.readouterr().err.strip()
    assert "preference_file row 4: its prompt or chosen completion holds characters the tokenizer has no token for "\
           "('é')" in err and len(err.splitlines()) == 1, err


def test_offline_dpo_trains_end_to_end_without_generation(tiny_model, tmp_path):
    rows = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)} for a, b in
            [(1, 2), (3, 4), (5, 6), (7, 1)]]
    cfg = build_config(dict(steps=6, prompts_per_step=4, max_new_tokens=4, eval_prompts=4, eval_every=0,
                            checkpoint_every=0, tensorboard=False, log_every=0, lr=3e-3, warmup_steps=0, threads=1,
                            preference_file=str(_write(tmp_path / "p.jsonl", rows))))
    summary = train(cfg, get_method("dpo"), model_dir=tiny_model, task=AdditionTask(), run_dir=str(tmp_path / "run"),
                    console=Console(file=io.StringIO()))
    assert summary["steps"] == 6 and summary["skipped_steps"] == 0
    steps = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
             if "objective/loss" in r]
    assert steps[0]["objective/loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference at step 1
    assert all(r["rollout/generated"] == 0 and r["objective/pairs"] == 4 for r in steps)
    assert steps[-1]["objective/reward_margin"] > 0 and steps[-1]["objective/loss"] < math.log(2)
