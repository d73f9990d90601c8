"""`polyrl safety ggro`: GGRO vs best-of-N at counted compute on the toy world, plus a reward-hacking check.

Per seed: a fresh grammar, a tiny LM fitted to it, a proxy RM fitted on the LM's embeddings (``toy``); prompts are
<bos> + 2 grammar letters. Best-of-N draws ``--samples`` completions per prompt and selects by the proxy RM; its
expected reward at N is the exact mean over all N-subsets of those draws (order statistics). GGRO decodes each
prompt once per (H*, S) with the same uniforms as best-of-N's first draw. Compute is counted in LM token-forward
equivalents (``Compute.units``; the RM is ``--rm-size`` times the LM). Proxy and true rewards are reported for
both, over seeds with bootstrap intervals.
"""

from __future__ import annotations

import argparse
import math
import time
from math import comb
from pathlib import Path

import numpy as np

from polyrl.config import ConfigError
from polyrl.safety.options import add_out_options, check_common, check_distinct, number_list, prepare_out

CLAIM_RATIO = 0.11
CLAIM = ("Seed blog: GGRO 'beats best-of-16 at 11% of the compute'. Paper (arXiv 2606.09635): 'minimal "
         "computational overhead'; the 11% figure is in no source found (spec §11c).")


OUTPUTS = ("reward_vs_compute.png", "proxy_vs_true.png")  # the figures, besides the report


def add_parser(subparsers, name: str = "ggro") -> None:
    """Register `polyrl safety ggro`."""
    desc = ("GGRO (gradient-guided reward optimisation at decoding time) vs best-of-N at matched counted compute "
            "on a toy LM + proxy RM sharing embeddings; writes report.html and results.json.")
    p = subparsers.add_parser(name, help="GGRO vs best-of-N at counted compute (spec §11)", description=desc)
    p.add_argument("--seeds", type=int, default=5, help="independent worlds (grammar, LM, RM, prompts); >= 2")
    p.add_argument("--prompts", type=int, default=32, help="prompts per seed")
    p.add_argument("--samples", type=int, default=32, help="draws per prompt for best-of-N (>= 16; N = 1..16)")
    p.add_argument("--max-new-tokens", type=int, default=20, help="completion length cap")
    p.add_argument("--thresholds", default="1.0,1.5", help="GGRO entropy thresholds H* in nats, comma-separated")
    p.add_argument("--refinements", default="2,4,8", help="GGRO refinement budgets S, comma-separated integers >= 2")
    p.add_argument("--top-k", type=int, default=8, help="candidate tokens per position for the nudge, at most the toy "
                   "vocabulary of 24 (the paper's 25 is for a real one)")
    p.add_argument("--nudge-temp", type=float, default=0.1, help="softmax temperature of nudge confidences")
    p.add_argument("--nudge-weight", type=float, default=1.0, help="weight w of the embedding-distance bias")
    p.add_argument("--min-segment", type=int, default=2, help="tokens a segment has before the entropy test")
    p.add_argument("--rm-size", type=float, default=1.0, help="RM cost per token relative to the LM's")
    p.add_argument("--lm-steps", type=int, default=300, help="training steps of the tiny LM per seed")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    add_out_options(p, name)
    p.set_defaults(fn=run_command)


