"""``arckv-lm-eval``: lm-eval's command line with the package plugged in.

Takes exactly the arguments of ``lm_eval`` / ``lm-eval`` (``run``, ``ls``, ``validate`` or the
legacy form without a sub-command), for example::

    HF_HUB_OFFLINE=1 arckv-lm-eval --model hf-arckv \\
        --model_args press=arckv-ha,ratio=0.1,dtype=float32 \\
        --tasks quality --device cpu --output_path results/

It imports :mod:`arckv_press.lm_eval` (which registers ``hf-arckv`` and adds the package's tasks to
lm-eval's ``TaskManager``) before handing over to ``lm_eval.__main__.cli_evaluate``, so it works
even when the start-up ``.pth`` hook is not installed or is disabled with
``ARCKV_LM_EVAL_NO_HOOK=1``. Also runnable as ``python -m arckv_press.lm_eval.cli``.
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    """Plug the package into lm-eval and run lm-eval's CLI with ``argv`` (default: ``sys.argv[1:]``)."""
    import arckv_press.lm_eval as integration

    integration.register()
    args = list(sys.argv[1:] if argv is None else argv)
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm-eval", *args]
    cli_evaluate()


if __name__ == "__main__":
    main()
