"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), and their export as a Hugging Face directory.

Layout, beside the single-file one of ``polyrl.checkpoint`` and in the same ``run_dir/checkpoints/step_000123``
place: ``dcp/`` holds the DCP shards (``__<rank>_0.distcp``) and their ``.metadata``, keyed ``model``, ``optimizer``
and, when present, ``critic``, ``critic_optimizer``, ``reference``; ``trainer_state.pt`` (written by rank 0) holds
the scheduler, rank 0's RNG states and the trainer's state; ``meta.json`` has ``"layout": "dcp"``, the world size
and a SHA-256 of every file, so ``verify_checkpoint``, ``latest_checkpoint`` and the rest work unchanged. Every
rank writes into one temporary sibling directory; after a barrier rank 0 checksums and renames it into place.

DCP stores each tensor once with its global shape, so a checkpoint loads at any world size: into FSDP2 modules
(each rank reads its shards) or into plain modules in a process without a process group (world size 1,
``LocalLearner.load``). A single-file checkpoint of ``LocalLearner`` loads into sharded modules too
(``load_unsharded``), so a run can also go from one process to several.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from polyrl.checkpoint import FORMAT, CheckpointError, _sha256, rng_state, set_rng_state, verify_checkpoint
from polyrl.learner import dist as pdist

LAYOUT = "dcp"
SHARDS = "dcp"  # the subdirectory of the DCP files


def _opt_key(name: str) -> str:
    return "optimizer" if name == "model" else f"{name}_optimizer"


def _state_dicts(models: dict[str, nn.Module], optimizers: dict[str, Any]) -> dict[str, Any]:
    """DCP's view of the models and their optimizers (DTensor shards under FSDP2, plain tensors otherwise)."""
    out: dict[str, Any] = {}
    for name, model in models.items():
        opt = optimizers.get(name)
        if opt is None:
            out[name] = get_model_state_dict(model)
        else:
            out[name], out[_opt_key(name)] = get_state_dict(model, opt)
    return out


def is_sharded(path: str | Path) -> bool:
    """Whether ``path`` is a checkpoint in this layout (False for a single-file or missing one)."""
    try:
        return json.loads((Path(path) / "meta.json").read_text()).get("layout") == LAYOUT
    except (OSError, ValueError):
        return False


def save_sharded(run_dir: str | Path, step: int, *, models: dict[str, nn.Module], optimizers: dict[str, Any],
                 scheduler: Any, state: dict[str, Any], keep_last: int = 2) -> Path:
    """Write ``run_dir/checkpoints/step_{step:06d}`` atomically from every rank (a collective); prune older ones.

    ``models`` maps ``model`` (the policy) and the extra models to their modules, ``optimizers`` a model's name to
    its optimizer (or None). Returns the checkpoint's path on every rank.
    """
    rank, world = pdist.rank_world()
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}_{pdist.broadcast_object(os.getpid())}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    pdist.barrier()
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(_state_dicts(models, optimizers), checkpoint_id=tmp / SHARDS, no_dist=not dist.is_initialized())
    if rank == 0:
        torch.save({"scheduler": scheduler.state_dict() if scheduler is not None else None, "rng": rng_state(),
                    "state": state}, tmp / "trainer_state.pt")
    pdist.barrier()  # every rank's shards are written
    if rank == 0:
        files = sorted(str(f.relative_to(tmp)) for f in tmp.rglob("*") if f.is_file())
        meta = {"format": FORMAT, "layout": LAYOUT, "step": step, "world_size": world,
                "files": {f: _sha256(tmp / f) for f in files}}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        if keep_last > 0:
            for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    pdist.barrier()
    return final


def load_sharded(path: str | Path, *, models: dict[str, nn.Module], optimizers: dict[str, Any], scheduler: Any,
                 restore_rng: bool = True, collective: bool = True) -> dict[str, Any]:
    """Restore a checkpoint of this layout in place, at any world size; return the trainer's state. Every rank of
    the process group calls it; ``collective=False`` (plain modules in one process, ``LocalLearner``) reads alone,
    with or without a process group."""
    path = Path(path)
    verify_checkpoint(path)
    reader = dcp.FileSystemReader(path / SHARDS)
    keys = set(reader.read_metadata().state_dict_metadata)  # flattened: "model.lm_head.weight", ...
    optimizers = {k: v for k, v in optimizers.items() if v is not None and k in models}
    for key in [*models, *map(_opt_key, optimizers)]:
        if not any(k.startswith(f"{key}.") for k in keys):
            raise CheckpointError(f"checkpoint {path} has no {key} state")
    sd = _state_dicts(models, optimizers)
    for name in models:
        missing = sorted(k for k in sd[name] if f"{name}.{k}" not in keys)
        if missing:
            raise CheckpointError(f"checkpoint {path} has no {name} weights for {', '.join(missing[:3])}"
                                  + (f" and {len(missing) - 3} more" if len(missing) > 3 else ""))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        # Partial: a parameter that never had a gradient has no Adam state in the checkpoint (see _keep_saved).
        dcp.load(sd, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True),
                 no_dist=not (collective and dist.is_initialized()))
    for name, model in models.items():
        if name in optimizers:
            set_state_dict(model, optimizers[name], model_state_dict=sd[name], optim_state_dict=sd[_opt_key(name)])
            prefix = f"{_opt_key(name)}.state."
            _keep_saved(model, optimizers[name], {k[len(prefix):].rsplit(".", 1)[0] for k in keys
                                                  if k.startswith(prefix)})
        else:
            set_model_state_dict(model, sd[name])
    return _restore(torch.load(path / "trainer_state.pt", weights_only=False), scheduler, restore_rng)


