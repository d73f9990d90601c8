"""Run each distinct prompt of a batch once, and its completions on top of it (a group shares one prompt).

A GRPO batch holds G completions of each prompt, so the plain training forward runs every prompt G times. Here
the distinct prompts go through the base model once, with a KV cache; the cache is indexed out to the rows
(``Cache.reorder_cache``, a differentiable gather), and the completion block runs on top of it with the full
attention mask and the same position ids as the plain forward. Attention sees exactly the same keys and values,
so log-probs and gradients are those of the plain forward up to float rounding (the gradients of a shared prompt
arrive summed over its rows in one matmul instead of G). ``tests/test_speed.py`` checks both against the plain
forward on every architecture the tests build (float64: log-probs to 1e-9, gradients to 1e-6 of their largest
entry; Gemma 2, whose float64 forward is NaN in transformers, in float32). The prompt's tokens cost ``U / B`` of
the plain forward's (U distinct prompts in B rows: 1/8 with groups of 8), most of the update at short completions.

The same idea is the "shared-prefix forward" of Prefix Grouper (arXiv:2506.05433), there with a custom attention
kernel; here it is the model's own cache path, so any architecture whose cache transformers builds works.
"""

from __future__ import annotations

import functools
import inspect
import weakref

import torch
from torch import Tensor, nn


def distinct_prompts(input_ids: Tensor, attention_mask: Tensor, width: int) -> tuple[Tensor, Tensor] | None:
    """``(first, inverse)``: the first row of each distinct prompt block (the first ``L - width`` columns of ids and
    mask) and each row's distinct-prompt index; None when every row's prompt is distinct (nothing to share)."""
    length = input_ids.shape[1]
    block = (input_ids[:, : length - width] * attention_mask[:, : length - width]).long()  # pads compare equal
    block = block * 2 + attention_mask[:, : length - width].long()  # ...and where the pads are does too
    unique, inverse = block.unique(dim=0, return_inverse=True)
    if unique.shape[0] == input_ids.shape[0]:
        return None
    first = inverse.new_full((unique.shape[0],), input_ids.shape[0]).scatter_reduce(
        0, inverse, inverse.new_tensor(range(len(inverse))), reduce="amin")
    return first, inverse


_KV_ONLY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> kv_only_cache (once per model)


def kv_only_cache(model: nn.Module) -> bool:
    """Whether ``model``'s cache holds keys and values alone (dynamic or sliding-window layers), which lets rows share a
    prompt's cache (indexed out with its gradients) and leave a decode batch. A hybrid's convolution or recurrent
    states (Qwen3.5's linear attention, LFM2) are updated in place by a completion block, which breaks the backward
    pass: such a model runs the plain training forward and takes no agency transfer."""
    if model not in _KV_ONLY:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

        layers = DynamicCache(config=model.config).layers
        _KV_ONLY[model] = all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in layers)
    return _KV_ONLY[model]


def shared_prompt_states(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                         width: int, first: Tensor, inverse: Tensor) -> Tensor:
    """Final hidden states [B, width, H] at the positions that predict the ``width`` completion columns (the last
    prompt column, then the completion columns but the last), computed with each distinct prompt run once."""
    length = input_ids.shape[1]
    split = length - width
    base = model.base_model
    prompt = base(input_ids=input_ids[first, :split], attention_mask=attention_mask[first, :split],
                  position_ids=position_ids[first, :split], use_cache=True)
    cache = prompt.cache if "cache" in prompt else prompt.past_key_values  # the name in transformers >= 5.2x
    last_prompt = prompt.last_hidden_state[inverse, -1:]  # [B, 1, H]: predicts completion column 0
    if width == 1:
        return last_prompt
    cache.reorder_cache(inverse)  # every row gets its prompt's keys and values (gradients flow back, summed)
    # The last column predicts nothing and no scored position attends to it: it is not run.
    tail = base(input_ids=input_ids[:, split:-1], attention_mask=attention_mask[:, :-1],
                position_ids=position_ids[:, split:-1], use_cache=True, **{cache_keyword(type(base)): cache})
    return torch.cat([last_prompt, tail.last_hidden_state], dim=1)


@functools.cache
def cache_keyword(model_class: type) -> str:
    """The name under which ``model_class.forward`` takes the KV cache.

    Recent transformers call it ``cache`` and warn (FutureWarning) on every call that passes the deprecated
    ``past_key_values``; older releases, which the package's range still allows, know only ``past_key_values``.
    """
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"
