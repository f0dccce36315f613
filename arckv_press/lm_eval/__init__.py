"""lm-eval integration: the ``hf-arckv`` model (an ``HFLM`` that compacts each prompt's document).

Three ways to use it (lm-eval 0.4.13):

1. The stock command, once the package is installed (``pip install -e .`` or a wheel)::

       HF_HUB_OFFLINE=1 lm_eval --model hf-arckv \\
           --model_args press=arckv-ha,ratio=0.1,dtype=float32 \\
           --tasks quality --device cpu --output_path results/

   The names resolve through a start-up hook: the installed ``arckv_press_lm_eval.pth`` imports
   the tiny ``_arckv_press_lm_eval_hook`` module (a copy of :mod:`._pth_hook`), which registers
   ``hf-arckv`` lazily when lm-eval imports its registry and adds the package's task folder to
   every ``TaskManager`` (nothing else is imported at start-up). The package's ``quality``,
   ``ruler`` and ``longbench`` tasks then override lm-eval's built-ins of the same names. Opt out
   with ``ARCKV_LM_EVAL_NO_HOOK=1`` (everything) or ``ARCKV_LM_EVAL_NO_TASKS=1`` (tasks only).

2. The console script ``arckv-lm-eval`` (same arguments as ``lm_eval``; plugs the model and the
   tasks in by importing this package, for when the start-up hook is disabled, then runs
   lm-eval's CLI): see :mod:`.cli`.

3. Python::

       import lm_eval
       import arckv_press.lm_eval                      # registers "hf-arckv"
       from arckv_press.lm_eval import HFArcKV          # lazy attribute (imports torch/lm-eval)

       results = lm_eval.simple_evaluate(
           model="hf-arckv", model_args="press=snapkv,ratio=0.25", tasks=["quality"], ...)
       # or with an instance:
       lm = HFArcKV(press="arckv-ha", ratio=0.1, records="records.jsonl")
       results = lm_eval.simple_evaluate(model=lm, tasks=[...], task_manager=...)

Data-parallel evaluation: ``accelerate launch -m lm_eval --model hf-arckv ...`` on GPUs splits
the documents over ranks as for ``--model hf``: each rank compacts only the documents of its own
requests and writes its own records file, suffixed ``_rank<r>``. lm-eval's ``HFLM`` sets up data
parallelism only when GPUs are present; ``hf-arckv`` also does it over CPU processes. On CPU
(checked with two processes) launch with torchrun, because ``accelerate launch --cpu
--num_processes 2`` starts a single process without an MPI setup::

    ACCELERATE_USE_CPU=1 OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 -m lm_eval --model hf-arckv ...

(``-m arckv_press.lm_eval.cli`` works the same when the ``.pth`` hook is not installed.)

Results folder: lm-eval names ``<output_path>/<model name>/`` after ``pretrained=`` in
``--model_args``; without it (the default model) the name is random, so pass
``pretrained=<folder>`` (the converted default model folder works) for a stable name. The records
file goes directly into ``<output_path>``.

Importing this package is cheap (no torch, no lm-eval): the model class is loaded on first use.
"""

from __future__ import annotations

from typing import Any

from . import _pth_hook

MODEL_NAME = "hf-arckv"
MODEL_TARGET = "arckv_press.lm_eval.model:HFArcKV"

#: set to 1 to keep lm-eval's TaskManager to its own tasks and ``--include_path`` (no package tasks)
NO_TASKS_ENV = "ARCKV_LM_EVAL_NO_TASKS"

__all__ = ["MODEL_NAME", "MODEL_TARGET", "NO_TASKS_ENV", "HFArcKV", "register", "on_registry_imported",
           "on_task_manager_imported", "tasks_dir"]


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


def tasks_dir() -> str:
    """The folder of the package's task YAMLs (``arckv_press.tasks``: ``tasks/`` in a checkout)."""
    from arckv_press.tasks import TASKS_DIR

    return str(TASKS_DIR)


def on_task_manager_imported(manager_module: Any) -> None:
    """Make every ``lm_eval.tasks.TaskManager`` index the package's tasks (idempotent).

    lm-eval indexes its built-in folder first and then ``include_path`` in order, later folders
    overriding earlier ones. The package's folder is put first in ``include_path``, so ``quality``,
    ``ruler``, ``longbench`` and their subtasks are always the package's versions (lm-eval logs each
    override), while a folder the user passes still overrides them. ``ARCKV_LM_EVAL_NO_TASKS=1``
    turns this off (lm-eval's own ``ruler`` and ``longbench`` come back).
    """
    import functools
    import os

    cls = manager_module.TaskManager
    if getattr(cls.__init__, "_arckv_tasks", False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, verbosity=None, include_path=None, include_defaults=True, metadata=None):
        if os.environ.get(NO_TASKS_ENV, "") in ("", "0"):
            paths = include_path if isinstance(include_path, (list, tuple)) else [include_path]
            paths = [p for p in paths if p is not None]
            ours = tasks_dir()
            if not any(os.path.realpath(p) == ours for p in paths):
                include_path = [ours, *paths]
        original(self, verbosity, include_path, include_defaults, metadata)

    __init__._arckv_tasks = True
    cls.__init__ = __init__


def register() -> None:
    """Register ``hf-arckv`` in lm-eval's model registry now (imports ``lm_eval.api.registry``)."""
    import lm_eval.api.registry as registry_module

    on_registry_imported(registry_module)


def __getattr__(name: str) -> Any:
    if name == "HFArcKV":
        from .model import HFArcKV

        return HFArcKV
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_pth_hook.install()  # register now, or when lm-eval imports its registry / TaskManager
