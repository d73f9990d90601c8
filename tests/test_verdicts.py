"""polyrl.lab.verdicts: hand-computed intervals and every branch of the verdict rule."""

import math

import numpy as np
import pytest

from polyrl.lab.verdicts import (
    Effect,
    binomial_interval,
    decide,
    paired_difference,
    rate_reduction,
    ratio_of_means,
    seeds_needed,
    unpaired_difference,
)


def _binom_cdf(k: int, n: int, p: float) -> float:
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))


def _solve(f, lo=0.0, hi=1.0) -> float:
    """Root of a monotone f on [lo, hi] by bisection (independent of scipy)."""
    flo = f(lo)
    for _ in range(200):
        mid = (lo + hi) / 2
        if (f(mid) > 0) == (flo > 0):
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def test_clopper_pearson_boundaries_closed_form():
    # 90%: each tail 0.05. (0, 5): upper solves (1-p)^5 = 0.05; (5, 5): lower solves p^5 = 0.05.
    lo, hi = binomial_interval(0, 5, 0.9)
    assert lo == 0.0 and hi == pytest.approx(1 - 0.05 ** (1 / 5), abs=1e-9)
    assert hi == pytest.approx(0.45072, abs=1e-5)
    lo, hi = binomial_interval(5, 5, 0.9)
    assert hi == 1.0 and lo == pytest.approx(0.05 ** (1 / 5), abs=1e-9)
    assert lo == pytest.approx(0.54928, abs=1e-5)


def test_clopper_pearson_2_of_10_from_the_binomial_definition():
    # lower: P(X >= 2 | p) = 0.05; upper: P(X <= 2 | p) = 0.05.
    want_lo = _solve(lambda p: (1 - _binom_cdf(1, 10, p)) - 0.05)
    want_hi = _solve(lambda p: _binom_cdf(2, 10, p) - 0.05)
    lo, hi = binomial_interval(2, 10, 0.9)
    assert lo == pytest.approx(want_lo, abs=1e-7) and hi == pytest.approx(want_hi, abs=1e-7)
    assert lo == pytest.approx(0.0368, abs=1e-3) and hi == pytest.approx(0.5069, abs=1e-3)
    with pytest.raises(ValueError):
        binomial_interval(3, 2)


def test_paired_difference_hand_example_and_seeding():
    a, b = [1.0, 2.0, 3.0], [2.0, 4.0, 3.0]  # d = [1, 2, 0]: mean 1, sd 1
    e = paired_difference(a, b, name="gain")
    assert e.estimate == pytest.approx(1.0) and e.sd == pytest.approx(1.0) and e.n == 3
    # t interval: 1 -+ t_{0.95, 2} * 1 / sqrt(3) = 1 -+ 2.919986 / 1.732051 = [-0.685854, 2.685854]
    assert e.lo == pytest.approx(-0.685854, abs=1e-6) and e.hi == pytest.approx(2.685854, abs=1e-6)
    assert paired_difference(a, b, name="gain") == e
    flipped = paired_difference(a, b, name="gain", direction=-1)
    assert flipped.estimate == pytest.approx(-1.0) and flipped.lo == pytest.approx(-e.hi)
    with pytest.raises(ValueError):
        paired_difference([1.0, 2.0], [1.0], name="x")
    one = paired_difference([1.0], [2.0], name="x")
    assert math.isnan(one.lo) and one.sd is None and decide(one).verdict == "inconclusive"


def test_unpaired_difference_mean_and_per_arm_sd():
    e = unpaired_difference([0.0, 2.0], [3.0, 5.0], name="u")
    assert e.estimate == pytest.approx(3.0) and e.sd == pytest.approx(2.0)  # sqrt(2 + 2)
    # Welch: se = sqrt(2/2 + 2/2) = 1.414214, df = 2^2 / (1 + 1) = 2: 3 -+ 2.919986 * 1.414214 = [-1.129, 7.129]
    assert e.lo == pytest.approx(-1.129483, abs=1e-5) and e.hi == pytest.approx(7.129483, abs=1e-5)


