"""`polyrl safety bias-probe`: the experiment, its plots and its report (spec §4, arXiv:2606.10931).

Part 1 (analytic, seconds): the closed-form onset time vs ODE integration; the spec's 3-option GRPO bandit
(G=16, lr 0.5, 20 seeds) over p0 with and without std normalisation, against the spec's median table, the
infinite-group closed form and the finite-group expected-drift flow; the onset vs the KL coefficient.
Part 2 (tiny LM, minutes): per seed, pretrain a tiny Llama on synthetic QA, GRPO on one flipped example,
measure the flipped answer's probability on it and on held-out prompts sharing the feature, the onset step, and
a repair phase of normal GRPO on correct data.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from polyrl.config import ConfigError
from polyrl.runs import check_fits
from polyrl.safety.options import add_out_options, check_common, flag, prepare_out, settings

SPEC_P0 = (0.2, 0.05, 0.01, 0.002)
SPEC_MEDIANS = {True: (5, 13, 46, 208), False: (10, 38, 161, 742)}  # spec §4(e) table: with / without std norm
SPEC_SEEDS = 20  # seeds behind each of the spec's medians
SPEC_BANDIT = {"options": 3, "group": 16, "sim_lr": 0.5}  # the bandit the spec's medians were measured on


def spec_settings(args) -> bool:
    """Whether the bandit runs the spec table's settings (K, G, lr), so that its medians are comparable."""
    return all(getattr(args, k) == v for k, v in SPEC_BANDIT.items())
EXTRA_P0 = (0.4, 0.1, 0.02, 0.005)
KL_COEFS = (0.0, 0.1, 0.3, 1.0)
# Options of the tiny-LM part only (they change nothing with --seeds 0): flag, type, help; and their defaults.
LM_OPTIONS = (
    ("--pretrain-steps", int, "supervised pretraining steps of the tiny LM"),
    ("--label-noise", float, "fraction of ambiguous pretraining items labelled with a named colour (sets p0)"),
    ("--lm-steps", int, "GRPO steps on the single flipped example"),
    ("--lm-group", int, "GRPO group size on the flipped example"),
    ("--lm-lr", float, "Adam learning rate of the LM GRPO phases"),
    ("--lm-kl", float, "k3 KL coefficient to the pretrained model (paper 0.001)"),
    ("--repair-steps", int, "normal GRPO steps on correct data afterwards (0: none)"),
    ("--eval-every", int, "evaluate the held-out sets every N one-shot steps (repair: every max(N, 5))"),
)
# Bytes held at once per unit, measured as peak resident memory above a small run's (`/usr/bin/time`, one thread): the
# bandit holds about 330 B per drawn answer (--sim-seeds x --group: 1-4 million draws; 150 B at 16 million) and 64 B
# per logit (--sim-seeds x --options: float64 logits, log-probs, gradients; 20 and 80 million), the tiny LM's one-shot
# phase 94-124 B per drawn answer (--lm-group at 4 and 16 million).
DRAW_BYTES, LOGIT_BYTES, LM_DRAW_BYTES = 336, 64, 128
LM_DEFAULTS = {"pretrain_steps": 300, "label_noise": 0.1, "lm_steps": 80, "lm_group": 16, "lm_lr": 1e-3,
               "lm_kl": 0.001, "repair_steps": 100, "eval_every": 2}


OUTPUTS = ("onset_vs_p0.png", "lm_curves.png")  # the figures, besides the report


def add_parser(subparsers, name: str) -> None:
    """Register `polyrl safety bias-probe` and its options."""
    desc = ("One-shot bias (arXiv:2606.10931): closed-form onset time of the Bernoulli policy gradient vs ODE, the "
            "3-option GRPO bandit simulation vs the spec's table, and a tiny LM trained with GRPO on ONE flipped "
            "synthetic example (onset, transfer to held-out prompts sharing the feature, undoing by later training). "
            "Writes report.html and results.json.")
    p = subparsers.add_parser(name, help="one-shot bias: GRPO on one flipped example, onset vs the closed form",
                              description=desc)
    add_out_options(p, name)
    p.add_argument("--sim-seeds", type=int, default=200,
                   help="bandit seeds per p0 (spec: 20; more seeds give the range of a 20-seed median)")
    p.add_argument("--group", type=int, default=16, help="GRPO group size G of the bandit (spec: 16)")
    p.add_argument("--sim-lr", type=float, default=0.5, help="SGD learning rate on the bandit logits (spec: 0.5)")
    p.add_argument("--options", type=int, default=3, help="answer options K of the bandit (spec: 3)")
    p.add_argument("--max-steps", type=int, default=4000, help="bandit step cap; seeds without onset are censored")
    p.add_argument("--seeds", type=int, default=5, help="LM seeds (each pretrains its own tiny model); 0 skips the LM")
    # The LM options default to None so that one given with --seeds 0 (no LM runs) can be told apart and refused;
    # ``_resolve_lm`` fills in LM_DEFAULTS otherwise.
    for flag_, kind, text in LM_OPTIONS:
        dest = flag_[2:].replace("-", "_")
        p.add_argument(flag_, type=kind, default=None, help=f"{text} (default {LM_DEFAULTS[dest]:g})")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.set_defaults(fn=command)


