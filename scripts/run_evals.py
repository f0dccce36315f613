"""Run the lm-eval benchmarks (RULER, QuALITY, LongBench) for methods x kept fractions, resumably.

The logic lives in :mod:`arckv_press.bench.run_evals`; ``--help`` lists the options.
"""

from arckv_press.bench.run_evals import main

if __name__ == "__main__":
    raise SystemExit(main())
