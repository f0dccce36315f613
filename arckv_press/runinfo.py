"""What a benchmark script records about its run: the command line, machine and versions, and
append-only CSV files (so long runs can be resumed row by row).

Used by ``scripts/needle.py``, ``scripts/bench_compaction.py`` and ``scripts/bench_decode.py``.
"""

from __future__ import annotations

import csv
import datetime as dt
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

__all__ = ["command_line", "machine_info", "print_header", "run_meta", "read_rows", "append_rows", "add_columns", "is_current", "CurrentIds", "current_rows"]


def command_line(argv: list[str] | None = None) -> str:
    """The exact command as typed (``python scripts/x.py --flag ...``)."""
    argv = sys.argv if argv is None else argv
    return shlex.join([Path(sys.executable).name, *argv])


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def median_seconds(fn, repeats: int, warmup: int = 1, reset=None) -> float:
    """Median wall time of ``fn()`` over ``repeats`` timed calls after ``warmup`` untimed ones;
    ``reset()`` (untimed) runs after every call to restore any state ``fn`` changed."""
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - t0
        if reset is not None:
            reset()
        if i >= warmup:
            times.append(elapsed)
    return statistics.median(times)


def _cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (Linux), or ``""``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def machine_info(device: str | torch.device = "cpu") -> dict[str, str]:
    """Device, CPU count, torch threads and the versions that matter for timings."""
    from arckv_press import __version__

    device = torch.device(device)
    name = _cpu_model() or platform.processor() or platform.machine()
    if device.type == "cpu":  # AVX2-only CPUs emulate bf16 (tens of times slower than float32)
        name += f", {torch.backends.cpu.get_cpu_capability()}"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    return {
        "device": f"{device.type} ({name})",
        "cpu_count": str(os.cpu_count()),
        "torch_threads": str(torch.get_num_threads()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "kvpress": _version("kvpress"),
        "arckv_press": __version__,
        "platform": platform.platform(),
    }


def run_meta(device: str | torch.device = "cpu", argv: list[str] | None = None) -> dict[str, str]:
    """Columns appended to every CSV row: command, date (UTC), package version, machine."""
    info = machine_info(device)
    machine = (
        f"{info['device']}, {info['cpu_count']} CPUs, {info['torch_threads']} threads, torch {info['torch']}, "
        f"transformers {info['transformers']}, kvpress {info['kvpress']}"
    )
    return {
        "command": command_line(argv),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "package_version": info["arckv_press"],
        "machine": machine,
    }


def print_header(title: str, device: str | torch.device = "cpu", argv: list[str] | None = None) -> None:
    """Print the command line and machine info (first lines of every benchmark's output)."""
    print(f"# {title}")
    print(f"command: {command_line(argv)}")
    for key, value in machine_info(device).items():
        print(f"{key}: {value}")
    print(flush=True)


def read_rows(path: str | Path) -> list[dict[str, str]]:
    """All rows of a CSV written by :func:`append_rows` (empty list if the file does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def append_rows(path: str | Path, rows: list[dict], fieldnames: list[str]) -> None:
    """Append ``rows`` to ``path`` (header written when the file is new; must match otherwise)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        with open(path, newline="", encoding="utf-8") as f:
            header = next(csv.reader(f), [])
        if header != list(fieldnames):
            raise ValueError(
                f"{path} has columns {header}, this script writes {list(fieldnames)}: move the old file away"
            )
    with open(path, "a", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fieldnames)
        if new:
            writer.writeheader()
        writer.writerows(rows)
        f.flush()


def add_columns(path: str | Path, fieldnames: list[str], values: dict[str, str] | None = None) -> bool:
    """Give a CSV written before some of ``fieldnames`` existed those columns (``values[col]`` for
    its rows, else empty), rewritten atomically with ``fieldnames``, so that :func:`append_rows`
    resumes it. Only new columns are added: a CSV whose columns are not all in ``fieldnames``, or
    missing, empty or already current, is left alone. Returns whether it was rewritten."""
    import os
    import tempfile

    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return False
    with open(path, newline="", encoding="utf-8") as f:
        header = next(csv.reader(f), [])
    if header == list(fieldnames) or not set(header) <= set(fieldnames):
        return False
    rows, fill = read_rows(path), {c: (values or {}).get(c, "") for c in fieldnames if c not in header}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=fieldnames)
            writer.writeheader()
            writer.writerows({**fill, **r} for r in rows)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return True


