"""Residual-stream access by forward hooks: read a block's output, or steer it by adding a vector (spec §7).

The residual stream after decoder block ``i`` is the output of ``model.model.layers[i]`` (Llama-style models;
GPT-2-style ``model.transformer.h`` also works). Hooks are used instead of ``output_hidden_states`` because the
last entry of ``hidden_states`` is taken after the final norm and because hooks see exactly what a steering
hook changed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The list of decoder blocks of a causal LM (``model.model.layers`` or ``model.transformer.h``)."""
    for path in (("model", "layers"), ("transformer", "h"), ("layers",)):
        obj = model
        for name in path:
            obj = getattr(obj, name, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList):
            return obj
    raise ValueError(f"{type(model).__name__}: no decoder layer list (model.layers or transformer.h) found")


def _hidden(output):
    return output[0] if isinstance(output, tuple) else output


@contextmanager
def steer(model: nn.Module, layer: int, direction: torch.Tensor, alpha: float) -> Iterator[None]:
    """Spec §7 (d): inside the block, the output of decoder block ``layer`` becomes ``h + alpha * direction`` at
    every position (a forward hook); the hook is removed on exit, also on an exception.

    Convention: ``direction`` is used as given (the caller normalises it; the experiment passes a unit vector and
    an alpha in units of the base model's projection half-gap). Activation addition: Turner et al. arXiv
    2308.10248; here the vector is a probe direction rather than a prompt-pair difference.
    """
    layers = decoder_layers(model)
    if not -len(layers) <= layer < len(layers):
        raise ValueError(f"layer must be in [0, {len(layers)}), got {layer}")
    vec = direction.detach().reshape(-1)

    def hook(_module, _inputs, output):
        h = _hidden(output)
        if h.shape[-1] != vec.shape[0]:
            raise ValueError(f"direction has {vec.shape[0]} entries, the residual stream {h.shape[-1]}")
        new = h + alpha * vec.to(device=h.device, dtype=h.dtype)
        return (new, *output[1:]) if isinstance(output, tuple) else new

    with _hooked(layers[layer], hook):
        yield


@contextmanager
def _hooked(module: nn.Module, hook) -> Iterator[None]:
    """``hook`` registered as a forward hook of ``module`` for the duration, removed on exit (exceptions too)."""
    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def amplify(model: nn.Module, layer: int, direction: torch.Tensor, factor: float, center: float = 0.0,
            position: int | None = None) -> Iterator[None]:
    """Inside the block, block ``layer``'s output ``h`` becomes ``h + (factor - 1) * (h.u - center) * u``
    (``u = direction / ||direction||``): the component along u, measured from ``center``, scaled by ``factor``;
    only at sequence index ``position`` when given, else everywhere. Removed on exit.

    Convention [ours]: the operationalisation of "amplifying the inferred attribute" (arXiv 2606.09735 [abs]):
    unlike ``steer`` it supplies no label -- it scales the model's own signal along u around the midpoint of
    the class means, so it can restore behaviour only if the signal is still there and still read downstream.
    """
    layers = decoder_layers(model)
    if not -len(layers) <= layer < len(layers):
        raise ValueError(f"layer must be in [0, {len(layers)}), got {layer}")
    u = direction.detach().reshape(-1).double()
    u = u / u.norm()

    def hook(_module, _inputs, output):
        h = _hidden(output)
        uu = u.to(device=h.device, dtype=h.dtype)
        part = h if position is None else h[:, position : position + 1 if position != -1 else None]
        delta = (factor - 1.0) * ((part @ uu) - center)[..., None] * uu
        if position is None:
            new = h + delta
        else:
            new = h.clone()
            new[:, position] = new[:, position] + delta[:, 0]
        return (new, *output[1:]) if isinstance(output, tuple) else new

    with _hooked(layers[layer], hook):
        yield


ROWS = 1024  # prompts per forward when reading activations: one forward over 10^6 prompts needed ~47 GB


@torch.no_grad()
def residual_activations(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                         layers: Sequence[int] | None = None) -> torch.Tensor:
    """Residual stream after each of ``layers`` (default all) at each row's last real token: [len(layers), N, d].

    Convention: rows are right-padded (``attention_mask`` 1 on real tokens); the read position is the last
    position with mask 1 -- for a prompt, the position whose logits choose the first completion token.
    """
    blocks = decoder_layers(model)
    layers = list(range(len(blocks))) if layers is None else list(layers)
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    seen: dict[int, torch.Tensor] = {}

    def make(i: int):
        def hook(_module, _inputs, output):
            seen[i] = _hidden(output)[rows, last].detach().float()
        return hook

    handles = [blocks[i].register_forward_hook(make(i)) for i in layers]
    parts = []
    try:
        for start in range(0, input_ids.shape[0], ROWS):  # a forward's memory grows with its rows
            ids, part_mask = input_ids[start:start + ROWS], mask[start:start + ROWS]
            rows, last = torch.arange(ids.shape[0]), part_mask.long().sum(1) - 1  # read by the hooks
            model(input_ids=ids, attention_mask=part_mask)
            parts.append(torch.stack([seen[i] for i in layers]))
    finally:
        for h in handles:
            h.remove()
    return torch.cat(parts, dim=1)
