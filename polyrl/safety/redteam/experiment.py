"""`polyrl safety redteam`: AdvGRPO co-training on the toy game, summed-reward GRPO vs decoupled GDPO, over seeds.

Variants (every one the same curriculum, sizes and seeds; only the estimator or the judges' scales differ):
- ``summed``: GRPO on the weighted channel sum, judges at their native scales (binary and Likert 1..10);
- ``decoupled``: GDPO (per-channel normalisation), the same judges;
- ``summed-unit`` (control, ``--control``): the summed baseline with the Likert judges mapped to [0, 1].
  GDPO is invariant to that map, so this variant tells whether a difference comes from scale dominance.

Measured per seed over the last ``--final-frac`` of the co-training updates (exact metrics of the tabular game):
ASR (multi-turn episode and single message), defender helpfulness on benign prompts ((Likert - 1) / 9),
oscillation (std over time of the episode ASR), and collapse: the defender complies with attacks
(single-message ASR >= 0.9), over-refuses (helpfulness <= 0.2), or the attacker stops attacking
(episode ASR <= 0.02). Convention [ours]: these thresholds define "collapse" for this toy.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

import polyrl.safety.redteam.game as game
from polyrl.config import ConfigError
from polyrl.errors import FLOAT32_MAX
from polyrl.lab.stats import bootstrap_ci
from polyrl.runs import check_fits
from polyrl.safety.options import add_out_options, check_common, number_list, prepare_out, refuse, settings
from polyrl.safety.redteam.trainer import PHASES, AdversarialCoTrainer, CoTrainConfig, total_updates
from polyrl.safety.report import table_html, write_report
from polyrl.tasks.rewards import load_callable, parse_reward_specs

J = "polyrl.safety.redteam.judges:"
CLAIM = ("AdvGRPO (arXiv:2606.09701, spec §10): attacker and defender co-trained with GRPO using GDPO decoupled "
         "per-channel normalisation; co-training converges toward a mixed equilibrium without collapse, compared "
         "with a single summed reward (where prior work found GRPO co-training unstable).")


# Bytes held at once per unit of --group-size (an update's episodes: their Prompts, transcripts, judge scores and
# tensors, attacker_groups = 16 or defender_prompts = 32 of them a unit), measured as peak resident memory above a small
# run's (`/usr/bin/time`, --group-size 5,000 and 20,000: 106 KB).
GROUP_BYTES = 110 * 1024


OUTPUTS = ("curves.png",)  # the figures, besides the report


def _unit(spec: str) -> str:
    """The [0, 1] variant of a Likert judge of ``judges`` (unchanged for the others)."""
    return spec + "_unit" if spec in (J + "prompt_quality", J + "helpfulness") else spec


def _check(args: argparse.Namespace) -> None:
    """Refuse bad options before anything runs (one line each); the shared rules first (finite, threads)."""
    check_common(args)
    for opt in ("seeds", "group_size", "single_turn_steps", "multi_turn_steps", "co_train_steps", "steps_per_role"):
        v = getattr(args, opt)
        low = 2 if opt == "group_size" else (0 if opt.endswith("_steps") and opt != "co_train_steps" else 1)
        if v < low:
            raise ConfigError(f"--{opt.replace('_', '-')} = {v}: must be an integer >= {low}")
    check_fits({f"--group-size = {args.group_size}": args.group_size * GROUP_BYTES})
    if not 0.0 < args.lr <= 1.0:
        raise ConfigError(f"--lr = {args.lr}: must be in (0, 1]")
    if not 0.0 < args.ci < 1.0:
        raise ConfigError(f"--ci = {args.ci}: must be in (0, 1)")
    if not 0.0 < args.final_frac <= 1.0:
        raise ConfigError(f"--final-frac = {args.final_frac}: must be in (0, 1]")


def _weights(args: argparse.Namespace) -> tuple[list[str], list[str], list[float], list[float]]:
    """Channels and weights of both roles; weights must be finite and > 0, one per channel (nan weights used to
    run and give results unlike any valid weights). Weights are parsed here, not by ``parse_reward_specs``, so the
    message names this tool's option and what it allows; empty weights mean 1 per channel."""
    out = []
    for role in ("attacker", "defender"):
        text = getattr(args, f"{role}_weights") or ""
        given = getattr(args, f"{role}_channels")
        specs, _ = parse_reward_specs(given, None) if given and given.strip() else ([], None)
        if not specs or "task" in specs:  # the game has no task of its own to check against
            refuse(f"--{role}-channels", given, "comma-separated reward functions, each module:function")
        for spec in specs:  # one line naming it when it cannot be imported, before --out is touched
            try:
                load_callable(spec)
            except ValueError as e:
                raise ConfigError(f"--{role}-channels: {e}") from None
        weights = number_list(text, f"--{role}-weights", f"{len(specs)} comma-separated numbers in (0, "
                              f"{FLOAT32_MAX:.3g}], one per channel", lambda v: 0 < v <= FLOAT32_MAX,
                              count=len(specs)) if text.strip() else [1.0] * len(specs)
        out.append((specs, weights))
    (att_specs, att_w), (def_specs, def_w) = out
    return att_specs, def_specs, att_w, def_w


