"""Rollout utilization per variant of a `polyrl compare` directory (tree vs uniform sampling).

    .venv/bin/polyrl compare --task addition_mixed --methods uniform=grpo,tree=grpo \\
        --method-args 'tree=--sampler tree' --seeds 3 --steps 100 --group-size 4 --prompts-per-step 16 \\
        --train-prompts 256 --eval-every 25 --workers 2 --out runs/tree-vs-uniform
    .venv/bin/python benchmarks/rollout_utilization.py runs/tree-vs-uniform

For every run: mean ``rollout/utilization`` (share of completions in groups whose rewards differ),
mean ``rollout/useful_groups_per_token``, distinct prompts with mixed outcomes per step (``rollout/groups`` x
``rollout/mixed_group_frac``: held-out gain follows this more than utilization), rollouts generated,
held-out accuracy before/after and, where the run logged them, the final ``eval/retained`` / ``eval/gained``
(held-out prompts the starting model solved that are still solved / the others now solved: a sampler that
learns faster but forgets more shows here); then the mean per variant and the utilization ratio of each
variant to "uniform" (else the first).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def main(out: str) -> None:
    table: dict[str, dict[str, float]] = {}
    for vdir in sorted(p for p in Path(out).iterdir() if p.is_dir()):
        runs = []
        for sdir in sorted(p for p in vdir.iterdir() if (p / "summary.json").exists()):
            rows = [json.loads(line) for line in (sdir / "metrics.jsonl").read_text().splitlines()]
            steps = [r for r in rows if "rollout/utilization" in r]
            summary = json.loads((sdir / "summary.json").read_text())
            run = {"utilization": statistics.mean(r["rollout/utilization"] for r in steps),
                   "useful_groups_per_token": statistics.mean(r["rollout/useful_groups_per_token"] for r in steps),
                   "mixed_prompts_per_step": statistics.mean(r["rollout/groups"] * r["rollout/mixed_group_frac"]
                                                             for r in steps),
                   "rollouts": sum(r["rollout/generated"] for r in steps),
                   "eval_before": summary["eval_before"], "eval_after": summary["eval_after"]}
            final = [r for r in rows if "eval/retained" in r]
            if final:
                run |= {"retained": final[-1]["eval/retained"], "gained": final[-1]["eval/gained"]}
            runs.append(run)
            print(f"{vdir.name:>10} {sdir.name}: " + "  ".join(f"{k} {v:.4g}" for k, v in run.items()))
        if runs:
            table[vdir.name] = {k: statistics.mean(r[k] for r in runs) for k in runs[0] if all(k in r for r in runs)}
    first = "uniform" if "uniform" in table else next(iter(table))
    print()
    for name, row in table.items():
        ratio = row["utilization"] / table[first]["utilization"]
        print(f"{name:>10} mean: " + "  ".join(f"{k} {v:.4g}" for k, v in row.items())
              + f"  utilization x{ratio:.2f} vs {first}")
    (Path(out) / "utilization.json").write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/tree-vs-uniform")
