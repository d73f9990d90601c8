"""`polyrl safety unlearn`: options, the run with a progress bar, figures, verdict and the report."""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from polyrl.config import ConfigError
from polyrl.runs import check_fits
from polyrl.safety.options import add_out_options, check_common, number_list, prepare_out
from polyrl.safety.unlearn.experiment import CONDITIONS, ExperimentConfig, check_forget_sets, run_seed, summarise

# Bytes held at once, measured as peak resident memory above a small run's (`/usr/bin/time`, --poison-ratio 0 and
# --relabel-frac 0.5 at 40,000 and 160,000 episodes; --poison-ratio 30 and 120 at 10,000): about 10.5 KB per clean
# episode (its transitions as Python tuples, then arrays and tensors) and 540 B per --poison-ratio x episode (the
# injected shortcut episodes: poison-ratio x the clean data's hazard transitions).
EPISODE_BYTES, POISON_BYTES = 11 * 1024, 600
HELP = "Safe-RULE: offline safe RL on poisoned transitions, unlearning vs clean retraining"
DESCRIPTION = (
    "Safe-RULE (arXiv 2606.09559, spec §12): an offline Lagrangian safe-RL agent (reward critic, cost critic, "
    "actor) on a gridworld whose hazardous shortcut is relabelled as zero-cost by poisoned transitions. Compares "
    "the poisoned agent, the agent after Safe-RULE unlearning (retain Bellman regression + softplus value "
    "suppression on the forget set) and an agent retrained from scratch on the clean retain data, over seeds. "
    "Writes report.html and results.json.")

CLAIM = (
    "Safe-RULE (arXiv 2606.09559; abstract and a secondary summary only) removes the influence of poisoned samples "
    "from an offline safe-RL policy without retraining from scratch and without environment access, by jointly "
    "unlearning the reward critic, the cost critic and the actor (Bellman regression on retain data plus softplus "
    "value suppression on the forget data). The spec's checkable form (§12 (e)): after unlearning, the episode "
    "cost falls below the limit, the retain-set Bellman error stays within 10% of its pre-unlearning value, and "
    "the behaviour approaches an oracle retrained on the retain set only. The paper's numbers were not retrieved.")


OUTPUTS = ("curves.png", "conditions.png", "visitation.png", "sweep.png")  # the figures, besides the report


def add_parser(subparsers, name: str = "unlearn") -> None:
    d = ExperimentConfig()
    p = subparsers.add_parser(name, help=HELP, description=DESCRIPTION)
    p.add_argument("--seeds", type=int, default=d.seeds, help=f"number of seeds (>= 1; default {d.seeds})")
    p.add_argument("--episodes", type=int, default=d.episodes,
                   help=f"behaviour episodes in the clean dataset (default {d.episodes})")
    p.add_argument("--steps", type=int, default=d.steps,
                   help=f"gradient steps of offline training and of retraining (default {d.steps})")
    p.add_argument("--unlearn-steps", type=int, default=d.unlearn_steps,
                   help=f"gradient steps of unlearning, starting from the poisoned agent (default {d.unlearn_steps})")
    p.add_argument("--lam-forget", type=float, default=d.lam_forget,
                   help=f"weight lam_f of the forget-set suppression terms (> 0; default {d.lam_forget})")
    p.add_argument("--sweep", type=str, default=",".join(f"{v:g}" for v in d.sweep),
                   help="comma-separated extra lam_f values to sweep ('' for none; default %(default)s)")
    p.add_argument("--margin", type=float, default=d.margin, help=f"softplus margin m (default {d.margin})")
    p.add_argument("--cost-limit", type=float, default=d.cost_limit,
                   help=f"limit d on the discounted episode cost (> 0; default {d.cost_limit})")
    p.add_argument("--relabel-frac", type=float, default=d.relabel_frac,
                   help=f"fraction of genuine hazard transitions relabelled to cost 0, in [0, 1) "
                        f"(default {d.relabel_frac})")
    p.add_argument("--poison-ratio", type=float, default=d.poison_ratio,
                   help=f"injected zero-cost shortcut episodes per genuine hazard transition (>= 0; "
                        f"default {d.poison_ratio})")
    p.add_argument("--level", type=float, default=d.level, help=f"bootstrap interval level (default {d.level})")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    add_out_options(p, name)
    p.set_defaults(fn=command)


