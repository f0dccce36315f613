"""Leaderboard rows from the declared sources.

- lm-eval 0.4.13 results (``results.json`` of ``run_evals.py``: ``results`` ``{task:
  {"<metric>,<filter>": value}}``, ``config`` ``{model, model_args}``, ``n-samples``,
  ``group_subtasks``, ``configs`` (RULER's ``max_seq_lengths``), ``date`` (unix seconds),
  ``arckv_run`` (the run's indexer checkpoint and compaction config ids)), with ``sample_scores.json``
  beside them for the per-example scores. ``--model hf`` runs are method ``none`` at ratio 1,
  ``hf-arckv`` runs take ``press`` / ``ratio`` from ``model_args``; ``drop_document=True`` makes a
  run the ``no-context`` reference (ratio 0). The package's task names (``arckv_ruler``,
  ``arckv_niah_single_1``, ``arckv_longbench``, ...) and the names of runs made before they
  carried the prefix (``ruler``, ``niah_single_1``, ``longbench``) are the same task
  (:func:`canonical_task`).
- ``hf-arckv``'s compaction records (``arckv_compaction.jsonl``: ``model``, ``press``, ``ratio``,
  ``compaction_seconds``, ``cache_bytes``, ``full_cache_bytes``, ``realised_ratio``,
  ``context_tokens``, ``tasks``, ``indexer``, ``config_id``), matched to results by (model, press,
  ratio), preferably from the result's own folder; the rows hold their means.
- ``scripts/needle.py``'s CSV: benchmark ``needle`` (score = fraction of cases found); rows with a
  ``framing`` column other than ``ruler`` (older rows have none: ``ruler``) form their own benchmark
  ``needle_<framing>``; other extra columns are ignored.
- ``scripts/bench_fidelity.py``'s CSV: benchmark ``fidelity``, task ``continuation`` (score = 1 -
  mean damage), with the full cache (1) and no context (0) as references.

Rows are kept only when made with the ids that :func:`newest_rows` reports for their (model,
benchmark, method), so a method's line never mixes two indexer checkpoints or two compaction
configurations (:func:`current_rows`).
"""

from __future__ import annotations

import csv
import datetime as dt
import json
from collections import defaultdict
from pathlib import Path
from statistics import mean
from typing import Any

from arckv_press.bench import ROOT
from arckv_press.models import named_model_id
from arckv_press.tasks._common.records import read_jsonl
from arckv_press.tasks.ruler.generate import TASKS as RULER_SPECS

from .intervals import example_scores
from .table import fmt_ratio, short_model

__all__ = ["TASK_PREFIX", "RULER_TASKS", "canonical_task", "parse_model_args", "iso_date", "benchmark_of",
           "ruler_length", "ruler_benchmark", "pick_metric", "count_of", "read_records", "record_stats",
           "read_results", "newest_rows", "case_rows", "read_needle", "read_fidelity", "current_rows",
           "source_name"]

#: the prefix of the package's lm-eval task names, so they never take over lm-eval's own
TASK_PREFIX = "arckv_"
METRIC_PRIORITY = ("acc", "exact_match", "score", "acc_norm", "contains")


# ---------------------------------------------------------------------------- names and fields
def canonical_task(name: str) -> str:
    """A task's name in the leaderboard: without the package's :data:`TASK_PREFIX`, so a run of
    ``arckv_ruler`` and a stored run of ``ruler`` (before the tasks carried the prefix) are one
    benchmark with the same task rows and example ids."""
    return name[len(TASK_PREFIX):] if name.startswith(TASK_PREFIX) else name


#: RULER's 13 tasks (the task generator's list, by their canonical names) and their group
RULER_TASKS = frozenset({*map(canonical_task, RULER_SPECS), "ruler"})