def _check(args) -> tuple[list[float], list[int]]:
    """Refuse bad options before anything runs or is written; return the thresholds H* and the budgets S."""
    check_common(args)
    for option, value, low in (("--seeds", args.seeds, 2), ("--prompts", args.prompts, 1),
                               ("--samples", args.samples, 16), ("--max-new-tokens", args.max_new_tokens, 2),
                               ("--top-k", args.top_k, 1), ("--min-segment", args.min_segment, 1),
                               ("--lm-steps", args.lm_steps, 1)):
        if value < low:
            raise ConfigError(f"{option}={value}: must be an integer >= {low}")
    if args.max_new_tokens > 40:
        raise ConfigError(f"--max-new-tokens={args.max_new_tokens}: at most 40 (the toy LM's context is 64)")
    for option, value in (("--nudge-temp", args.nudge_temp), ("--nudge-weight", args.nudge_weight)):
        if not value > 0:
            raise ConfigError(f"{option}={value}: must be > 0")
    if args.rm_size < 0:
        raise ConfigError(f"--rm-size={args.rm_size}: must be >= 0")
    from polyrl.safety.ggro.toy import VOCAB

    if args.top_k > VOCAB:  # it was cut to the vocabulary unseen, while results.json recorded the value asked for
        raise ConfigError(f"--top-k={args.top_k}: at most {VOCAB}, the toy LM's vocabulary")
    if args.min_segment > args.max_new_tokens:  # no segment would be long enough to test: plain decoding
        raise ConfigError(f"--min-segment={args.min_segment}: must be at most --max-new-tokens={args.max_new_tokens}"
                          " (a segment shorter than that is never refined)")
    # the entropy of a next-token distribution over VOCAB tokens is at most ln VOCAB: a higher H* never refines
    most = math.log(VOCAB)
    thresholds = number_list(args.thresholds, "--thresholds", f"comma-separated numbers in (0, {most:.3f}] (ln of "
                             f"the {VOCAB}-token vocabulary, the largest entropy)", lambda v: 0 < v <= most)
    refinements = number_list(args.refinements, "--refinements", "comma-separated integers >= 2 (S = 1 is the "
                              "base decode, with no refinement)", lambda v: v == int(v) and v >= 2)
    check_distinct("--thresholds", args.thresholds, thresholds)  # results are keyed "H={h:g},S={s}"
    check_distinct("--refinements", args.refinements, refinements)
    return thresholds, [int(s) for s in refinements]


def best_of_n_weights(m: int, n: int) -> np.ndarray:
    """P(the draw of ascending rank k, k = 1..m, is the best of a uniform random n-subset) = C(k-1, n-1) / C(m, n).

    So ``E[metric of the best of n] = sum_k w_k metric_(k)`` with draws sorted by the selection score: the exact
    subset average of the m draws (unbiased for best-of-n when the m draws are i.i.d.).
    """
    total = comb(m, n)  # Python's int / int is correctly rounded at any size (a float array of C(k-1, n-1) overflowed)
    return np.array([comb(k - 1, n - 1) / total for k in range(1, m + 1)])