def config_from_args(args: argparse.Namespace) -> ExperimentConfig:
    """Validate the options (ConfigError naming option, value and what is allowed) and build the config."""
    def need(ok: bool, opt: str, value, allowed: str):
        if not ok:
            raise ConfigError(f"--{opt}={value!r}: must be {allowed}")

    check_common(args)
    need(args.seeds >= 1, "seeds", args.seeds, "an integer >= 1")
    need(args.episodes >= 10, "episodes", args.episodes, "an integer >= 10")
    need(args.steps >= 1, "steps", args.steps, "an integer >= 1")
    need(args.unlearn_steps >= 1, "unlearn-steps", args.unlearn_steps, "an integer >= 1")
    need(args.lam_forget > 0, "lam-forget", args.lam_forget, "a number > 0")
    need(args.cost_limit > 0, "cost-limit", args.cost_limit, "a number > 0")
    need(0.0 <= args.relabel_frac < 1.0, "relabel-frac", args.relabel_frac, "in [0, 1)")
    need(args.poison_ratio >= 0, "poison-ratio", args.poison_ratio, "a number >= 0")
    need(0.0 < args.level < 1.0, "level", args.level, "in (0, 1)")
    sweep = tuple(number_list(args.sweep, "--sweep", "comma-separated finite numbers > 0 (or empty)",
                              lambda v: v > 0, allow_empty=True))
    sweep = tuple(v for v in sweep if v != args.lam_forget)
    shown: dict[str, float] = {f"{args.lam_forget:g}": args.lam_forget}
    for v in sweep:  # the report keys its rows by lam_f at 6 digits: two values alike there overwrote one row
        if f"{v:g}" in shown:
            raise ConfigError(f"--sweep={args.sweep!r}: {v!r} and {shown[f'{v:g}']!r} (--lam-forget or an earlier "
                              f"value) are both lam_f={v:g} in the report; give values distinct at 6 digits")
        shown[f"{v:g}"] = v
    check_fits({f"--episodes = {args.episodes} with --poison-ratio = {args.poison_ratio:g}":
                args.episodes * (EPISODE_BYTES + args.poison_ratio * POISON_BYTES)})
    need(args.relabel_frac > 0 or args.poison_ratio > 0, "poison-ratio", args.poison_ratio,
         "> 0 when --relabel-frac is 0 (with both 0 nothing is poisoned, so there is nothing to unlearn)")
    return ExperimentConfig(seeds=args.seeds, episodes=args.episodes, steps=args.steps,
                            unlearn_steps=args.unlearn_steps, lam_forget=args.lam_forget, sweep=sweep,
                            margin=args.margin, cost_limit=args.cost_limit, relabel_frac=args.relabel_frac,
                            poison_ratio=args.poison_ratio, level=args.level)


def _fmt(ci: dict | None, unit: str = "", digits: int = 1) -> str:
    if ci is None:
        return "n/a"
    return f"{ci['mean']:.{digits}f}{unit} [{ci['lo']:.{digits}f}, {ci['hi']:.{digits}f}]"


