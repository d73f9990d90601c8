"""The model backend behind the training loop: a small protocol and its single-process implementation.

The loop in ``trainer.py`` only talks to a ``Learner``: log-probs of token batches (with or without
gradient) for the policy and its reference, critic values and the critic's step, backward, optimizer
step, learning-rate changes, weights for generators elsewhere, and checkpoints. An FSDP2 or LoRA
learner implements the same methods without touching the loop (``fsdp.FSDPLearner``: every rank holds
the whole batch; ``shard`` and ``all_sum`` divide the micro-batches among ranks and add up what they
counted). Token batches are ``polyrl.batch``; code both learners share is in ``common``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from polyrl.batch import TokenBatch, logprobs_nograd
from polyrl.checkpoint import load_checkpoint, save_checkpoint
from polyrl.learner.common import (
    clip_and_step,
    extra_models,
    make_optimizer,
    reference_logp,
    sampling_settings,
    set_base_lr,
    sync_reference,
)
from polyrl.learner.lora import BaseReference, plain_state_dict, trainable_parameters
from polyrl.model import TokenLogprobs, completion_logprobs
from polyrl.objectives.value import clipped_value_loss
from polyrl.rollout.generator import Sample
from polyrl.tasks.base import Prompt
from polyrl.tasks.chat import prompt_ids


def prompt_embedder(model: nn.Module, tokenizer) -> Callable[[list[Prompt | str]], Tensor]:
    """``embed(prompts)`` -> [N, H]: each prompt's (a Prompt as the model sees it, or plain text) mean last hidden
    state under ``model`` (no grad), the features of the tree sampler's shared success predictor."""
    def embed(texts: list[Prompt | str]) -> Tensor:
        ids = prompt_ids(tokenizer, texts)
        width = max(len(i) for i in ids)  # right padding, masked out
        enc = {"input_ids": torch.tensor([i + [0] * (width - len(i)) for i in ids]),
               "attention_mask": torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])}
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        with torch.no_grad():
            out = model(input_ids=enc["input_ids"].to(device), attention_mask=enc["attention_mask"].to(device),
                        output_hidden_states=True)
        model.train(was_training)
        mask = enc["attention_mask"].to(device)[..., None].to(out.hidden_states[-1].dtype)
        return ((out.hidden_states[-1] * mask).sum(1) / mask.sum(1)).float().cpu()

    return embed


def answer_likelihood(learner: LocalLearner, generator, max_new_tokens: int) -> Callable[[list[Prompt]], Tensor]:
    """``likelihood(prompts)`` -> [N]: the probability that one completion sampled by ``generator`` (an HFGenerator:
    its tokenizer, EOS ids and pad id) is exactly the prompt's reference answer, under the learner's sampling
    distribution (temperature, top-p, top-k) and policy now.

    The answer is tokenized as it follows the prompt (the tail of the joint tokenization, so SentencePiece adds no
    word-start marker), and it ends at any of the generator's EOS ids, or at the ``max_new_tokens`` cap when it is
    exactly that long (a capped completion is scored too); an answer longer than the cap has probability 0. One
    teacher-forced forward pass per prompt and EOS id, no sampling. For a task whose reward is 1 exactly when the
    completion is the reference answer (``exact_answer`` tasks: addition) this is the success probability of a
    rollout -- a success predictor that needs no history and is never stale: exact with a character tokenizer, a
    lower bound where other token sequences also pass (another tokenization of the same text, whitespace the
    reward strips).
    """
    tokenizer, eos_ids = generator.tokenizer, list(generator.eos_ids)

    def likelihood(prompts: list[Prompt]) -> Tensor:
        out = torch.zeros(len(prompts), dtype=torch.float64)
        if not prompts:
            return out
        heads = prompt_ids(tokenizer, prompts)
        joint = prompt_ids(tokenizer, prompts, suffixes=[p.answer for p in prompts])
        samples, owner = [], []
        for i, (head, both, p) in enumerate(zip(heads, joint, prompts)):
            answer = both[len(head):] if both[: len(head)] == head else \
                tokenizer(p.answer, add_special_tokens=False)["input_ids"]
            if len(answer) > max_new_tokens:
                continue  # cannot be written before the cap: probability 0
            for end in [[]] if len(answer) == max_new_tokens else [[e] for e in eos_ids]:
                samples.append(Sample(prompt_index=i, prompt_token_ids=list(head), completion_token_ids=[*answer, *end],
                                      logprobs=[0.0] * (len(answer) + len(end)), finish_reason="stop", text=p.answer))
                owner.append(i)
        if samples:
            batch = TokenBatch.from_samples(samples, generator.pad_id)
            logp = learner.logprobs_nograd(batch).logp.double()
            out.index_add_(0, torch.tensor(owner), (logp * batch.completion_mask.double()).sum(-1).exp().cpu())
        return out

    return likelihood


