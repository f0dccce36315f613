"""Needle retrieval and continuation damage for methods, reference-query sources and poolings.

The logic lives in :mod:`arckv_press.bench.probes`; ``--help`` lists the options.
"""

import sys

from arckv_press.bench.probes import main

if __name__ == "__main__":
    sys.exit(main())
