"""The benchmarks and leaderboard tools behind ``scripts/`` (each script is a thin entry point to the
module of the same name here, so the logic is imported and tested as package code).

Benchmarks run offline by default: importing this package sets ``HF_HUB_OFFLINE``,
``HF_DATASETS_OFFLINE`` (both ``1``) and ``TOKENIZERS_PARALLELISM`` (``false``) unless they are
already set; set ``HF_HUB_OFFLINE=0`` to let them download. Default outputs go to ``leaderboards/``
under :data:`ROOT`: the checkout the package runs from, else the working directory.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from arckv_press.tasks._common.resources import REPO_ROOT, SHARED_DATA_DIR  # noqa: E402 (after the env defaults)

__all__ = ["CHECKOUT", "ROOT", "SHARED_DATA_DIR", "checkout"]

#: the source checkout this package runs from (an editable install), ``None`` when installed
CHECKOUT: Path | None = REPO_ROOT
#: where default outputs (``leaderboards/``) and the README live: the checkout, else the working directory
ROOT: Path = CHECKOUT if CHECKOUT is not None else Path.cwd()


def checkout() -> Path:
    """The source checkout; a clear error when the package is installed from a wheel."""
    if CHECKOUT is None:
        raise RuntimeError("this tool works on the source checkout (it builds wheels of it); run it from a "
                           "`git clone` with `pip install -e .`")
    return CHECKOUT
