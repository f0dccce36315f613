"""Needle in a haystack: exact retrieval of a 7-digit number per method, kept fraction, context
length and needle depth, on the default model with the Paul Graham essays.

The logic lives in :mod:`arckv_press.bench.needle`; ``--help`` lists the options.
"""

import sys

from arckv_press.bench.needle import main

if __name__ == "__main__":
    sys.exit(main())
