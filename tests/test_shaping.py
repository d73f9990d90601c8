"""Reward shapers and group filters (DAPO, ScaleRL)."""

from __future__ import annotations

import pytest
import torch

from polyrl.registry import FILTERS, SHAPERS, PartError
from polyrl.shaping import length_penalty, no_positive_resampling, overlong_filter, overlong_soft, zero_variance


def test_dapo_soft_overlong_punishment_values():
    """Spec sec. 7 test 3 with the paper's numbers: L_max = 20480, L_cache = 4096."""
    lengths = torch.tensor([100, 16384, 16384 + 2048, 20480])
    r = overlong_soft(torch.zeros(4), lengths, torch.zeros(4, dtype=torch.bool), 20480, cache_len=4096)
    assert r.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0])
    # cache_frac 0.2 of 20480 is the same band
    r2 = overlong_soft(torch.zeros(4), lengths, torch.zeros(4, dtype=torch.bool), 20480)
    assert r2.tolist() == pytest.approx(r.tolist())


def test_overlong_punishment_is_continuous_and_non_increasing():
    lengths = torch.arange(0, 129)
    r = overlong_soft(torch.ones(129), lengths, lengths >= 128, 128, cache_len=32)
    diffs = r[1:] - r[:-1]
    assert (diffs <= 1e-12).all() and diffs.abs().max() <= 1 / 32 + 1e-9
    assert r[96] == 1.0 and r[128] == 0.0


def test_length_penalty_is_linear_in_length():
    r = length_penalty(torch.ones(3), torch.tensor([0, 32, 64]), torch.zeros(3, dtype=torch.bool), 64, coef=0.5)
    assert r.tolist() == pytest.approx([1.0, 0.75, 0.5])


def test_zero_variance_drops_flat_groups_and_singletons():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.7])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    keep = zero_variance(rewards, groups, torch.zeros(7, dtype=torch.bool), None)
    assert keep.tolist() == [False, False, True, True, False, False, False]


def test_overlong_filter_drops_truncated_only():
    keep = overlong_filter(torch.zeros(3), torch.zeros(3, dtype=torch.long), torch.tensor([True, False, True]), None)
    assert keep.tolist() == [False, True, False]


def test_no_positive_resampling_uses_history():
    groups = torch.tensor([5, 5, 7, 7, 9])
    keep = no_positive_resampling(torch.zeros(5), groups, torch.zeros(5, dtype=torch.bool), {5: 0.95, 7: 0.5})
    assert keep.tolist() == [False, False, True, True, True]
    keep = no_positive_resampling(torch.zeros(5), groups, torch.zeros(5, dtype=torch.bool), {5: 0.95}, threshold=1.0)
    assert keep.all()
    with pytest.raises(ValueError, match="history"):
        no_positive_resampling(torch.zeros(1), groups[:1], torch.zeros(1, dtype=torch.bool), None)


def test_shaper_and_filter_settings_are_validated():
    with pytest.raises(PartError, match="'cache_frac' = 1.5"):
        SHAPERS.resolve("overlong_soft", {"cache_frac": 1.5})
    with pytest.raises(PartError, match="'cache_len' = 0"):
        SHAPERS.resolve("overlong_soft", {"cache_len": 0})
    with pytest.raises(PartError, match="'threshold' = 0"):
        FILTERS.resolve("no_positive_resampling", {"threshold": 0})
