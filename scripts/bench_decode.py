"""One decode step's attention, per layer: the full cache against the ARC-KV compact cache.

The logic lives in :mod:`arckv_press.bench.bench_decode`; ``--help`` lists the options.
"""

import sys

from arckv_press.bench.bench_decode import main

if __name__ == "__main__":
    sys.exit(main())
