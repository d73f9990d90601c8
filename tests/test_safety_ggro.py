"""GGRO (spec §11): swap scores, entropy, nudge bias, decode invariances, the Generator-compatible decoder."""

from __future__ import annotations

import argparse
import math

import numpy as np
import pytest
import torch

from polyrl.config import ConfigError
from polyrl.rollout.generator import SamplingParams
from polyrl.safety.ggro.core import (
    GGRODecoder,
    base_decode,
    embedding_distance_bias,
    entropy,
    first_order_swap_scores,
    ggro_decode,
    select_nudges,
)
from polyrl.safety.ggro.experiment import _check, add_parser, best_of_n_weights
from polyrl.safety.ggro.toy import BOS, EOS, LETTERS, OFFSET, VOCAB, ConvRM, TinyLM, World

E3 = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])


def linear_rm(a: torch.Tensor, c: float = 0.5):
    return lambda embeds: (embeds @ a).sum(dim=-1) + c


def test_entropy_hand_values():
    assert float(entropy(torch.zeros(4))) == pytest.approx(math.log(4))
    masked = torch.tensor([0.0, 0.0, -math.inf, -math.inf])
    assert float(entropy(masked)) == pytest.approx(math.log(2))
    assert float(entropy(torch.tensor([50.0, -50.0, -50.0]))) == pytest.approx(0.0, abs=1e-12)


def test_swap_scores_hand_computed_linear_rm():
    # R = sum_i a . e_{y_i} + c with a = (2, -1): token values 2, -1, 1; y = (0, 1)
    scores = first_order_swap_scores(linear_rm(torch.tensor([2.0, -1.0])), torch.tensor([0, 1]), E3,
                                     torch.tensor([[1, 2], [0, 2]]))
    assert torch.allclose(scores, torch.tensor([[-3.0, -1.0], [3.0, 2.0]]))


def test_swap_scores_exact_for_any_linear_rm():
    gen = torch.Generator().manual_seed(0)
    embed, a = torch.randn(12, 5, generator=gen), torch.randn(5, generator=gen)
    rm = linear_rm(a)
    y = torch.randint(0, 12, (6,), generator=gen)
    cands = torch.randint(0, 12, (6, 4), generator=gen)
    scores = first_order_swap_scores(rm, y, embed, cands)
    base = rm(embed[y][None])[0]
    for i in range(6):
        for k in range(4):
            swapped = y.clone()
            swapped[i] = cands[i, k]
            assert float(scores[i, k]) == pytest.approx(float(rm(embed[swapped][None])[0] - base), abs=1e-5)


def test_swap_scores_first_order_not_exact_for_quadratic_rm():
    # R = (sum_i a . e_i)^2: g_i[v] = 2 S (a . e_v); hand: a = (1, 0), y = (0, 0) -> S = 2, swap 0 -> 1 scores -4
    rm = lambda embeds: ((embeds @ torch.tensor([1.0, 0.0])).sum(-1)) ** 2  # noqa: E731
    scores = first_order_swap_scores(rm, torch.tensor([0, 0]), E3, torch.tensor([[1], [2]]))
    assert torch.allclose(scores, torch.tensor([[-4.0], [0.0]]))  # exact changes are -3 and 0
    positions = first_order_swap_scores(rm, torch.tensor([0, 0]), E3, torch.tensor([[2]]), torch.tensor([1]))
    assert torch.allclose(positions, torch.tensor([[0.0]]))


def test_embedding_distance_bias_hand_values():
    bias = embedding_distance_bias(torch.tensor([0, 2]), E3, weight=0.5)
    assert torch.allclose(bias, torch.tensor([[0.0, -1.0, -0.5], [-0.5, -0.5, 0.0]]))
    logits = torch.tensor([[3.0, 4.0, 0.0], [0.0, 0.0, 2.0]])
    scaled = embedding_distance_bias(torch.tensor([0, 2]), E3, weight=1.0, match_logit_norm=logits)
    assert torch.allclose(scaled.norm(dim=-1), logits.norm(dim=-1))
    assert torch.allclose(scaled[0], torch.tensor([0.0, -2.0, -1.0]) * 5 / math.sqrt(5))


def test_bias_raises_nudge_probability():
    gen = torch.Generator().manual_seed(1)
    embed = torch.randn(16, 4, generator=gen)
    logits = torch.randn(16, 16, generator=gen) * 3
    nudge = torch.randint(0, 16, (16,), generator=gen)
    for w in (0.01, 1.0):
        bias = embedding_distance_bias(nudge, embed, weight=w, match_logit_norm=logits)
        before = logits.softmax(-1).gather(1, nudge[:, None])
        after = (logits + bias).softmax(-1).gather(1, nudge[:, None])
        assert bool((after > before).all())


