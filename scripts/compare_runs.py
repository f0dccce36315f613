"""Paired comparison of two lm-eval runs on the prompts both answered.

The logic lives in :mod:`arckv_press.bench.compare_runs`; ``--help`` lists the options.
"""

from arckv_press.bench.compare_runs import main

if __name__ == "__main__":
    main()
