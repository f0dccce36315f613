"""Does the joint stage's soft surrogate point downhill for the hard loss it stands in for?

The logic lives in :mod:`arckv_press.bench.check_surrogate`; ``--help`` lists the options.
"""

from arckv_press.bench.check_surrogate import main

if __name__ == "__main__":
    raise SystemExit(main())