def test_select_nudges_greedy_and_confidence():
    ids, conf = select_nudges(torch.tensor([[0.0, 1.0, -1.0], [0.2, 0.1, 0.0]]), torch.tensor([[7, 8, 9], [3, 4, 5]]),
                              temperature=0.1)
    assert ids.tolist() == [8, 3]
    assert float(conf[0]) == pytest.approx(float(torch.tensor([0.0, 10.0, -10.0]).softmax(0)[1]))
    assert float(conf[1]) == pytest.approx(float(torch.tensor([2.0, 1.0, 0.0]).softmax(0)[0]))


def _models(seed: int = 0):
    torch.manual_seed(seed)
    lm = TinyLM().eval()
    rm = ConvRM(lm.embed.weight.shape[1]).eval()
    return lm, rm, lm.embed.weight.detach()


@pytest.mark.parametrize("threshold,refinements", [(math.inf, 4), (0.5, 1)])
def test_ggro_reduces_to_base_decode(threshold, refinements):
    lm, rm, embed = _models()
    prompt = [BOS, OFFSET + 3, OFFSET + 7]
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    u = torch.rand(3, 12, generator=torch.Generator().manual_seed(5))
    toks, logps, stopped, base_cost = base_decode(lm, prompt, params, u, (EOS,))
    for r in range(3):
        res = ggro_decode(lm, rm, prompt, embed=embed, entropy_threshold=threshold, num_refinements=refinements,
                          max_new_tokens=12, top_k=5, params=params, uniforms=u[r], eos_ids=(EOS,))
        assert res["ids"] == toks[r]
        assert res["logprobs"] == pytest.approx(logps[r], abs=1e-5)
        assert res["stopped"] == stopped[r] and res["num_nudges"] == 0
        assert res["compute"].rm_forward == res["compute"].rm_backward == 0
        assert res["compute"].lm_tokens == len(prompt) + len(toks[r])
    assert base_cost.lm_tokens == 3 * len(prompt) + sum(len(t) for t in toks)


def test_ggro_nudges_raise_a_linear_reward():
    lm, _, embed = _models(1)
    target = OFFSET + 5  # a linear RM that rewards only this token's direction
    a = embed[target] / embed[target].norm()
    rm = linear_rm(a, c=0.0)
    prompt = [BOS, OFFSET + 1]
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    u = torch.rand(6, 10, generator=torch.Generator().manual_seed(2))
    gains, nudged = [], 0
    for r in range(6):
        base = ggro_decode(lm, rm, prompt, embed=embed, entropy_threshold=0.0, num_refinements=1,
                           max_new_tokens=10, params=params, uniforms=u[r], eos_ids=(EOS,))
        res = ggro_decode(lm, rm, prompt, embed=embed, entropy_threshold=0.0, num_refinements=4, top_k=8,
                          max_new_tokens=10, params=params, uniforms=u[r], eos_ids=(EOS,))
        score = lambda ids: float(rm(embed[torch.tensor(prompt + ids)][None])[0])  # noqa: E731
        gains.append(score(res["ids"]) - score(base["ids"]))
        nudged += res["num_nudges"]
        c = res["compute"]
        assert c.rm_forward >= c.rm_backward > 0 and c.lm_tokens > len(prompt) + len(res["ids"]) - 1
        assert res["segment_bounds"][-1] == len(res["ids"])
    assert nudged > 0
    assert sum(gains) / len(gains) > 0


def test_nudge_weight_scales_the_rescaled_bias():
    """Spec 11: the bias is rescaled to the logit norm, then w multiplies. Applied before the rescaling, w cancelled:
    0.01, 1 and 100 gave the same completions, nudges and rewards."""
    lm, _, embed = _models(1)
    rm = linear_rm(embed[OFFSET + 5] / embed[OFFSET + 5].norm(), c=0.0)
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    u = torch.rand(6, 10, generator=torch.Generator().manual_seed(2))
    runs = {w: [ggro_decode(lm, rm, [BOS, OFFSET + 1], embed=embed, entropy_threshold=0.0, num_refinements=4, top_k=8,
                            max_new_tokens=10, params=params, uniforms=u[r], eos_ids=(EOS,), nudge_weight=w)["ids"]
                for r in range(6)] for w in (0.0, 1.0, 100.0)}
    assert runs[0.0] != runs[1.0] != runs[100.0]  # w = 0: no bias at all


