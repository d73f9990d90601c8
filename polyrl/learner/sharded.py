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
from glob import escape as glob_escape
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

from polyrl.checkpoint import (
    FORMAT,
    CheckpointError,
    _sha256,
    list_checkpoints,
    prune_checkpoints,
    replace_dir,
    rng_state,
    set_rng_state,
    verify_checkpoint,
)
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
    rngs = pdist.all_gather_object(rng_state())  # each rank's own: its CPU and GPU generators have drawn apart
    if rank == 0:
        torch.save({"scheduler": scheduler.state_dict() if scheduler is not None else None, "rng": rngs[0],
                    "rng_ranks": rngs, "state": state}, tmp / "trainer_state.pt")
    pdist.barrier()  # every rank's shards are written
    if rank == 0:
        files = sorted(str(f.relative_to(tmp)) for f in tmp.rglob("*") if f.is_file())
        meta = {"format": FORMAT, "layout": LAYOUT, "step": step, "world_size": world,
                "files": {f: _sha256(tmp / f) for f in files}}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        replace_dir(tmp, final)  # an existing copy of this step is kept until the new one is in place
        prune_checkpoints(run_dir, step, keep_last)  # step_NNNNNN only: a backup copy is never pruned
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
    blob = torch.load(path / "trainer_state.pt", weights_only=False, map_location="cpu")
    return _restore(blob, scheduler, restore_rng)


def _keep_saved(model: nn.Module, optimizer: Any, saved: set[str]) -> None:
    """Drop the optimizer state of parameters whose state was not saved: reading a state dict first gives every
    parameter one (a step with zero gradients), but a parameter that never had a gradient (a critic's unused LM
    head) had none, and must have none again for the optimizer to be exactly the saved one."""
    for name, param in model.named_parameters():
        if name not in saved:
            optimizer.state.pop(param, None)


def _restore(blob: dict[str, Any], scheduler: Any, restore_rng: bool) -> dict[str, Any]:
    """Scheduler and RNG states from ``trainer_state.pt``; returns the trainer's state. Each rank takes its own
    generators back when the world size is the saved one, else rank 0's (a checkpoint of one process, or a resume
    at another world size)."""
    if scheduler is not None and blob["scheduler"] is not None:
        scheduler.load_state_dict(blob["scheduler"])
    if restore_rng:
        rank, world = pdist.rank_world()
        ranks = blob.get("rng_ranks") or []
        set_rng_state(ranks[rank] if len(ranks) == world else blob["rng"])
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
    blob = torch.load(path / "trainer_state.pt", weights_only=False, map_location="cpu")
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


EXPORT_MARKER = "polyrl_export.json"  # written into every export: only a directory holding it may be overwritten


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _holds_checkpoints(path: Path) -> bool:
    """Whether ``path`` is a run's ``checkpoints/`` directory: it holds a ``step_NNNNNN`` with a meta.json."""
    return path.name == "checkpoints" and any((p / "meta.json").is_file() for p in list_checkpoints(path.parent))


def check_export_destination(checkpoint_dir: str | Path, out_dir: str | Path) -> Path:
    """The absolute destination of an export, or a one-line ``ConfigError`` naming ``out``: refused are a file, a
    path inside the checkpoint (or holding it), inside the checkpoint's run directory, a polyrl run directory, a
    checkpoint directory and any other non-empty directory that is not a previous export (``EXPORT_MARKER``). A new
    or empty directory, or a previous export, is allowed."""
    from polyrl.errors import ConfigError

    out = Path(os.path.abspath(out_dir))
    named = f"out = {str(out_dir)!r}"
    checkpoint = Path(checkpoint_dir).resolve()
    allowed = "allowed: a new or empty directory, or a previous export (one holding " + EXPORT_MARKER + ")"
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{named}: is an existing file, not a directory; {allowed}")
    real = out.resolve()
    if _inside(real, checkpoint):
        raise ConfigError(f"{named}: is the checkpoint being exported or inside it ({checkpoint}); {allowed} outside "
                          "the run directory")
    run = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None
    if run is not None and _inside(real, run):
        where = "is the run directory" if real == run else f"is inside the run directory {str(run)!r}"
        raise ConfigError(f"{named}: {where} of the checkpoint being exported (its files would be overwritten); "
                          f"{allowed} outside it")
    if _inside(checkpoint, real):
        raise ConfigError(f"{named}: holds the checkpoint being exported ({checkpoint}); {allowed}")
    from polyrl.runs import run_contents

    if (real / "meta.json").is_file() or any(_holds_checkpoints(p) for p in (real, *real.parents)):
        raise ConfigError(f"{named}: is a polyrl checkpoint directory, or in a run's checkpoints/; {allowed}")
    if real.is_dir() and run_contents(real):
        raise ConfigError(f"{named}: is a polyrl run directory; {allowed}")
    if real.is_dir() and any(real.iterdir()) and not (real / EXPORT_MARKER).is_file():
        raise ConfigError(f"{named}: is a non-empty directory that is not a previous polyrl export (no "
                          f"{EXPORT_MARKER}); {allowed}, or remove it first")
    return real