def run_one(variant: str, seed: int, args: argparse.Namespace, att_specs: list[str], def_specs: list[str],
            att_w: list[float], def_w: list[float], on_update=None) -> list[dict[str, Any]]:
    import torch

    torch.manual_seed(seed)
    unit = variant == "summed-unit"
    cfg = CoTrainConfig(group_size=args.group_size, lr=args.lr, steps_per_role=args.steps_per_role,
                        steps={"single_turn": args.single_turn_steps, "multi_turn": args.multi_turn_steps,
                               "co_train": args.co_train_steps})
    trainer = AdversarialCoTrainer(
        game.AttackerPolicy(), game.DefenderPolicy(),
        attacker_channels=[_unit(s) for s in att_specs] if unit else att_specs,
        defender_channels=[_unit(s) for s in def_specs] if unit else def_specs,
        attacker_weights=att_w, defender_weights=def_w,
        estimator="gdpo" if variant == "decoupled" else "summed", curriculum=PHASES, config=cfg, seed=seed)
    return trainer.run(on_update)


def summarize_run(history: list[dict[str, Any]], final_frac: float) -> dict[str, float]:
    """Final-window means of one run, its oscillation and its collapse flags."""
    co = [r for r in history if r["phase"] == "co_train"]
    tail = co[-max(1, int(round(final_frac * len(co)))):]
    asr = np.array([r["asr_multi"] for r in tail])
    asr1 = float(np.mean([r["asr_single"] for r in tail]))
    helpful = float(np.mean([r["helpfulness"] for r in tail]))
    out = {"asr_multi": float(asr.mean()), "asr_single": asr1, "helpfulness": helpful,
           "oscillation": float(asr.std()), "cotrain_swing": float(np.std([r["asr_multi"] for r in co])),
           "attacker_entropy": float(np.mean([r["attacker_entropy"] for r in tail])),
           "defender_collapse": float(asr1 >= 0.9), "over_refusal": float(helpful <= 0.2),
           "attacker_collapse": float(asr.mean() <= 0.02)}
    out["collapse"] = float(max(out["defender_collapse"], out["over_refusal"], out["attacker_collapse"]))
    return out


def _ci(values: list[float], level: float) -> dict[str, float]:
    lo, hi = bootstrap_ci(values, level=level)
    return {"mean": float(np.mean(values)), "lo": lo, "hi": hi}


