"""The sources manifest, ``leaderboards/sources.toml``: every input of the leaderboard rebuild and
every output it writes.

- ``[outputs]``: ``leaderboard`` and ``comparisons`` (CSV files), ``plots`` (a folder);
- ``[cases]``: the per-case CSVs read into the table (``needle``, ``fidelity``) and plotted
  (``probes``); each optional;
- ``[[runs]]``: lm-eval run sets, each a ``root`` folder of ``run_evals.py`` runs
  (``<root>/<benchmark>/<method>_<ratio>/results.json``, ``arckv_compaction.jsonl``,
  ``sample_scores.json``) and a line ``about`` it; ``no_context = true`` for a set of plain
  ``--model hf`` runs without the document;
- ``[[superseded]]``: run folders whose rows another run set replaces (``by``), with ``why``:
  they are read, each of their rows must have its replacement under ``by``, and they never enter
  the table. Two current sources with one row key are an error;
- ``[[block]]``: the generated doc blocks: ``doc`` (a Markdown file), ``name``, ``table`` (which
  generator writes it), ``source`` (the CSV it reads; ``leaderboards/leaderboard.csv`` for the
  leaderboard's own tables) and the generator's parameters (e.g. ``benchmark``, ``task``, ``title``
  and ``label`` of a ``benchmark`` table: a block with a ``label`` is a ranked benchmark, listed in
  the README's best-at-keep-10% block and the evidence cost).

Paths are relative to the checkout: the folder holding the manifest's folder.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_MANIFEST", "RunSet", "Superseded", "Block", "Sources", "load_sources"]

DEFAULT_MANIFEST = Path("leaderboards") / "sources.toml"


@dataclass(frozen=True)
class RunSet:
    """A folder of lm-eval runs (``run_evals.py --out``)."""

    root: Path
    about: str
    no_context: bool = False


@dataclass(frozen=True)
class Superseded:
    """Run folders whose every row a run of the set ``by`` replaces."""

    runs: tuple[Path, ...]
    by: Path
    why: str


@dataclass(frozen=True)
class Block:
    """A generated block of a doc: ``doc`` and ``source`` relative to the checkout, ``table`` the
    generator's name, ``params`` its keyword arguments."""

    doc: str
    name: str
    table: str
    source: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Sources:
    """The manifest, read: absolute paths under ``root`` (the checkout)."""

    path: Path
    root: Path
    leaderboard: Path
    comparisons: Path
    plots: Path
    runs: tuple[RunSet, ...]
    superseded: tuple[Superseded, ...]
    needle: Path | None
    fidelity: Path | None
    probes: Path | None
    compaction: Path | None
    blocks: tuple[Block, ...]

    def relative(self, path: Path) -> str:
        """``path`` as the manifest writes it (relative to the checkout)."""
        return Path(path).resolve().relative_to(self.root.resolve()).as_posix()

    def ranked(self) -> list[tuple[str, str, str]]:
        """``(label, benchmark, task)`` of every benchmark table with a ``label``, in manifest order."""
        return [(b.params["label"], b.params["benchmark"], b.params["task"]) for b in self.blocks
                if b.table == "benchmark" and b.params.get("label")]

    def superseded_runs(self) -> dict[Path, Superseded]:
        return {run: s for s in self.superseded for run in s.runs}


def _take(table: dict, key: str, where: str, kind: type | tuple = str, required: bool = True):
    if key not in table:
        if required:
            raise ValueError(f"{where}: missing {key!r}")
        return None
    value = table.pop(key)
    if not isinstance(value, kind):
        raise ValueError(f"{where}: {key!r} must be {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def _no_more(table: dict, where: str) -> None:
    if table:
        raise ValueError(f"{where}: unknown key(s) {sorted(table)}")


def load_sources(path: Path | str | None = None) -> Sources:
    """Read and check the manifest at ``path`` (default: the checkout's ``leaderboards/sources.toml``).
    Every input it names must exist; an unknown or missing key, or a value of the wrong type, is an
    error naming the manifest and the entry."""
    if path is None:
        from arckv_press.bench import ROOT

        path = ROOT / DEFAULT_MANIFEST
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no sources manifest at {path}")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not TOML ({exc})") from exc
    root = path.resolve().parent.parent

    def existing(rel: str, where: str, folder: bool = False) -> Path:
        p = (root / rel).resolve()
        if not (p.is_dir() if folder else p.is_file()):
            raise ValueError(f"{where}: {rel!r} is no {'folder' if folder else 'file'} under {root}")
        return p

    outputs = _take(data, "outputs", f"{path}", dict)
    where = f"{path} [outputs]"
    leaderboard = root / _take(outputs, "leaderboard", where)
    comparisons = root / _take(outputs, "comparisons", where)
    plots = root / _take(outputs, "plots", where)
    _no_more(outputs, where)

    cases = _take(data, "cases", f"{path}", dict, required=False) or {}
    where = f"{path} [cases]"
    found = {k: (existing(v, where) if (v := _take(cases, k, where, required=False)) is not None else None)
             for k in ("needle", "fidelity", "probes", "compaction")}
    _no_more(cases, where)

    runs = []
    for i, entry in enumerate(_take(data, "runs", f"{path}", list, required=False) or [], 1):
        where = f"{path} [[runs]] entry {i}"
        runs.append(RunSet(existing(_take(entry, "root", where), where, folder=True), _take(entry, "about", where),
                           bool(_take(entry, "no_context", where, bool, required=False))))
        _no_more(entry, where)
    roots = {r.root for r in runs}

    superseded = []
    for i, entry in enumerate(_take(data, "superseded", f"{path}", list, required=False) or [], 1):
        where = f"{path} [[superseded]] entry {i}"
        by = existing(_take(entry, "by", where), where, folder=True)
        if by not in roots:
            raise ValueError(f"{where}: 'by' {entry.get('by', by)!r} is no [[runs]] root")
        folders = tuple(existing(rel, where, folder=True) for rel in _take(entry, "runs", where, list))
        for folder in folders:
            if not any(root_ in folder.parents for root_ in roots):
                raise ValueError(f"{where}: {folder} lies in no [[runs]] root")
            if by in folder.parents:
                raise ValueError(f"{where}: {folder} lies in the run set that supersedes it")
        superseded.append(Superseded(folders, by, _take(entry, "why", where)))
        _no_more(entry, where)

    blocks = []
    for i, entry in enumerate(_take(data, "block", f"{path}", list, required=False) or [], 1):
        where = f"{path} [[block]] entry {i}"
        doc, name = _take(entry, "doc", where), _take(entry, "name", where)
        existing(doc, where)
        table, source = _take(entry, "table", where), _take(entry, "source", where)
        if root / source != leaderboard:
            existing(source, where)
        blocks.append(Block(doc, name, table, source, dict(entry)))
    names = [(b.doc, b.name) for b in blocks]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: a doc has two blocks of one name")
    _no_more(data, f"{path}")
    return Sources(path, root, leaderboard, comparisons, plots, tuple(runs), tuple(superseded), found["needle"],
                   found["fidelity"], found["probes"], found["compaction"], tuple(blocks))