def _settle_interrupted_export(out: Path) -> None:
    """What an export killed midway left beside ``out``: its temporary copy (``.OUT.export-*``) is deleted, and a
    previous export it was replacing (``.old_OUT_*``, holding ``EXPORT_MARKER``) is put back when ``out`` is gone,
    else deleted. Later exports used to leave both there, full-size, for good."""
    if not out.parent.is_dir():
        return
    for tmp in out.parent.glob(f".{glob_escape(out.name)}.export-*"):
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
    for old in sorted(out.parent.glob(f".old_{glob_escape(out.name)}_*")):
        if not (old.is_dir() and (old / EXPORT_MARKER).is_file() and old.name[len(out.name) + 6:].isdigit()):
            continue
        if out.exists() or out.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, out)


def export_hf(checkpoint_dir: str | Path, out_dir: str | Path, model_dir: str | Path, *,
              chat_template: str = "auto", template_text: str | None = None) -> Path:
    """Write the policy of a checkpoint (either layout, or a LoRA adapter: merged) as a plain Hugging Face directory
    loadable with ``from_pretrained``: config, generation config and tokenizer from ``model_dir``, weights from the
    checkpoint, and ``EXPORT_MARKER`` (what was exported). Needs no process group (call it on one rank).

    ``chat_template``: the run's setting (``--chat-template``). The tokenizer keeps its own template for auto, takes
    the run's template file's text for a path, and has none for none (the run's prompts were plain text), so that
    the export renders prompts as training did. ``template_text``: that file's text as the run read it (its record
    keeps it), taken before the file, which may have moved or changed since.

    ``out_dir`` must be new, empty or a previous export (``check_export_destination``; a run or checkpoint directory
    is never written). The export is written into a temporary sibling and renamed into place, so a failed export
    leaves ``out_dir`` as it was. A missing or damaged ``model_dir`` is a one-line ``ConfigError`` naming ``model``.
    """
    import tempfile

    from safetensors.torch import load_model as load_weights
    from torch.distributed.checkpoint.api import CheckpointException

    from polyrl.errors import ConfigError
    from polyrl.learner.lora import ADAPTER_DIR, merged_model
    from polyrl.model import check_model_dir, load_error, load_model, load_tokenizer
    from polyrl.tasks.chat import AUTO, read_template

    checkpoint_dir = Path(checkpoint_dir)
    verify_checkpoint(checkpoint_dir)
    _settle_interrupted_export(Path(os.path.abspath(out_dir)))
    out = check_export_destination(checkpoint_dir, out_dir)
    check_model_dir(model_dir)
    tokenizer = load_tokenizer(model_dir)
    if chat_template != AUTO:
        try:
            tokenizer.chat_template = template_text or read_template(chat_template)  # None for none
        except ValueError as e:  # a run recorded before its record kept the text, whose file is gone
            raise ConfigError(f"{e}: the export carries the template the run rendered its prompts with; put the "
                              "file back there") from None
    if (checkpoint_dir / ADAPTER_DIR).is_dir():  # LoRA: the base with the adapter merged into its weights
        try:
            model = merged_model(model_dir, checkpoint_dir / ADAPTER_DIR)
        except Exception as e:  # noqa: BLE001 (a damaged base or one the adapter does not fit)
            raise load_error(model_dir, e) from e
    else:
        model = load_model(model_dir, dtype="auto")
        try:
            if is_sharded(checkpoint_dir):
                sd = {"model": model.state_dict()}
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    dcp.load(sd, checkpoint_id=checkpoint_dir / SHARDS, no_dist=True)
                model.load_state_dict(sd["model"])
            else:
                load_weights(model, str(checkpoint_dir / "model.safetensors"))
        except (Exception, CheckpointException) as e:  # noqa: BLE001 (shapes or names of another architecture)
            first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
            raise ConfigError(f"model = {str(model_dir)!r}: does not fit checkpoint {str(checkpoint_dir)!r} "
                              f"({first}); pass the model the run trained (--model DIR)") from e
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
        mask = os.umask(0)
        os.umask(mask)
        tmp.chmod(0o777 & ~mask)  # mkdtemp's 0700 would keep a serving account from reading the export
    except OSError as e:
        raise ConfigError(f"out = {str(out_dir)!r}: cannot create a directory there ({e})") from None
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / EXPORT_MARKER).write_text(json.dumps(
            {"checkpoint": str(checkpoint_dir.resolve()), "model": str(Path(model_dir).resolve()),
             "chat_template": chat_template}, indent=2))
        check_export_destination(checkpoint_dir, out)  # unchanged while the model was being written
        replace_dir(tmp, out)  # a previous export (or an empty directory) is removed once the new one is in place
    except OSError as e:
        raise ConfigError(f"out = {str(out_dir)!r}: cannot write the export ({e})") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