def test_decoder_is_generator_compatible_and_keyed():
    from polyrl.tinylm import build_char_tokenizer

    lm, rm, embed = _models(2)
    tok = build_char_tokenizer(LETTERS)
    assert len(tok) == VOCAB
    dec = GGRODecoder(lm, rm, embed, tok, entropy_threshold=1.0, num_refinements=3, top_k=6)
    params = SamplingParams(n=2, max_new_tokens=8, temperature=1.0, seed=11)
    samples = dec.generate(["abc", "de"], params)
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1]
    assert samples[0].prompt_token_ids == [BOS, OFFSET, OFFSET + 1, OFFSET + 2]
    for s in samples:
        assert len(s.logprobs) == len(s.completion_token_ids) > 0
        assert s.finish_reason == ("stop" if s.completion_token_ids[-1] == EOS else "length")
        assert s.text == tok.decode(s.completion_token_ids, skip_special_tokens=True)
        # log-probs are the BASE LM's (unbiased) processed log-probs of the kept tokens
        ids = torch.tensor(s.prompt_token_ids + s.completion_token_ids)[None]
        with torch.no_grad():
            ref = lm(ids)[0, len(s.prompt_token_ids) - 1 : -1].log_softmax(-1)
        expect = ref.gather(1, torch.tensor(s.completion_token_ids)[:, None])[:, 0]
        assert s.logprobs == pytest.approx(expect.tolist(), abs=1e-4)
    alone = dec.generate_ids([samples[3].prompt_token_ids], SamplingParams(n=1, max_new_tokens=8, seed=11), keys=[3])
    assert alone[0].completion_token_ids == samples[3].completion_token_ids
    assert dec.compute.lm_tokens > 0


def test_best_of_n_weights_hand_values():
    assert best_of_n_weights(3, 2).tolist() == pytest.approx([0.0, 1 / 3, 2 / 3])
    assert best_of_n_weights(5, 1).tolist() == pytest.approx([0.2] * 5)
    assert best_of_n_weights(5, 5).tolist() == pytest.approx([0, 0, 0, 0, 1])
    assert float(best_of_n_weights(32, 16).sum()) == pytest.approx(1.0)


def test_world_true_reward_penalises_ungrammatical_bigrams():
    world = World(0)
    a = 0
    follower = int(world.trans[a].argmax())
    never = int((world.trans[a] == 0).nonzero()[0][0])
    value = world.value
    assert world.true_reward([BOS, OFFSET + a, OFFSET + follower, EOS]) == value[a] + value[follower]
    assert world.true_reward([BOS, OFFSET + a, OFFSET + never]) == value[a] + value[never] - 2.0


def test_cli_rejects_bad_values():
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(), "ggro")
    good = parser.parse_args(["ggro"])
    assert _check(good) == ([1.0, 1.5], [2, 4, 8])
    for argv in (["--samples", "8"], ["--refinements", "2.5"], ["--thresholds", "x"], ["--nudge-temp", "0"]):
        with pytest.raises(ConfigError):
            _check(parser.parse_args(["ggro", *argv]))


@pytest.mark.parametrize("argv, words", [
    (["--top-k", "25"], "--top-k=25: at most 24"),  # was cut to 24 unseen, results.json saying 25
    (["--thresholds", "1,3.2"], "in (0, 3.178]"),  # above ln 24 no position is uncertain enough: base decoding
    (["--refinements", "1,4"], "S = 1 is the base decode"),
    (["--min-segment", "21"], "--min-segment=21: must be at most --max-new-tokens=20"),
])
def test_cli_refuses_settings_that_leave_plain_decoding_or_are_cut_unseen(argv, words):
    """Each of these ran GGRO rows identical to base decoding (0 nudges), reported as GGRO points."""
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(), "ggro")
    with pytest.raises(ConfigError) as e:
        _check(parser.parse_args(["ggro", *argv]))
    assert words in str(e.value), str(e.value)
    _check(parser.parse_args(["ggro", "--top-k", "24", "--thresholds", "3.17", "--min-segment", "20"]))


def test_best_of_n_weights_past_a_thousand_draws():
    """C(k-1, n-1) overflowed a float at about 1,030 draws (an OverflowError traceback for --samples 1030); the
    weights are a distribution, and with n = 1 each draw weighs 1/m."""
    from polyrl.safety.ggro.experiment import best_of_n_weights

    for m in (40, 1030, 5000):
        for n in (1, 16):
            w = best_of_n_weights(m, n)
            assert w.shape == (m,) and np.isfinite(w).all() and w.sum() == pytest.approx(1.0)
    assert best_of_n_weights(5000, 1) == pytest.approx(np.full(5000, 1 / 5000))
    assert best_of_n_weights(1030, 16)[:15].sum() == 0  # the 15 lowest draws are never the best of 16
