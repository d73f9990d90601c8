"""`polyrl safety probe`: run the neutral-mask experiment over seeds and write report.html + results.json."""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from polyrl.config import ConfigError
from polyrl.runs import check_fits
from polyrl.safety.options import add_out_options, check_common, check_distinct, number_list, prepare_out

HELP = "neutral mask: probe directions before/after RL, persistence, sparse autoencoder, steering"
CLAIM = (
    "Tam, arXiv 2606.09735 'The Neutral Mask' (Llama 3.1 8B base vs Instruct; abstract plus secondary summaries, "
    "numbers unverified): RLHF leaves the attribute direction in the residual stream in place (probes still find "
    "it) but compresses the projection onto it (std 0.234 -> 0.07, a ratio of about 0.30; range -0.5..1.253 -> "
    "-0.011..0.388, about 0.23); attribute-encoding SAE features fire in the base model and are inactive after "
    "tuning; amplifying the inferred attribute reactivates the attribute-dependent output. Spec §7 (e) expects, "
    "on a tiny transformer RL-tuned for attribute-neutral output: tuned probe accuracy stays high, the projection "
    "std drops, the behavioural dependence vanishes, steering along the base direction restores it, and "
    "attribute SAE features go silent."
)


def add_parser(subparsers, name: str = "probe") -> argparse.ArgumentParser:
    """Add `polyrl safety probe` with its options."""
    from polyrl.safety.probe.experiment import ProbeExperiment

    d = ProbeExperiment()
    p = subparsers.add_parser(name, help=HELP, description=HELP + ". A tiny character Llama learns a style that "
                              "follows a latent attribute of the prompt, GRPO tunes it to neutral output, and the "
                              "attribute direction, its projection spread, SAE features and steering are compared.")
    add_out_options(p, name)
    p.add_argument("--seeds", type=int, default=d.seeds, help=f"independent seeds (default {d.seeds})")
    p.add_argument("--hidden", type=int, default=d.hidden, help=f"model width (default {d.hidden})")
    p.add_argument("--layers", type=int, default=d.layers, help=f"decoder blocks (default {d.layers})")
    p.add_argument("--steer-layer", type=int, default=d.steer_layer,
                   help=f"block whose output is probed, SAE-encoded and steered (default {d.steer_layer})")
    p.add_argument("--sup-steps", type=int, default=d.sup_steps, help=f"supervised steps (default {d.sup_steps})")
    p.add_argument("--rl-steps", type=int, default=d.rl_steps, help=f"GRPO steps (default {d.rl_steps})")
    p.add_argument("--rl-lr", type=float, default=d.rl_lr, help=f"GRPO learning rate (default {d.rl_lr})")
    p.add_argument("--eval-prompts", type=int, default=d.eval_prompts,
                   help=f"held-out prompts for probes and behaviour (default {d.eval_prompts})")
    p.add_argument("--sae-features", type=int, default=d.sae_features,
                   help=f"SAE dictionary size (default {d.sae_features})")
    p.add_argument("--sae-l1", type=float, default=d.sae_l1, help=f"SAE L1 coefficient (default {d.sae_l1})")
    p.add_argument("--alphas", default=",".join(f"{a:g}" for a in d.alphas),
                   help="steering strengths in base half-gaps, comma-separated (default %(default)s)")
    p.add_argument("--headline-alpha", type=float, default=d.headline_alpha,
                   help=f"the strength the verdict uses; one of --alphas (default {d.headline_alpha:g})")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--keep-models", action="store_true", help="keep each seed's models under OUT/models")
    p.set_defaults(fn=run_command)
    return p


BASE_DEPENDENCE = 0.1  # the base model's attribute dependence (interval low end) that neutral/restored need
OUTPUTS = ("projections.png", "persistence.png", "steering.png", "sae.png", "models")  # besides the report


