"""bf16 vs float32 speed on this machine: one matmul shaped like the default model's MLP input and
one prefill of the default model, median of repeats, ratio printed.

The logic lives in :mod:`arckv_press.bench.bench_dtype`; ``--help`` lists the options.
"""

import sys

from arckv_press.bench.bench_dtype import main

if __name__ == "__main__":
    sys.exit(main())
