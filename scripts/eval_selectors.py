"""Anchor selectors on held-out development contexts: learned indexer vs HA vs VI vs AM OMP-fast.

The logic lives in :mod:`arckv_press.bench.eval_selectors`; ``--help`` lists the options.
"""

import sys

from arckv_press.bench.eval_selectors import main

if __name__ == "__main__":
    sys.exit(main())
