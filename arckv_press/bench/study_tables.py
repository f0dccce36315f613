"""The study tables of ``docs/``, generated from the benchmark CSVs between marker lines, so a figure
in the docs cannot drift from the data it came from (``scripts/make_leaderboard.py`` rewrites them;
``tests/test_make_leaderboard.py`` checks the committed docs equal what this module generates).

- ``compaction-time`` (``docs/results.md``): the last model-section run of ``bench_compaction.py``
  with today's defaults on one thread: seconds per stage and the ratios that run printed against the
  goals of the fast-compaction issue (the same lines as ``bench_compaction.py --summary``);
  ``compaction-time-two-threads``: the same for the last run on two threads.
- ``development-split`` (``docs/results.md``): mean continuation damage on the development documents
  (``bench_fidelity.py --split dev``) per method and compaction options, each row labelled by the
  ``--option`` values that made it, or ``default`` when its config id is today's default there.
- ``selectors-dev`` (``docs/indexer.md``): the same data for the three ARC-KV selectors at today's
  defaults, with the mean over kept fractions.
- ``evidence-cost`` (``docs/results.md``): the compaction hours behind the leaderboard's rows of
  the ranked benchmarks, per method (from ``leaderboards/leaderboard.csv``).
"""

from __future__ import annotations

import shlex
from collections import defaultdict
from functools import partial
from itertools import combinations
from pathlib import Path

from . import checkout
from .make_leaderboard import _replace_between, block_marks, fmt_ratio

__all__ = ["STUDY_BLOCKS", "dev_damage", "dev_split_markdown", "selectors_markdown",
           "compaction_time_markdown", "evidence_cost_markdown", "update_study_docs"]


def _options(command: str) -> dict:
    """The ``--option KEY=VALUE`` values of a stored command line, in order (:func:`parse_option`)."""
    from arckv_press.runinfo import parse_option

    words = shlex.split(command)
    return dict(parse_option(words[i + 1]) for i, w in enumerate(words[:-1]) if w == "--option")


#: option values that were defaults when a stored row was made, so its command does not name them.
#: A row is labelled with its command's options plus the first combination of these (fewest first)
#: under which today's code gives the row's ids (the ids are recomputed, so a label cannot be wrong):
#: ``lambda_m`` 0.25 and ``indexer_rows="all"`` were the defaults before 2026-11-27, top-t anchors
#: with ``lambda_m`` 1.0 the default below keep 5% until the OMP search replaced them.
KNOWN_OPTIONS = ({"lambda_m": 0.25}, {"lambda_m": 1.0}, {"indexer_rows": "all"}, {"anchor_search": "scores"})

#: config ids of option values whose code changed since (their rows stay, under this label)
FORMER_IDS = {"30d356828b2a": "indexer_rows=corrected, additive estimate (superseded)",  # lambda_m 0.25
              "aca6877353e3": "indexer_rows=corrected, additive estimate (superseded)"}  # lambda_m 1.0 (keep < 5%)


def _known_combinations() -> list[dict]:
    """Every combination of :data:`KNOWN_OPTIONS` whose entries do not set one field twice, fewest first."""
    combos = []
    for size in range(len(KNOWN_OPTIONS) + 1):
        for group in combinations(KNOWN_OPTIONS, size):
            fields = [key for part in group for key in part]
            if len(fields) == len(set(fields)):
                combos.append({key: value for part in group for key, value in part.items()})
    return combos


def dev_damage(rows: list[dict], model_id: str | None = None) -> dict[tuple[str, str], dict[str, tuple[float, int]]]:
    """``{(method, label): {ratio: (mean damage, documents)}}`` of development-split rows; ``label``
    is ``default`` when the row's ids are today's defaults at its kept fraction, else the
    ``--option`` values of its command plus the :data:`KNOWN_OPTIONS` that were defaults when it ran
    (the first combination under which its ids are today's), else ``config <id>`` (an earlier code
    state); rows of an id in :data:`FORMER_IDS` carry its label."""
    from arckv_press.models import DEFAULT_MODEL_ID
    from arckv_press.runinfo import CurrentIds

    model_id = model_id or DEFAULT_MODEL_ID
    ids = CurrentIds(model_id)
    checkers: dict[str, CurrentIds] = {}
    combos = _known_combinations()

    def label(r: dict) -> str:
        if r["config_id"] in FORMER_IDS:
            return FORMER_IDS[r["config_id"]]
        given = _options(r["command"])
        for extra in combos:
            if extra.keys() & given.keys():
                continue
            opts = {**given, **extra}
            name = " ".join(f"{k}={v}" for k, v in opts.items())
            if name not in checkers:
                checkers[name] = CurrentIds(model_id, opts)
            if checkers[name].matches(r):
                return name
        return f"config {r['config_id']}"

    docs: dict[tuple[str, str, str], dict[str, float]] = defaultdict(dict)
    for r in rows:
        name = "default" if ids.matches(r) else label(r)
        docs[(r["method"], name, fmt_ratio(r["ratio"]))][r["doc"]] = float(r["damage"])  # a rerun replaces
    out: dict[tuple[str, str], dict[str, tuple[float, int]]] = defaultdict(dict)
    for (method, name, ratio), by_doc in docs.items():
        out[(method, name)][ratio] = (sum(by_doc.values()) / len(by_doc), len(by_doc))
    return out


