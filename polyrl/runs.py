"""A run directory's record: the settings it started with, what a resume changed, and logs cut back to a checkpoint.

``config.json`` is written once, when a run starts, and never overwritten: it is the record of the
run's own settings. ``polyrl train --run-dir X --resume`` continues with exactly those; a flag given
with ``--resume`` that differs from the saved value is refused with one line naming both values,
except the few in ``RESUME_MAY_CHANGE`` (extending a run, logging cadence, threads, where it runs), whose changes are
appended to ``config_history.jsonl`` with the step they took effect at. After a kill, the logs hold
steps that the checkpoint does not: ``cut_logs`` drops them, so no step appears twice.

The directory's life is here too: ``new_run`` (and the train command through the same primitives) starts a run only
in an empty directory or beside the command's own inputs (``refuse_foreign``), sets an old run aside for
``--overwrite`` and puts it back when the new one never started, and ``signals_unwind`` makes SIGTERM unwind
like Ctrl-C so that this happens.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

from polyrl.errors import ConfigError, Terminated

CONFIG = "config.json"
HISTORY = "config_history.jsonl"
LOGS = ("metrics.jsonl", "samples.jsonl")  # JSON lines with a "step" key

# Settings a resume may change: they extend the run, change how it is watched or where it runs (processes, rollout
# workers, the device: batches and gradients do not depend on them, up to a device's float rounding), not what it
# computes.
RESUME_MAY_CHANGE = ("steps", "eval_every", "checkpoint_every", "log_every", "threads", "tensorboard", "wandb",
                     "max_bad_steps", "nproc", "device", "rollout_workers", "ray_address", "ray_cpus",
                     "rollout_worker_gpus")
# Run control, not settings: never compared.
RUN_CONTROL = ("resume", "resume_from", "overwrite", "run_dir")


def saved_record(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's ``config.json`` ({"config", "method", "overrides"}), or None when it has none.

    A ``config.json`` that is not a run record (not an object with a "config" object: say a model's config written
    over it) raises ConfigError naming the file: the run's settings are unknown, and defaults must not stand in.
    """
    path = Path(run_dir) / CONFIG
    if not path.is_file():
        return None
    record = read_json(path, f"run_dir = {str(run_dir)!r}: ", "the run's settings are unknown, so it cannot be resumed")
    problem = _record_problem(record)
    if problem:
        raise ConfigError(f"run_dir = {str(run_dir)!r}: {path} is not a polyrl run record ({problem}); the run's "
                          "settings are unknown: it cannot be resumed (an export needs --model DIR)")
    return record


def read_json(path: Path, where: str, consequence: str) -> Any:
    """``path``'s JSON, or a one-line ConfigError: ``where`` + the file and why it cannot be read + ``consequence``."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:  # a missing/unreadable file, not UTF-8, or not JSON (cut short by a kill)
        why = f"{type(e).__name__}: {str(e).splitlines()[0]}" if str(e) else type(e).__name__
        raise ConfigError(f"{where}{path} cannot be read ({why}); {consequence}") from None


def _record_problem(record: Any) -> str:
    """Why ``record`` is not the shape ``write_record`` writes ("" when it is)."""
    if not isinstance(record, dict):
        return f"it holds a {type(record).__name__}, not an object"
    if not isinstance(record.get("config"), dict):
        return 'it has no "config" object' if "config" not in record else \
            f'its "config" is a {type(record["config"]).__name__}, not an object'
    if record.get("overrides") is not None and not isinstance(record["overrides"], dict):
        return f'its "overrides" is a {type(record["overrides"]).__name__}, not an object'
    return ""


def run_contents(run_dir: str | Path) -> list[str]:
    """What in ``run_dir`` shows that it holds a polyrl run: a run record ``config.json`` (an object with a "config"
    object), ``metrics.jsonl`` of step rows, a ``summary.json`` object, ``checkpoints/`` with ``step_NNNNNN`` saves.
    Empty when none (a model directory's config.json, for one, does not count)."""
    run = Path(run_dir)
    found = []
    try:
        if not _record_problem(json.loads((run / CONFIG).read_text())):
            found.append(CONFIG)
    except (OSError, ValueError):
        pass
    try:
        with open(run / "metrics.jsonl") as f:
            first = f.readline()
        row = json.loads(first) if first.strip() else None
        if isinstance(row, dict) and "step" in row:
            found.append("metrics.jsonl")
    except (OSError, ValueError):
        pass
    try:
        if isinstance(json.loads((run / "summary.json").read_text()), dict):
            found.append("summary.json")
    except (OSError, ValueError):
        pass
    ckpts = run / "checkpoints"
    if ckpts.is_dir() and any(p.is_dir() and re.fullmatch(r"(\.tmp_|\.old_|superseded_)?step_\d{6,}.*", p.name)
                              for p in ckpts.iterdir()):
        found.append("checkpoints/")
    return found


def files_line(run_dir: str | Path) -> str:
    """``run files: DIR/ (a, b, tb/)``: what the run wrote in ``run_dir``, read from the directory (a fixed list
    named ``tb/`` after `--no-tensorboard` and ``checkpoints/`` before the first save); hidden names left out."""
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in Path(run_dir).iterdir() if not p.name.startswith("."))
    return f"run files: {run_dir}/ ({', '.join(names)})"


