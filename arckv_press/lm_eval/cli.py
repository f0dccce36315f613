"""``arckv-lm-eval``: lm-eval's command line with the ``hf-arckv`` model registered.

Takes exactly the arguments of ``lm_eval`` / ``lm-eval`` (``run``, ``ls``, ``validate`` or the
legacy form without a sub-command), for example::

    HF_HUB_OFFLINE=1 arckv-lm-eval --model hf-arckv \\
        --model_args press=arckv-ha,ratio=0.1,dtype=float32 \\
        --tasks quality --device cpu --output_path results/

Before handing over to ``lm_eval.__main__.cli_evaluate`` it

- registers ``hf-arckv`` (works even when the start-up ``.pth`` hook is not installed);
- adds ``--include_path <tasks folder>`` when no ``--include_path`` was given and a task folder
  is found: ``$ARCKV_TASKS_DIR``, else the repository's ``tasks/`` next to the ``arckv_press``
  package (an editable install or a source checkout; wheels do not ship the tasks).

Also runnable as ``python -m arckv_press.lm_eval.cli``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

TASKS_ENV = "ARCKV_TASKS_DIR"
_SUBCOMMANDS = ("run", "ls", "validate")

__all__ = ["default_tasks_dir", "main", "prepare_argv"]


def default_tasks_dir() -> Path | None:
    """``$ARCKV_TASKS_DIR`` or the repository's ``tasks/`` folder, if it holds our task files."""
    env = os.environ.get(TASKS_ENV)
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"${TASKS_ENV} points to {str(path)!r}, which is not a folder")
        return path
    candidate = Path(__file__).resolve().parents[2] / "tasks"
    if (candidate / "_common" / "doc_markers.py").is_file():
        return candidate
    return None


def prepare_argv(argv: list[str]) -> list[str]:
    """``argv`` (without the program name) with ``--include_path`` added when appropriate."""
    argv = list(argv)
    if not argv or any(a == "--include_path" or a.startswith("--include_path=") for a in argv):
        return argv
    if argv[0] in ("-h", "--help"):
        return argv
    if argv[0] not in _SUBCOMMANDS and not argv[0].startswith("-"):
        return argv  # an unknown sub-command: let lm-eval report it
    tasks = default_tasks_dir()
    if tasks is None:
        return argv
    return argv + ["--include_path", str(tasks)]


def main(argv: list[str] | None = None) -> None:
    """Register ``hf-arckv`` and run lm-eval's CLI with ``argv`` (default: ``sys.argv[1:]``)."""
    import arckv_press.lm_eval as integration

    integration.register()
    args = prepare_argv(sys.argv[1:] if argv is None else argv)
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm-eval", *args]
    cli_evaluate()


if __name__ == "__main__":
    main()
