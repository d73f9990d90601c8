"""LoRA through PEFT: adapters on a loaded policy, the base as the reference, merged weights for generators.

``add_adapters`` injects PEFT's LoRA layers into the transformers model in place (``get_peft_model``), so the
model object the learner, the sampler and the evaluator already hold now computes ``W x + (alpha / r) B A x``
and only ``A`` and ``B`` require gradients: the optimizer is built over the trainable parameters alone. The
reference policy of a KL preset is that same model with the adapters switched off (``BaseReference``: PEFT's
``disable_adapter`` context), so it costs no second copy of the weights. Generators in other processes (Ray
rollout workers, vLLM) and ``polyrl export`` receive the merged weights under the base model's own names
(``plain_state_dict``); a checkpoint holds the adapter alone, in PEFT's format (``adapter_config.json`` and
``adapter_model.safetensors``, loadable with ``PeftModel.from_pretrained(base, dir)``).

Convention: ``--lora-targets all-linear`` is PEFT's ``all-linear`` (every linear layer except the LM head);
the LM head never gets an adapter, because the sampler and the trainer apply it as a plain ``nn.Linear``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

from polyrl.checkpoint import ADAPTER_DIR  # the checkpoint's sub-directory holding the PEFT adapter

__all__ = ["ADAPTER_DIR", "BaseReference", "add_adapters", "merged_model", "plain_state_dict", "trainable_parameters"]


def add_adapters(model: nn.Module, *, rank: int, alpha: float, targets: str, dropout: float):
    """Inject LoRA adapters into ``model`` in place and freeze its base weights; return the PEFT wrapper.

    ``targets``: ``all-linear`` or comma-separated module names (``q_proj,v_proj``). A name that matches no module,
    or one that would put an adapter on the LM head, raises ValueError naming ``lora_targets``.
    """
    from peft import LoraConfig, get_peft_model
    from transformers.pytorch_utils import Conv1D

    names = "all-linear" if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]
    head = model.get_output_embeddings()
    head_names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if module is head}
    if isinstance(names, list) and head_names & set(names):
        raise ValueError(f"lora_targets = {targets!r} names the LM head ({', '.join(sorted(head_names))}); the head "
                         "is applied as a plain linear layer by the sampler and the trainer: leave it out")
    layer = (nn.Linear, Conv1D)  # GPT-2's linear layers are transformers' Conv1D, which PEFT adapts too
    modules = dict(model.named_modules())

    def matched(wanted) -> list[nn.Module]:  # PEFT's rule: the full name or its dotted suffix
        return [m for full, m in modules.items() if any(full == n or full.endswith("." + n) for n in wanted)]

    if isinstance(names, list):  # PEFT refuses only when no name matches: one stray name would be ignored
        missing = [n for n in names if not matched([n])]
        linear = sorted({full.rsplit(".", 1)[-1] for full, m in modules.items()
                         if isinstance(m, layer) and m is not head})
        if missing:
            raise ValueError(f"lora_targets = {targets!r}: {', '.join(missing)} "
                             f"match{'es' if len(missing) == 1 else ''} no module of the model; "
                             f"allowed: all-linear or names among {', '.join(linear)}")
        # a block (mlp, layers): PEFT's error then printed the module's repr, cut to its first line
        blocks = [n for n in names if not any(isinstance(m, layer) for m in matched([n]))]
        if blocks:
            raise ValueError(f"lora_targets = {targets!r}: {', '.join(blocks)} "
                             f"{'is a block' if len(blocks) == 1 else 'are blocks'} of modules, not a linear layer; "
                             f"allowed: all-linear or names among {', '.join(linear)}")
    targeted = [m for m in (modules.values() if names == "all-linear" else matched(names))
                if isinstance(m, layer) and m is not head]
    # past every targeted layer's smaller side a rank adds parameters and no capacity (narrow k/v projections of
    # grouped-query attention stop gaining earlier than the rest, which still gain)
    widest = max((min(m.weight.shape) for m in targeted), default=None)
    if widest is not None and rank > widest:
        raise ValueError(f"lora_rank = {rank} is not allowed: no targeted layer has a smaller side above {widest}, so "
                         f"a higher rank adds parameters and no capacity; allowed: 1 .. {widest}")
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=names, bias="none")
    try:
        with warnings.catch_warnings():  # PEFT calls a transformers property deprecated in v5 (FutureWarning)
            warnings.simplefilter("ignore", FutureWarning)
            peft_model = get_peft_model(model, config)
    except ValueError as e:  # PEFT: "Target modules {...} not found in the base model"
        raise ValueError(f"lora_targets = {targets!r}: {str(e).splitlines()[0]}") from None
    return peft_model


def has_adapters(model: nn.Module) -> bool:
    """Whether PEFT's LoRA layers are injected in ``model``."""
    from peft.tuners.lora import LoraLayer

    return any(isinstance(m, LoraLayer) for m in model.modules())


def plain_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """``model``'s weights under the base architecture's names: LoRA layers merged (``W + (alpha / r) B A``), the
    adapters' own tensors left out. A model without adapters gives its ``state_dict()`` unchanged."""
    from peft.tuners.lora import LoraLayer

    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    if not layers:
        return model.state_dict()
    merged: dict[str, Tensor] = {}
    for name, tensor in model.state_dict().items():
        if ".lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".base_layer.")
        if owner in layers and leaf == "weight":
            layer = layers[owner]
            with torch.no_grad():
                delta = sum((layer.get_delta_weight(a) for a in layer.active_adapters), torch.zeros_like(tensor))
            tensor = tensor + delta.to(tensor.dtype)
        merged[name.replace(".base_layer.", ".")] = tensor
    return merged


class BaseReference:
    """The reference policy of a LoRA run: the policy's own base weights, scored with the adapters switched off."""

    def __init__(self, peft_model) -> None:
        self.peft_model = peft_model
        self.model = peft_model.get_base_model()  # the transformers model (holding the adapters, off while scoring)

    @contextlib.contextmanager
    def scoring(self) -> Iterator[nn.Module]:
        """The model to score with, its adapters off for the duration."""
        with self.peft_model.disable_adapter():
            yield self.model


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimizer should hold: all of them, or only the adapters of a LoRA model."""
    return [p for p in model.parameters() if p.requires_grad]


def merged_model(base_dir: str | Path, adapter_dir: str | Path) -> nn.Module:
    """A plain transformers model: ``base_dir``'s weights with the adapter in ``adapter_dir`` merged in."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype="auto", local_files_only=True)
    with warnings.catch_warnings():  # PEFT calls a transformers property deprecated in v5 (FutureWarning)
        warnings.simplefilter("ignore", FutureWarning)
        return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