def clear_run_dir(run_dir: str | Path, *, inputs: dict[str, Any] | None = None) -> None:
    """Delete ``run_dir`` for ``--overwrite``: only an empty directory or one that holds a polyrl run (``run_contents``)
    is cleared; anything else (a directory of other files, a folder of several runs, a file, the current directory
    or one above it, one holding a file this command reads: ``inputs``, setting name -> value, where a string value
    may name paths, also as ``a,b`` or ``path:function``) is refused in one line naming run_dir and what it holds,
    and nothing is deleted."""
    import shutil

    if replaceable(run_dir, inputs=inputs):
        shutil.rmtree(run_dir)


# `polyrl train --overwrite` does not delete the old run before the new one can be refused (a setting checked while
# the model loads): ``set_aside_run`` moves it to a hidden sibling, the trainer calls ``drop_replaced`` once its parts
# are built, and ``settle_replaced`` puts it back when the command ended before that. ``recover_replaced`` finishes
# the job of a command that was killed in between.
def aside_path(run_dir: str | Path) -> Path:
    """Where ``--overwrite`` keeps the old run until the new one has started: ``.NAME.replaced`` beside it (a long
    name is cut and tagged with its hash, so the hidden name stays within the file system's limit)."""
    return _beside(run_dir, "replaced")


def _beside(run_dir: str | Path, what: str) -> Path:
    """``.NAME.WHAT`` beside the run directory NAME (a long name cut and tagged with its hash)."""
    run = Path(run_dir)
    if run.name in ("", ".", ".."):  # '.': beside the directory it means, not inside it
        run = run.resolve()
    name = run.name
    if len(name.encode()) > 200:
        import hashlib

        name = f"{name.encode()[:160].decode(errors='ignore')}-{hashlib.sha256(name.encode()).hexdigest()[:12]}"
    return run.parent / f".{name}.{what}"


@contextlib.contextmanager
def run_lock(run_dir: str | Path, option: str = "run_dir") -> Iterator[None]:
    """Hold the run directory for one command: another polyrl command on it meanwhile is refused in one line (two
    writers interleaved one run's metrics and checkpoints, and one's --overwrite or --resume moved files under the
    other). The hold is an ``flock`` on ``.NAME.lock`` beside the directory, which --overwrite's renames leave in
    place; the kernel lets go of it when the process ends, however it ends (a killed command leaves at most an
    unlocked file, which the next command takes over), and the file is removed when the command ends. A lock taken on
    a file that was removed meanwhile is taken again on the new one. Where the lock file cannot be made (a read-only
    folder), nothing is held."""
    import fcntl

    lock = _beside(Path(run_dir).resolve(), "lock")  # one lock however the directory is named (a symlink to it)
    made = missing_folders(lock.parent)
    while True:
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(f"{option} = '{run_dir}' is in use by another polyrl command (it holds {str(lock)!r}); "
                              "let it finish or stop it, or choose another directory") from None
        try:
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                break  # the file still at that name: held
        except FileNotFoundError:
            pass
        os.close(fd)  # its holder removed it as it ended: take the new one
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            lock.unlink()
        os.close(fd)
        remove_empty(made)  # made only to hold the lock (a refused command)


@contextlib.contextmanager
def resume_hold(run_dir: str | Path | None) -> Iterator[None]:
    """A family ``--resume``'s hold on its run (``run_lock``), taken before the run is read, with SIGTERM unwinding;
    ``None`` (a new run, which ``new_run`` holds, or no run directory given) holds nothing."""
    if run_dir is None:
        yield
        return
    with signals_unwind(), run_lock(run_dir):
        yield


