"""Reward shapers and group filters.

Shapers: ``fn(rewards [B], lengths [B], truncated [B] bool, max_len, *, settings) -> rewards [B]``,
applied in order after the task scores the completions. ``max_len`` is the generation cap of the
run (the trainer passes it), so presets stay valid for any generation length.

Filters: ``fn(rewards [B], group_ids [B], truncated [B], history, *, settings) -> keep [B] bool``; the
collector passes the task scores *before* shaping (DAPO filters groups on accuracy).
``history`` maps a group (prompt) id to the best pass rate seen for it in earlier batches.
Dynamic sampling (refilling the batch after filtering) lives in ``rollout.collect`` only; filters
just say what to drop. Samples are dropped *after* advantages are computed on the full group, so a
dropped truncated sample still counts in its group's statistics (DAPO's overlong filtering masks
the loss only).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from polyrl.registry import FILTERS, SHAPERS


def _check_overlong(p: dict) -> str | None:
    if p["cache_len"] is not None and p["cache_len"] <= 0:
        return f"parameter 'cache_len' = {p['cache_len']} must be > 0 (or None to use cache_frac)"
    return None


@SHAPERS.register(
    "overlong_soft",
    paper="arXiv:2503.14476",
    ranges={"cache_frac": "(0, 1]", "penalty": ">=0"},
    check=_check_overlong,
)
def overlong_soft(
    rewards: Tensor,
    lengths: Tensor,
    truncated: Tensor,
    max_len: int,
    *,
    cache_frac: float = 0.2,
    cache_len: int | None = None,
    penalty: float = 1.0,
) -> Tensor:
    """Add DAPO's soft overlong punishment to the reward.

    R_len = 0 if |y| <= L_max - L_cache; ((L_max - L_cache) - |y|) / L_cache if inside the cache
    band; -1 beyond L_max; scaled by ``penalty``. L_max is the run's generation cap, L_cache =
    ``cache_len`` tokens or ``cache_frac`` * L_max (the paper: 4096 of 20480 = 0.2). As in verl,
    generation is capped at L_max, so -1 is reached exactly at |y| = L_max.
    """
    l_cache = float(cache_len if cache_len is not None else max(1.0, cache_frac * max_len))
    start = max_len - l_cache
    lengths = lengths.to(rewards.dtype)
    r_len = torch.clamp((start - lengths) / l_cache, min=-1.0, max=0.0)
    return rewards + penalty * r_len


@SHAPERS.register("length_penalty", ranges={"coef": ">=0"})
def length_penalty(
    rewards: Tensor, lengths: Tensor, truncated: Tensor, max_len: int, *, coef: float = 0.1
) -> Tensor:
    """Subtract a linear length cost: r - coef * |y| / L_max (a plain baseline shaper, no paper)."""
    return rewards - coef * lengths.to(rewards.dtype) / float(max_len)


def _group_index(group_ids: Tensor) -> tuple[Tensor, Tensor]:
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    return uniq, inverse


@FILTERS.register("zero_variance", paper="arXiv:2503.14476", ranges={"tol": ">=0"})
def zero_variance(
    rewards: Tensor, group_ids: Tensor, truncated: Tensor, history: Mapping[int, float] | None, *, tol: float = 1e-6
) -> Tensor:
    """Drop groups whose rewards are all equal (max - min <= tol): they carry no group-relative signal.

    DAPO's dynamic sampling and ScaleRL's zero-variance filtering; a group of one is dropped too.
    """
    uniq, inverse = _group_index(group_ids)
    r = rewards.to(torch.float64)
    hi = torch.full((len(uniq),), -float("inf"), dtype=r.dtype).scatter_reduce(0, inverse, r, "amax")
    lo = torch.full((len(uniq),), float("inf"), dtype=r.dtype).scatter_reduce(0, inverse, r, "amin")
    return ((hi - lo) > tol)[inverse]


@FILTERS.register("overlong_filter", paper="arXiv:2503.14476")
def overlong_filter(
    rewards: Tensor, group_ids: Tensor, truncated: Tensor, history: Mapping[int, float] | None
) -> Tensor:
    """Drop truncated samples from the loss (DAPO overlong filtering; off in the paper's best runs)."""
    return ~truncated.bool()


@FILTERS.register("no_positive_resampling", paper="arXiv:2510.13786", ranges={"threshold": "(0, 1]"})
def no_positive_resampling(
    rewards: Tensor,
    group_ids: Tensor,
    truncated: Tensor,
    history: Mapping[int, float] | None,
    *,
    threshold: float = 0.9,
) -> Tensor:
    """Drop prompts whose pass rate in an earlier batch reached ``threshold`` (ScaleRL: >= 0.9, for good)."""
    if history is None:
        raise ValueError("filter 'no_positive_resampling' needs the pass-rate history (got None)")
    done = [history.get(int(g), 0.0) >= threshold for g in group_ids.tolist()]
    return ~torch.tensor(done, dtype=torch.bool)
