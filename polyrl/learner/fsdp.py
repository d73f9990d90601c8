"""``FSDPLearner``: the ``Learner`` protocol over N processes, each module sharded with PyTorch's FSDP2 ``fully_shard``.

Conventions (the training loop is unchanged; ``polyrl.update`` asks ``shard`` and ``all_sum``):

- Every rank holds the WHOLE scored batch (the trainer broadcasts the rollout batch from rank 0). Normalizers are
  computed from the full minibatch before the micro-batch loop, so they are global by construction.
- Work division lives here. ``shard(n)`` deals the n micro-batches of a minibatch round-robin and pads with None so
  that every rank runs the same number of forward/backward passes: FSDP2 all-gathers parameters in each forward and
  reduce-scatters gradients in each backward, collectives every rank must join in the same order (lockstep). A None
  is a pass over the minibatch's first micro-batch whose loss is multiplied by 0. ``update_policy`` agrees on a
  non-finite loss with an ``all_sum`` per micro-batch, so every rank breaks off at the same pass.
- Gradients are SUMMED over ranks, not averaged: each micro-batch's loss is already its share of the step loss
  (a sum over its tokens divided by global denominators), so the step's gradient is the sum over micro-batches,
  whichever rank ran them. FSDP2 would divide by the world size in its reduce-scatter; every sharded module gets
  ``set_gradient_divide_factor(1.0)`` and ``set_force_sum_reduction_for_comms(True)`` (a plain SUM, which gloo
  also supports), so loss and gradients equal those of one process on the same batch, at any world size.
- No-grad scoring (policy, reference, critic values) splits the rows into equal contiguous shards (the last padded
  by repeating the last row) and all-gathers them: every rank returns the identical full [B, T] tensor. Outputs are
  on the CPU like the batch, the forward on this rank's device (its GPU under NCCL).
- ``completion_logprobs`` calls the base model and applies the LM head itself, so the root module's own forward
  never runs; it is registered as an FSDP forward method (``polyrl_score``) so that the root's parameters (embeddings,
  final norm, LM head) are gathered around it and their gradients reduced after backward. Transformer blocks (the
  model's ``_no_split_modules``) are sharded one by one.
- ``step()`` clips with the global gradient norm (the DTensor norm's ``full_tensor()``), the same on every rank.
  ``weights()`` and ``save``/``load`` are collectives every rank calls; ``weights()`` gives the full state dict on
  rank 0 (empty elsewhere); checkpoints go through ``torch.distributed.checkpoint`` (``polyrl.learner.sharded``).
"""

from __future__ import annotations

import types
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from polyrl.batch import TokenBatch
from polyrl.learner import dist as pdist
from polyrl.learner.common import (
    clip_and_step,
    extra_models,
    make_optimizer,
    reference_logp,
    sampling_settings,
    set_base_lr,
    sync_reference,
)
from polyrl.learner.sharded import is_sharded, load_sharded, load_unsharded, save_sharded
from polyrl.model import TokenLogprobs, completion_logprobs
from polyrl.objectives.value import clipped_value_loss
from polyrl.rollout.generator import Sample
from polyrl.shared_prompt import distinct_prompts
from polyrl.types import Normalizer

SCORE = "polyrl_score"  # the FSDP forward method that runs completion_logprobs on a sharded causal LM


def _score(self: nn.Module, input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor, **kw) -> tuple:
    # a tuple: FSDP hooks the backward of its tensors
    return completion_logprobs(self, input_ids, attention_mask, completion_mask, **kw).tensors()


def shard_module(module: nn.Module, mesh: DeviceMesh, *, scorer: bool) -> nn.Module:
    """``fully_shard`` each transformer block of ``module``, then ``module`` itself, summing gradients over ranks;
    ``scorer``: register ``polyrl_score`` (completion log-probs) as a forward method of the root."""
    blocks = set()
    for sub in module.modules():
        blocks.update(getattr(sub, "_no_split_modules", None) or ())
    for sub in list(module.modules()):
        if sub is not module and type(sub).__name__ in blocks:
            fully_shard(sub, mesh=mesh)
    _shard_other_dtypes(module, mesh)
    fully_shard(module, mesh=mesh)
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.set_gradient_divide_factor(1.0)  # sum, not mean: see the module docstring
            sub.set_force_sum_reduction_for_comms(True)
    if scorer:
        setattr(module, SCORE, types.MethodType(_score, module))
        register_fsdp_forward_method(module, SCORE)
    return module


def _shard_other_dtypes(module: nn.Module, mesh: DeviceMesh) -> None:
    """Give each submodule whose own parameters have another dtype than most of the root's unit (by size) a unit of
    its own: FSDP2 flattens a unit's parameters together and refuses mixed dtypes (a float32 value head on a
    bfloat16 backbone)."""
    loose = [p for p in module.parameters() if not isinstance(p, DTensor)]  # not in a block's unit already
    sizes = Counter()
    for p in loose:
        sizes[p.dtype] += p.numel()
    if len(sizes) < 2:
        return
    common = sizes.most_common(1)[0][0]
    for sub in list(module.modules()):
        own = list(sub.parameters(recurse=False))
        if sub is not module and own and not any(isinstance(p, DTensor) for p in own) and \
                all(p.dtype != common for p in own):
            fully_shard(sub, mesh=mesh)