class Learner(Protocol):
    """What the training loop needs from a model backend: nothing outside a learner touches a model or optimizer."""

    def logprobs(self, batch: TokenBatch, *, grad: bool, topk: int = 0,
                 topk_ids: Tensor | None = None) -> TokenLogprobs: ...  # topk_ids [B, T, K]: log-probs at these ids
    def logprobs_nograd(self, batch: TokenBatch, *, topk: int = 0) -> TokenLogprobs: ...
    def ref_logprobs(self, batch: TokenBatch, samples: list[Sample]) -> Tensor | None: ...  # None: no reference
    def values(self, batch: TokenBatch) -> Tensor | None: ...  # critic values [B, T]; None: no critic
    def begin_step(self, step: int) -> None: ...  # e.g. sync a reference that follows the policy
    def backward(self, loss: Tensor) -> None: ...
    def step(self) -> float: ...  # clip, optimizer and scheduler step; returns the pre-clip grad norm
    def skip_step(self) -> None: ...  # drop the accumulated gradients (a non-finite loss)
    def critic_step(self, batch: TokenBatch, old_values: Tensor, returns: Tensor) -> dict[str, float]: ...
    def set_base_lr(self, lr: float) -> None: ...
    @property
    def lr(self) -> float: ...
    def weights(self) -> dict[str, Tensor]: ...  # the policy's state dict, for generators elsewhere
    def save(self, run_dir: str | Path, step: int, state: dict[str, Any]) -> Path: ...
    def load(self, path: str | Path) -> dict[str, Any]: ...  # restores in place; returns the trainer state
    # Work division among data-parallel ranks (each holds the whole batch); trivial in one process.
    def shard(self, n: int) -> list[int | None]: ...  # this rank's micro-batches of n; None: a zero-weight pass
    def all_sum(self, values: Tensor) -> Tensor: ...  # sum over ranks


class ValueHead(nn.Module):
    """A critic: the policy's architecture with a scalar head on the last hidden state (GAE presets)."""

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(backbone.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, batch: TokenBatch) -> Tensor:
        """Values [B, T] of the states in which each completion token was chosen."""
        pos = (batch.attention_mask.cumsum(-1) - 1).clamp_min(0)
        out = self.backbone.base_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=pos)
        T = batch.completion_mask.shape[1]
        hidden = out.last_hidden_state[:, -T - 1:-1]  # state before token t predicts token t
        return self.head(hidden.float()).squeeze(-1)