def _keep_saved(model: nn.Module, optimizer: Any, saved: set[str]) -> None:
    """Drop the optimizer state of parameters whose state was not saved: reading a state dict first gives every
    parameter one (a step with zero gradients), but a parameter that never had a gradient (a critic's unused LM
    head) had none, and must have none again for the optimizer to be exactly the saved one."""
    for name, param in model.named_parameters():
        if name not in saved:
            optimizer.state.pop(param, None)


def _restore(blob: dict[str, Any], scheduler: Any, restore_rng: bool) -> dict[str, Any]:
    """Scheduler and RNG states from ``trainer_state.pt``; returns the trainer's state."""
    if scheduler is not None and blob["scheduler"] is not None:
        scheduler.load_state_dict(blob["scheduler"])
    if restore_rng:
        set_rng_state(blob["rng"])
    return blob["state"]


def load_unsharded(path: str | Path, *, models: dict[str, nn.Module], optimizers: dict[str, Any], scheduler: Any,
                   restore_rng: bool = True) -> dict[str, Any]:
    """Restore a single-file checkpoint (``LocalLearner.save``) into sharded modules: every rank reads the full
    tensors and keeps its shards. Optimizer states are keyed by parameter order there, by name here."""
    from safetensors.torch import load_file

    path = Path(path)
    meta = verify_checkpoint(path)
    full = StateDictOptions(full_state_dict=True, strict=False)  # a parameter never stepped has no Adam state
    for name, model in models.items():
        file = "model.safetensors" if name == "model" else f"{name}.safetensors"
        if file not in meta["files"]:
            raise CheckpointError(f"checkpoint {path} has no {name} weights")
        tensors = load_file(path / file)  # tied weights are stored once; strict=False lets the other name be
        set_model_state_dict(model, tensors, options=StateDictOptions(full_state_dict=True, strict=False))
    blob = torch.load(path / "trainer_state.pt", weights_only=False)
    saved_opts = {"model": blob["optimizer"], "critic": blob["state"].pop("critic_optimizer", None)}
    for name, opt in optimizers.items():
        if opt is None or name not in models or saved_opts.get(name) is None:
            continue
        names = [n for n, _ in models[name].named_parameters()]  # the order the optimizer was built in
        osd = saved_opts[name]
        osd = {"state": {names[i]: s for i, s in osd["state"].items()},
               "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]]}
        set_optimizer_state_dict(models[name], opt, osd, options=full)
        _keep_saved(models[name], opt, set(osd["state"]))
    return _restore(blob, scheduler, restore_rng)


def export_hf(checkpoint_dir: str | Path, out_dir: str | Path, model_dir: str | Path) -> Path:
    """Write the policy of a checkpoint (either layout, or a LoRA adapter: merged) as a plain Hugging Face directory
    loadable with ``from_pretrained``: config, generation config and tokenizer from ``model_dir``, weights from the
    checkpoint.
    Needs no process group (call it on one rank)."""
    from safetensors.torch import load_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from polyrl.learner.lora import ADAPTER_DIR, merged_model

    checkpoint_dir, out = Path(checkpoint_dir), Path(out_dir)
    verify_checkpoint(checkpoint_dir)
    if (checkpoint_dir / ADAPTER_DIR).is_dir():  # LoRA: the base with the adapter merged into its weights
        model = merged_model(model_dir, checkpoint_dir / ADAPTER_DIR)
    elif is_sharded(checkpoint_dir):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto", local_files_only=True)
        sd = {"model": model.state_dict()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(sd, checkpoint_id=checkpoint_dir / SHARDS, no_dist=True)
        model.load_state_dict(sd["model"])
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto", local_files_only=True)
        load_model(model, str(checkpoint_dir / "model.safetensors"))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir, local_files_only=True).save_pretrained(out)
    return out
