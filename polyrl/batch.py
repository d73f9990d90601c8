"""Rollout samples as padded token tensors, and the scoring helpers every layer above the model shares.

``TokenBatch`` holds a batch in the layout ``completion_logprobs`` expects: the left-padded prompt
followed by a right-padded completion block of T columns. The learner, the update phase and the
asynchronous generation process (which scores a frozen reference) all read it; keeping it here
rather than in ``learner`` lets rollout code use it without importing a learner.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from polyrl.model import TokenLogprobs, completion_logprobs

if TYPE_CHECKING:
    from polyrl.rollout.generator import Sample


@dataclass
class TokenBatch:
    """Rollout samples as padded tensors."""

    input_ids: Tensor  # [B, P + T] left-padded prompt, then right-padded completion
    attention_mask: Tensor  # [B, P + T]
    completion_mask: Tensor  # [B, T] 1 for sampled completion tokens (EOS included)
    rollout_logp: Tensor  # [B, T] log-probs reported by the sampler (0 at padding and environment tokens)
    loss_mask: Tensor  # [B, T] 1 for tokens the policy chose; environment and copied-prefix tokens are 0
    turn_ids: Tensor  # [B, T] long: agent-turn index of each completion token (0 for single-turn tasks)
    sum_pi_sq: Tensor | None = None  # [B, T] sampler's sum_v pi_v^2 per token, when every sample carries it (OTB)

    def to(self, device: torch.device) -> TokenBatch:
        """The same batch on ``device`` (itself where it already is: ``Tensor.to`` does not copy then)."""
        values = (getattr(self, f.name) for f in fields(self))
        return TokenBatch(*(None if t is None else t.to(device) for t in values))

    def rows(self, index: Tensor | slice) -> TokenBatch:
        return TokenBatch(self.input_ids[index], self.attention_mask[index], self.completion_mask[index],
                          self.rollout_logp[index], self.loss_mask[index], self.turn_ids[index],
                          None if self.sum_pi_sq is None else self.sum_pi_sq[index])

    def trimmed(self) -> tuple[TokenBatch, int]:
        """The same rows without the columns that are padding in every row: the prompt block's leading columns and
        the completion block's trailing ones. Returns the batch and its completion width (the kept first columns
        of every [B, T] completion tensor); log-probs of the kept tokens are unchanged (positions come from the
        attention mask, and no kept token attends to a dropped one)."""
        T = self.completion_mask.shape[1]
        used = self.completion_mask.any(dim=0).nonzero()
        width = int(used.max()) + 1 if len(used) else 1
        prompt = self.attention_mask[:, : self.input_ids.shape[1] - T].any(dim=0).nonzero()
        start = int(prompt.min()) if len(prompt) else 0
        stop = self.input_ids.shape[1] - T + width
        sq = None if self.sum_pi_sq is None else self.sum_pi_sq[:, :width]
        return TokenBatch(self.input_ids[:, start:stop], self.attention_mask[:, start:stop],
                          self.completion_mask[:, :width], self.rollout_logp[:, :width], self.loss_mask[:, :width],
                          self.turn_ids[:, :width], sq), width

    @staticmethod
    def from_samples(samples: list[Sample], pad_id: int) -> TokenBatch:
        P = max(len(s.prompt_token_ids) for s in samples)
        T = max(1, max(len(s.completion_token_ids) for s in samples))
        # Padded Python lists first, one tensor each at the end (a torch.tensor call per row and field costs more).
        ids, attn, comp, logp, loss_mask, turns = [], [], [], [], [], []
        with_sq = all(s.sum_pi_sq is not None for s in samples)
        sq = []
        for s in samples:
            p, c = len(s.prompt_token_ids), len(s.completion_token_ids)
            right = [0] * (T - c)
            ids.append([pad_id] * (P - p) + [*s.prompt_token_ids, *s.completion_token_ids] + [pad_id] * (T - c))
            attn.append([0] * (P - p) + [1] * (p + c) + right)
            comp.append([1] * c + right)
            logp.append(list(s.logprobs[:c]) + right)
            loss_mask.append((list(s.loss_mask) if s.loss_mask is not None else [1] * c) + right)
            turns.append((list(s.turn_ids) if s.turn_ids is not None else [0] * c) + right)
            if with_sq:
                sq.append(list(s.sum_pi_sq) + right)
        f32 = torch.float32
        return TokenBatch(torch.tensor(ids, dtype=torch.long), torch.tensor(attn, dtype=torch.long),
                          torch.tensor(comp, dtype=f32), torch.tensor(logp, dtype=f32),
                          torch.tensor(loss_mask, dtype=f32), torch.tensor(turns, dtype=torch.long),
                          torch.tensor(sq, dtype=f32) if with_sq else None)


SEGMENT_END = ".,;:!?\n"


def boundary_token_ids(tokenizer) -> frozenset[int]:
    """Ids of tokens that end a sub-sentence: their text ends in . , ; : ! ? or holds a newline.

    Byte-level BPE vocabularies spell a newline as 'Ċ'; both spellings count.
    """
    out = set()
    for tok, idx in tokenizer.get_vocab().items():
        text = tok.replace("Ċ", "\n").rstrip(" Ġ")
        if "\n" in text or (text and text[-1] in SEGMENT_END):
            out.add(idx)
    return frozenset(out)


def segment_ids(completion_ids: Tensor, completion_mask: Tensor, boundaries: frozenset[int]) -> Tensor:
    """[B, T] sub-sentence index of each completion token: a new segment starts after each boundary token (SSPO)."""
    is_end = torch.zeros_like(completion_mask, dtype=torch.long)
    if boundaries:
        ends = torch.tensor(sorted(boundaries), dtype=completion_ids.dtype)
        is_end = torch.isin(completion_ids, ends).long() * completion_mask.long()
    return torch.cumsum(is_end, dim=-1) - is_end  # the boundary token belongs to the segment it closes


def logprobs_nograd(model: nn.Module, batch: TokenBatch, *, micro_batch_size: int, fp32_head: bool = False,
                    topk: int = 0, temperature: float = 1.0, top_p: float | None = None,
                    top_k: int | None = None, share_prompts: bool = False) -> TokenLogprobs:
    """Completion log-probs (entropy, top-K) of ``batch`` under ``model``, without gradient, micro-batched: each
    micro-batch computed on the model's device, the results on the CPU."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    parts = []
    with torch.no_grad():
        for i in range(0, batch.input_ids.shape[0], micro_batch_size):
            rows = batch.rows(slice(i, i + micro_batch_size)).to(device)
            parts.append(completion_logprobs(model, rows.input_ids, rows.attention_mask, rows.completion_mask,
                                             fp32_head=fp32_head, topk=topk, temperature=temperature, top_p=top_p,
                                             top_k=top_k, share_prompts=share_prompts).cpu())
    model.train(was_training)

    def cat(name: str) -> Tensor | None:
        return None if getattr(parts[0], name) is None else torch.cat([getattr(p, name) for p in parts])

    return TokenLogprobs(logp=cat("logp"), entropy=cat("entropy"), topk_ids=cat("topk_ids"),
                         topk_logp=cat("topk_logp"))


def sample_ref_logp(samples: list[Sample], T: int) -> Tensor | None:
    """[B, T] reference log-probs carried by the samples (scored by the rollout workers), or None if one lacks them."""
    if not samples or any(s.ref_logprobs is None or len(s.ref_logprobs) != len(s.completion_token_ids)
                          for s in samples):
        return None
    out = torch.zeros((len(samples), T), dtype=torch.float32)
    for i, s in enumerate(samples):
        out[i, : len(s.ref_logprobs)] = torch.tensor(s.ref_logprobs, dtype=torch.float32)
    return out
