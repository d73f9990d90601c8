"""Seconds per RL step and samples per second: generation in the trainer process vs 1 and 2 Ray rollout workers.

Runs `polyrl train` (the task's shipped warm start unless ``--model``) at one batch in every configuration:

- ``in-process``: ``--rollout-workers 0``, the trainer samples its own rollouts;
- ``ray-N``: ``--rollout-workers N`` generator actors on the local Ray instance polyrl starts; the trainer
  waits for them every step (synchronous), then broadcasts its new weights;
- with ``--staleness k`` also ``ray-N-async-k``: the same actors with ``--async-staleness k``, sampling up to
  k policy versions ahead while the trainer updates.

The configurations are measured side by side in one invocation: each of ``--rounds`` rounds runs every
configuration once, in an order rotated by one each round, so that machine noise (and any drift over
the invocation) hits all of them alike. Per run, the first RL step (``--warmup`` steps) is left out of the
step medians (actors starting, the first weight broadcast, allocator and thread-pool warm-up) and reported
as ``warmup_extra_s`` (those steps minus as many median steps). ``startup_s`` is the rest of the fixed cost
of a run: the process's wall clock minus (steps x median step), i.e. interpreter and model loading,
Ray and actor start-up, the held-out evaluations before and after (the same in every configuration),
the final checkpoint and shutting Ray down. ``trainer_wall_minus_steps_s`` is the trainer's own
``wall_seconds`` (summary.json, counted from after the first evaluation) minus the sum of all its steps.
Per configuration the table gives the median over the timed steps of all rounds pooled of
``perf/step_seconds``, samples per second (``rollout/generated`` / ``perf/step_seconds``),
``perf/generate_s``, ``perf/score_s``, ``perf/train_s``, ``perf/weight_sync_s`` and
``rollout/worker_utilization``, the fastest timed step (``best s/step``: the least disturbed by other work
on the machine), and the ratios to ``in-process`` (s/step: above 1 is slower; samples/s: above 1 is
faster); the JSON adds each round's ratio and every run's numbers.

    .venv/bin/python benchmarks/scaling.py --rounds 3 --steps 12 --prompts-per-step 16 --group-size 8 \\
        [--staleness 1] [--json benchmarks/results/scaling.json] [--png benchmarks/results/scaling.png]

Writes the JSON (settings, machine, every run, per-configuration medians and ratios), a PNG with bars of
s/step and samples/s per configuration (each round a dot, the ratio to in-process written on the bar) and
prints a rich table. The run directories (and each run's console output, ``NAME-rR.log``) go under ``--runs``;
each run records the 1-minute load average before it started (``load_before``): a shared machine's other
work shows there.

On a 2-core machine this measures overhead, not speed-up. The Ray actors compete with the trainer for
the same two cores (a synchronous actor gets both while the trainer waits, two actors split them, an
asynchronous one samples on one core while the trainer trains on the other), so a worker adds no compute:
what a ratio shows is the cost of the hand-off (actor processes, serialising episodes, broadcasting
weights, Ray itself) against whatever the same two cores gain from overlapping generation with training
(``--staleness``) and, with a KL preset such as grpo, from the actors scoring the frozen reference
(``score s`` leaves the trainer's step, the actors' ``generate s`` grows). These ratios say nothing about
the speed-up on a machine with more cores or with GPUs, where each actor brings its own compute: measure
there with the same command. On a shared machine, torch's threads also contend with other people's
processes, and a step can take ten times its quiet time or more; read ``load`` and ``best s/step`` with the medians.
Two torch threads per process suffer most there (a thread that loses its core stalls the other), which
favours the configurations whose processes run one thread each (two workers, asynchronous workers);
``--threads 1`` gives every process one thread and compares the hand-off alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

from _runs import median_of, read_metrics, run_train, step_rows
from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
BASE = "in-process"
# per-step metrics: key in the JSON -> metrics.jsonl key (s_per_step and samples_per_s are computed)
STEP_KEYS = {"generate_s": "perf/generate_s", "score_s": "perf/score_s", "train_s": "perf/train_s",
             "weight_sync_s": "perf/weight_sync_s", "worker_utilization": "rollout/worker_utilization"}
PER_STEP = ["s_per_step", "samples_per_s", *STEP_KEYS]


def configurations(workers: list[int], staleness: int) -> dict[str, list[str]]:
    """Name -> the flags that make the configuration."""
    configs = {BASE: ["--rollout-workers", "0"]}
    configs |= {f"ray-{n}": ["--rollout-workers", str(n)] for n in workers}
    if staleness:
        configs |= {f"ray-{n}-async-{staleness}": ["--rollout-workers", str(n), "--async-staleness", str(staleness)]
                    for n in workers}
    return configs


def measure(run_dir: Path, flags: list[str], warmup: int) -> dict[str, Any]:
    """Run one configuration once: its per-step values after ``warmup`` (``timed``), their medians, its fixed costs."""
    load = os.getloadavg()[0]
    process_s = run_train(run_dir, flags)
    every = step_rows(read_metrics(run_dir))
    if len(every) <= warmup:
        raise SystemExit(f"{run_dir}: {len(every)} RL step(s) logged, {warmup} of them warm-up (--steps, --warmup)")
    steps = every[warmup:]
    timed = {"s_per_step": [r["perf/step_seconds"] for r in steps],
             "samples_per_s": [r["rollout/generated"] / r["perf/step_seconds"] for r in steps],
             **{name: [r[key] for r in steps if key in r] for name, key in STEP_KEYS.items()}}
    run: dict[str, Any] = {name: statistics.median(v) if v else None for name, v in timed.items()}
    step_s = run["s_per_step"]
    summary = json.loads((run_dir / "summary.json").read_text())
    run |= {
        "worker_restarts": max((r.get("rollout/worker_restarts", 0.0) for r in every), default=0.0),
        "samples_per_step": median_of(steps, "rollout/generated"),
        "first_step_s": every[0]["perf/step_seconds"],
        "warmup_extra_s": sum(r["perf/step_seconds"] for r in every[:warmup]) - warmup * step_s,
        "process_s": process_s,
        "startup_s": process_s - len(every) * step_s,
        "trainer_wall_minus_steps_s": summary["wall_seconds"] - sum(r["perf/step_seconds"] for r in every),
        "summary_seconds_per_step": summary["seconds_per_step"],
        "summary_rollouts_per_second": summary["rollouts_per_second"],
        "load_before": load,
        "timed": timed,
    }
    return run


def aggregate(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per configuration: per-step numbers as the median of the timed steps of all rounds pooled (a burst of load in
    one run moves it less than a median of two or three run medians would), the fastest timed step, fixed costs as
    the median over rounds, restarts as the most in any run; and the ratios to in-process (also per round)."""
    table: dict[str, dict[str, Any]] = {}
    for name, rs in runs.items():
        pooled = {key: [v for r in rs for v in r["timed"][key]] for key in PER_STEP}
        row: dict[str, Any] = {key: statistics.median(v) if v else None for key, v in pooled.items()}
        row["s_per_step_best"] = min(pooled["s_per_step"])
        row["steps_timed"] = len(pooled["s_per_step"])
        for key in ("warmup_extra_s", "startup_s", "process_s", "trainer_wall_minus_steps_s", "first_step_s",
                    "load_before"):
            row[key] = statistics.median(r[key] for r in rs)
        row["worker_restarts"] = max(r["worker_restarts"] for r in rs)
        table[name] = row
    base = table[BASE]
    for name, row in table.items():
        row["s_per_step_ratio"] = row["s_per_step"] / base["s_per_step"]
        row["samples_per_s_ratio"] = row["samples_per_s"] / base["samples_per_s"]
        row["s_per_step_best_ratio"] = row["s_per_step_best"] / base["s_per_step_best"]
        row["s_per_step_ratio_each_round"] = [round(r["s_per_step"] / b["s_per_step"], 3)
                                              for r, b in zip(runs[name], runs[BASE])]
        row["rounds"] = len(runs[name])
    return table


