"""The update loop's handling of tokens the trainer's own sampling filters leave out (update_policy)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from polyrl.methods import get_method
from polyrl.update import Scored, update_policy
from tests.helpers import random_batch, tiny_learner


def test_a_token_outside_the_trainers_top_k_leaves_the_loss_instead_of_skipping_the_step(tiny_model):
    """The sampler and the trainer filter top-k / top-p from logits that differ by rounding (bfloat16: by far more):
    a sampled token at the edge can come back -inf. Before, its nan loss skipped the whole step; now it leaves the
    loss, counted in objective/outside_support_frac, and the other tokens train."""
    learner = tiny_learner(tiny_model, top_k=2)
    model = learner.model
    g = torch.Generator().manual_seed(1)
    B, P, T = 4, 3, 5
    tb = random_batch(B, P, T, g)
    with torch.no_grad():  # greedy completions (inside top-2), then row 0's first token the least likely one
        for t in range(T):
            tb.input_ids[:, P + t] = model(input_ids=tb.input_ids[:, :P + t]).logits[:, -1].argmax(-1)
        tb.input_ids[0, P] = int(model(input_ids=tb.input_ids[:1, :P]).logits[0, -1].argmin())
    outside = ~torch.isfinite(learner.logprobs_nograd(tb).logp)
    assert outside[0, 0] and 0 < int(outside.sum()) < B * T
    before = [p.detach().clone() for p in model.parameters()]
    counters = SimpleNamespace(bad_steps=0, skipped_total=0)
    scored = Scored(tb=tb, mask=tb.loss_mask, adv=torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None].expand(B, T).clone(),
                    group_ids=torch.zeros(B, dtype=torch.long), segment_ids=torch.zeros(B, T, dtype=torch.long),
                    old_logp=torch.zeros(B, T), old_topk=None, ref_logp=None)
    metrics = update_policy(learner, get_method("grpo", kl=None, kl_coef=0.0), scored, counters, epochs=1,
                            minibatches=1, micro_batch_size=8, horizon=T, topk=0, reuse_old=True, seed=0,
                            max_bad_steps=5)
    assert counters.skipped_total == 0 and torch.isfinite(torch.tensor(metrics["objective/loss"]))
    assert metrics["objective/outside_support_frac"] == float(outside.sum()) / (B * T)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_a_token_outside_pi_olds_top_k_stays_out_after_the_policy_moved(tiny_model):
    """pi_old computed before the update (several epochs): a token its top-2 left out has old log-prob -inf. After an
    optimizer step the policy's own top-2 may keep it: it must stay out of the loss (a ratio of +inf made CISPO's and
    CE-GPPO's loss nan and skipped every later step of the batch)."""
    learner = tiny_learner(tiny_model, top_k=2)
    tb = random_batch(8, 3, 5, torch.Generator().manual_seed(2))  # random tokens: many outside top-2
    old = learner.logprobs_nograd(tb).logp
    assert (~torch.isfinite(old)).any()
    B, T = old.shape
    for method in ("cispo", "ce_gppo"):
        counters = SimpleNamespace(bad_steps=0, skipped_total=0)
        scored = Scored(tb=tb, mask=tb.loss_mask, adv=torch.randn(B, generator=torch.Generator().manual_seed(3))[
            :, None].expand(B, T).clone(), group_ids=torch.arange(B) // 4,
            segment_ids=torch.zeros(B, T, dtype=torch.long), old_logp=old.clone(), old_topk=None, ref_logp=None)
        metrics = update_policy(learner, get_method(method), scored, counters, epochs=4, minibatches=1,
                                micro_batch_size=8, horizon=T, topk=0, reuse_old=False, seed=0, max_bad_steps=10)
        assert counters.skipped_total == 0, method
        assert abs(metrics["objective/loss"]) < 10 and metrics["objective/outside_support_frac"] > 0
