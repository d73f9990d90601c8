"""One advantage entry point for every rollout layout: flat groups and trees, with every input the estimator takes.

``advantages`` always passes what the method's estimator can use: KL-in-reward token rewards, critic
values and separate reward channels (for estimators tagged ``channels``, GDPO). A source that builds
trees gets the same estimator on its root and sibling groups (``tree_advantages``). Critic presets
also get their value targets (returns) here, so the loop has one call whatever the method is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from polyrl.objectives.objective import Method
from polyrl.objectives.token_advantages import gae_advantages_and_returns
from polyrl.registry import ADVANTAGES
from polyrl.types import TreeInfo


def advantages(method: Method, rewards: Tensor, group_ids: Tensor, mask: Tensor, *, values: Tensor | None = None,
               token_rewards: Tensor | None = None, channels: Tensor | None = None,
               tree: TreeInfo | None = None, greedy_rewards: Tensor | None = None, sum_pi_sq: Tensor | None = None,
               sampled_logp: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Token advantages [B, T] of the method's estimator, and value targets [B, T] when there are ``values``.

    ``rewards`` [B] (shaped), ``group_ids`` [B], ``mask`` [B, T] loss tokens, ``values`` [B, T] critic values,
    ``token_rewards`` [B, T] (a KL penalty, already negative), ``channels`` [B, C], ``tree`` the sample layout,
    ``greedy_rewards`` [B] the reward of each prompt's greedy completion (for estimators tagged ``needs_greedy``),
    ``sum_pi_sq`` [B, T] and ``sampled_logp`` [B, T] the sampler's sum_v pi_v^2 and log pi of each sampled token
    (for estimators tagged ``needs_sum_pi_sq``, the optimal token baseline).
    Tree groups compare sequence rewards, so a KL penalty in the reward is summed over the tokens each sample
    trains on first (a continuation's copy of its prefix has loss mask 0: the root rollout carries it).
    """
    spec = method.advantage
    fn = ADVANTAGES.fn(spec.name)
    mask64 = mask.double()
    extra: tuple[Tensor, ...] = ()
    if "needs_greedy" in ADVANTAGES.spec(spec.name).tags:  # ReMax: the greedy decode's reward is its baseline
        if greedy_rewards is None or tree is not None:
            raise ValueError(f"advantage {spec.name!r} needs the reward of each prompt's greedy completion "
                             "(RolloutBatch.greedy_rewards), which only the uniform sampler decodes")
        extra = (greedy_rewards.double(),)
    if "needs_sum_pi_sq" in ADVANTAGES.spec(spec.name).tags:  # OTB: W_t from the sampler's token probabilities
        if sum_pi_sq is None or sampled_logp is None or tree is not None:
            raise ValueError(f"advantage {spec.name!r} needs the sampler's per-token sum_v pi_v^2 and log-probs "
                             "(SamplingParams.sum_pi_sq), which only the uniform hf sampler records")
        extra = (sum_pi_sq.double(), sampled_logp.double())
    if tree is not None:
        seq = sib = rewards.double()
        if token_rewards is not None:  # a sibling group compares what follows its branch point: the shared prefix's
            after = torch.arange(mask.shape[1])[None, :] >= tree.branch_at[:, None]  # KL is left out of every member
            seq = seq + (token_rewards * mask64).sum(-1)
            sib = sib + (token_rewards * mask64 * after).sum(-1)
        adv = tree_advantages(lambda r, g, m: fn(r, g, m, None, None, **spec.params), seq, tree, mask64,
                              sibling_rewards=sib).float()
    else:
        # Estimators tagged "channels" (GDPO) normalise each reward channel separately when the task has several.
        per_channel = "channels" in ADVANTAGES.spec(spec.name).tags and channels is not None
        source = channels if per_channel else rewards
        adv = fn(source.double(), group_ids, mask64, None if values is None else values.double(), token_rewards,
                 *extra, **spec.params).float()
        adv = adv[:, None].expand_as(mask).contiguous() if adv.dim() == 1 else adv
    returns = None
    if values is not None:
        gamma, lam = spec.params.get("gamma", 1.0), spec.params.get("lam", 1.0)
        _, returns = gae_advantages_and_returns(rewards.double(), values.double(), mask64, token_rewards,
                                                gamma=gamma, lam=lam)
        returns = returns.float()
    return adv, returns


def tree_advantages(adv_fn: Callable[[Tensor, Tensor, Tensor], Tensor], rewards: Tensor, tree: TreeInfo,
                    mask: Tensor, sibling_rewards: Tensor | None = None) -> Tensor:
    """Token advantages [B, T]: root-group advantage before the branch point, sibling-group advantage after.

    ``adv_fn(rewards, group_ids, mask)`` is the method's group estimator ([B] or [B, T] out). Root groups
    hold the root rollouts only (unbiased samples of the prompt); continuations have no root advantage
    (their prefix tokens carry no loss). ``sibling_rewards`` (default ``rewards``): what sibling groups compare --
    with a KL penalty in the reward, each member's penalty after the branch point only (a continuation's copied
    prefix has no loss tokens; a root rollout's prefix KL would count against it alone).
    """
    B, T = mask.shape
    root = tree.is_root
    a_root = torch.zeros(B, T, dtype=mask.dtype)
    if root.any():
        a_root[root] = _per_token(adv_fn(rewards[root], tree.root_ids[root], mask[root]), T)
    sib = tree.sibling_ids >= 0
    a_sib = torch.zeros(B, T, dtype=mask.dtype)
    if sib.any():
        sib_rewards = rewards if sibling_rewards is None else sibling_rewards
        a_sib[sib] = _per_token(adv_fn(sib_rewards[sib], tree.sibling_ids[sib], mask[sib]), T)
    after = (torch.arange(T)[None, :] >= tree.branch_at[:, None]) & sib[:, None]
    return torch.where(after, a_sib, a_root)


def _per_token(adv: Tensor, T: int) -> Tensor:
    return adv[:, None].expand(-1, T) if adv.dim() == 1 else adv