def _renamed(mapping: dict, path: Path, what: str) -> dict:
    out = {canonical_task(k): v for k, v in mapping.items()}
    if len(out) != len(mapping):
        raise ValueError(f"{path}: {what} holds a task under both its name and its {TASK_PREFIX!r} name")
    return out


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


def iso_date(value: Any) -> str:
    """lm-eval's ``date`` (unix seconds) or a date string -> ``YYYY-MM-DDTHH:MM:SSZ``."""
    if isinstance(value, (int, float)):
        return dt.datetime.fromtimestamp(float(value), dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return str(value or "")


def source_name(path: Path, root: Path) -> str:
    """``path`` relative to ``root`` (the checkout) when it lies inside it: no machine-local paths in
    the table, and a rebuild in another copy of the checkout writes the same cells."""
    try:
        return Path(path).resolve().relative_to(Path(root).resolve()).as_posix()
    except ValueError:
        return str(path)


def benchmark_of(task: str, groups: dict[str, list[str]]) -> str:
    """Benchmark of a (canonical) task: its lm-eval group, else a name rule (``longbench_*``,
    ``quality*``, RULER's tasks)."""
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
    none that can be told, is refused: its rows would merge with another length's. ``data`` has
    canonical task names."""
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


def count_of(n) -> int | str:
    """The number of examples an lm-eval ``n-samples`` entry counts (``effective``, else ``original``),
    or ``""`` when there is none."""
    if isinstance(n, dict):
        n = n.get("effective", n.get("original"))
    return "" if n is None else int(n)


# ---------------------------------------------------------------------------- lm-eval runs
def read_records(files: list[Path]) -> dict[tuple[str, str, str], list[dict]]:
    """Compaction records grouped by (short model, press, ratio); each record remembers its folder
    (``_dir``), so that a results file uses the records written next to it (``run_evals.py``
    layout) rather than those of another benchmark run with the same press and ratio. A document
    compacted twice in one file (a run interrupted and resumed) counts once: its last record."""
    out: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for path in files:
        latest: dict[tuple, dict] = {}
        folder = path.parent.resolve()
        for n, located in enumerate(read_jsonl(path)):
            for field in ("model", "press", "ratio"):
                if field not in located:
                    raise ValueError(f"{located.where}: record lacks {field!r}")
            doc = located.get("document_sha1")
            tasks = tuple(canonical_task(t) for t in located.get("tasks") or ())
            ident = (located["model"], located["press"], located["ratio"], doc, tasks) if doc else (n,)
            rec = {**located, "_dir": folder}
            if "tasks" in rec:
                rec["tasks"] = list(tasks)
            latest.pop(ident, None)                  # re-insert: keeps file order of the last copies
            latest[ident] = rec
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


def _sample_scores(path: Path) -> dict[str, dict[str, dict[str, float]]]:
    """``run_evals.py``'s ``sample_scores.json``: ``{task: {doc id: {metric: value}}}`` (``{}`` if absent)."""
    return _renamed(json.loads(path.read_text(encoding="utf-8")), path, "its scores") if path.exists() else {}


def _canonical_results(data: dict, path: Path) -> dict:
    """``data`` with every task named by :func:`canonical_task` (results, groups, counts, configs)."""
    groups = {canonical_task(g): [canonical_task(t) for t in ts] for g, ts in (data.get("group_subtasks") or {}).items()}
    return {**data, "results": _renamed(data["results"], path, "'results'"), "group_subtasks": groups,
            "n-samples": _renamed(data.get("n-samples") or {}, path, "'n-samples'"),
            "configs": _renamed(data.get("configs") or {}, path, "'configs'")}


def read_results(path: Path, records: dict, nocontext: bool, common: dict[str, str],
                 root: Path | None = None) -> list[dict]:
    """Rows of one lm-eval results JSON (``source`` relative to ``root``, default the checkout)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict) or "results" not in data:
        raise ValueError(f"{path}: not an lm-eval results file (no 'results')")
    data = _canonical_results(data, path)
    config = data.get("config") or {}
    args = parse_model_args(config.get("model_args"))
    # a model named by its short name (``--model gemma3-270m``) is reported by its Hugging Face id,
    # as the case benchmarks and the compaction records report it
    model = named_model_id(args.get("pretrained") or data.get("model_name") or str(config.get("model", "unknown")))
    if nocontext or str(args.get("drop_document", "")).lower() in ("true", "1", "yes"):
        method, ratio = "no-context", "0"
    elif config.get("model") == "hf-arckv":
        method = args.get("press", "arckv")
        ratio = "1" if method == "none" else fmt_ratio(float(args.get("ratio", 0.1)))
    else:
        method, ratio = "none", "1"
    groups = data["group_subtasks"]
    n_samples = data["n-samples"]
    recs = records.get((short_model(model), method, ratio)) or (
        records.get((short_model(model), method, fmt_ratio(args.get("ratio", 0.1)))) if method == "none" else None
    ) or []
    folder = Path(path).parent.resolve()
    recs = [r for r in recs if r.get("_dir") == folder] or recs
    samples = _sample_scores(Path(path).parent / "sample_scores.json")
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
            "source": source_name(path, ROOT if root is None else root), "date": iso_date(data.get("date")), **common,
            "example_scores": example_scores(per_example) if per_example else "",
        }
        if recs:
            row.update(record_stats(recs, task, task in groups))
        for key in ("indexer", "config_id"):  # the run's own ids (run_evals.py), even for a task without records
            if (data.get("arckv_run") or {}).get(key):
                row[key] = str(data["arckv_run"][key])
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------- which rows are current
_ID_KEYS = ("indexer", "config_id")


def _ids_of(r: dict) -> dict[str, str]:
    """A row's indexer checkpoint id and compaction config id (empty when it has none)."""
    return {key: r.get(key) or "" for key in _ID_KEYS}


def _is_default(r: dict) -> bool:
    """Whether row ``r`` was made with the ids its method uses now by default at its kept fraction
    (:func:`arckv_press.registry.result_ids`; a default may depend on the kept fraction, as
    ``lambda_m`` does); methods outside the registry have none."""
    from arckv_press.methods import METHODS
    from arckv_press.registry import result_ids

    method, model = r.get("method"), r.get("model")
    return bool(method in METHODS and model) and _ids_of(r) == result_ids(method, model, float(r.get("ratio") or 1.0))


def newest_rows(rows: list[dict], strict: bool = False, is_default=_is_default) -> tuple[dict[str, str], list[dict]]:
    """The indexer checkpoint id and compaction config id of the method's rows to report, and the
    rows made with them (never mix checkpoints or configurations): the rows made with the ids the
    method uses now by default (:func:`_is_default`) when some rows carry them, so that rows made
    with a non-default option (``--option``) never replace the default's; otherwise, unless
    ``strict``, the rows with the newest row's ids (``strict``: none). The ids returned are those of
    the newest row reported (empty when none is). ``is_default``: the test of a row (a caller that
    has already asked :func:`_is_default` of every row passes its answers)."""
    if len({(r.get("method"), r.get("model")) for r in rows}) > 1:
        raise ValueError("newest_rows takes the rows of one model and method")
    chosen = [r for r in rows if is_default(r)]
    if not chosen and not strict:
        newest = _ids_of(max(rows, key=lambda r: r["date"]))
        chosen = [r for r in rows if _ids_of(r) == newest]
    return (_ids_of(max(chosen, key=lambda r: r["date"])) if chosen else dict.fromkeys(_ID_KEYS, "")), chosen


def current_rows(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """``(current, other)``: rows of a (model, benchmark, method) made with another indexer
    checkpoint or other compaction options than :func:`newest_rows` reports are left out of the
    table and the plots (a new checkpoint or default is rerun one kept fraction at a time), so a
    method's line never mixes two configurations. Once a (model, method) has a row made with its
    current defaults in any benchmark, its rows of earlier defaults are left out in every benchmark
    (``strict``): a benchmark not yet rerun shows no cell rather than the earlier defaults' figure.
    Order is kept."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["model"], r["benchmark"], r["method"])].append(r)
    defaults = {id(r) for r in rows if _is_default(r)}  # one registry lookup per row
    rerun = {(r["model"], r["method"]) for r in rows if id(r) in defaults}
    kept: set[int] = set()
    for (model, _, method), rs in groups.items():
        kept.update(id(r) for r in newest_rows(rs, strict=(model, method) in rerun, is_default=lambda r: id(r) in defaults)[1])
    return [r for r in rows if id(r) in kept], [r for r in rows if id(r) not in kept]


# ---------------------------------------------------------------------------- per-case CSVs
def _read_cases(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def case_rows(cases: list[dict], source: str, common: dict[str, str], benchmark: str, task: str, metric: str, score,
              example_id, total=None) -> list[dict]:
    """Per-case rows (one per case and method) -> one leaderboard row per (model, method, ratio):
    the mean of ``score(case)`` over the cases made with :func:`newest_rows`' ids (``total(cases)``
    instead, when given), each case's score stored under ``example_id(case)``."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in cases:
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
            "n_examples": len(rs), "n_records": len(rs), "source": source,
            "date": max(r["date"] for r in rs), **common,
            "package_version": rs[0].get("package_version", common["package_version"]),
        })
    return rows


