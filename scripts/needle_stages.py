"""Where a compacted cache loses a planted needle: layer by layer, then head by head.

The logic lives in :mod:`arckv_press.bench.needle_stages`; ``--help`` lists the options.
"""

import sys

from arckv_press.bench.needle_stages import main

if __name__ == "__main__":
    sys.exit(main())
