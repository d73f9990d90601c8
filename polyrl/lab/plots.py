"""PNG plots of a compare analysis (matplotlib, Agg backend): curves with bootstrap bands, dynamics,
zero-gradient share by position, ScaleRL sigmoid fits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

AXIS_LABELS = {"steps": "RL steps", "rollouts": "cumulative rollouts", "tokens": "cumulative generated tokens"}
PLOTS = ("performance", "dynamics", "zero_grad", "sigmoid")


def _colors(methods: list[str]) -> dict[str, Any]:
    import matplotlib

    # tab10 up to ten methods; tab20 beyond, so that no two methods of one report share a colour (up to 20)
    cmap, n = (matplotlib.colormaps["tab10"], 10) if len(methods) <= 10 else (matplotlib.colormaps["tab20"], 20)
    return {m: cmap(i % n) for i, m in enumerate(methods)}


def _band(ax, c: dict[str, Any] | None, color, label: str) -> bool:
    """Mean with its band where every seed has data; dotted, without a band, where fewer seeds reach (on the
    rollouts and tokens axes seeds end at different x, and a mean over the few that go furthest is not comparable)."""
    if not c or not c["x"]:
        return False
    marker = "o" if len(c["x"]) < 15 else None
    n = c.get("n") or [1] * len(c["x"])
    full = [i for i, k in enumerate(n) if k == max(n)]
    first, last = full[0], full[-1]
    pick = lambda key, idx: [c[key][i] for i in idx]
    solid = list(range(first, last + 1))
    ax.plot(pick("x", solid), pick("mean", solid), color=color, lw=1.6, label=label, marker=marker, ms=3)
    ax.fill_between(pick("x", solid), pick("lo", solid), pick("hi", solid), color=color, alpha=0.18, lw=0)
    for part in (list(range(first + 1)), list(range(last, len(n)))):  # head and tail fewer seeds reach
        if len(part) > 1:
            ax.plot(pick("x", part), pick("mean", part), color=color, lw=1.0, ls=":", marker=marker, ms=2)
    return True


def _finish(ax, title: str, xlabel: str, drew: bool) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel, fontsize=9)
    ax.grid(alpha=0.3)
    ax.tick_params(which="both", labelsize=8)
    if not drew:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="0.5")


def _plot_performance(results, colors, path: Path, plt) -> None:
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), squeeze=False)
    for i, (key, name) in enumerate((("reward/mean", "training reward"), ("eval/accuracy", "held-out accuracy"))):
        for j, axis in enumerate(("steps", "rollouts", "tokens")):
            ax = axes[i][j]
            drew = False
            for m, res in results["methods"].items():
                drew |= _band(ax, res["curves"][key][axis], colors[m], m)
            _finish(ax, f"{name} vs {AXIS_LABELS[axis]}", AXIS_LABELS[axis], drew)
    _legend(fig, axes)
    fig.suptitle(f"mean over seeds, shaded: {results['settings']['ci']:.0%} bootstrap interval; dotted: beyond where "
                 "every seed reaches", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.9, 0.97))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _legend(fig, axes) -> None:
    handles, labels = {}, {}
    for ax in fig.axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
            labels[lab] = lab
    if handles:
        fig.legend(list(handles.values()), list(labels), loc="center right", fontsize=9, frameon=False)


def _plot_dynamics(results, colors, path: Path, plt) -> None:
    keys = (("objective/entropy", "policy entropy"), ("rollout/mean_len", "mean response length"))
    keys += (("objective/approx_kl", "approx KL (old to new)"),)
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8), squeeze=False)
    for ax, (key, name) in zip(axes[0], keys):
        drew = False
        for m, res in results["methods"].items():
            drew |= _band(ax, res["curves"][key]["steps"], colors[m], m)
        _finish(ax, name, "RL steps", drew)
    _legend(fig, axes)
    fig.tight_layout(rect=(0, 0, 0.9, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _plot_zero_grad(results, colors, path: Path, plt) -> None:
    import numpy as np

    fig, ax = plt.subplots(figsize=(9, 3.8))
    ms = [m for m, r in results["methods"].items() if r["zero_grad"]]
    width = 0.8 / max(len(ms), 1)
    for k, m in enumerate(ms):
        zg = results["methods"][m]["zero_grad"]
        qs = [zg[f"q{i}"] for i in range(1, 5)]
        x = np.arange(4) + (k - (len(ms) - 1) / 2) * width
        mean = [q["mean"] if q["mean"] is not None else np.nan for q in qs]
        err = [
            [q["mean"] - q["lo"] if q["mean"] is not None else 0 for q in qs],
            [q["hi"] - q["mean"] if q["mean"] is not None else 0 for q in qs],
        ]
        ax.bar(x, mean, width, yerr=err, color=colors[m], label=m, capsize=2)
    ax.set_xticks(range(4), ["q1 (start)", "q2", "q3", "q4 (end)"])
    ax.set_ylabel("zero-gradient token share", fontsize=9)
    if ms:
        ax.legend(fontsize=8, frameon=False)
    _finish(ax, "clipped/masked (zero-gradient) share of loss tokens by response-position quarter", "", bool(ms))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _plot_sigmoid(results, colors, path: Path, plt) -> None:
    import numpy as np

    from polyrl.lab.stats import sigmoid_law

    s = results["settings"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    drew = False
    for m, res in results["methods"].items():
        sg = res["sigmoid"]
        pts = sg.get("points") or {"C": [], "R": []}
        c = np.array(pts["C"], dtype=float)
        r = np.array(pts["R"], dtype=float)
        keep = c > 0
        if keep.any():
            ax.scatter(c[keep], r[keep], s=12, color=colors[m], alpha=0.55)
            drew = True
        if sg["ok"]:
            grid = np.geomspace(c[keep].min() / 2, c[keep].max() * 4, 200)
            label = f"{m}: A={sg['A']:.3f}, B={sg['B']:.2f}, Cmid={sg['Cmid']:.3g}"
            ax.plot(grid, sigmoid_law(grid, sg["A"], sg["B"], sg["Cmid"], sg["R0"]), color=colors[m], label=label)
            ax.axhline(sg["A"], color=colors[m], ls=":", lw=0.8)
        elif keep.any():
            ax.plot([], [], color=colors[m], ls="none", marker="o", label=f"{m}: no fit")
    if drew:
        ax.set_xscale("log")
        ax.legend(fontsize=8, frameon=False, loc="lower right")
    _finish(
        ax,
        f"ScaleRL sigmoid fit of {s['perf_metric']} vs compute (dotted: asymptote A)",
        AXIS_LABELS[s["compute"]],
        drew,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_plots(results: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write the report's PNGs into ``out_dir`` and return {name: path}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    colors = _colors(list(results["methods"]))
    paths = {}
    for name, fn in zip(PLOTS, (_plot_performance, _plot_dynamics, _plot_zero_grad, _plot_sigmoid)):
        paths[name] = out / f"{name}.png"
        fn(results, colors, paths[name], plt)
    return paths
