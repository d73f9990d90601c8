"""A KV cache for the decode loop that writes each step's keys in place instead of concatenating.

transformers' ``DynamicLayer.update`` is ``torch.cat([keys, new])``: decode step t copies all t earlier keys and
values of every layer, so a completion of length S moves O(S^2) cache bytes. With a tiny model on a CPU that copy
can be most of the decode time (64 rows, 128 new tokens, hidden 128: 64 % in ``aten::cat`` under ``torch.profiler``
in a fresh process; less inside a long run, where the allocator reuses freed memory), and it grows with S^2.
``InPlaceLayer`` knows the longest the row can get (prompt width + max_new_tokens), allocates
that once, writes step t's keys into slot t and hands attention the view of the filled slots: attention sees the
same keys as with concatenation (tests/test_speed.py checks the rollouts are the same), at O(S) copying.
``StaticCache`` also writes in place but attends over every slot, filled or not, and builds a full-length mask per
step: slower than concatenation at these sizes (measured), so it is not used.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class InPlaceLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys/values live in a buffer of ``capacity`` slots; ``keys`` is the filled view."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.filled = 0

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.device, self.is_initialized = key_states.device, True
            batch, heads, _, _ = key_states.shape
            self._keys = key_states.new_empty((batch, heads, self.capacity, key_states.shape[-1]))
            self._values = value_states.new_empty((batch, heads, self.capacity, value_states.shape[-1]))
        end = self.filled + key_states.shape[-2]
        if end > self.capacity:
            raise ValueError(f"InPlaceLayer: {end} tokens exceed the capacity {self.capacity}")
        self._keys[:, :, self.filled:end] = key_states
        self._values[:, :, self.filled:end] = value_states
        self.filled = end
        self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
        return self.keys, self.values

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.is_initialized:
            self._keys, self._values = self._keys[indices], self._values[indices]
            self.keys, self.values = self._keys[:, :, : self.filled], self._values[:, :, : self.filled]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx.to(self.device) if self.is_initialized else beam_idx)


def decode_cache(config, capacity: int) -> DynamicCache:
    """transformers' ``DynamicCache`` for ``config`` with each full-attention layer replaced by an ``InPlaceLayer``
    of ``capacity`` slots (sliding-window and other special layers keep their own type)."""
    cache = DynamicCache(config=config)
    cache.layers = [InPlaceLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
