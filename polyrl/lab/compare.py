"""`polyrl compare`: run methods x seeds on one task, then analyse and report.

Every (method, seed) pair is one ordinary `polyrl train` run in ``OUT/<method>/seed<k>/``, started
as a subprocess (its output in ``OUT/<method>/seed<k>.train.log`` beside it, which --overwrite of the run leaves),
one after another or in W worker processes.
All runs start from the same model: the task's cached warm start (built once, before any run) or
``--model``. A rerun skips finished runs (``summary.json`` present) and resumes interrupted ones
(checkpoints but no summary). Every shared and per-method flag is validated for every method
before the first run starts, so a typo fails in one line instead of after an hour.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from polyrl.config import ConfigError
from polyrl.logging import StepProgress


@dataclass
class RunSpec:
    method: str
    seed: int
    run_dir: Path
    args: list[str]  # full `polyrl train` argument list

    @property
    def name(self) -> str:
        return f"{self.method}/seed{self.seed}"

    @property
    def log(self) -> Path:
        """The run's output, ``OUT/<method>/seed<k>.train.log``: beside its directory, which --overwrite replaces."""
        return self.run_dir.parent / f"{self.run_dir.name}.train.log"


def split_label(entry: str) -> tuple[str, str]:
    """``LABEL=PRESET`` (a variant, e.g. ``tree=grpo`` with its own --method-args) or just ``PRESET``."""
    label, eq, preset = entry.partition("=")
    return (label.strip(), preset.strip()) if eq else (entry.strip(), entry.strip())


def method_labels(methods: str) -> dict[str, str]:
    """``--methods a,tree=grpo`` -> {label: preset}. A label names the method's folder under --out and its rows in
    the results: one that is empty, repeated (the later one silently replaced the earlier), not a plain folder name
    (``../x`` wrote outside --out) or holding a '.' (the report's cells look values up by dotted paths such as
    ``methods.LABEL.final``: every cell of ``eps0.3`` was blank) is refused in one line."""
    out: dict[str, str] = {}
    for entry in (m for m in methods.split(",") if m.strip()):
        label, preset = split_label(entry)
        if not label or not preset or "." in label or "/" in label or "\\" in label:
            raise ConfigError(f"methods = {methods!r}: {entry.strip()!r} is not allowed; allowed: PRESET or "
                              "LABEL=PRESET, LABEL a folder name under --out with no '/' or '.' (e.g. eps0p3)")
        if label in out:
            raise ConfigError(f"methods = {methods!r}: {label!r} is given twice; give each method (or LABEL=PRESET "
                              "variant) once")
        out[label] = preset
    return out


def parse_method_args(items: list[str] | None, methods: list[str]) -> dict[str, list[str]]:
    """``--method-args 'dppo_tv=--trust-region dppo_tv:delta_low=0.1 --lr 5e-5'`` -> {method: [flags]}."""
    out: dict[str, list[str]] = {}
    for item in items or []:
        name, eq, rest = item.partition("=")
        if not eq or name.strip() not in methods:
            raise ConfigError(f"method_args = {item!r}: write METHOD=FLAGS with METHOD one of {', '.join(methods)}")
        try:
            flags = shlex.split(rest)
        except ValueError as e:  # an unbalanced quote
            raise ConfigError(f"method_args = {item!r}: {e} (quote a value as in a shell: 'dapo=--lr 5e-5')") from None
        out.setdefault(name.strip(), []).extend(flags)
    return out


# Train flags that compare sets for every run itself; given again, the later one would win (a --run-dir outside OUT,
# wiped by the run's --overwrite; every seed the same seed): refused, with what to use instead.
RUN_FLAGS = {
    "--method": "each run's preset comes from --methods (LABEL=PRESET names a variant)",
    "--seed": "the runs use seeds 0 .. N-1 of --seeds N",
    "--run-dir": "each run's directory is OUT/METHOD/seedK of --out",
    "--resume": "a rerun of the same compare command resumes its interrupted runs itself",
    "--resume-from": "a rerun of the same compare command resumes its interrupted runs itself",
    "--overwrite": "compare restarts unfinished runs itself; delete OUT/METHOD/seedK to rerun a finished one",
    "--model": "compare's own --model starts every run",
    "--task": "compare's own --task applies to every run",
}


