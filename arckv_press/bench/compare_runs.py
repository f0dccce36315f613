"""Paired comparison of two lm-eval runs on the prompts both answered: each task's scores, their
mean difference with a 95% paired bootstrap interval and the sign test, as the leaderboard's
``comparisons.csv`` gives for two methods, but for any two runs (say one method with and without a
compaction option, ``run_evals.py --option``).

    python scripts/compare_runs.py leaderboards/studies/lm_eval_n10_merge256/ruler/arckv-ha_0.1/results.json \\
        leaderboards/runs/lm_eval_n10/ruler/arckv-ha_0.1/results.json

Each ``results.json`` needs the ``sample_scores.json`` that ``run_evals.py`` writes beside it.
Differences are A - B; a task's line is a tie when the interval holds zero.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .leaderboard.intervals import examples_of
from .leaderboard.readers import read_results

__all__ = ["compare", "main"]


def _rows(path: Path) -> dict[str, dict]:
    rows = {r["task"]: r for r in read_results(path, {}, False, {}) if examples_of(r)}
    if not rows:
        raise ValueError(f"{path}: no per-example scores (sample_scores.json) beside it, nothing to pair")
    return rows


def compare(a: Path, b: Path, tasks: list[str] | None = None) -> list[dict]:
    """One dict per task both runs scored (``tasks``: only those): ``task, n, score_a, score_b,
    mean_difference, ci_low, ci_high, p_sign, wins, losses, verdict``, scores being the means over
    the shared examples. A task asked for that one run lacks is an error."""
    from .uncertainty import paired_comparison

    rows_a, rows_b = _rows(Path(a)), _rows(Path(b))
    shared = sorted(set(rows_a) & set(rows_b))
    if tasks:
        missing = sorted(set(tasks) - set(shared))
        if missing:
            raise ValueError(f"task(s) {missing} are not scored by both runs; both have {shared}")
        shared = [t for t in shared if t in tasks]
    out = []
    for task in shared:
        ea, eb = examples_of(rows_a[task]), examples_of(rows_b[task])
        c = paired_comparison(ea, eb)
        if c is None:
            continue
        common = set(ea) & set(eb)
        out.append({"task": task, "n": c.n, "score_a": sum(ea[k] for k in common) / c.n,
                    "score_b": sum(eb[k] for k in common) / c.n, "mean_difference": c.mean_difference,
                    "ci_low": c.ci_low, "ci_high": c.ci_high, "p_sign": c.p_sign, "wins": c.wins,
                    "losses": c.losses, "verdict": c.verdict})
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", type=Path, help="results.json of run A")
    p.add_argument("b", type=Path, help="results.json of run B")
    p.add_argument("--tasks", nargs="+", default=None, help="only these tasks (default: every task both scored)")
    args = p.parse_args(argv)
    try:
        rows = compare(args.a, args.b, args.tasks)
    except (ValueError, OSError) as exc:
        p.error(str(exc))
    print(f"A = {args.a}\nB = {args.b}")
    print("| task | n | A | B | A - B | 95% interval | sign test p | A better / worse | verdict |")
    print("|---|---:|---:|---:|---:|---|---:|---|---|")
    for r in rows:
        print(f"| {r['task']} | {r['n']} | {r['score_a']:.3f} | {r['score_b']:.3f} | {r['mean_difference']:+.3f} | "
              f"[{r['ci_low']:+.3f}, {r['ci_high']:+.3f}] | {r['p_sign']:.2g} | {r['wins']} / {r['losses']} | "
              f"{r['verdict']} |")
    return rows


if __name__ == "__main__":
    main()
