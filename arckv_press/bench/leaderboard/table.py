"""The leaderboard table: its columns, the key of a row, the reference scores and the CSV file.

One row per (model, benchmark, task, method, kept fraction). Two sources giving the same key is an
error (the manifest declares which run replaces which, :mod:`.sources`), so a rebuild never
depends on the order its sources are read in.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path
from typing import Any

__all__ = ["FIELDS", "KEY", "REFERENCE_METHODS", "fmt_ratio", "num", "short_model", "key_of", "sorted_unique",
           "fill_references", "write_csv", "summary_markdown"]

FIELDS = [
    "model", "benchmark", "task", "method", "ratio", "score", "ci_low", "ci_high", "metric", "full_score",
    "nocontext_score", "compaction_seconds", "cache_bytes", "full_cache_bytes", "realised_ratio", "context_tokens",
    "indexer", "config_id", "n_examples",
    "n_records", "model_args", "source", "date", "package_version", "command", "example_scores",
]
KEY = ("model", "benchmark", "task", "method", "ratio")
#: the reference rows of a benchmark (never ranked, never compared) and their labels in the docs
REFERENCE_METHODS = {"none": "full cache", "no-context": "no context"}


def fmt_ratio(ratio: Any) -> str:
    """A kept fraction as the table writes it (``0.1``, ``1``)."""
    return f"{float(ratio):g}"


def num(value: Any) -> float | None:
    """``value`` as a float, ``None`` when it is none (an empty cell)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def short_model(name: str) -> str:
    """Model name without organisation/path, lower case: how results and records are matched."""
    return re.split(r"[/\\]", str(name).rstrip("/"))[-1].lower()


def key_of(row: dict) -> tuple[str, ...]:
    return tuple(str(row[k]) if k != "ratio" else fmt_ratio(row[k]) for k in KEY)


def sorted_unique(rows: list[dict]) -> list[dict]:
    """``rows`` in key order (model, benchmark, task, method, then kept fraction as a number); two rows
    with one key are an error naming both sources."""
    table: dict[tuple, dict] = {}
    for row in rows:
        k = key_of(row)
        if k in table:
            raise ValueError(f"two sources give the row {dict(zip(KEY, k))}: {table[k].get('source')} and "
                             f"{row.get('source')}; declare the older run superseded in the sources manifest")
        table[k] = row
    return [table[k] for k in sorted(table, key=lambda k: (*k[:4], float(k[4])))]


def fill_references(rows: list[dict]) -> None:
    """``full_score`` / ``nocontext_score``: method ``none`` / ``no-context`` of the same model and task."""
    ref = {(r["model"], r["benchmark"], r["task"], r["method"]): r["score"] for r in rows}
    for r in rows:
        r["full_score"] = ref.get((r["model"], r["benchmark"], r["task"], "none"), "")
        r["nocontext_score"] = ref.get((r["model"], r["benchmark"], r["task"], "no-context"), "")


def _cell(v: Any) -> Any:
    if isinstance(v, float):
        return f"{v:.6g}"
    return "" if v is None else v


def write_csv(path: Path, rows: list[dict], fields: list[str] = FIELDS) -> None:
    """Write ``rows`` (floats to 6 significant digits) with the columns ``fields``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: _cell(r.get(k, "")) for k in fields})


def summary_markdown(rows: list[dict]) -> str:
    """What a rebuild printed: per benchmark, its rows, tasks, methods and kept fractions."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["benchmark"], []).append(r)
    lines = ["| benchmark | rows | tasks | methods | kept fractions |", "|---|---:|---:|---:|---|"]
    for bench, rs in sorted(by.items()):
        ratios = sorted({fmt_ratio(r["ratio"]) for r in rs if r["method"] not in REFERENCE_METHODS}, key=float,
                        reverse=True)
        lines.append(f"| {bench} | {len(rs)} | {len({r['task'] for r in rs})} | {len({r['method'] for r in rs})} | "
                     f"{' '.join(ratios)} |")
    return "\n".join(lines)