def run_seed(seed: int, cfg: dict, configs: list[tuple[float, int]], advance) -> dict:
    """One world: best-of-N curve and GGRO points (proxy, true, compute), averaged over prompts."""
    import torch

    from polyrl.rollout.generator import SamplingParams
    from polyrl.safety.ggro.core import base_decode, ggro_decode
    from polyrl.safety.ggro.toy import EOS, World, train_lm, train_proxy_rm

    world = World(seed)
    lm = train_lm(world, seed=seed, steps=cfg["lm_steps"])
    embed = lm.embed.weight.detach()
    rm = train_proxy_rm(world, embed, seed=seed)
    advance()

    def proxy(seq: list[int]) -> float:
        with torch.no_grad():
            return float(rm(embed[torch.tensor(seq)][None])[0])

    rng = np.random.default_rng(seed + 3)
    prompts = [s[:3] for s in world.sample(cfg["prompts"], 8, rng)]
    params = SamplingParams(max_new_tokens=cfg["max_new_tokens"], temperature=1.0)
    gen = torch.Generator().manual_seed(seed + 4)
    m, max_n = cfg["samples"], 16
    weights = {n: best_of_n_weights(m, n) for n in range(1, max(m, max_n) + 1)}
    bon = {n: {"proxy": [], "true": [], "units": [], "passes": []} for n in range(1, m + 1)}
    ggro = {c: {"proxy": [], "true": [], "units": [], "lm_units": [], "passes": [], "nudges": [], "segments": []}
            for c in configs}
    for prompt in prompts:
        uniforms = torch.rand(m, cfg["max_new_tokens"], generator=gen)
        toks, _, _, _ = base_decode(lm, prompt, params, uniforms, (EOS,))
        full = [prompt + t for t in toks]
        p = np.array([proxy(s) for s in full])
        t = np.array([world.true_reward(s) for s in full])
        # per draw: LM prompt + generated tokens, one RM forward over the whole sequence
        u = np.array([len(prompt) + len(x) + cfg["rm_size"] * len(s) for x, s in zip(toks, full)])
        passes = np.array([1 + len(x) + 1 for x in toks])
        order = np.argsort(p, kind="stable")
        for n in range(1, m + 1):
            w = weights[n]
            bon[n]["proxy"].append(float(w @ p[order]))
            bon[n]["true"].append(float(w @ t[order]))
            bon[n]["units"].append(n * float(u.mean()))
            bon[n]["passes"].append(n * float(passes.mean()))
        for thr, s in configs:
            res = ggro_decode(lm, rm, prompt, embed=embed, entropy_threshold=thr, num_refinements=s,
                              max_new_tokens=cfg["max_new_tokens"], top_k=cfg["top_k"], nudge_temp=cfg["nudge_temp"],
                              nudge_weight=cfg["nudge_weight"], params=params, uniforms=uniforms[0], eos_ids=(EOS,),
                              min_segment_tokens=cfg["min_segment"])
            seq = prompt + res["ids"]
            c = res["compute"]
            g = ggro[(thr, s)]
            g["proxy"].append(proxy(seq))
            g["true"].append(world.true_reward(seq))
            g["units"].append(c.units(cfg["rm_size"]))
            g["lm_units"].append(float(c.lm_tokens))
            g["passes"].append(float(c.lm_passes + c.rm_forward + c.rm_backward))
            g["nudges"].append(res["num_nudges"])
            g["segments"].append(len(res["segment_bounds"]))
        advance()
    mean = lambda d: {k: float(np.mean(v)) for k, v in d.items()}  # noqa: E731
    return {"bon": {n: mean(v) for n, v in bon.items()}, "ggro": {c: mean(v) for c, v in ggro.items()}}


def _interp_bon(bon: dict, units: float, key: str) -> tuple[float, bool]:
    """Best-of-N ``key`` at compute ``units`` (linear in compute between integer N); flag if beyond the largest N."""
    ns = sorted(bon)
    xs = np.array([bon[n]["units"] for n in ns])
    ys = np.array([bon[n][key] for n in ns])
    return float(np.interp(units, xs, ys)), bool(units > xs[-1])


