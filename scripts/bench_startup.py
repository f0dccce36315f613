"""Interpreter start-up cost of the installed package (its lm-eval start-up hook runs in every
Python process of the environment).

The logic lives in :mod:`arckv_press.bench.bench_startup`; ``--help`` lists the options.
"""

from arckv_press.bench.bench_startup import main

if __name__ == "__main__":
    raise SystemExit(main())
