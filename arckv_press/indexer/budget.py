"""Per-head budget weights ``a_{l,h}`` (paper App. "Inference", Eq. (per_head_budget)) derived
from training statistics, and the held-out reconstruction error they are derived from.

The paper distributes the nominal budget over layer--KV-head pairs with "fixed model-specific
weights" (following Scissorhands / AdaKV) without saying how they are obtained. Our procedure:

1. **Error curves.** For every layer--KV-head pair ``p`` and a grid of per-head kept fractions
   ``f_1 < ... < f_F`` (:data:`DEFAULT_FRACTIONS`), measure on training pools the held-out
   post-fit error ``e_p(f)``: the pool's reference positions are split into disjoint fit and
   holdout positions (:func:`fit_holdout_split`); anchors are the top ``max(1, ceil(f T))``
   positions of the (trained) indexer's RMS-pooled scores on the fit rows (hard anchors, no key
   merging); ``beta`` (paper Eq. (mass_fit)) and ``C_v`` (Eq. (value_lstsq)) are fitted on the
   fit rows; ``e_p(f)`` is the relative L2 error ``||O_hat - O||_F / ||O||_F`` of the attention
   output on the holdout rows (:func:`heldout_error`), averaged over pools.
2. **Water-filling** (:func:`water_fill`). For a total budget ``B = |P| rho`` (in units of
   fractions of T), every pair starts at ``f_1`` and the remaining budget goes, piece by piece,
   to the pair whose error drops most per unit of budget, i.e. greedy allocation by marginal
   error reduction on the piecewise-linear curves. The curves are first made non-increasing
   (running minimum) and replaced by their lower convex hull, which makes the greedy allocation
   the exact minimiser of ``sum_p e_p(f_p)`` subject to ``sum_p f_p = B`` and
   ``f_1 <= f_p <= f_F`` for the convexified curves (checked against brute force in
   ``tests/test_indexer.py``). A pair never receives more than ``f_F``; budget left when no
   pair gains anything more is spread in proportion to the remaining capacity ``f_F - f_p``.
3. **Weights** (:func:`budget_weights_from_curves`). The allocation is normalised to
   ``a^rho = f / sum f`` for each training ratio ``rho`` in ``(0.2, 0.1, 0.05, 0.02, 0.01)``,
   and the shipped weights are the mean over ratios, ``a = mean_rho a^rho`` (one fixed weight
   per pair, as the paper's Eq. (per_head_budget) needs); reshaped to ``[L, H]``.

The running minimum matters in practice: with a fixed number of fit queries the held-out error
can *rise* again at large budgets (on SmolLM2 with 768 fit rows, ``e(0.4) > e(0.2)`` for most
layers: ``C_v`` overfits the fit rows), and such budget is never worth allocating.

Averaging over ratios is a compromise: the optimal allocation depends on rho, fixed weights
cannot follow it exactly; ``scripts/eval_selectors.py`` compares them with uniform budgets on
development contexts.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from arckv_press.compaction.fit import FitConfig, compact_attention, fit_beta, fit_values, full_attention
from arckv_press.compaction.reference import split_episode
from arckv_press.compaction.select import topk_anchors

from .train import ReferencePool, budget_for_ratio

__all__ = [
    "DEFAULT_FRACTIONS",
    "DEFAULT_RATIOS",
    "fit_holdout_split",
    "heldout_error",
    "error_curves",
    "convexify",
    "water_fill",
    "budget_weights_from_curves",
]

#: Per-head kept fractions at which error curves are measured.
DEFAULT_FRACTIONS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.4)
#: Retention ratios the weights are averaged over (the training ratios of the paper).
DEFAULT_RATIOS = (0.2, 0.1, 0.05, 0.02, 0.01)


def fit_holdout_split(pool: ReferencePool, holdout_fraction: float = 0.25, seed: int = 0
                      ) -> tuple[Tensor, Tensor]:
    """Disjoint ``(fit_rows, holdout_rows)`` of ``pool.Q`` (all G query heads of a reference
    position go to the same side), deterministic in ``seed``."""
    if not 0 < holdout_fraction < 1:
        raise ValueError(f"holdout_fraction must be in (0, 1), got {holdout_fraction!r}")
    fit, _, hold = split_episode(pool.n_ref, (1.0 - holdout_fraction, 0.0, holdout_fraction), seed, 0)
    if fit.numel() == 0 or hold.numel() == 0:
        raise ValueError(f"pool with n_ref={pool.n_ref} positions is too small for a fit/holdout split")
    return pool.rows(fit), pool.rows(hold)


def heldout_error(Q_fit: Tensor, Q_hold: Tensor, K: Tensor, V: Tensor, scaling: float, idx: Tensor,
                  valid: Tensor, fit_config: FitConfig | None = None, Y_hold: Tensor | None = None
                  ) -> Tensor:
    """Per-head held-out relative L2 error ``[H]`` (float64) of hard anchors ``idx [H, t]``
    (``valid`` mask): ``C_k = K_S``, beta and C_v fitted on ``Q_fit``, error on ``Q_hold``."""
    fit_config = fit_config or FitConfig()
    Kf, Vf = K.float(), V.float()
    C_k = torch.gather(Kf, 1, idx[..., None].expand(-1, -1, Kf.shape[-1])) * valid[..., None]
    beta, _ = fit_beta(Q_fit.float(), Kf, C_k, scaling, valid, fit_config)
    C_v = fit_values(Q_fit.float(), Kf, Vf, C_k, beta, scaling, valid, fit_config)
    y_hat = compact_attention(Q_hold.float(), C_k, beta, C_v, scaling, valid).double()
    y = full_attention(Q_hold.float(), Kf, Vf, scaling).double() if Y_hold is None else Y_hold.double()
    tiny = torch.finfo(torch.float64).tiny
    return (y_hat - y).pow(2).sum((1, 2)).sqrt() / y.pow(2).sum((1, 2)).sqrt().clamp_min(tiny)


@torch.no_grad()
def error_curves(score_fn, pools: Sequence[ReferencePool], fractions: Sequence[float] = DEFAULT_FRACTIONS,
                 holdout_fraction: float = 0.25, seed: int = 0, fit_config: FitConfig | None = None
                 ) -> Tensor:
    """Mean held-out error ``[H, F]`` over ``pools`` (one layer) at each kept fraction.

    ``score_fn(pool, fit_rows) -> [H, T]`` scores anchors from the fit rows only (e.g. the
    indexer's pooled scores or HA scores). Step 1 of the module docstring.
    """
    if not pools:
        raise ValueError("error_curves needs at least one pool")
    fr = [float(f) for f in fractions]
    if not fr or any(not 0 < f <= 1 for f in fr) or any(a >= b for a, b in zip(fr, fr[1:])):
        raise ValueError(f"fractions must be increasing values in (0, 1], got {fractions!r}")
    total = None
    for k, pool in enumerate(pools):
        fit_rows, hold_rows = fit_holdout_split(pool, holdout_fraction, seed + k)
        Q, K, V = pool.Q.float(), pool.K.float(), pool.V.float()
        scores = score_fn(pool, fit_rows).float()
        Y_hold = full_attention(Q[:, hold_rows], K, V, pool.scaling)
        errs = []
        for f in fr:
            t = budget_for_ratio(f, pool.T)
            idx, valid = topk_anchors(scores, torch.full((K.shape[0],), t, dtype=torch.long))
            errs.append(heldout_error(Q[:, fit_rows], Q[:, hold_rows], K, V, pool.scaling, idx, valid,
                                      fit_config, Y_hold))
        e = torch.stack(errs, dim=1)
        total = e if total is None else total + e
    return total / len(pools)


def convexify(grid: Tensor, curves: Tensor) -> Tensor:
    """Lower convex hull of the non-increasing envelope of each curve, evaluated on ``grid``.

    ``grid [F]`` increasing, ``curves [P, F]``; returns ``[P, F]`` float64. Loops over the F
    grid points only (F is small), batched over the P curves.
    """
    x = grid.double()
    e = torch.cummin(curves.double(), dim=1).values
    P, F = e.shape
    hull = e.clone()
    # for each point k, the hull value is the min over chords (i < k < j) through curve points
    for k in range(1, F - 1):
        for i in range(0, k):
            for j in range(k + 1, F):
                w = (x[k] - x[i]) / (x[j] - x[i])
                hull[:, k] = torch.minimum(hull[:, k], (1 - w) * e[:, i] + w * e[:, j])
    return hull


def water_fill(curves: Tensor, grid: Sequence[float] | Tensor, total: float) -> Tensor:
    """Greedy allocation by marginal error reduction (module docstring, step 2).

    Args:
        curves: ``[P, F]`` error of each pair at the kept fractions ``grid [F]``.
        grid: increasing kept fractions.
        total: total budget ``sum_p f_p`` (e.g. ``P * rho``); must be ``>= P * grid[0]``.

    Returns:
        ``[P]`` float64 fractions in ``[grid[0], grid[-1]]`` summing to ``min(total, P * grid[-1])``.
        Exact minimiser of the summed piecewise-linear convexified error.
    """
    g = torch.as_tensor(grid, dtype=torch.float64)
    if curves.ndim != 2 or curves.shape[1] != g.numel() or g.numel() < 1:
        raise ValueError(f"curves must be [P, F={g.numel()}], got {tuple(curves.shape)}")
    if not torch.isfinite(curves).all():
        raise ValueError("curves contain NaN or inf")
    if (g[1:] <= g[:-1]).any() or g[0] <= 0:
        raise ValueError(f"grid must be increasing and positive, got {g.tolist()}")
    P = curves.shape[0]
    floor_total = P * float(g[0])
    if not math.isfinite(total) or total < floor_total - 1e-12:
        raise ValueError(f"total budget {total} is below the minimum P * grid[0] = {floor_total}")
    alloc = torch.full((P,), float(g[0]), dtype=torch.float64)
    remaining = min(total, P * float(g[-1])) - floor_total
    if g.numel() == 1 or remaining <= 0:
        return alloc
    hull = convexify(g, curves)
    length = (g[1:] - g[:-1]).expand(P, -1)  # [P, F-1]
    gain = (hull[:, :-1] - hull[:, 1:]) / length  # error reduction per unit budget, non-increasing in F
    # segments in order of decreasing gain; a group of equal-gain segments that the budget only
    # partly covers shares it in proportion to the segment lengths (symmetric tie-breaking)
    flat_gain, flat_len = gain.reshape(-1), length.reshape(-1)
    taken = torch.zeros_like(flat_gain)
    rem = remaining
    for v in torch.unique(flat_gain[flat_gain > 0]).flip(0).tolist():
        m = flat_gain == v
        seg = float(flat_len[m].sum())
        if seg <= rem:
            taken[m] = flat_len[m]
            rem -= seg
        else:
            taken[m] = flat_len[m] * (rem / seg)
            rem = 0.0
            break
    alloc = alloc + taken.view(P, -1).sum(1)
    # budget left once no pair gains anything: spread in proportion to the remaining capacity
    # (not piled onto the first pairs, which an index tie-break would do)
    left = rem
    if left > 1e-12:
        cap = float(g[-1]) - alloc
        alloc = alloc + left * cap / cap.sum()
    return alloc


def budget_weights_from_curves(curves: Tensor, grid: Sequence[float] = DEFAULT_FRACTIONS,
                               ratios: Sequence[float] = DEFAULT_RATIOS) -> Tensor:
    """Fixed budget weights (module docstring, step 3): ``curves [L, H, F]`` -> ``[L, H]``
    float32 summing to 1 (the mean over ``ratios`` of the normalised water-filling allocations).
    A ratio whose total is below ``P * grid[0]`` contributes uniform weights."""
    if curves.ndim != 3:
        raise ValueError(f"curves must be [L, H, F], got {tuple(curves.shape)}")
    L, H, F = curves.shape
    flat = curves.reshape(L * H, F)
    P = L * H
    acc = torch.zeros(P, dtype=torch.float64)
    for rho in ratios:
        total = P * float(rho)
        if total < P * float(grid[0]):
            a = torch.full((P,), 1.0 / P, dtype=torch.float64)
        else:
            f = water_fill(flat, grid, total)
            a = f / f.sum()
        acc += a
    w = acc / len(ratios)
    return (w / w.sum()).reshape(L, H).float()
