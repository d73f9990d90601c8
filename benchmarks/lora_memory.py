"""Peak memory (RSS) and seconds per RL step: LoRA through PEFT vs full fine-tuning, on the same model and batch.

Builds one random-init Qwen2-shaped model with ``polyrl.tinyhf`` (``--hidden``, ``--layers``, ``--intermediate``;
the default, hidden 1024 x 12 layers, is about 130M parameters, the largest shape that trains comfortably beside
other work on a 2-core, 24 GiB machine), then runs `polyrl train` on it once per mode and round, in an order
rotated each round so that machine noise hits both alike:

- ``full``: every weight trains; AdamW keeps two moments per weight and a KL preset (grpo) a frozen reference copy;
- ``lora``: ``--lora-rank R`` adapters on every linear layer; the base is frozen, the reference is the base with the
  adapters off (no copy) and AdamW holds the adapters alone.

Each run's peak resident memory is ``peak_rss_mb`` of its summary.json (the process's high-water mark,
``ru_maxrss``: loading, the steps and the final checkpoint; the steps dominate), its step time the median
``perf/step_seconds`` after the first step.

    .venv/bin/python benchmarks/lora_memory.py --rounds 2 [--hidden 1024 --layers 12] [--rank 8]

Prints a table and writes ``benchmarks/results/lora_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from _runs import read_metrics, run_train, step_rows
from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent


def build_model(out: Path, hidden: int, layers: int, intermediate: int) -> tuple[Path, int]:
    """A Qwen2-shaped random model with a local BPE tokenizer; returns its directory and parameter count."""
    from polyrl.tinyhf import build_tiny

    heads = max(2, hidden // 64)
    path = build_tiny("qwen2", out, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate,
                      num_attention_heads=heads, num_key_value_heads=2, head_dim=hidden // heads)
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        count = sum(f.get_slice(k).get_shape().numel() if hasattr(f.get_slice(k).get_shape(), "numel")
                    else _numel(f.get_slice(k).get_shape()) for k in f.keys())
    return path, count


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--method", default="grpo")
    p.add_argument("--threads", type=int, default=0, help="torch threads per run (0 = all cores)")
    p.add_argument("--runs", type=Path, default=HERE / "results" / "lora_memory")
    p.add_argument("--json", type=Path, default=HERE / "results" / "lora_memory.json")
    args = p.parse_args()

    console = Console()
    model, params = build_model(args.runs / "model", args.hidden, args.layers, args.intermediate)
    console.print(f"model: qwen2 hidden {args.hidden} x {args.layers} layers, {params / 1e6:.1f}M parameters ({model})")
    common = ["--model", str(model), "--method", args.method, "--task", "addition", "--steps", str(args.steps),
              "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "16", "--eval-prompts", "4",
              "--eval-every", "0", "--checkpoint-every", "0", "--threads", str(args.threads)]
    modes = {"full": [], "lora": ["--lora-rank", str(args.rank), "--lora-alpha", str(2 * args.rank)]}
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):
        order = list(modes)[r % 2:] + list(modes)[: r % 2]
        for mode in order:
            run_dir = args.runs / f"{mode}-r{r}"
            process_s = run_train(run_dir, common + modes[mode])
            summary = json.loads((run_dir / "summary.json").read_text())
            steps = step_rows(read_metrics(run_dir), skip=1)
            runs[mode].append({"peak_rss_mb": summary["peak_rss_mb"], "process_s": process_s,
                               "s_per_step": statistics.median(s["perf/step_seconds"] for s in steps)})
            console.print(f"round {r} {mode}: peak RSS {summary['peak_rss_mb']:.0f} MB")
    table = {m: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for m, rs in runs.items()}
    out = Table(title=f"LoRA r={args.rank} vs full fine-tuning, {params / 1e6:.0f}M parameters, {args.method}")
    for col in ("mode", "peak RSS MB", "ratio to full", "s/step", "ratio to full"):
        out.add_column(col, justify="right")
    for mode, row in table.items():
        out.add_row(mode, f"{row['peak_rss_mb']:.0f}", f"{row['peak_rss_mb'] / table['full']['peak_rss_mb']:.2f}",
                    f"{row['s_per_step']:.2f}", f"{row['s_per_step'] / table['full']['s_per_step']:.2f}")
    console.print(out)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"settings": vars(args) | {"runs": str(args.runs), "json": str(args.json)},
                                     "parameters": params, "runs": runs, "median": table}, indent=2, default=str))
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