def plot(table: dict[str, dict[str, Any]], runs: dict[str, list[dict[str, Any]]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(table)
    colors = ["tab:gray"] + [f"C{i}" for i in range(len(names) - 1)]
    fig, axes = plt.subplots(1, 2, figsize=(4 + 1.6 * len(names), 4.5))
    for ax, key, label in ((axes[0], "s_per_step", "seconds per RL step (lower is better)"),
                           (axes[1], "samples_per_s", "samples per second (higher is better)")):
        heights = [table[n][key] for n in names]
        bars = ax.bar(range(len(names)), heights, color=colors, alpha=0.8)
        for i, n in enumerate(names):  # every round's value as a dot
            ax.plot([i] * len(runs[n]), [r[key] for r in runs[n]], "k.", ms=5)
        for bar, n in zip(bars, names):  # the ratio above the bar and its dots
            top = max(bar.get_height(), *(r[key] for r in runs[n]))
            ax.annotate(f"x{table[n][key + '_ratio']:.2f}", (bar.get_x() + bar.get_width() / 2, top),
                        ha="center", va="bottom", xytext=(0, 4), textcoords="offset points", fontsize=9)
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
        ax.set_ylabel(label)
        ax.set_ylim(0, max(max(r[key] for r in runs[n]) for n in names) * 1.18)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(table: dict[str, dict[str, Any]], console: Console, caption: str) -> None:
    t = Table(title="in-process generation vs Ray rollout workers: medians of the timed steps of all rounds",
              caption=caption + "; warm-up, start-up (s) and load: medians over rounds")
    columns = [("config", None, ""), ("s/step", "s_per_step", ".3f"), ("x", "s_per_step_ratio", ".2f"),
               ("best s/step", "s_per_step_best", ".3f"), ("x", "s_per_step_best_ratio", ".2f"),
               ("samples/s", "samples_per_s", ".1f"), ("x", "samples_per_s_ratio", ".2f"),
               ("generate s", "generate_s", ".3f"), ("score s", "score_s", ".3f"), ("train s", "train_s", ".3f"),
               ("sync s", "weight_sync_s", ".3f"), ("util", "worker_utilization", ".2f"),
               ("restarts", "worker_restarts", ".0f"), ("warm-up +s", "warmup_extra_s", ".1f"),
               ("start-up s", "startup_s", ".1f"), ("load", "load_before", ".1f")]
    for header, _, _ in columns:
        t.add_column(header, justify="left" if header == "config" else "right")
    for name, row in table.items():
        t.add_row(name, *("-" if row[key] is None else format(row[key], fmt) for _, key, fmt in columns[1:]))
    console.print(t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="addition")
    p.add_argument("--method", default="grpo")
    p.add_argument("--model", default=None, help="model directory (default: the task's shipped warm start)")
    p.add_argument("--steps", type=int, default=12, help="RL steps per run")
    p.add_argument("--warmup", type=int, default=1, help="first steps of each run left out of the medians")
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=None, help="generation cap (default: polyrl's)")
    p.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts of the evaluations before/after")
    p.add_argument("--workers", default="1,2", help="comma-separated numbers of Ray rollout workers")
    p.add_argument("--staleness", type=int, default=0,
                   help="also run the workers asynchronously with --async-staleness k (0 = no)")
    p.add_argument("--threads", type=int, default=0,
                   help="polyrl's --threads: the cores it divides between trainer and workers (0 = all)")
    p.add_argument("--rounds", type=int, default=3, help="every configuration runs once per round")
    p.add_argument("--runs", default="runs/scaling", help="where the run directories go")
    p.add_argument("--json", default=str(HERE / "results" / "scaling.json"))
    p.add_argument("--png", default=str(HERE / "results" / "scaling.png"))
    args = p.parse_args()
    if args.warmup < 0 or args.steps <= args.warmup:
        p.error("--steps must exceed --warmup (the warm-up steps are left out of the medians)")

    workers = [int(n) for n in args.workers.split(",") if n.strip()]
    if not workers or min(workers) < 1:
        p.error("--workers: numbers of Ray workers, each at least 1 (in-process generation always runs)")
    configs = configurations(workers, args.staleness)
    common = ["--task", args.task, "--method", args.method, "--steps", str(args.steps),
              "--prompts-per-step", str(args.prompts_per_step), "--group-size", str(args.group_size),
              "--eval-every", "0", "--checkpoint-every", "0", "--eval-prompts", str(args.eval_prompts)]
    if args.model:
        common += ["--model", args.model]
    if args.max_new_tokens:
        common += ["--max-new-tokens", str(args.max_new_tokens)]
    if args.threads:
        common += ["--threads", str(args.threads)]

    console = Console()
    if not console.is_terminal:  # piped into a file: the whole table, not 80 columns of it
        console.width = 180
    out = Path(args.runs)
    names = list(configs)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotated: no configuration always runs first
            run = measure(out / f"{name}-r{r}", common + configs[name], args.warmup)
            runs[name].append(run)
            console.print(f"round {r + 1}/{args.rounds} {name:>18}: {run['s_per_step']:.3f} s/step, "
                          f"{run['samples_per_s']:.1f} samples/s, warm-up +{run['warmup_extra_s']:.2f} s, "
                          f"process {run['process_s']:.1f} s, load before {run['load_before']:.1f}")

    table = aggregate(runs)
    cores = os.cpu_count()
    command = shlex.join([sys.executable, *sys.argv])
    caption = (f"{args.task}/{args.method}, {args.prompts_per_step}x{args.group_size} samples per step, "
               f"{args.steps} steps ({args.warmup} left out), {args.rounds} rounds, {cores} CPU cores")
    print_table(table, console, caption)
    if cores is not None and cores <= 2 * max(workers):
        console.print(f"[yellow]{cores} cores: the Ray workers share them with the trainer, so these ratios show "
                      "the overhead of the hand-off, not the speed-up of more hardware.[/]")
    load = statistics.median(r["load_before"] for rs in runs.values() for r in rs)
    if cores is not None and load > 0.75 * cores:
        console.print(f"[yellow]the machine was busy (median load {load:.1f} on {cores} cores): other processes "
                      "shared the cores, so the medians carry their noise; compare with best s/step.[/]")
    result = {
        "what": "seconds per RL step and samples per second: in-process generation vs Ray rollout workers",
        "command": command,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpu_count": cores, "platform": platform.platform(), "python": platform.python_version()},
        "settings": vars(args),
        "train_flags": common,
        "configurations": configs,
        "summary": table,
        "runs": runs,
    }
    json_path, png_path = Path(args.json), Path(args.png)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2))
    plot(table, runs, caption, png_path)
    console.print(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()