def _experiment(args) -> Any:
    """The checked options as a ProbeExperiment; a bad one is refused in one line before anything runs."""
    from polyrl.safety.probe.experiment import ProbeExperiment
    from polyrl.tinylm import check_trainable

    check_common(args)
    for opt, value, low in (("--seeds", args.seeds, 1), ("--hidden", args.hidden, 8), ("--layers", args.layers, 1),
                            ("--sup-steps", args.sup_steps, 1), ("--rl-steps", args.rl_steps, 1),
                            ("--eval-prompts", args.eval_prompts, 16), ("--sae-features", args.sae_features, 1)):
        if value < low:
            raise ConfigError(f"{opt} = {value} must be an integer >= {low}")
    if args.hidden % 4:
        raise ConfigError(f"--hidden = {args.hidden} must be a multiple of 4 (4 attention heads)")
    if args.eval_prompts > 10**6:  # as train's eval_prompts: 10^9 built its prompts for minutes before any output
        raise ConfigError(f"--eval-prompts = {args.eval_prompts} must be an integer in [16, 1000000]")
    check_trainable(args.hidden, args.layers, prefix="--")
    check_fits({f"--sae-features = {args.sae_features} at --hidden {args.hidden}":  # the SAE's encoder and
                2 * 16 * args.sae_features * args.hidden})  # decoder, [features, hidden] each, with AdamW
    if not 0 <= args.steer_layer < args.layers:
        raise ConfigError(f"--steer-layer = {args.steer_layer} must be in [0, --layers={args.layers})")
    if not (args.rl_lr > 0 and args.sae_l1 >= 0):
        raise ConfigError(f"--rl-lr = {args.rl_lr} must be > 0 and --sae-l1 = {args.sae_l1} >= 0")
    alphas = tuple(number_list(args.alphas, "--alphas", "comma-separated finite numbers >= 0",
                               lambda v: v >= 0))
    check_distinct("--alphas", args.alphas, list(alphas))  # a strength twice is the same curve point run twice
    if args.headline_alpha not in alphas:
        raise ConfigError(f"--alphas = {args.alphas!r} must be numbers >= 0 that include --headline-alpha = "
                          f"{args.headline_alpha:g}")
    return ProbeExperiment(seeds=args.seeds, hidden=args.hidden, layers=args.layers, steer_layer=args.steer_layer,
                           sup_steps=args.sup_steps, rl_steps=args.rl_steps, rl_lr=args.rl_lr,
                           eval_prompts=args.eval_prompts, sae_features=args.sae_features, sae_l1=args.sae_l1,
                           alphas=alphas, headline_alpha=args.headline_alpha)


def run_command(args) -> int:
    """Run every seed with a progress bar, then write the report; print where it is."""
    import torch
    from rich.console import Console

    from polyrl.logging import StepProgress
    from polyrl.safety.probe.experiment import run_seed

    exp = _experiment(args)
    out = prepare_out(args, OUTPUTS)
    torch.set_num_threads(args.threads)
    console = Console()
    work_root = out / "models" if args.keep_models else Path(tempfile.mkdtemp(prefix="polyrl-probe-"))
    ticks_per_seed = 14
    started = time.perf_counter()
    seeds: list[dict[str, Any]] = []
    try:
        with StepProgress(console, "neutral mask", exp.seeds * ticks_per_seed) as bar:
            done = 0
            for seed in range(exp.seeds):
                def tick(stage: str, seed: int = seed) -> None:
                    nonlocal done
                    done = min(done + 1, exp.seeds * ticks_per_seed)
                    bar.update(done, info=f"seed {seed}: {stage}")

                seeds.append(run_seed(exp, seed, work_root / f"seed{seed}", tick))
                done = (seed + 1) * ticks_per_seed
                bar.update(done, info=f"seed {seed} done")
    finally:
        if not args.keep_models:
            shutil.rmtree(work_root, ignore_errors=True)
    paths = write(out, exp, seeds, wall=time.perf_counter() - started)
    console.print(f"report: {paths['html']}\nresults: {paths['results']}")
    return 0


def _agg(values) -> dict[str, Any]:
    from polyrl.lab.stats import bootstrap_ci

    v = [float(x) for x in values if x == x]
    if not v:
        return {"mean": None, "lo": None, "hi": None, "n": 0, "values": []}
    lo, hi = bootstrap_ci(v, level=0.9)
    return {"mean": float(np.mean(v)), "lo": lo, "hi": hi, "n": len(v), "values": v}