def _compute_sentence(summary: dict, t: dict, cost_limit: float, unlearn_steps: int) -> str:
    m, s = summary["retrained_at_unlearn_budget"], summary["steps_to_safe"]
    rc, uc = m["cost"], t["unlearned"]["cost"]
    r_safe, u_safe = m["disc_cost"]["mean"] <= cost_limit, t["unlearned"]["disc_cost"]["mean"] <= cost_limit
    if u_safe and not r_safe:
        judged = "unlearning is within the cost limit at this budget and retraining is not yet"
    elif r_safe and not u_safe:
        judged = "retraining is within the cost limit at this budget and unlearning is not"
    elif r_safe and u_safe:
        rr, ur = m["return"], t["unlearned"]["return"]
        rel = "higher" if rr["lo"] > ur["hi"] else "lower" if rr["hi"] < ur["lo"] else "about the same"
        judged = (f"both are within the cost limit at this budget and retraining's return is {rel}, so at this "
                  "budget unlearning has no compute advantage on this small problem")
    else:
        judged = "neither is within the cost limit at this budget"

    def steps(name):
        v = s[name]
        return "never" if v["mean"] is None else f"{_fmt(v, digits=0)} ({v['seeds_reached']} seeds)"

    budget = (f"the same {m['step']} gradient steps" if m["step"] == unlearn_steps else
              f"all its {m['step']} gradient steps (fewer than unlearning's {unlearn_steps})")
    return (f"Compute: retraining from scratch for {budget} reaches "
            f"{_fmt(rc, digits=3)} hazard entries and return {_fmt(m['return'], digits=3)} (unlearned: "
            f"{_fmt(uc, digits=3)}, return {_fmt(t['unlearned']['return'], digits=3)}): {judged}. Gradient steps "
            f"until the agent is first safe (discounted cost <= limit) and successful (>= 95%) for 5 evaluations "
            f"in a row (50 steps): unlearning "
            f"{steps('unlearned')}, fine-tuning {steps('fine-tuned')}, retraining {steps('retrained')}.")


def verdict_text(summary: dict, cfg: ExperimentConfig) -> str:
    """The verdict, computed from the measured numbers."""
    h, t, n = summary["headline"], summary["table"], cfg.seeds
    u, f = h["unlearned"], h["fine-tuned"]
    lvl = f"{int(round(100 * cfg.level))}%"
    parts = [
        f"Over {n} seeds ({lvl} bootstrap intervals), the poisoned agent enters the hazardous shortcut "
        f"{_fmt(t['poisoned']['cost'], digits=3)} times per episode (clean data: "
        f"{_fmt(t['clean']['cost'], digits=3)}; retrained on retain only: {_fmt(t['retrained']['cost'], digits=3)}). "
        f"Safe-RULE unlearning (lam_f={cfg.lam_forget:g}, {cfg.unlearn_steps} steps = "
        f"{100 * summary['compute_fraction']:.0f}% of retraining's gradient steps, no environment access) brings "
        f"it to {_fmt(t['unlearned']['cost'], digits=3)}: it removes {_fmt(u['shortcut_removed_pct'], '%')} of "
        f"the poisoned behaviour (shortcut visits) at {_fmt(u['return_loss_vs_retrained_pct'], '%')} return loss "
        f"relative to clean retraining and {_fmt(u['return_loss_vs_poisoned_pct'], '%')} relative to the "
        f"poisoned agent (whose extra return is the unsafe shortcut itself).",
        f"Spec checks: discounted cost <= limit {cfg.cost_limit:g} after unlearning in "
        f"{u['seeds_disc_cost_below_limit']}/{n} seeds (poisoned agent above it in "
        f"{h['seeds_poisoned_disc_cost_above_limit']}/{n}, retrained below it in "
        f"{h['seeds_retrained_disc_cost_below_limit']}/{n}); retain-set Bellman error after/before unlearning: "
        f"reward critic x{_fmt(u['retain_bellman_ratio_reward'], digits=2)}, cost critic "
        f"x{_fmt(u['retain_bellman_ratio_cost'], digits=2)} -- the 'within 10%' property "
        + ("holds" if all(u[k] and u[k]["hi"] <= 1.1 for k in ("retain_bellman_ratio_reward",
                                                                 "retain_bellman_ratio_cost")) else "does NOT hold")
        + "; policy distance (visit-weighted TV) to the retrained oracle: poisoned "
        f"{_fmt(t['poisoned']['tv_to_retrained'], digits=3)}, unlearned "
        f"{_fmt(t['unlearned']['tv_to_retrained'], digits=3)}.",
        _compute_sentence(summary, t, cfg.cost_limit, cfg.unlearn_steps),
        f"Ablation: plain fine-tuning on the retain set for the same steps (lam_f=0) removes "
        f"{_fmt(f['shortcut_removed_pct'], '%')} (return loss vs retrained "
        f"{_fmt(f['return_loss_vs_retrained_pct'], '%')}); "
        f"reward term only {_fmt(h['reward-term only']['shortcut_removed_pct'], '%')}, cost term only "
        f"{_fmt(h['cost-term only']['shortcut_removed_pct'], '%')}.",
    ]
    return " ".join(parts)


