"""lm-eval integration: the ``hf-arckv`` model (an ``HFLM`` that compacts each prompt's document).

Three ways to use it (lm-eval 0.4.13):

1. The stock command, once the package is installed (``pip install -e .`` or a wheel)::

       HF_HUB_OFFLINE=1 lm_eval --model hf-arckv \\
           --model_args press=arckv-ha,ratio=0.1,dtype=float32 \\
           --tasks quality --device cpu --output_path results/

   The names resolve through a start-up hook: the installed ``arckv_press_lm_eval.pth`` imports
   the tiny ``_arckv_press_lm_eval_hook`` module (a copy of :mod:`._pth_hook`), which registers
   ``hf-arckv`` lazily when lm-eval imports its registry and adds the package's task folder to
   every ``TaskManager`` (nothing else is imported at start-up; :mod:`.plugin`). The package's
   tasks (``quality``, ``quality_gen``, ``arckv_ruler``, ``arckv_longbench`` and their ``arckv_*``
   subtasks) add names to lm-eval's and never replace a built-in: ``--tasks ruler`` stays
   lm-eval's own RULER. Opt out with ``ARCKV_LM_EVAL_NO_HOOK=1``.

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
from .plugin import (
    MODEL_NAME,
    MODEL_TARGET,
    on_registry_imported,
    on_task_manager_imported,
    register,
    tasks_dir,
)

__all__ = ["MODEL_NAME", "MODEL_TARGET", "HFArcKV", "register", "on_registry_imported",
           "on_task_manager_imported", "tasks_dir"]


def __getattr__(name: str) -> Any:
    if name == "HFArcKV":
        from .model import HFArcKV

        return HFArcKV
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_pth_hook.install()  # register now, or when lm-eval imports its registry / TaskManager