class LocalLearner:
    """Single-process learner: one policy with AdamW and linear warm-up, its reference and its critic (if any).

    The reference is a frozen copy of the starting model, or one that follows the policy every
    ``ref_sync_every`` steps (Humanline presets; then it is state and is checkpointed), or with LoRA
    (``adapters``) the policy itself with its adapters off (``lora.BaseReference``). The critic is the
    policy's architecture with a value head and its own AdamW (GAE presets).

    The models compute on the device they were given on (``--device``: a GPU or the CPU); batches come and results
    go on the CPU, as ``FSDPLearner``'s do, so the loss and everything after it is computed there.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float,
        weight_decay: float,
        warmup_steps: int,
        max_grad_norm: float,
        temperature: float,
        top_p: float,
        top_k: int,
        fp32_head: bool,
        micro_batch_size: int,
        reference: nn.Module | None = None,
        ref_sync_every: int = 0,
        critic: ValueHead | None = None,
        critic_lr: float = 1e-4,
        value_clip: float = 0.5,
        value_loss_agg: str = "token_mean",
        adapters: Any | None = None,
        share_prompts: bool = False,
        fused_adam: bool = False,
    ):
        self.model = model
        self.device = next(model.parameters()).device
        self.adapters = adapters  # LoRA: the PEFT model; only its adapters train and the checkpoint holds them alone
        self.reference, self.ref_sync_every = reference, ref_sync_every
        self.critic, self.value_clip, self.value_loss_agg = critic, value_clip, value_loss_agg
        self.critic_opt = torch.optim.AdamW(critic.parameters(), lr=critic_lr) if critic is not None else None
        self.optimizer, self.scheduler = make_optimizer(trainable_parameters(model), lr=lr, weight_decay=weight_decay,
                                                        warmup_steps=warmup_steps, fused=fused_adam)
        self.max_grad_norm = max_grad_norm
        self.sampling = sampling_settings(temperature, top_p, top_k, share_prompts)
        self.fp32_head = fp32_head
        self.micro_batch_size = micro_batch_size

    def logprobs(self, batch: TokenBatch, *, grad: bool, topk: int = 0, topk_ids: Tensor | None = None
                 ) -> TokenLogprobs:
        """Log-probs, entropy (and top-K) of the completion tokens under the sampling distribution; with ``topk_ids``
        [B, T, K] the log-probs at those ids instead of this model's own top-K (pi_old's support in a later epoch).
        Train mode with or without ``grad``: the update's forward-only passes (zero-advantage rows) see the model its
        other passes see."""
        self.model.train()
        b = batch.to(self.device)
        ids = None if topk_ids is None else topk_ids.to(self.device)
        with torch.set_grad_enabled(grad):
            return completion_logprobs(self.model, b.input_ids, b.attention_mask, b.completion_mask,
                                       fp32_head=self.fp32_head, topk=0 if ids is not None else topk, topk_ids=ids,
                                       **self.sampling).cpu()

    def logprobs_nograd(self, batch: TokenBatch, *, topk: int = 0, model: nn.Module | None = None) -> TokenLogprobs:
        """The same without gradient and micro-batched, for the policy or another model (the reference)."""
        return logprobs_nograd(model or self.model, batch, micro_batch_size=self.micro_batch_size,
                               fp32_head=self.fp32_head, topk=topk, **self.sampling)

    def ref_logprobs(self, batch: TokenBatch, samples: list[Sample]) -> Tensor | None:
        """Reference log-probs [B, T] at the rollout weights: scored with the samples when the generation process
        did it (a frozen reference), else here; None without a reference."""
        def score() -> Tensor:
            if isinstance(self.reference, BaseReference):
                with self.reference.scoring() as base:
                    return self.logprobs_nograd(batch, model=base).logp
            return self.logprobs_nograd(batch, model=self.reference).logp

        return reference_logp(self.reference, self.ref_sync_every, batch, samples, score)

    def values(self, batch: TokenBatch) -> Tensor | None:
        """Critic values [B, T] on the loss tokens (0 elsewhere), without gradient; None without a critic."""
        if self.critic is None:
            return None
        with torch.no_grad():
            return self.critic(batch.to(self.device)).cpu() * batch.loss_mask

    def begin_step(self, step: int) -> None:
        """Sync a reference that follows the policy (Humanline: reference = recent policy) when it is due."""
        sync_reference(self.reference, self.ref_sync_every, self.model, step)

    def critic_step(self, batch: TokenBatch, old_values: Tensor, returns: Tensor) -> dict[str, float]:
        """One critic optimizer step on the clipped value loss of ``batch``; {} without a critic."""
        if self.critic is None or self.critic_opt is None:
            return {}
        values = self.critic(batch.to(self.device)).cpu()
        v_loss = clipped_value_loss(values, old_values, returns, batch.loss_mask, self.value_clip, self.value_loss_agg)
        self.critic_opt.zero_grad(set_to_none=True)
        v_loss.backward()
        self.critic_opt.step()
        return {"critic/value_loss": float(v_loss.detach())}

    def backward(self, loss: Tensor) -> None:
        loss.backward()

    def step(self) -> float:
        """Clip, step and zero; a non-finite gradient norm skips the update (weights untouched) and returns it."""
        return clip_and_step(self.model, self.optimizer, self.scheduler, self.max_grad_norm)

    def set_base_lr(self, lr: float) -> None:
        """Change the schedule's base learning rate for the rest of the run (saved with the scheduler state)."""
        set_base_lr(self.optimizer, self.scheduler, lr)

    def skip_step(self) -> None:
        """Drop accumulated gradients without stepping (non-finite loss)."""
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def weights(self) -> dict[str, Tensor]:
        """The policy's weights under the base model's names (LoRA adapters merged in), on its device (Ray's pool
        moves them to the CPU; vLLM beside it on the GPU takes them as they are)."""
        return plain_state_dict(self.model)

    def shard(self, n: int) -> list[int | None]:
        """Every micro-batch runs here."""
        return list(range(n))

    def all_sum(self, values: Tensor) -> Tensor:
        """One process: the sum over ranks is ``values`` itself."""
        return values

    def _extra_models(self) -> dict[str, nn.Module]:
        return extra_models(self.reference, self.ref_sync_every, self.critic)

    def save(self, run_dir: str | Path, step: int, state: dict[str, Any]) -> Path:
        """An atomic checkpoint of everything this learner holds, with the trainer's ``state``."""
        if self.critic_opt is not None:
            state = {**state, "critic_optimizer": self.critic_opt.state_dict()}
        return save_checkpoint(run_dir, step, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                               state=state, extra_models=self._extra_models(), adapters=self.adapters)

    def load(self, path: str | Path) -> dict[str, Any]:
        """Restore a checkpoint in place (weights, optimizers, schedule, RNG); return the trainer's state.

        A sharded checkpoint (saved by ``FSDPLearner`` at any world size) is read through the same DCP function,
        without a process group."""
        from polyrl.learner.sharded import is_sharded, load_sharded

        if is_sharded(path):
            return load_sharded(path, models={"model": self.model, **self._extra_models()},
                                optimizers={"model": self.optimizer, "critic": self.critic_opt},
                                scheduler=self.scheduler, collective=False)
        saved = load_checkpoint(path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                                extra_models=self._extra_models(), adapters=self.adapters)
        critic_opt_state = saved.pop("critic_optimizer", None)
        if self.critic_opt is not None and critic_opt_state is not None:
            self.critic_opt.load_state_dict(critic_opt_state)
        return saved
