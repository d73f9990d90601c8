"""Atomic checkpoints and exact resume.

A checkpoint is a directory ``step_000123/`` holding the model weights (safetensors; shared
tensors such as tied embeddings handled), the optimizer and scheduler states, every RNG state
and the trainer's own state (step, data position, pass-rate history, ...), plus ``meta.json``
with a SHA-256 of each file. It is written into a temporary sibling directory and renamed into
place, so a crash mid-save never leaves a half-written checkpoint under a real name; loading
verifies the checksums and reports a corrupt checkpoint in one line instead of a torch traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_model, save_model

from polyrl.errors import CheckpointError  # re-exported: defined without torch for the CLI

FORMAT = 1
_FILES = ("model.safetensors", "trainer_state.pt")
ADAPTER_DIR = "adapter"  # a LoRA run's policy weights: the PEFT adapter alone (adapter_config.json, adapter_model...)
_STEP_NAME = re.compile(r"step_(\d{6,})")  # what save_checkpoint writes: f"step_{step:06d}"; nothing else is one


def checkpoint_step(path: str | Path) -> int | None:
    """The step of a directory named exactly as ``save_checkpoint`` names one (``step_000123``), else None: a copy
    such as ``step_000123.bak`` or ``superseded_step_000123`` is not a checkpoint of the run."""
    name = Path(path).name
    m = _STEP_NAME.fullmatch(name)
    return int(m.group(1)) if m and name == f"step_{int(m.group(1)):06d}" else None


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's checkpoint directories (``checkpoints/step_NNNNNN``, complete or not), oldest step first."""
    root = Path(run_dir) / "checkpoints"
    found = [p for p in root.iterdir() if p.is_dir() and checkpoint_step(p) is not None] if root.is_dir() else []
    return sorted(found, key=checkpoint_step)


def replace_dir(tmp: Path, final: Path) -> None:
    """Move the complete directory ``tmp`` to ``final``; an existing ``final`` is renamed aside first and deleted
    only once the new one is in place (a crash in between leaves it as ``.old_<name>_<pid>``, which
    ``remove_partial_saves`` puts back), so the old copy is never lost before the new one is complete."""
    old = None
    if final.exists() or final.is_symlink():
        old = final.with_name(f".old_{final.name}_{os.getpid()}")
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        if old.is_symlink() or not old.is_dir():
            old.unlink()
        else:
            shutil.rmtree(old, ignore_errors=True)


