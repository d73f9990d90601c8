"""Seconds per RL step, rollouts per second and tokens per second at the demo settings (not a test).

    .venv/bin/python benchmarks/step_throughput.py --model MODEL_DIR --steps 20 \
        [--trl-python /path/to/venv-with-trl/bin/python]

Settings: 8 prompts x 8 generations, 8 new tokens, one optimizer step per batch, GRPO, CPU float32,
KL coefficient ``--beta`` on both sides (default 0, TRL's default; GRPO's paper value is 0.04).
With ``--trl-python`` the same model and settings also run through TRL's GRPOTrainer
(benchmarks/trl_grpo_throughput.py, in that interpreter) right after polyrl, and the ratio is printed.
Timings on a shared 2-core machine are noisy, so ``--rounds R`` alternates the two frameworks R times
and reports medians: compare the two numbers of one run, not across runs.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _runs import read_metrics, step_rows
from rich.console import Console


def run_polyrl(model: str, steps: int, warmup: int, threads: int, beta: float) -> dict[str, float]:
    from polyrl.config import build_config
    from polyrl.methods import get_method
    from polyrl.tasks import get_task
    from polyrl.trainer import train

    with tempfile.TemporaryDirectory() as run_dir:
        cfg = build_config(dict(steps=warmup + steps, prompts_per_step=8, group_size=8, max_new_tokens=8,
                                eval_prompts=8, eval_every=0, checkpoint_every=0, tensorboard=False, log_every=0,
                                threads=threads))
        method = get_method("grpo", kl_coef=beta) if beta > 0 else get_method("grpo", kl=None, kl_coef=0.0)
        train(cfg, method, model_dir=model, task=get_task("addition"), run_dir=run_dir,
              console=Console(file=io.StringIO()))
        timed = step_rows(read_metrics(Path(run_dir)), skip=warmup)
    mean = lambda key: sum(r[key] for r in timed) / len(timed)  # noqa: E731
    sec = mean("perf/step_seconds")
    return {
        "polyrl_seconds_per_step": sec,
        "polyrl_rollouts_per_second": 64 / sec,
        "polyrl_gen_seconds": mean("perf/generate_s"),
        "polyrl_score_seconds": mean("perf/score_s"),
        "polyrl_update_seconds": mean("perf/train_s"),
        "polyrl_gen_tokens_per_second": mean("perf/gen_tokens_per_second"),
        "polyrl_train_tokens_per_second": mean("perf/train_tokens_per_second"),
        "steps_timed": len(timed),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="local Hugging Face model directory (e.g. the demo warm start)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="alternate the frameworks this many times")
    ap.add_argument("--beta", type=float, default=0.0, help="KL coefficient for both frameworks")
    ap.add_argument("--trl-python", help="interpreter of an environment with TRL installed")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    rounds: list[dict[str, float]] = []
    for _ in range(args.rounds):
        results = run_polyrl(args.model, args.steps, args.warmup, args.threads, args.beta)
        if args.trl_python:
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                script = Path(__file__).with_name("trl_grpo_throughput.py")
                subprocess.run([args.trl_python, str(script), "--model", args.model, "--steps", str(args.steps),
                                "--warmup", str(args.warmup), "--threads", str(args.threads), "--beta",
                                str(args.beta), "--json", f.name],
                               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                results.update(json.loads(Path(f.name).read_text()))
            results["speedup_rollouts_per_second"] = (results["polyrl_rollouts_per_second"]
                                                      / results["trl_rollouts_per_second"])
        rounds.append(results)
    results = {k: statistics.median(r[k] for r in rounds) for k in rounds[0] if isinstance(rounds[0][k], float)}
    results["rounds"] = len(rounds)
    if args.trl_python:
        results["speedup_each_round"] = [round(r["speedup_rollouts_per_second"], 3) for r in rounds]
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    sys.exit(main())
