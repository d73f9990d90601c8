"""Every speed switch computes what the plain path computes (issue 23): shared prompts in the training forward and in
the sampler's prefill, and the fused AdamW kernel. Float64 models show the arithmetic is the same (log-probs and
loss to 1e-9, gradients to 1e-6 of their largest entry: transformers' RMSNorm computes in float32 even in a float64
model, so a gradient summed in another order differs at float32's rounding); float32 shows the rounding stays within
1e-6 of the loss and 1e-5 of the gradients' size."""

from __future__ import annotations

import pytest
import torch

from polyrl import shared_prompt
from polyrl.learner.common import make_optimizer
from polyrl.model import completion_logprobs, load_policy
from polyrl.rollout.generator import SamplingParams
from polyrl.rollout.hf import HFGenerator
from polyrl.shared_prompt import distinct_prompts
from polyrl.tinyhf import ARCHITECTURES, build_tiny, train_bpe_tokenizer

PROMPTS = ["7+5=", "48+95=", "The answer to 123+456 is"]  # different lengths: the shared block has left padding
ARCHS = [pytest.param(a, marks=[] if a in ARCHITECTURES else pytest.mark.skip(reason=f"transformers lacks {a}"))
         for a in ("llama", "qwen2", "gemma2", "gemma3_text", "phi3", "gpt2", "olmo2")]


@pytest.fixture(scope="module")
def bpe():
    return train_bpe_tokenizer()


def _batch(generator: HFGenerator, n: int = 3):
    """Rows as the trainer lays them out: left-padded prompts, then right-padded completions of varied lengths."""
    from polyrl.batch import TokenBatch

    samples = generator.generate(PROMPTS, SamplingParams(n=n, max_new_tokens=7, temperature=1.0, seed=1))
    return TokenBatch.from_samples(samples, generator.pad_id)


def _scores_and_grads(model, tb, share: bool, topk: int = 3):
    model.zero_grad(set_to_none=True)
    out = completion_logprobs(model, tb.input_ids, tb.attention_mask, tb.completion_mask, topk=topk,
                              share_prompts=share)
    weights = torch.linspace(-1.0, 2.0, out.logp.numel(), dtype=out.logp.dtype).reshape(out.logp.shape)
    loss = (weights * out.logp).sum() / tb.completion_mask.sum() - 0.1 * out.entropy.mean() \
        + 0.01 * out.topk_logp.mean()
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), out, grads


def test_distinct_prompts_groups_rows_by_their_prompt_block():
    ids = torch.tensor([[0, 5, 6, 9], [0, 5, 6, 8], [4, 5, 6, 9], [0, 5, 6, 7]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]])
    first, inverse = distinct_prompts(ids, mask, width=1)
    # rows 0 and 1 share "5 6" after one pad; row 2 is "4 5 6"; row 3 is "0 5 6" unpadded (pad id 0 != token 0)
    assert inverse[0] == inverse[1] and len({inverse[0].item(), inverse[2].item(), inverse[3].item()}) == 3
    assert sorted(first.tolist()) == [0, 2, 3]
    assert distinct_prompts(ids[[0, 2, 3]], mask[[0, 2, 3]], width=1) is None  # nothing shared: the plain path


@pytest.mark.parametrize("arch", ARCHS)
def test_shared_prompts_give_the_plain_forward_log_probs_and_gradients(arch, bpe, tmp_path):
    model_dir = build_tiny(arch, tmp_path / "m", tokenizer=bpe)
    model, tok = load_policy(model_dir, threads=1)
    tb = _batch(HFGenerator(model, tok))
    assert distinct_prompts(tb.input_ids, tb.attention_mask, tb.completion_mask.shape[1]) is not None
    if arch == "gemma2":  # its float64 forward is NaN in transformers itself: checked in float32, to its rounding
        _check_float32(model.eval(), tb)
        return
    model = model.double().eval()  # eval: GPT-2's dropout would make two forwards differ
    plain_loss, plain, plain_grads = _scores_and_grads(model, tb, share=False)
    loss, out, grads = _scores_and_grads(model, tb, share=True)
    assert abs(loss - plain_loss) < 1e-9
    for name in ("logp", "entropy", "topk_logp"):
        torch.testing.assert_close(getattr(out, name), getattr(plain, name), atol=1e-9, rtol=0)
    assert torch.equal(out.topk_ids, plain.topk_ids)
    assert grads.keys() == plain_grads.keys()
    for name, g in grads.items():  # RMSNorm runs in float32 even in a float64 model (transformers upcasts to 32)
        scale = float(plain_grads[name].abs().max())
        torch.testing.assert_close(g, plain_grads[name], atol=1e-6 * scale, rtol=0, msg=name)