def prune_checkpoints(run_dir: str | Path, step: int, keep_last: int) -> None:
    """Keep the newest ``keep_last`` checkpoints up to ``step`` (the one just saved counts); delete older ones. Only
    ``step_NNNNNN`` directories are considered: a backup copy or a set-aside branch is never deleted, nor is the
    checkpoint just saved."""
    if keep_last <= 0:
        return
    older = [p for p in list_checkpoints(run_dir) if checkpoint_step(p) < step]
    for old in older[:max(0, len(older) - (keep_last - 1))]:
        shutil.rmtree(old, ignore_errors=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def rng_state() -> dict[str, Any]:
    """Every RNG the training loop draws from: the GPUs' too once CUDA is in use (dropout of a model on a GPU)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore ``rng_state()``'s generators; the GPUs' where this machine has as many (a GPU run resumed on the CPU
    draws nothing from them)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    state: dict[str, Any] | None = None,
    extra_models: dict[str, torch.nn.Module] | None = None,
    keep_last: int = 2,
    adapters: Any | None = None,
) -> Path:
    """Write ``run_dir/checkpoints/step_{step:06d}`` atomically and prune older ones (keep ``keep_last``).

    ``adapters`` (the PEFT model of a LoRA run): the policy's weights are its adapter alone (``adapter/``, in
    PEFT's format), not ``model.safetensors``: the frozen base is the run's starting model.
    """
    from safetensors import SafetensorError

    final = Path(run_dir) / "checkpoints" / f"step_{step:06d}"
    tmp = final.with_name(f".tmp_step_{step:06d}_{os.getpid()}")
    try:
        _write(tmp, model, optimizer, scheduler, state, extra_models, adapters, step)
    except (OSError, RuntimeError, SafetensorError) as e:  # a full disk, a read-only directory: one line, not a trace
        shutil.rmtree(tmp, ignore_errors=True)
        reason = e.strerror if isinstance(e, OSError) and e.strerror else (str(e).strip().splitlines() or [""])[-1]
        raise CheckpointError(f"checkpoint {final} cannot be written ({type(e).__name__}: {reason}); the earlier "
                              "checkpoints are intact: free space or fix the directory, then --resume") from None
    replace_dir(tmp, final)  # re-saving the same step: the old copy goes only once the new one is in place
    prune_checkpoints(run_dir, step, keep_last)
    return final


def _write(tmp: Path, model, optimizer, scheduler, state, extra_models, adapters, step: int) -> None:
    """Every file of a checkpoint into the fresh directory ``tmp``, its meta.json last."""
    tmp.parent.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    if adapters is not None:
        adapters.save_pretrained(tmp / ADAPTER_DIR)
        files = ["trainer_state.pt", *sorted(str(p.relative_to(tmp)) for p in (tmp / ADAPTER_DIR).rglob("*")
                                            if p.is_file())]
    else:
        save_model(model, str(tmp / "model.safetensors"))
        files = list(_FILES)
    for name, extra in (extra_models or {}).items():
        save_model(extra, str(tmp / f"{name}.safetensors"))
        files.append(f"{name}.safetensors")
    torch.save(
        {
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "rng": rng_state(),
            "state": state or {},
        },
        tmp / "trainer_state.pt",
    )
    meta = {"format": FORMAT, "step": step, "files": {f: _sha256(tmp / f) for f in files}}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """Newest complete checkpoint of a run (temporary directories are ignored), or None."""
    done = [p for p in list_checkpoints(run_dir) if (p / "meta.json").exists()]
    return done[-1] if done else None


def remove_partial_saves(run_dir: str | Path) -> int:
    """Delete the ``.tmp_step_*`` directories of saves that were interrupted; return how many.

    A ``.old_step_*`` directory (a checkpoint being replaced by a save of the same step when the process died) is
    put back under its name when that name is free, and deleted only when the new copy made it into place.
    """
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return 0
    partial = [p for p in root.glob(".tmp_step_*") if p.is_dir()]
    for p in partial:
        shutil.rmtree(p, ignore_errors=True)
    _restore_replaced(root)
    return len(partial)


def _restore_replaced(root: Path) -> None:
    """Put a ``.old_step_*`` directory (left by a process that died while ``replace_dir`` swapped a re-saved step) back
    under its name when that name is free; delete it when the new copy made it into place."""
    for old in sorted(root.glob(".old_step_*")) if root.is_dir() else []:
        m = re.fullmatch(r"\.old_(step_\d{6,})_\d+", old.name)
        if m is None or not old.is_dir():
            continue
        final = root / m.group(1)
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                os.replace(old, final)
            except FileNotFoundError:  # another process of the same run (a --nproc rank) put it back first
                pass


def resume_checkpoint(run_dir: str | Path, resume_from: str | Path | None = None, *,
                      use: str = "resume from it with --resume-from {path}") -> tuple[Path, dict[str, Any]]:
    """The checkpoint a resume starts from (``resume_from``, else the newest) and its verified meta.

    A corrupt newest checkpoint is not skipped silently: the error names the newest intact one and how to ``use``
    it (the caller's command: a resume, an export).
    """
    root = Path(run_dir) / "checkpoints"
    if resume_from is not None:
        path = Path(resume_from)
        inside = path.absolute().parent.resolve() == root.resolve()
        if not inside or checkpoint_step(path) is None:
            raise CheckpointError(
                f"resume_from = {str(resume_from)!r} is not a checkpoint of run_dir = {str(run_dir)!r}; allowed: "
                f"a directory {root}/step_NNNNNN (a resume continues this run; to train from another run's "
                "weights, export them with `polyrl export` and start a new run with --model)")
        return path, verify_checkpoint(path)  # which also holds its meta.json's step to its name
    _restore_replaced(root)  # a step whose re-save was interrupted mid-swap is still the run's
    found = list_checkpoints(run_dir)[::-1]
    if not found:
        raise CheckpointError(f"run_dir = {str(run_dir)!r} has no checkpoint to resume from")
    try:
        meta = verify_checkpoint(found[0])
    except CheckpointError as e:
        for older in found[1:]:
            try:
                verify_checkpoint(older)
            except CheckpointError:
                continue
            raise CheckpointError(f"{e}; the newest intact checkpoint is {older}: {use.format(path=older)}") from None
        raise CheckpointError(f"{e}; no older intact checkpoint in {root}") from None
    return found[0], meta


def set_aside_newer(run_dir: str | Path, step: int) -> list[Path]:
    """Rename the checkpoints newer than ``step`` to ``superseded_step_*`` (kept, never loaded again).

    A run resumed from an older checkpoint (``--resume-from``, or past a corrupt newest one) branches there: a
    later resume, a guard rollback or the pruning of old checkpoints must not pick up the abandoned branch.
    """
    root = Path(run_dir) / "checkpoints"
    moved = []
    for p in list_checkpoints(run_dir):
        if checkpoint_step(p) > step:
            target = root / f"superseded_{p.name}"
            n = 1
            while target.exists():
                target, n = root / f"superseded_{p.name}.{n}", n + 1
            os.replace(p, target)
            moved.append(target)
    return moved


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check that ``path`` is a complete, uncorrupted checkpoint; return its meta or raise CheckpointError."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint {path} has no readable meta.json ({e.__class__.__name__}); it is incomplete or corrupt"
        ) from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {path}: meta.json holds a {type(meta).__name__}, not an object with "
                              "format, step and files; it is corrupt")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {meta.get('format')!r}; this polyrl reads format {FORMAT}")
    step, files = meta.get("step"), meta.get("files")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"checkpoint {path}: meta.json has step = {step!r}; allowed: an integer >= 0 "
                              "(it is corrupt)")
    if not isinstance(files, dict) or not files or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise CheckpointError(f"checkpoint {path}: meta.json has files = {_short(files)}; allowed: an object of "
                              "file name -> SHA-256 (it is corrupt)")
    # meta.json lists what it holds; what every checkpoint must hold is not left to it (an edited list hid a
    # deleted trainer_state.pt or a truncated model until the load failed in a traceback)
    weights = ("model.safetensors", f"{ADAPTER_DIR}/adapter_model.safetensors", "dcp/.metadata")  # by layout
    for needed in (("trainer_state.pt",), weights):
        if not any(n in files for n in needed):
            raise CheckpointError(f"checkpoint {path}: meta.json lists no {' or '.join(needed)}; it is incomplete or "
                                  "corrupt")
    named = re.fullmatch(r"step_(\d{6,})", path.name)
    if named and int(named.group(1)) != step:
        raise CheckpointError(f"checkpoint {path}: its meta.json says step {step}, its name step "
                              f"{int(named.group(1))}; it was renamed, copied or edited, so it cannot be used")
    for name, digest in files.items():
        f = path / name
        if not f.exists():
            raise CheckpointError(f"checkpoint {path} is missing {name}")
        if _sha256(f) != digest:
            raise CheckpointError(f"checkpoint {path}: {name} does not match its checksum (corrupt or modified)")
    return meta


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def load_checkpoint(
    path: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    extra_models: dict[str, torch.nn.Module] | None = None,
    restore_rng: bool = True,
    adapters: Any | None = None,
) -> dict[str, Any]:
    """Restore everything saved by ``save_checkpoint`` in place; return the trainer's ``state`` dict."""
    path = Path(path)
    meta = verify_checkpoint(path)
    saved_adapter = f"{ADAPTER_DIR}/adapter_model.safetensors" in meta["files"]
    if saved_adapter != (adapters is not None):
        held, wanted = ("a LoRA adapter", "a full model") if saved_adapter else ("full weights", "LoRA adapters")
        raise CheckpointError(f"checkpoint {path} holds {held}, but this run trains {wanted} (lora_rank differs)")
    if adapters is not None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        result = set_peft_model_state_dict(adapters, load_file(str(path / ADAPTER_DIR / "adapter_model.safetensors")))
        if getattr(result, "unexpected_keys", None):
            raise CheckpointError(f"checkpoint {path}: its adapter does not fit this model (unexpected: "
                                  f"{', '.join(result.unexpected_keys[:3])})")
    else:
        load_model(model, str(path / "model.safetensors"))
    for name, extra in (extra_models or {}).items():
        if f"{name}.safetensors" not in meta["files"]:
            raise CheckpointError(f"checkpoint {path} has no {name} weights")
        load_model(extra, str(path / f"{name}.safetensors"))
    # on the CPU: a GPU run's optimizer state resumes on a machine without one (load_state_dict moves it to the
    # parameters' device)
    blob = torch.load(path / "trainer_state.pt", weights_only=False, map_location="cpu")
    if optimizer is not None and blob["optimizer"] is not None:
        optimizer.load_state_dict(blob["optimizer"])
    if scheduler is not None and blob["scheduler"] is not None:
        scheduler.load_state_dict(blob["scheduler"])
    if restore_rng:
        set_rng_state(blob["rng"])
    return blob["state"]
