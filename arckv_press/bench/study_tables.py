"""The study tables of ``docs/``, generated from the benchmark CSVs between marker lines, so a figure
in the docs cannot drift from the data it came from (``scripts/make_leaderboard.py`` writes the
blocks that ``leaderboards/sources.toml`` declares; ``tests/test_make_leaderboard.py`` checks the
committed docs equal what this module generates).

- ``compaction-time`` (``docs/results.md``): the last model-section run of ``bench_compaction.py``
  with today's defaults on one (or ``threads``) torch threads: seconds per stage and the ratios that
  run printed (the same lines as ``bench_compaction.py --summary``).
- ``development-split`` (``docs/studies/development_split.md``): mean continuation damage on the
  development documents (``bench_fidelity.py --split dev``) per method and compaction options, each
  row labelled ``default`` when its config id is today's default there, else by its command's
  ``--option`` values when they give its ids, else by the label stored for its config id
  (``leaderboards/studies/config_labels.csv``: rows made under earlier defaults, whose commands do
  not name the options that tell them apart), else by its config id.
- ``selectors`` (``docs/indexer.md``): the same data for the three ARC-KV selectors at today's
  defaults, with the mean over kept fractions.
- ``long-context`` (``docs/results.md``, ``docs/studies/long_contexts.md``): the newest synthetic
  sweep of ``bench_compaction.py`` (time per stage and peak memory against T, chunked and not).
- ``evidence-cost`` (``docs/results.md``): the compaction hours behind the leaderboard's rows of
  the ranked benchmarks, per method.
- ``needle-stages`` (``docs/studies/needle_end.md``): ``needle_stages.py --stages``' ladder, needles
  found per stage of the method on the same anchors, and the stage that first loses each.
"""

from __future__ import annotations

import shlex
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from .leaderboard.doc_tables import of_model
from .leaderboard.table import REFERENCE_METHODS, fmt_ratio

__all__ = ["read_config_labels", "dev_damage", "dev_split_markdown", "selectors_markdown",
           "compaction_time_markdown", "long_context_markdown", "evidence_cost_markdown", "needle_stages_markdown"]


def _options(command: str) -> dict:
    """The ``--option KEY=VALUE`` values of a stored command line, in order (:func:`parse_option`)."""
    from arckv_press.runinfo import parse_option

    words = shlex.split(command)
    return dict(parse_option(words[i + 1]) for i, w in enumerate(words[:-1]) if w == "--option")


def read_config_labels(path: Path | None) -> dict[tuple[str, str], str]:
    """``{(method, config_id): label}`` from a CSV with those columns (``{}`` without a path)."""
    from arckv_press.runinfo import read_rows

    if path is None:
        return {}
    labels = {}
    for n, r in enumerate(read_rows(path), 2):
        if not r.get("method") or not r.get("config_id") or not r.get("label"):
            raise ValueError(f"{path}:{n}: a label needs method, config_id and label")
        labels[(r["method"], r["config_id"])] = r["label"]
    return labels


def dev_damage(rows: list[dict], labels: dict[tuple[str, str], str] | None = None,
               model_id: str | None = None) -> dict[tuple[str, str], dict[str, tuple[float, int]]]:
    """``{(method, label): {ratio: (mean damage, documents)}}`` of the development-split rows of one
    model (``model_id``, default the default model's, which rows without a model are); ``label`` is
    ``default`` when the row's ids are today's defaults at its kept fraction, else the ``--option``
    values of its command when they give its ids today, else ``labels[(method, config_id)]`` when
    given, else ``config <id>``, followed by ``, N-token docs`` for documents of another length than
    the study's (``bench_fidelity.DOC_TOKENS``), so that documents of two lengths never share a mean."""
    from arckv_press.bench.bench_fidelity import DOC_TOKENS
    from arckv_press.models import DEFAULT_MODEL_ID
    from arckv_press.runinfo import CurrentIds

    model_id = model_id or DEFAULT_MODEL_ID
    labels = labels or {}
    ids = CurrentIds(model_id)
    checkers: dict[str, CurrentIds] = {}

    def label(r: dict) -> str:
        if ids.matches(r):
            return "default"
        given = _options(r["command"])
        name = " ".join(f"{k}={v}" for k, v in given.items())
        if given:
            if name not in checkers:
                checkers[name] = CurrentIds(model_id, given)
            try:
                if checkers[name].matches(r):
                    return name
            except (TypeError, ValueError):  # options the code no longer takes: the row's stored label
                pass
        return labels.get((r["method"], r["config_id"]), f"config {r['config_id']}")

    def length(r: dict) -> str:
        tokens = int(r.get("doc_tokens") or DOC_TOKENS)
        return "" if tokens == DOC_TOKENS else f", {tokens:,}-token docs"

    docs: dict[tuple[str, str, str], dict[str, float]] = defaultdict(dict)
    for r in of_model(rows, model_id):  # rows from before the model column: the default model's
        docs[(r["method"], label(r) + length(r), fmt_ratio(r["ratio"]))][r["doc"]] = float(r["damage"])  # a rerun replaces
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


