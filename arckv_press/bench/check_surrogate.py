"""Does the joint stage's soft surrogate point downhill for the hard loss it stands in for?

The indexer's joint training (paper Sec. 3.4, Eqs. (soft_candidate_gate)-(output_ste)) takes
its forward value from the hard top-t branch ``L_h`` and its gradient from the soft surrogate
``L_s``. This script checks, in score space, whether that gradient is informative. For each
reference pool, layer and kept fraction rho, with one episode split (score / fit / holdout
positions, as in training):

  s        the indexer's pooled scores (Eq. (indexer_pooling)) on the score rows
  L_h(s)   hard branch: top-t anchors, beta and C_v fitted on the fit rows, relative squared
           error of the attention output on the holdout rows (Eq. (output_loss))
  g        dL_s/ds of the soft surrogate at temperature ``--gamma`` (non-zero only on the 2t
           candidates)
  step     s + eps * sigma_s * sqrt(T) * d / ||d|| for d = -g, +g, and a random direction on
           the same candidates (sigma_s: the per-head std of s)

and reports the change of ``L_h`` after each step. An informative surrogate lowers ``L_h`` along
-g more often than along a random direction, and raises it along +g.

    python scripts/check_surrogate.py --layers 3,12,21 --pools 4
    python scripts/check_surrogate.py --indexer DIR --pool-files a.safetensors b.safetensors

Pools: the cached reference pools of ``scripts/train_indexer.py`` for the default model (by
default the first ``--pools`` files, in name order, of its pool folder: training or
development contexts alike, which does not matter for this check). Prints a table per (layer,
rho) and a summary; nothing is written.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

from arckv_press.compaction.fit import full_attention
from arckv_press.indexer.train import (
    TrainConfig,
    hard_branch_loss,
    soft_branch_loss,
    split_positions,
)

DIRECTIONS = ("-g", "+g", "random")


def surrogate_steps(s: torch.Tensor, Q_fit: torch.Tensor, Q_hold: torch.Tensor, K: torch.Tensor,
                    V: torch.Tensor, scaling: float, ratio: float, gamma: float, eps: float,
                    generator: torch.Generator) -> tuple[float, dict[str, float]]:
    """``(L_h(s), {direction: L_h(s + step) - L_h(s)})`` for one episode (module docstring).

    ``s [H, T]`` scores, ``Q_fit / Q_hold [H, n, D]``, ``K, V [H, T, D]``.
    """
    Y_hold = full_attention(Q_hold.double(), K.double(), V.double(), scaling)
    s = s.detach()
    hard = hard_branch_loss(s, Q_fit, Q_hold, K, V, scaling, ratio, Y_hold=Y_hold)
    s_var = s.clone().requires_grad_(True)
    soft = soft_branch_loss(s_var, Q_fit, Q_hold, K, V, scaling, hard, gamma, Y_hold=Y_hold)
    (g,) = torch.autograd.grad(soft, s_var)
    size = eps * s.std(dim=-1, keepdim=True) * s.shape[-1] ** 0.5
    rand = torch.randn(g.shape, generator=generator, dtype=g.dtype) * (g != 0)

    def unit(d: torch.Tensor) -> torch.Tensor:
        return d / d.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(d.dtype).tiny)

    base = float(hard.loss)
    changes = {}
    for name, d in zip(DIRECTIONS, (-g, g, rand)):
        moved = hard_branch_loss(s + size * unit(d), Q_fit, Q_hold, K, V, scaling, ratio, Y_hold=Y_hold)
        changes[name] = float(moved.loss) - base
    return base, changes


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--indexer", default=None, help="checkpoint dir (default: the shipped one)")
    p.add_argument("--pool-files", nargs="+", default=None, help="pool files (default: see --pools)")
    p.add_argument("--pools", type=int, default=4, help="first N files of the default pool folder")
    p.add_argument("--layers", default="3,12,21", help="comma-separated layers")
    p.add_argument("--ratios", type=float, nargs="+", default=[0.2, 0.1, 0.05])
    p.add_argument("--gamma", type=float, default=0.3, help="gate temperature (training anneals 1.0 -> 0.1)")
    p.add_argument("--eps", type=float, nargs="+", default=[0.02, 0.05], help="step sizes (see docstring)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


def _pool_files(args) -> list[Path]:
    if args.pool_files:
        return [Path(f) for f in args.pool_files]
    from arckv_press.indexer.data import default_pool_dir
    from arckv_press.models import DEFAULT_MODEL_ID

    folder = default_pool_dir(DEFAULT_MODEL_ID)
    files = sorted(folder.glob("*.safetensors"))[: args.pools]
    if not files:
        raise SystemExit(f"no reference pools in {folder}; build them with scripts/train_indexer.py --pools-only")
    return files


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from arckv_press.runinfo import print_header

    print_header("soft surrogate check (scripts/check_surrogate.py)",
                 argv=None if argv is None else [sys.argv[0], *argv])
    from arckv_press.indexer.checkpoint import (
        checkpoint_id,
        default_indexer_path,
        load_indexer,
    )
    from arckv_press.indexer.data import load_pool
    from arckv_press.models import DEFAULT_MODEL_ID

    ck = Path(args.indexer) if args.indexer else default_indexer_path(DEFAULT_MODEL_ID)
    if ck is None:
        raise SystemExit(f"no indexer checkpoint for {DEFAULT_MODEL_ID}; pass --indexer")
    indexer, _, _ = load_indexer(ck)
    files = _pool_files(args)
    layers = [int(x) for x in args.layers.split(",")]
    fractions = TrainConfig().episode_fractions
    print(f"indexer {checkpoint_id(ck)} ({ck}); {len(files)} pools; layers {layers}; rho {args.ratios}; "
          f"gamma {args.gamma}; eps {args.eps}; episode fractions {fractions}")
    cells: dict[tuple, list[dict[str, float]]] = defaultdict(list)
    gen = torch.Generator().manual_seed(args.seed)
    for pi, path in enumerate(files):
        for layer in layers:
            pool = load_pool(path, layer, torch.float32)
            pos_s, pos_f, pos_h = split_positions(pool.n_ref, fractions, args.seed, pi, torch.device("cpu"))
            rows_s, rows_f, rows_h = pool.rows(pos_s), pool.rows(pos_f), pool.rows(pos_h)
            with torch.no_grad():
                s = indexer.scores(layer, pool.X_rows(rows_s), pool.Q[:, rows_s], pool.K, pool.V)
            for ratio in args.ratios:
                for eps in args.eps:
                    base, ch = surrogate_steps(s, pool.Q[:, rows_f], pool.Q[:, rows_h], pool.K, pool.V,
                                               pool.scaling, ratio, args.gamma, eps, gen)
                    cells[(layer, ratio)].append({"base": base, **ch})
    print(f"\n{'layer':>5} {'rho':>5} {'n':>3} {'L_h':>7} | " + " | ".join(
        f"{d:>6} mean  better" for d in DIRECTIONS))
    total: dict[str, list[float]] = defaultdict(list)
    for (layer, ratio), items in sorted(cells.items()):
        parts = []
        for d in DIRECTIONS:
            v = torch.tensor([it[d] for it in items])
            total[d] += v.tolist()
            parts.append(f"{float(v.mean()):+.5f} {float((v < 0).float().mean()):>6.2f}")
        base = sum(it["base"] for it in items) / len(items)
        print(f"{layer:>5} {ratio:>5g} {len(items):>3} {base:>7.4f} | " + " | ".join(parts))
    print("\nall episodes and step sizes:")
    for d in DIRECTIONS:
        v = torch.tensor(total[d])
        print(f"  {d:>6}: mean change of L_h {float(v.mean()):+.5f}, lower in {float((v < 0).float().mean()):.2f} "
              f"of {len(v)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
