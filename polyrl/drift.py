"""The drift meter of `polyrl train --drift-prompts N`: how far the policy has moved from its starting point.

At build time, before any update (and before a resume loads a checkpoint), the meter fixes a probe set: ``N``
held-out prompts of the task (drawn with their own seed), one completion of each sampled from the *starting*
policy with the run's sampling settings, the starting policy's log-probs of those tokens, and its final hidden
state at each prompt's last token. At every evaluation it scores the same sequences with the current policy and
logs, beside the evaluator's metrics:

- ``drift/kl_k1``: mean over the probe tokens of ``log pi_0(y) - log pi_theta(y)``, y ~ pi_0: an unbiased estimate
  of the per-token KL(pi_0 || pi_theta) (Schulman's k1);
- ``drift/kl_k3``: mean of ``r - 1 - log r`` with ``r = pi_theta(y) / pi_0(y)``: the same KL with lower variance,
  never negative (k3);
- ``drift/hidden_cos``: mean cosine between the starting and current final hidden states of the probe prompts
  (1 = the representation has not turned);
- ``drift/hidden_shift``: mean ``||h_theta - h_0|| / ||h_0||`` of those states.

Convention: the sequences are sampled once from pi_0 and kept, so the estimates measure KL(pi_0 || pi_theta)
(forward, mass-covering) on a fixed sample; no copy of the starting model is kept (N x T log-probs and N hidden
states are), so the meter is cheap at any model size. It needs the policy in this process: several training
processes (``--nproc``) and agency transfer (whose rollouts are a baseline/learner mixture) are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # the settings are read without torch (polyrl.config); the meter imports it when built
    from torch import Tensor

DRIFT_SEED = 7_919  # the probe prompts' own draw, apart from the evaluation's and the training stream's


@dataclass
class DriftConfig:
    """The drift meter (`--drift-prompts`, TOML table ``[drift]``, ``TrainConfig.drift``)."""

    PREFIX: ClassVar[str] = "drift"

    prompts: int = 0
    """held-out probe prompts whose drift from the starting policy is logged at every evaluation (drift/*; 0 = off)"""


class DriftMeter:
    """An evaluator that adds ``drift/*`` to the metrics of the evaluator it wraps (see the module docstring)."""

    def __init__(self, evaluate, learner, runner, prompts, params, pad_id: int) -> None:
        from polyrl.batch import TokenBatch

        self.evaluate, self.learner = evaluate, learner
        samples = sorted(runner.sample(prompts, params), key=lambda s: s.prompt_index)
        self.batch = TokenBatch.from_samples(samples, pad_id)
        self.logp0, self.hidden0 = self._measure()

    def _measure(self) -> tuple[Tensor, Tensor]:
        """Log-probs [B, T] of the probe tokens and final hidden states [B, H] at each prompt's last token."""
        import torch

        batch, model = self.batch, self.learner.model
        logp = self.learner.logprobs_nograd(batch).logp
        was_training = model.training
        model.eval()
        device, rows = next(model.parameters()).device, self.learner.micro_batch_size
        prompt_end = batch.input_ids.shape[1] - batch.completion_mask.shape[1] - 1  # prompts are left padded
        hidden = []
        with torch.no_grad():
            for i in range(0, batch.input_ids.shape[0], rows):  # micro-batched, as the log-probs are
                on = batch.rows(slice(i, i + rows)).to(device)
                pos = (on.attention_mask.cumsum(-1) - 1).clamp_min(0)
                out = model.base_model(input_ids=on.input_ids, attention_mask=on.attention_mask, position_ids=pos)
                hidden.append(out.last_hidden_state[:, prompt_end].float().cpu())
        model.train(was_training)
        return logp, torch.cat(hidden)

    def drift(self) -> dict[str, float]:
        """The ``drift/*`` metrics of the current policy."""
        import torch

        logp, hidden = self._measure()
        mask = self.batch.completion_mask.to(logp.dtype)
        tokens = mask.sum().clamp_min(1.0)
        log_ratio = (logp - self.logp0) * mask  # log pi_theta / pi_0 on the probe tokens
        k3 = (torch.exp(log_ratio) - 1 - log_ratio) * mask
        cos = torch.nn.functional.cosine_similarity(hidden, self.hidden0, dim=-1)
        shift = (hidden - self.hidden0).norm(dim=-1) / self.hidden0.norm(dim=-1).clamp_min(1e-12)
        return {"drift/kl_k1": float(-log_ratio.sum() / tokens), "drift/kl_k3": float(k3.sum() / tokens),
                "drift/hidden_cos": float(cos.mean()), "drift/hidden_shift": float(shift.mean())}

    def __call__(self, step: int, solved_before: list[bool] | None = None) -> tuple[dict[str, float], list[bool]]:
        metrics, solved = self.evaluate(step, solved_before)
        return {**metrics, **self.drift()}, solved

    def summary(self, metrics: dict[str, Any]) -> dict[str, float]:
        """The wrapped evaluator's summary entries, and the final drift (``drift_kl_k3_after`` ...)."""
        out = self.evaluate.summary(metrics)
        out.update({k.replace("drift/", "drift_") + "_after": v for k, v in metrics.items() if k.startswith("drift/")})
        return out
