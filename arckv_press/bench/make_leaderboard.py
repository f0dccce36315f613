"""Turn evaluation outputs into ``leaderboards/leaderboard.csv`` and PNG plots.

Inputs (all optional; glob patterns, repeatable):

- ``--results``: lm-eval 0.4.13 ``results_*.json`` files (``--output_path``): ``results``
  ``{task: {"<metric>,<filter>": value}}``, ``config`` ``{model, model_args}``, ``n-samples``,
  ``group_subtasks``, ``date`` (unix seconds). ``--model hf`` runs are method ``none`` at ratio 1;
  ``--model hf-arckv`` runs take ``press`` / ``ratio`` from ``model_args``.
- ``--nocontext-results``: lm-eval results of the same tasks run without the document; they become
  rows of method ``no-context`` (ratio 0) and fill the ``nocontext_score`` column. ``hf-arckv``
  runs with ``drop_document=True`` in ``model_args`` are recognised as such from ``--results`` too.
- ``--records``: the per-document compaction records of ``hf-arckv``
  (``arckv_compaction_<model>_<press>_<ratio>.jsonl``, fields ``model``, ``press``, ``ratio``,
  ``compaction_seconds``, ``cache_bytes``, ``full_cache_bytes``, ``realised_ratio``, ``tasks``).
  They are matched to results by (model name, press, ratio) and, when they list ``tasks``, by task;
  the leaderboard holds their means.
- ``--needle`` (default ``<out-dir>/needle.csv``): ``scripts/needle.py`` rows become benchmark
  ``needle`` rows (score = fraction correct; of a method's rows, only those made with the indexer
  checkpoint and compaction options of its newest row).

Column ``indexer``: content id of the learned indexer checkpoint behind a row (``arckv`` only;
from ``results.json``'s ``arckv_run`` (``run_evals.py``), else the records' / needle rows'
``indexer`` field, ``arckv_press.indexer.checkpoint_id``);
column ``config_id``: content id of the compaction options (ARC-KV and AM;
``arckv_press.api.config_id``).
- ``--fidelity`` (default ``<out-dir>/bench_fidelity.csv``): ``scripts/bench_fidelity.py`` rows
  become benchmark ``fidelity`` rows, task ``continuation`` (score = 1 - mean damage over the
  documents, of the newest row's indexer checkpoint and compaction options: 1 = as good as the full cache, 0 = as good as no context), with the full cache
  (method ``none``, score 1) and no context (method ``no-context``, score 0) as references.
- ``--probes`` (default ``<out-dir>/probes.csv``): plotted only (damage and needle fraction per
  config).

Output ``<out-dir>/leaderboard.csv``: one row per (model, benchmark, task, method, ratio). A rerun
merges with the existing file (same key: the row with the newer ``date`` wins, ties go to the new
row); nothing is recomputed from the old rows except the ``full_score`` / ``nocontext_score``
columns, which are looked up in the merged table. Of a (model, benchmark, method), only the rows
made with the indexer checkpoint and compaction options of its newest row stay there; the others
(kept fractions not yet rerun after a new checkpoint or default) go to
``<out-dir>/leaderboard_superseded.csv``, also merged. Column ``context_tokens``: mean tokens of
the compacted documents (prefix included; from the records). Plots: ``<benchmark>_score_vs_ratio.png``,
``<benchmark>_score_vs_time.png`` and ``probes.png``.

Usage: ``python scripts/make_leaderboard.py --results 'runs/**/results_*.json'
--records 'runs/**/arckv_compaction_*.jsonl'``
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import glob
import json
import math
import re
import shlex
import sys
from collections import defaultdict
from pathlib import Path
from statistics import mean
from typing import Any, Iterable, NamedTuple

from arckv_press.bench import ROOT as REPO

FIELDS = [
    "model", "benchmark", "task", "method", "ratio", "score", "ci_low", "ci_high", "metric", "full_score",
    "nocontext_score", "compaction_seconds", "cache_bytes", "full_cache_bytes", "realised_ratio", "context_tokens",
    "indexer", "config_id", "n_examples",
    "n_records", "model_args", "source", "date", "package_version", "command", "example_scores",
]
COMPARISON_FIELDS = ["model", "benchmark", "task", "ratio", "method", "other", "n", "mean_difference", "ci_low",
                     "ci_high", "p_sign", "wins", "losses", "verdict"]
KEY = ("model", "benchmark", "task", "method", "ratio")
RULER_TASKS = {
    "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
    "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2", "ruler",
}
METRIC_PRIORITY = ("acc", "exact_match", "score", "acc_norm", "contains")


# ---------------------------------------------------------------------------- helpers
def package_version() -> str:
    """``arckv_press.__version__`` (importing the package loads no torch)."""
    from arckv_press import __version__

    return __version__


def expand(patterns: Iterable[str] | None) -> list[Path]:
    """Sorted unique files matching the glob patterns (``**`` allowed); a pattern matching nothing is an error."""
    files: set[Path] = set()
    for pattern in patterns or []:
        hits = glob.glob(pattern, recursive=True)
        if not hits:
            raise ValueError(f"no file matches {pattern!r}")
        files.update(Path(h) for h in hits)
    return sorted(files)


def fmt_ratio(ratio: float) -> str:
    return f"{float(ratio):g}"


def short_model(name: str) -> str:
    """Model name without organisation/path, lower case: how results and records are matched."""
    return re.split(r"[/\\]", str(name).rstrip("/"))[-1].lower()


def parse_model_args(args: Any) -> dict[str, str]:
    """lm-eval ``model_args``: a ``k=v,k=v`` string or a dict."""
    if isinstance(args, dict):
        return {str(k): str(v) for k, v in args.items()}
    out: dict[str, str] = {}
    for part in str(args or "").split(","):
        if "=" in part:
            key, value = part.split("=", 1)
            out[key.strip()] = value.strip()
    return out


def _source(path: Path) -> str:
    """``path`` relative to the repository when it lies inside it (no machine-local paths in the CSV)."""
    try:
        return Path(path).resolve().relative_to(REPO).as_posix()
    except ValueError:
        return str(path)


def iso_date(value: Any) -> str:
    """lm-eval's ``date`` (unix seconds) or a date string -> ``YYYY-MM-DDTHH:MM:SSZ``."""
    if isinstance(value, (int, float)):
        return dt.datetime.fromtimestamp(float(value), dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return str(value or "")


def benchmark_of(task: str, groups: dict[str, list[str]]) -> str:
    """Benchmark of a task: its lm-eval group, else a name rule (``longbench_*``, ``quality*``, RULER)."""
    for group, subtasks in groups.items():
        if task == group or task in subtasks:
            return group
    if task.startswith("longbench"):
        return "longbench"
    if task.startswith("quality"):
        return "quality"
    if task in RULER_TASKS:
        return "ruler"
    return task


def ruler_length(data: dict, path: Path) -> int | None:
    """The one sequence length of a results file's RULER tasks (``None`` without RULER tasks): the
    tasks' ``max_seq_lengths`` metadata, else the per-length metrics (``"2048,none"``) that hold a
    score (lm-eval's RULER writes -1 for a length without samples). A file with several lengths, or
    none that can be told, is refused: its rows would merge with another length's."""
    ruler = [t for t in data["results"] if benchmark_of(t, data.get("group_subtasks") or {}) == "ruler"]
    if not ruler:
        return None
    configs = data.get("configs") or {}
    lengths = {int(n) for t in ruler for n in ((configs.get(t) or {}).get("metadata") or {}).get("max_seq_lengths") or ()}
    if not lengths:
        lengths = {int(k.split(",", 1)[0]) for t in ruler for k, v in data["results"][t].items()
                   if k.split(",", 1)[0].isdigit() and isinstance(v, (int, float)) and v >= 0}
    if len(lengths) != 1:
        raise ValueError(f"{path}: RULER results at {'no readable' if not lengths else sorted(lengths)} sequence "
                         "lengths; run_evals.py runs one length per folder (--ruler-length)")
    return lengths.pop()


def ruler_benchmark(length: int) -> str:
    """The leaderboard's benchmark name for RULER at ``length`` tokens: ``ruler`` at 2048 (the
    leaderboard's RULER), else ``ruler_4k`` (multiples of 1024) or ``ruler_<length>``, so rows of two
    lengths never share a key."""
    if length == 2048:
        return "ruler"
    return f"ruler_{length // 1024}k" if length % 1024 == 0 else f"ruler_{length}"


def pick_metric(values: dict[str, Any]) -> tuple[str, float] | None:
    """The main ``metric,filter`` of a task's results (priority list, else the first numeric one)."""
    numeric = {
        k: float(v) for k, v in values.items()
        if "," in k and "_stderr" not in k and isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    if not numeric:
        return None
    for name in METRIC_PRIORITY:
        for key in numeric:
            if key.split(",", 1)[0] == name:
                return key, numeric[key]
    key = next(iter(numeric))
    return key, numeric[key]


# ---------------------------------------------------------------------------- readers
def read_records(files: list[Path]) -> dict[tuple[str, str, str], list[dict]]:
    """Compaction records grouped by (short model, press, ratio); each record remembers its folder
    (``_dir``), so that a results file uses the records written next to it (``run_evals.py``
    layout) rather than those of another benchmark run with the same press and ratio. A document
    compacted twice in one file (a run interrupted and resumed) counts once: its last record."""
    out: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for path in files:
        latest: dict[tuple, dict] = {}
        folder = path.parent.resolve()
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not a JSON line ({exc})") from exc
            for field in ("model", "press", "ratio"):
                if field not in rec:
                    raise ValueError(f"{path}:{n}: record lacks {field!r}")
            doc = rec.get("document_sha1")
            ident = (rec["model"], rec["press"], rec["ratio"], doc, tuple(rec.get("tasks") or ())) if doc else (n,)
            latest.pop(ident, None)                  # re-insert: keeps file order of the last copies
            latest[ident] = {**rec, "_dir": folder}
        for rec in latest.values():
            out[(short_model(rec["model"]), str(rec["press"]), fmt_ratio(rec["ratio"]))].append(rec)
    return out


def _mean(records: list[dict], field: str) -> float | str:
    vals = [float(r[field]) for r in records if isinstance(r.get(field), (int, float))]
    return mean(vals) if vals else ""


def record_stats(records: list[dict], task: str, is_group: bool = False) -> dict[str, Any]:
    """Means of the records serving ``task`` (records without ``tasks`` serve every task; a group
    row with no record naming it gets all records of the run)."""
    served = [r for r in records if "tasks" not in r or task in (r.get("tasks") or [])]
    records = served or (records if is_group else [])
    if not records:
        return {"n_records": 0}
    return {
        "compaction_seconds": _mean(records, "compaction_seconds"),
        "cache_bytes": _mean(records, "cache_bytes"),
        "full_cache_bytes": _mean(records, "full_cache_bytes"),
        "realised_ratio": _mean(records, "realised_ratio"),
        "context_tokens": _mean(records, "context_tokens"),
        "indexer": "+".join(sorted({str(r["indexer"]) for r in records if r.get("indexer")})),
        "config_id": "+".join(sorted({str(r["config_id"]) for r in records if r.get("config_id")})),
        "n_records": len(records),
    }


def read_sample_scores(path: Path) -> dict[str, dict[str, dict[str, float]]]:
    """``run_evals.py``'s ``sample_scores.json``: ``{task: {doc id: {metric: value}}}`` (``{}`` if absent)."""
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def read_results(path: Path, records: dict, nocontext: bool, common: dict[str, str]) -> list[dict]:
    """Rows of one lm-eval results JSON."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or "results" not in data:
        raise ValueError(f"{path}: not an lm-eval results file (no 'results')")
    config = data.get("config") or {}
    args = parse_model_args(config.get("model_args"))
    model = args.get("pretrained") or data.get("model_name") or str(config.get("model", "unknown"))
    if nocontext or str(args.get("drop_document", "")).lower() in ("true", "1", "yes"):
        method, ratio = "no-context", "0"
    elif config.get("model") == "hf-arckv":
        method = args.get("press", "arckv")
        ratio = "1" if method == "none" else fmt_ratio(float(args.get("ratio", 0.1)))
    else:
        method, ratio = "none", "1"
    groups = data.get("group_subtasks") or {}
    n_samples = data.get("n-samples") or {}
    recs = records.get((short_model(model), method, ratio)) or (
        records.get((short_model(model), method, fmt_ratio(args.get("ratio", 0.1)))) if method == "none" else None
    ) or []
    folder = path.parent.resolve()
    recs = [r for r in recs if r.get("_dir") == folder] or recs
    samples = read_sample_scores(path.parent / "sample_scores.json")
    length = ruler_length(data, path)
    rows = []
    for task, values in sorted(data["results"].items()):
        picked = pick_metric(values)
        if picked is None:
            continue
        metric, score = picked
        name = metric.split(",", 1)[0]
        per_example = {f"{t}/{doc}": s[name] for t in (groups.get(task) or [task]) for doc, s in samples.get(t, {}).items()
                       if name in s}
        n = count_of(n_samples.get(task))
        if n == "" and task in groups:  # a group's count is its subtasks' (lm-eval lists none for it)
            counts = [count_of(n_samples.get(t)) for t in groups[task]]
            n = sum(counts) if counts and "" not in counts else ""
        benchmark, row_task = benchmark_of(task, groups), task
        if benchmark == "ruler":  # one benchmark per length; its group row is named after it, as every group's
            benchmark = ruler_benchmark(length)
            row_task = benchmark if task == "ruler" else task
        row = {
            "model": model, "benchmark": benchmark, "task": row_task, "method": method,
            "ratio": ratio, "score": score, "metric": metric,
            "n_examples": n,
            "model_args": config.get("model_args") if isinstance(config.get("model_args"), str)
            else json.dumps(config.get("model_args"), sort_keys=True),
            "source": _source(path), "date": iso_date(data.get("date")), **common,
            "example_scores": example_scores(per_example) if per_example else "",
        }
        if recs:
            row.update(record_stats(recs, task, task in groups))
        for key in ("indexer", "config_id"):  # the run's own ids (run_evals.py), even for a task without records
            if (data.get("arckv_run") or {}).get(key):
                row[key] = str(data["arckv_run"][key])
        rows.append(row)
    return rows


def count_of(n) -> int | str:
    """The number of examples an lm-eval ``n-samples`` entry counts (``effective``, else ``original``),
    or ``""`` when there is none."""
    if isinstance(n, dict):
        n = n.get("effective", n.get("original"))
    return "" if n is None else int(n)


def newest_rows(rows: list[dict]) -> tuple[dict[str, str], list[dict]]:
    """The indexer checkpoint id and compaction config id of the method's rows to report, and the
    rows made with them (never mix checkpoints or configurations): the rows made with the ids the
    method uses now by default at their kept fraction (:func:`arckv_press.registry.result_ids`; a
    default may depend on the kept fraction, as ``lambda_m`` does) when some rows carry them, so
    that rows made with a non-default option (``--option``) never replace the default's; otherwise
    the rows with the newest row's ids. The ids returned are those of the newest row reported."""
    from arckv_press.methods import METHODS
    from arckv_press.registry import result_ids

    method, model = rows[0].get("method"), rows[0].get("model")
    if len({(r.get("method"), r.get("model")) for r in rows}) > 1:
        raise ValueError("newest_rows takes the rows of one model and method")
    keys = ("indexer", "config_id")
    ids_of = lambda r: {key: r.get(key) or "" for key in keys}  # noqa: E731
    if method in METHODS and model:
        matching = [r for r in rows if ids_of(r) == result_ids(method, model, float(r.get("ratio") or 1.0))]
        if matching:
            return ids_of(max(matching, key=lambda r: r["date"])), matching
    newest = ids_of(max(rows, key=lambda r: r["date"]))
    return newest, [r for r in rows if ids_of(r) == newest]


def _case_rows(path: Path, common: dict[str, str], benchmark: str, task: str, metric: str, score, example_id,
               keep=lambda r: True, total=None) -> list[dict]:
    """A per-case CSV (one row per case and method) -> one leaderboard row per (model, method, ratio):
    the mean of ``score(row)`` over the cases made with :func:`newest_rows`' ids (``total(rows)``
    instead, when given), each case's score stored under ``example_id(row)``; rows failing ``keep``
    are left out."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    with open(path, newline="", encoding="utf-8") as f:
        for r in csv.DictReader(f):
            if keep(r):
                groups[(r["model"], r["method"], fmt_ratio(r["ratio"]))].append(r)
    rows = []
    for (model, method, ratio), rs in sorted(groups.items()):
        newest, rs = newest_rows(rs)
        rows.append({
            "model": model, "benchmark": benchmark, "task": task, "method": method, "ratio": ratio,
            "score": total(rs) if total else mean(score(r) for r in rs), "metric": metric,
            "example_scores": example_scores({example_id(r): score(r) for r in rs}),
            "compaction_seconds": mean(float(r["compaction_s"]) for r in rs),
            "cache_bytes": mean(float(r["cache_bytes"]) for r in rs), **newest,
            "n_examples": len(rs), "n_records": len(rs), "source": _source(path),
            "date": max(r["date"] for r in rs), **common,
            "package_version": rs[0].get("package_version", common["package_version"]),
        })
    return rows


def read_needle(path: Path, common: dict[str, str]) -> list[dict]:
    """``scripts/needle.py`` CSV -> one row per (model, method, ratio): fraction correct."""
    return _case_rows(path, common, "needle", "needle", "correct", lambda r: float(r["correct"]),
                      lambda r: f"{r['length']}/{fmt_ratio(r['depth'])}/{r['seed']}")


def read_fidelity(path: Path, common: dict[str, str]) -> list[dict]:
    """``scripts/bench_fidelity.py`` CSV -> one row per (model, method, ratio): 1 - mean damage.

    Rows whose damage is undefined (``nan``: the document did not help its continuation) are left
    out; the full cache (1) and no context (0) are added per model as reference rows, with that
    score on every document any method of the model was scored on (damage is defined by them, so
    each document's value is exact and their interval a point).
    """
    rows = _case_rows(path, common, "fidelity", "continuation", "1-damage", lambda r: 1.0 - float(r["damage"]),
                      lambda r: f"doc{r['doc']}/{r['doc_tokens']}/{r['cont_tokens']}",
                      keep=lambda r: r["damage"] not in ("", "nan"),
                      total=lambda rs: 1.0 - mean(float(r["damage"]) for r in rs))
    for model in sorted({r["model"] for r in rows}):
        date = max(r["date"] for r in rows if r["model"] == model)
        docs = sorted({doc for r in rows if r["model"] == model for doc in json.loads(r["example_scores"])})
        for method, ratio, score in (("none", "1", 1.0), ("no-context", "0", 0.0)):
            rows.append({"model": model, "benchmark": "fidelity", "task": "continuation", "method": method,
                         "ratio": ratio, "score": score, "metric": "1-damage", "source": _source(path), "date": date,
                         "example_scores": example_scores(dict.fromkeys(docs, score)), "n_examples": len(docs),
                         **common})
    return rows


# ---------------------------------------------------------------------------- uncertainty
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
    from arckv_press.bench.uncertainty import mean_interval

    for r in rows:
        scores = examples_of(r)
        r["ci_low"], r["ci_high"] = mean_interval(scores.values()) if scores else ("", "")


def comparisons(rows: list[dict]) -> list[dict]:
    """Each ARC-KV method against every other method of the same (model, benchmark, task, kept
    fraction), paired on the examples both scored (:func:`~arckv_press.bench.uncertainty.paired_comparison`):
    mean difference, 95% paired bootstrap interval, sign-test p-value; ``verdict`` is ``tie`` when the
    interval holds zero."""
    from arckv_press.bench.uncertainty import paired_comparison
    from arckv_press.methods import METHODS

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


# ---------------------------------------------------------------------------- table
def key_of(row: dict) -> tuple[str, ...]:
    return tuple(str(row[k]) if k != "ratio" else fmt_ratio(row[k]) for k in KEY)


def merge(old: list[dict], new: list[dict]) -> list[dict]:
    """Union by key; for a repeated key the newer ``date`` wins (ties: the later row)."""
    table: dict[tuple, dict] = {}
    for row in [*old, *new]:
        k = key_of(row)
        if k not in table or str(row.get("date", "")) >= str(table[k].get("date", "")):
            table[k] = row
    return [table[k] for k in sorted(table, key=lambda k: (*k[:4], float(k[4])))]


def split_superseded(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """``(current, superseded)``: rows of a (model, benchmark, method) made with another indexer
    checkpoint or other compaction options than :func:`newest_rows` reports are superseded (a new
    checkpoint or default is rerun one kept fraction at a time), so a method's line never mixes
    two configurations; they go to ``leaderboard_superseded.csv``, not to the table or the plots."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["model"], r["benchmark"], r["method"])].append(r)
    current: list[dict] = []
    for rs in groups.values():
        current += newest_rows(rs)[1]
    kept = {id(r) for r in current}
    return [r for r in rows if id(r) in kept], [r for r in rows if id(r) not in kept]


def fill_references(rows: list[dict]) -> None:
    """``full_score`` / ``nocontext_score``: method ``none`` / ``no-context`` of the same model and task."""
    ref = {(r["model"], r["benchmark"], r["task"], r["method"]): r["score"] for r in rows}
    for r in rows:
        r["full_score"] = ref.get((r["model"], r["benchmark"], r["task"], "none"), "")
        r["nocontext_score"] = ref.get((r["model"], r["benchmark"], r["task"], "no-context"), "")


def read_csv(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def write_csv(path: Path, rows: list[dict], fields: list[str] = FIELDS) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: _cell(r.get(k, "")) for k in fields})


def _cell(v: Any) -> Any:
    if isinstance(v, float):
        return f"{v:.6g}"
    return "" if v is None else v


def _num(v: Any) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def markdown(rows: list[dict]) -> str:
    cols = ["model", "benchmark", "task", "method", "ratio", "score", "full_score", "nocontext_score",
            "compaction_seconds", "realised_ratio", "n_examples"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            x = _num(v) if c not in ("model", "task", "method", "ratio") else None
            cells.append(f"{x:.4g}" if x is not None else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- README headline

HEADLINE_START = "<!-- headline table: generated by scripts/make_leaderboard.py from leaderboards/leaderboard.csv -->"
HEADLINE_END = "<!-- end of headline table -->"
HEADLINE_RATIOS = (0.2, 0.1, 0.05)
REFERENCE_METHODS = {"none": "full cache", "no-context": "no context"}


def _headline_value(r: dict | None, kind: str) -> str:
    """One value of a headline cell: needles found ``k/n``, a score or compaction seconds; ``-`` if none."""
    x = None if r is None else _num(r.get("compaction_seconds") if kind == "time" else r["score"])
    if x is None:
        return "-"
    if kind == "needle":
        n = int(float(r["n_examples"]))
        return f"{round(x * n)}/{n}"
    return f"{x:.1f}" if kind == "time" else f"{x:.2f}"


def headline_markdown(rows: list[dict]) -> str:
    """The README's headline table: per method, needles found, continuation fidelity, RULER and
    compaction time at keep 20 / 10 / 5%, from the leaderboard rows (no number is typed by hand); the
    keep-10% values and the references carry their 95% interval over examples where the row stores one."""
    from arckv_press.methods import METHOD_NAMES

    def pick(bench: str, task: str) -> dict[tuple[str, float], dict]:
        return {(r["method"], round(float(r["ratio"]), 6)): r for r in rows
                if r["benchmark"] == bench and r["task"] == task and r["ratio"] not in ("", None)}

    needle, fidelity, ruler = pick("needle", "needle"), pick("fidelity", "continuation"), pick("ruler", "ruler")
    columns = ((needle, "needle"), (fidelity, "score"), (ruler, "score"), (fidelity, "time"))
    keep = "/".join(f"{r * 100:g}" for r in HEADLINE_RATIOS)
    head = [f"method, keep {keep}%", "needles found", "continuation fidelity", "RULER 2K", "compaction s"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for m in METHOD_NAMES:
        if m in REFERENCE_METHODS:
            continue
        cells = []
        for table, kind in columns:
            values = [(_with_interval if ratio == BEST_RATIO and kind != "time" else _headline_value)(
                table.get((m, ratio)), kind) for ratio in HEADLINE_RATIOS]
            cells.append(" · ".join(values) if any(v != "-" for v in values) else "-")
        lines.append("| " + " | ".join([f"`{m}`", *cells]) + " |")
    for m, label in REFERENCE_METHODS.items():  # one row each, whatever ratio it is stored under
        cells = [_with_interval(next((r for (name, _), r in table.items() if name == m), None), kind)
                 for table, kind in columns[:3]]
        lines.append("| " + " | ".join([label, *cells, "-"]) + " |")
    return "\n".join(lines)


def _replace_between(text: str, start_mark: str, end_mark: str, body: str, path: Path) -> str:
    start, end = text.find(start_mark), text.find(end_mark)
    if start < 0 or end < start:
        raise ValueError(f"{path} must contain the lines {start_mark!r} and then {end_mark!r}")
    return text[: start + len(start_mark)] + "\n" + body + "\n" + text[end:]


BEST_START = "<!-- best at keep 10%: generated by scripts/make_leaderboard.py from leaderboards/leaderboard.csv -->"
BEST_END = "<!-- end of best at keep 10% -->"
BEST_RATIO = 0.1


def best_markdown(rows: list[dict], ratio: float = BEST_RATIO) -> str:
    """Per headline benchmark at kept fraction ``ratio``: the best compact method, the runner-up and
    whether the difference is significant (paired on their shared examples,
    :func:`~arckv_press.bench.uncertainty.paired_comparison`; ``tie`` unless the interval excludes 0
    and the sign test gives p < 0.05). Full cache and no context are not candidates."""
    from arckv_press.bench.uncertainty import paired_comparison

    lines = []
    for label, bench, task in ((t.short, t.benchmark, t.task) for t in RESULT_TABLES if t.short):
        cands = sorted((r for r in rows if r["benchmark"] == bench and r["task"] == task
                        and r["method"] not in REFERENCE_METHODS and r["ratio"] not in ("", None)
                        and abs(float(r["ratio"]) - ratio) < 1e-9 and _num(r["score"]) is not None),
                       key=lambda r: (-float(r["score"]), r["method"]))
        if len(cands) < 2:
            continue
        best, second = cands[0], cands[1]
        kind = "needle" if bench == "needle" else "score"
        head = (f"- {label}: `{best['method']}` {_headline_value(best, kind)}, runner-up `{second['method']}` "
                f"{_headline_value(second, kind)}")
        a, b = examples_of(best), examples_of(second)
        c = paired_comparison(a, b) if a and b else None
        if c is None:
            lines.append(head + ": not tested (no per-example scores for both)")
        else:
            lines.append(head + f": {'significant' if c.verdict == 'better' else 'a tie'} (difference "
                         f"{c.mean_difference:+.3f}, 95% interval [{c.ci_low:+.3f}, {c.ci_high:+.3f}], sign test "
                         f"p = {c.p_sign:.2g}, {c.n} shared examples)")
    return "\n".join(lines)


def update_readme(path: Path, table: str, best: str | None = None) -> bool:
    """Put ``table`` between the headline markers of ``path`` (and ``best``, when given, between the
    best-at-keep-10% markers); True if the file changed. A README without the markers, in order, is
    an error (nothing is written)."""
    text = path.read_text(encoding="utf-8")
    new = _replace_between(text, HEADLINE_START, HEADLINE_END, table, path)
    if best is not None:
        new = _replace_between(new, BEST_START, BEST_END, best, path)
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


# ---------------------------------------------------------------------------- docs/results.md tables
class ResultTable(NamedTuple):
    """One benchmark's generated table in docs/results.md: its block name, the leaderboard's benchmark
    and task, what the cells hold, and the label of its line in the README's best-at-keep-10% list
    (``None``: not ranked there, e.g. a benchmark this model cannot rank methods on)."""

    name: str
    benchmark: str
    task: str
    title: str
    short: str | None = None


#: the per-benchmark tables of docs/results.md, and the benchmarks :func:`best_markdown` ranks
RESULT_TABLES = (
    ResultTable("needle", "needle", "needle",
                "needles found (five depths per length; the total is the method's number of cases)", "needles"),
    ResultTable("fidelity", "fidelity", "continuation", "continuation fidelity, 1 - damage (mean over documents)",
                "continuation fidelity"),
    ResultTable("ruler", "ruler", "ruler", "RULER at 2K tokens (13 tasks)", "RULER 2K"),
    ResultTable("ruler-4k", "ruler_4k", "ruler_4k", "RULER at 4K tokens (13 tasks)", "RULER 4K"),
    ResultTable("quality", "quality", "quality", "QuALITY accuracy"),
    ResultTable("longbench-multifieldqa", "longbench", "longbench_multifieldqa_zh", "LongBench MultiFieldQA-zh"),
    ResultTable("longbench-passage-retrieval", "longbench", "longbench_passage_retrieval_zh",
                "LongBench PassageRetrieval-zh"),
)


def block_marks(name: str, source: str = "leaderboards/leaderboard.csv") -> tuple[str, str]:
    """The marker lines around generated block ``name``, whose data is the CSV ``source``, in a
    Markdown file."""
    return (f"<!-- generated by scripts/make_leaderboard.py from {source}: {name} -->",
            f"<!-- end of generated {name} -->")


def _with_interval(r: dict | None, kind: str) -> str:
    """A cell's value and, when the row has one, its 95% interval over examples (as fractions)."""
    value = _headline_value(r, kind)
    low, high = (None, None) if r is None else (_num(r.get("ci_low")), _num(r.get("ci_high")))
    return value if low is None or high is None else f"{value} [{low:.2f}, {high:.2f}]"


def benchmark_markdown(rows: list[dict], benchmark: str, task: str) -> str:
    """One benchmark's table: a row per method (registry order, then the references), a column per
    kept fraction present, each cell the leaderboard's value (needles as found/total) with its 95%
    bootstrap interval over examples when the row stores them; ``-`` where a method has no row;
    ``No rows yet.`` for a benchmark with none."""
    from arckv_press.methods import METHOD_NAMES

    kind = "needle" if benchmark == "needle" else "score"
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
            lines.append("| " + " | ".join([label, *[_headline_value(ref, kind)] * len(ratios)]) + " |")
    return "\n".join(lines)


def update_results_doc(path: Path, rows: list[dict]) -> bool:
    """Rewrite every generated block of ``path`` (:data:`RESULT_TABLES`) from the leaderboard rows;
    True if the file changed. A block whose markers are missing is an error (nothing is written)."""
    text = path.read_text(encoding="utf-8")
    new = text
    for t in RESULT_TABLES:
        new = _replace_between(new, *block_marks(t.name), benchmark_markdown(rows, t.benchmark, t.task), path)
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


# ---------------------------------------------------------------------------- plots
class Point(NamedTuple):
    """One method's point of a benchmark plot: kept fraction, score, compaction seconds, and the 95%
    interval of the score (``None`` when the point is no single row with stored examples)."""

    ratio: float
    score: float
    seconds: float | None
    low: float | None = None
    high: float | None = None


def _benchmark_points(rows: list[dict]) -> dict[tuple[str, str], list[Point]]:
    """Per (model, method): the points of the benchmark: its group row (with that row's interval), else
    the mean over its task rows (an interval only when there is one task row: a mean of intervals is
    none)."""
    by: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        by[(r["model"], r["method"], fmt_ratio(r["ratio"]))].append(r)
    out: dict[tuple[str, str], list] = defaultdict(list)
    for (model, method, ratio), rs in by.items():
        group = [r for r in rs if r["task"] == r["benchmark"]]
        rs = group or rs
        scores = [_num(r["score"]) for r in rs if _num(r["score"]) is not None]
        secs = [_num(r.get("compaction_seconds")) for r in rs if _num(r.get("compaction_seconds")) is not None]
        if scores:
            low, high = (_num(rs[0].get("ci_low")), _num(rs[0].get("ci_high"))) if len(rs) == 1 else (None, None)
            if low is None or high is None:
                low = high = None
            out[(model, method)].append(Point(float(ratio), mean(scores), mean(secs) if secs else None, low, high))
    return out


def _draw(ax, xs: list[float], pts: list[Point], style: dict[str, Any], label: str) -> None:
    """A method's line, with its points' 95% intervals as error bars where the rows store them."""
    ax.plot(xs, [p.score for p in pts], label=label, **style)
    bars = [(x, p) for x, p in zip(xs, pts) if p.low is not None]
    if bars:
        ax.errorbar([x for x, _ in bars], [p.score for _, p in bars],
                    yerr=[[max(0.0, p.score - p.low) for _, p in bars], [max(0.0, p.high - p.score) for _, p in bars]],
                    fmt="none", ecolor=style["color"], elinewidth=1, capsize=3, alpha=0.7)


def method_family(method: str) -> str:
    """``arckv`` (ARC-KV variants), ``am`` (Attention Matching) or ``kvpress`` (any other press),
    by the registry's naming (this script does not import torch)."""
    if method.startswith("arckv"):
        return "arckv"
    return "am" if method.startswith("am-") else "kvpress"


_FAMILY_STYLE = {"arckv": ("-", "o"), "am": ("--", "s"), "kvpress": (":", "^")}


def method_styles(methods: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Matplotlib styles for the method lines of one plot, ``{label: method}`` to ``{label: style}``
    (a label is ``method`` or ``model method``): line style and marker by the method's family (ARC-KV
    solid, Attention Matching dashed, kvpress dotted) and a colour of ``tab20`` per label in sorted
    order, so every line differs in colour even with a dozen methods (``tab10`` repeats after ten)."""
    import matplotlib

    palette = matplotlib.colormaps["tab20"].colors
    palette = palette[0::2] + palette[1::2]  # the ten strong colours first, then their light twins
    styles = {}
    for i, label in enumerate(sorted(methods)):
        ls, marker = _FAMILY_STYLE[method_family(methods[label])]
        styles[label] = {"color": palette[i % len(palette)], "linestyle": ls, "marker": marker}
    return styles


def plot_benchmark(benchmark: str, rows: list[dict], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = _benchmark_points(rows)
    many = len({m for m, _ in points}) > 1
    labels = {key: f"{short_model(key[0])} {key[1]}" if many else key[1] for key in points}
    styles = method_styles({labels[key]: key[1] for key in points if key[1] not in ("none", "no-context")})
    paths = []
    for kind in ("ratio", "time"):
        fig, ax = plt.subplots(figsize=(6, 4))
        for (model, method), pts in sorted(points.items()):
            label = labels[(model, method)]
            if method in ("none", "no-context"):
                ref, color = pts[0], "k" if method == "none" else "grey"
                ax.axhline(ref.score, ls="--" if method == "none" else ":", color=color,
                           label=f"{label} (full context)" if method == "none" else label)
                if ref.low is not None:  # the reference's 95% interval as a band
                    ax.axhspan(ref.low, ref.high, color=color, alpha=0.08, lw=0)
                continue
            pts = sorted(pts)
            if kind == "ratio":
                _draw(ax, [p.ratio for p in pts], pts, styles[label], label)
            else:
                timed = [p for p in pts if p.seconds is not None and p.seconds > 0]
                if timed:
                    _draw(ax, [p.seconds for p in timed], timed, styles[label], label)
        ax.set_xscale("log")
        ax.set_xlabel("kept ratio" if kind == "ratio" else "compaction seconds per document")
        ax.set_ylabel("score (bars, band: 95% interval over examples)")
        ax.set_title(benchmark)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        path = out_dir / f"{benchmark}_score_vs_{kind}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_probes(path: Path, out_dir: Path) -> Path | None:
    rows = read_csv(path)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def same(r):
        return r["config"], r["ratio"], r.get("dtype"), r.get("indexer")

    config_ids = defaultdict(set)  # name the compaction options only where they tell rows apart
    for r in rows:
        config_ids[same(r)].add(r.get("config_id") or "")
    labels = [f"{r['config']} @{r['ratio']}" + (f" {r['dtype']}" if r.get("dtype") else "")
              + (f" [{r['indexer'][:6]}]" if r.get("indexer") else "")  # one bar per checkpoint / config
              + (f" <{(r.get('config_id') or '-')[:6]}>" if len(config_ids[same(r)]) > 1 else "") for r in rows]
    damage = [_num(r.get("damage")) or 0.0 for r in rows]
    found = [
        (_num(r.get("needle_found")) or 0.0) / t if (t := _num(r.get("needle_total"))) else math.nan for r in rows
    ]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, vals, title in zip(axes, (damage, found), ("damage (lower is better)", "needle fraction found")):
        ax.bar(range(len(vals)), vals)
        ax.set_xticks(range(len(vals)), labels, rotation=45, ha="right", fontsize=7)
        ax.set_title(title)
    fig.tight_layout()
    out = out_dir / "probes.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


# ---------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", nargs="*", default=[], help="lm-eval results_*.json glob(s)")
    p.add_argument("--nocontext-results", nargs="*", default=[], help="lm-eval results of no-document runs")
    p.add_argument("--records", nargs="*", default=[], help="arckv_compaction_*.jsonl glob(s)")
    p.add_argument("--needle", default=None, help="needle CSV (default <out-dir>/needle.csv if present)")
    p.add_argument("--fidelity", default=None, help="bench_fidelity CSV (default <out-dir>/bench_fidelity.csv if present)")
    p.add_argument("--probes", default=None, help="probes CSV (default <out-dir>/probes.csv if present)")
    p.add_argument("--out-dir", default=None, help="default: leaderboards/")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--readme", default=None,
                   help="file whose headline table (between its markers) is rewritten (default: README.md when "
                        "--out-dir is the default leaderboards/, else none)")
    p.add_argument("--results-doc", default=None,
                   help="file whose per-benchmark tables (between their markers) are rewritten (default: "
                        "docs/results.md when --out-dir is the default leaderboards/, else none)")
    p.add_argument("--study-docs", default=None,
                   help="checkout whose docs' study tables (compaction time, development split, selectors) are "
                        "rewritten from its CSVs (default: this checkout when --out-dir is the default, else none)")
    args = p.parse_args(argv)
    if args.study_docs is None and args.out_dir is None:
        args.study_docs = str(REPO)
    if args.readme is None and args.out_dir is None:
        args.readme = str(REPO / "README.md")
    if args.results_doc is None and args.out_dir is None:
        args.results_doc = str(REPO / "docs" / "results.md")
    args.out_dir = args.out_dir or str(REPO / "leaderboards")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    """Build/merge the leaderboard; returns the merged rows."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    command = "python scripts/make_leaderboard.py " + shlex.join(argv)
    print(command)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    common = {"package_version": package_version(), "command": command}

    records = read_records(expand(args.records))
    new: list[dict] = []
    for path in expand(args.results):
        new += read_results(path, records, False, common)
    for path in expand(args.nocontext_results):
        new += read_results(path, records, True, common)
    needle = Path(args.needle) if args.needle else out_dir / "needle.csv"
    if args.needle or needle.exists():
        new += read_needle(needle, common)
    fidelity = Path(args.fidelity) if args.fidelity else out_dir / "bench_fidelity.csv"
    if args.fidelity or fidelity.exists():
        new += read_fidelity(fidelity, common)

    out, old_out = out_dir / "leaderboard.csv", out_dir / "leaderboard_superseded.csv"
    reread = {r.get("source") for r in new if r.get("source")}  # a source read again replaces its old rows
    previous = [r for r in read_csv(out) if r.get("source") not in reread]
    rows, superseded = split_superseded(merge(previous, new))
    fill_references(rows)
    add_intervals(rows)
    write_csv(out, rows)
    write_csv(out_dir / "comparisons.csv", comparisons(rows), COMPARISON_FIELDS)
    if superseded or old_out.exists():
        superseded = merge(read_csv(old_out), superseded)
        fill_references(superseded)
        add_intervals(superseded)
        write_csv(old_out, superseded)
        print(f"{len(superseded)} rows of an older checkpoint or older compaction options: {old_out}")

    if not args.no_plots:
        by_bench: dict[str, list[dict]] = defaultdict(list)
        for r in rows:
            by_bench[r["benchmark"]].append(r)
        for bench, rs in sorted(by_bench.items()):
            plot_benchmark(bench, rs, out_dir)
        probes = Path(args.probes) if args.probes else out_dir / "probes.csv"
        if probes.exists():
            plot_probes(probes, out_dir)
    if args.readme:
        changed = update_readme(Path(args.readme), headline_markdown(rows), best_markdown(rows))
        print(f"headline table {'updated' if changed else 'unchanged'} in {args.readme}")
    if args.results_doc:
        changed = update_results_doc(Path(args.results_doc), rows)
        print(f"per-benchmark tables {'updated' if changed else 'unchanged'} in {args.results_doc}")
    if args.study_docs:
        from .study_tables import update_study_docs

        changed_docs = update_study_docs(Path(args.study_docs))
        print(f"study tables updated in {', '.join(changed_docs)}" if changed_docs else "study tables unchanged")
    print(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
