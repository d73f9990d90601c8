"""Agency transfer (arXiv:2606.09825): a frozen baseline policy acts first, the learner takes over.

The paper's arbitration rule and schedule were not readable (shared/spec/methods-seedblog.md §9);
this is OUR operational version of "rely strongly on the baseline, then progressively transfer
agency to the learner":

- a schedule ``beta(step)`` goes from 1 (the baseline acts) to 0 (the learner acts alone);
- ``mode="token"``: before every token a coin with P(baseline) = beta picks who chooses it, so the
  behaviour policy is the per-token mixture  mu(y_t) = beta pi_b(y_t) + (1 - beta) pi_theta(y_t);
- ``mode="sequence"``: one coin per completion picks who writes all of it, so the behaviour policy
  of the whole sequence is  beta P_b(y) + (1 - beta) P_theta(y).  Its per-token factor is the
  posterior-weighted mixture  log mu_t = log(beta P_b(y_<=t) + (1-beta) P_theta(y_<=t))
  - log(beta P_b(y_<t) + (1-beta) P_theta(y_<t)), so the sum over tokens is exactly the sequence
  mixture and token-level importance corrections stay exact.

In multi-turn episodes every agent turn is a separate decode, so "sequence" means one coin per agent
turn there (the reported log-probs follow that behaviour exactly).

Both distributions are processed identically (temperature, top-k, top-p) before mixing. The coins
are uniforms of each row's own coin stream (the generator derives it from the seed and the row's key,
apart from the row's token stream), so the token draws use exactly the random numbers they would use
without the arbiter: with the same seed, beta = 1 reproduces the baseline's completions and beta = 0
the learner's, and a row's coins do not depend on the other rows of its batch. The behaviour log-prob
becomes the sample's ``rollout_logp``; the trainer's mismatch correction (TIS by default with
agency) turns it into the importance weight pi_theta / mu.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from polyrl.rollout.agency.config import AgencyMode
from polyrl.rollout.generator import draw_tokens


@dataclass
class MixState:
    """Per-row bookkeeping of one decode batch (full batch size; rows are indexed by original row)."""

    from_baseline: Tensor  # [N] bool, sequence mode: who writes the row
    prefix_b: Tensor  # [N] log P_b(y_<t)
    prefix_l: Tensor  # [N] log P_theta(y_<t)
    baseline_tokens: Tensor  # [N] long: tokens chosen by the baseline


class AgencyArbiter:
    """Mixes a frozen baseline policy with the learner; ``beta`` is set by the trainer every step."""

    def __init__(self, baseline: nn.Module, schedule: Callable[[int], float], *, mode: AgencyMode = "token"):
        if mode not in ("token", "sequence"):
            raise ValueError(f"agency_mode = {mode!r} is not allowed; use 'token' or 'sequence'")
        self.baseline = baseline.eval().requires_grad_(False)
        self.schedule = schedule
        self.mode = mode
        self.beta = float(schedule(0))

    def set_step(self, step: int) -> float:
        self.beta = float(self.schedule(step))
        return self.beta

    @property
    def active(self) -> bool:
        return self.beta > 0.0

    def start(self, coins: Tensor) -> MixState:
        """State of a decode batch; ``coins`` [N] holds each row's sequence-mode coin (a uniform in [0, 1))."""
        count, device = coins.shape[0], coins.device
        zeros = torch.zeros(count, dtype=torch.float64, device=device)
        return MixState(coins < self.beta, zeros, zeros.clone(), torch.zeros(count, dtype=torch.long, device=device))

    def pick(self, logp_l: Tensor, logp_b: Tensor, greedy: bool, u: Tensor, coins: Tensor, state: MixState,
             rows: Tensor) -> tuple[Tensor, Tensor]:
        """Choose one token per live row from the processed log-distributions [n, V] of learner and baseline.

        ``u`` [n] are the live rows' token uniforms of this step, ``coins`` [n] their token-mode coins (unused in
        sequence mode). Returns (token [n], behaviour log-prob [n]); ``state`` is updated for ``rows`` (original
        row ids).
        """
        use_b = coins < self.beta if self.mode == "token" else state.from_baseline[rows]
        source = torch.where(use_b[:, None], logp_b, logp_l)
        token = source.argmax(dim=-1) if greedy else draw_tokens(source, u)
        lb = logp_b.gather(-1, token[:, None]).squeeze(1).double()
        ll = logp_l.gather(-1, token[:, None]).squeeze(1).double()
        state.baseline_tokens[rows] += use_b.long()
        beta = torch.tensor(self.beta, dtype=torch.float64, device=lb.device)
        if self.mode == "token":
            behaviour = _mix(beta, lb, ll)
        else:
            before = _mix(beta, state.prefix_b[rows], state.prefix_l[rows])
            state.prefix_b[rows] += lb
            state.prefix_l[rows] += ll
            behaviour = _mix(beta, state.prefix_b[rows], state.prefix_l[rows]) - before
        return token, behaviour.float()


def _mix(beta: Tensor, log_b: Tensor, log_l: Tensor) -> Tensor:
    """log(beta e^log_b + (1 - beta) e^log_l), stable at beta in {0, 1}."""
    terms = torch.stack([torch.log(beta) + log_b, torch.log1p(-beta) + log_l])
    return torch.logsumexp(terms, dim=0)


class AgencySource:
    """A rollout source whose samples come from the baseline/learner mixture: sets ``beta`` for each step.

    Wraps the source that samples (uniform groups or the tree) with the generator that holds the arbiter,
    and reports ``agency/beta`` and ``agency/baseline_share`` (the share of trained tokens the baseline chose).
    """

    def __init__(self, inner, arbiter: AgencyArbiter) -> None:
        self.inner, self.arbiter = inner, arbiter

    def collect(self, method, stream, step: int):
        self.arbiter.set_step(step)
        batch = self.inner.collect(method, stream, step)
        tokens = sum(float(sum(s.loss_mask)) if s.loss_mask is not None else float(len(s.completion_token_ids))
                     for s, kept in zip(batch.samples, batch.keep.tolist()) if kept)
        batch.stats["agency/beta"] = self.arbiter.beta
        chosen = sum(s.baseline_tokens for s, kept in zip(batch.samples, batch.keep.tolist()) if kept)  # as tokens
        batch.stats["agency/baseline_share"] = chosen / max(1.0, tokens)
        return batch

    def after_update(self, weights, version: int) -> None:
        self.inner.after_update(weights, version)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def close(self) -> None:
        self.inner.close()
