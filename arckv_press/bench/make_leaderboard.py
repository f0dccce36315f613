"""Rebuild ``leaderboards/leaderboard.csv``, ``comparisons.csv``, the plots and every generated doc
block from the sources that ``leaderboards/sources.toml`` declares, from scratch.

    python scripts/make_leaderboard.py                 # the checkout's manifest
    python scripts/make_leaderboard.py --no-plots
    python scripts/make_leaderboard.py --sources path/to/leaderboards/sources.toml

The leaderboard holds one row per (model, benchmark, task, method, kept fraction), read from the
declared lm-eval run sets, needle CSV and continuation-fidelity CSV (:mod:`.leaderboard.readers`),
never from a previous leaderboard: a run folder that another set replaces is declared superseded in
the manifest, and a method's rows made with another indexer checkpoint or other compaction options
than its current ones are left out by id. Then each row's 95% bootstrap interval over its examples,
the paired comparisons of each ARC-KV method with every other (``comparisons.csv``), the plots
(``<benchmark>_score_vs_ratio.png``, ``<benchmark>_score_vs_time.png``, ``probes.png``) and the doc
blocks (the README's headline table and best-at-keep-10% list, the tables of ``docs/results.md``,
the study tables of :mod:`.study_tables`), each from the CSV its marker lines name. The same
sources give byte-identical CSVs and docs (``tests/test_make_leaderboard.py`` rebuilds a copy).

Columns: ``indexer`` (the learned indexer checkpoint behind an ``arckv`` row,
``arckv_press.indexer.checkpoint_id``) and ``config_id`` (its compaction options,
``arckv_press.config.config_id``), ``context_tokens`` (mean tokens of the compacted documents, prefix
included), ``example_scores`` (JSON ``{example id: score}``), ``source`` (the file the row was read
from, relative to the checkout).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from typing import Callable, NamedTuple

from arckv_press.runinfo import read_rows

from .leaderboard.doc_blocks import update_doc
from .leaderboard.doc_tables import benchmark_markdown, best_markdown, cross_model_markdown, headline_markdown, of_model
from .leaderboard.intervals import COMPARISON_FIELDS, add_intervals, comparisons
from .leaderboard.plots import plot_benchmark, plot_long_context, plot_probes
from .leaderboard.readers import current_rows, read_fidelity, read_needle, read_records, read_results
from .leaderboard.sources import DEFAULT_MANIFEST, Sources, load_sources
from .leaderboard.table import fill_references, key_of, sorted_unique, summary_markdown, write_csv
from .study_tables import (compaction_time_markdown, dev_split_markdown, evidence_cost_markdown, long_context_markdown,
                           needle_stages_markdown, read_config_labels, selectors_markdown)

__all__ = ["GeneratedTable", "TABLES", "read_sources", "generate_block", "rebuild", "main"]


class GeneratedTable(NamedTuple):
    """A generator of doc blocks: ``make(rows of the block's source, sources, params)`` and the
    parameters a block of it must and may give. A ``per_model`` table is made from one model's rows
    only (:func:`.leaderboard.doc_tables.of_model`: the block's ``model`` parameter, else the default
    model's), so it never mixes models; the others see every row."""

    make: Callable[[list[dict], Sources, dict], str]
    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    per_model: bool = False

    @property
    def accepted(self) -> set[str]:
        """Every parameter a block of this table may give (``model`` for a per-model table)."""
        return set(self.required) | set(self.optional) | ({"model"} if self.per_model else set())


#: the generators a ``[[block]]`` of the manifest names by its ``table``
TABLES: dict[str, GeneratedTable] = {
    "headline": GeneratedTable(lambda rows, s, p: headline_markdown(rows), per_model=True),
    "best": GeneratedTable(lambda rows, s, p: best_markdown(rows, s.ranked()), per_model=True),
    "benchmark": GeneratedTable(lambda rows, s, p: benchmark_markdown(rows, p["benchmark"], p["task"]),
                                ("benchmark", "task", "title"), ("label",), per_model=True),
    "cross-model": GeneratedTable(lambda rows, s, p: cross_model_markdown(rows)),
    "compaction-time": GeneratedTable(lambda rows, s, p: compaction_time_markdown(rows, threads=p.get("threads", 1)),
                                      (), ("threads",)),
    "development-split": GeneratedTable(
        lambda rows, s, p: dev_split_markdown(rows, read_config_labels(s.root / p["labels"] if "labels" in p else None),
                                              p.get("model")),
        (), ("labels", "model")),
    "selectors": GeneratedTable(lambda rows, s, p: selectors_markdown(rows)),
    "long-context": GeneratedTable(lambda rows, s, p: long_context_markdown(rows)),
    "evidence-cost": GeneratedTable(lambda rows, s, p: evidence_cost_markdown(rows, s.ranked()), per_model=True),
    "needle-stages": GeneratedTable(lambda rows, s, p: needle_stages_markdown(rows), per_model=True),
}


def package_version() -> str:
    """``arckv_press.__version__`` (importing the package loads no torch)."""
    from arckv_press import __version__

    return __version__


def _check_blocks(sources: Sources) -> None:
    for b in sources.blocks:
        where = f"{sources.path}: block {b.name!r} of {b.doc}"
        if b.table not in TABLES:
            raise ValueError(f"{where}: unknown table {b.table!r}; known: {', '.join(TABLES)}")
        gen = TABLES[b.table]
        missing, unknown = set(gen.required) - set(b.params), set(b.params) - gen.accepted
        if missing or unknown:
            raise ValueError(f"{where}: {'missing ' + str(sorted(missing)) if missing else ''}"
                             f"{' ' if missing and unknown else ''}{'unknown ' + str(sorted(unknown)) if unknown else ''}"
                             f" parameter(s) of table {b.table!r}")


def read_sources(sources: Sources, common: dict[str, str]) -> tuple[list[dict], list[dict]]:
    """``(rows, left_out)``: the current rows of every declared source in key order, and the rows
    left out because a method's current rows carry other ids (:func:`.leaderboard.readers.current_rows`).
    A declared superseded folder is read too, and each of its rows must be replaced by a row of the
    run set that supersedes it."""
    records = read_records(sorted({p for rs in sources.runs for p in rs.root.glob("**/arckv_compaction.jsonl")}))
    superseded = sources.superseded_runs()
    rows: list[dict] = []
    replaced: list[tuple[Path, dict]] = []
    seen: set[Path] = set()
    for runset in sources.runs:
        for path in sorted(runset.root.glob("**/results.json")):
            folder = path.parent.resolve()
            got = read_results(path, records, runset.no_context, common, sources.root)
            if folder in superseded:
                seen.add(folder)
                replaced += [(folder, r) for r in got]
            else:
                rows += got
    for folder in set(superseded) - seen:
        raise ValueError(f"{sources.path}: superseded run {sources.relative(folder)} holds no results.json")
    if sources.needle is not None:
        rows += read_needle(sources.needle, common, sources.root)
    if sources.fidelity is not None:
        rows += read_fidelity(sources.fidelity, common, sources.root)
    rows = sorted_unique(rows)
    by_key = {key_of(r): r for r in rows}
    for folder, r in replaced:
        by = sources.relative(superseded[folder].by) + "/"
        new = by_key.get(key_of(r))
        if new is None or not str(new.get("source", "")).startswith(by):
            raise ValueError(f"{sources.path}: {sources.relative(folder)} is declared superseded by {by}, which has "
                             f"no row for {r['benchmark']} / {r['task']} / {r['method']} / {r['ratio']}")
    return current_rows(rows)


def generate_block(sources: Sources, block, rows_of: Callable[[str], list[dict]]) -> str:
    """The body of ``block``, from the rows of its source CSV (``rows_of(source)``; one model's, for a
    per-model table)."""
    gen = TABLES[block.table]
    rows = rows_of(block.source)
    if gen.per_model:
        rows = of_model(rows, block.params.get("model"))
    return gen.make(rows, sources, block.params)


def rebuild(sources: Sources, plots: bool = True, command: str | None = None) -> dict:
    """Write every output of ``sources`` from its inputs; returns ``{"rows", "left_out", "docs"}``
    (the docs whose blocks changed)."""
    common = {"package_version": package_version(), "command": command or _command(sources)}
    _check_blocks(sources)
    rows, left_out = read_sources(sources, common)
    fill_references(rows)
    add_intervals(rows)
    write_csv(sources.leaderboard, rows)
    write_csv(sources.comparisons, comparisons(rows), COMPARISON_FIELDS)
    cache: dict[str, list[dict]] = {}

    def rows_of(source: str) -> list[dict]:
        if source not in cache:
            cache[source] = read_rows(sources.root / source)
        return cache[source]

    if plots:
        by_bench: dict[str, list[dict]] = defaultdict(list)
        for r in rows:
            by_bench[r["benchmark"]].append(r)
        for bench, rs in sorted(by_bench.items()):
            plot_benchmark(bench, rs, sources.plots)
        if sources.probes is not None:
            plot_probes(read_rows(sources.probes), sources.plots)
        if sources.compaction is not None:  # the same rows as the long-context blocks
            plot_long_context(rows_of(sources.relative(sources.compaction)), sources.plots)
    by_doc: dict[str, list] = defaultdict(list)
    for block in sources.blocks:
        by_doc[block.doc].append((block.name, block.source, generate_block(sources, block, rows_of)))
    changed = [doc for doc, blocks in by_doc.items() if update_doc(sources.root / doc, blocks)]
    return {"rows": rows, "left_out": left_out, "docs": changed}


def _command(sources: Sources) -> str:
    """The command that rebuilds from ``sources``, as recorded in every row."""
    rel = sources.relative(sources.path)
    return "python scripts/make_leaderboard.py" + ("" if rel == DEFAULT_MANIFEST.as_posix() else f" --sources {rel}")


def main(argv: list[str] | None = None) -> list[dict]:
    """Rebuild everything the manifest declares; returns the leaderboard rows."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sources", type=Path, default=None,
                   help=f"the sources manifest (default: the checkout's {DEFAULT_MANIFEST.as_posix()})")
    p.add_argument("--no-plots", action="store_true", help="write the CSVs and the doc blocks only")
    args = p.parse_args(sys.argv[1:] if argv is None else list(argv))
    sources = load_sources(args.sources)
    print(_command(sources))
    out = rebuild(sources, plots=not args.no_plots)
    rows, left_out = out["rows"], out["left_out"]
    print(f"{len(rows)} rows -> {sources.relative(sources.leaderboard)}, "
          f"comparisons -> {sources.relative(sources.comparisons)}"
          + ("" if args.no_plots else f", plots -> {sources.relative(sources.plots)}/"))
    for r in left_out:
        print(f"left out (other ids than the method's current rows): {r['benchmark']} / {r['task']} / {r['method']} / "
              f"{r['ratio']} (indexer {r.get('indexer') or '-'}, config {r.get('config_id') or '-'}, {r['source']})")
    print(f"doc blocks updated in {', '.join(out['docs'])}" if out["docs"] else "doc blocks unchanged")
    print(summary_markdown(rows))
    return rows


if __name__ == "__main__":
    main()
