"""TRACE-style allocation (our operationalisation): exact DP == brute force, and its documented properties."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from polyrl.rollout.tree import allocate_rollouts, p_mixed


def _value(p, alloc):
    return float(p_mixed(torch.tensor(p, dtype=torch.float64), torch.tensor(alloc)).sum())


def test_p_mixed_by_hand_and_maximised_at_one_half():
    assert float(p_mixed(torch.tensor(0.3), torch.tensor(2))) == pytest.approx(1 - 0.09 - 0.49)
    assert float(p_mixed(torch.tensor(0.3), torch.tensor(1))) == 0.0
    grid = torch.linspace(0, 1, 101)
    for n in range(2, 9):
        assert float(grid[p_mixed(grid, torch.tensor(n)).argmax()]) == pytest.approx(0.5)


def test_decided_anchors_get_nothing():
    assert allocate_rollouts(torch.tensor([0.0, 1.0, 0.5, 0.3]), 8).tolist() == [0, 0, 4, 4]


def test_dp_equals_brute_force_on_small_instances():
    rng = random.Random(0)
    for _ in range(200):
        M, B = rng.randint(1, 4), rng.randint(0, 11)
        n_min, n_max = rng.choice([1, 2]), rng.randint(2, 6)
        p = [rng.choice([0.0, 1.0, rng.random()]) for _ in range(M)]
        options = [0, *range(n_min, n_max + 1)]
        brute = max(_value(p, a) for a in itertools.product(options, repeat=M) if sum(a) <= B)
        alloc = allocate_rollouts(torch.tensor(p), B, n_min=n_min, n_max=n_max)
        assert alloc.sum() <= B and all(int(n) in options for n in alloc)
        assert _value(p, alloc.tolist()) == pytest.approx(brute, abs=1e-9), (p, B, alloc)


def test_beats_uniform_allocation_with_a_perfect_predictor():
    torch.manual_seed(0)
    p = torch.distributions.Beta(0.5, 0.5).sample((32,))
    alloc = allocate_rollouts(p, 128, n_max=16)
    assert _value(p.tolist(), alloc.tolist()) > _value(p.tolist(), [4] * 32)


def test_bad_arguments_are_clear():
    with pytest.raises(ValueError, match="budget = -1"):
        allocate_rollouts(torch.tensor([0.5]), -1)
    with pytest.raises(ValueError, match="n_max = 1 must be >= n_min = 2"):
        allocate_rollouts(torch.tensor([0.5]), 4, n_max=1)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        allocate_rollouts(torch.tensor([1.5]), 4)
