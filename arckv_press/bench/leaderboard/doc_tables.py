"""The doc blocks generated from ``leaderboard.csv``: the README's headline table and its
best-at-keep-10% list, and one table per benchmark (``docs/results.md``). No number in them is
typed by hand."""

from __future__ import annotations

from collections.abc import Sequence

from arckv_press.bench.uncertainty import paired_comparison
from arckv_press.methods import METHOD_NAMES

from .intervals import examples_of
from .table import REFERENCE_METHODS, fmt_ratio, num

__all__ = ["HEADLINE_RATIOS", "BEST_RATIO", "CROSS_MODEL_RATIOS", "CROSS_MODEL_COLUMNS", "CROSS_MODEL_BENCHMARKS",
           "of_model", "headline_markdown", "best_markdown", "benchmark_markdown", "cross_model_markdown"]

HEADLINE_RATIOS = (0.2, 0.1, 0.05)
BEST_RATIO = 0.1
CROSS_MODEL_RATIOS = (0.1, 0.05)
#: the cross-model table's columns (label, method), the paper's: full, no context, AM, EA, SnapKV, KVzip, ARC-KV
CROSS_MODEL_COLUMNS = (("full", "none"), ("no context", "no-context"), ("AM (OMP-fast)", "am-omp-fast"),
                       ("EA", "expected_attention"), ("SnapKV", "snapkv"), ("KVzip", "kvzip"), ("ARC-KV", "arckv"))
#: its rows per model (label, benchmark, task)
CROSS_MODEL_BENCHMARKS = (("needles", "needle", "needle"), ("continuation fidelity", "fidelity", "continuation"),
                          ("RULER 2K", "ruler", "ruler"), ("RULER 4K", "ruler_4k", "ruler_4k"))


def of_model(rows: list[dict], model_id: str | None = None) -> list[dict]:
    """The rows of one model (``model_id``, default the default model's): the per-model tables never
    mix models."""
    from arckv_press.models import DEFAULT_MODEL_ID

    model_id = model_id or DEFAULT_MODEL_ID
    return [r for r in rows if (r.get("model") or DEFAULT_MODEL_ID) == model_id]


def _value(r: dict | None, kind: str) -> str:
    """One value of a cell: needles found ``k/n``, a score or compaction seconds; ``-`` if none."""
    x = None if r is None else num(r.get("compaction_seconds") if kind == "time" else r["score"])
    if x is None:
        return "-"
    if kind == "needle":
        n = int(float(r["n_examples"]))
        return f"{round(x * n)}/{n}"
    return f"{x:.1f}" if kind == "time" else f"{x:.2f}"


def _with_interval(r: dict | None, kind: str) -> str:
    """A cell's value and, when the row has one, its 95% interval over examples (as fractions)."""
    value = _value(r, kind)
    low, high = (None, None) if r is None else (num(r.get("ci_low")), num(r.get("ci_high")))
    return value if low is None or high is None else f"{value} [{low:.2f}, {high:.2f}]"


def _kind(benchmark: str) -> str:
    return "needle" if benchmark == "needle" or benchmark.startswith("needle_") else "score"


def _pick(rows: list[dict], bench: str, task: str) -> dict[tuple[str, float], dict]:
    """The rows of one benchmark and task by ``(method, ratio)`` (rows without a ratio left out)."""
    return {(r["method"], round(float(r["ratio"]), 6)): r for r in rows
            if r["benchmark"] == bench and r["task"] == task and r["ratio"] not in ("", None)}


def _ratio_cell(table: dict, method: str, ratios: Sequence[float], interval_ratio: float | None, kind: str) -> str:
    """One method's values at ``ratios`` joined by `` · `` (the one at ``interval_ratio`` with its
    interval); ``-`` when it has none."""
    values = [(_with_interval if ratio == interval_ratio else _value)(table.get((method, ratio)), kind)
              for ratio in ratios]
    return " · ".join(values) if any(v != "-" for v in values) else "-"


