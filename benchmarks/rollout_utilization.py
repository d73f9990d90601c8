"""Rollout utilization against held-out accuracy per variant of `polyrl compare` directories (tree vs uniform).

    .venv/bin/polyrl warmstart --task addition_mixed --threshold 0.5     # prints DIR
    .venv/bin/polyrl compare --task addition_mixed --model DIR --methods uniform=grpo,tree=grpo \\
        --method-args 'tree=--sampler tree --tree-predictor likelihood --tree-root-frac 0.75 --tree-candidates 4' \\
        --seeds 20 --steps 150 --group-size 4 --prompts-per-step 16 --eval-every 25 --workers 2 --out runs/tree-final
    .venv/bin/python benchmarks/rollout_utilization.py runs/tree-final [more compare dirs ...]

For every run: mean ``rollout/utilization`` (share of completions in groups whose rewards differ),
mean ``rollout/useful_groups_per_token``, distinct prompts with mixed outcomes per step (``rollout/groups`` x
``rollout/mixed_group_frac``), rollouts generated, held-out accuracy before/after and, where the run logged
them, the final ``eval/retained`` / ``eval/gained`` (held-out prompts the starting model solved that are still
solved / the others now solved: a sampler that learns faster but forgets more shows here). Then per variant:
the means, the number of seeds, the standard error of the final accuracy and the utilization ratio to
"uniform" (else the first variant). ``utilization.json`` goes into the first directory, and
``utilization_vs_accuracy.png`` plots every variant's final accuracy (mean +- standard error) against its
utilization, so the trade-off between the two reads at a glance.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from _runs import read_metrics


def runs_of(vdir: Path, quiet: bool) -> list[dict[str, float]]:
    runs = []
    for sdir in sorted(p for p in vdir.iterdir() if (p / "summary.json").exists()):
        rows = read_metrics(sdir)
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
        if not quiet:
            print(f"{vdir.name:>10} {sdir.name}: " + "  ".join(f"{k} {v:.4g}" for k, v in run.items()))
    return runs


def plot(table: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for name, row in table.items():
        ax.errorbar(row["utilization"], row["eval_after"], yerr=row["eval_after_se"], fmt="o", capsize=3)
        ax.annotate(f"{name} ({row['seeds']:.0f})", (row["utilization"], row["eval_after"]), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    ax.set_xlabel("rollout utilization (share of completions in mixed groups)")
    ax.set_ylabel("final held-out accuracy (mean +- s.e. over seeds)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dirs", nargs="*", default=["runs/tree-final"], help="polyrl compare output directories")
    p.add_argument("--quiet", action="store_true", help="print the per-variant means only")
    args = p.parse_args()
    table: dict[str, dict[str, float]] = {}
    for out in map(Path, args.dirs):
        for vdir in sorted(p for p in out.iterdir() if p.is_dir()):
            runs = runs_of(vdir, args.quiet)
            if not runs:
                continue
            name = vdir.name if len(args.dirs) == 1 else f"{out.name}/{vdir.name}"
            acc = [r["eval_after"] for r in runs]
            table[name] = {k: statistics.mean(r[k] for r in runs) for k in runs[0] if all(k in r for r in runs)}
            table[name] |= {"seeds": len(runs),
                            "eval_after_se": statistics.stdev(acc) / len(acc) ** 0.5 if len(acc) > 1 else 0.0}
    if not table:
        raise SystemExit(f"no finished runs under {', '.join(args.dirs)}")
    first = next((n for n in table if n.split("/")[-1] == "uniform"), next(iter(table)))
    print()
    for name, row in table.items():
        ratio = row["utilization"] / table[first]["utilization"]
        print(f"{name:>10} mean: " + "  ".join(f"{k} {v:.4g}" for k, v in row.items())
              + f"  utilization x{ratio:.2f} vs {first}")
    first_dir = Path(args.dirs[0])
    (first_dir / "utilization.json").write_text(json.dumps(table, indent=2))
    plot(table, first_dir / "utilization_vs_accuracy.png")
    print(f"\nwrote {first_dir / 'utilization.json'} and {first_dir / 'utilization_vs_accuracy.png'}")


if __name__ == "__main__":
    main()
