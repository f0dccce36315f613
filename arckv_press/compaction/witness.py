"""Fit rows that cover the anchors: each anchor's *witness* query joins the fitting rows.

The paper (App. "Inference") uses one reference pool for anchor scoring, key merging and the
fits of beta and C_v (Eqs. (mass_fit), (value_lstsq)). When the pool is large, this package
scores anchors from every captured position but fits on a ``query_budget`` subsample
(``CompactionConfig.query_budget``). An anchor chosen because of a few sharp queries
(a copy head reading a planted needle) then often has none of those queries among the fitting
rows, so its compact value C_v is fitted only from queries that touch it weakly, and exact
copying breaks. The witness of anchor ``j`` of a head is the pooled row that gives it the largest
full-cache attention probability,

    i*(j) = argmax_i softmax_u(scaling q_i . k_u)_j        (ties: lowest row),

i.e. the query that most needs that key. Each KV head fits on the budget rows plus its own
anchors' witness rows (:func:`head_fit_rows`), so every anchor has at least its strongest query in
the fit; every row is used once, so the least-squares fits stay unweighted.
:func:`block_witnesses` finds the witnesses inside the blocks the reference pass recorded;
:func:`anchor_witnesses` is the direct search over every row.
"""

from __future__ import annotations

import torch

from .merge import check_anchor_inputs
from .checks import check_positive_int, compute_dtype, row_blocks

__all__ = ["anchor_witnesses", "block_witnesses", "head_fit_rows"]


def anchor_witnesses(
    Q: torch.Tensor,
    K: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor | None,
    scaling: float,
    block_rows: int = 256,
) -> torch.Tensor:
    """Row index ``[H, t]`` of each anchor's witness query (module docstring).

    ``Q [H, n, D]`` reference rows, ``K [H, T, D]``, ``anchors [H, t]`` positions in ``K``.
    Log-probabilities are compared in float32 (float64 for float64 inputs), blockwise over rows;
    ties go to the lowest row. Padded slots (``valid`` False) get row 0.
    """
    scaling, valid = check_anchor_inputs(Q, K, anchors, valid, scaling, block_rows)
    cols = torch.where(valid, anchors.long(), 0)
    cd = compute_dtype(Q, K)
    Kt = K.to(cd).transpose(1, 2)
    best = torch.full(cols.shape, -torch.inf, dtype=cd, device=K.device)
    rows = torch.zeros(cols.shape, dtype=torch.long, device=K.device)
    for lo, hi in row_blocks(Q.shape[1], block_rows):
        logp = torch.log_softmax((Q[:, lo:hi].to(cd) * scaling) @ Kt, dim=-1)    # [H, b, T]
        at = logp.gather(2, cols[:, None, :].expand(-1, hi - lo, -1))           # [H, b, t]
        val, arg = at.max(dim=1)                                                  # first max in block
        better = val > best                                                       # strict: earlier block wins ties
        best = torch.where(better, val, best)
        rows = torch.where(better, arg + lo, rows)
    return rows.masked_fill(~valid, 0)


def head_fit_rows(witnesses: torch.Tensor, base_rows: torch.Tensor) -> torch.Tensor:
    """Fit rows of one KV head: ``base_rows`` (the budget rows, GQA layout) followed by the rows of
    ``witnesses`` (its anchors' witness rows, :func:`block_witnesses`) that are not among them,
    ascending, each once. A witness is the single (query head, position) row that attends to its
    anchor most, so a head gets at most ``len(base_rows) + t`` rows.
    """
    base = base_rows.long().to(witnesses.device)
    extra = torch.unique(witnesses)
    extra = extra[~torch.isin(extra, base)]
    return torch.cat([base, extra])


def block_witnesses(
    Q: torch.Tensor,
    K: torch.Tensor,
    anchors: torch.Tensor,
    scaling: float,
    row_lse: torch.Tensor,
    block_start: torch.Tensor,
    block: int,
    group_size: int,
) -> torch.Tensor:
    """Witness rows ``[H, t]`` of ``anchors [H, t]`` from the reference pass's block search.

    ``Q [H, G * N, D]`` the pool (GQA layout), ``row_lse [H, G * N]`` each row's log-sum-exp over the
    document, ``block_start [H, T]`` the first position of the block holding each key's largest
    probability (:class:`~arckv_press.compaction.stats.ReferenceStats`). Among the rows of positions
    ``block_start .. block_start + block - 1`` (all query heads) this takes the one with the largest
    log p = scaling q . k - lse; ties go to the lowest position, then the lowest query head. One
    small matmul per (KV head, block) that holds anchors: no copy of the candidate rows per anchor.
    """
    check_positive_int(group_size, "group_size")
    check_positive_int(block, "block")
    H, n, D = Q.shape
    G, N = group_size, n // group_size
    idx = anchors.long()
    starts = block_start.gather(1, idx)
    out = torch.empty(anchors.shape, dtype=torch.long, device=Q.device)
    for h in range(H):
        # position-major rows (row i of a block = position p0 + i // G, query head i % G), once per head
        q_pos = Q[h].view(G, N, D).transpose(0, 1).reshape(N * G, D)
        lse_pos = row_lse[h].view(G, N).T.reshape(N * G, 1)
        order = torch.sort(starts[h], stable=True).indices               # anchors grouped by block
        p0s, counts = torch.unique_consecutive(starts[h, order], return_counts=True)
        keys = K[h, idx[h, order]].to(q_pos.dtype)
        best = []                                                           # position-major row of each anchor
        for p0, k in zip(p0s.tolist(), torch.split(keys, counts.tolist())):
            lo, hi = p0 * G, min(p0 + block, N) * G
            logp = scaling * (q_pos[lo:hi] @ k.T) - lse_pos[lo:hi]
            best.append(logp.argmax(0) + lo)                                # first max: lowest position, then g
        best = torch.cat(best)
        out[h, order] = (best % G) * N + best // G                          # GQA layout: g * N + position
    return out