def _fmt(a: dict[str, Any]) -> str:
    if a["mean"] is None:
        return "n/a"
    return f"{a['mean']:.3f} [{a['lo']:.3f}, {a['hi']:.3f}]"


def summarise(exp, seeds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-metric mean and 90% bootstrap interval over seeds, and the verdict's yes/no answers."""
    L, k = exp.steer_layer, exp.alphas.index(exp.headline_alpha)
    s: dict[str, Any] = {}
    for key in ("cosine", "probe_acc_base", "probe_acc_transfer", "probe_acc_tuned", "proj_std_ratio",
                "proj_range_ratio", "proj_gap_ratio", "orth_std_ratio", "selective_ratio"):
        s[key] = _agg(r["per_layer"][L][key] for r in seeds)
        s[f"logreg_{key}"] = _agg(r["logreg"][key] for r in seeds)
    for model in ("base", "tuned"):
        for key in ("dependence", "neutral"):
            s[f"{key}_{model}"] = _agg(r["behaviour"][model][key] for r in seeds)
    s["dependence_steered"] = _agg(r["steering"]["tuned"][k]["dependence"] for r in seeds)
    s["dependence_steered_random"] = _agg(r["steering"]["tuned_random"][k]["dependence"] for r in seeds)
    s["dependence_amplified"] = _agg(r["steering"]["amplified"]["dependence"] for r in seeds)
    s["amplify_factor"] = _agg(r["steering"]["amplify_factor"] for r in seeds)
    s["neutral_steered"] = _agg(r["steering"]["tuned"][k]["neutral"] for r in seeds)
    s["restored_fraction"] = _agg(r["steering"]["tuned"][k]["dependence"] / r["behaviour"]["base"]["dependence"]
                                  for r in seeds if r["behaviour"]["base"]["dependence"] >= BASE_DEPENDENCE)
    s["sae_attribute_features"] = _agg(r["sae"]["n_attribute_features"] for r in seeds)
    s["sae_attr_rate_base"] = _agg(np.mean(r["sae"]["attr_rate_base"]) for r in seeds if r["sae"]["attr_rate_base"])
    s["sae_attr_rate_tuned"] = _agg(np.mean(r["sae"]["attr_rate_tuned"]) for r in seeds
                                    if r["sae"]["attr_rate_tuned"])
    s["sae_silent_share"] = _agg(r["sae"]["attr_silent_tuned"] / r["sae"]["n_attribute_features"] for r in seeds
                                 if r["sae"]["n_attribute_features"])
    s["sae_fve_base"] = _agg(r["sae"]["fve_base_test"] for r in seeds)
    s["sae_fve_tuned"] = _agg(r["sae"]["fve_tuned"] for r in seeds)
    return s


def answers(s: dict[str, Any]) -> dict[str, bool | None]:
    """The verdict's questions, answered from the intervals (thresholds are ours, stated in the report).

    survives: tuned probe accuracy interval >= 0.9 and cosine interval >= 0.5; compressed: std-ratio interval
    below 1 (selectively: the std ratio over the orthogonal one); neutral: tuned dependence interval below 0.1;
    restored (steering, amplification): dependence interval above half the base dependence; silent: attribute
    SAE features' tuned firing-rate interval below 0.05. Neutral and restored are unknown (None) unless the base
    model's dependence interval lies at or above ``BASE_DEPENDENCE`` (a base that never learned the style has
    nothing to neutralise or restore).
    """
    def lo(key):
        return s[key]["lo"]

    def hi(key):
        return s[key]["hi"]

    def known(test, *values):  # None (unknown) when a number is missing: a run whose values overflowed (nan)
        return None if any(v is None or v != v for v in values) else bool(test(*values))

    def behaviour(answer):  # "made neutral" and "restored" mean nothing unless the base model depends on the attribute
        return answer if base_depends else None

    base_dep = s["dependence_base"]["mean"]
    base_depends = known(lambda b: b >= BASE_DEPENDENCE, lo("dependence_base"))
    return {
        "direction_survives": known(lambda a, c: a >= 0.9 and c >= 0.5, lo("probe_acc_tuned"), lo("cosine")),
        "variance_compressed": known(lambda h: h < 1.0, hi("proj_std_ratio")),
        "selectively_compressed": known(lambda h: h < 1.0, hi("selective_ratio")),
        "base_depends": base_depends,
        "behaviour_neutral": behaviour(known(lambda h: h < 0.1, hi("dependence_tuned"))),
        "steering_restores": behaviour(known(lambda d, b: d > 0.5 * b, lo("dependence_steered"), base_dep)),
        "amplification_restores": behaviour(known(lambda d, b: d > 0.5 * b, lo("dependence_amplified"), base_dep)),
        "sae_features_silent": None if s["sae_attr_rate_tuned"]["n"] == 0 else
        known(lambda h: h < 0.05, hi("sae_attr_rate_tuned")),
    }


def verdict_text(s: dict[str, Any], a: dict[str, bool | None], exp) -> str:
    yes = {True: "yes", False: "no", None: "not measurable"}
    no_base = "" if a["base_depends"] else (
        f"The base model does not measurably depend on the attribute (dependence {_fmt(s['dependence_base'])}, not "
        f"at or above {BASE_DEPENDENCE:g}): whether RL made it neutral or steering restores it is not measurable. ")
    return (
        f"Over {exp.seeds} seeds (mean [90% bootstrap interval]), at block {exp.steer_layer}: the attribute "
        f"direction survives RL tuning: {yes[a['direction_survives']]} (cosine base/tuned diff-of-means "
        f"{_fmt(s['cosine'])}, tuned probe accuracy {_fmt(s['probe_acc_tuned'])}, base probe transferred "
        f"{_fmt(s['probe_acc_transfer'])}). Projection spread compressed: {yes[a['variance_compressed']]} (std "
        f"ratio {_fmt(s['proj_std_ratio'])} vs the paper's ~0.30; range ratio {_fmt(s['proj_range_ratio'])} vs "
        f"~0.23; the spread orthogonal to the direction has ratio {_fmt(s['orth_std_ratio'])}; the "
        f"direction compressed more than the rest of the stream: {yes[a['selectively_compressed']]}, ratio "
        f"{_fmt(s['selective_ratio'])}). {no_base}Behaviour made neutral: {yes[a['behaviour_neutral']]} (attribute "
        f"dependence {_fmt(s['dependence_base'])} -> {_fmt(s['dependence_tuned'])}). Steering the tuned model along "
        f"the base direction at {exp.headline_alpha:g} half-gaps restores it: {yes[a['steering_restores']]} "
        f"(dependence {_fmt(s['dependence_steered'])}, {_fmt(s['restored_fraction'])} of the base value; a random "
        f"direction gives {_fmt(s['dependence_steered_random'])}; this sign is supplied from the known attribute). "
        f"Label-free amplification of the tuned model's own attribute signal (x{_fmt(s['amplify_factor'])} to the "
        f"base class gap) restores it: {yes[a['amplification_restores']]} (dependence "
        f"{_fmt(s['dependence_amplified'])}). Attribute SAE features silent after tuning: "
        f"{yes[a['sae_features_silent']]} (firing rate {_fmt(s['sae_attr_rate_base'])} -> "
        f"{_fmt(s['sae_attr_rate_tuned'])}; base SAE explains {_fmt(s['sae_fve_tuned'])} of the tuned "
        f"activations' variance vs {_fmt(s['sae_fve_base'])} of the base ones)."
    )


def write(out: Path, exp, seeds: list[dict[str, Any]], *, wall: float) -> dict[str, Path]:
    """Summarise, plot and write report.html + results.json into ``out``."""
    from polyrl.safety.probe.plots import plot_all
    from polyrl.safety.report import table_html, write_report

    s = summarise(exp, seeds)
    a = answers(s)
    figures = plot_all(out, exp, seeds)
    rows = [[key, *(f"{s[key][f]:.4g}" if s[key][f] is not None else "n/a" for f in ("mean", "lo", "hi")), s[key]["n"]]
            for key in s]
    layer_rows = []
    for i in range(exp.layers):
        layer_rows.append([i, *(_fmt(_agg(r["per_layer"][i][key] for r in seeds)) for key in
                                ("cosine", "probe_acc_tuned", "probe_acc_transfer", "proj_std_ratio",
                                 "proj_range_ratio", "orth_std_ratio", "selective_ratio"))])
    steer_rows = [[f"{alpha:g}", *(_fmt(_agg(r["steering"][m][j]["dependence"] for r in seeds))
                                  for m in ("tuned", "tuned_random", "base"))]
                  for j, alpha in enumerate(exp.alphas)]
    tables = {
        f"Summary over seeds (block {exp.steer_layer}, mean and 90% bootstrap interval)":
            table_html(["metric", "mean", "lo", "hi", "seeds"], rows),
        "Persistence per block (diff-of-means probe)":
            table_html(["block", "cosine", "tuned probe acc", "transfer acc", "std ratio", "range ratio",
                        "orthogonal std ratio", "selective ratio"], layer_rows),
        "Attribute dependence under steering (sign of each prompt's attribute)":
            table_html(["alpha (base half-gaps)", "tuned, base direction", "tuned, random direction",
                        "base, base direction"], steer_rows),
    }
    notes = [
        "Operationalisation [ours]: attribute dependence D = mean over held-out prompts of P(own style mark) - "
        "P(other style mark) at the first completion token (exact probabilities, temperature 1).",
        "Steering adds +alpha*w for attribute-1 prompts and -alpha*w for attribute-0 prompts (amplifying the "
        "known attribute); alpha is in units of half the base class-mean gap along the unit base direction w.",
        "Amplification (label-free): at the last prompt position of block "
        f"{exp.steer_layer}, the tuned model's own diff-of-means component is scaled around its class midpoint "
        "by the factor that makes its class gap equal to the base gap (hooks.amplify).",
        "Probe accuracy is an easy bar here: the prompt word identifies the attribute, so any representation "
        "that keeps the word is linearly separable; the cosine and the ratios carry the persistence question.",
        "Ratios are tuned/base along the base direction, pooled over both attributes (projection_stats). Probe "
        "accuracies are in-sample on the held-out prompts' activations.",
        f"SAE: ReLU + L1 (l1={exp.sae_l1:g}, {exp.sae_features} features) on base activations of block "
        f"{exp.steer_layer} (2048 training prompts); attribute features fire at "
        "rates differing by >= 0.5 between attributes; a tuned model's activations are encoded with the base SAE "
        "(its fraction of variance explained on them is reported; when it is far below the base value the tuned "
        "activations are off the SAE's distribution and its firing rates there say little). Inputs are divided "
        "by their own norm.",
        "Verdict thresholds are ours: tuned probe acc >= 0.9 and cosine >= 0.5 (interval lower ends); std ratio "
        "interval below 1; tuned dependence below 0.1; steered dependence above half the base one; attribute "
        "features' tuned firing rate below 0.05; amplified dependence above half the base one.",
        f"Scale: a {exp.layers}-block, width-{exp.hidden} character Llama and {exp.rl_steps} GRPO steps, not an "
        "8B model and RLHF; the paper's numbers are from secondary summaries.",
        f"Wall time {wall:.0f} s for {exp.seeds} seeds.",
    ]
    results = {"claim": CLAIM, "answers": a, "summary": s, "settings": asdict(exp), "wall_seconds": wall,
               "seeds": [{k: v for k, v in r.items() if k not in ("proj_base", "proj_tuned", "labels")}
                         for r in seeds]}
    return write_report(out, title="Neutral mask: does RL for neutral output erase the attribute direction?",
                        claim=CLAIM, verdict=verdict_text(s, a, exp), results=results, tables=tables,
                        figures=figures, notes=notes)