def _ratios(cells) -> list[str]:
    return sorted({r for by_ratio in cells for r in by_ratio}, key=float, reverse=True)


def _cell(value: tuple[float, int] | None, docs: int) -> str:
    if value is None:
        return ""
    mean, n = value
    return f"{mean:.3f}" if n == docs else f"{mean:.3f} ({n} docs)"


def dev_split_markdown(rows: list[dict]) -> str:
    """Mean development-split damage, a row per (method, options), a column per kept fraction."""
    damage = dev_damage(rows)
    docs = max((n for by_ratio in damage.values() for _, n in by_ratio.values()), default=0)
    ratios = _ratios(damage.values())
    lines = ["| method | options | " + " | ".join(f"keep {float(r) * 100:g}%" for r in ratios) + " |",
             "|---|---|" + "---:|" * len(ratios)]
    for (method, label), by_ratio in sorted(damage.items(), key=lambda kv: (kv[0][0], kv[0][1] != "default", kv[0][1])):
        shown = "default" if label == "default" else f"`{label}`"
        lines.append(f"| `{method}` | {shown} | " + " | ".join(_cell(by_ratio.get(r), docs) for r in ratios) + " |")
    return "\n".join(lines)


SELECTORS = (("arckv", "learned indexer (`arckv`)"), ("arckv-ha", "HA (`arckv-ha`)"), ("arckv-vi", "VI (`arckv-vi`)"))


def selectors_markdown(rows: list[dict]) -> str:
    """The three ARC-KV selectors at today's defaults on the development split, with the mean over
    the kept fractions every selector has (the lowest damage of a column in bold)."""
    damage = dev_damage(rows)
    cells = {m: damage.get((m, "default"), {}) for m, _ in SELECTORS}
    ratios = [r for r in _ratios(cells.values()) if all(r in c for c in cells.values())]
    if not ratios:
        return "(no kept fraction has development rows of all three selectors with today's defaults)"
    means = {m: sum(c[r][0] for r in ratios) / len(ratios) for m, c in cells.items()}
    best = {r: min(c[r][0] for c in cells.values()) for r in ratios}
    best_mean = min(means.values())

    def fmt(x: float, low: float | None) -> str:
        return f"**{x:.3f}**" if low is not None and x == low else f"{x:.3f}"

    lines = ["| selector | " + " | ".join(f"keep {float(r) * 100:g}%" for r in ratios) + " | mean |",
             "|---|" + "---:|" * (len(ratios) + 1)]
    for m, label in SELECTORS:
        lines.append(f"| {label} | " + " | ".join(fmt(cells[m][r][0], best[r]) for r in ratios)
                     + f" | {fmt(means[m], best_mean)} |")
    return "\n".join(lines)


def compaction_time_markdown(rows: list[dict], threads: int = 1) -> str:
    """The last model-section run of ``bench_compaction.py`` with today's defaults on ``threads`` torch
    threads: its command, date and machine, a table of seconds per stage, and the ratios it printed
    against the issue's goals."""
    from .bench_compaction import ARCKV_STAGES, last_model_run, post_repeat, ratio_lines

    run, results = last_model_run(rows, threads=threads)
    lengths = sorted({k[2] for k in results})
    ratios = sorted({k[1] for k in results if k[0] != "none"}, reverse=True)
    methods = list(dict.fromkeys(k[0] for k in results if k[0] != "none"))
    names = {"repeat_prefill": "repeat-prefill", "reference_stats": "of it: statistics", "selection": "selection",
             "fit_rows": "witness rows", "merge": "merge", "beta_fit": "beta fit", "value_fit": "C_v fit"}
    head = ["tokens", "keep", "method", "prefill", *[names[s] for s in ARCKV_STAGES], "AM select + fit",
            "after the repeat-prefill", "end to end (prefill excluded)"]
    lines = [f"Run of {run['date']} on {run['machine']}: `{run['command']}`", "",
             "| " + " | ".join(head) + " |", "|---|---|---|" + "---:|" * (len(head) - 3)]

    def num(x: float | None) -> str:
        return "" if x is None else f"{x:.1f}"

    for length in lengths:
        prefill = results.get(("none", 1.0, length), {}).get("prefill")
        for ratio in ratios:
            for m in methods:
                st = results.get((m, ratio, length))
                if st is None:
                    continue
                total = st.get("compact_total", st.get("press_total"))
                after = post_repeat(st) if "compact_total" in st else None
                lines.append("| " + " | ".join([f"{length:,}", f"{ratio * 100:g}%", f"`{m}`", num(prefill),
                                                 *[num(st.get(s)) for s in ARCKV_STAGES], num(st.get("am_total")),
                                                 num(after), num(total)]) + " |")
    ratio_text = ratio_lines(results, lengths, ratios)
    if ratio_text:
        lines += ["", "Ratios printed by this run (goals in brackets; post = everything after the repeat-prefill):", ""]
        lines += [f"- {line.strip()}" for line in ratio_text]
    return "\n".join(lines)