def refuse_run_flags(flags: list[str], where: str) -> None:
    """Raise ConfigError naming the first of ``flags`` that compare sets per run (``RUN_FLAGS``), or an abbreviation
    of one (which the parsers, taking none, would refuse anyway, less clearly); ``where`` names the setting they came
    from."""
    for i, token in enumerate(flags):
        if token == "--":
            return
        name, eq, _ = token.partition("=")
        if not name.startswith("--") or len(name) < 3:
            continue
        hits = [f for f in RUN_FLAGS if f == name] or [f for f in RUN_FLAGS if f.startswith(name)]
        if not hits:
            continue
        given = token if eq or i + 1 == len(flags) or flags[i + 1].startswith("-") else f"{token} {flags[i + 1]}"
        meant = "" if hits == [name] else f" ({' or '.join(hits)})"
        raise ConfigError(f"{where}: {given!r}{meant} is not allowed in compare: {RUN_FLAGS[hits[0]]}")


def refuse_foreign_out(out: Path) -> None:
    """An ``--out`` that holds files but no compare run (``METHOD/seedK``) is refused in one line: the report
    (``results.json``, ``report.html``, figures) would overwrite files of the same name there."""
    if not out.is_dir() or any(out.glob("*/seed*")):
        return
    entries = sorted(p.name for p in out.iterdir())
    if entries:
        raise ConfigError(f"out = {str(out)!r} holds {len(entries)} entr{'y' if len(entries) == 1 else 'ies'} "
                          f"({', '.join(entries[:4])}{', ...' if len(entries) > 4 else ''}) and no compare run "
                          "(METHOD/seedK); the report would overwrite them: choose an empty or new --out")


def refuse_run_settings(config: str | None) -> None:
    """Refuse a ``--config`` TOML that sets what compare sets for every run (``RUN_FLAGS``): compare's own flags
    would win over it unseen (a TOML ``task = "calculator"`` trained addition)."""
    if not config:
        return
    from polyrl.build import METHOD_OVERRIDES
    from polyrl.config import load_toml

    values = load_toml(config, flags_only=METHOD_OVERRIDES)
    for flag, why in RUN_FLAGS.items():
        key = flag[2:].replace("-", "_")
        if key in values:
            raise ConfigError(f"config = {config!r}: {key} = {values[key]!r} is not allowed in compare: {why}")


def threads_given(parse: Callable[[list[str]], argparse.Namespace], flags: list[str]) -> bool:
    """Whether train ``flags`` set the thread count, as a flag in any form argparse takes or in their --config TOML
    (then compare does not split the cores between runs itself)."""
    from polyrl.build import METHOD_OVERRIDES
    from polyrl.config import load_toml

    args = parse(flags)
    return args.threads is not None or bool(args.config and "threads" in load_toml(args.config,
                                                                                     flags_only=METHOD_OVERRIDES))