def headline_markdown(rows: list[dict]) -> str:
    """The README's headline table: per method, needles found, continuation fidelity, RULER and
    compaction time at keep 20 / 10 / 5%; the keep-10% values and the references carry their 95%
    interval over examples where the row stores one."""
    needle, fidelity, ruler = (_pick(rows, "needle", "needle"), _pick(rows, "fidelity", "continuation"),
                               _pick(rows, "ruler", "ruler"))
    columns = ((needle, "needle"), (fidelity, "score"), (ruler, "score"), (fidelity, "time"))
    keep = "/".join(f"{r * 100:g}" for r in HEADLINE_RATIOS)
    head = [f"method, keep {keep}%", "needles found", "continuation fidelity", "RULER 2K", "compaction s"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for m in METHOD_NAMES:
        if m in REFERENCE_METHODS:
            continue
        cells = []
        for table, kind in columns:
            cells.append(_ratio_cell(table, m, HEADLINE_RATIOS, BEST_RATIO if kind != "time" else None, kind))
        lines.append("| " + " | ".join([f"`{m}`", *cells]) + " |")
    for m, label in REFERENCE_METHODS.items():  # one row each, whatever ratio it is stored under
        cells = [_with_interval(next((r for (name, _), r in table.items() if name == m), None), kind)
                 for table, kind in columns[:3]]
        lines.append("| " + " | ".join([label, *cells, "-"]) + " |")
    return "\n".join(lines)


def best_markdown(rows: list[dict], ranked: Sequence[tuple[str, str, str]], ratio: float = BEST_RATIO) -> str:
    """Per ranked benchmark ``(label, benchmark, task)`` at kept fraction ``ratio``: the best compact
    method, the runner-up and whether the difference is significant (paired on their shared
    examples, :func:`~arckv_press.bench.uncertainty.paired_comparison`; ``tie`` unless the interval
    excludes 0 and the sign test gives p < 0.05). Full cache and no context are not candidates."""
    lines = []
    for label, bench, task in ranked:
        cands = sorted((r for r in rows if r["benchmark"] == bench and r["task"] == task
                        and r["method"] not in REFERENCE_METHODS and r["ratio"] not in ("", None)
                        and abs(float(r["ratio"]) - ratio) < 1e-9 and num(r["score"]) is not None),
                       key=lambda r: (-float(r["score"]), r["method"]))
        if len(cands) < 2:
            continue
        best, second = cands[0], cands[1]
        kind = _kind(bench)
        head = (f"- {label}: `{best['method']}` {_value(best, kind)}, runner-up `{second['method']}` "
                f"{_value(second, kind)}")
        a, b = examples_of(best), examples_of(second)
        c = paired_comparison(a, b) if a and b else None
        if c is None:
            lines.append(head + ": not tested (no per-example scores for both)")
        else:
            lines.append(head + f": {'significant' if c.verdict == 'better' else 'a tie'} (difference "
                         f"{c.mean_difference:+.3f}, 95% interval [{c.ci_low:+.3f}, {c.ci_high:+.3f}], sign test "
                         f"p = {c.p_sign:.2g}, {c.n} shared examples)")
    return "\n".join(lines)


def benchmark_markdown(rows: list[dict], benchmark: str, task: str) -> str:
    """One benchmark's table: a row per method (registry order, then the references), a column per
    kept fraction present, each cell the leaderboard's value (needles as found/total) with its 95%
    bootstrap interval over examples when the row stores them; ``-`` where a method has no row;
    ``No rows yet.`` for a benchmark with none."""
    kind = _kind(benchmark)
    cells = {(r["method"], fmt_ratio(r["ratio"])): r for r in rows
             if r["benchmark"] == benchmark and r["task"] == task and r["ratio"] not in ("", None)}
    if not cells:
        return "No rows yet."
    ratios = sorted({ratio for (m, ratio) in cells if m not in REFERENCE_METHODS}, key=float, reverse=True)
    head = ["method", *[f"keep {float(r) * 100:g}%" for r in ratios]]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * len(ratios)]
    for m in METHOD_NAMES:
        if m in REFERENCE_METHODS or not any((m, r) in cells for r in ratios):
            continue
        lines.append("| " + " | ".join([f"`{m}`", *[_with_interval(cells.get((m, r)), kind) for r in ratios]]) + " |")
    for m, label in REFERENCE_METHODS.items():
        ref = next((r for (name, _), r in cells.items() if name == m), None)
        if ref is not None:
            lines.append("| " + " | ".join([label, *[_value(ref, kind)] * len(ratios)]) + " |")
    return "\n".join(lines)


def cross_model_markdown(rows: list[dict]) -> str:
    """The README's cross-model table (the paper's): a row per benchmark and model (the models of
    :data:`arckv_press.models.MODELS` that have rows, the default first), a column per method of
    :data:`CROSS_MODEL_COLUMNS`; a compact method's cell is its keep-10% value with its 95% interval
    over examples, then its keep-5% value; the references' cells their value and interval; ``-``
    where a method has no row (a row with no cell at all is left out)."""
    from arckv_press.models import MODELS

    lines = ["| benchmark @ model | " + " | ".join(label for label, _ in CROSS_MODEL_COLUMNS) + " |",
             "|---|" + "---:|" * len(CROSS_MODEL_COLUMNS)]
    for spec in MODELS.values():
        mine = of_model(rows, spec.model_id)
        for label, bench, task in CROSS_MODEL_BENCHMARKS:
            table = _pick(mine, bench, task)
            if not table:
                continue
            kind = _kind(bench)
            cells = [_with_interval(next((r for (name, _), r in table.items() if name == method), None), kind)
                     if method in REFERENCE_METHODS else _ratio_cell(table, method, CROSS_MODEL_RATIOS,
                                                                     CROSS_MODEL_RATIOS[0], kind)
                     for _, method in CROSS_MODEL_COLUMNS]
            if any(c != "-" for c in cells):
                lines.append("| " + " | ".join([f"{label} @ {spec.name}", *cells]) + " |")
    return "\n".join(lines)
