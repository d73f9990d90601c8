"""What ``LocalLearner`` and ``FSDPLearner`` share, as plain functions (neither inherits from the other).

The optimizer and its warm-up schedule, the sampling settings, clipping and stepping (over plain or DTensor
gradients), changing the base learning rate, the reference's scoring and syncing, and which models a checkpoint
holds besides the policy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from polyrl.batch import TokenBatch, sample_ref_logp


def make_optimizer(params: Iterable[nn.Parameter], *, lr: float, weight_decay: float, warmup_steps: int,
                   fused: bool = False) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with a linear warm-up over ``warmup_steps`` optimizer steps (none: constant).

    ``fused``: torch's fused AdamW kernel (CPU and CUDA, float32/bfloat16 parameters), the same update as the loop
    over parameters up to float rounding; False keeps torch's default implementation.
    """
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **({"fused": True} if fused else {}))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / (warmup_steps + 1)) if warmup_steps else 1.0
    )
    return optimizer, scheduler


def sampling_settings(temperature: float, top_p: float, top_k: int, share_prompts: bool = False) -> dict[str, Any]:
    """Keyword arguments of ``completion_logprobs``: the sampling distribution (1.0 and 0 disable filters), and
    whether rows that share a prompt run it once (``polyrl.shared_prompt``)."""
    return dict(temperature=temperature, top_p=top_p if top_p < 1 else None, top_k=top_k or None,
                share_prompts=share_prompts)


def clip_and_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, max_grad_norm: float) -> float:
    """Clip, step and zero; a non-finite gradient norm skips the update (weights untouched) and returns it.

    The same arithmetic as ``clip_grad_norm_`` (which is ``get_total_norm`` then ``clip_grads_with_norm_``); with
    sharded (DTensor) gradients the total norm is a partial reduction, made global (the same number on every rank)
    by ``full_tensor()`` before clipping.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    max_norm = max_grad_norm if max_grad_norm > 0 else float("inf")
    total = torch.nn.utils.get_total_norm([p.grad for p in params])
    if hasattr(total, "full_tensor"):  # a DTensor: gradients sharded by FSDP2
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    norm = float(total)
    if math.isfinite(norm):
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def set_base_lr(optimizer: torch.optim.Optimizer, scheduler: Any, lr: float) -> None:
    """Change the schedule's base learning rate for the rest of the run (saved with the scheduler state)."""
    ratio = scheduler.get_last_lr()[0] / scheduler.base_lrs[0]  # where the warm-up stands
    scheduler.base_lrs = [lr for _ in scheduler.base_lrs]
    for group in optimizer.param_groups:
        group["lr"] = lr * ratio
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() (guard/lr) reads


def reference_logp(reference: nn.Module | None, ref_sync_every: int, batch: TokenBatch, samples: list,
                   score: Callable[[], Tensor]) -> Tensor | None:
    """Reference log-probs [B, T] at the rollout weights: carried by the samples when the generation process scored
    a frozen reference, else ``score()``; None without a reference."""
    if reference is None:
        return None
    scored = None if ref_sync_every else sample_ref_logp(samples, batch.completion_mask.shape[1])
    return score() if scored is None else scored


def sync_reference(reference: nn.Module | None, ref_sync_every: int, model: nn.Module, step: int) -> None:
    """Copy the policy into a reference that follows it (Humanline) when due. Sharded alike, the copy is local."""
    if reference is not None and ref_sync_every and step % ref_sync_every == 0:
        reference.load_state_dict(model.state_dict())


def extra_models(reference: nn.Module | None, ref_sync_every: int, critic: nn.Module | None) -> dict[str, nn.Module]:
    """The models a checkpoint holds besides the policy: the critic, and a reference that follows the policy (then
    it is state; a frozen reference is the starting model)."""
    extra: dict[str, nn.Module] = {"critic": critic} if critic is not None else {}
    if reference is not None and ref_sync_every:
        extra["reference"] = reference
    return extra