def plan_runs(methods: list[str], seeds: list[int], out: Path, shared: list[str],
              per_method: dict[str, list[str]], model: str | None, workers: int = 1,
              presets: dict[str, str] | None = None, command: tuple[str, ...] = ("train",),
              resumable: bool = True, checkpointed: Callable[[Path], bool] | None = None,
              threads: Collection[str] = (), expected: dict[str, dict] | None = None) -> list[RunSpec]:
    """One RunSpec per (method, seed); a finished run is left out, an interrupted one gets --resume.

    ``presets`` maps a variant label to its preset (``--methods uniform=grpo,tree=grpo``); by default a
    method's label is its preset. ``command`` is the train command (``polyrl train``, or an RL family's, e.g.
    ``flow train``); a family (``resumable=False``) takes no ``--model`` or ``--threads``, and resumes an
    interrupted run when its ``checkpointed(run_dir)`` says it saved one (q, duplex, marl), else restarts it (flow).
    ``threads``: the methods whose flags set the thread count (``threads_given``: shared or their own flags, or a
    --config TOML); every other method's runs get the cores over ``workers``.
    ``expected``: {method: the record its runs would write} (``validate_runs``); a finished run is checked against it
    (``finished_run``: kept, refused, or asked for more steps: resumed, or for a family that saves no checkpoint
    (flow) trained again).
    """
    presets = presets or {}
    from polyrl.checkpoint import latest_checkpoint
    from polyrl.runs import cores

    split = ["--threads", str(max(1, cores() // max(1, workers)))]  # the cores between concurrent runs
    specs = []
    for method in methods:
        own = split if resumable and method not in threads else []
        for seed in seeds:
            run_dir = out / method / f"seed{seed}"
            done = (run_dir / "summary.json").exists()
            if done and finished_run(run_dir, (expected or {}).get(method)):
                continue
            # a family without checkpoints (flow) trains a run asked for more steps again from the start
            saved = (checkpointed(run_dir) if checkpointed is not None else
                     resumable and (done or latest_checkpoint(run_dir) is not None))
            if saved and not done:  # interrupted after a checkpoint: resumed with this command's flags
                check_interrupted_run(run_dir, (expected or {}).get(method))
            resume = ["--resume"] if saved else ["--overwrite"]
            args = [*command, "--method", presets.get(method, method), "--seed", str(seed), "--run-dir", str(run_dir),
                    *(["--model", model] if model is not None else []),
                    *shared, *own, *per_method.get(method, []), *resume]
            specs.append(RunSpec(method, seed, run_dir, args))
    return specs


def validate_runs(methods: list[str], shared: list[str], per_method: dict[str, list[str]],
                  presets: dict[str, str] | None, *, check: Callable[[list[str]], dict | None]) -> dict[str, dict]:
    """Resolve every method's full train configuration now (raises ConfigError / PartError in one line).

    ``check(flags)`` resolves one run's train flags (without --seed and --run-dir), raising ConfigError on a bad one;
    what it returns (a run's record, or None) is returned per method: {method: record}.
    """
    presets = presets or {}
    records = {}
    for method in methods:
        argv = ["--method", presets.get(method, method), *shared, *per_method.get(method, [])]
        try:
            record = check(argv)
        except ConfigError as e:
            raise ConfigError(f"the flags for method {method!r}: {e}") from None
        if record is not None:
            records[method] = record
    return records


def finished_run(run_dir: Path, expected: dict | None) -> bool:
    """Whether the finished run in ``run_dir`` is the one this command asks for: True to keep it, False to resume it
    for more steps. ``expected``: the run's record (its ``config.json``) as this command would write it (None: not
    known, kept): a `polyrl train` run's {"config", "overrides"}, a family run's {"config", "method", "parts"}. A run
    made with other settings, another preset or other parts (or fewer steps asked than it ran) is refused in one line:
    keeping it would report it as this command's. Run control, the seed and settings a resume may change (threads,
    eval_every...) do not count."""
    differ, steps = _record_differences(run_dir, expected)
    if steps is not None and steps[1] < steps[0]:
        differ["steps"] = steps
    _refuse_other_run(run_dir, "finished", differ)
    return steps is None


def check_interrupted_run(run_dir: Path, expected: dict | None) -> None:
    """Refuse (ConfigError, one line) an interrupted run in ``run_dir`` that this command would resume with other
    settings than it started with, or with fewer steps than its checkpoint: its resume would be refused once the
    runs start, and the report would then rank the interrupted run's old rows as this command's."""
    from polyrl.checkpoint import checkpoint_step, latest_checkpoint

    differ, steps = _record_differences(run_dir, expected)
    checkpoint = latest_checkpoint(run_dir)
    saved = checkpoint_step(checkpoint) if checkpoint is not None else None
    if steps is not None and saved is not None and steps[1] < saved:
        differ["steps"] = [f"{steps[0]} (its checkpoint at step {saved})", steps[1]]
    _refuse_other_run(run_dir, "stopped", differ)


def _record_differences(run_dir: Path, expected: dict | None) -> tuple[dict[str, list], list | None]:
    """The settings and record keys in which ``run_dir``'s run differs from ``expected`` ({key: [had, asked]}, run
    control, the seed and what a resume may change left out), and [had, asked] steps when those differ."""
    from polyrl.runs import RESUME_MAY_CHANGE, RUN_CONTROL, effective_config, same_value, saved_record

    if expected is None:
        return {}, None
    saved = effective_config(run_dir) or {}
    differ = {k: [saved[k], v] for k, v in expected["config"].items()
              if k in saved and k not in (*RUN_CONTROL, "seed") and not same_value(saved[k], v)}
    record = saved_record(run_dir) or {}
    for key, asked in expected.items():  # what defines the method beside the settings
        had = record.get(key, {} if key == "overrides" else None)
        if key != "config" and had != asked:
            differ["part overrides" if key == "overrides" else key] = [had, asked]
    steps = differ.pop("steps", None)
    return {k: v for k, v in differ.items() if k not in RESUME_MAY_CHANGE}, steps


def _refuse_other_run(run_dir: Path, how: str, differ: dict[str, list]) -> None:
    if differ:
        k, (old, new) = next(iter(differ.items()))
        raise ConfigError(f"{run_dir} {how} with {k} = {old!r}, and this compare gives {k} = {new!r}"
                          f"{f' (and {len(differ) - 1} more)' if len(differ) > 1 else ''}: its results would be "
                          "reported as this command's; use another --out, or delete that run to run it again")


def check_train_flags(parse: Callable[[list[str]], argparse.Namespace], model: str) -> Callable[[list[str]], dict]:
    """``check`` for `polyrl train` runs from ``model``: parse the flags and resolve them with the builder; it returns
    the run's record as a run would write it (``{"config", "overrides"}``), for ``finished_run``."""
    from polyrl.build import resolve_train

    def check(argv: list[str]) -> dict:
        from polyrl.config import to_dict

        args = parse([*argv, "--model", model])
        refuse_run_settings(args.config)
        args.run_dir = str(Path("/nonexistent-polyrl-validation") / args.method)  # resolving must not touch dirs
        plan = resolve_train(args)
        record = {"config": to_dict(plan.cfg), "overrides": plan.overrides}
        return json.loads(json.dumps(record, default=str))  # as config.json reads back (tuples as lists)

    return check


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (indices or UUIDs); none without CUDA."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return [d.strip() for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip() and d.strip() != "-1"]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def gpu_slots(gpus: list[str], workers: int) -> list[str]:
    """CUDA_VISIBLE_DEVICES for each of ``workers`` concurrent runs: disjoint blocks of the GPUs when there are at
    least as many GPUs as workers, else one GPU each, shared round-robin; [] (the environment as it is) with at most
    one GPU or one worker, where there is nothing to spread."""
    if len(gpus) < 2 or workers < 2:
        return []
    if len(gpus) >= workers:
        per = len(gpus) // workers
        return [",".join(gpus[w * per:(w + 1) * per]) for w in range(workers)]
    return [gpus[w % len(gpus)] for w in range(workers)]


def run_all(specs: list[RunSpec], *, workers: int, console: Console) -> list[tuple[RunSpec, int, float]]:
    """Run the specs (W at a time), each `polyrl train` in its own process; return (spec, exit code, seconds).

    With several GPUs and several workers, each worker slot's runs see their own GPUs (``gpu_slots``); before, every
    concurrent run trained on GPU 0.

    A child runs with ``PYTHONSAFEPATH`` (the current directory is not put first on its import path, so a ``math.py``
    there cannot replace the standard library's). When compare itself stops (Ctrl-C, SIGTERM: an exception here), no
    further run starts and the running ones get SIGTERM, each unwinding as its own command does (its checkpoints
    kept), then SIGKILL after ``STOP_GRACE_S``: none is left training on into a run directory a rerun would use.
    """
    live: set[subprocess.Popen] = set()
    lock = threading.Lock()
    stopping = threading.Event()
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    gpus = gpu_slots(visible_gpus(), workers) if workers > 1 else []
    free_slots = list(range(max(1, workers)))

    def one(spec: RunSpec) -> tuple[RunSpec, int, float]:
        if stopping.is_set():  # compare is stopping: a run not started stays as it was (its log included)
            return spec, -signal.SIGTERM, 0.0
        with lock:
            slot = free_slots.pop()
        try:
            return run_one(spec, slot)
        finally:
            with lock:
                free_slots.append(slot)

    def run_one(spec: RunSpec, slot: int) -> tuple[RunSpec, int, float]:
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        resumed = "--resume" in spec.args  # the interrupted run's log is kept: its error or last steps came first
        with open(spec.log, "a" if resumed else "w") as log:
            if resumed:
                log.write(f"--- resumed by compare: polyrl {' '.join(spec.args)}\n")
                log.flush()
            with lock:
                if stopping.is_set():
                    return spec, -signal.SIGTERM, 0.0
                own = {**env, "CUDA_VISIBLE_DEVICES": gpus[slot]} if gpus else env
                proc = subprocess.Popen([sys.executable, "-m", "polyrl", *spec.args], stdout=log,
                                        stderr=subprocess.STDOUT, env=own)
                live.add(proc)
            code = proc.wait()
        with lock:
            live.discard(proc)
        return spec, code, time.perf_counter() - t0

    results = []
    pool = ThreadPoolExecutor(max_workers=max(1, workers))
    try:
        with StepProgress(console, "compare runs", len(specs), every_s=0.0) as bar:  # a line per finished run
            for spec, code, secs in pool.map(one, specs):
                results.append((spec, code, secs))
                status = "ok" if code == 0 else f"FAILED (exit {code}, see {spec.log})"
                bar.update(len(results), info=f"{spec.name} {status} {secs:.0f}s")
    except BaseException:
        with lock:
            stopping.set()
            running = list(live)
        _stop(running)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return results


STOP_GRACE_S = 60.0  # how long a stopped compare waits for its runs to unwind before it kills them


def _stop(procs: list[subprocess.Popen]) -> None:
    """Give the children a moment to end on their own (a terminal's Ctrl-C reached them too), then SIGTERM each one
    still running, wait up to ``STOP_GRACE_S`` for all of them, and SIGKILL what is left."""
    settle = time.monotonic() + 2.0
    while any(proc.poll() is None for proc in procs) and time.monotonic() < settle:
        time.sleep(0.05)
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
