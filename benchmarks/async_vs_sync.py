"""Seconds per RL step: synchronous generation vs the asynchronous pipeline (--async-staleness k).

Runs `polyrl train` with the same settings in both modes (same batch, same preset), alternating for
``--rounds`` rounds so that machine noise hits both, and reports the median of ``perf/step_seconds``
after ``--warmup`` steps (the generation process starts during the first steps) and the largest
``async/staleness_max`` seen. With a KL preset (grpo) the generation process also scores the frozen
reference, so the trainer's step loses that forward pass as well as the generation.

    .venv/bin/python benchmarks/async_vs_sync.py --steps 40 --rounds 2 --staleness 1
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from _runs import median_of, read_metrics, run_train, step_rows


def run(mode: str, args: argparse.Namespace, out: Path, round_: int) -> dict[str, float]:
    run_dir = out / f"{mode}-r{round_}"
    flags = ["--task", args.task, "--method", args.method, "--steps", str(args.steps),
             "--prompts-per-step", str(args.prompts), "--group-size", str(args.group_size), "--eval-every", "0",
             "--eval-prompts", "20", "--checkpoint-every", "0"]
    if args.model:
        flags += ["--model", args.model]
    if args.threads:
        flags += ["--threads", str(args.threads)]
    if mode == "async":
        flags += ["--async-staleness", str(args.staleness)]
    run_train(run_dir, flags)
    rows = read_metrics(run_dir)
    steps = step_rows(rows, skip=args.warmup)
    return {
        "median_step_seconds": median_of(steps, "perf/step_seconds"),
        "median_gen_seconds": median_of(steps, "perf/generate_s"),
        "median_score_seconds": median_of(steps, "perf/score_s"),
        "median_update_seconds": median_of(steps, "perf/train_s"),
        "staleness_max": max((r.get("async/staleness_max", 0.0) for r in rows), default=0.0),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="addition")
    p.add_argument("--method", default="grpo", help="preset (grpo's KL term makes the pipeline score the reference)")
    p.add_argument("--model", default=None, help="model directory (default: the task's warm start)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="total CPU threads (0 = all cores)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="runs/async_vs_sync")
    args = p.parse_args()
    out = Path(args.out)
    results: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
    for r in range(args.rounds):
        for mode in ("sync", "async"):
            results[mode].append(run(mode, args, out, r))
            print(mode, r, json.dumps(results[mode][-1]))
    summary = {mode: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for mode, rs in results.items()}
    summary["speedup"] = summary["sync"]["median_step_seconds"] / summary["async"]["median_step_seconds"]
    summary["staleness_bound"] = args.staleness
    (out / "results.json").write_text(json.dumps({"rounds": results, "summary": summary}, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
