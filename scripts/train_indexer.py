#!/usr/bin/env python
"""Train the ARC-KV value-aware indexer of a base model and ship it (paper Sec. 3.5).

Thin entry point: everything lives in :mod:`arckv_press.indexer.run` (steps, resumability,
sharding, threads, defaults; see its docstring). Typical CPU run for the default model::

    python scripts/train_indexer.py --pools-only --pool-shard 0/2 &   # reference pools
    python scripts/train_indexer.py --pools-only --pool-shard 1/2 &
    python scripts/train_indexer.py --layers 0-14 &                  # one shard per core
    python scripts/train_indexer.py --layers 15-29 &
    python scripts/train_indexer.py --merge                           # -> arckv_press/indexer/weights/...

HYPERPARAMETERS_NOTE
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from arckv_press.indexer.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