def _fill_lm_defaults(args) -> None:
    """Give the LM options left out (None) their LM_DEFAULTS value."""
    for k, v in LM_DEFAULTS.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)


def _resolve_lm(args) -> None:
    """Refuse LM options given with --seeds 0 (the LM part does not run then, so they would be recorded in the
    results' settings without changing anything); then fill in the defaults of those left out."""
    given = [flag(k) for k in LM_DEFAULTS if getattr(args, k) is not None]
    if args.seeds == 0 and given:
        raise ConfigError(f"{', '.join(given)} given with --seeds = 0: the tiny-LM part does not run; drop them or "
                          "set --seeds >= 1")
    _fill_lm_defaults(args)


def run_settings(args) -> dict[str, Any]:
    """The settings results.json records: without the LM options when --seeds is 0 (they did not run)."""
    return settings(args, drop=() if args.seeds else tuple(LM_DEFAULTS))


def _check(args) -> None:
    """Refuse bad options before anything runs (one line each); resolve the LM options' defaults."""
    def bad(opt, value, allowed):
        raise ConfigError(f"--{opt} = {value!r}; allowed: {allowed}")

    check_common(args)
    if args.seeds < 0:
        bad("seeds", args.seeds, "an integer >= 0")
    _resolve_lm(args)
    for opt, lo in (("sim_seeds", 2), ("group", 2), ("options", 2), ("max_steps", 1), ("pretrain_steps", 1),
                    ("lm_steps", 1), ("lm_group", 2), ("eval_every", 1)):
        if getattr(args, opt) < lo:
            bad(opt.replace("_", "-"), getattr(args, opt), f"an integer >= {lo}")
    if args.options > 2**24:  # torch.multinomial draws from at most 2**24 categories
        bad("options", args.options, f"an integer in [2, {2**24}]")
    if args.repair_steps < 0:
        bad("repair-steps", args.repair_steps, "an integer >= 0")
    for opt in ("sim_lr", "lm_lr"):
        if not getattr(args, opt) > 0:
            bad(opt.replace("_", "-"), getattr(args, opt), "a number > 0")
    if not args.lm_kl >= 0:
        bad("lm-kl", args.lm_kl, "a number >= 0")
    if not 0 <= args.label_noise < 1:
        bad("label-noise", args.label_noise, "a number in [0, 1)")
    needs = {f"--sim-seeds x --group = {args.sim_seeds * args.group} drawn answers a step":
             args.sim_seeds * args.group * DRAW_BYTES,
             f"--sim-seeds x --options = {args.sim_seeds * args.options} logits":
             args.sim_seeds * args.options * LOGIT_BYTES}
    if args.seeds:
        needs[f"--lm-group = {args.lm_group} drawn answers a step"] = args.lm_group * LM_DRAW_BYTES
    check_fits(needs)


def command(args: argparse.Namespace) -> int:
    """Run the experiment with a progress bar, write the report, print where it is."""
    from rich.console import Console

    _check(args)
    prepare_out(args, OUTPUTS)
    console = Console()
    t0 = time.perf_counter()
    paths = run_experiment(args, console=console)
    console.print(f"bias-probe: {time.perf_counter() - t0:.0f} s; report {paths['html']}  results {paths['results']}")
    return 0