def test_shared_prompts_in_float32_stay_within_rounding(bpe, tmp_path):
    model, tok = load_policy(build_tiny("llama", tmp_path / "m", tokenizer=bpe), threads=1)
    _check_float32(model.train(), _batch(HFGenerator(model, tok), n=4))


def _check_float32(model, tb):
    plain_loss, _, plain_grads = _scores_and_grads(model, tb, share=False)
    loss, _, grads = _scores_and_grads(model, tb, share=True)
    assert abs(loss - plain_loss) < 1e-6
    for name, g in grads.items():
        scale = plain_grads[name].abs().max().clamp_min(1e-3)
        assert (g - plain_grads[name]).abs().max() / scale < 1e-5, name


def test_the_sampler_prefills_each_distinct_prompt_once_with_the_same_rollouts(bpe, tmp_path, monkeypatch):
    model, tok = load_policy(build_tiny("llama", tmp_path / "m", tokenizer=bpe), threads=1)
    generator = HFGenerator(model, tok)
    params = SamplingParams(n=4, max_new_tokens=8, temperature=1.0, seed=5)
    calls = []
    real = shared_prompt.distinct_prompts

    def spy(*a, **k):
        calls.append(out := real(*a, **k))
        return out

    monkeypatch.setattr("polyrl.rollout.hf.distinct_prompts", spy)
    shared = generator.generate(PROMPTS, params)
    assert calls and calls[0] is not None and len(calls[0][0]) == len(PROMPTS)  # 3 prefills for 12 rows
    monkeypatch.setattr("polyrl.rollout.hf.distinct_prompts", lambda *a, **k: None)
    plain = generator.generate(PROMPTS, params)
    for a, b in zip(shared, plain):
        assert a.completion_token_ids == b.completion_token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-6, rtol=0)


def test_the_in_place_kv_cache_gives_the_concatenating_caches_rollouts(tiny_model, monkeypatch):
    from transformers import DynamicCache

    from polyrl.rollout.kv_cache import InPlaceLayer, decode_cache

    model, tok = load_policy(tiny_model, threads=1)  # a character vocabulary: EOS is sampled now and then
    assert all(isinstance(layer, InPlaceLayer) for layer in decode_cache(model.config, 16).layers)
    generator = HFGenerator(model, tok)
    params = SamplingParams(n=4, max_new_tokens=40, temperature=1.0, seed=2)
    in_place = generator.generate(PROMPTS, params)
    assert len({len(s.completion_token_ids) for s in in_place}) > 1  # rows finished early and were dropped
    monkeypatch.setattr("polyrl.rollout.hf.decode_cache", lambda config, capacity: DynamicCache(config=config))
    concatenated = generator.generate(PROMPTS, params)
    for a, b in zip(in_place, concatenated):
        assert a.completion_token_ids == b.completion_token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-6, rtol=0)


def test_an_in_place_layer_refuses_more_tokens_than_its_capacity():
    from polyrl.rollout.kv_cache import InPlaceLayer

    layer = InPlaceLayer(capacity=3)
    keys, values = layer.update(torch.ones(2, 1, 2, 4), torch.zeros(2, 1, 2, 4))
    assert keys.shape == (2, 1, 2, 4) and layer.get_seq_length() == 2
    keys, _ = layer.update(torch.full((2, 1, 1, 4), 5.0), torch.zeros(2, 1, 1, 4))
    assert keys[:, :, 2].eq(5).all() and keys[:, :, :2].eq(1).all()
    layer.batch_select_indices(torch.tensor([1]))
    assert layer.keys.shape == (1, 1, 3, 4)
    with pytest.raises(ValueError, match="exceed the capacity 3"):
        layer.update(torch.ones(1, 1, 1, 4), torch.ones(1, 1, 1, 4))