def _deleting(aside: Path) -> Path:
    """Where an old run goes while it is deleted: a name recovery never puts back (a half-deleted run is no run)."""
    return aside.with_name(aside.name + ".deleting")


def set_aside_run(run_dir: str | Path) -> Path:
    """Move the old run in ``run_dir`` (``replaceable`` said there is one) to ``aside_path``; return that path.
    Something already at that path, or a move the file system refuses, is a one-line ConfigError, and the old run
    stays where it was."""
    run, aside = Path(run_dir), aside_path(run_dir)
    if aside.exists() or aside.is_symlink():  # recover_replaced has put back or dropped any run of ours there
        raise ConfigError(f"run_dir = {str(run_dir)!r}: --overwrite sets the old run aside as {str(aside)!r}, which "
                          "already exists and is not a run it set aside: move it, or choose another --run-dir")
    try:
        run.rename(aside)
    except OSError as e:
        raise ConfigError(f"run_dir = {str(run_dir)!r}: --overwrite cannot set the old run aside as {aside.name} "
                          f"({e.strerror or e}); it is unchanged: choose another --run-dir") from None
    return aside


def drop_replaced(aside: Path | None) -> None:
    """Delete the old run set aside for ``--overwrite``: the new run has started (its parts are built). It is renamed
    out of recovery's reach first, so an interrupted deletion never comes back as a half-deleted run."""
    if aside is None or not aside.is_dir() or aside.is_symlink():
        return
    doomed = _deleting(aside)
    remove_path(doomed)
    aside.rename(doomed)
    remove_path(doomed)


def run_started(run_dir: str | Path, existing: Collection[str] = ()) -> bool:
    """Whether a new run in ``run_dir`` got past building its parts: it wrote more than its ``config.json``
    (``existing``: names that were there before it, such as its own ``--config`` TOML, do not count)."""
    run = Path(run_dir)
    return run.is_dir() and any(p.name != CONFIG and p.name not in existing for p in run.iterdir())


def forget_unstarted(run_dir: str | Path, *, created: bool, existing: Collection[str] = ()) -> None:
    """A new run stopped before it started (``run_started``) wrote only its config.json: remove it, and the
    directory if the command made it and it is empty, so that the corrected command is not refused as a rerun."""
    run = Path(run_dir)
    if run.is_dir() and not run_started(run, existing):
        (run / CONFIG).unlink(missing_ok=True)
        if created and not any(run.iterdir()):
            run.rmdir()


def settle_replaced(run_dir: str | Path, aside: Path | None) -> bool:
    """At the end of a ``train --overwrite`` command: when the old run is still set aside and the new run did not
    start, remove what it wrote (its ``config.json``) and put the old run back (True); when it started, delete the
    old run (False). Nothing to do: False."""
    if aside is None or not aside.is_dir() or aside.is_symlink():
        return False
    run = Path(run_dir)
    if run_started(run):
        drop_replaced(aside)
        return False
    if run.is_dir():
        (run / CONFIG).unlink(missing_ok=True)
        run.rmdir()
    aside.rename(run)
    return True


def recover_replaced(run_dir: str | Path) -> str | None:
    """Finish a ``train --overwrite`` that was killed (SIGKILL, out of memory) while the old run was set aside: put it
    back when ``run_dir`` holds no started run, drop it when it holds the polyrl run that replaced it, refuse in one
    line when it holds something else. Returns a line saying what was done, or None when there was nothing to do."""
    aside, run = aside_path(run_dir), Path(run_dir)
    try:
        remove_path(_deleting(aside))  # an old run whose deletion was interrupted
        if not aside.is_dir() or aside.is_symlink():
            return None
        if not run_started(run):
            settle_replaced(run, aside)
            return f"put back the run in {run_dir}: an earlier --overwrite stopped before its new run started"
        if not run_contents(run):
            raise ConfigError(f"run_dir = {str(run_dir)!r}: an earlier --overwrite left the old run in {str(aside)!r} "
                              f"and {str(run_dir)!r} now holds files that are no polyrl run; move one of them")
        drop_replaced(aside)
        return f"deleted the run that an earlier --overwrite of {run_dir} had replaced (left in {aside.name})"
    except OSError as e:
        raise ConfigError(f"run_dir = {str(run_dir)!r}: an earlier --overwrite left the old run in {str(aside)!r}, "
                          f"which cannot be put back or deleted ({e.strerror or e}); move it by hand") from None


