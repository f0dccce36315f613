"""Per-example scores of leaderboard rows, their 95% intervals and the paired comparisons of
``comparisons.csv`` (the statistics are :mod:`arckv_press.bench.uncertainty`'s)."""

from __future__ import annotations

import json
from collections import defaultdict

from arckv_press.bench.uncertainty import mean_interval, paired_comparison
from arckv_press.methods import METHODS

from .table import REFERENCE_METHODS, fmt_ratio

__all__ = ["COMPARISON_FIELDS", "example_scores", "examples_of", "add_intervals", "comparisons"]

COMPARISON_FIELDS = ["model", "benchmark", "task", "ratio", "method", "other", "n", "mean_difference", "ci_low",
                     "ci_high", "p_sign", "wins", "losses", "verdict"]


def example_scores(scores: dict[str, float]) -> str:
    """Per-example scores as stored in a leaderboard cell: compact JSON ``{example id: score}``."""
    return json.dumps(scores, sort_keys=True, separators=(",", ":"))


def examples_of(row: dict) -> dict[str, float]:
    """The per-example scores of a leaderboard row (``{}`` when it stores none)."""
    text = row.get("example_scores") or ""
    return {k: float(v) for k, v in json.loads(text).items()} if text else {}


def add_intervals(rows: list[dict]) -> None:
    """``ci_low`` / ``ci_high``: the seeded 95% bootstrap interval of each row's mean over its stored
    examples (:func:`~arckv_press.bench.uncertainty.mean_interval`); empty without examples."""
    for r in rows:
        scores = examples_of(r)
        r["ci_low"], r["ci_high"] = mean_interval(scores.values()) if scores else ("", "")


def comparisons(rows: list[dict]) -> list[dict]:
    """Each ARC-KV method against every other method of the same (model, benchmark, task, kept
    fraction), paired on the examples both scored (:func:`~arckv_press.bench.uncertainty.paired_comparison`):
    mean difference, 95% paired bootstrap interval, sign-test p-value and the verdict."""
    groups: dict[tuple, dict[str, dict[str, float]]] = defaultdict(dict)
    for r in rows:
        scores = examples_of(r)
        if scores and r["method"] not in REFERENCE_METHODS:
            groups[(r["model"], r["benchmark"], r["task"], fmt_ratio(r["ratio"]))][r["method"]] = scores
    out = []
    for (model, bench, task, ratio), by_method in sorted(groups.items()):
        for method in sorted(by_method):
            if method not in METHODS or METHODS[method].family != "arckv":
                continue
            for other in sorted(by_method):
                if other == method:
                    continue
                c = paired_comparison(by_method[method], by_method[other])
                if c is None:
                    continue
                out.append({"model": model, "benchmark": bench, "task": task, "ratio": ratio, "method": method,
                            "other": other, "n": c.n, "mean_difference": c.mean_difference, "ci_low": c.ci_low,
                            "ci_high": c.ci_high, "p_sign": c.p_sign, "wins": c.wins, "losses": c.losses,
                            "verdict": c.verdict})
    return out