def test_in_place_rows_follow_any_selection_and_finished_rows_move_the_fewest():
    from polyrl.rollout.kv_cache import InPlaceLayer, fill_order

    finished = torch.tensor([False, True, False, True, False, False, True])
    order = fill_order(finished)
    assert order.tolist() == [0, 4, 2, 5]  # slots 1 and 3 take the live rows 4 and 5; rows 0 and 2 stay
    rows = torch.arange(7.0).reshape(7, 1, 1, 1).expand(7, 2, 3, 4)  # row r holds the value r
    for indices in (order, torch.tensor([3, 0, 1]), torch.tensor([2, 2, 0, 1, 0, 2, 1, 3, 4])):  # gather-then-write
        layer = InPlaceLayer(capacity=5)
        layer.update(rows.clone(), -rows)
        layer.batch_select_indices(indices)
        expected = indices.float().reshape(-1, 1, 1, 1).expand(-1, 2, 3, 4)
        assert layer.keys.shape == (len(indices), 2, 3, 4)
        torch.testing.assert_close(layer.keys, expected, rtol=0, atol=0)
        torch.testing.assert_close(layer.values, -expected, rtol=0, atol=0)
        keys, _ = layer.update(torch.full((len(indices), 2, 1, 4), 9.0), torch.zeros(len(indices), 2, 1, 4))
        assert keys.shape[2] == 4 and keys[:, :, 3].eq(9).all() and keys[:, :, :3].equal(expected)


def test_fused_adamw_takes_the_loop_implementations_steps():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    twin = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    twin.load_state_dict(net.state_dict())
    (opt, _), (fused, _) = (make_optimizer(m.parameters(), lr=1e-2, weight_decay=0.1, warmup_steps=0, fused=f)
                            for m, f in ((net, False), (twin, True)))
    assert fused.defaults["fused"] and not opt.defaults.get("fused")
    start = net[0].weight.detach().clone()
    x = torch.randn(64, 16)
    for _ in range(5):
        for model, optimizer in ((net, opt), (twin, fused)):
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            optimizer.step()
    moved = max((a - b).abs().max() for a, b in zip(net.parameters(), twin.parameters()))
    assert moved < 1e-6
    assert (net[0].weight - start).abs().max() > 1e-3  # the steps did move the weights


def test_micro_batches_pack_rows_by_length_under_the_token_cap():
    from polyrl.update import plan_micro_batches

    lengths = torch.tensor([3, 9, 5, 9, 1, 4])
    rows = torch.arange(6)
    plan = lambda **k: [m.tolist() for m in plan_micro_batches(lengths, rows, prompt_width=1, **k)]  # noqa: E731
    assert plan(max_rows=4, max_tokens=0) == [[0, 1, 2, 3], [4, 5]]  # no cap: consecutive chunks
    # longest first (ties in order): 1 + 9 = 10 wide -> 2 rows in 20 tokens, then [2, 5, 0] in 18, then [4]: three
    # micro-batches, and the same three with the rows dealt out evenly still keep the caps
    assert plan(max_rows=4, max_tokens=20) == [[1, 3], [2, 5], [0, 4]]
    assert plan(max_rows=2, max_tokens=100) == [[1, 3], [2, 5], [0, 4]]  # the row cap still holds
    assert plan(max_rows=4, max_tokens=5) == [[1], [3], [2], [5], [0], [4]]  # never fewer than one row
    pairs = torch.tensor([7, 7, 8, 8, 9, 9])  # units that stay together (a preference pair's group)
    got = [m.tolist() for m in plan_micro_batches(lengths, pairs, max_rows=4, max_tokens=20, prompt_width=1)]
    assert got == [[0, 1], [2, 3], [4, 5]]


