"""Bootstrap intervals and paired comparisons (arckv_press.bench.uncertainty) against independent
references: the normal approximation of a proportion's interval and the binomial formula."""

from __future__ import annotations

import math

import numpy as np
import pytest

from arckv_press.bench.uncertainty import mean_interval, paired_comparison, sign_test


def test_mean_interval_matches_the_normal_approximation_and_is_seeded():
    rng = np.random.default_rng(1)
    x = (rng.random(400) < 0.3).astype(float)
    low, high = mean_interval(x)
    p = x.mean()
    half = 1.96 * math.sqrt(p * (1 - p) / x.size)
    assert low < p < high
    assert abs(low - (p - half)) < 0.01 and abs(high - (p + half)) < 0.01
    assert mean_interval(x) == (low, high)  # the same seed, the same interval
    y = rng.normal(size=50)  # continuous scores: another seed moves the interval's ends a little
    assert mean_interval(y, seed=1) != mean_interval(y) and mean_interval(y, seed=1) == pytest.approx(mean_interval(y), abs=0.05)
    narrow = mean_interval(np.tile(x, 4))
    assert narrow[1] - narrow[0] < (high - low) * 0.7  # 4x the examples: about half the width
    assert mean_interval([0.25]) == (0.25, 0.25) and mean_interval([1.0] * 7) == (1.0, 1.0)
    for bad in ([], [1.0, float("nan")]):
        with pytest.raises(ValueError):
            mean_interval(bad)


def _binomial_p(wins: int, losses: int) -> float:
    n, k = wins + losses, min(wins, losses)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)


@pytest.mark.parametrize("wins, losses, ties", [(9, 1, 3), (5, 5, 0), (12, 0, 0), (0, 3, 2), (7, 4, 1)])
def test_sign_test_equals_the_binomial_formula(wins, losses, ties):
    d = [0.5] * wins + [-0.25] * losses + [0.0] * ties
    assert sign_test(d) == pytest.approx(_binomial_p(wins, losses), rel=1e-9)
    assert sign_test([0.0, 0.0]) == 1.0


def test_paired_comparison_uses_the_common_examples():
    a = {"x": 1.0, "y": 1.0, "z": 0.0, "only_a": 5.0}
    b = {"x": 0.0, "y": 1.0, "z": 0.0, "only_b": -5.0}
    c = paired_comparison(a, b)
    assert (c.n, c.wins, c.losses) == (3, 1, 0) and c.mean_difference == pytest.approx(1 / 3)
    assert c.ci_low <= c.mean_difference <= c.ci_high and c.verdict == "tie"  # one win in three: not significant
    many_a = {str(i): 1.0 for i in range(30)}
    many_b = {str(i): float(i % 10 == 0) for i in range(30)}
    strong = paired_comparison(many_a, many_b)
    assert strong.verdict == "better" and strong.ci_low > 0 and strong.p_sign < 1e-4
    assert paired_comparison(many_b, many_a).verdict == "worse"
    assert paired_comparison({"a": 1.0}, {"b": 1.0}) is None
    four = paired_comparison({k: 1.0 for k in "abcd"}, {k: 0.0 for k in "abcd"})  # interval > 0, p = 0.125
    assert four.ci_low > 0 and four.p_sign == 0.125 and four.verdict == "tie"