def read_needle(path: Path, common: dict[str, str], root: Path) -> list[dict]:
    """``scripts/needle.py`` CSV -> one row per (model, method, ratio) and framing: fraction found.
    Cases without a ``framing`` (or ``ruler``) are benchmark ``needle``, others ``needle_<framing>``."""
    by_framing: dict[str, list[dict]] = defaultdict(list)
    for r in _read_cases(path):
        by_framing[r.get("framing") or "ruler"].append(r)
    rows = []
    for framing, cases in sorted(by_framing.items()):
        bench = "needle" if framing == "ruler" else f"needle_{framing}"
        rows += case_rows(cases, source_name(path, root), common, bench, bench, "correct", lambda r: float(r["correct"]),
                          lambda r: f"{r['length']}/{fmt_ratio(r['depth'])}/{r['seed']}")
    return rows


def read_fidelity(path: Path, common: dict[str, str], root: Path) -> list[dict]:
    """``scripts/bench_fidelity.py`` CSV -> one row per (model, method, ratio): 1 - mean damage.

    Rows whose damage is undefined (``nan``: the document did not help its continuation) are left
    out; the full cache (1) and no context (0) are added per model as reference rows, with that
    score on every document any method of the model was scored on (damage is defined by them, so
    each document's value is exact and their interval a point).
    """
    source = source_name(path, root)
    cases = [r for r in _read_cases(path) if r["damage"] not in ("", "nan")]
    rows = case_rows(cases, source, common, "fidelity", "continuation", "1-damage", lambda r: 1.0 - float(r["damage"]),
                     lambda r: f"doc{r['doc']}/{r['doc_tokens']}/{r['cont_tokens']}",
                     total=lambda rs: 1.0 - mean(float(r["damage"]) for r in rs))
    for model in sorted({r["model"] for r in rows}):
        date = max(r["date"] for r in rows if r["model"] == model)
        docs = sorted({doc for r in rows if r["model"] == model for doc in json.loads(r["example_scores"])})
        for method, ratio, score in (("none", "1", 1.0), ("no-context", "0", 0.0)):
            rows.append({"model": model, "benchmark": "fidelity", "task": "continuation", "method": method,
                         "ratio": ratio, "score": score, "metric": "1-damage", "source": source, "date": date,
                         "example_scores": example_scores(dict.fromkeys(docs, score)), "n_examples": len(docs),
                         **common})
    return rows