def test_trimming_drops_only_columns_that_are_padding_everywhere(tiny_model):
    from polyrl.batch import TokenBatch
    from polyrl.rollout.generator import Sample

    def sample(prompt, completion):
        return Sample(prompt_index=0, prompt_token_ids=prompt, completion_token_ids=completion,
                      logprobs=[-0.5] * len(completion), finish_reason="stop", text="")

    rows = [sample([5, 6, 7], [8, 9, 2]), sample([5, 6], [8]), sample([4, 5, 6, 7], [9, 9, 9, 9])]
    tb = TokenBatch.from_samples(rows, pad_id=0)
    small, width = tb.rows(torch.tensor([0, 1])).trimmed()
    assert width == 3 and small.input_ids.tolist() == [[5, 6, 7, 8, 9, 2], [0, 5, 6, 8, 0, 0]]
    model, _ = load_policy(tiny_model, threads=1)
    full = completion_logprobs(model, tb.input_ids[:2], tb.attention_mask[:2], tb.completion_mask[:2])
    cut = completion_logprobs(model, small.input_ids, small.attention_mask, small.completion_mask)
    torch.testing.assert_close(cut.logp, full.logp[:, :width], atol=1e-6, rtol=0)
    assert full.logp[:, width:].abs().sum() == 0


def test_a_batch_on_its_own_device_is_not_copied_and_keeps_every_field():
    """``TokenBatch.to`` and ``TokenLogprobs.cpu`` (how learners hand batches to a GPU and results back) cost nothing
    where the tensors already are, and carry the optional fields too (FSDP's old mover dropped ``sum_pi_sq``)."""
    from polyrl.batch import TokenBatch
    from polyrl.model import TokenLogprobs

    ids = torch.arange(12).reshape(2, 6)
    comp = torch.ones(2, 3)
    tb = TokenBatch(ids, torch.ones_like(ids), comp, -comp, comp, torch.zeros(2, 3, dtype=torch.long), comp * 0.5)
    moved = tb.to(torch.device("cpu"))
    assert all(getattr(moved, f) is getattr(tb, f) for f in ("input_ids", "completion_mask", "sum_pi_sq"))
    logp = torch.randn(2, 3, requires_grad=True)
    back = TokenLogprobs(logp, None, ids[:, :3, None], None).cpu()
    assert back.logp is logp and back.entropy is None and back.topk_ids.shape == (2, 3, 1)


@pytest.mark.parametrize("switch", [{"share_prompts": False}, {"fused_adam": False}, {"micro_batch_tokens": 0}],
                         ids=["share_prompts", "fused_adam", "micro_batch_tokens"])
def test_each_speed_setting_leaves_training_as_it_was(tiny_model, tmp_path, switch):
    import io
    import json

    from rich.console import Console
    from safetensors.torch import load_file

    from polyrl.config import build_config
    from polyrl.methods import get_method
    from polyrl.tasks.arithmetic import AdditionTask
    from polyrl.trainer import train

    runs = {}
    for name, extra in (("fast", {"micro_batch_tokens": 30}), ("plain", switch)):
        cfg = build_config(dict(steps=2, prompts_per_step=3, group_size=4, max_new_tokens=6, eval_prompts=2,
                                eval_every=0, checkpoint_every=0, tensorboard=False, log_every=0, lr=1e-3,
                                warmup_steps=0, threads=1, **extra))
        run = tmp_path / name
        train(cfg, get_method("grpo"), model_dir=tiny_model, task=AdditionTask(), run_dir=str(run),
              console=Console(file=io.StringIO()))
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        weights = load_file(str(next((run / "checkpoints").glob("step_*")) / "model.safetensors"))
        runs[name] = ([r["objective/loss"] for r in rows if "objective/loss" in r], weights)
    (fast_loss, fast_w), (plain_loss, plain_w) = runs["fast"], runs["plain"]
    assert len(fast_loss) == 2 and fast_loss == pytest.approx(plain_loss, abs=1e-6)
    assert max(float((fast_w[k] - plain_w[k]).abs().max()) for k in plain_w) < 1e-5


