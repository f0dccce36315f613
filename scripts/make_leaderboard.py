"""Rebuild ``leaderboards/leaderboard.csv``, ``comparisons.csv``, the plots and every generated doc
block from the sources that ``leaderboards/sources.toml`` declares.

The logic lives in :mod:`arckv_press.bench.make_leaderboard`; ``--help`` lists the options.
"""

from arckv_press.bench.make_leaderboard import main

if __name__ == "__main__":
    main()
