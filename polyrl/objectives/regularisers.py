"""Regularisers' settings and the high-entropy-minority token mask ("Beyond the 80/20 Rule").

The entropy *bonus* itself is one line of the composition (``policy_loss``: loss -= coef * entropy per token,
aggregated like the policy loss) and the adaptive coefficients (KL beta, entropy alpha) live in ``controller.py``;
this module holds their build-time checks and the token mask, a pure function of the per-token entropies.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from polyrl.registry import PartError


def high_entropy_mask(entropy: Tensor, mask: Tensor, rho: float) -> Tensor:
    """Keep the top-rho fraction of loss tokens by entropy: detached {0, 1} weights [B, T].

    arXiv:2506.01939 (Wang et al., "Beyond the 80/20 Rule"): the policy gradient flows only through the
    k = ceil(rho * n) highest-entropy "forking" tokens of the n loss tokens (``mask`` > 0); the rest get weight 0.
    Ties at the threshold are broken by position (``torch.topk``), so exactly k tokens are kept.
    Convention: the quantile is over the *micro-batch's* loss tokens (the paper's verl code takes it per
    micro-batch); exact micro-batch invariance then needs one micro-batch per optimizer step. Dropped tokens keep
    their place in the Normalizer (as every token mask here, slime's convention); the paper's code drops them from
    the token-mean denominator too, so its gradient is 1/rho times ours [assumed from verl's masking convention].
    """
    flat_mask = mask.reshape(-1) > 0
    n = int(flat_mask.sum())
    keep = torch.zeros(mask.numel(), dtype=mask.dtype, device=mask.device)
    if n == 0:
        return keep.reshape(mask.shape)
    k = max(1, math.ceil(rho * n - 1e-9))  # the 1e-9 keeps 0.2 * 15 = 3.0000000000000004 at 3
    scores = torch.where(flat_mask, entropy.detach().reshape(-1).to(torch.float64),
                         torch.full((mask.numel(),), float("-inf"), dtype=torch.float64, device=mask.device))
    keep[scores.topk(k).indices] = 1.0
    return keep.reshape(mask.shape)


def check_regularisers(name: str, has_kl: bool, kl_target: float, kl_horizon: int, entropy_coef: float,
                        entropy_target: float, entropy_delta: float, entropy_coef_max: float,
                        entropy_top: float) -> None:
    """Refuse, in one line naming it, a setting of the adaptive controllers or the token mask that cannot act."""
    for key, value in (("kl_target", kl_target), ("entropy_coef", entropy_coef), ("entropy_target", entropy_target),
                       ("entropy_coef_max", entropy_coef_max)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < float("inf"):
            raise PartError(f"method {name!r}: {key} = {value!r} must be a finite number >= 0")

    def bad(key: str, value: object, allowed: str) -> PartError:
        return PartError(f"method {name!r}: {key} = {value!r} {allowed}")

    if kl_target > 0 and not has_kl:
        raise bad("kl_target", kl_target, "needs a KL term (kl=... with kl_coef > 0) whose beta it adapts")
    if not isinstance(kl_horizon, int) or isinstance(kl_horizon, bool) or kl_horizon < 1:
        raise bad("kl_horizon", kl_horizon, "must be an integer >= 1")
    if kl_horizon != 10_000 and kl_target == 0:
        raise bad("kl_horizon", kl_horizon, "only applies with kl_target > 0 (the adaptive KL controller)")
    if entropy_target > 0 and entropy_coef_max <= 0:
        raise bad("entropy_target", entropy_target, "needs entropy_coef_max > 0 (the adaptive coefficient's ceiling)")
    for key, value in (("entropy_delta", entropy_delta), ("entropy_coef_max", entropy_coef_max)):
        if value != {"entropy_delta": 0.005, "entropy_coef_max": 0.0}[key] and entropy_target == 0:
            raise bad(key, value, "only applies with entropy_target > 0 (the adaptive entropy coefficient)")
    if not isinstance(entropy_delta, (int, float)) or not 0 < entropy_delta < float("inf"):
        raise bad("entropy_delta", entropy_delta, "must be a finite number > 0")
    if entropy_target > 0 and entropy_coef > entropy_coef_max:
        raise bad("entropy_coef", entropy_coef, f"must be <= entropy_coef_max = {entropy_coef_max} (its start value)")
    if not isinstance(entropy_top, (int, float)) or not 0 <= entropy_top < 1:
        raise bad("entropy_top", entropy_top, "must be in [0, 1) (the fraction of tokens kept; 0 = all tokens)")
