"""Step 4 of the training loop: epochs x minibatches x micro-batches of ``policy_loss``.

One optimizer step per minibatch, each with its own global Normalizer computed before the
micro-batch loop, so splitting into micro-batches never changes the loss or the gradient. A
non-finite loss or gradient skips the optimizer step; ``max_bad_steps`` in a row stop the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from polyrl.batch import TokenBatch
from polyrl.errors import TrainingError
from polyrl.learner.local import Learner
from polyrl.objectives import Method, policy_loss
from polyrl.objectives.objective import zero_grad_by_quarter
from polyrl.types import LossInputs, Normalizer, group_token_counts


@dataclass
class Scored:
    """A rollout batch with everything the update reads (step 2 and 3 of the loop)."""

    tb: TokenBatch
    mask: Tensor  # [B, T] tokens that count for the loss
    adv: Tensor  # [B, T]
    group_ids: Tensor  # [B]
    segment_ids: Tensor  # [B, T]
    old_logp: Tensor  # [B, T] filled in during the update when reuse_old
    old_topk: Tensor | None
    ref_logp: Tensor | None
    values: Tensor | None = None  # critic values at the rollout weights (GAE presets)
    returns: Tensor | None = None
    sample_weight: Tensor | None = None  # [B] importance weight of each sequence's loss (None: all 1)


class UpdateCounters(Protocol):
    """Where the update counts skipped optimizer steps (the trainer's resumable state)."""

    bad_steps: int  # consecutive skipped steps
    skipped_total: int


def update_policy(learner: Learner, method: Method, s: Scored, counters: UpdateCounters, *, epochs: int,
                  minibatches: int, micro_batch_size: int, horizon: int, topk: int, reuse_old: bool, seed: int,
                  max_bad_steps: int) -> dict[str, float]:
    """Run the optimizer steps on one scored batch; return averaged objective/*, perf/* and critic/* metrics.

    With ``reuse_old`` (one optimizer step per batch) the policy has not moved when the loss is computed,
    so the update's own detached log-probs serve as pi_old (TRL does the same).
    """
    tb, mask = s.tb, s.mask
    B = tb.input_ids.shape[0]
    micro_sums: dict[str, float] = {}  # per micro-batch metrics, averaged at the end
    step_sums: dict[str, float] = {}  # per optimizer step metrics
    n_micro = n_steps = 0
    zero_grad_counts = torch.zeros(2, 4)
    step_gen = torch.Generator().manual_seed(seed)
    for _epoch in range(epochs):
        order = torch.randperm(B, generator=step_gen) if minibatches > 1 else torch.arange(B)
        for mb in order.chunk(minibatches):
            norm = Normalizer.from_batch(mask[mb], s.group_ids[mb], horizon=horizon)
            group_tokens = group_token_counts(mask[mb], s.group_ids[mb])
            finite = True
            for micro in torch.arange(len(mb)).split(micro_batch_size):
                rows = mb[micro]
                cur = learner.logprobs(tb.rows(rows), grad=True, topk=topk)
                if reuse_old:
                    s.old_logp[rows] = cur.logp.detach()
                    if cur.topk_logp is not None:
                        if s.old_topk is None:
                            s.old_topk = cur.topk_logp.new_zeros((B, *cur.topk_logp.shape[1:]))
                        s.old_topk[rows] = cur.topk_logp.detach()
                old_topk = None if s.old_topk is None else s.old_topk[rows]
                inputs = LossInputs(
                    logp=cur.logp, old_logp=s.old_logp[rows], adv=s.adv[rows], mask=mask[rows], normalizer=norm,
                    rollout_logp=tb.rollout_logp[rows], ref_logp=None if s.ref_logp is None else s.ref_logp[rows],
                    entropy=cur.entropy.detach(), group_ids=s.group_ids[rows], group_tokens=group_tokens[micro],
                    segment_ids=s.segment_ids[rows], turn_ids=tb.turn_ids[rows], topk_ids=cur.topk_ids,
                    topk_logp=cur.topk_logp, old_topk_logp=old_topk, rollout_topk_logp=old_topk,
                    sample_weight=None if s.sample_weight is None else s.sample_weight[rows],
                )
                out = policy_loss(inputs, method)
                if not torch.isfinite(out.loss):
                    finite = False
                    break
                zero_grad_counts += zero_grad_by_quarter(out.surrogate, cur.logp, mask[rows], s.adv[rows])
                learner.backward(out.loss)
                n_micro += 1
                for k, v in {**out.metrics, "objective/loss": out.loss.detach()}.items():
                    micro_sums[k] = micro_sums.get(k, 0.0) + float(v)
            grad_norm = learner.step() if finite else float("nan")  # a non-finite norm skips the update too
            if not math.isfinite(grad_norm):  # skip the step, count it, stop when it keeps happening
                learner.skip_step()
                counters.bad_steps += 1
                counters.skipped_total += 1
                if counters.bad_steps >= max_bad_steps:
                    raise TrainingError(f"{counters.bad_steps} optimizer steps in a row had a non-finite loss or "
                                        "gradient; lower lr or check the method's settings")
                continue
            counters.bad_steps = 0
            n_steps += 1
            step_sums["perf/grad_norm"] = step_sums.get("perf/grad_norm", 0.0) + grad_norm
            if s.returns is not None:  # a critic preset: its value loss takes a step with each policy step
                for k, v in learner.critic_step(tb.rows(mb), s.values[mb], s.returns[mb]).items():
                    step_sums[k] = step_sums.get(k, 0.0) + v
    metrics = {k: v / max(1, n_micro) for k, v in micro_sums.items()}
    metrics.update({k: v / max(1, n_steps) for k, v in step_sums.items()})
    for q in range(4):
        if zero_grad_counts[1, q] > 0:
            metrics[f"position/zero_grad_frac_q{q + 1}"] = float(zero_grad_counts[0, q] / zero_grad_counts[1, q])
    return metrics