def analyse(per_seed: list[dict], configs: list[tuple[float, int]], rm_size: float) -> dict:
    """Per-config claim statistics over seeds (means with 90% bootstrap intervals)."""
    from polyrl.lab.stats import bootstrap_ci

    def stat(values) -> dict:
        lo, hi = bootstrap_ci(values, level=0.9)
        return {"mean": float(np.mean(values)), "ci90": [lo, hi], "per_seed": [float(v) for v in values]}

    out = {"bon": {}, "ggro": {}}
    for n in range(1, 17):
        out["bon"][str(n)] = {k: stat([s["bon"][n][k] for s in per_seed]) for k in ("proxy", "true", "units",
                                                                                     "passes")}
    for c in configs:
        rows = [s["ggro"][c] for s in per_seed]
        entry = {k: stat([r[k] for r in rows]) for k in rows[0]}
        b16 = [s["bon"][16] for s in per_seed]
        entry["proxy_minus_bon16"] = stat([r["proxy"] - b["proxy"] for r, b in zip(rows, b16)])
        entry["true_minus_bon16"] = stat([r["true"] - b["true"] for r, b in zip(rows, b16)])
        entry["hack_gap_minus_bon16"] = stat([(r["proxy"] - r["true"]) - (b["proxy"] - b["true"])
                                              for r, b in zip(rows, b16)])
        entry["cost_ratio_vs_bon16"] = stat([r["units"] / b["units"] for r, b in zip(rows, b16)])
        entry["lm_only_cost_ratio_vs_bon16"] = stat(
            [r["lm_units"] / (b["units"] / (1 + rm_size) if rm_size else b["units"]) for r, b in zip(rows, b16)])
        matched = [(_interp_bon(s["bon"], r["units"], "proxy"), _interp_bon(s["bon"], r["units"], "true"))
                   for s, r in zip(per_seed, rows)]
        entry["proxy_minus_bon_matched"] = stat([r["proxy"] - mp[0] for r, (mp, _) in zip(rows, matched)])
        entry["true_minus_bon_matched"] = stat([r["true"] - mt[0] for r, (_, mt) in zip(rows, matched)])
        entry["beyond_bon_range_seeds"] = int(sum(mp[1] for mp, _ in matched))
        entry["proxy_gain_vs_base"] = stat([r["proxy"] - s["bon"][1]["proxy"] for r, s in zip(rows, per_seed)])
        entry["true_gain_vs_base"] = stat([r["true"] - s["bon"][1]["true"] for r, s in zip(rows, per_seed)])
        out["ggro"][f"H={c[0]:g},S={c[1]}"] = entry
    return out


def verdict(stats: dict) -> str:
    """The verdict from the measured numbers: does some GGRO setting beat best-of-16 (proxy reward, 90% interval
    above 0) with a compute ratio whose 90% interval lies at or below 0.11? Checked with the full count (LM + RM
    passes) and, as a sensitivity, with LM token-forwards only (the RM taken as free)."""
    def beats(e: dict, ratio: str) -> bool:
        return e["proxy_minus_bon16"]["ci90"][0] > 0 and e[ratio]["ci90"][1] <= CLAIM_RATIO

    fmt = lambda s: f"{s['mean']:+.3g} [{s['ci90'][0]:+.3g}, {s['ci90'][1]:+.3g}]"  # noqa: E731
    fr = lambda s: f"{s['mean']:.3g} [{s['ci90'][0]:.3g}, {s['ci90'][1]:.3g}]"  # noqa: E731
    ggro = stats["ggro"]
    holds = [k for k, e in ggro.items() if beats(e, "cost_ratio_vs_bon16")]
    holds_lm = [k for k, e in ggro.items() if beats(e, "lm_only_cost_ratio_vs_bon16")]
    cheapest = min(ggro.items(), key=lambda kv: kv[1]["cost_ratio_vs_bon16"]["mean"])
    best = max(ggro.items(), key=lambda kv: kv[1]["proxy_minus_bon_matched"]["mean"])
    winners = [kv for kv in ggro.items() if kv[1]["proxy_minus_bon16"]["ci90"][0] > 0]
    head = (f"HOLDS on this toy for {', '.join(holds)}." if holds else
            "DOES NOT HOLD on this toy: no GGRO setting beats best-of-16 at <= 11% of its counted compute.")
    b16 = stats["bon"]["16"]
    text = (f"{head} Best-of-16: proxy reward {fr(b16['proxy'])}, true {fr(b16['true'])}, "
            f"{fr(b16['units'])} compute units per prompt. Cheapest GGRO ({cheapest[0]}): compute ratio to "
            f"best-of-16 {fr(cheapest[1]['cost_ratio_vs_bon16'])}, proxy minus best-of-16 "
            f"{fmt(cheapest[1]['proxy_minus_bon16'])}. ")
    if winners:
        k, e = min(winners, key=lambda kv: kv[1]["cost_ratio_vs_bon16"]["mean"])
        text += (f"Cheapest GGRO that beats best-of-16 ({k}): proxy {fmt(e['proxy_minus_bon16'])} at compute ratio "
                 f"{fr(e['cost_ratio_vs_bon16'])} (LM compute only: {fr(e['lm_only_cost_ratio_vs_bon16'])}). ")
    text += ("Counting LM compute only (RM free), the claim " +
             (f"holds for {', '.join(holds_lm)}. " if holds_lm else "still does not hold. "))
    text += (f"Best GGRO at matched compute ({best[0]}): proxy minus best-of-N at equal compute "
             f"{fmt(best[1]['proxy_minus_bon_matched'])}, true reward minus best-of-N "
             f"{fmt(best[1]['true_minus_bon_matched'])}; reward hacking: its proxy-minus-true gap exceeds "
             f"best-of-16's by {fmt(best[1]['hack_gap_minus_bon16'])} (means over seeds, 90% bootstrap intervals).")
    return text


