"""KL estimators of KL(pi_theta || pi_ref) per sampled token (Schulman, "Approximating KL Divergence").

Signature: ``fn(logp, ref_logp, old_logp, *, clamp) -> kl [B, T]``, with d = clamp(ref_logp - logp,
-clamp, clamp) (verl clamps d to [-20, 20]); k3 and k3_plus also clamp their value to +-value_clamp (10, verl's
low_var_kl bound) with zero gradient beyond. Gradient flows through ``logp`` only. Used as a LOSS term
(added per token, to be minimised) or, evaluated at pi_old and detached, as a reward penalty.
Expected gradients on samples from pi_theta (shared/spec/objectives-llm.md section 22):
E[grad k1] = 0, E[grad k2] = grad KL(pi || ref), E[grad k3] = grad KL(ref || pi).
Padded positions are not masked here; the composition's aggregation ignores them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from polyrl.objectives.objective import Method, _call, masked_mean
from polyrl.registry import KL


def _d(logp: Tensor, ref_logp: Tensor, clamp: float) -> Tensor:
    return (ref_logp.detach() - logp).clamp(-clamp, clamp)


def _k2(d: Tensor) -> Tensor:
    return 0.5 * d**2


def _k3(d: Tensor) -> Tensor:
    return torch.expm1(d) - d


def _straight_through(value: Tensor, d: Tensor) -> Tensor:
    """Value of ``value``, gradient of k2: sg(value) + k2 - sg(k2)."""
    k2 = _k2(d)
    return value.detach() + k2 - k2.detach()


@KL.register("k1", paper="joschu.net/blog/kl-approx.html", ranges={"clamp": ">0"})
def k1(logp: Tensor, ref_logp: Tensor, old_logp: Tensor | None, *, clamp: float = 20.0) -> Tensor:
    """k1 = -d = logp - ref_logp: unbiased, can be negative; zero expected gradient as a loss."""
    return -_d(logp, ref_logp, clamp)


@KL.register("k2", paper="joschu.net/blog/kl-approx.html", ranges={"clamp": ">0"})
def k2(logp: Tensor, ref_logp: Tensor, old_logp: Tensor | None, *, clamp: float = 20.0) -> Tensor:
    """k2 = d^2 / 2: biased, >= 0; its expected gradient is grad KL(pi || ref)."""
    return _k2(_d(logp, ref_logp, clamp))


@KL.register("k3", paper="joschu.net/blog/kl-approx.html", ranges={"clamp": ">0", "value_clamp": ">0"})
def k3(logp: Tensor, ref_logp: Tensor, old_logp: Tensor | None, *, clamp: float = 20.0,
       value_clamp: float = 10.0) -> Tensor:
    """k3 = exp(d) - 1 - d ("low_var_kl", GRPO): unbiased value, >= 0; gradient of KL(ref || pi).

    The value is clamped to [-value_clamp, value_clamp] with zero gradient beyond, as verl's low_var_kl does
    (bound 10): a token far off the reference (d = 20 gives k3 = e^20) then stops pulling instead of dominating
    the update with a gradient of up to e^20. Convention: value_clamp = 10 (verl's); pass value_clamp=inf for the
    unclamped estimator (d itself is still clamped to [-clamp, clamp]).
    """
    return _k3(_d(logp, ref_logp, clamp)).clamp(-value_clamp, value_clamp)


@KL.register("k1_plus", paper="joschu.net/blog/kl-approx.html", ranges={"clamp": ">0"})
def k1_plus(logp: Tensor, ref_logp: Tensor, old_logp: Tensor | None, *, clamp: float = 20.0) -> Tensor:
    """Straight-through k1 (verl "k1+"): value of k1, gradient of k2 = sg(k1) + k2 - sg(k2)."""
    d = _d(logp, ref_logp, clamp)
    return _straight_through(-d, d)


@KL.register("k3_plus", paper="joschu.net/blog/kl-approx.html", ranges={"clamp": ">0", "value_clamp": ">0"})
def k3_plus(logp: Tensor, ref_logp: Tensor, old_logp: Tensor | None, *, clamp: float = 20.0,
            value_clamp: float = 10.0) -> Tensor:
    """Straight-through k3 (verl "k3+"): value of k3 (clamped to +-value_clamp, as verl's low_var_kl), gradient of
    k2 (unbiased reverse-KL gradient)."""
    d = _d(logp, ref_logp, clamp)
    return _straight_through(_k3(d).clamp(-value_clamp, value_clamp), d)


@KL.register("abs", paper="github.com/huggingface/trl (PPOConfig.kl_penalty)", ranges={"clamp": ">0"})
def abs_kl(logp: Tensor, ref_logp: Tensor, old_logp: Tensor | None, *, clamp: float = 20.0) -> Tensor:
    """Take |k1| = |logp - ref_logp| (verl and TRL's kl_penalty "abs"): >= 0, biased; gradient sign(logp - ref_logp).

    Not an unbiased KL estimate (E|k1| >= |E k1|): a symmetric penalty on the log-ratio of every sampled token.
    Convention: d = ref_logp - logp is clamped to [-clamp, clamp] like every estimator here (verl and TRL do not
    clamp "abs"); the gradient at logp = ref_logp is 0 (torch's subgradient of |x| at 0).
    """
    return _d(logp, ref_logp, clamp).abs()


@KL.register("k3_unbiased", paper="arXiv:2512.02556", ranges={"clamp": ">0"})
def k3_unbiased(logp: Tensor, ref_logp: Tensor, old_logp: Tensor | None, *, clamp: float = 20.0) -> Tensor:
    """Importance-corrected k3 (DeepSeek-V3.2): sg(pi_theta / pi_old) * k3, unbiased on samples from pi_old.

    E_{y ~ pi_old}[sg(pi/pi_old) k3] = KL(pi || ref); the log-ratio logp - old_logp is clamped like d.
    """
    if old_logp is None:
        raise ValueError(
            "kl 'k3_unbiased' needs old_logp [B, T] (log pi_old of the sampled tokens); got None"
        )
    w = (logp.detach() - old_logp.detach()).clamp(-clamp, clamp).exp()
    return w * _k3(_d(logp, ref_logp, clamp))


def kl_reward_penalty(method: Method, old_logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor:
    """Per-token reward penalty kl_coef * KL(old, ref), detached [B, T] (zeros unless placement is reward).

    PPO-RLHF, REINFORCE++ and RLOO put k1 of the sampling policy against the reference into the
    reward; the trainer subtracts this from the token rewards before computing advantages.
    """
    if method.kl is None or method.kl_coef == 0 or method.kl_placement != "reward":
        return torch.zeros_like(old_logp)
    with torch.no_grad():
        kl = _call(KL, method.kl, old_logp, ref_logp, old_logp)
    return method.kl_coef * kl * mask


def kl_in_reward(method: Method, old_logp: Tensor, ref_logp: Tensor | None,
                 mask: Tensor) -> tuple[Tensor | None, dict[str, float]]:
    """Token rewards [B, T] (float64, already negative) of a KL penalty placed in the reward, and its metrics.

    None and no metric unless the method puts its KL in the reward and there is a reference. The metric
    ``reward/kl_penalty`` is the penalty's mean per loss token (verl logs it as ``actor/reward_kl_penalty``),
    so a run shows whether a penalty shaped its rewards; ``reward/kl`` is the estimator itself (before beta)
    averaged per sequence, then over sequences: verl's ``current_kl``, which the adaptive controller reads.
    """
    if method.kl_placement != "reward" or ref_logp is None:
        return None, {}
    token_rewards = -kl_reward_penalty(method, old_logp, ref_logp, mask).double()
    metrics = {"reward/kl_penalty": float(masked_mean(-token_rewards, mask))}
    if method.kl is not None and method.kl_coef > 0:
        with torch.no_grad():
            kl = _call(KL, method.kl, old_logp, ref_logp, old_logp).double() * mask
        has = mask.sum(-1) > 0
        per_seq = kl.sum(-1)[has] / mask.sum(-1)[has]
        metrics["reward/kl"] = float(per_seq.mean()) if per_seq.numel() else 0.0
    return token_rewards, metrics
