"""One layer of compaction: select (all KV heads at once) -> merge -> fit (one head at a time at its
own anchor count) (paper Sec. 3.1-3.3).

``compact_layer`` composes the step modules; it is pure tensor code (the learned indexer enters
as an object with a ``scores(layer, X, Q, K, V, pooling)`` method). Methods:

- ``arckv`` (learned indexer), ``arckv-ha``, ``arckv-vi``: top-t anchors from the scorer
  (chunked for long contexts, App. (KV-Based Chunking)), convex-hull key merging with
  ``lambda_m`` (Eqs. (response_profile)-(key_merge)), then beta (Eq. (mass_fit)) and C_v
  (Eq. (value_lstsq); or the anchors' own values with ``fit.values="anchor"``).
  ``compact_layer`` merges and fits on every row of ``Q``, over the whole document;
  ``compact_layer_from_stats`` (the compaction's path) on the budget rows plus each head's anchors'
  witness rows (:mod:`.witness`; ``fit.witnesses``), and chunk by chunk for documents longer than
  ``chunk_min_length`` (:mod:`.chunks`).
- ``am-omp``, ``am-omp-fast``, ``am-ha``: the Attention Matching baselines (:mod:`.omp`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from arckv_press.compaction.chunks import chunk_bounds, chunk_budgets, rest_of_chunk
from arckv_press.compaction.fit import FitConfig, attention_lse, compact_logits, fit_beta, fit_values
from arckv_press.compaction.merge import assign_to_anchors, check_anchors, merge_keys
from arckv_press.compaction.omp import AM_OMP, AM_OMP_FAST, OMPOverflowError, am_compact, omp_select
from arckv_press.compaction.select import chunked_topk_anchors, ha_scores, topk_anchors, vi_scores
from arckv_press.compaction.stats import ReferenceStats
from arckv_press.compaction.witness import block_witnesses, head_fit_rows
from arckv_press.methods import Method
from arckv_press.methods import method as lookup_method

__all__ = ["LayerMethod", "LayerResult", "compact_layer", "compact_layer_from_stats", "anchor_scores", "omp_anchors"]

ANCHOR_SEARCHES = {"scores": None, "omp": AM_OMP, "omp-fast": AM_OMP_FAST}


@dataclass
class LayerMethod:
    """How to compact a layer.

    Attributes:
        name: one of ``arckv``, ``arckv-ha``, ``arckv-vi``, ``am-omp``, ``am-omp-fast``, ``am-ha``.
        lambda_m: key-merging coefficient of Eq. (key_merge) (ARC-KV only; 0 = no merging).
        pooling: row pooling of Eq. (indexer_pooling): ``rms`` (paper), ``mean`` or ``max``.
        chunk_len / chunk_min_length: for documents longer than ``chunk_min_length``, contiguous chunks
            of ``chunk_len`` positions: chunked top-t (App. KV-Based Chunking) or, with an OMP
            ``anchor_search``, each chunk's own OMP search (:func:`omp_anchors`), and, in
            :func:`compact_layer_from_stats`, merging and fits inside each chunk (:mod:`.chunks`).
        fit: which anchors and rows are fitted (``scope``, ``witnesses``) and how
            (:class:`~.fit.FitConfig`).
        block: position block of the merge assignment (bounds memory; 256 keeps the ``[n, block]``
            profiles in the CPU caches).
        anchor_search: how anchors are found. ``"scores"`` (default): the top-t of the selector's
            pooled scores (Eq. (indexer_pooling)); ``"omp"`` / ``"omp-fast"``: Attention Matching's
            greedy OMP search on the budget rows (:func:`~.omp.omp_select`, which refits the
            attention mass after each pick), with the same per-head budgets (chunk by chunk above
            ``chunk_min_length``), then the same merging and fits.
    """

    name: str = "arckv"
    lambda_m: float = 0.25
    pooling: str = "rms"
    chunk_len: int = 4096
    chunk_min_length: int = 10_000
    fit: FitConfig = field(default_factory=FitConfig)
    block: int = 256
    anchor_search: str = "scores"

    def __post_init__(self) -> None:
        if self.anchor_search not in ANCHOR_SEARCHES:
            raise ValueError(f"anchor_search must be one of {tuple(ANCHOR_SEARCHES)}, got {self.anchor_search!r}")
        lookup_method(self.name, ours=True)
        if not 0.0 <= self.lambda_m <= 1.0:
            raise ValueError(f"lambda_m must be in [0, 1], got {self.lambda_m}")
        if self.definition.family == "am" and self.fit.values != "fit":
            raise ValueError(
                f"fit.values={self.fit.values!r} applies to ARC-KV methods only; the Attention Matching "
                f"baseline {self.name!r} always fits C_v (paper Eq. (value_lstsq))"
            )


    @property
    def definition(self) -> Method:
        """The :class:`~arckv_press.methods.Method` called ``name``."""
        return lookup_method(self.name, ours=True)


@dataclass
class LayerResult:
    """Padded compact cache of one layer plus what the benchmarks report."""

    C_k: torch.Tensor  # [H, t_max, D]
    beta: torch.Tensor  # [H, t_max] float32
    C_v: torch.Tensor  # [H, t_max, D]
    valid: torch.Tensor  # [H, t_max] bool, valid slots first
    anchors: torch.Tensor  # [H, t_max] positions of the anchors
    w: torch.Tensor | None = None  # mass weights before the log (ARC-KV)
    timings: dict[str, float] = field(default_factory=dict)
    fit_rows: int = 0  # reference rows per KV head that merging and the fits used


class _Stopwatch:
    def __init__(self, timings: dict[str, float]):
        self.timings = timings

    def __call__(self, stage: str):
        watch = self

        class _Stage:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                watch.timings[stage] = watch.timings.get(stage, 0.0) + time.perf_counter() - self.t0

        return _Stage()


def _prefix_order(idx: torch.Tensor, valid: torch.Tensor, *others: torch.Tensor):
    """Reorder slots so valid ones come first (stable), as the packed cache requires."""
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
    take = lambda x: x.gather(1, order) if x.ndim == 2 else x.gather(1, order[..., None].expand_as(x))  # noqa: E731
    return (take(idx), take(valid), *(take(o) for o in others))


def omp_anchors(
    rows: torch.Tensor, K: torch.Tensor, budgets: torch.Tensor, scaling: float, search: str, scores,
    chunks: list[tuple[int, int]] | None = None, row_max: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors ``idx, valid [H, t_max]`` of ``anchor_search`` ``"omp"`` / ``"omp-fast"``: Attention
    Matching's greedy search (:func:`~.omp.omp_select`) on the reference ``rows [H, n, D]`` for each
    head's first ``min(t_h, n)`` anchors (its mass least squares needs at least as many rows as keys;
    where it is near-singular even so, :class:`~.omp.OMPOverflowError`, every head's search is capped at
    ``n // 2`` instead);
    a head whose budget exceeds ``n`` takes the rest as the top of the pooled scores (Eq.
    (indexer_pooling)) among the positions the search left. ``scores``: ``[H, T]`` or a function
    returning them, called only then.

    ``chunks`` (:func:`~.chunks.chunk_bounds`; ``None``: one chunk): with more than one, chunk c
    gets its own t_c anchors (:func:`~.chunks.chunk_budgets`, as the chunked top-t), searched in
    that chunk alone to fit the chunk's own mass, every row's logits taken against its maximum over
    the whole document (``row_max [H, n]``, computed when ``None``): the mass target of the
    chunk-separable fits (:mod:`.chunks`), at a cost linear in the document's length."""
    H, T = K.shape[:2]
    budgets = torch.as_tensor(budgets, device=K.device).long().expand(H)
    if chunks is None or len(chunks) == 1:
        return _omp_span(rows, K, budgets, scaling, search, scores, None)
    if row_max is None:
        row_max = torch.stack([torch.bmm(rows.float(), K[:, lo:hi].float().transpose(1, 2)).amax(2)
                               for lo, hi in chunks]).amax(0).mul_(scaling)
    cache: list[torch.Tensor] = []

    def all_scores() -> torch.Tensor:  # computed once, and only if a chunk's budget exceeds the rows
        if not cache:
            cache.append(scores() if callable(scores) else scores)
        return cache[0]

    idx, valid = [], []
    for lo, hi in chunks:
        span_scores = (lambda lo=lo, hi=hi: all_scores()[:, lo:hi])
        i, v = _omp_span(rows, K[:, lo:hi], chunk_budgets(budgets, hi - lo, T), scaling, search, span_scores, row_max)
        idx.append(i + lo)
        valid.append(v)
    idx, valid = _prefix_order(torch.cat(idx, 1), torch.cat(valid, 1))
    t_max = int(valid.sum(1).max())
    return idx[:, :t_max], valid[:, :t_max]