def test_paired_intervals_cover_at_their_level_with_few_seeds():
    """With no effect, a 90 % interval excludes 0 in about 10 % of cases -- at 2 and 3 seeds too (the percentile
    bootstrap this replaced gave a verdict in 49 % and 37 %)."""
    rng = np.random.default_rng(0)
    for seeds in (2, 3, 5):
        decided = sum(decide(paired_difference(rng.normal(size=seeds), rng.normal(size=seeds), name="x")).verdict
                      != "inconclusive" for _ in range(2000))
        assert 0.08 <= decided / 2000 <= 0.12, (seeds, decided)
    exact = paired_difference([0.05, 0.05, 0.05], [0.11, 0.11, 0.11], name="x")  # a deterministic ratio
    assert (exact.lo, exact.hi) == pytest.approx((0.06, 0.06)) and decide(exact).verdict == "holds"


def test_rate_reduction_sign_and_newcombe_interval():
    e = rate_reduction(9, 10, 0, 10, name="collapse")
    assert e.estimate == pytest.approx(0.9)
    # hand: Wilson(9/10, z=1.6449) = [0.6523, 0.9774], Wilson(0/10) = [0, 0.2129];
    # lo = 0.9 - sqrt(0.2477^2 + 0.2129^2) = 0.5733, hi = 0.9 + 0.0774 = 0.9774
    assert e.lo == pytest.approx(0.5733, abs=1e-3) and e.hi == pytest.approx(0.9774, abs=1e-3)
    assert e.lo > 0 and "9/10 vs 0/10" in e.name
    worse = rate_reduction(0, 10, 9, 10, name="collapse")
    assert worse.estimate == pytest.approx(-0.9) and worse.hi < 0
    assert rate_reduction(0, 5, 0, 5, name="c").sd is None


def test_ratio_of_means_with_censoring():
    e = ratio_of_means([100, None, 80], [50, 60, 70], name="fewer steps", censor=151)
    assert e.estimate == pytest.approx(1 - 60 / ((100 + 151 + 80) / 3))  # 0.4562
    assert "1 of 3 runs in a and 0 of 3 in b" in e.name and "151" in e.name
    assert e.lo <= e.estimate <= e.hi
    with pytest.raises(ValueError):
        ratio_of_means([100, math.inf], [50, 60], name="x")
    assert ratio_of_means([100.0, 100.0], [50.0, 50.0], name="x").estimate == pytest.approx(0.5)


def test_seeds_needed_hand_computed():
    e = Effect("x", 0.5, -0.1, 1.1, 0.9, 5, 1.0)
    # ((1.6449 + 0.8416) * 1 / 0.5)^2 = 24.73 -> 25
    assert seeds_needed(e) == 25
    # textbook 95% / 80%: (1.96 + 0.8416)^2 * 4 = 31.4 -> 32
    assert seeds_needed(e, level=0.95) == 32
    assert seeds_needed(Effect("x", 0.5, 0, 1, 0.9, 5, None)) is None


def _eff(est, lo, hi, sd=0.1):
    return Effect("clip-higher raised final-quarter entropy by", est, lo, hi, 0.9, 5, sd)


def test_decide_holds():
    d = decide(_eff(0.12, 0.05, 0.19))
    assert d.verdict == "holds" and d.seeds_needed is None
    assert "0.12 [0.05, 0.19] (90% interval, 5 seeds per arm)" in d.reason and "names no size" in d.reason
    assert decide(_eff(0.5, 0.3, 0.7), claimed=0.6).verdict == "holds"


def test_decide_holds_partly():
    d = decide(_eff(0.2, 0.1, 0.3), claimed=0.92)
    assert d.verdict == "holds partly" and "0.92" in d.reason


def test_decide_opposite_effect():
    d = decide(_eff(-0.2, -0.3, -0.1), claimed=0.5)
    assert d.verdict == "does not hold at this scale" and "opposite" in d.reason


def test_decide_size_excluded():
    d = decide(_eff(0.05, -0.05, 0.15), claimed=0.4)
    assert d.verdict == "does not hold at this scale" and "excludes the claimed 0.4" in d.reason


def test_decide_inconclusive_gives_sample_size_and_names_also():
    acc = Effect("accuracy gain", 0.01, -0.02, 0.04, 0.9, 5, 0.03)
    d = decide(_eff(0.05, -0.05, 0.15), claimed=0.1, also=(acc,), numbers={"arms": {"a": 1.0}})
    # ((1.6449 + 0.8416) * 0.1 / 0.05)^2 = 24.73 -> 25
    assert d.verdict == "inconclusive" and d.seeds_needed == 25 and "25 seeds per arm" in d.reason
    assert "accuracy gain: 0.01 [-0.02, 0.04]" in d.reason
    assert d.effects == (d.effects[0], acc) and d.numbers["claimed"] == 0.1 and d.numbers["arms"] == {"a": 1.0}
