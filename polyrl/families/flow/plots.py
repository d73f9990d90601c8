"""PNG plots for flow runs: samples before and after training, and reward against KL to the pretrained policy."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def scatter_before_after(before: Mapping[str, Any], after: Mapping[str, Any], task, path: str | Path, *,
                         title: str = "", max_points: int = 1500) -> Path:
    """Two scatter panels of ``evaluate`` points; colour = context class (if any), crosses = rewarded targets."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(9, 4.4), sharex=True, sharey=True)
    for ax, res, label in ((axes[0], before, "before"), (axes[1], after, "after")):
        pts = res["points"][:max_points].float()
        ctx = res["contexts"]
        colour = None
        if ctx is not None and task.name.startswith("ring"):
            colour = ctx[:max_points].argmax(-1).numpy()
        ax.scatter(pts[:, 0].numpy(), pts[:, 1].numpy(), s=3, alpha=0.5, c=colour, cmap="tab10" if colour is not None
                   else None)
        targets = task.modes(ctx[:1] if ctx is not None else None).reshape(-1, 2) if colour is None else None
        if targets is not None:
            ax.scatter(targets[:, 0].numpy(), targets[:, 1].numpy(), marker="x", s=80, c="red", label=task.target_label)
            ax.legend(loc="upper right", fontsize=8)
        ax.set_title(f"{label}: mean reward {res['reward']:.3f}, KL {res['kl']:.2f}")
        ax.set_aspect("equal")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    return _save(plt, fig, path)


def _save(plt, fig, path: str | Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _smooth(x: torch.Tensor, k: int = 5) -> torch.Tensor:
    """Moving average over k points (valid part only)."""
    k = min(k, len(x))
    return torch.nn.functional.conv1d(x[None, None], torch.ones(1, 1, k, dtype=x.dtype) / k)[0, 0]


def reward_vs_kl(curves: Sequence[Mapping[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """One line per run: x = KL to the pretrained policy, y = mean reward (per-step values, smoothed)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    styles = {1: ":", 2: "--", 4: "-"}
    for c in curves:
        kl = torch.tensor(c["kl"], dtype=torch.float64)
        rw = torch.tensor(c["reward"], dtype=torch.float64)
        ax.plot(_smooth(kl).numpy(), _smooth(rw).numpy(), ls=styles.get(c["updates"], "-."), color=c.get("color"),
                label=c["label"], lw=1.6)
    ax.set_xscale("symlog", linthresh=1.0)
    top = max(max(c["kl"]) for c in curves)
    ticks = [t for t in (0, 0.5, 1, 2, 3, 5, 10, 20, 50, 100, 200) if t <= 1.2 * top]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.set_xlabel("KL to the pretrained policy (nats, path KL summed over steps and dims)")
    ax.set_ylabel("mean reward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return _save(plt, fig, path)