def _zero_adv_update(model_dir: str, skip: str, adv: torch.Tensor, *, minibatches: int, **overrides) -> dict:
    """Two epochs of ``update_policy`` (pi_old from the update, 2-row micro-batches) on one seeded 8-row batch."""
    from types import SimpleNamespace

    from polyrl.batch import TokenBatch
    from polyrl.learner.local import LocalLearner
    from polyrl.methods import get_method
    from polyrl.update import Scored, update_policy

    model, _ = load_policy(model_dir, threads=1)
    learner = LocalLearner(model, lr=1e-2, weight_decay=0.01, warmup_steps=0, max_grad_norm=1.0, temperature=1.0,
                           top_p=1.0, top_k=0, fp32_head=False, micro_batch_size=2)
    g = torch.Generator().manual_seed(3)
    B, P, T = adv.shape[0], 4, 6
    lengths = torch.tensor([6, 2, 5, 6, 3, 1, 4, 6])
    comp = (torch.arange(T)[None] < lengths[:, None]).float()
    tb = TokenBatch(torch.randint(4, 60, (B, P + T), generator=g), torch.cat([torch.ones(B, P).long(), comp.long()], 1),
                    comp, -torch.rand(B, T, generator=g) * comp, comp.clone(), torch.zeros(B, T, dtype=torch.long))
    s = Scored(tb=tb, mask=tb.loss_mask, adv=adv[:, None].expand(B, T).clone(), group_ids=torch.arange(B) // 4,
               segment_ids=torch.zeros(B, T, dtype=torch.long), old_logp=torch.zeros(B, T), old_topk=None,
               ref_logp=None)
    method = get_method("dapo", filters=[], **overrides)
    grads = []
    step = learner.step

    def recorded_step() -> float:  # the gradient of each optimizer step, before it is applied
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        return step()

    learner.step = recorded_step
    metrics = update_policy(learner, method, s, SimpleNamespace(bad_steps=0, skipped_total=0), epochs=2,
                            minibatches=minibatches, micro_batch_size=2, horizon=T, topk=0, reuse_old=True, seed=0,
                            max_bad_steps=3, micro_batch_tokens=30, skip_zero_adv=skip)
    return dict(metrics=metrics, old_logp=s.old_logp, grads=grads,
                weights={k: v.detach().clone() for k, v in model.state_dict().items()})


@pytest.mark.parametrize("minibatches", [1, 2])
def test_zero_advantage_rows_forward_only_give_the_same_step(tiny_model, minibatches):
    """Rows 1, 2 and 5 have A = 0: with skip_zero_adv they run forward only (pi_old and the metrics still see
    them) and the weights after two epochs are those of the plain update. With 2 minibatches of shuffled rows the
    count of forward-only rows follows the shuffle: a minibatch's zero-advantage rows run forward only unless they are
    all its rows (then it runs as usual: AdamW still steps on its momentum)."""
    adv = torch.tensor([1.0, 0.0, 0.0, -0.5, 2.0, 0.0, 0.7, -1.5])
    plain = _zero_adv_update(tiny_model, "no", adv, minibatches=minibatches)
    fast = _zero_adv_update(tiny_model, "yes", adv, minibatches=minibatches)  # a forward-only pass even if it costs
    assert len(fast["grads"]) == len(plain["grads"]) == 2 * minibatches
    for got, want in zip(fast["grads"], plain["grads"]):  # float32 rounding of another summation order
        assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    # two Adam steps amplify that rounding where consecutive gradients nearly cancel (as in test_fsdp)
    assert max(float((fast["weights"][k] - plain["weights"][k]).abs().max()) for k in plain["weights"]) < 1e-4
    torch.testing.assert_close(fast["old_logp"], plain["old_logp"], atol=1e-6, rtol=0)
    for key, value in plain["metrics"].items():  # token-weighted: the same whatever the passes (4 vs 3 + 2 here)
        if key.startswith(("objective/", "position/")):
            assert fast["metrics"][key] == pytest.approx(value, abs=1e-6), key
    assert "perf/forward_only_frac" not in plain["metrics"]
    frac = fast["metrics"]["perf/forward_only_frac"]
    assert frac == 3 / 8 if minibatches == 1 else 0 < frac <= 3 / 8  # (in a minibatch with a live row)
    # every row at A = 0: nothing is left out (the plain step), and the fraction says so
    none = _zero_adv_update(tiny_model, "yes", torch.zeros(8), minibatches=minibatches)
    assert none["metrics"]["perf/forward_only_frac"] == 0.0