def remove_path(path: Path) -> None:
    """Delete a file, a symlink or a folder with what it holds; nothing there: nothing to do."""
    import shutil

    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def nested_runs(run: Path) -> list[str]:
    """The runs below ``run`` at any depth (``run_contents``; a compare's sit two folders down, and a run may have
    been started inside a checkpoint or tb/), as paths relative to it; symlinks are not followed."""
    def unreadable(e: OSError) -> None:  # a run inside it could not be seen
        raise ConfigError(f"run_dir = {str(run)!r}: {e.filename} cannot be listed ({e.strerror}); --overwrite clears "
                          "only what it can check: fix its permissions or choose another --run-dir")

    found = []
    for here, folders, _ in os.walk(run, onerror=unreadable):
        where = Path(here)
        if where != run and run_contents(where):
            found.append(str(where.relative_to(run)))
            folders.clear()  # its own insides are that run's
    return sorted(found)


# What a run (train or a family's) writes in its directory, figures included (a user's own figure is not one); an
# interrupted write leaves .tmp.
RUN_OUTPUTS = frozenset({CONFIG, HISTORY, "metrics.jsonl", "samples.jsonl", "summary.json", "errors.log", "tb",
                         "checkpoints", "checkpoint.pt", "checkpoint.pkl", "curves.png", "samples.png"})


def _run_output(name: str) -> bool:
    return name in RUN_OUTPUTS or (name.endswith(".tmp") and name[:-4] in RUN_OUTPUTS)


def replaceable(run_dir: str | Path, *, inputs: dict[str, Any] | None = None) -> bool:
    """Whether ``--overwrite`` has a run to remove in ``run_dir`` (False: no directory, or an empty one); what it must
    not remove (see ``clear_run_dir``) is refused in one line naming run_dir."""
    run = Path(run_dir)
    if not run.exists() and not run.is_symlink():
        return False
    if run.is_symlink() or not run.is_dir():
        raise ConfigError(f"run_dir = {str(run)!r} is {'a symlink' if run.is_symlink() else 'a file'}, not a run "
                          "directory; --overwrite clears only a run directory: choose another --run-dir")
    entries = sorted(p.name for p in run.iterdir())
    if not entries:
        return False
    here = Path.cwd().resolve()
    if run.resolve() == here or run.resolve() in here.parents:
        raise ConfigError(f"run_dir = {str(run)!r} is the current directory or one above it; --overwrite "
                          "will not delete it: choose another --run-dir")
    root = run.resolve()
    for name, value, where in _input_paths(inputs):
        if where == root or root in where.parents:
            raise ConfigError(f"run_dir = {str(run)!r} holds {name} = {str(value)!r}, which this run reads; "
                              "--overwrite will not delete it: move it out or choose another --run-dir")
    held = run_contents(run)
    nested = nested_runs(run) if held else []  # no run here: refused whatever lies below
    added = [e for e in entries if not _run_output(e)] if held and not nested else []
    if added:  # a user's notes, an analysis folder, an export put inside: deleted with the run before
        raise ConfigError(f"run_dir = {str(run)!r} holds a polyrl run and {len(added)} entr"
                          f"{'y' if len(added) == 1 else 'ies'} no run writes ({', '.join(added[:4])}"
                          f"{', ...' if len(added) > 4 else ''}); --overwrite would delete them with it: move them "
                          "out or choose another --run-dir")
    if held and not nested:
        return True
    what = f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'} ({', '.join(entries[:4])}" + \
        (", ...)" if len(entries) > 4 else ")")
    why = f"other runs in {', '.join(nested[:3])}" if nested else "no polyrl run"
    raise ConfigError(f"run_dir = {str(run)!r} holds {what} and {why}; --overwrite clears only an empty "
                      "directory or a single polyrl run (config.json with a \"config\" object, metrics.jsonl, "
                      "summary.json, checkpoints/step_*): move those files or choose another --run-dir")