def _color(i: int) -> str:
    return ("tab:red", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive")[i % 7]


def _marker(i: int) -> str:
    return "sD^v<>p"[i % 7]


def _figures(stats: dict, out: Path) -> dict[str, Path]:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [str(n) for n in range(1, 17)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key in zip(axes, ("proxy", "true")):
        x = [stats["bon"][n]["units"]["mean"] for n in ns]
        y = np.array([stats["bon"][n][key]["mean"] for n in ns])
        lo = [stats["bon"][n][key]["ci90"][0] for n in ns]
        hi = [stats["bon"][n][key]["ci90"][1] for n in ns]
        ax.plot(x, y, "o-", color="tab:blue", label="best-of-N (N = 1..16)", ms=3)
        ax.fill_between(x, lo, hi, color="tab:blue", alpha=0.2)
        for i, (name, e) in enumerate(stats["ggro"].items()):
            ux, uy = e["units"], e[key]
            ax.errorbar(ux["mean"], uy["mean"],
                        yerr=[[uy["mean"] - uy["ci90"][0]], [uy["ci90"][1] - uy["mean"]]],
                        xerr=[[ux["mean"] - ux["ci90"][0]], [ux["ci90"][1] - ux["mean"]]],
                        fmt=_marker(i), color=_color(i), label=f"GGRO {name}", ms=5)
        ax.axvline(CLAIM_RATIO * stats["bon"]["16"]["units"]["mean"], color="grey", ls=":",
                   label="11% of best-of-16 compute")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("counted compute per prompt (LM token-forward equivalents)")
        ax.set_ylabel(f"{key} reward")
        ax.set_title(f"{key} reward vs counted compute")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    p1 = out / "reward_vs_compute.png"
    fig.savefig(p1, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    ax.plot([stats["bon"][n]["proxy"]["mean"] for n in ns], [stats["bon"][n]["true"]["mean"] for n in ns], "o-",
            color="tab:blue", ms=3, label="best-of-N")
    for i, (name, e) in enumerate(stats["ggro"].items()):
        ax.plot(e["proxy"]["mean"], e["true"]["mean"], _marker(i), color=_color(i), label=f"GGRO {name}")
    lim = ax.get_xlim()
    ax.plot(lim, lim, color="grey", ls="--", lw=0.8, label="true = proxy")
    ax.set_xlabel("proxy RM reward (optimised)")
    ax.set_ylabel("held-out true reward")
    ax.set_title("reward hacking check")
    ax.legend(fontsize=7)
    fig.tight_layout()
    p2 = out / "proxy_vs_true.png"
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    return {"Reward vs counted compute (GGRO points, best-of-N curve; 90% intervals over seeds)": p1,
            "Proxy vs true reward (reward-hacking check)": p2}


def run_command(args: argparse.Namespace) -> int:
    """Run the experiment and write report.html + results.json under ``--out``."""
    thresholds, refinements = _check(args)
    out = prepare_out(args, OUTPUTS)
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from polyrl.safety.report import table_html, write_report

    torch.set_num_threads(args.threads)
    configs = [(h, s) for h in thresholds for s in refinements]
    cfg = {"prompts": args.prompts, "samples": args.samples, "max_new_tokens": args.max_new_tokens,
           "top_k": args.top_k, "nudge_temp": args.nudge_temp, "nudge_weight": args.nudge_weight,
           "min_segment": args.min_segment, "rm_size": args.rm_size, "lm_steps": args.lm_steps}
    started = time.perf_counter()
    per_seed = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as bar:
        task = bar.add_task("ggro: worlds and prompts", total=args.seeds * (args.prompts + 1))
        for seed in range(args.seeds):
            per_seed.append(run_seed(seed, cfg, configs, lambda: bar.advance(task)))
    stats = analyse(per_seed, configs, args.rm_size)
    text = verdict(stats)
    fr = lambda s: f"{s['mean']:.3g} [{s['ci90'][0]:.3g}, {s['ci90'][1]:.3g}]"  # noqa: E731
    bon_rows = [[n, fr(stats["bon"][n]["units"]), fr(stats["bon"][n]["passes"]), fr(stats["bon"][n]["proxy"]),
                 fr(stats["bon"][n]["true"])] for n in ("1", "2", "4", "8", "16")]
    ggro_rows = [[k, fr(e["units"]), fr(e["passes"]), fr(e["proxy"]), fr(e["true"]), fr(e["cost_ratio_vs_bon16"]),
                  fr(e["lm_only_cost_ratio_vs_bon16"]), fr(e["proxy_minus_bon16"]), fr(e["hack_gap_minus_bon16"]),
                  fr(e["proxy_minus_bon_matched"]), fr(e["true_minus_bon_matched"]),
                  f"{e['nudges']['mean']:.2g}/{e['segments']['mean']:.2g}"] for k, e in stats["ggro"].items()]
    tables = {
        "Best-of-N (selected by the proxy RM)": table_html(
            ["N", "compute units", "passes", "proxy reward", "true reward"], bon_rows),
        "GGRO": table_html(["setting", "compute units", "passes", "proxy", "true", "compute / BoN-16",
                            "LM-only compute / BoN-16", "proxy - BoN-16", "(proxy - true) - BoN-16's",
                            "proxy - BoN at equal compute", "true - BoN at equal compute",
                            "nudged/segments"], ggro_rows)}
    figures = _figures(stats, out)
    wall = time.perf_counter() - started
    notes = [
        "Compute = LM token-forwards (KV cache assumed; every regenerated token counted) + rm_size x (RM forward "
        "tokens + 2 x RM backward tokens); 'passes' counts LM calls (prefill + one per token) + RM forwards + "
        f"backwards. rm_size = {args.rm_size} (the paper pairs an 8B LM with an 8B RM).",
        "Best-of-N at N is the exact average over all N-subsets of the per-prompt draws, selected by the proxy RM. "
        "'At equal compute' interpolates best-of-N linearly in compute; beyond N = 16's compute it uses draws up "
        f"to N = {args.samples} (and is clipped at that N).",
        "GGRO uses the same uniforms as best-of-N's first draw (common random numbers); its bias is added at every "
        "position of the previous candidate (the released code forces one position instead).",
        "True reward = letter values - 2 x ungrammatical bigrams; the proxy RM was fitted on grammatical text "
        "only, so gains in proxy that are not gains in true reward are reward hacking.",
        "Toy scale: 20-letter grammar, a 2-layer d = 32 LM, a conv RM; not the paper's 8B models or benchmarks.",
    ]
    results = {"claim": CLAIM, "verdict": text, "config": {**cfg, "seeds": args.seeds, "thresholds": thresholds,
               "refinements": refinements}, "stats": stats, "wall_s": wall}
    paths = write_report(out, title="GGRO vs best-of-N at counted compute (spec §11)", claim=CLAIM, verdict=text,
                         results=results, tables=tables, figures=figures, notes=notes)
    Console().print(f"{text}\nreport: {paths['html']}\nresults: {paths['results']}  ({wall:.0f} s)")
    return 0
