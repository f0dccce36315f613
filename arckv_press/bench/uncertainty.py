"""Uncertainty of leaderboard scores: bootstrap intervals over examples and paired comparisons.

Thin, seeded wrappers of :func:`scipy.stats.bootstrap` (percentile intervals of the mean, resampling
examples) and :func:`scipy.stats.binomtest` (the sign test), so that every interval in the
leaderboard is reproducible from the per-example scores stored with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats

__all__ = ["DEFAULT_RESAMPLES", "Comparison", "mean_interval", "paired_comparison", "sign_test"]

DEFAULT_RESAMPLES = 10_000
SIGNIFICANCE = 0.05


def _as_array(values, name: str) -> np.ndarray:
    x = np.asarray(list(values), dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"{name} must be a non-empty sequence of numbers")
    if not np.isfinite(x).all():
        raise ValueError(f"{name} holds a NaN or infinite score")
    return x


def mean_interval(values, level: float = 0.95, seed: int = 0,
                  resamples: int = DEFAULT_RESAMPLES) -> tuple[float, float]:
    """``(low, high)``: the percentile bootstrap interval of the mean of ``values`` (resampling the
    examples, ``resamples`` times, seeded). One example, or all equal, gives ``(mean, mean)``."""
    x = _as_array(values, "values")
    if x.size == 1 or bool((x == x[0]).all()):
        return float(x.mean()), float(x.mean())
    res = stats.bootstrap((x,), np.mean, confidence_level=level, n_resamples=resamples, method="percentile",
                          rng=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def sign_test(differences) -> float:
    """Two-sided sign-test p-value of paired ``differences`` (ties, exact zeros, left out; 1.0 when
    every difference is zero)."""
    d = _as_array(differences, "differences")
    wins, losses = int((d > 0).sum()), int((d < 0).sum())
    if wins + losses == 0:
        return 1.0
    return float(stats.binomtest(wins, wins + losses, 0.5, alternative="two-sided").pvalue)


@dataclass(frozen=True)
class Comparison:
    """Method A against method B on the same ``n`` examples: mean of A - B, its paired bootstrap
    interval, the sign-test p-value, and the examples A wins / loses."""

    n: int
    mean_difference: float
    ci_low: float
    ci_high: float
    p_sign: float
    wins: int
    losses: int

    @property
    def verdict(self) -> str:
        """``better`` / ``worse`` when the interval excludes zero *and* the sign test gives p < 0.05,
        else ``tie``. Both are required: on a few examples the percentile bootstrap is too narrow
        (four examples can never reach p < 0.05 in the sign test, whose smallest p is then 0.125)."""
        if self.p_sign >= SIGNIFICANCE:
            return "tie"
        if self.ci_low > 0:
            return "better"
        if self.ci_high < 0:
            return "worse"
        return "tie"


def paired_comparison(a: dict, b: dict, level: float = 0.95, seed: int = 0,
                      resamples: int = DEFAULT_RESAMPLES) -> Comparison | None:
    """Compare per-example scores ``a`` and ``b`` (``{example id: score}``) on the examples both have;
    ``None`` when they share none."""
    common = sorted(set(a) & set(b))
    if not common:
        return None
    d = _as_array((a[k] - b[k] for k in common), "differences")
    low, high = mean_interval(d, level, seed, resamples)
    return Comparison(len(common), float(d.mean()), low, high, sign_test(d), int((d > 0).sum()), int((d < 0).sum()))