def memory_bytes() -> int:
    """The memory this process may use: the machine's physical memory, or its cgroup's limit when lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def check_fits(needs: dict[str, float]) -> None:
    """Refuse (ConfigError, a ValueError: one line) sizes whose work would hold more memory at once than this machine
    has, where the kernel's OOM killer would end the process with no message. ``needs`` maps what the refusal names (the
    settings and their values, e.g. ``'groups x group_size = 200000 segments'``) to the bytes it would hold, an
    estimate from bytes per unit measured on the family's own loop (a family's constants say where they come from).
    """
    have = memory_bytes()
    for what, need in needs.items():
        if need > have:
            raise ConfigError(f"{what} is not allowed here: it would hold about {need / 2**30:,.1f} GiB at once (an "
                             f"estimate), more than the {have / 2**30:,.1f} GiB of memory of this machine; lower it")


def missing_folders(path: str | Path) -> list[Path]:
    """The folders of ``path``, itself included, that do not exist yet, deepest first (``remove_empty`` takes them
    back)."""
    where = Path(path)
    return [p for p in (where, *where.parents) if not p.exists()]


def remove_empty(folders: list[Path]) -> None:
    """Remove the ``folders`` (deepest first, ``missing_folders``) a command made and left empty; stop at the first
    that holds something."""
    for folder in folders:
        try:
            folder.rmdir()
        except FileNotFoundError:  # never made (the command stopped before)
            continue
        except OSError:
            break


MAX_SEEDS = 1000  # seeds of a report or comparison, each one training run per method


def cores() -> int:
    """The cores this process may run on: its CPU affinity (a cpuset from taskset, Slurm or docker --cpuset-cpus),
    not every core of the machine, so that threads sized from it never oversubscribe the cores it was given."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no affinity on this platform (macOS)
        return os.cpu_count() or 1


def max_threads() -> int:
    """The most CPU threads a command may ask for: 4 per core. More only oversubscribe the cores (duplex at 2,000
    threads on 2 cores ran 7x slower than at 64), and tens of thousands failed to start or crashed the process."""
    return 4 * cores()


def check_out_dir(path: str | Path, option: str = "--out", *, try_making: bool = True) -> None:
    """Refuse, in one line, an output directory that is a file or lies under one (it failed with a traceback after
    the work was done, or before it with a file-system error), or, with ``try_making``, one that cannot be made
    (the folders made to find out are removed again; `train` leaves this out: its ranks of one run would race,
    and it refuses an uncreatable run_dir itself)."""
    if not str(path).strip():
        raise ConfigError(f"{option} = {str(path)!r} is not allowed: an empty path; give a directory (or leave it "
                          "out for the default)")
    where = Path(path)
    long = next((part for part in where.parts if len(part.encode()) > 255), None)
    if long is not None:  # the file system's limit: it failed as "File name too long" deep inside the command
        raise ConfigError(f"{option} = {str(path)[:60]!r}... is not allowed: a name in it is {len(long.encode())} "
                          "bytes long; allowed: names of at most 255 bytes")
    blocker = next((p for p in [where, *where.parents] if p.exists() or p.is_symlink()), None)
    if blocker is not None and not blocker.is_dir():
        raise ConfigError(f"{option} = {str(path)!r} is not allowed: {str(blocker)!r} is a file, not a directory")
    if not try_making:
        return
    made = missing_folders(where)
    try:  # one that cannot be made (a read-only or virtual file system) failed in a traceback later
        where.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{option} = {str(path)!r} cannot be created: {e.strerror or e}") from None
    remove_empty(made)  # made again when the command writes into it


def _input_paths(inputs: dict[str, Any] | None) -> list[tuple[str, Any, Path]]:
    """(setting, value, resolved path) of every existing path a command's settings name: a string value may name
    paths, also as ``a,b`` or ``path:function``."""
    found = []
    for name, value in (inputs or {}).items():
        if name in RUN_CONTROL:
            continue
        pieces = [value, *str(value).split(",")] if isinstance(value, (str, Path)) else []
        for piece in {q for p in pieces for q in (str(p).strip(), str(p).strip().rpartition(":")[0]) if q}:
            where = Path(piece).expanduser()
            if where.exists():
                found.append((name, value, where.resolve()))
    return found


def refuse_foreign(run_dir: str | Path, *, inputs: dict[str, Any] | None = None) -> None:
    """A new run (no ``--overwrite``) does not start in a directory of files that are no polyrl run (a later
    ``--overwrite`` would delete them with it): one line naming them. Files the command reads (``inputs``, e.g. its
    ``--config`` TOML) may be there."""
    run = Path(run_dir)
    if not run.is_dir() or run_contents(run):
        return
    read = [where for _, _, where in _input_paths(inputs)]
    foreign = sorted(p.name for p in run.iterdir()
                     if not any(w == p.resolve() or p.resolve() in w.parents for w in read))
    if foreign:
        raise ConfigError(f"run_dir = {str(run)!r} holds {len(foreign)} entr{'y' if len(foreign) == 1 else 'ies'} "
                          f"({', '.join(foreign[:4])}{', ...' if len(foreign) > 4 else ''}) and no polyrl run; a run "
                          "there would be mixed with them (and --overwrite would delete them with it): choose an "
                          "empty or new --run-dir")