def _plot(histories: dict[str, list[list[dict[str, Any]]]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    colors = {"summed": "tab:red", "decoupled": "tab:blue", "summed-unit": "tab:gray"}
    for variant, runs in histories.items():
        for ax, key in zip(axes, ("asr_multi", "asr_single", "helpfulness")):
            ys = np.array([[r[key] for r in h] for h in runs])
            x = np.arange(ys.shape[1])
            ax.plot(x, ys.mean(0), color=colors[variant], label=variant)
            ax.fill_between(x, ys.min(0), ys.max(0), color=colors[variant], alpha=0.15)
    first = histories[next(iter(histories))][0]
    starts = [i for i in range(2, len(first)) if first[i]["phase"] != first[i - 1]["phase"]]
    titles = ("attack success rate (2-turn episode)", "attack success rate (single message)",
              "defender helpfulness on benign prompts")
    for ax, title in zip(axes, titles):
        for s in starts:
            ax.axvline(s, color="k", lw=0.5, ls=":")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("update (single-turn | multi-turn | co-training)")
        ax.set_ylim(-0.02, 1.02)
    axes[0].legend()
    fig.suptitle("mean over seeds (band: min-max)", fontsize=9)
    fig.tight_layout()
    path = out / "curves.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def command(args: argparse.Namespace) -> int:
    """Run every variant over the seeds, write report.html and results.json into --out."""
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    _check(args)
    att_specs, def_specs, att_w, def_w = _weights(args)
    rescales = any(_unit(spec) != spec for spec in (*att_specs, *def_specs))  # else the control repeats "summed"
    variants = ["summed", "decoupled"] + (["summed-unit"] if args.control and rescales else [])
    out = prepare_out(args, OUTPUTS)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    histories: dict[str, list[list[dict[str, Any]]]] = {v: [] for v in variants}
    cfg = CoTrainConfig(steps_per_role=args.steps_per_role,
                        steps={"single_turn": args.single_turn_steps, "multi_turn": args.multi_turn_steps,
                               "co_train": args.co_train_steps})
    total = total_updates(cfg) * len(variants) * args.seeds
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as bar:
        task = bar.add_task("redteam", total=total)
        for seed in range(args.seeds):
            for v in variants:
                bar.update(task, description=f"redteam {v} seed {seed}")
                try:
                    histories[v].append(run_one(v, seed, args, att_specs, def_specs, att_w, def_w,
                                                lambda: bar.advance(task)))
                except ValueError as e:  # a channel that cannot be imported, or weights that do not fit
                    raise ConfigError(f"--attacker-channels/--defender-channels: {e}") from None
    wall = time.time() - t0
    per_seed = {v: [summarize_run(h, args.final_frac) for h in histories[v]] for v in variants}
    keys = ("asr_multi", "asr_single", "helpfulness", "oscillation", "cotrain_swing", "collapse")
    stats = {v: {k: _ci([r[k] for r in per_seed[v]], args.ci) for k in keys} for v in variants}
    diffs = {k: _ci([d[k] - s[k] for d, s in zip(per_seed["decoupled"], per_seed["summed"])], args.ci)
             for k in keys}
    verdict = _verdict(stats, diffs, args)
    fig = _plot(histories, out)
    rows = [[v, *(f"{stats[v][k]['mean']:.3f} [{stats[v][k]['lo']:.3f}, {stats[v][k]['hi']:.3f}]" for k in keys)]
            for v in variants]
    rows.append(["decoupled - summed", *(f"{diffs[k]['mean']:+.3f} [{diffs[k]['lo']:+.3f}, {diffs[k]['hi']:+.3f}]"
                                          for k in keys)])
    headers = ["variant", "ASR (2-turn)", "ASR (1 message)", "helpfulness", "ASR oscillation (final window)",
               "ASR swing (whole co-training)", "collapse rate"]
    seed_rows = [[v, i, *(round(r[k], 4) for k in (*keys, "attacker_entropy"))]
                 for v in variants for i, r in enumerate(per_seed[v])]
    results = {"claim": CLAIM, "verdict": verdict, "wall_seconds": wall, "variants": variants, "seeds": args.seeds,
               "ci_level": args.ci, "stats": stats, "decoupled_minus_summed": diffs, "per_seed": per_seed,
               "settings": settings(args),
               "curves": {v: [[{k: r[k] for k in ("update", "phase", "asr_multi", "asr_single", "helpfulness")}
                               for r in h] for h in histories[v]] for v in variants}}
    paths = write_report(
        out, title="AdvGRPO: summed vs decoupled (GDPO) co-training", claim=CLAIM, verdict=verdict, results=results,
        tables={f"Final {args.final_frac:.0%} of co-training: mean [{args.ci:.0%} bootstrap CI over "
                f"{args.seeds} seeds]": table_html(headers, rows),
                "Per seed": table_html(["variant", "seed", *keys, "attacker entropy"], seed_rows)},
        figures={"ASR and helpfulness curves": fig},
        notes=_notes(args, att_specs, def_specs, att_w, def_w, wall) + (
            [f"Control not run: no channel is a 1..10 judge ({J}prompt_quality or {J}helpfulness), so the summed "
             "baseline with [0, 1]-scaled judges would be the summed run again."] if args.control and not rescales
            else []))
    print(f"wrote {paths['html']} and {paths['results']} ({wall:.0f} s)")
    return 0


def _verdict(stats: dict, diffs: dict, args: argparse.Namespace) -> str:
    s, d = stats["summed"], stats["decoupled"]
    parts = [f"Over {args.seeds} seeds, the summed baseline collapsed in {s['collapse']['mean']:.0%} of runs "
             f"(final 2-turn ASR {s['asr_multi']['mean']:.2f}, helpfulness {s['helpfulness']['mean']:.2f}); "
             f"the decoupled (GDPO) version in {d['collapse']['mean']:.0%} (ASR {d['asr_multi']['mean']:.2f}, "
             f"helpfulness {d['helpfulness']['mean']:.2f}, ASR oscillation {d['oscillation']['mean']:.3f} vs "
             f"{s['oscillation']['mean']:.3f})."]
    parts.append(f"Over the whole co-training phase the episode ASR swings (std over updates) by "
                 f"{d['cotrain_swing']['mean']:.3f} [{d['cotrain_swing']['lo']:.3f}, {d['cotrain_swing']['hi']:.3f}] "
                 "for the decoupled version: " + ("it cycles before settling, so 'converges' holds only for the "
                                                  "final window." if d["cotrain_swing"]["mean"] > 0.05 else
                                                  "little cycling."))
    supported = s["collapse"]["mean"] >= 0.5 and d["collapse"]["mean"] <= 0.2
    parts.append("The claim holds on this toy: the summed reward collapses and the decoupled version does not."
                 if supported else "The claim is NOT supported on this toy at these settings.")
    if "summed-unit" in stats:
        u = stats["summed-unit"]
        parts.append(f"Control: the summed baseline with the Likert judges mapped to [0, 1] collapsed in "
                     f"{u['collapse']['mean']:.0%} of runs (ASR {u['asr_multi']['mean']:.2f}, helpfulness "
                     f"{u['helpfulness']['mean']:.2f})"
                     + (", so the baseline's collapse here is scale dominance by the 1..10 judges, which GDPO's "
                        "per-channel normalisation removes (it is invariant to the rescaling)."
                        if u["collapse"]["mean"] < s["collapse"]["mean"] else "."))
    return " ".join(parts)


def _notes(args, att_specs, def_specs, att_w, def_w, wall) -> list[str]:
    return [
        f"Attacker channels {att_specs} weights {att_w}; defender channels {def_specs} weights {def_w}.",
        "Toy game [ours]: tabular attacker (style, obfuscation tokens; turn-2 policy conditioned on the reply) and "
        "tabular defender (style, harm cue) -> comply / safe_complete / refuse; synthetic judges, no real content.",
        f"Curriculum: {args.single_turn_steps} single-turn attacker updates, {args.multi_turn_steps} multi-turn "
        f"attacker updates, {args.co_train_steps} co-training rounds of {args.steps_per_role} attacker + "
        f"{args.steps_per_role} defender updates; group size {args.group_size}, PPO clip 0.2, 2 epochs, Adam lr "
        f"{args.lr}.",
        "Metrics are exact expectations under the tabular policies, not sampled estimates.",
        "Collapse [ours]: single-message ASR >= 0.9 (defender complies), helpfulness <= 0.2 (over-refusal) or "
        "episode ASR <= 0.02 (attacker stops attacking), over the final window.",
        "Channel weights are the experiment's choice (the paper's were not retrieved); with equal weights GDPO's "
        "per-channel z-scores make the fluency channel (deterministic given the prompt) outweigh the noisy binary "
        "attack channel and the attacker stops attacking (measured while building this toy).",
        "No equilibrium of the game is computed: 'converges' is measured as a small final-window ASR std, and "
        "'mixed' as the attacker's message entropy in the per-seed table; a two-turn ASR near 0.8 comes from the "
        "defender having no memory of the first turn (the attacker retries with another message).",
        f"Wall time {wall:.0f} s.",
    ]


def add_parser(subparsers, name: str) -> None:
    """`polyrl safety redteam`: the AdvGRPO experiment."""
    p = subparsers.add_parser(name, help="AdvGRPO: attacker/defender co-training, summed vs decoupled (GDPO)",
                              description=__doc__.split("\n\n")[0])
    add_out_options(p, name)
    p.add_argument("--seeds", type=int, default=5, help="seeds per variant (default 5)")
    p.add_argument("--attacker-channels", default=f"{J}attack_success,{J}prompt_quality",
                   help="attacker reward functions by import path, comma-separated (module:function)")
    p.add_argument("--attacker-weights", default="4,1",
                   help="attacker channel weights, comma-separated ('' for 1 each)")
    p.add_argument("--defender-channels", default=f"{J}safety,{J}helpfulness",
                   help="defender reward functions by import path, comma-separated")
    p.add_argument("--defender-weights", default="2,1",
                   help="defender channel weights, comma-separated ('' for 1 each)")
    p.add_argument("--group-size", type=int, default=8, help="GRPO group size G of each role")
    p.add_argument("--single-turn-steps", type=int, default=40, help="curriculum phase 1: attacker updates")
    p.add_argument("--multi-turn-steps", type=int, default=40, help="curriculum phase 2: attacker updates")
    p.add_argument("--co-train-steps", type=int, default=200, help="curriculum phase 3: alternating rounds")
    p.add_argument("--steps-per-role", type=int, default=1, help="updates of each role per co-training round")
    p.add_argument("--lr", type=float, default=0.05, help="Adam learning rate of both tabular policies")
    p.add_argument("--final-frac", type=float, default=0.2, help="share of co-training updates averaged at the end")
    p.add_argument("--ci", type=float, default=0.9, help="bootstrap interval level over seeds")
    p.add_argument("--control", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the summed baseline with [0, 1]-scaled judges (default on; skipped, with a note, "
                   "when no channel is a 1..10 judge)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.set_defaults(fn=command)