def dev_split_markdown(rows: list[dict], labels: dict[tuple[str, str], str] | None = None,
                       model_id: str | None = None) -> str:
    """Mean development-split damage of one model (``model_id``, default the default model's), a row
    per (method, options), a column per kept fraction (``labels``: :func:`dev_damage`'s)."""
    damage = dev_damage(rows, labels, model_id)
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
    (:func:`~arckv_press.bench.bench_compaction.ratio_lines`)."""
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
        lines += ["", "Ratios printed by this run (post = everything after the repeat-prefill):", ""]
        lines += [f"- {line.strip()}" for line in ratio_text]
    return "\n".join(lines)


#: the columns of the long-context table: (header, ``arckv-ha`` stage or ``method/stage``, cell kind)
LONG_CONTEXT_COLUMNS = (
    ("statistics pass s", "reference_pass", "s"), ("post s", "post", "s"), ("merge", "merge", "s"),
    ("beta fit", "beta_fit", "s"), ("C_v fit", "value_fit", "s"), ("post / pass", "post", "per pass"),
    ("post growth", "post", "growth"), ("post MiB", "post_tensor_mib", "MiB"),
    ("MiB growth", "post_tensor_mib", "growth"),
    ("unchunked post s", "post_unchunked", "s"), ("unchunked growth", "post_unchunked", "growth"),
    ("unchunked MiB", "post_unchunked_tensor_mib", "MiB"), ("OMP-fast s", "am-omp-fast/total", "s"),
)


def long_context_markdown(rows: list[dict], ratio: float = 0.1) -> str:
    """The newest synthetic sweep of ``bench_compaction.py`` at keep ``ratio``: per length, the
    statistics pass and the work after it (post, with merge and the two fits), post / pass, post's
    growth per doubling, its peak memory (the bytes it holds at once), the same post without chunks
    and OMP-fast while it ran (:func:`~arckv_press.bench.bench_compaction.last_synthetic_run`)."""
    from .bench_compaction import last_synthetic_run

    run, by_length = last_synthetic_run(rows, ratio)
    lines = [f"Run of {run['date']} on {run['machine']}, keep {ratio * 100:g}%: `{run['command']}`", "",
             "| tokens | " + " | ".join(h for h, _, _ in LONG_CONTEXT_COLUMNS) + " |",
             "|---|" + "---:|" * len(LONG_CONTEXT_COLUMNS)]

    def value(T: int, stage: str) -> float | None:
        row = by_length.get(T, {})
        key = stage if "/" in stage else f"arckv-ha/{stage}"
        return row.get(key)

    def cell(T: int, stage: str, kind: str) -> str:
        x = value(T, stage)
        if x is None:
            return ""
        if kind == "growth":
            before = value(T // 2, stage) if T % 2 == 0 else None
            return "" if before is None else f"{x / before:.2f}x"
        if kind == "per pass":
            passed = value(T, "reference_pass")
            return f"{x / passed:.3f}" if passed else ""
        return f"{x:.0f}" if kind == "MiB" else f"{x:.2f}"

    for T in by_length:
        lines.append(f"| {T:,} | " + " | ".join(cell(T, stage, kind) for _, stage, kind in LONG_CONTEXT_COLUMNS) + " |")
    return "\n".join(lines)


def evidence_cost_markdown(rows: list[dict], ranked: Sequence[tuple[str, str, str]]) -> str:
    """Compaction hours behind the leaderboard's rows of every ranked benchmark ``(label,
    benchmark, task)``: per method and benchmark, the sum over its kept fractions of compactions x
    mean compaction seconds (the compactions are ``n_records``, else ``n_examples``), with the
    number of compactions; a total row. Rows without recorded seconds (no context) are left out."""
    from arckv_press.methods import METHOD_NAMES

    cost: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for r in rows:
        label = next((lb for lb, bench, task in ranked if (r.get("benchmark"), r.get("task")) == (bench, task)), None)
        n = r.get("n_records") or r.get("n_examples")
        if label is None or not r.get("compaction_seconds") or not n:
            continue
        cell = cost[(r["method"], label)]
        cell[0] += int(float(n)) * float(r["compaction_seconds"])
        cell[1] += int(float(n))
    labels = [lb for lb, _, _ in ranked]
    order = [m for m in METHOD_NAMES if m not in REFERENCE_METHODS] + list(REFERENCE_METHODS)
    methods = [m for m in order if any((m, lb) in cost for lb in labels)]
    methods += sorted({m for m, _ in cost} - set(methods))

    def fmt(c: list[float] | None) -> str:
        return "" if not c or not c[1] else f"{c[0] / 3600:.1f} ({c[1]})"

    def total(cells) -> list[float]:
        return [sum(c[0] for c in cells if c), sum(c[1] for c in cells if c)]

    by_method = {m: [cost.get((m, lb)) for lb in labels] for m in methods}
    lines = ["| method | " + " | ".join(labels) + " | all |", "|---|" + "---:|" * (len(labels) + 1)]
    for m, cells in by_method.items():
        lines.append("| " + " | ".join([REFERENCE_METHODS.get(m, f"`{m}`"), *map(fmt, cells), fmt(total(cells))]) + " |")
    columns = [total([cells[i] for cells in by_method.values()]) for i in range(len(labels))]
    lines.append("| " + " | ".join(["all", *map(fmt, columns), fmt(total(columns))]) + " |")
    return "\n".join(lines)


def needle_stages_markdown(rows: list[dict]) -> str:
    """The stage ladder of ``needle_stages.py --stages`` (:data:`~arckv_press.bench.needle_stages.STAGES`):
    per length, run options (the command's ``--option`` values) and stage, the needles found per
    depth and in all, and "first lost": the cases the full cache finds and the stage before finds
    (the full cache, for the first stage) but this stage does not, so the stage that loses a needle
    is the row that counts it. The full cache's row is shared by every run of a length (it depends
    on no option); a rerun of a case replaces its row. Rows of ``--oracle`` runs (``anchors``
    ``oracle``) are labelled "oracle anchors"."""
    from arckv_press.bench.needle_stages import STAGES

    names = ["full", *(name for name, _ in STAGES)]
    found: dict[tuple, dict[tuple[str, str], bool]] = defaultdict(dict)  # (length, label, stage) -> case -> found
    for r in rows:
        given = _options(r.get("command", ""))
        label = " ".join(f"{k}={v}" for k, v in given.items()) if given else "defaults"
        if r.get("anchors") == "oracle":  # needle_stages.py --oracle: the question's own top positions
            label = "oracle anchors" + ("" if label == "defaults" else ", " + label)
        key = (int(r["length"]), "" if r["stage"] == "full" else label, r["stage"])
        found[key][(r["seed"], r["depth"])] = r["correct"] == "1"
    depths = sorted({case[1] for cases in found.values() for case in cases}, key=float)
    lines = ["| length | options | stage | " + " | ".join(f"{float(d) * 100:g}%" for d in depths)
             + " | all | first lost |", "|---|---|---|" + "---:|" * (len(depths) + 2)]
    def row(length: int, label: str, stage: str, cases: dict, lost: str) -> str:
        cells = []
        for d in depths:
            mine = [ok for (_, depth), ok in cases.items() if depth == d]
            cells.append(f"{sum(mine)}/{len(mine)}" if mine else "")
        return (f"| {length:,} | {label} | {stage} | " + " | ".join(cells)
                + f" | {sum(cases.values())}/{len(cases)} | {lost} |")

    for length in sorted({k[0] for k in found}):
        full = found.get((length, "", "full"), {})
        if full:
            lines.append(row(length, "", "full cache", full, ""))
        for label in sorted({k[1] for k in found if k[0] == length and k[1]}):
            before = full
            for stage in names[1:]:
                cases = found.get((length, label, stage))
                if cases is None:
                    continue
                lost = sum(1 for case, ok in cases.items() if full.get(case) and before.get(case) and not ok)
                lines.append(row(length, label, stage, cases, str(lost)))
                before = cases
    return "\n".join(lines)
