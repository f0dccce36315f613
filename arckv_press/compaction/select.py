"""Anchor scoring, pooling and top-t selection (paper Sec. 3.3 and App. C.1).

Scores are ``[H, T]`` tensors (one score per cache position and KV head). Row quantities
(softmax probabilities of indexer logits, HA probabilities, VI influences) are pooled over the
reference-query rows blockwise, so an ``[H, n, T]`` tensor is never materialised:

- :class:`RowPool` accumulates sum / sum of squares / running max over row blocks;
- :func:`pool_rows`, :func:`pool_probs`, :func:`pool_logits`, :func:`pooled_softmax_scores`
  are thin drivers around it (paper Eq. (indexer_pooling));
- :func:`corrected_scores` estimates a residual indexer's all-row score from a row sample;
- :func:`ha_scores` and :func:`vi_scores` are the highest-attention and value-influence
  selectors of paper Eq. (background_value_selectors);
- :func:`per_head_budgets` distributes the nominal budget (paper Eq. (per_head_budget));
- :func:`topk_anchors` and :func:`chunked_topk_anchors` pick the anchor set
  (paper Eq. (persistent_support) and App. "KV-Based Chunking").

Input checks live in :mod:`.checks`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from .chunks import chunk_bounds, chunk_budgets
from .checks import (
    check_float,
    check_nonnegative,
    check_positive_int,
    check_qk,
    check_ratio,
    check_scaling,
    check_tensor,
    check_values,
    compute_dtype,
    row_blocks,
)

POOLINGS = ("rms", "mean", "max")


def _check_pooling(pooling: str) -> str:
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    return pooling


# --------------------------------------------------------------------------------------
# pooling over query rows (paper Eq. (indexer_pooling))
# --------------------------------------------------------------------------------------


@dataclass
class RowPool:
    """Blockwise accumulator pooling ``[H, b, T]`` row blocks into one ``[H, T]`` score.

    ``rms``: sqrt(mean_i x_ij^2) (paper Eq. (indexer_pooling), the default); ``mean``:
    mean_i x_ij; ``max``: max_i x_ij. Each block is reduced in its own dtype and the partial
    sums are accumulated across blocks in float64, so the result does not depend on the block
    size beyond float rounding.
    """

    pooling: str = "rms"
    count: int = 0
    acc: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _check_pooling(self.pooling)

    def update(self, block: torch.Tensor, inplace: bool = False) -> None:
        """Add a row block ``[H, b, T]``; ``inplace`` lets ``rms`` square the block in place."""
        check_tensor(block, "row block", 3)
        if self.acc is not None and block.shape[::2] != self.acc.shape:
            raise ValueError(f"row block {tuple(block.shape)} does not match pooled shape {tuple(self.acc.shape)}")
        if self.pooling == "max":
            part = block.amax(dim=1)
            self.acc = part if self.acc is None else torch.maximum(self.acc, part)
        else:
            if self.pooling == "rms":
                block = block.square_() if inplace else block * block
            part = block.sum(dim=1).double()
            self.acc = part if self.acc is None else self.acc + part
        self.count += block.shape[1]

    def result(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.acc is None or self.count == 0:
            raise ValueError("RowPool.result() called before any non-empty update()")
        if self.pooling == "max":
            return self.acc.to(dtype)
        mean = self.acc / self.count
        return (mean.sqrt() if self.pooling == "rms" else mean).to(dtype)


def pool_rows(blocks: Iterable[torch.Tensor], pooling: str = "rms") -> torch.Tensor:
    """Pool row blocks ``[H, b_k, T]`` (rows concatenated over k) into ``[H, T]`` float32."""
    pool = RowPool(pooling)
    for block in blocks:
        pool.update(block)
    return pool.result()


def pool_probs(prob_blocks: Iterable[torch.Tensor], pooling: str = "rms") -> torch.Tensor:
    """Pool per-row probability blocks ``[H, b, T]`` over rows (paper Eq. (indexer_pooling))."""
    return pool_rows(prob_blocks, pooling)


def pool_logits(logits_blocks: Iterable[torch.Tensor], pooling: str = "rms") -> torch.Tensor:
    """Row-softmax each logits block ``[H, b, T]`` over T, then pool over rows.

    Paper Eq. (indexer_pooling): pi_ij = softmax_j(I_ij), s_j = sqrt(mean_i pi_ij^2) for
    ``rms``. The softmax runs in float32 (float64 for float64 logits). Returns ``[H, T]``.
    """
    def probs() -> Iterator[torch.Tensor]:
        for block in logits_blocks:
            check_tensor(block, "logits block", 3)
            if torch.isnan(block).any():
                raise ValueError("logits block contains NaN")
            yield torch.softmax(block.to(compute_dtype(block)), dim=-1)

    return pool_probs(probs(), pooling)


def pooled_softmax_scores(
    logit_fn: Callable[[int, int], torch.Tensor],
    n_rows: int,
    block_rows: int = 256,
    pooling: str = "rms",
) -> torch.Tensor:
    """Pool softmax probabilities of ``logit_fn(start, stop) -> [H, stop-start, T]`` over rows.

    Only one block of ``block_rows`` rows is alive at a time.
    """
    check_positive_int(n_rows, "n_rows")
    check_positive_int(block_rows, "block_rows")
    return pool_logits((logit_fn(a, b) for a, b in row_blocks(n_rows, block_rows)), pooling)


# --------------------------------------------------------------------------------------
# HA and VI selectors (paper App. C.1, Eq. (background_value_selectors))
# --------------------------------------------------------------------------------------


def ha_scores(
    Q: torch.Tensor, K: torch.Tensor, scaling: float, pooling: str = "rms", block_rows: int = 256
) -> torch.Tensor:
    """Highest-attention scores s^HA ``[H, T]`` float32.

    s^HA_j = sqrt(mean_i p_ij^2) with p_ij = softmax_j(scaling * q_i . k_j) (``rms``, paper
    Eq. (background_value_selectors)); ``mean`` and ``max`` pool p_ij by mean / max instead.
    """
    check_qk(Q, K)
    scaling = check_scaling(scaling)
    _check_pooling(pooling)
    cd = compute_dtype(Q, K)
    Kc = K.to(cd)

    def logits(a: int, b: int) -> torch.Tensor:
        return scaling * (Q[:, a:b].to(cd) @ Kc.transpose(1, 2))

    return pooled_softmax_scores(logits, Q.shape[1], block_rows, pooling)


def value_influence(
    Lb: torch.Tensor, V: torch.Tensor, eps: float = 1e-6, Vc: torch.Tensor | None = None
) -> torch.Tensor:
    """Normalised leave-one-out influence D_ij / sqrt(||O_i||^2 + eps) ``[H, b, T]`` of a row
    block: the per-row term of s^VI (paper Eq. (background_value_selectors)).

    ``Lb`` ``[H, b, T]`` logits over the whole context, ``V`` ``[H, T, Dv]`` values, ``Vc``
    values centred per head (computed when not given; distances are translation invariant and
    centring reduces cancellation).

    Off the row maximum, p_ij <= 1/2, so D_ij = p/(1-p) * ||v_j - O_i|| is well conditioned
    (||v_j - O_i||^2 by the expansion |v|^2 - 2 v.O + |O|^2). At the row's argmax j* (first
    occurrence) p can round to 1, so there we use the exact identity
    D_ij* = p_ij* * ||v_j* - O_i^(-j*)|| with O^(-j*) formed from the other positions'
    exponentials directly. If every other position underflows (or T = 1), O^(-j*) is taken
    as the zero vector (removing the only attended key removes the whole output).
    """
    if Vc is None:
        Vc = V - V.mean(dim=1, keepdim=True)
    H, b, T = Lb.shape
    m, jstar = Lb.max(dim=-1, keepdim=True)            # first occurrence of the max
    E = torch.exp(Lb - m)                               # E[.., j*] == 1
    E_rest = E.scatter(-1, jstar, 0.0)                  # other positions only
    rest = E_rest.sum(-1, keepdim=True)                 # [H, b, 1], sum_{u != j*} E_u
    P = E / (1.0 + rest)
    Oc = P @ Vc                                          # centred output
    O = Oc + (V - Vc)[:, :1]                             # uncentred: add back the per-head mean
    v2 = (Vc * Vc).sum(-1)                               # [H, T]
    dist2 = (v2[:, None, :] - 2.0 * (Oc @ Vc.transpose(1, 2)) + (Oc * Oc).sum(-1, keepdim=True)).clamp_min(0.0)
    D = P / (1.0 - P).clamp_min(0.5) * dist2.sqrt()      # off-argmax entries: 1 - p >= 1/2
    # exact leave-one-out at the argmax (a direct weighted average: no cancellation)
    O_minus = (E_rest @ V) / rest.clamp_min(torch.finfo(Lb.dtype).tiny)
    O_minus = torch.where(rest > 0, O_minus, torch.zeros_like(O_minus))  # nothing left: zero output
    v_star = torch.gather(V, 1, jstar.expand(H, b, V.shape[-1]))
    p_star = torch.gather(P, -1, jstar)
    D_star = p_star * (v_star - O_minus).norm(dim=-1, keepdim=True)
    D = D.scatter(-1, jstar, D_star)
    return D / ((O * O).sum(-1, keepdim=True) + eps).sqrt()


def vi_scores(
    Q: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    scaling: float,
    pooling: str = "rms",
    eps: float = 1e-6,
    block_rows: int = 256,
) -> torch.Tensor:
    """Value-influence scores s^VI ``[H, T]`` float32 (paper Eq. (background_value_selectors)).

    D_ij = ||O_i - O_i^(-j)|| = p_ij / (1 - p_ij) * ||v_j - O_i||, and
    s^VI_j = sqrt(mean_i D_ij^2 / (||O_i||^2 + eps)) for ``rms``; ``mean`` / ``max`` pool
    D_ij / sqrt(||O_i||^2 + eps) by mean / max. The p_ij -> 1 limit is handled exactly
    (see :func:`value_influence`). Computed in float32 (float64 for float64 inputs).
    """
    check_qk(Q, K)
    check_values(V, K)
    scaling = check_scaling(scaling)
    _check_pooling(pooling)
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be finite and > 0, got {eps}")
    check_positive_int(block_rows, "block_rows")
    cd = compute_dtype(Q, K, V)
    Kc, Vf = K.to(cd), V.to(cd)
    Vc = Vf - Vf.mean(dim=1, keepdim=True)
    pool = RowPool(pooling)
    for a, b in row_blocks(Q.shape[1], block_rows):
        Lb = scaling * (Q[:, a:b].to(cd) @ Kc.transpose(1, 2))
        pool.update(value_influence(Lb, Vf, eps, Vc))
    return pool.result()


# --------------------------------------------------------------------------------------
# budgets and top-t selection
# --------------------------------------------------------------------------------------

_BUDGET_EPS = 1e-6  # absorbs float error so that uniform weights give exactly floor(ratio * T)


def corrected_scores(full_base: torch.Tensor, sample: torch.Tensor, sample_base: torch.Tensor,
                     pooling: str = "rms", shrink: float = 0.1, fraction: float = 0.0) -> torch.Tensor:
    """The learned indexer's pooled score over every reference row (Eq. (indexer_pooling)),
    estimated from a sample of rows by its ratio to its base selector.

    ``b`` is the base distribution the residual indexer corrects (HA's ``softmax_j(s_0 q_i . k_j)``
    or VI's ``Dn_ij``), pooled exactly over every row by the reference pass (``full_base``); the
    indexer's ``pi`` and ``b`` are pooled over the sampled rows (``sample``, ``sample_base``). With
    ``m(x)`` the mean over rows of a pooled power (squares for ``rms``, the values for ``mean``),
    the estimate scales the base's all-row score by the indexer's ratio to it on the sample,
    shrunk towards 1 where the sample saw little of a key::

        m(pi)_j ~= m(b)_j * (m_S(pi)_j + e) / (m_S(b)_j + e),   e = shrink * (1 - fraction) * mean_j m_S(b)_j

    per KV head, ``fraction`` the sampled share of the rows. It is exact when the sample holds every
    row (``fraction = 1``), equal to the base's score where the indexer agrees with its base on the
    sample, never negative, and a key whose sharp rows are not sampled keeps the base's score. An
    additive control variate ``m(b) + m_S(pi) - m_S(b)`` would be unbiased, but a key that one
    sampled row attends to sharply then has its whole correction weighted by the inverse sampling
    rate, which can zero a planted needle's key; the ratio bounds it by the indexer's own ratio.
    ``max`` pooling is not a mean and is refused. Inputs ``[H, T]``; returns float32 ``[H, T]``.
    """
    _check_pooling(pooling)
    if pooling == "max":
        raise ValueError("corrected_scores needs rms or mean pooling (a mean over rows); max pooling is not")
    check_nonnegative(shrink, "shrink")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
        raise ValueError(f"fraction must be in [0, 1], got {fraction!r}")
    for name, t in (("full_base", full_base), ("sample", sample), ("sample_base", sample_base)):
        check_tensor(t, name, 2)
        if t.shape != full_base.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(full_base.shape)}")
        if (t < 0).any():
            raise ValueError(f"{name} has negative scores: pooled attention scores are >= 0")
    if fraction == 1:  # the sample is every row
        return sample.float()
    power = 2 if pooling == "rms" else 1
    full_base, sample, sample_base = (t.double() ** power for t in (full_base, sample, sample_base))
    e = shrink * (1.0 - fraction) * sample_base.mean(-1, keepdim=True)
    den = sample_base + e
    ratio = torch.where(den > 0, (sample + e) / den.clamp_min(torch.finfo(den.dtype).tiny), torch.ones_like(den))
    return (full_base * ratio).pow(1.0 / power).float()


def per_head_budgets(
    T: int,
    ratio: float,
    weights: torch.Tensor | None = None,
    num_layers: int | None = None,
    num_heads: int | None = None,
) -> torch.Tensor:
    """Per layer--KV-head budgets ``[L, H]`` (paper Eq. (per_head_budget)).

    t_lh = clip_[1, T](floor(a_lh * |P| * ratio * T)) with a = weights / sum(weights)
    (uniform when ``weights`` is None, which then needs ``num_layers`` and ``num_heads``).
    ``_BUDGET_EPS`` = 1e-6 is added before the floor (in float64) so uniform weights give
    exactly floor(ratio * T) despite rounding in a * |P|. The realised total may differ from
    |P| * ratio * T because of flooring and clipping (the paper says so).
    """
    check_positive_int(T, "T")
    ratio = check_ratio(ratio)
    if weights is None:
        if num_layers is None or num_heads is None:
            raise ValueError("num_layers and num_heads are required when weights is None")
        check_positive_int(num_layers, "num_layers")
        check_positive_int(num_heads, "num_heads")
        a = torch.full((num_layers, num_heads), 1.0, dtype=torch.float64)
        device = torch.device("cpu")
    else:
        check_tensor(weights, "weights", 2)
        L, H = weights.shape
        if (num_layers is not None and num_layers != L) or (num_heads is not None and num_heads != H):
            raise ValueError(
                f"weights shape {tuple(weights.shape)} does not match num_layers={num_layers}, num_heads={num_heads}"
            )
        if L < 1 or H < 1:
            raise ValueError(f"weights must be non-empty, got shape {tuple(weights.shape)}")
        a = weights.detach().to(torch.float64)
        if not bool(torch.isfinite(a).all()):
            raise ValueError("weights contain NaN or inf")
        if bool((a < 0).any()):
            bad = (a < 0).nonzero()[0].tolist()
            raise ValueError(f"weights must be nonnegative; layer {bad[0]} head {bad[1]} is {a[bad[0], bad[1]].item()}")
        if a.sum() <= 0:
            raise ValueError("weights must have a positive sum")
        device = weights.device
    a = a / a.sum()
    raw = a * a.numel() * ratio * T
    t = torch.floor(raw + _BUDGET_EPS).to(torch.long).clamp(1, T)
    return t.to(device)


def global_budgets(scores: torch.Tensor, ratio: float, min_per_head: int = 1, min_fraction: float = 0.0) -> torch.Tensor:
    """Per layer--KV-head budgets ``[L, H]`` from one global top-k over all heads' scores.

    Context-adaptive alternative to the fixed weights of Eq. (per_head_budget) (the allocation
    KVzip uses): the total stays ``L * H * floor(ratio * T)``, as with uniform budgets, but it
    goes to the positions with the highest scores across every layer and head, so heads that
    concentrate their attention on a few positions (retrieval / copy heads) get more anchors
    and diffuse heads fewer. Each head first keeps its ``min_per_head`` best positions (Eq.
    (per_head_budget)'s clip at 1); the rest of the total is the global top-k of the remaining
    scores. Ties are broken by the lowest (layer, head, position) index (stable sort), so the
    result is deterministic. Scores must be comparable across heads: pooled attention
    probabilities (HA, the indexer's pooled softmax) are.

    Args:
        scores: ``[L, H, T]`` finite, nonnegative scores.
        ratio: kept fraction in (0, 1].
        min_per_head: anchors every head keeps (1 <= min_per_head <= T).
        min_fraction: raises that floor to ``floor(min_fraction * ratio * T)`` (in [0, 1]; 1 gives
            every head the uniform budget, 0 leaves ``min_per_head``).
    """
    check_float(scores, "scores", 3)
    ratio = check_ratio(ratio)
    L, H, T = scores.shape
    check_positive_int(T, "T")
    if not 1 <= min_per_head <= T:
        raise ValueError(f"min_per_head must be in [1, T={T}], got {min_per_head}")
    if not 0.0 <= min_fraction <= 1.0:
        raise ValueError(f"min_fraction must be in [0, 1], got {min_fraction}")
    min_per_head = min(T, max(min_per_head, math.floor(min_fraction * ratio * T + _BUDGET_EPS)))
    per_head = max(min_per_head, math.floor(ratio * T + _BUDGET_EPS))
    total = L * H * per_head
    flat = scores.detach().reshape(L * H, T).double()
    # each head's ``min_per_head`` best positions are reserved first (stable: lowest position wins ties)
    order = torch.sort(flat, dim=1, descending=True, stable=True).indices
    reserved = torch.zeros_like(flat, dtype=torch.bool).scatter_(1, order[:, :min_per_head], True)
    rest = total - L * H * min_per_head
    counts = torch.full((L * H,), min_per_head, dtype=torch.long, device=scores.device)
    if rest > 0:
        pool = flat.masked_fill(reserved, -math.inf).reshape(-1)
        order = torch.sort(pool, descending=True, stable=True).indices[: L * H * (T - min_per_head)]
        counts += torch.bincount(order[:rest] // T, minlength=L * H)
    return counts.reshape(L, H)


def _check_scores_budgets(scores: torch.Tensor, budgets) -> torch.Tensor:
    check_float(scores, "scores", 2)
    H, T = scores.shape
    budgets = torch.as_tensor(budgets, device=scores.device)
    if budgets.dtype.is_floating_point or budgets.dtype == torch.bool:
        raise TypeError(f"budgets must be integer, got {budgets.dtype}")
    if tuple(budgets.shape) != (H,):
        raise ValueError(f"budgets must have shape {(H,)}, got {tuple(budgets.shape)}")
    if bool(((budgets < 1) | (budgets > T)).any()):
        h = int(((budgets < 1) | (budgets > T)).nonzero()[0])
        raise ValueError(f"budgets must be in [1, T={T}]; head {h} has {int(budgets[h])}")
    return budgets.long()


def topk_anchors(scores: torch.Tensor, budgets) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head top-t anchors (paper Eq. (persistent_support)).

    Args:
        scores: ``[H, T]`` finite scores.
        budgets: ``[H]`` integers in [1, T].

    Returns:
        ``idx`` ``[H, t_max]`` long and ``valid`` ``[H, t_max]`` bool, t_max = max(budgets).
        Head h keeps its ``budgets[h]`` highest scores, ties broken by the lowest position
        (stable descending sort); kept positions are sorted ascending; padded slots hold 0
        and are ``valid == False``.
    """
    budgets = _check_scores_budgets(scores, budgets)
    H, T = scores.shape
    t_max = int(budgets.max())
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :t_max]
    valid = torch.arange(t_max, device=scores.device)[None, :] < budgets[:, None]
    idx = torch.where(valid, order, torch.full_like(order, T))   # padding sorts last
    idx = torch.sort(idx, dim=-1).values
    return torch.where(valid, idx, torch.zeros_like(idx)), valid


def _pack_left(idx: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move valid slots to the front (keeping their order) and trim to the max count."""
    order = torch.sort((~valid).to(torch.int8), dim=-1, stable=True).indices
    idx, valid = torch.gather(idx, 1, order), torch.gather(valid, 1, order)
    t_max = int(valid.sum(-1).max())
    idx, valid = idx[:, :t_max], valid[:, :t_max]
    return torch.where(valid, idx, torch.zeros_like(idx)), valid


def chunked_topk_anchors(
    scores: torch.Tensor, budgets, chunk_len: int, min_length: int = 10_000
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-t within contiguous chunks (paper App. "KV-Based Chunking for Long Contexts").

    If T <= ``min_length`` this is :func:`topk_anchors`. Otherwise the positions are split
    into chunks of ``chunk_len`` (last one shorter) and chunk c of length T_c keeps its local
    top t_c = clip_[1, T_c](round(t * T_c / T)) positions; the anchor set is the union.
    ``round`` is round-half-to-even (Python / torch semantics). The realised count per head
    may differ from ``budgets[h]`` (the paper notes this). Returns padded ``idx`` / ``valid``
    as :func:`topk_anchors`, positions ascending.
    """
    budgets = _check_scores_budgets(scores, budgets)
    H, T = scores.shape
    chunks = chunk_bounds(T, chunk_len, min_length)
    if T <= min_length:
        return topk_anchors(scores, budgets)
    idx_parts, valid_parts = [], []
    for start, stop in chunks:
        Tc = stop - start
        tc = chunk_budgets(budgets, Tc, T)
        idx_c, valid_c = topk_anchors(scores[:, start:stop], tc)
        idx_parts.append(idx_c + start)
        valid_parts.append(valid_c)
    return _pack_left(torch.cat(idx_parts, dim=1), torch.cat(valid_parts, dim=1))


__all__: Sequence[str] = (
    "POOLINGS",
    "RowPool",
    "pool_rows",
    "pool_probs",
    "pool_logits",
    "pooled_softmax_scores",
    "ha_scores",
    "vi_scores",
    "value_influence",
    "corrected_scores",
    "per_head_budgets",
    "global_budgets",
    "topk_anchors",
    "chunked_topk_anchors",
)
