"""The generator protocol: prompts in, sampled completions with their rollout log-probs out.

A backend (transformers here; vLLM optionally) samples ``n`` completions per prompt and reports,
for every sampled token, its log-prob under the distribution it was actually drawn from (after
temperature, top-k and top-p). The trainer keeps these as ``rollout_logp`` so mismatch corrections
and DPPO-style trust regions anchor to the policy that really sampled.

Randomness is per completion, as vLLM's per-request seed: every row (one completion) carries a
key, and its draws depend only on ``(seed, key)``, never on which other rows share its batch. So a
list of prompts sampled in one call, or split into chunks sampled separately (other processes,
other batch sizes) with the same keys, gives the same completions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import Tensor

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; ``temperature == 0`` means greedy decoding."""

    n: int = 1  # completions per prompt (the group size)
    max_new_tokens: int = 64  # completion length cap; hitting it gives finish_reason "length"
    temperature: float = 1.0  # 0 = greedy (argmax), else logits / temperature
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]; 1.0 disables
    top_k: int | None = None  # keep the k most probable tokens; None disables
    seed: int | None = None  # sampling seed; None = nondeterministic
    stop_token_ids: tuple[int, ...] = ()  # besides EOS, tokens that end a completion (a tool call's closer)
    sum_pi_sq: bool = False  # also report sum_v pi_v^2 of each token's distribution (Sample.sum_pi_sq; OTB)

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"SamplingParams.top_k must be >= 1 or None, got {self.top_k}")


@dataclass
class Sample:
    """One sampled completion of one prompt."""

    prompt_index: int  # index of the prompt in the list given to generate()
    prompt_token_ids: list[int]  # the prompt as tokenized (special tokens included, no padding)
    completion_token_ids: list[int]  # sampled tokens, the EOS token included when finish_reason == "stop"
    logprobs: list[float]  # rollout log-prob of each completion token under the processed distribution
    finish_reason: FinishReason  # "stop": EOS or a stop token sampled (it is the last token); "length": cap reached
    text: str  # completion decoded without special tokens (so without EOS)
    loss_mask: list[int] | None = None  # per completion token: 0 = inserted by an environment/tree prefix; None = all 1
    turn_ids: list[int] | None = None  # per completion token: agent-turn index (multi-turn tasks); None = all 0
    policy_version: int = 0  # optimizer steps the sampling weights had seen (asynchronous pipeline)
    baseline_tokens: int = 0  # tokens chosen by the agency-transfer baseline policy
    ref_logprobs: list[float] | None = None  # per completion token under the frozen reference (asynchronous pipeline)
    sum_pi_sq: list[float] | None = None  # per completion token: sum_v pi_v^2 of the distribution it was drawn from


class Generator(Protocol):
    """A sampling backend. Samples come back grouped: all ``n`` of prompt 0, then prompt 1, ...

    ``keys`` holds one integer per row (prompt ``i``'s ``n`` copies in order; by default a row's key is its
    index ``i * n + j``). Like vLLM's per-request seed, a row's randomness comes from ``(params.seed, key)``
    alone, so the same seed and key give the same completion in any batch.
    """

    def generate(self, prompts: list[str], params: SamplingParams, keys: list[int] | None = None) -> list[Sample]:
        """Sample ``params.n`` completions for every prompt."""
        ...

    def generate_ids(self, prompt_ids: list[list[int]], params: SamplingParams,
                     keys: list[int] | None = None) -> list[Sample]:
        """The same from already tokenized prompts (continuations of multi-turn or tree prefixes)."""
        ...

    def load_weights(self, state_dict: dict[str, Tensor]) -> None:
        """Replace the sampling weights with the trainer's (same parameter names)."""
        ...


def check_prompts_fit(prompt_ids: list[list[int]], max_new_tokens: int, context: int | None, tokenizer) -> None:
    """Refuse (``ConfigError``, one line showing the prompt's start) a prompt whose tokens and ``max_new_tokens``
    exceed the model's ``context`` (``model.context_length``; vLLM's ``max_model_len``)."""
    from polyrl.model import check_context

    if context is None:
        return
    for ids in prompt_ids:
        if len(ids) + max_new_tokens > context:
            shown = tokenizer.decode(ids[:24], skip_special_tokens=True)
            more = "..." if len(ids) > 24 or len(shown) > 40 else ""
            check_context(len(ids), max_new_tokens, context, prompt=f"the prompt {shown[:40]!r}{more}")


def draw_tokens(logprobs: Tensor, u: Tensor) -> Tensor:
    """Sample one token per row [n] from log-distributions [n, V] by inverse CDF with uniforms ``u`` [n] in [0, 1).

    Each row uses only its own uniform, so its token does not depend on the other rows (unlike one
    ``torch.multinomial`` over the batch). A zero-probability (filtered) token is never picked, even
    at ``u == 0`` or where float rounding of the cumulative sum would allow it: its CDF entry is set
    to exactly its predecessor's, and the target stays strictly below the total mass.
    """
    probs = logprobs.exp()
    cdf = torch.where(probs > 0, probs.cumsum(dim=-1), 0.0).cummax(dim=-1).values
    total = cdf[:, -1:]
    target = torch.minimum(u.to(cdf.dtype)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)