def test_zero_advantage_rows_keep_their_backward_where_the_loss_gives_them_a_gradient(tiny_model):
    """An entropy bonus gives every row a gradient: 'auto' runs every row forward and backward, 'yes' is refused."""
    adv = torch.tensor([1.0, 0.0, 0.0, -0.5, 2.0, 0.0, 0.7, -1.5])
    auto = _zero_adv_update(tiny_model, "auto", adv, minibatches=1, entropy_coef=0.01)
    assert "perf/forward_only_frac" not in auto["metrics"]
    with pytest.raises(ValueError, match="entropy bonus gives every row a gradient"):
        _zero_adv_update(tiny_model, "yes", adv, minibatches=1, entropy_coef=0.01)


def test_zero_advantage_rows_run_forward_only_where_their_backward_outweighs_a_pass():
    from polyrl.update import PASS_COST_TOKENS, plan_passes

    def kinds(inert, lengths, always=False, **caps):
        got = plan_passes(torch.tensor(lengths), torch.arange(len(lengths)), torch.tensor(inert), prompt_width=1,
                          full_width=max(lengths), always=always, **caps)
        return [(grad, sorted(int(i) for m in micro for i in m), len(micro)) for grad, micro in got]

    assert PASS_COST_TOKENS == 256
    four = [4, 4, 4, 4]  # 5 tokens a row: 2 rows under 12 tokens, so all four rows take 2 passes
    # two inert rows: 1 pass with a gradient + 1 without, no pass added, 2 x 10 tokens of backward saved
    assert kinds([True, True, False, False], four, max_rows=4, max_tokens=12) == [(True, [2, 3], 1),
                                                                                  (False, [0, 1], 1)]
    # one: the 3 others still take 2 passes, so a pass is added for 2 x 5 tokens of backward -- unless always
    assert kinds([True, False, False, False], four, max_rows=4, max_tokens=12) == [(True, [0, 1, 2, 3], 2)]
    assert kinds([True, False, False, False], four, True, max_rows=4, max_tokens=12)[1] == (False, [0], 1)
    # one pass of all four rows becomes two: worth it for 2 x 2 x 65 = 260 tokens, not for 2 x 2 x 61 = 244
    assert kinds([True, True, False, False], [64, 64, 4, 4], max_rows=4, max_tokens=0)[1] == (False, [0, 1], 1)
    assert kinds([True, True, False, False], [60, 60, 4, 4], max_rows=4, max_tokens=0) == [(True, [0, 1, 2, 3], 1)]
    # every row inert: no row would have a gradient, so the plain step runs (AdamW steps on its momentum)
    assert kinds([True] * 4, four, True, max_rows=4, max_tokens=12) == [(True, [0, 1, 2, 3], 2)]
    # 16 rows of 65 tokens, 8 a pass, 4 inert. One rank: 2 x (256 + 3 x 520) = 3632 plain, split (256 + 3 x 520) +
    # (256 + 3 x 260) + (256 + 260) = 3368. Two ranks: 1816 plain, split 2332 on rank 0 ([8] then the forward-only
    # [4]) while rank 1 repeats [4] as its padding pass: the ranks wait for the busiest, so no split.
    sixteen, four_inert = [64] * 16, [True] * 4 + [False] * 12
    assert [k[0] for k in kinds(four_inert, sixteen, max_rows=8, max_tokens=0)] == [True, False]
    assert [k[0] for k in kinds(four_inert, sixteen, max_rows=8, max_tokens=0, world=2)] == [True]