def _finite(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def analytic_part(args, progress=None, task=None) -> dict[str, Any]:
    """Closed form vs ODE, the bandit over p0 (both variants) and the KL sweep; every number for results.json."""
    import polyrl.safety.bias_probe.theory as th

    b = th.softmax_effective_b(args.options)
    out: dict[str, Any] = {"b_effective": b, "closed_form_check": [], "bandit": [], "kl_sweep": [],
                           "spec_bandit": SPEC_BANDIT}  # the settings of the spec's table, which the report names
    for p0 in SPEC_P0:
        for std in (True, False):
            cf = th.bernoulli_pg_onset_time(p0, args.sim_lr, b, std)
            ode = th.bernoulli_pg_onset_ode(p0, args.sim_lr, b, std)
            out["closed_form_check"].append({"p0": p0, "std_normalized": std, "closed_form": cf, "ode": ode,
                                             "rel_err": abs(cf - ode) / cf})
    grid = sorted(set(SPEC_P0) | set(EXTRA_P0), reverse=True)
    for std in (True, False):
        for i, p0 in enumerate(grid):
            res = th.simulate_bandit_onsets(p0, seeds=args.sim_seeds, k=args.options, group=args.group,
                                            lr=args.sim_lr, std_normalized=std, max_steps=args.max_steps,
                                            seed=1000 * i + int(std))
            vals = np.where(res.onsets < 0, np.inf, res.onsets).astype(float)
            med, lo, hi = th.median_ci(vals)
            spec = SPEC_MEDIANS[std][SPEC_P0.index(p0)] if p0 in SPEC_P0 and spec_settings(args) else None
            row = {"p0": p0, "std_normalized": std, "onsets": [int(v) for v in res.onsets],
                   "censored": int((res.onsets < 0).sum()), "median": _finite(med),
                   "median_ci90": [_finite(lo), _finite(hi)],
                   "closed_form": th.bernoulli_pg_onset_time(p0, args.sim_lr, b, std),
                   "finite_group_flow": th.finite_group_onset_ode(p0, args.sim_lr, b, args.group, std),
                   "spec_median": spec}
            _, lo20, hi20 = th.median_ci(vals, sample_size=SPEC_SEEDS)
            row["median20_range90"] = [_finite(lo20), _finite(hi20)]
            if spec is not None:
                row["spec_in_ci"] = bool(lo <= spec <= hi)
                row["spec_in_range20"] = bool(lo20 <= spec <= hi20)
                row["rel_diff_vs_spec"] = _finite((med - spec) / spec)
            out["bandit"].append(row)
            if progress is not None:
                progress.advance(task)
    for std in (True, False):
        for kl in KL_COEFS:
            res = th.simulate_bandit_onsets(0.05, seeds=args.sim_seeds, k=args.options, group=args.group,
                                            lr=args.sim_lr, std_normalized=std, kl_coef=kl,
                                            max_steps=args.max_steps, seed=77)  # same draws per kl
            vals = np.where(res.onsets < 0, np.inf, res.onsets).astype(float)
            med, lo, hi = th.median_ci(vals)
            out["kl_sweep"].append({"p0": 0.05, "std_normalized": std, "kl_coef": kl, "median": _finite(med),
                                    "median_ci90": [_finite(lo), _finite(hi)], "censored": int((res.onsets < 0).sum())})
            if progress is not None:
                progress.advance(task)
    return out


def lm_seed(args, seed: int, advance=None) -> dict[str, Any]:
    """One LM seed: pretrain, one-shot GRPO toward the flipped answer, repair; the curves and summary numbers."""
    import torch

    import polyrl.safety.bias_probe.lm as lm

    torch.manual_seed(seed)
    model, tok = lm.build_model(seed)
    enc = lm.Encoder(tok)
    sets = lm.eval_sets()
    lm.pretrain(model, enc, steps=args.pretrain_steps, batch=32, lr=3e-3, label_noise=args.label_noise,
                seed=seed, on_step=advance)
    before = lm.evaluate(model, enc, sets)
    ref = lm.frozen_copy(model)
    probe = lm.probe_item()
    shot = lm.one_shot_probe(model, enc, probe, lm.FEATURE[0], steps=args.lm_steps, group_size=args.lm_group,
                             lr=args.lm_lr, kl_coef=args.lm_kl, eval_sets_=sets, eval_every=args.eval_every,
                             seed=seed, on_step=advance)
    after = shot["eval_curves"][args.lm_steps]
    repair = {}
    if args.repair_steps:
        repair = lm.repair(model, enc, steps=args.repair_steps, prompts=8, group_size=8, lr=args.lm_lr,
                           kl_coef=args.lm_kl, ref_model=ref, eval_sets_=sets, eval_every=max(args.eval_every, 5),
                           seed=seed, on_step=advance)
    final = repair[args.repair_steps] if repair else after
    return {"seed": seed, "p0": shot["train_curve"][0], "onset_step": shot["onset_step"],
            "train_curve": shot["train_curve"], "before": before, "after_one_shot": after, "after_repair": final,
            "eval_curve": {str(k): v for k, v in shot["eval_curves"].items()},
            "repair_curve": {str(k): v for k, v in repair.items()}}


def run_experiment(args, console=None) -> dict[str, Path]:
    """Both parts under one rich progress bar; then figures, tables and the report."""
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    _fill_lm_defaults(args)  # a library caller's parsed options: the LM ones may still be None
    torch.set_num_threads(args.threads)
    console = console or Console()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    n_sim = 2 * len(set(SPEC_P0) | set(EXTRA_P0)) + 2 * len(KL_COEFS)
    n_lm = args.seeds * (args.pretrain_steps + args.lm_steps + args.repair_steps)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        t_sim = progress.add_task("bandit simulation", total=n_sim)
        analytic = analytic_part(args, progress, t_sim)
        t_analytic = time.perf_counter() - t0
        t_lm = progress.add_task("tiny LM seeds", total=max(n_lm, 1))
        seeds = [lm_seed(args, s, advance=lambda _s: progress.advance(t_lm)) for s in range(args.seeds)]
    results = {"settings": run_settings(args), "analytic": analytic,
               "lm": summarize_lm(seeds, args) if seeds else None, "lm_seeds": seeds,
               "seconds": {"analytic": t_analytic, "total": time.perf_counter() - t0}}
    from polyrl.safety.bias_probe.report import write
    return write(out, results, args)


def summarize_lm(seeds: list[dict], args) -> dict[str, Any]:
    """Means over seeds with 90% bootstrap intervals (``polyrl.lab.stats.bootstrap_ci``)."""
    from polyrl.lab.stats import bootstrap_ci

    def stat(values):
        v = [float(x) for x in values]
        lo, hi = bootstrap_ci(v, level=0.9)
        return {"mean": float(np.mean(v)), "ci90": [lo, hi], "values": v}

    names = list(seeds[0]["before"])
    onsets = [s["onset_step"] for s in seeds]
    reached = [o for o in onsets if o is not None]
    summary: dict[str, Any] = {
        "p0": stat([s["p0"] for s in seeds]),
        "onset_reached": len(reached), "onset_steps": onsets,
        "onset": stat(reached) if reached else None,
    }
    for phase in ("before", "after_one_shot", "after_repair"):
        summary[phase] = {n: {"p_target": stat([s[phase][n]["p_target"] for s in seeds]),
                              "p_unknown": stat([s[phase][n]["p_unknown"] for s in seeds]),
                              "p_feature": stat([s[phase][n]["p_feature"] for s in seeds])} for n in names}
    # Transfer: the rise of P(FEATURE) on held-out prompts sharing the feature vs prompts without it.
    for key in ("feature_same_q", "feature_other_q", "control"):
        summary[f"rise_p_feature_{key}"] = stat([s["after_one_shot"][key]["p_feature"] - s["before"][key]["p_feature"]
                                                 for s in seeds])
    # Which held-out prompts adopt the flip first: per set, the first evaluated step with P(feature) >= 0.5
    # (censored at the phase's end), and P(feature) at the first evaluation at or after the trained onset.
    for s in seeds:
        curve = sorted((int(k), v) for k, v in s["eval_curve"].items())
        s["set_onsets"] = {n: next((t for t, v in curve if v[n]["p_feature"] >= 0.5), None) for n in names}
        on = s["onset_step"]
        at = next((v for t, v in curve if on is not None and t >= on), curve[-1][1])
        s["at_onset"] = {n: at[n]["p_feature"] for n in names}
    end = args.lm_steps
    for n in ("feature_same_q", "feature_other_q", "control"):
        summary[f"at_onset_p_feature_{n}"] = stat([s["at_onset"][n] for s in seeds])
        summary[f"set_onset_{n}"] = stat([end if s["set_onsets"][n] is None else s["set_onsets"][n] for s in seeds])
        summary[f"set_onset_censored_{n}"] = sum(s["set_onsets"][n] is None for s in seeds)
    summary["lag_control_minus_feature"] = stat(
        [(end if s["set_onsets"]["control"] is None else s["set_onsets"]["control"])
         - (end if s["set_onsets"]["feature_same_q"] is None else s["set_onsets"]["feature_same_q"]) for s in seeds])
    undone = [bool(s["after_repair"]["trained"]["p_target"] < 0.5) for s in seeds]
    summary["undone"] = undone if args.repair_steps else None
    return summary
