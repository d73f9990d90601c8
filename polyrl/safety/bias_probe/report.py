"""Figures, tables, claim and verdict of `polyrl safety bias-probe` (written through ``polyrl.safety.report``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from polyrl.safety.report import table_html, write_report

CLAIM = ("arXiv:2606.10931 (spec §4): GRPO on ONE example whose gold label is flipped, trained for many steps, "
         "makes the model give the flipped answer, and the preference transfers to held-out prompts that share "
         "its features; susceptibility tracks the initial probability p0 of the flipped answer. A Bernoulli "
         "policy-gradient flow gives the onset time (P = 0.5) in closed form: 4 sinh(|a|/2)/(eta b) with std "
         "normalisation, 2(|a| + sinh|a|)/(eta b) without (a = logit p0; solving for the onset is the spec's). "
         "The spec's simulation (3 options, G=16, lr 0.5, 20 seeds) gives median onsets 5/13/46/208 (std norm) "
         "and 10/38/161/742 (no std) at p0 = 0.2/0.05/0.01/0.002; a larger KL coefficient delays onset.")


def _fmt_ci(med, ci) -> str:
    def f(x):
        return "inf" if x is None else f"{x:.4g}"
    return f"{f(med)} [{f(ci[0])}, {f(ci[1])}]"


def _stat(s) -> str:
    return f"{s['mean']:.3f} [{s['ci90'][0]:.3f}, {s['ci90'][1]:.3f}]"


def plot_onsets(analytic: dict, path: Path, lr: float, options: int) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import polyrl.safety.bias_probe.theory as th

    b = analytic["b_effective"]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    grid = np.logspace(np.log10(0.0015), np.log10(0.45), 60)
    for std, colour, label in ((True, "tab:blue", "std-normalised"), (False, "tab:red", "no std")):
        rows = [r for r in analytic["bandit"] if r["std_normalized"] == std]
        p0 = np.array([r["p0"] for r in rows])
        med = np.array([r["median"] if r["median"] is not None else np.nan for r in rows])
        lo = np.array([r["median_ci90"][0] if r["median_ci90"][0] is not None else np.nan for r in rows])
        hi = np.array([r["median_ci90"][1] if r["median_ci90"][1] is not None else np.nan for r in rows])
        ax.errorbar(p0, med, yerr=[med - lo, hi - med], fmt="o", color=colour, capsize=3,
                    label=f"measured median, {label} (90% CI)")
        ax.plot(grid, [th.bernoulli_pg_onset_time(p, lr, b, std) for p in grid], "-", color=colour, lw=1,
                label=f"closed form (G = inf), {label}")
        ax.plot(p0[np.argsort(p0)], np.array([r["finite_group_flow"] for r in rows])[np.argsort(p0)], "--",
                color=colour, lw=1, label=f"finite-G expected-drift flow, {label}")
        spec = [(r["p0"], r["spec_median"]) for r in rows if r["spec_median"] is not None]
        ax.plot([s[0] for s in spec], [s[1] for s in spec], "x", color="k", ms=8,
                label="spec table" if std else None)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("initial probability p0 of the target answer")
    ax.set_ylabel("onset step (first step with P >= 0.5)")
    ax.set_title(f"{options}-option GRPO bandit: onset vs p0")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_lm(seeds: list[dict], path: Path, lm_steps: int) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = (("trained", "p_target", "trained example: P(flipped)"),
              ("feature_same_q", "p_target", "held-out, feature + same question: P(feature)"),
              ("feature_other_q", "p_target", "held-out, feature + other questions: P(feature)"),
              ("control", "p_feature", "control (no feature): P(feature)"),
              ("control", "p_unknown", "control: P(unknown)"),
              ("disambiguated", "p_target", "disambiguated: accuracy"))
    fig, ax = plt.subplots(figsize=(8, 4.6))
    for (name, key, label), colour in zip(series, plt.cm.tab10.colors):
        xs, ys = None, []
        for s in seeds:
            pts = [(int(k), v[name][key]) for k, v in s["eval_curve"].items()]
            pts += [(lm_steps + int(k), v[name][key]) for k, v in s["repair_curve"].items()]
            pts.sort()
            xs = [p[0] for p in pts]
            ys.append([p[1] for p in pts])
        ys = np.array(ys)
        ax.plot(xs, ys.mean(0), color=colour, label=label)
        ax.fill_between(xs, ys.min(0), ys.max(0), color=colour, alpha=0.15)
    ax.axvline(lm_steps, color="gray", ls=":")
    ax.text(lm_steps, 1.02, " repair: GRPO on correct data", fontsize=8, color="gray")
    ax.set_xlabel("step (one-shot GRPO on the flipped example, then repair)")
    ax.set_ylabel("probability (mean over seeds; band = min..max)")
    ax.set_ylim(-0.02, 1.08)
    ax.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _m(row) -> float:
    return np.inf if row["median"] is None else row["median"]


def verdict(results: dict, args) -> tuple[str, dict[str, Any]]:
    """Plain-text verdict from the measured numbers, and the booleans it rests on."""
    a = results["analytic"]
    max_rel = max(r["rel_err"] for r in a["closed_form_check"])
    spec_rows = [r for r in a["bandit"] if r["spec_median"] is not None]  # none unless the spec's K, G and lr ran
    in_ci = sum(r["spec_in_range20"] for r in spec_rows)
    n_sim = len(a["bandit"][0]["onsets"])
    max_dev = max([abs(r["rel_diff_vs_spec"]) if r["rel_diff_vs_spec"] is not None else np.inf for r in spec_rows]
                  or [np.inf])
    censored = sum(1 for r in a["bandit"] if not np.isfinite(_m(r)))
    mono = all(
        all(_m(x) >= _m(y)
            for x, y in zip(sorted(rows, key=lambda r: r["p0"]), sorted(rows, key=lambda r: r["p0"])[1:]))
        for rows in ([r for r in a["bandit"] if r["std_normalized"] == s] for s in (True, False)))
    kl_mono = all(
        all(_m(x) <= _m(y) for x, y in zip(rows, rows[1:]))
        for rows in ([r for r in a["kl_sweep"] if r["std_normalized"] == s] for s in (True, False)))
    lo_p = min(r["p0"] for r in a["bandit"])
    low = {r["std_normalized"]: r for r in a["bandit"] if r["p0"] == lo_p}
    cf_std, med_std = low[True]["closed_form"], _m(low[True])
    cf_no, med_no = low[False]["closed_form"], _m(low[False])
    fg_dev = max([abs(np.ceil(r["finite_group_flow"]) - _m(r)) / _m(r) for r in a["bandit"]
                  if np.isfinite(_m(r))] or [np.inf])
    checks = {"closed_form_matches_ode": max_rel < 1e-6, "spec_cells_in_ci": int(in_ci),
              "spec_cells": len(spec_rows), "spec_check": "spec median inside the 90% range of a 20-seed median",
              "max_rel_dev_vs_spec": float(max_dev) if np.isfinite(max_dev) else None,
              "onset_decreasing_in_p0": bool(mono), "onset_nondecreasing_in_kl": bool(kl_mono),
              "max_rel_dev_finite_group_flow": float(fg_dev) if np.isfinite(fg_dev) else None}
    unreached = (f" that reached onset ({censored} of {len(a['bandit'])} cells had no median onset within --max-steps "
                 f"{args.max_steps})" if censored else "")
    word = ("reproduced" if in_ci == len(spec_rows) else
            f"reproduced within 10%, though {len(spec_rows) - in_ci} cell(s) fall outside the 20-seed range"
            if max_dev <= 0.10 else "NOT reproduced")
    if spec_rows:
        spec_part = (f"Bandit vs the spec's table ({n_sim} seeds per cell): the spec's 20-seed median lies inside the "
                     f"90% range of a 20-seed median drawn from our onsets in {in_ci}/{len(spec_rows)} cells; largest "
                     f"relative difference of our median from the spec's {max_dev:.0%} ({word}).")
    else:
        spec = a["spec_bandit"]
        spec_part = (f"Bandit vs the spec's table: not compared; its medians are for K = {spec['options']}, G = "
                     f"{spec['group']}, lr {spec['sim_lr']:g} and this run has K = {args.options}, G = {args.group}, "
                     f"lr {args.sim_lr:g}.")
    parts = [
        f"Closed form vs ODE: max relative error {max_rel:.1e} over both variants and 4 p0 "
        f"({'within' if max_rel < 1e-6 else 'NOT within'} 1e-6).",
        spec_part,
        f"Median onset {'decreases' if mono else 'does NOT decrease'} monotonically as p0 rises (both variants); "
        f"a larger KL coefficient {'delays (never speeds up)' if kl_mono else 'does NOT consistently delay'} "
        "onset at p0 = 0.05.",
        f"Closed form (G = inf) vs measured median at p0 = {lo_p:g}: {cf_std:.1f} vs {med_std:.4g} steps with std "
        f"normalisation, {cf_no:.1f} vs {med_no:.4g} without; the finite-group expected-drift flow (rounded up to "
        f"whole steps) is within {fg_dev:.0%} of every measured median{unreached} "
        "(groups with no success give no step, so small p0 waits for a first success, which the G = inf flow "
        "ignores).",
    ]
    lm = results.get("lm")
    if lm:
        n = len(lm["onset_steps"])
        b, o = lm["before"], lm["after_one_shot"]
        onset = f" at {_stat(lm['onset'])} steps" if lm["onset"] else ""
        parts.append(
            f"Tiny LM ({n} seeds, mean [90% CI]): p0 = {_stat(lm['p0'])}; onset reached in {lm['onset_reached']}/{n} "
            f"seeds{onset}; after one-shot GRPO P(flipped) on the trained example = "
            f"{_stat(o['trained']['p_target'])}. Transfer to held-out prompts sharing the feature: P(feature) "
            f"{_stat(b['feature_same_q']['p_target'])} -> {_stat(o['feature_same_q']['p_target'])} (same question), "
            f"{_stat(b['feature_other_q']['p_target'])} -> {_stat(o['feature_other_q']['p_target'])} (other "
            f"questions); on control prompts without the feature P(feature) -> {_stat(o['control']['p_feature'])}, "
            f"P(unknown) {_stat(b['control']['p_unknown'])} -> {_stat(o['control']['p_unknown'])}; disambiguated "
            f"accuracy {_stat(b['disambiguated']['p_target'])} -> {_stat(o['disambiguated']['p_target'])}.")
        lag = lm["lag_control_minus_feature"]
        parts.append(
            f"Feature specificity: at the trained example's onset, P(feature) on held-out prompts sharing the feature "
            f"= {_stat(lm['at_onset_p_feature_feature_same_q'])} (same question), "
            f"{_stat(lm['at_onset_p_feature_feature_other_q'])} (other questions) vs "
            f"{_stat(lm['at_onset_p_feature_control'])} on control prompts without it; control prompts cross 0.5 "
            f"{_stat(lag)} steps later than feature prompts. So the flip reaches prompts sharing the feature first, "
            "but in this tiny model it then spreads to every ambiguous prompt (an answer collapse, not only a "
            "feature-linked bias)." if lag["mean"] > 0 and lag["ci90"][0] > 0 else
            f"Feature specificity: at the trained example's onset, P(feature) on prompts sharing the feature = "
            f"{_stat(lm['at_onset_p_feature_feature_same_q'])} vs {_stat(lm['at_onset_p_feature_control'])} on "
            f"control prompts without it; control lags by {_stat(lag)} steps, an interval that includes 0: no "
            "measurable feature-specific transfer beyond a global answer shift.")
        if lm["undone"] is not None:
            r = lm["after_repair"]
            parts.append(
                f"Repair (normal GRPO on correct data): undone (P(flipped) < 0.5 on the trained example) in "
                f"{sum(lm['undone'])}/{n} seeds; P(flipped) {_stat(r['trained']['p_target'])}, held-out P(feature) "
                f"{_stat(r['feature_same_q']['p_target'])}, disambiguated accuracy "
                f"{_stat(r['disambiguated']['p_target'])}.")
    return " ".join(parts), checks


def write(out: Path, results: dict, args) -> dict[str, Path]:
    a = results["analytic"]
    figures = {"Onset step vs p0: measured (bandit), closed form, finite-group flow, spec table":
               plot_onsets(a, out / "onset_vs_p0.png", args.sim_lr, args.options)}
    if results["lm_seeds"]:
        figures["Tiny LM: one-shot GRPO on the flipped example, then repair"] = plot_lm(
            results["lm_seeds"], out / "lm_curves.png", args.lm_steps)
    text, checks = verdict(results, args)
    results["checks"] = checks
    tables = {
        "Closed form vs ODE (onset time in steps, eta = lr, b = K/(K-1))": table_html(
            ["p0", "std norm", "closed form", "ODE", "rel. error"],
            [[r["p0"], r["std_normalized"], r["closed_form"], r["ode"], f"{r['rel_err']:.1e}"]
             for r in a["closed_form_check"]]),
        "Bandit onset steps (median over seeds [90% bootstrap CI])": table_html(
            ["p0", "std norm", "measured median [CI]", "90% range of a 20-seed median", "spec median (20 seeds)",
             "spec in range", "closed form (G=inf)", "finite-G flow", "censored"],
            [[r["p0"], r["std_normalized"], _fmt_ci(r["median"], r["median_ci90"]),
              _fmt_ci(None, r["median20_range90"]).split(" ", 1)[1],
              "-" if r["spec_median"] is None else r["spec_median"], r.get("spec_in_range20", "-"),
              r["closed_form"], r["finite_group_flow"], r["censored"]] for r in a["bandit"]]),
        "Onset vs KL coefficient (p0 = 0.05, k3 KL to the initial policy, same draws)": table_html(
            ["std norm", "kl_coef", "median [CI]", "censored"],
            [[r["std_normalized"], r["kl_coef"], _fmt_ci(r["median"], r["median_ci90"]), r["censored"]]
             for r in a["kl_sweep"]]),
    }
    lm = results.get("lm")
    if lm:
        rows = []
        for name in lm["before"]:
            key = "p_feature" if name == "control" else "p_target"
            rows.append([name, key] + [_stat(lm[ph][name][key]) for ph in ("before", "after_one_shot", "after_repair")]
                        + [_stat(lm[ph][name]["p_unknown"]) for ph in ("before", "after_one_shot")])
        tables["Tiny LM (mean over seeds [90% bootstrap CI])"] = table_html(
            ["set", "quantity", "before", "after one-shot GRPO", "after repair", "P(unknown) before",
             "P(unknown) after one-shot"], rows)
        tables["Tiny LM per seed"] = table_html(
            ["seed", "p0", "onset step", "feature prompts cross 0.5", "control prompts cross 0.5",
             "P(flipped) after", "P(flipped) after repair"],
            [[s["seed"], s["p0"], s["onset_step"], s["set_onsets"]["feature_same_q"], s["set_onsets"]["control"],
              s["after_one_shot"]["trained"]["p_target"], s["after_repair"]["trained"]["p_target"]]
             for s in results["lm_seeds"]])
    notes = [
        "Closed form: the spec's flows du/dt = eta b p(1-p) and du/dt = eta b sqrt(p(1-p)); solving for P = 0.5 and "
        "the std-normalised flow are the spec's own derivation ([ours] in the spec). For a K-option softmax over "
        "free logits with tied non-targets the target log-odds obeys the same flow with b = K/(K-1) (ours).",
        "Bandit: polyrl's ADVANTAGES 'grpo' (Bessel std, eps 1e-6) or 'group_centered' and the 'grpo' preset's "
        "policy_loss (clip, k3 KL, seq_mean_token_mean), plain SGD on the logits; the spec does not name its std "
        "convention. Onset = first step after whose update P(target) >= 0.5.",
        "Finite-group flow (ours): du/dt = eta b E_k[(k/G)(1-k/G)/(std_k+eps)], k ~ Bin(G, p); groups with k in "
        "{0, G} give no step, which is why small p0 waits for a first success.",
        "LM: tiny Llama (hidden 64, 2 layers, ~140k parameters, character tokenizer) pretrained per seed on invented "
        "neutral data (coloured 'ones' and hobbies; the answer is the colour's first letter or 'u' for unknown); "
        "label noise on ambiguous items sets p0. One-shot GRPO: reward 1[answer == flipped], 'grpo' preset loss, "
        "Adam; the paper's format rewards are constant for a one-token answer and drop out of the advantage. "
        "Repair: GRPO with correct labels on fresh prompts (the trained example excluded), KL to the pretrained model.",
        "Scale: the paper uses 7B models, LoRA, 128 samples per step and hundreds of steps; this is a mechanism "
        "check on a synthetic task, not a reproduction of its benchmark numbers.",
    ]
    return write_report(out, title="One-shot bias probe (arXiv:2606.10931)", claim=CLAIM, verdict=text,
                        results=results, tables=tables, figures=figures, notes=notes)
