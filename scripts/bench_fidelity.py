"""Context fidelity benchmark: how much of a document's help to its own continuation survives
compaction, for every method at the five kept fractions.

The logic lives in :mod:`arckv_press.bench.bench_fidelity`; ``--help`` lists the options.
"""

from arckv_press.bench.bench_fidelity import main

if __name__ == "__main__":
    raise SystemExit(main())
