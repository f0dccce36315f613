"""Cache-reconstruction fidelity: paper Table (motivation_reconstruction) and Table
(key_merging_coefficient_ablation) on the default model and real contexts.

The logic lives in :mod:`arckv_press.bench.reconstruction`; ``--help`` lists the options.
"""

from arckv_press.bench.reconstruction import main

if __name__ == "__main__":
    main()
