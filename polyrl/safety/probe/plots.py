"""Figures of the neutral-mask report: projections, persistence per block, steering curves, SAE firing rates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def _band(values_per_seed: list[list[float]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    from polyrl.lab.stats import bootstrap_ci

    arr = np.asarray(values_per_seed, dtype=float)  # [seeds, points]
    lo_hi = np.array([bootstrap_ci(arr[:, j], level=0.9) for j in range(arr.shape[1])])
    return arr.mean(0), lo_hi[:, 0], lo_hi[:, 1]


def plot_all(out: Path, exp, seeds: list[dict[str, Any]]) -> dict[str, Path]:
    """Write the PNGs into ``out``; return heading -> path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs: dict[str, Path] = {}
    r0 = seeds[0]
    y = np.asarray(r0["labels"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), sharex=True)
    for ax, key, title in ((axes[0], "proj_base", "base"), (axes[1], "proj_tuned", "RL-tuned")):
        p = np.asarray(r0[key])
        bins = np.linspace(min(np.min(r0["proj_base"]), np.min(r0["proj_tuned"])),
                           max(np.max(r0["proj_base"]), np.max(r0["proj_tuned"])), 50)
        ax.hist(p[y == 1], bins=bins, alpha=0.6, label="attribute 1")
        ax.hist(p[y == 0], bins=bins, alpha=0.6, label="attribute 0")
        ax.set_title(f"{title}: projection on base direction (seed 0, block {exp.steer_layer})", fontsize=8)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    figs["Projection on the base direction, base vs tuned (seed 0)"] = out / "projections.png"
    fig.savefig(figs["Projection on the base direction, base vs tuned (seed 0)"], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.4))
    blocks = np.arange(exp.layers)
    for key, label in (("cosine", "cosine base/tuned"), ("probe_acc_tuned", "tuned probe acc"),
                       ("proj_std_ratio", "std ratio"), ("proj_range_ratio", "range ratio")):
        m, lo, hi = _band([[r["per_layer"][i][key] for i in blocks] for r in seeds])
        ax.errorbar(blocks, m, yerr=[m - lo, hi - m], marker="o", capsize=3, label=label)
    ax.axhline(0.30, ls=":", c="grey", lw=1, label="paper std ratio ~0.30 [sec]")
    ax.set_xlabel("decoder block")
    ax.set_xticks(blocks)
    ax.legend(fontsize=7)
    ax.set_title("Direction persistence (mean, 90% bootstrap interval over seeds)", fontsize=9)
    fig.tight_layout()
    figs["Persistence per block"] = out / "persistence.png"
    fig.savefig(figs["Persistence per block"], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.4))
    alphas = np.asarray(exp.alphas)
    for key, label in (("tuned", "tuned, base direction"), ("tuned_random", "tuned, random direction"),
                       ("base", "base, base direction")):
        m, lo, hi = _band([[s["dependence"] for s in r["steering"][key]] for r in seeds])
        ax.plot(alphas, m, marker="o", label=label)
        ax.fill_between(alphas, lo, hi, alpha=0.2)
    ax.axhline(float(np.mean([r["behaviour"]["base"]["dependence"] for r in seeds])), ls=":", c="grey",
               label="base, unsteered")
    ax.set_xlabel("alpha (base half-gaps), signed by each prompt's attribute")
    ax.set_ylabel("attribute dependence D")
    ax.legend(fontsize=7)
    fig.tight_layout()
    figs["Steering: attribute dependence vs strength"] = out / "steering.png"
    fig.savefig(figs["Steering: attribute dependence vs strength"], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.2))
    for i, r in enumerate(seeds):
        b, t = r["sae"]["attr_rate_base"], r["sae"]["attr_rate_tuned"]
        if b:
            ax.scatter(np.full(len(b), i - 0.12), b, c="C0", s=12, label="base" if i == 0 else None)
            ax.scatter(np.full(len(t), i + 0.12), t, c="C3", s=12, label="tuned" if i == 0 else None)
    ax.set_xlabel("seed")
    ax.set_ylabel("firing rate on preferred attribute")
    ax.set_title("Attribute-selective SAE features (trained on base activations)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    figs["SAE attribute features: firing rates"] = out / "sae.png"
    fig.savefig(figs["SAE attribute features: firing rates"], dpi=110)
    plt.close(fig)
    return figs
