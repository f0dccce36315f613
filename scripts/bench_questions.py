"""Many questions about one compacted context: answered one by one vs decoded together.

The logic lives in :mod:`arckv_press.bench.bench_questions`; ``--help`` lists the options.
"""

from arckv_press.bench.bench_questions import main

if __name__ == "__main__":
    raise SystemExit(main())