class FSDPLearner:
    """The policy (AdamW, linear warm-up), its reference and its critic, each sharded over the process group.

    Takes the same settings as ``LocalLearner`` and unsharded modules (the same weights on every rank, e.g. each
    rank loads the model directory); shards them in place over ``mesh`` (default: every rank, on this rank's
    device). Needs an initialised process group (``polyrl.learner.dist.init_from_env``).
    """

    def __init__(self, model: nn.Module, *, lr: float, weight_decay: float, warmup_steps: int, max_grad_norm: float,
                 temperature: float, top_p: float, top_k: int, fp32_head: bool, micro_batch_size: int,
                 reference: nn.Module | None = None, ref_sync_every: int = 0, critic: nn.Module | None = None,
                 critic_lr: float = 1e-4, value_clip: float = 0.5, value_loss_agg: str = "token_mean",
                 mesh: DeviceMesh | None = None, share_prompts: bool = False, fused_adam: bool = False):
        if not dist.is_initialized():
            raise RuntimeError("FSDPLearner needs a process group: call polyrl.learner.dist.init_from_env() first")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = pdist.device()
        self.mesh = mesh if mesh is not None else init_device_mesh(self.device.type, (self.world,))
        self.model = shard_module(model, self.mesh, scorer=True)
        self.reference = shard_module(reference, self.mesh, scorer=True) if reference is not None else None
        self.ref_sync_every = ref_sync_every
        self.critic = shard_module(critic, self.mesh, scorer=False) if critic is not None else None
        self.value_clip, self.value_loss_agg = value_clip, value_loss_agg
        self.critic_opt = torch.optim.AdamW(self.critic.parameters(), lr=critic_lr) if critic is not None else None
        self.optimizer, self.scheduler = make_optimizer(self.model.parameters(), lr=lr, weight_decay=weight_decay,
                                                        warmup_steps=warmup_steps, fused=fused_adam)
        self.max_grad_norm = max_grad_norm
        self.sampling = sampling_settings(temperature, top_p, top_k, share_prompts)
        self.fp32_head = fp32_head
        self.micro_batch_size = micro_batch_size

    # work division ------------------------------------------------------------------------------------------
    def shard(self, n: int) -> list[int | None]:
        """Micro-batches rank, rank + world, ... of n, padded with None to ceil(n / world) passes."""
        per = -(-n // self.world)
        return [i if (i := self.rank + k * self.world) < n else None for k in range(per)]

    def all_sum(self, values: Tensor) -> Tensor:
        return pdist.all_sum(values)

    # scoring --------------------------------------------------------------------------------------------------
    def _forward(self, model: nn.Module, batch: TokenBatch, topk: int, topk_ids: Tensor | None = None) -> TokenLogprobs:
        """(logp, entropy, topk_ids, topk_logp) of ``batch`` on the CPU, computed on this rank's device."""
        b = batch.to(self.device)
        ids = None if topk_ids is None else topk_ids.to(self.device)
        sampling = {**self.sampling, "share_prompts": self._all_share(b)}
        parts = getattr(model, SCORE)(b.input_ids, b.attention_mask, b.completion_mask, fp32_head=self.fp32_head,
                                      topk=0 if ids is not None else topk, topk_ids=ids, **sampling)
        return TokenLogprobs(*parts).cpu()  # differentiable: backward flows to this rank's device

    def _all_share(self, b: TokenBatch) -> bool:
        """Whether this pass runs shared prompts on every rank. A shared-prompt forward calls the base model twice
        (prompts, then completions on their cache), the plain one once, and each call all-gathers every block: ranks
        that decided apart, from micro-batches of their own, issued different collectives and hung. One all-reduce
        per pass settles it (every rank runs as many passes); if any rank's rows share nothing, none shares."""
        if not self.sampling["share_prompts"]:
            return False
        width = b.completion_mask.shape[1]
        mine = width > 1 and distinct_prompts(b.input_ids, b.attention_mask, width) is not None
        return int(pdist.all_sum(torch.tensor([0.0 if mine else 1.0]))) == 0

    def _critic(self, batch: TokenBatch) -> Tensor:
        """Critic values of ``batch`` on the CPU. ValueHead returns a view (``squeeze``), which FSDP2 warns about in
        case it is modified in place; it never is."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*returned a view tensor", category=UserWarning)
            return self.critic(batch.to(self.device)).cpu()

    def logprobs(self, batch: TokenBatch, *, grad: bool, topk: int = 0, topk_ids: Tensor | None = None
                 ) -> TokenLogprobs:
        """Log-probs, entropy (and top-K, or the log-probs at ``topk_ids``) of this rank's rows (``update_policy`` gives
        each rank its micro-batches); in train mode with or without ``grad``, as ``LocalLearner.logprobs``."""
        self.model.train()
        with torch.set_grad_enabled(grad):
            out = self._forward(self.model, batch, topk, topk_ids)
        if not grad:  # FSDP2 leaves the root's parameters gathered for the backward it expects; with none to come,
            self.model.reshard()  # ``step()`` would clip the unsharded ones, which hold no gradient
        return out

    def _rows(self, batch: TokenBatch, fn) -> list[Tensor | None]:
        """``fn`` (a tuple of [rows, ...] tensors or None) over this rank's row shard, micro-batched, all-gathered."""
        n = batch.input_ids.shape[0]
        local = batch.rows(pdist.row_shard(n)[0])
        with torch.no_grad():
            outs = [fn(local.rows(slice(i, i + self.micro_batch_size)))
                    for i in range(0, local.input_ids.shape[0], self.micro_batch_size)]
        return [None if col[0] is None else pdist.gather_rows(torch.cat(col), n) for col in zip(*outs)]

    def logprobs_nograd(self, batch: TokenBatch, *, topk: int = 0, model: nn.Module | None = None) -> TokenLogprobs:
        """The same without gradient for the whole batch (rows split among ranks), for the policy or the reference."""
        model = model or self.model
        was_training = model.training
        model.eval()
        out = TokenLogprobs(*self._rows(batch, lambda b: self._forward(model, b, topk).tensors()))
        model.train(was_training)
        return out

    def ref_logprobs(self, batch: TokenBatch, samples: list[Sample]) -> Tensor | None:
        return reference_logp(self.reference, self.ref_sync_every, batch, samples,
                              lambda: self.logprobs_nograd(batch, model=self.reference).logp)

    def values(self, batch: TokenBatch) -> Tensor | None:
        """Critic values [B, T] on the loss tokens (0 elsewhere), without gradient; None without a critic."""
        if self.critic is None:
            return None
        (v,) = self._rows(batch, lambda b: (self._critic(b),))
        return v * batch.loss_mask

    # optimisation ---------------------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        sync_reference(self.reference, self.ref_sync_every, self.model, step)

    def backward(self, loss: Tensor) -> None:
        loss.backward()  # FSDP2 reduce-scatters with SUM (divide factor 1)

    def step(self) -> float:
        """Clip with the global gradient norm, step and zero; a non-finite norm (the same on every rank) skips."""
        return clip_and_step(self.model, self.optimizer, self.scheduler, self.max_grad_norm)

    def skip_step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def critic_step(self, batch: TokenBatch, old_values: Tensor, returns: Tensor) -> dict[str, float]:
        """One critic step on the clipped value loss of ``batch``, its rows split among ranks; each rank divides by the
        whole minibatch's denominators, so the summed gradient is the one-process gradient."""
        if self.critic is None or self.critic_opt is None:
            return {}
        index, real = pdist.row_shard(batch.input_ids.shape[0])
        mask = batch.loss_mask[index] * real[:, None].to(batch.loss_mask.dtype)
        values = self._critic(batch.rows(index))
        norm = Normalizer.from_batch(batch.loss_mask, torch.zeros(batch.loss_mask.shape[0], dtype=torch.long))
        v_loss = clipped_value_loss(values, old_values[index], returns[index], mask, self.value_clip,
                                    self.value_loss_agg, norm)
        self.critic_opt.zero_grad(set_to_none=True)
        v_loss.backward()
        self.critic_opt.step()
        return {"critic/value_loss": float(self.all_sum(v_loss.detach()))}

    def set_base_lr(self, lr: float) -> None:
        set_base_lr(self.optimizer, self.scheduler, lr)

    @property
    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    # weights and checkpoints (collectives) -------------------------------------------------------------------
    def weights(self) -> dict[str, Tensor]:
        """The policy's full state dict on rank 0, on the CPU (other ranks: empty); every rank must call it."""
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def _parts(self) -> tuple[dict[str, nn.Module], dict[str, Any]]:
        models = {"model": self.model, **extra_models(self.reference, self.ref_sync_every, self.critic)}
        return models, {"model": self.optimizer, "critic": self.critic_opt}

    def save(self, run_dir: str | Path, step: int, state: dict[str, Any]) -> Path:
        """A sharded atomic checkpoint (``polyrl.learner.sharded``) with the trainer's ``state`` (rank 0's)."""
        models, optimizers = self._parts()
        return save_sharded(run_dir, step, models=models, optimizers=optimizers, scheduler=self.scheduler,
                            state=state)

    def load(self, path: str | Path) -> dict[str, Any]:
        """Restore a checkpoint saved at any world size (sharded, or a one-process one); return the trainer state."""
        models, optimizers = self._parts()
        loader = load_sharded if is_sharded(path) else load_unsharded
        return loader(path, models=models, optimizers=optimizers, scheduler=self.scheduler)