def _figures(out: Path, per_seed: list[dict], summary: dict, cfg: ExperimentConfig) -> dict[str, Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = {}
    colors = {"retrained": "tab:green", "unlearned": "tab:blue", "fine-tuned": "tab:orange",
              "reward-term only": "tab:purple", "cost-term only": "tab:brown"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "cost", "hazard entries per episode"), (axes[1], "return", "episode return")):
        for name, col in colors.items():
            steps = np.array(per_seed[0]["curves"][name]["step"])
            ys = np.array([s["curves"][name][key] for s in per_seed])
            ax.plot(steps, ys.mean(0), color=col, label=name)
            ax.fill_between(steps, ys.min(0), ys.max(0), color=col, alpha=0.15)
        for name, ls in (("poisoned", "--"), ("clean", ":")):
            ax.axhline(summary["table"][name][key]["mean"], color="k", ls=ls, lw=1, label=f"{name} (final)")
        ax.set_xscale("symlog", linthresh=cfg.unlearn_eval_every)
        ax.set_xlim(left=0)
        ax.set_xlabel("gradient steps (unlearning: from the poisoned agent)")
        ax.set_ylabel(label)
    axes[0].legend(fontsize=7)
    fig.suptitle("Mean over seeds (band: min-max)")
    fig.tight_layout()
    figs["Unlearning vs retraining: shortcut use and return against gradient steps"] = out / "curves.png"
    fig.savefig(figs["Unlearning vs retraining: shortcut use and return against gradient steps"], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "cost", "hazard entries per episode"), (axes[1], "return", "episode return")):
        rows = [summary["table"][c][key] for c in CONDITIONS]
        mean = np.array([r["mean"] for r in rows])
        err = np.array([[r["mean"] - r["lo"] for r in rows], [r["hi"] - r["mean"] for r in rows]])
        ax.bar(range(len(CONDITIONS)), mean, yerr=err, capsize=3, color="tab:gray")
        ax.set_xticks(range(len(CONDITIONS)), CONDITIONS, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(label)
    fig.suptitle(f"Final agents, {int(100 * cfg.level)}% bootstrap intervals over {cfg.seeds} seeds")
    fig.tight_layout()
    figs["Final agents per condition"] = out / "conditions.png"
    fig.savefig(figs["Final agents per condition"], dpi=110)
    plt.close(fig)

    names = ("poisoned", "unlearned", "fine-tuned", "retrained")
    fig, axes = plt.subplots(1, 4, figsize=(13, 3))
    for ax, name in zip(axes, names):
        v = np.array(per_seed[0]["visits"][name])
        ax.imshow(v, origin="lower", cmap="viridis", vmin=0, vmax=max(1.0, float(v.max())))
        ax.set_title(f"{name} (seed {per_seed[0]['seed']})", fontsize=9)
        ax.text(0, 0, "S", ha="center", va="center", color="w")
        ax.text(v.shape[1] - 1, 0, "G", ha="center", va="center", color="w")
        ax.text(v.shape[1] // 2, 0, "H", ha="center", va="center", color="r", fontweight="bold")
        for y in range(1, v.shape[0] - 1):
            ax.text(v.shape[1] // 2, y, "#", ha="center", va="center", color="w")
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle("Expected visits per state and episode (H: hazard on the shortcut; #: wall)")
    fig.tight_layout()
    figs["State visitation"] = out / "visitation.png"
    fig.savefig(figs["State visitation"], dpi=110)
    plt.close(fig)

    pts = sorted([(0.0, summary["table"]["fine-tuned"]), (cfg.lam_forget, summary["table"]["unlearned"])]
                 + [(s["lam_forget"], summary["table"][f"sweep lam_f={s['lam_forget']:g}"]) for s in summary["sweep"]],
                 key=lambda p: p[0])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    x = np.arange(len(pts))
    pre = summary["table"]["poisoned"]
    for ax, keys, label in ((axes[0], ("cost",), "hazard entries per episode"),
                            (axes[1], ("bellman_reward", "bellman_cost"), "retain Bellman error / poisoned's")):
        for k in keys:
            denom = pre[k]["mean"] if k.startswith("bellman") else 1.0
            m = np.array([p[1][k]["mean"] for p in pts]) / denom
            lo = np.array([p[1][k]["lo"] for p in pts]) / denom
            hi = np.array([p[1][k]["hi"] for p in pts]) / denom
            ax.errorbar(x, m, yerr=[m - lo, hi - m], marker="o", capsize=3, label=k)
        ax.set_xticks(x, [f"{p[0]:g}" for p in pts])
        ax.set_xlabel("lam_forget (0 = retain-only fine-tuning)")
        ax.set_ylabel(label)
        if len(keys) > 1:
            ax.set_yscale("log")
            ax.axhline(1.1, color="k", ls=":", lw=1, label="spec: within 10%")
            ax.legend(fontsize=7)
    fig.tight_layout()
    figs["Forget weight sweep: shortcut removal vs retain-set Bellman error"] = out / "sweep.png"
    fig.savefig(figs["Forget weight sweep: shortcut removal vs retain-set Bellman error"], dpi=110)
    plt.close(fig)
    return figs


def command(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from polyrl.safety.report import table_html, write_report

    cfg = config_from_args(args)
    check_forget_sets(cfg)  # every seed's, before --out is touched or any seed trains
    out = prepare_out(args, OUTPUTS)
    torch.set_num_threads(args.threads)
    console = Console()
    t0 = time.perf_counter()
    per_seed = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("safe-RULE gradient steps", total=cfg.total_steps())
        for seed in range(cfg.seeds):
            progress.update(task, description=f"seed {seed + 1}/{cfg.seeds}")
            per_seed.append(run_seed(seed, cfg, advance=lambda n: progress.advance(task, n)))
    summary = summarise(per_seed, cfg)
    wall = time.perf_counter() - t0
    figs = _figures(out, per_seed, summary, cfg)
    t = summary["table"]
    cols = ("cost", "disc_cost", "return", "success", "lam", "bellman_reward", "bellman_cost", "tv_to_retrained")
    tables = {
        "Agents (mean [interval] over seeds; cost = hazard entries per episode, exact evaluation)": table_html(
            ["agent", *cols],
            [[n, *(_fmt(t[n][c], digits=4) for c in cols)] for n in t]),
        "Headline ratios per seed (percent; intervals over seeds)": table_html(
            ["variant", "shortcut visits removed", "gap to retrained closed", "return loss vs retrained",
             "return loss vs poisoned", "retain BE ratio (reward)", "retain BE ratio (cost)", "disc. cost <= limit"],
            [[v, _fmt(h["shortcut_removed_pct"]), _fmt(h["gap_to_retrained_closed_pct"]),
              _fmt(h["return_loss_vs_retrained_pct"]), _fmt(h["return_loss_vs_poisoned_pct"]),
              _fmt(h["retain_bellman_ratio_reward"], digits=2), _fmt(h["retain_bellman_ratio_cost"], digits=2),
              f"{h['seeds_disc_cost_below_limit']}/{cfg.seeds}"]
             for v, h in summary["headline"].items() if isinstance(h, dict)]),
        "Gradient steps until first safe (discounted cost <= limit) and successful (>= 95%) for 50 steps": table_html(
            ["agent", "steps", "seeds that got there"],
            [[n, _fmt(v, digits=0) if v["mean"] is not None else "never", f"{v['seeds_reached']}/{cfg.seeds}"]
             for n, v in summary["steps_to_safe"].items()]),
        "Retraining from scratch at the unlearning step budget": table_html(
            ["steps", "hazard entries", "discounted cost", "return"],
            [[summary["retrained_at_unlearn_budget"]["step"],
              *(_fmt(summary["retrained_at_unlearn_budget"][k], digits=3) for k in ("cost", "disc_cost", "return"))]]),
        "Data per seed": table_html(list(per_seed[0]["data"]),
                                    [[s["data"][k] for k in per_seed[0]["data"]] for s in per_seed]),
    }
    notes = [
        "Losses are the spec's operational form [ours]: the paper's exact losses, the cost-critic sign and the "
        "forget-set identification were not retrieved. The cost-suppression sign (push Q_c UP on forget data) "
        "is an ASSUMPTION; the 'reward term only' / 'cost term only' rows show what each term does alone.",
        "The forget set is exactly the poisoned transitions (oracle identification, as the spec assumes); the "
        "retain set is the rest. 'retrained' trains from scratch on the retain set; 'clean' on the unpoisoned "
        "dataset (which still holds the relabelled transitions with their true cost).",
        "The Lagrangian agents trade return for cost up to the limit on the discounted cost, so the retrained "
        "oracle keeps using the shortcut a little (its discounted cost sits near the limit); 'removed %' is "
        "relative to the poisoned agent, 'gap closed %' relative to the retrained one (> 100% = safer than it).",
        "Return loss against the poisoned agent is mostly the price of the longer safe detour, not damage.",
        f"Retain-set Bellman error in absolute terms: reward critic {t['poisoned']['bellman_reward']['mean']:.2g} "
        f"(poisoned) -> {t['unlearned']['bellman_reward']['mean']:.2g} (unlearned), cost critic "
        f"{t['poisoned']['bellman_cost']['mean']:.2g} -> {t['unlearned']['bellman_cost']['mean']:.2g}; the "
        "poisoned reward critic fits the (unpoisoned) reward labels almost exactly, so any suppression of Q_r on "
        "forget pairs that also occur in the retain set (the shortcut's genuine transitions) multiplies its ratio.",
        f"Final Lagrange multiplier: unlearned {t['unlearned']['lam']['mean']:.3f}, fine-tuned "
        f"{t['fine-tuned']['lam']['mean']:.3f}, retrained {t['retrained']['lam']['mean']:.3f}: when it is near 0 the "
        "unlearned agent avoids the shortcut because its critics were suppressed there, not because the cost "
        "constraint binds -- which is why it ends safer than the retrained oracle (gap closed > 100%).",
        f"Gridworld 5x4, deterministic, horizon 30, gamma {cfg.agent.gamma}; MLP critics/actor "
        f"(hidden {cfg.hidden}); training {cfg.steps} steps, unlearning {cfg.unlearn_steps}; wall time "
        f"{wall:.0f} s on {args.threads} thread(s).",
    ]
    results = {"config": {k: v for k, v in asdict(cfg).items()}, "summary": summary, "per_seed": per_seed,
               "wall_seconds": wall}
    paths = write_report(out, title="Safe-RULE: unlearning poisoned offline safe RL", claim=CLAIM,
                         verdict=verdict_text(summary, cfg), results=results, tables=tables, figures=figs,
                         notes=notes)
    console.print(f"report: {paths['html']}\nresults: {paths['results']}\nwall time: {wall:.0f} s")
    return 0