def is_current(row: dict, ids: dict[str, str]) -> bool:
    """Whether a stored result row was made with the indexer checkpoint and compaction options
    ``ids`` (:func:`arckv_press.registry.result_ids`) that its method uses now. A row without a
    ``config_id`` column is stale for a method that has one."""
    return all(str(row.get(key) or "") == value for key, value in ids.items())


class CurrentIds:
    """The ids (:func:`arckv_press.registry.result_ids`) a stored row of a method at a kept fraction
    must carry now, for ``model_id``, with the scripts' ``--option`` fields ``config_options`` and
    ``--indexer`` checkpoint ``indexer`` (:func:`arckv_press.registry.press_options`). Called as
    ``ids(method, ratio)``; :meth:`matches` checks a stored row (its ``method`` and ``ratio``
    columns; a row without a ratio counts as the full cache, 1)."""

    def __init__(self, model_id: str, config_options: dict | None = None, indexer: str | None = None):
        self.model_id, self.config_options, self.indexer = model_id, config_options, indexer
        self._cache: dict[tuple[str, float], dict[str, str]] = {}

    def __call__(self, method: str, ratio: float) -> dict[str, str]:
        key = (method, float(ratio))
        if key not in self._cache:
            from arckv_press.registry import press_options, result_ids

            options = press_options(method, self.config_options, self.indexer)
            self._cache[key] = result_ids(method, self.model_id, float(ratio), **options)
        return self._cache[key]

    def matches(self, row: dict) -> bool:
        return is_current(row, self(row["method"], float(row.get("ratio") or 1.0)))


def current_rows(rows: list[dict], model_id: str, config_options: dict | None = None,
                 indexer: str | None = None) -> list[dict]:
    """Rows made with the indexer checkpoint and compaction options each method now uses for
    ``model_id`` at the row's kept fraction (columns ``indexer`` and ``config_id``,
    :class:`CurrentIds`; kvpress methods: every row), or with the scripts' ``--option`` fields
    ``config_options`` and ``--indexer`` checkpoint ``indexer`` when given."""
    ids = CurrentIds(model_id, config_options, indexer)
    kept = [r for r in rows if ids.matches(r)]
    if len(kept) < len(rows):
        what = "other compaction defaults" if not config_options else f"other compaction options than {config_options}"
        print(f"({len(rows) - len(kept)} rows made with another indexer checkpoint or {what} are left out)")
    return kept


def parse_length(text: str) -> int:
    """A context length for a CLI: ``"2K"``/``"2k"`` -> 2000 tokens (K = 1000), ``"1500"`` -> 1500."""
    import argparse

    text = text.strip().lower()
    value = float(text[:-1]) * 1000 if text.endswith("k") else float(text)
    if value < 64 or value != int(value):
        raise argparse.ArgumentTypeError(f"context length must be a whole number of tokens >= 64, got {text!r}")
    return int(value)


def parse_option(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` with VALUE a Python literal (``4.0``, ``None``, ``'fixed'``) or a bare word."""
    import argparse
    import ast

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def add_option_argument(parser) -> None:
    """``--option KEY=VALUE`` (repeatable): a :class:`~arckv_press.config.CompactionConfig` field for the
    ARC-KV / Attention Matching methods (:func:`parse_option` values), collected as the dict
    ``args.options``; :func:`arckv_press.registry.press_options` turns it into press arguments."""
    import argparse

    class Collect(argparse.Action):
        def __call__(self, parser, namespace, value, option_string=None):
            setattr(namespace, self.dest, {**getattr(namespace, self.dest), value[0]: value[1]})

    parser.add_argument("--option", dest="options", action=Collect, type=parse_option, default={}, metavar="KEY=VALUE",
                        help="a CompactionConfig field for the ARC-KV / Attention Matching methods (repeatable), "
                             "e.g. lambda_m=1.0 or \"fit={'scope': 'all'}\"; their rows carry that option's config_id")