def evidence_cost_markdown(rows: list[dict]) -> str:
    """Compaction hours behind the leaderboard's rows of every ranked benchmark
    (:data:`~arckv_press.bench.make_leaderboard.RESULT_TABLES` with a ``short`` label): per method and
    benchmark, the sum over its kept fractions of compactions x mean compaction seconds (the
    compactions are ``n_records``, else ``n_examples``), with the number of compactions; a total row.
    Rows without recorded seconds (no context) are left out."""
    from arckv_press.methods import METHOD_NAMES

    from .make_leaderboard import REFERENCE_METHODS, RESULT_TABLES

    tables = [t for t in RESULT_TABLES if t.short]
    cost: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for r in rows:
        t = next((t for t in tables if (r.get("benchmark"), r.get("task")) == (t.benchmark, t.task)), None)
        n = r.get("n_records") or r.get("n_examples")
        if t is None or not r.get("compaction_seconds") or not n:
            continue
        cell = cost[(r["method"], t.name)]
        cell[0] += int(float(n)) * float(r["compaction_seconds"])
        cell[1] += int(float(n))
    order = [m for m in METHOD_NAMES if m not in REFERENCE_METHODS] + list(REFERENCE_METHODS)
    methods = [m for m in order if any((m, t.name) in cost for t in tables)]
    methods += sorted({m for m, _ in cost} - set(methods))

    def fmt(c: list[float] | None) -> str:
        return "" if not c or not c[1] else f"{c[0] / 3600:.1f} ({c[1]})"

    def total(cells) -> list[float]:
        return [sum(c[0] for c in cells if c), sum(c[1] for c in cells if c)]

    by_method = {m: [cost.get((m, t.name)) for t in tables] for m in methods}
    lines = ["| method | " + " | ".join(t.short for t in tables) + " | all |", "|---|" + "---:|" * (len(tables) + 1)]
    for m, cells in by_method.items():
        lines.append("| " + " | ".join([REFERENCE_METHODS.get(m, f"`{m}`"), *map(fmt, cells), fmt(total(cells))]) + " |")
    columns = [total([cells[i] for cells in by_method.values()]) for i in range(len(tables))]
    lines.append("| " + " | ".join(["all", *map(fmt, columns), fmt(total(columns))]) + " |")
    return "\n".join(lines)


#: (doc, block name, source CSV, generator) of every generated study table; paths from the checkout root
STUDY_BLOCKS = (
    ("docs/results.md", "compaction-time", "leaderboards/bench_compaction.csv", compaction_time_markdown),
    ("docs/results.md", "compaction-time-two-threads", "leaderboards/bench_compaction.csv",
     partial(compaction_time_markdown, threads=2)),
    ("docs/results.md", "development-split", "leaderboards/studies/fidelity_dev.csv", dev_split_markdown),
    ("docs/indexer.md", "selectors-dev", "leaderboards/studies/fidelity_dev.csv", selectors_markdown),
    ("docs/results.md", "evidence-cost", "leaderboards/leaderboard.csv", evidence_cost_markdown),
)


def update_study_docs(root: Path | None = None) -> list[str]:
    """Rewrite every block of :data:`STUDY_BLOCKS` under ``root`` (default: the checkout); returns the
    docs that changed. A doc missing a block's markers is an error, and nothing of it is written."""
    from arckv_press.runinfo import read_rows

    root = Path(root) if root is not None else checkout()
    by_doc: dict[str, list] = defaultdict(list)
    for doc, name, source, make in STUDY_BLOCKS:
        by_doc[doc].append((name, source, make))
    changed = []
    for doc, blocks in by_doc.items():
        path = root / doc
        text = path.read_text(encoding="utf-8")
        for name, source, _ in blocks:  # every block's markers first: a doc missing one is left as it is
            _replace_between(text, *block_marks(name, source), "", path)
        new = text
        for name, source, make in blocks:
            new = _replace_between(new, *block_marks(name, source), make(read_rows(root / source)), path)
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(doc)
    return changed
