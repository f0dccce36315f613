"""Turn evaluation outputs into ``leaderboards/leaderboard.csv`` and PNG plots.

The logic lives in :mod:`arckv_press.bench.make_leaderboard`; ``--help`` lists the options.
"""

from arckv_press.bench.make_leaderboard import main

if __name__ == "__main__":
    main()