def write_record(run_dir: str | Path, record: dict[str, Any]) -> None:
    """Write ``config.json`` for a new run; an existing one is the record of another run and is kept."""
    path = Path(run_dir) / CONFIG
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str))


def start_run_dir(run_dir: str | Path, *, overwrite: bool, inputs: dict[str, Any] | None = None) -> Path:
    """A directory for a new run: one that already holds a run is refused unless ``overwrite`` (then cleared, if
    ``clear_run_dir`` finds a polyrl run or nothing in it and no file of ``inputs``, the command's settings;
    anything else is refused, never deleted)."""
    run = Path(run_dir)
    if run.exists() and not run.is_dir():
        raise ConfigError(f"run_dir = '{run}' is a file, not a directory; choose another --run-dir")
    if overwrite:
        clear_run_dir(run, inputs=inputs)
    elif (run / "metrics.jsonl").exists() or (run / "summary.json").exists() or (run / CONFIG).exists():
        raise ConfigError(f"run_dir = '{run}' already holds a run; pass --overwrite or another --run-dir")
    run.mkdir(parents=True, exist_ok=True)
    return run


@contextlib.contextmanager
def new_run(run_dir: str | Path, *, overwrite: bool, inputs: dict[str, Any] | None = None,
            record: dict[str, Any] | None = None) -> Iterator[Path]:
    """``start_run_dir`` for a command whose run starts inside the block (the family commands), without losing the
    old run: a copy an earlier killed command left aside is recovered first (``recover_replaced``); ``overwrite``
    sets the old run aside (``set_aside_run``) instead of deleting it. When the block ends -- returned, refused,
    Ctrl-C, SIGTERM -- a new run that started (it wrote more than its ``config.json``) stays and the old one is
    deleted; one that did not is removed (its ``config.json``, the directory if the block made it) and the old run
    is put back, so the same command can simply be run again. ``record``: the run's ``config.json``
    (``write_record``), written before the block runs. The command holds the directory throughout (``run_lock``)."""
    run = Path(run_dir)
    with signals_unwind(), run_lock(run):
        recover_noted(run)
        if run.exists() and not run.is_dir():
            raise ConfigError(f"run_dir = '{run}' is a file, not a directory; choose another --run-dir")
        if not overwrite and any((run / name).exists() for name in ("metrics.jsonl", "summary.json", CONFIG)):
            raise ConfigError(f"run_dir = '{run}' already holds a run; pass --overwrite or another --run-dir")
        if not overwrite:
            refuse_foreign(run, inputs=inputs)
        aside = set_aside_run(run) if overwrite and replaceable(run, inputs=inputs) else None
        created = not run.exists()
        existing: set[str] = set()
        try:
            try:
                run.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ConfigError(f"run_dir = '{run}' cannot be created: {e.strerror or e}") from None
            existing = {p.name for p in run.iterdir()}  # the command's own inputs (refuse_foreign let only those)
            if record is not None:
                write_record(run, record)
            yield run
        finally:
            _settle_new_run(run, aside, created, existing)


def recover_noted(run_dir: str | Path) -> None:
    """``recover_replaced``, saying on stderr what it did: before a family command's ``--resume`` reads the run."""
    if (note := recover_replaced(run_dir)) is not None:
        print(f"polyrl: {note}", file=sys.stderr)


def _settle_new_run(run: Path, aside: Path | None, created: bool, existing: Collection[str]) -> None:
    """The end of ``new_run``: keep a started run (deleting the old one), else forget the new one and put the old one
    back; a file system that refuses is a warning line that lets the command's own outcome stand."""
    try:
        if aside is not None and aside.is_dir() and not aside.is_symlink():
            if settle_replaced(run, aside):
                print(f"polyrl: the new run in {run} did not start; the old run there is as it was", file=sys.stderr)
        else:
            forget_unstarted(run, created=created, existing=existing)
    except OSError as e:
        where = f"; the old run is still in {aside}" if aside is not None and aside.exists() else ""
        print(f"polyrl: warning: {run} could not be settled ({e.strerror or e}){where}", file=sys.stderr)


