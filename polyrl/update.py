"""Step 4 of the training loop: epochs x minibatches x micro-batches of ``policy_loss``.

One optimizer step per minibatch, each with its own global Normalizer computed before the
micro-batch loop, so splitting into micro-batches never changes the loss or the gradient. A
non-finite loss or gradient skips the optimizer step; ``max_bad_steps`` in a row stop the run.

Data parallelism (``learner.fsdp``): every rank holds the whole batch and runs the micro-batches that
``learner.shard`` gives it (None: a pass with zero weight, so every rank runs as many passes); what the
ranks counted (metrics, micro-batches, zero-gradient tokens, a non-finite loss, reused log-probs) is
added up with ``learner.all_sum``. In one process both are trivial and nothing changes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import Tensor

from polyrl.batch import TokenBatch
from polyrl.errors import TrainingError
from polyrl.learner.local import Learner
from polyrl.objectives import Method, policy_loss
from polyrl.objectives.objective import zero_grad_by_quarter
from polyrl.registry import TRUST_REGIONS
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
    old_topk: Tensor | None  # [B, T, K] pi_old's log-probs at old_topk_ids
    ref_logp: Tensor | None
    values: Tensor | None = None  # critic values at the rollout weights (GAE presets)
    returns: Tensor | None = None
    sample_weight: Tensor | None = None  # [B] importance weight of each sequence's loss (None: all 1)
    old_topk_ids: Tensor | None = None  # [B, T, K] pi_old's top-K ids, computed before the update (not reuse_old)


class UpdateCounters(Protocol):
    """Where the update counts skipped optimizer steps (the trainer's resumable state)."""

    bad_steps: int  # consecutive skipped steps
    skipped_total: int


def plan_micro_batches(lengths: Tensor, units: Tensor, *, max_rows: int, max_tokens: int,
                       prompt_width: int) -> list[Tensor]:
    """Positions (into the minibatch) of each micro-batch; the loss does not depend on the split.

    ``max_tokens`` 0: consecutive chunks of ``max_rows``. Otherwise rows are packed by length: the units (``units``
    [n] labels rows that must stay together -- a preference pair's group -- else every row is its own unit) are
    sorted by their longest completion, longest first (ties keep their order, so a GRPO group of equal lengths stays
    together and shares its prompt's forward), and each micro-batch takes units while it holds at most ``max_rows``
    rows and at most ``max_tokens`` tokens of (prompt width + its longest completion) per row; at least one unit.
    The units are then dealt out evenly over that many micro-batches when the caps still hold (64 rows of 135
    tokens under 4096: 22 + 21 + 21, not 30 + 30 + 4).
    Micro-batches of similar lengths, trimmed to their own longest row by ``TokenBatch.trimmed``, run almost no
    padding (verl's dynamic batch size, ``ppo_max_token_len_per_gpu``, does the same)."""
    n = len(lengths)
    if max_tokens <= 0 or n == 0:
        return list(torch.arange(n).split(max_rows))
    labels = units.unique(return_inverse=True)[1]
    longest = torch.zeros(int(labels.max()) + 1, dtype=lengths.dtype).scatter_reduce(
        0, labels, lengths, reduce="amax", include_self=False)
    order = torch.argsort(longest, descending=True, stable=True).tolist()
    members = [torch.nonzero(labels == u).squeeze(1) for u in range(len(longest))]
    greedy = _pack(order, members, longest, max_rows, max_tokens, prompt_width)
    # The same number of micro-batches with the units dealt out evenly (no small last one), when that keeps the caps.
    even = [list(chunk) for chunk in torch.tensor(order).tensor_split(len(greedy))]
    fits = all(sum(len(members[u]) for u in c) <= max_rows and
               sum(len(members[u]) for u in c) * (prompt_width + int(longest[c[0]])) <= max_tokens for c in even)
    return [torch.cat([members[int(u)] for u in c]) for c in even] if fits else greedy


def _pack(order: list[int], members: list[Tensor], longest: Tensor, max_rows: int, max_tokens: int,
          prompt_width: int) -> list[Tensor]:
    """Greedy packing of ``plan_micro_batches``: units in ``order``, a new micro-batch when the next would pass a
    cap."""
    out: list[Tensor] = []
    rows: list[Tensor] = []
    count = width = 0
    for u in order:
        unit = members[u]
        if rows and (count + len(unit) > max_rows or (count + len(unit)) * width > max_tokens):
            out.append(torch.cat(rows))
            rows, count = [], 0
        if not rows:
            width = prompt_width + int(longest[u])  # a micro-batch's first unit is its longest
        rows.append(unit)
        count += len(unit)
    out.append(torch.cat(rows))
    return out


def update_policy(learner: Learner, method: Method, s: Scored, counters: UpdateCounters, *, epochs: int,
                  minibatches: int, micro_batch_size: int, horizon: int, topk: int, reuse_old: bool, seed: int,
                  max_bad_steps: int, micro_batch_tokens: int = 0,
                  skip_zero_adv: Literal["auto", "yes", "no"] = "no") -> dict[str, float]:
    """Run the optimizer steps on one scored batch; return its metrics: objective/* as means over the loss tokens of
    every pass (each pass's token means weighted by its tokens, so any split gives the same numbers), objective/loss
    the step loss averaged over the optimizer steps, perf/* and critic/* averaged over the steps taken.

    Micro-batches: ``plan_micro_batches`` (at most ``micro_batch_size`` rows; with ``micro_batch_tokens`` > 0 packed
    by length under that token cap and trimmed of the columns that are padding in all their rows).

    With ``reuse_old`` (one optimizer step per batch) the policy has not moved when the loss is computed,
    so the update's own detached log-probs serve as pi_old (TRL does the same); across ranks each
    rank fills the rows it ran and the rows are summed, so every rank ends with the full ``s.old_logp``.

    ``skip_zero_adv`` "auto" or "yes" (only for a method with ``zero_adv_rows_inert``): rows whose advantage is 0 at
    every loss token run in micro-batches of their own, forward only -- they have no gradient and leave the others'
    loss unchanged, so the step is the same without their backward; their forward still fills pi_old and the metrics.
    "auto": where ``plan_passes`` finds the backward saved worth the passes added; "yes": wherever a row is left with
    a gradient.
    """
    tb, mask = s.tb, s.mask
    B, T = tb.completion_mask.shape
    pairs = "whole_groups" in TRUST_REGIONS.spec(method.trust_region.name).tags  # a group's rows stay together
    lengths = tb.completion_mask.sum(-1).long()
    micro_sums: dict[str, float] = {}  # per micro-batch metrics (token means) x its loss tokens
    step_sums: dict[str, float] = {}  # per optimizer step metrics
    n_steps, counts = 0, torch.zeros(4, dtype=torch.float64)  # (loss tokens, step losses summed, forward-only rows,
    # loss tokens outside the filtered support)
    zero_grad_counts = torch.zeros(2, 4)
    step_gen = torch.Generator().manual_seed(seed)
    own = _OwnRows(s.old_logp) if reuse_old else None  # the rows this rank computed (reuse_old)
    if skip_zero_adv != "no" and not method.zero_adv_rows_inert:
        if skip_zero_adv == "yes":
            raise ValueError(f"skip_zero_adv = 'yes' is not allowed with method {method.name!r}: "
                             f"{method.zero_adv_rows_active()}")
        skip_zero_adv = "no"  # auto: nothing to skip for this method
    inert = ((s.adv == 0) | (mask == 0)).all(-1) if skip_zero_adv != "no" else torch.zeros(B, dtype=torch.bool)
    world = int(learner.all_sum(torch.ones(1))) if bool(inert.any()) else 1  # data-parallel ranks (a collective)
    for _epoch in range(epochs):
        order = torch.randperm(B, generator=step_gen) if minibatches > 1 else torch.arange(B)
        for mb in order.chunk(minibatches):
            norm = Normalizer.from_batch(mask[mb], s.group_ids[mb], horizon=horizon)
            group_tokens = group_token_counts(mask[mb], s.group_ids[mb])
            finite = True
            units = s.group_ids[mb] if pairs else torch.arange(len(mb))
            passes = plan_passes(lengths[mb], units, inert[mb], max_rows=micro_batch_size,
                                 max_tokens=micro_batch_tokens, prompt_width=tb.input_ids.shape[1] - T, full_width=T,
                                 world=world, always=skip_zero_adv == "yes")
            for grad, index, micro in _this_rank(learner, passes):
                real = index is not None  # else a zero-weight pass that keeps the ranks in lockstep
                rows = mb[micro]
                batch, w = tb.rows(rows).trimmed() if micro_batch_tokens > 0 else (tb.rows(rows), T)

                cut = functools.partial(_cut, rows, w)
                # pi_theta on pi_old's top-K support when that was computed before the update: after an optimizer step
                # its own top-K ids differ, and the trust region compares the two distributions column by column
                cur = learner.logprobs(batch, grad=grad, topk=topk, topk_ids=cut(s.old_topk_ids))
                if reuse_old:
                    s.old_logp[rows, :w] = cur.logp.detach()
                    if cur.topk_logp is not None:
                        if s.old_topk is None:
                            s.old_topk = cur.topk_logp.new_zeros((B, T, cur.topk_logp.shape[-1]))
                        s.old_topk[rows, :w] = cur.topk_logp.detach()
                    if real:
                        own.record(rows, s.old_logp[rows], None if s.old_topk is None else s.old_topk[rows])
                old_topk = cut(s.old_topk)
                # A sampled token this pass's top-k / top-p filter leaves out has log-prob -inf: the sampler's logits
                # differ from these by rounding (bfloat16: by far more) at the filter's edge, or another policy chose
                # it (agency); pi_old's or the reference's filter may have left it out before an update moved the
                # policy. It leaves the loss, counted, instead of making it nan (or a ratio of +inf).
                outside = ~torch.isfinite(cur.logp.detach()) | ~torch.isfinite(cut(s.old_logp))
                if s.ref_logp is not None:
                    outside |= ~torch.isfinite(cut(s.ref_logp))
                outside &= cut(mask) > 0
                micro_mask = cut(mask) * ~outside
                inputs = LossInputs(
                    logp=cur.logp, old_logp=cut(s.old_logp), adv=cut(s.adv), mask=micro_mask, normalizer=norm,
                    rollout_logp=cut(tb.rollout_logp), ref_logp=cut(s.ref_logp),
                    entropy=cur.entropy if method.entropy_grad else cur.entropy.detach(),  # differentiated by a bonus
                    group_ids=s.group_ids[rows], group_tokens=group_tokens[micro],
                    segment_ids=cut(s.segment_ids), turn_ids=cut(tb.turn_ids), topk_ids=cur.topk_ids,
                    # mu's top-K: the sampler records none; pi_old's is mu's where they share weights (a stale
                    # sampler is refused for the trust regions that read it: tag "rollout_topk")
                    topk_logp=cur.topk_logp, old_topk_logp=old_topk, rollout_topk_logp=old_topk,
                    sample_weight=cut(s.sample_weight),
                )
                out = policy_loss(inputs, method)
                if learner.all_sum(torch.tensor([float(not torch.isfinite(out.loss))])) > 0:  # on any rank
                    finite = False
                    break
                if grad:  # (a forward-only row has A = 0 everywhere: no token of it counts in zero_grad_counts)
                    zeros = zero_grad_by_quarter(out.surrogate, cur.logp, micro_mask, cut(s.adv))
                    learner.backward(out.loss if real else out.loss * 0.0)
                    if real:
                        zero_grad_counts += zeros
                tokens = float(micro_mask.sum()) if real else 0.0
                ran = [tokens, float(out.loss.detach()), 0.0 if grad else len(rows), float(outside.sum())] if real \
                    else [0.0] * 4
                counts += torch.tensor(ran, dtype=torch.float64)
                for k, v in out.metrics.items():  # token means, so weighted by tokens: the same for any split
                    micro_sums[k] = micro_sums.get(k, 0.0) + float(v) * tokens
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
    if own is not None:
        own.merge(learner, s)
    keys = sorted(micro_sums)  # the same on every rank: each ran the same passes of the same method
    totals = learner.all_sum(torch.cat([torch.tensor([micro_sums[k] for k in keys], dtype=torch.float64), counts]))
    tokens, loss_sum, forward_only, outside_total = totals[-4:].tolist()
    metrics = {k: v / max(1.0, tokens) for k, v in zip(keys, totals[:-4].tolist())}
    metrics["objective/outside_support_frac"] = outside_total / max(1.0, tokens + outside_total)
    if n_steps:  # the step loss, averaged over steps; none when every step was skipped (it logged 0.0)
        metrics["objective/loss"] = loss_sum / (epochs * minibatches)
    metrics.update({k: v / max(1, n_steps) for k, v in step_sums.items()})
    zero_grad_counts = learner.all_sum(zero_grad_counts)
    if skip_zero_adv != "no":
        metrics["perf/forward_only_frac"] = forward_only / max(1, B * epochs)
    for q in range(4):
        if zero_grad_counts[1, q] > 0:
            metrics[f"position/zero_grad_frac_q{q + 1}"] = float(zero_grad_counts[0, q] / zero_grad_counts[1, q])
    return metrics


# What one more pass costs, in tokens of forward (Python and small kernels), measured where it is largest against the
# compute: the demo's model (1.1M, 64 rows x 15 tokens, 1 CPU thread; ``benchmarks/zero_adv_rows.py --skip yes
# --length 8 --prompt 7``) ran 8, 16, 32 zero-advantage rows in a forward-only pass of their own at 0.99, 0.94, 0.83
# of the plain update's time: a pass costs about the forward of 210-260 tokens there. Elsewhere it differs (a larger
# model makes it fewer tokens, FSDP's all-gathers a pass more): --skip-zero-adv yes or no overrides the estimate.
PASS_COST_TOKENS = 256


def plan_passes(lengths: Tensor, units: Tensor, inert: Tensor, *, max_rows: int, max_tokens: int, prompt_width: int,
                full_width: int, world: int = 1, always: bool = False) -> list[tuple[bool, list[Tensor]]]:
    """The passes of one minibatch: [(with gradient, micro-batches as positions in the minibatch)].

    The ``inert`` rows (A = 0 everywhere, a method whose loss then gives them no gradient) run forward only, in
    micro-batches of their own, when that costs less (or ``always``); never when no row would be left with a gradient
    (AdamW still steps on its momentum after a zero gradient): then, or else, every row runs forward and backward.
    The cost is the busiest of ``world`` ranks' (``learner.shard`` deals micro-batch i to rank i mod world, a padding
    pass repeats micro-batch 0; ranks wait for each other): for each pass ``PASS_COST_TOKENS`` + its padded tokens x 3
    (forward and backward) or x 1 (forward only); a pass is trimmed to its longest row with ``max_tokens``, else runs
    ``full_width`` completion columns. An estimate: shared prompts (one forward per group) count once per row. Every
    rank computes the same plan from the same whole batch."""
    caps = dict(max_rows=max_rows, max_tokens=max_tokens, prompt_width=prompt_width)
    plain = [(True, list(plan_micro_batches(lengths, units, **caps)))]
    n = int(inert.sum())
    if n == 0 or n == len(inert):
        return plain
    split = []
    for grad, rows in ((True, torch.nonzero(~inert).squeeze(1)), (False, torch.nonzero(inert).squeeze(1))):
        split.append((grad, [rows[m] for m in plan_micro_batches(lengths[rows], units[rows], **caps)]))

    def cost(passes: list[tuple[bool, list[Tensor]]]) -> float:
        ranks = [0.0] * world
        for grad, micro in passes:
            sizes = [len(m) * (prompt_width + (int(lengths[m].max()) if max_tokens > 0 else full_width)) for m in micro]
            for k in range(-(-len(micro) // world)):
                for r in range(world):
                    i = k * world + r
                    ranks[r] += PASS_COST_TOKENS + (3 if grad else 1) * sizes[i if i < len(micro) else 0]
        return max(ranks)

    return split if always or cost(split) < cost(plain) else plain


def _this_rank(learner: Learner, passes: list[tuple[bool, list[Tensor]]]) -> Iterator[tuple[bool, int | None, Tensor]]:
    """(with gradient, micro-batch index or None for a zero-weight pass, its positions) of this rank's passes: each
    kind's micro-batches are sharded on their own, so every rank runs as many passes of each kind, in one order."""
    for grad, micro_batches in passes:
        for index in learner.shard(len(micro_batches)):
            yield grad, index, micro_batches[0 if index is None else index]


def _cut(rows: Tensor, w: int, x: Tensor | None) -> Tensor | None:
    """[B, T, ...] -> the micro-batch's rows and first ``w`` columns ([B] -> its rows)."""
    return None if x is None else x[rows, :w] if x.dim() > 1 else x[rows]


class _OwnRows:
    """The rows of pi_old (and its top-K) one rank computed in a ``reuse_old`` update, summed over ranks at the end:
    every row is computed by exactly one rank, so the sum is the full tensor on every rank."""

    def __init__(self, old_logp: Tensor):
        self.logp = torch.zeros_like(old_logp)
        self.topk: Tensor | None = None
        self.done = torch.zeros(old_logp.shape[0], dtype=old_logp.dtype)

    def record(self, rows: Tensor, logp: Tensor, topk_logp: Tensor | None) -> None:
        self.logp[rows] = logp.detach()
        if topk_logp is not None:
            if self.topk is None:
                self.topk = topk_logp.new_zeros((self.logp.shape[0], *topk_logp.shape[1:]))
            self.topk[rows] = topk_logp.detach()
        self.done[rows] = 1

    def merge(self, learner: Learner, s: Scored) -> None:
        done = learner.all_sum(self.done) > 0  # rows no rank reached (a non-finite loss stopped it) keep their value
        s.old_logp.copy_(torch.where(done[:, None], learner.all_sum(self.logp), s.old_logp))
        if s.old_topk is not None:  # on every rank alike (a rank with only zero-weight passes recorded none)
            mine = self.topk if self.topk is not None else torch.zeros_like(s.old_topk)
            s.old_topk.copy_(torch.where(done[:, None, None], learner.all_sum(mine), s.old_topk))
