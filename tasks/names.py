"""The lm-eval names of the package's tasks, and the names they were stored under before.

Every task and group of the package is named ``arckv_<name>`` (``arckv_ruler`` with
``arckv_niah_single_1`` ... ``arckv_qa_2``, ``arckv_longbench`` with ``arckv_longbench_<dataset>``),
except QuALITY's ``quality`` and ``quality_gen``, which lm-eval does not define, so that
installing the package adds names to lm-eval and never replaces one of its built-ins (lm-eval
0.4.13 has its own ``ruler``, ``niah_*``, ``longbench`` and ``longbench_*``).

Results stored before the rename carry the unprefixed names (``ruler``, ``niah_single_1``,
``longbench_multifieldqa_zh``, ...); :func:`current_task_name` maps either name to today's, so a
reader of stored ``results.json`` / ``sample_scores.json`` files accepts both.
"""

from __future__ import annotations

from arckv_press.tasks.longbench.metrics import DATASET2METRIC
from arckv_press.tasks.ruler.generate import TASKS as RULER_TASKS

PREFIX = "arckv_"
RULER_GROUP = PREFIX + "ruler"
LONGBENCH_GROUP = PREFIX + "longbench"

__all__ = ["LONGBENCH_GROUP", "PREFIX", "RULER_GROUP", "current_task_name", "longbench_task", "ruler_task"]


def ruler_task(name: str) -> str:
    """The lm-eval task of the RULER task ``name`` (``niah_single_1`` -> ``arckv_niah_single_1``)."""
    if name not in RULER_TASKS:
        raise ValueError(f"unknown RULER task {name!r}; valid: {sorted(RULER_TASKS)}")
    return PREFIX + name


def longbench_task(dataset: str) -> str:
    """The lm-eval task of the LongBench v1 dataset ``dataset`` (``arckv_longbench_<dataset>``)."""
    if dataset not in DATASET2METRIC:
        raise ValueError(f"unknown LongBench dataset {dataset!r}; valid: {sorted(DATASET2METRIC)}")
    return f"{LONGBENCH_GROUP}_{dataset}"


def current_task_name(name: str) -> str:
    """Today's name of a task or group stored under ``name``: the ``arckv_`` name for a name from
    before the rename (``ruler``, a RULER task, ``longbench``, ``longbench_<dataset>``), else
    ``name`` unchanged (a current name, ``quality``, or a name that is not the package's)."""
    if name in ("ruler", "longbench") or name in RULER_TASKS:
        return PREFIX + name
    if name.startswith("longbench_") and name.removeprefix("longbench_") in DATASET2METRIC:
        return PREFIX + name
    return name
