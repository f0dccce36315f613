"""Compaction cost: per-stage wall time of ARC-KV and the Attention-Matching baselines on the
default model, kvpress's presses end to end, and a head-level sweep on synthetic tensors.

The logic lives in :mod:`arckv_press.bench.bench_compaction`; ``--help`` lists the options.
"""

import sys

from arckv_press.bench.bench_compaction import main

if __name__ == "__main__":
    sys.exit(main())