def _omp_span(rows, K, budgets, scaling, search, scores, row_max):
    """:func:`omp_anchors` on the positions of ``K`` (a whole document, or one chunk with the
    document's ``row_max``)."""
    H, T = K.shape[:2]
    capped = budgets.clamp_max(rows.shape[1])
    try:
        idx, valid, _ = omp_select(rows, K, capped, scaling, ANCHOR_SEARCHES[search], row_max)
    except OMPOverflowError:  # a head asked for about as many keys as there are rows: its mass fit is
        capped = budgets.clamp_max(max(1, rows.shape[1] // 2))  # near-singular; search half, score the rest
        idx, valid, _ = omp_select(rows, K, capped, scaling, ANCHOR_SEARCHES[search], row_max)
    extra = budgets - capped
    heads = (extra > 0).nonzero().flatten()
    if not heads.numel():
        return idx, valid
    s = scores() if callable(scores) else scores
    taken = torch.zeros(H, T, dtype=torch.bool, device=K.device)
    taken[torch.arange(H, device=K.device)[:, None].expand_as(idx)[valid], idx[valid]] = True
    rest = s[heads].float().masked_fill(taken[heads], float(s.min()) - 1.0)   # below every untaken key
    idx_r, valid_r = topk_anchors(rest, extra[heads])
    pad = torch.zeros(H, idx_r.shape[1], dtype=torch.long, device=K.device)
    more, more_valid = pad.index_copy(0, heads, idx_r), pad.bool().index_copy(0, heads, valid_r)
    idx, valid = _prefix_order(torch.cat([idx, more], 1), torch.cat([valid, more_valid], 1))
    t_max = int(budgets.max())
    return idx[:, :t_max], valid[:, :t_max]


def anchor_scores(
    method: LayerMethod,
    Q: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    scaling: float,
    X: torch.Tensor | None = None,
    indexer=None,
    layer_idx: int = 0,
) -> torch.Tensor:
    """Pooled anchor scores ``[H, T]`` of an ARC-KV method (learned indexer, HA or VI; Eq.
    (indexer_pooling) with ``method.pooling``) from reference queries ``Q [H, n, D]``."""
    selector = method.definition.selector
    if selector is None:
        raise ValueError(f"method {method.name!r} does not select anchors by scores")
    if selector == "indexer":
        if indexer is None or X is None:
            raise ValueError("method 'arckv' needs the learned indexer and the activations X")
        return indexer.scores(layer_idx, X, Q, K, V, pooling=method.pooling)
    if selector == "ha":
        return ha_scores(Q, K, scaling, pooling=method.pooling)
    return vi_scores(Q, K, V, scaling, pooling=method.pooling)


def compact_layer(
    K: torch.Tensor,
    V: torch.Tensor,
    Q: torch.Tensor,
    budgets: torch.Tensor,
    scaling: float,
    method: LayerMethod,
    X: torch.Tensor | None = None,
    indexer=None,
    layer_idx: int = 0,
    scores: torch.Tensor | None = None,
) -> LayerResult:
    """Compact one layer: ``K, V [H, T, D]``, reference queries ``Q [H, n, D]``, ``budgets [H]``.

    ``X [n, d_x]`` (rows aligned with ``Q``'s rows) and ``indexer`` are needed by ``arckv``.
    ``scores [H, T]``: anchor scores computed beforehand (see :func:`anchor_scores`); ARC-KV
    methods then skip their own scoring.
    Returns padded ``(C_k, beta, C_v)`` with a prefix ``valid`` mask per head.
    """
    timings: dict[str, float] = {}
    watch = _Stopwatch(timings)
    variant = method.definition.variant
    if variant is not None:
        with watch("am_total"):
            C_k, beta, C_v, idx, valid = am_compact(Q, K, V, budgets, scaling, variant)
        idx, valid, C_k, beta, C_v = _prefix_order(idx, valid, C_k, beta, C_v)
        return LayerResult(C_k, beta, C_v, valid, idx, None, timings, Q.shape[1])

    if scores is not None and tuple(scores.shape) != tuple(K.shape[:2]):
        raise ValueError(f"scores must have shape {tuple(K.shape[:2])} (heads x positions), got {tuple(scores.shape)}")

    def own_scores() -> torch.Tensor:  # the OMP search reads them only for heads whose budget exceeds its rows
        return anchor_scores(method, Q, K, V, scaling, X, indexer, layer_idx) if scores is None else scores

    with watch("selection"):
        if method.anchor_search != "scores":  # AM's search on the rows the fits use
            idx, valid = omp_anchors(Q, K, budgets, scaling, method.anchor_search, own_scores,
                                     chunk_bounds(K.shape[1], method.chunk_len, method.chunk_min_length))
        else:
            idx, valid = chunked_topk_anchors(own_scores(), budgets, method.chunk_len, method.chunk_min_length)
        idx, valid = _prefix_order(idx, valid)
    check_anchors(idx, valid, K.shape[1])
    # Heads are merged and fitted one at a time at their own anchor count: under global budgets
    # the counts of one layer's heads differ a lot, and padding every head to the largest one
    # multiplied the merge and fit work (docs/history.md, "Compaction time").
    H, t_max = valid.shape
    C_k = K.new_zeros(H, t_max, K.shape[2])
    C_v = V.new_zeros(H, t_max, V.shape[2])
    beta = torch.zeros(H, t_max, dtype=torch.float32, device=K.device)
    w = torch.zeros(H, t_max, dtype=torch.float32, device=K.device)
    for h in range(H):
        t_h = int(valid[h].sum())  # valid slots come first (_prefix_order)
        ck, b, cv, wh = _compact_head(K[h:h + 1], V[h:h + 1], Q[h:h + 1], idx[h:h + 1, :t_h], scaling, method, watch)
        C_k[h, :t_h], beta[h, :t_h], C_v[h, :t_h], w[h, :t_h] = ck[0], b[0].float(), cv[0], wh[0]
    return LayerResult(C_k, beta, C_v, valid, idx, w, timings, Q.shape[1])


def compact_layer_from_stats(
    K: torch.Tensor,
    V: torch.Tensor,
    Q: torch.Tensor,
    stats: ReferenceStats,
    budgets: torch.Tensor,
    scaling: float,
    method: LayerMethod,
    base_rows: torch.Tensor,
    merge_rows: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
) -> LayerResult:
    """Compact one layer from the statistics of its reference pass (:mod:`.stats`), ARC-KV only.

    ``Q [H, G * N, D]`` is the whole pool of captured rows (GQA layout) that ``stats`` was gathered
    from; ``base_rows`` are the budget rows every head fits on, ``merge_rows`` the rows of the
    response profiles of Eq. (response_profile) (``None``: each head's fit rows). Anchors are the
    top-t of ``scores`` (default ``stats.scores``); each head fits beta (Eq. (mass_fit)) and C_v
    (Eq. (value_lstsq)) on ``base_rows`` plus its own anchors' witness rows
    (:func:`~.witness.head_fit_rows`), with the full-cache targets taken from ``stats``, so no
    stage reads all of ``Q`` against all of ``K`` again. Documents longer than
    ``method.chunk_min_length`` are merged and fitted chunk by chunk (:mod:`.chunks`): each chunk's
    anchors absorb only its positions and fit on the budget rows plus their own witnesses, with the
    chunk's exact mass and the rest of the document as targets.
    """
    if method.definition.family != "arckv":
        raise ValueError(f"compact_layer_from_stats is for ARC-KV methods, not {method.name!r}")
    if tuple(Q.shape[:2]) != (stats.H, stats.G * stats.N) or tuple(K.shape[:2]) != (stats.H, stats.T):
        raise ValueError(f"Q {tuple(Q.shape)} and K {tuple(K.shape)} do not match the reference statistics "
                         f"[H={stats.H}, rows={stats.G * stats.N}, T={stats.T}]")
    timings: dict[str, float] = {}
    watch = _Stopwatch(timings)
    with watch("selection"):
        scores = stats.scores if scores is None else scores
        if tuple(scores.shape) != tuple(K.shape[:2]):
            raise ValueError(f"scores must have shape {tuple(K.shape[:2])} (heads x positions), got {tuple(scores.shape)}")
        if method.anchor_search == "scores":
            idx, valid = chunked_topk_anchors(scores, budgets, method.chunk_len, method.chunk_min_length)
        else:
            rows = base_rows.to(K.device)
            idx, valid = omp_anchors(Q[:, rows], K, budgets, scaling, method.anchor_search, scores,
                                     chunk_bounds(K.shape[1], method.chunk_len, method.chunk_min_length),
                                     stats.rows("row_max")[:, rows])
        idx, valid = _prefix_order(idx, valid)
    check_anchors(idx, valid, K.shape[1])
    row_max, row_lse, row_out = stats.rows("row_max"), stats.rows("row_lse"), stats.rows("row_out")
    H, t_max = valid.shape
    if method.fit.witnesses:
        with watch("fit_rows"):
            witnesses = block_witnesses(Q, K, idx, scaling, row_lse, stats.witness_pos, stats.block, stats.G)
    C_k, C_v = K.new_zeros(H, t_max, K.shape[2]), V.new_zeros(H, t_max, V.shape[2])
    beta = torch.zeros(H, t_max, dtype=torch.float32, device=K.device)
    w = torch.zeros(H, t_max, dtype=torch.float32, device=K.device)
    T = K.shape[1]
    local = T > method.chunk_min_length  # chunk-local merging and fits (:mod:`.chunks`)
    chunks = chunk_bounds(T, method.chunk_len, method.chunk_min_length)
    n_rows = 0
    for h in range(H):
        t_h = int(valid[h].sum())
        anchors = idx[h, :t_h]
        for lo, hi in chunks:
            slots = ((anchors >= lo) & (anchors < hi)).nonzero().flatten() if local else torch.arange(t_h, device=K.device)
            if not slots.numel():
                continue
            with watch("fit_rows"):
                rows = head_fit_rows(witnesses[h, slots], base_rows) if method.fit.witnesses else base_rows.to(K.device)
                n_rows = max(n_rows, rows.numel())
                Qh, Y = Q[h, rows][None], row_out[h, rows][None]
                Qm = Qh if merge_rows is None else Q[h, merge_rows.to(K.device)][None]
            Kc, Vc = K[h:h + 1, lo:hi], V[h:h + 1, lo:hi]
            rest = None
            if local:
                with watch("chunk_targets"):  # the chunk's own mass, and the rest of the document exactly
                    lse_c, out_c = attention_lse(Qh, Kc, Vc, scaling, method.fit.block_rows)
                    rest = rest_of_chunk(row_lse[h, rows][None], Y, lse_c, out_c)
                    targets = (row_max[h, rows][None], lse_c)
            else:
                targets = (row_max[h, rows][None], row_lse[h, rows][None])
            ck, b, cv, wh = _compact_head(Kc, Vc, Qh, anchors[slots][None] - lo, scaling, method, watch,
                                          Q_merge=Qm, targets=targets, Y=Y, rest=rest)
            C_k[h, slots], beta[h, slots], C_v[h, slots], w[h, slots] = ck[0], b[0].float(), cv[0], wh[0]
    return LayerResult(C_k, beta, C_v, valid, idx, w, timings, n_rows)


def _compact_head(
    K: torch.Tensor, V: torch.Tensor, Q: torch.Tensor, idx: torch.Tensor, scaling: float, method: LayerMethod, watch,
    Q_merge: torch.Tensor | None = None, targets=None, Y: torch.Tensor | None = None, rest=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge (Eq. (key_merge)), beta (Eq. (mass_fit)) and C_v (Eq. (value_lstsq)) of one head whose
    ``t`` anchors ``idx [1, t]`` are all valid; returns ``(C_k, beta, C_v, w)``. ``Q_merge``: the
    rows of the response profiles (default ``Q``); ``targets`` / ``Y``: the full-cache row
    statistics of ``Q``'s rows (:func:`~.fit.fit_beta`, :func:`~.fit.fit_values`); ``rest``: the
    document outside ``K`` when ``K`` is one chunk of it (:func:`~.chunks.rest_of_chunk`)."""
    valid = torch.ones_like(idx, dtype=torch.bool)
    Qm = Q if Q_merge is None else Q_merge
    assignment = None
    with watch("merge"):
        if method.lambda_m > 0:
            C_k, assignment = merge_keys(Qm, K, idx, valid, scaling, lambda_m=method.lambda_m, block=method.block)
        else:
            C_k = K.gather(1, idx[:, :, None].expand(-1, -1, K.shape[2]))
            if method.fit.scope == "merged":
                assignment = assign_to_anchors(Qm, K, idx, valid, scaling, method.block)
    fixed = None
    if method.fit.scope == "merged":  # anchors that absorbed no other position keep their own term
        fixed = torch.stack([torch.bincount(a, minlength=idx.shape[1]) for a in assignment]) == 1
    with watch("beta_fit"):  # the logits of the fit rows against C_k serve both fits
        logits = compact_logits(Q, C_k, scaling, method.fit.block_rows)
        beta, w = fit_beta(Q, K, C_k, scaling, valid, method.fit, targets=targets, fixed=fixed, logits=logits)
    with watch("value_fit"):
        V_S = None  # the anchors' own values, gathered only when used
        if method.fit.values == "anchor" or method.fit.value_prior == "anchor" or fixed is not None:
            V_S = V.gather(1, idx[:, :, None].expand(-1, -1, V.shape[2]))
        if method.fit.values == "anchor":
            C_v = V_S
        else:
            prior = V_S if method.fit.value_prior == "anchor" else None
            C_v = fit_values(Q, K, V, C_k, beta, scaling, valid, method.fit, prior=prior, Y=Y,
                             fixed=fixed, fixed_values=None if fixed is None else V_S, logits=logits, rest=rest)
    return C_k, beta, C_v, w
