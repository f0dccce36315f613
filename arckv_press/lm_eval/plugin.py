"""What plugs the package into lm-eval: the ``hf-arckv`` registry entry and the package's tasks.

The start-up hook (:mod:`._pth_hook`) calls :func:`on_registry_imported` and
:func:`on_task_manager_imported` when lm-eval first imports its registry and its ``TaskManager``;
``import arckv_press.lm_eval`` does the same for modules lm-eval has already imported. Standard
library only at import time (no torch, no lm-eval).

The package *adds* task names to lm-eval, never replaces one: its tasks are ``arckv_ruler`` (and
its ``arckv_*`` subtasks), ``arckv_longbench`` (``arckv_longbench_*``), ``quality`` and
``quality_gen``, none of them a built-in of lm-eval 0.4.13, and if a later lm-eval defines one of
these names its own task wins (:func:`index_paths`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

MODEL_NAME = "hf-arckv"
MODEL_TARGET = "arckv_press.lm_eval.model:HFArcKV"

__all__ = ["MODEL_NAME", "MODEL_TARGET", "index_paths", "on_registry_imported", "on_task_manager_imported",
           "register", "tasks_dir"]


def on_registry_imported(registry_module: Any) -> None:
    """Register ``hf-arckv`` (lazy ``"module:Class"`` target) in a freshly imported lm-eval registry.

    Also imports ``lm_eval.models`` (a table of lazy placeholders, no model code): lm-eval only
    registers its own models when ``get_model`` finds the registry *empty*, which it no longer is
    once ``hf-arckv`` is in it. Idempotent.
    """
    registry = registry_module.model_registry
    if MODEL_NAME not in registry:
        registry.register(MODEL_NAME, target=MODEL_TARGET)
    import lm_eval.models  # noqa: F401  (registers "hf", "vllm", ... as lazy placeholders)


def register() -> None:
    """Register ``hf-arckv`` in lm-eval's model registry now (imports ``lm_eval.api.registry``)."""
    import lm_eval.api.registry as registry_module

    on_registry_imported(registry_module)


def tasks_dir() -> str:
    """The folder of the package's task YAMLs (``arckv_press.tasks``: ``tasks/`` in a checkout)."""
    from arckv_press.tasks import TASKS_DIR

    return str(TASKS_DIR)


def index_paths(include_path, include_defaults: bool, ours: str, builtin: str) -> tuple[list | None, bool]:
    """``(include_path, include_defaults)`` that a ``TaskManager`` is built with so that it indexes
    the package's folder ``ours`` as well as what the caller asked for, below everything else.

    lm-eval 0.4.13 indexes its built-in folder ``builtin`` first, then ``include_path`` in order,
    and a name in a later folder replaces the same name of an earlier one. So ``ours`` goes first:
    with the built-ins, ``[ours, builtin, *include_path]`` and no separate defaults (the same folders
    in lm-eval's own order after ours); without them, ``[ours, *include_path]``. A built-in or a
    folder the caller passes therefore always wins over a task of ours with the same name. A caller
    that passes ``ours`` itself gets exactly its own arguments.
    """
    paths = list(include_path) if isinstance(include_path, (list, tuple)) else [include_path]
    paths = [p for p in paths if p is not None]
    if any(os.path.realpath(p) == os.path.realpath(ours) for p in paths):
        return include_path, include_defaults
    if include_defaults:
        return [ours, builtin, *paths], False
    return [ours, *paths], False


def on_task_manager_imported(manager_module: Any) -> None:
    """Make every ``lm_eval.tasks.TaskManager`` also index the package's tasks, after lm-eval's own
    and the caller's folders in precedence (:func:`index_paths`); its ``include_path`` attribute
    keeps the caller's value. Idempotent."""
    import functools

    cls = manager_module.TaskManager
    if getattr(cls.__init__, "_arckv_tasks", False):
        return
    original = cls.__init__
    builtin = str(Path(manager_module.__file__).resolve().parent)  # the folder TaskManager calls its defaults

    @functools.wraps(original)
    def __init__(self, verbosity=None, include_path=None, include_defaults=True, metadata=None):
        paths, defaults = index_paths(include_path, include_defaults, tasks_dir(), builtin)
        original(self, verbosity, paths, defaults, metadata)
        self.include_path = include_path

    __init__._arckv_tasks = True
    cls.__init__ = __init__