@contextlib.contextmanager
def signals_unwind() -> Iterator[None]:
    """SIGTERM and SIGHUP raise ``Terminated(128 + signal)`` (a SystemExit) while the command runs, so that its
    ``finally`` blocks run (as they do on Ctrl-C) instead of the process vanishing mid-way; a signal someone set to
    be ignored (nohup) or handled stays so. Every handler the command may change (torch.distributed.run's launcher
    sets SIGINT, SIGQUIT, SIGTERM and SIGHUP) comes back after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, _frame):
        raise Terminated(128 + signum)

    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGHUP)}
    for s in (signal.SIGTERM, signal.SIGHUP):
        if previous[s] == signal.SIG_DFL:
            signal.signal(s, stop)
    try:
        yield
    finally:
        for s, handler in previous.items():
            if handler is not None:  # None: set outside Python, not restorable from here
                signal.signal(s, handler)


def unreadable(run_dir: str | Path, name: str, e: BaseException) -> ConfigError:
    """The one-line error for a run's checkpoint file ``name`` that cannot be read back (cut short by a kill, or not
    this family's checkpoint)."""
    why = f"{type(e).__name__}: {str(e).splitlines()[0]}" if str(e) else type(e).__name__
    return ConfigError(f"run_dir = '{run_dir}': {name} cannot be read ({why}); it cannot be resumed")


def check_resume_steps(steps: int, done: int, run_dir) -> None:
    """Refuse ``steps`` below the step of the checkpoint being resumed: the run would end with more rows logged than
    its summary's steps say (and a policy trained longer than recorded)."""
    if steps < done:
        raise ConfigError(f"steps = {steps} is not allowed; allowed: >= {done}, the step of the checkpoint being "
                          f"resumed in '{run_dir}'")


def resume_values(saved: dict[str, Any], given: dict[str, Any], *, what: str = "") -> tuple[dict, dict]:
    """Merge settings ``given`` with ``--resume`` into the run's ``saved`` ones.

    Returns (values, changes): the saved values with the allowed changes applied, and {name: [old, new]}.
    A differing value outside ``RESUME_MAY_CHANGE`` raises ConfigError naming both values.
    """
    # How to run this command (resume, overwrite, run_dir) is never the run's: the record's values are dropped.
    values = {k: v for k, v in saved.items() if k not in RUN_CONTROL}
    values.update({k: v for k, v in given.items() if k in RUN_CONTROL})
    changes = {}
    for name, new in given.items():
        if name in RUN_CONTROL or new is None:
            continue
        old = saved.get(name)
        if same_setting(name, old, new):
            continue
        if name not in RESUME_MAY_CHANGE:
            may = [k for k in RESUME_MAY_CHANGE if k in saved]  # this command's own (q has no nproc)
            raise ConfigError(f"{name} = {new!r} differs from the run's own {name} = {old!r}{what}; a resume keeps "
                              f"the run's settings (may change: {', '.join(may)}); drop the flag, or "
                              "start a new run with another --run-dir")
        values[name], changes[name] = new, [old, new]
    return values, changes


# Settings that name files or directories: recorded absolute (``absolute_paths``), so that a run started with
# ``--data-file ok.jsonl`` resumes from any directory, and compared as paths.
PATH_SETTINGS = ("model", "data_file", "teacher", "agency", "chat_template", "preference_file", "reward_funcs")


def absolute_paths(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with each path setting that names an existing file or directory made absolute (``reward_funcs``
    piece by piece, ``FILE.py:function`` keeping its function); a name that is none (a module, ``auto``) stays."""
    out = dict(values)
    for name in PATH_SETTINGS:
        value = out.get(name)
        if isinstance(value, str) and value.strip():
            pieces = value.split(",") if name == "reward_funcs" else [value]
            out[name] = ",".join(_absolute(piece, function=name == "reward_funcs") for piece in pieces)
    return out


def _absolute(text: str, *, function: bool = False) -> str:
    """An existing path made absolute, or with ``function`` (a reward spec) the ``FILE.py`` of ``FILE.py:function``;
    anything else (a ``module:function``, even beside a folder of that name) and the words that name no path
    (``auto``, ``none``, ``task``) as it was."""
    if text.strip() in ("auto", "none", "task"):
        return text
    head, colon, name = text.rpartition(":")
    path, rest = (head, colon + name) if function else (text, "")
    if path and (not function or path.endswith(".py")) and Path(path).expanduser().exists():
        return str(Path(path).expanduser().resolve()) + rest
    return text


def same_setting(name: str, saved: Any, new: Any) -> bool:
    """Whether a run's recorded setting ``name`` is ``new``: equal values, or for a path setting the same path (a run
    recorded with relative paths, read from the directory it started in)."""
    return same_value(saved, new) or (name in PATH_SETTINGS and same_value(absolute_paths({name: saved})[name], new))


def same_value(a: Any, b: Any) -> bool:
    """Whether two settings' values are equal (an int and a float of one value are)."""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def record_resume(run_dir: str | Path, step: int, checkpoint: str, changes: dict[str, list]) -> None:
    """Append one line to ``config_history.jsonl``: when, from which checkpoint, what changed."""
    line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "resumed_at_step": step, "checkpoint": checkpoint,
            "changes": changes}
    path = Path(run_dir) / HISTORY
    text = path.read_text() if path.is_file() else ""
    if text and not text.endswith("\n"):  # a line cut short by a kill: never glue this one onto it
        head, _, tail = text.rpartition("\n")
        try:
            json.loads(tail)
            text += "\n"
        except ValueError:
            text = head + "\n" if head else ""
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    with open(path, "a") as f:
        f.write(json.dumps(line, default=str) + "\n")


def effective_config(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's settings as they stand now: ``config.json`` with every recorded resume change applied (what the
    next resume continues with, so that ``--steps`` extended once stays extended)."""
    record = saved_record(run_dir)
    if record is None:
        return None
    config = dict(record["config"])
    for changes in _history_changes(run_dir):
        config.update(changes)
    return config


def _history_changes(run_dir: str | Path) -> list[dict[str, Any]]:
    """Each resume's changes in ``config_history.jsonl`` as {name: new value}. A last line cut short by a kill is
    skipped (that resume never started: it is appended before training); any other damage raises ConfigError
    naming the file and line."""
    path = Path(run_dir) / HISTORY
    if not path.is_file():
        return []
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"run_dir = {str(run_dir)!r}: {path} cannot be read ({e.__class__.__name__}); the run's "
                          "settings are unknown, so it cannot be resumed") from None
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    out = []
    for n, line in numbered:
        try:
            row = json.loads(line)
        except ValueError:
            if n == numbered[-1][0]:  # cut short by a kill while it was appended
                continue
            raise ConfigError(f"run_dir = {str(run_dir)!r}: {path} line {n} is not valid JSON; allowed: one object "
                              "per line as written by a resume (fix or remove that line)") from None
        changes = row.get("changes", {}) if isinstance(row, dict) else None
        if not isinstance(changes, dict) or not all(isinstance(v, list) and len(v) == 2 for v in changes.values()):
            raise ConfigError(f"run_dir = {str(run_dir)!r}: {path} line {n} is not a resume record; allowed: an "
                              'object whose "changes" maps a setting to [old, new] (fix or remove that line)')
        out.append({name: new for name, (_, new) in changes.items()})
    return out


def cut_logs(run_dir: str | Path, step: int, *, keep_eval: bool = False) -> int:
    """Drop the rows logged after ``step`` (steps redone after a resume); return how many were dropped.

    A line cut short by a kill is dropped too, and so is a final evaluation logged at ``step`` itself (a row of
    eval/* and drift/* alone after the step's own row): the resumed run evaluates again when it ends; ``keep_eval``
    keeps it (``step`` is on the --eval-every schedule of a run that goes on past it, which evaluates there
    unbroken). The file is rewritten through a temporary sibling.
    """
    dropped = 0
    for name in LOGS:
        path = Path(run_dir) / name
        if not path.is_file():
            continue
        kept = []
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                dropped += 1
                continue
            final_eval = (row.get("step") == step and step > 0 and not keep_eval  # drift probes ride along with it
                          and all(k == "step" or k.startswith(("eval/", "drift/")) for k in row))
            if row.get("step", 0) <= step and not (final_eval and name == "metrics.jsonl"):
                kept.append(line)
            else:
                dropped += 1
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept))
        tmp.replace(path)
    return dropped


def read_rows(run_dir: str | Path) -> list[dict[str, float]]:
    """The rows of ``metrics.jsonl`` (empty when there is none)."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
