"""``compact(...)``: compact a document into a :class:`~arckv_press.cache.CompactCache`.

The flow of one compaction (ARCHITECTURE.md): prefill ``prefix + document`` -> repeat-prefill
capturing reference queries -> per compacted layer, all KV heads at once, ``compact_layer``
(select, merge, fit) -> packed compact layers with the prefix kept verbatim.

``ratio`` is the kept fraction rho = t/T (paper convention). ``ratio=1.0`` keeps every position
with beta = 0 and the original values, so outputs equal the normal cache's.

Which tokens are compacted: exactly the document tokens. The framing prefix (chat template up to
the user message, or BOS) stays uncompressed; questions appended later see the compacted document
and the verbatim prefix. The same framing is used for the prefill and the repeat-prefill.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from arckv_press import __version__
from arckv_press.attention import enable_compact_attention
from arckv_press.cache import CacheMetadata, CompactCache, CompactLayer, cache_nbytes, new_cache, pack_heads
from arckv_press.capture import (check_context_positions, encode_document, framing_for, prefill, repeat_prefill,
                                  repeat_prefill_stats, softmax_scale)
from arckv_press.compaction.layer import compact_layer, compact_layer_from_stats
from arckv_press.compaction.reference import group_activations, group_queries_by_kv_head, grouped_rows, subsample_rows
from arckv_press.compaction.select import corrected_scores, global_budgets, per_head_budgets
from arckv_press.config import MIN_LENGTH, SCORE_SHRINK, CompactionConfig, config_id
from arckv_press.indexer.checkpoint import resolve_indexer
from arckv_press.methods import method as lookup_method

__all__ = ["compact", "compact_prefilled", "CompactionReport", "reference_positions"]

@dataclass
class CompactionReport:
    """What one compaction did: per-stage seconds, sizes and the realised ratio.

    Sizes, in bytes: ``compact_bytes`` is what the compacted layers hold for the document (the
    entries ``C_k``, ``C_v`` and the float32 ``beta``) and ``full_bytes`` their uncompressed keys
    and values (prefix and document); ``cache_bytes`` is the whole cache after compaction and
    ``full_cache_bytes`` the whole cache after the prefill, every layer counted, the
    sliding-window layers (which keep their window, uncompacted) included. On a model without
    sliding-window layers the two pairs differ by the prefix rows only; on Gemma 3 ``cache_bytes``
    also holds the windows of its 15 sliding layers. ``realised_ratio`` counts the compacted
    layers only.

    ``reference_rows``: the most reference-query rows per KV head that merging and the fits of
    any layer used (the budget rows plus that layer's anchor witnesses, see ``FitConfig.witnesses``).
    """

    original_length: int
    prefix_length: int
    timings: dict[str, float]
    compact_bytes: int
    full_bytes: int
    realised_ratio: float
    reference_rows: int
    cache_bytes: int = 0
    full_cache_bytes: int = 0


def _load_weights(weights, shape: tuple[int, int], num_layers: int) -> torch.Tensor | None:
    """Budget weights a(l, h) for the compacted layers (``shape``) or for every layer."""
    if weights is None:
        return None
    if isinstance(weights, (str, Path)):
        path = Path(weights)
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            tensors = load_file(str(path))
            if len(tensors) != 1:
                raise ValueError(f"{path}: expected one tensor of budget weights, found {list(tensors)}")
            weights = next(iter(tensors.values()))
        else:
            weights = torch.load(path, map_location="cpu", weights_only=True)
    weights = torch.as_tensor(weights, dtype=torch.float64)
    if tuple(weights.shape) not in (shape, (num_layers, shape[1])):
        raise ValueError(f"budget weights have shape {tuple(weights.shape)}, expected {shape} (compacted layers x KV heads)")
    return weights


def reference_positions(T: int, G: int, config: CompactionConfig) -> torch.Tensor:
    """Document positions of the repeat-prefill's reference rows (``query_budget // G``, sorted): the
    budget rows every ARC-KV head fits on (its reference pass reads every position's row for the
    scores and witnesses), the captured rows of Attention Matching."""
    return subsample_rows(T, max(1, config.query_budget // G), config.seed)


def compact(
    model,
    tokenizer,
    context: str,
    method: str = "arckv",
    ratio: float = 0.1,
    use_chat_template: bool | None = None,
    progress: bool = False,
    indexer=None,
    **options,
) -> CompactCache:
    """Prefill ``context`` and compact its document tokens with ``method`` at kept fraction ``ratio``.

    Returns a :class:`CompactCache` (batch size 1) for ``model``; the model's attention is switched
    to the ARC-KV function (:func:`arckv_press.attention.enable_compact_attention`), which behaves
    as before on ordinary caches. Ask questions by feeding ``question + suffix`` tokens (see
    :func:`arckv_press.capture.framing_for`) with ``past_key_values=cache``. ``options``:
    :class:`~arckv_press.config.CompactionConfig` fields; ``progress``: tqdm bars; ``indexer``: the
    learned indexer of method ``arckv`` (:func:`compact_prefilled`).
    """
    config = CompactionConfig(method=method, ratio=ratio, **options)
    ids, prefix_len = encode_document(tokenizer, context, use_chat_template)
    cache = new_cache(model)
    return compact_prefilled(model, tokenizer, cache, ids, prefix_len, config, use_chat_template=use_chat_template,
                             progress=progress, indexer=indexer)


@torch.no_grad()
def compact_prefilled(
    model,
    tokenizer,
    cache,
    context_ids: torch.Tensor,
    prefix_len: int,
    config: CompactionConfig,
    already_prefilled: bool = False,
    use_chat_template: bool | None = None,
    progress: bool = False,
    indexer=None,
) -> CompactCache:
    """Compact the document ``context_ids[:, prefix_len:]`` held in ``cache``, in place.

    ``indexer``: the learned value-aware indexer of method ``arckv`` (an input, like the model, with
    its own id, :func:`arckv_press.registry.indexer_id`): a checkpoint path or a loaded
    ``ValueAwareIndexer``; ``None`` takes the checkpoint shipped for the model (an error when none is).

    ``cache`` is prefilled here unless ``already_prefilled`` (the press path, where kvpress's
    pipeline ran the prefill).
    The compacted layers of ``cache`` are replaced by :class:`CompactLayer` objects; a
    ``CompactCache`` sharing those layers is returned. Runs under ``torch.no_grad()``: with
    autograd on, the prefill, repeat-prefill and fits would keep their graphs alive.
    """
    from arckv_press.models import config_hash, describe_attention_layout, model_id, weights_fingerprint

    if context_ids.ndim != 2 or context_ids.shape[0] != 1:
        raise ValueError(f"compaction supports batch size 1 only, got context ids of shape {tuple(context_ids.shape)}")
    n_ctx = context_ids.shape[1]
    if isinstance(prefix_len, bool) or not hasattr(prefix_len, "__index__"):
        raise TypeError(f"prefix_len must be an int, got {type(prefix_len).__name__}")
    prefix_len = prefix_len.__index__()
    if not 0 <= prefix_len <= n_ctx:
        raise ValueError(f"prefix_len must be in [0, {n_ctx}] (the context length), got {prefix_len}")
    layout = describe_attention_layout(model)
    config = config.for_model(model_id(model))  # the model's defaults where the config leaves them open
    T = context_ids.shape[1] - prefix_len
    if T < MIN_LENGTH:
        raise ValueError(f"the document has {T} tokens; at least {MIN_LENGTH} are needed to compact it")
    check_context_positions(model, n_ctx, prefix_len)  # before the (long) prefill and repeat-prefill
    layers = list(layout.full_attention_layers)
    H, G = layout.num_kv_heads, layout.group_size
    timings: dict[str, float] = {}
    repeat_pos = reference_positions(T, G, config)

    # Indexer and budgets are resolved before the (possibly long) prefill: a missing checkpoint or
    # malformed budget weights fail fast and leave ``cache`` untouched.
    indexer, shipped_weights = resolve_indexer(config.method, indexer, model) if config.ratio < 1.0 else (None, None)
    chosen = None  # uniform: Attention Matching, and ARC-KV's global allocation before its top-k
    if config.family == "arckv" and not (isinstance(config.budgets, str) and config.budgets == "global"):
        chosen = shipped_weights if isinstance(config.budgets, str) and config.budgets == "fixed" else config.budgets
    weights = _load_weights(chosen, (len(layers), H), layout.num_layers)
    if weights is not None and weights.shape[0] == layout.num_layers != len(layers):
        weights = weights[list(layers)]  # checkpoint weights cover every layer; keep the compacted ones
    budgets = per_head_budgets(T, config.ratio, weights, len(layers), H)

    t0 = time.perf_counter()
    if not already_prefilled:
        prefill(model, context_ids, cache)
    timings["prefill"] = time.perf_counter() - t0 if not already_prefilled else 0.0

    full_bytes = sum(cache.layers[i].keys.nbytes + cache.layers[i].values.nbytes for i in layers)
    full_cache_bytes = cache_nbytes(cache)  # every layer, the sliding windows included
    framing = framing_for(tokenizer, use_chat_template)
    method = config.layer_method()
    if config.ratio >= 1.0:
        layer_results = {i: None for i in layers}
        n_rows = 0
    else:
        run = _Run(model, tokenizer, cache, context_ids, prefix_len, layers, config, method, framing, timings, H, G,
                   progress)
        if config.family == "arckv":
            layer_results, n_rows = _compact_fused(run, indexer, budgets, repeat_pos)
        else:
            layer_results, n_rows = _compact_am(run, budgets, repeat_pos)
    for layer_idx in layers:
        _pack_layer(cache, layer_idx, prefix_len, T, H, layer_results[layer_idx])

    enable_compact_attention(model)
    result = CompactCache(list(cache.layers), None)
    report = CompactionReport(
        original_length=T,
        prefix_length=prefix_len,
        timings=timings,
        compact_bytes=result.compact_nbytes(),
        full_bytes=full_bytes,
        realised_ratio=result.realised_ratio(),
        reference_rows=n_rows,
        cache_bytes=cache_nbytes(cache),
        full_cache_bytes=full_cache_bytes,
    )
    result.metadata = CacheMetadata(
        model_id=model_id(model),
        config_hash=config_hash(model.config),
        method=config.method,
        ratio=float(config.ratio),
        original_length=int(context_ids.shape[1]),
        package_version=__version__,
        weights_fingerprint=weights_fingerprint(model),
        extra={"prefix_length": prefix_len, "lambda_m": config.scheduled("lambda_m"), "config_id": config_id(config),
               "report": report.__dict__},
    )
    result.report = report
    # which document positions each head kept as anchors (-1 pads a head's row); in memory only
    result.kept_positions = {i: res.anchors.masked_fill(~res.valid, -1) for i, res in layer_results.items()
                             if res is not None}
    return result


@dataclass
class _Run:
    """What every stage of one compaction reads (model, prefilled cache, options, layers) and the
    stage timings it adds to."""

    model: object
    tokenizer: object
    cache: object
    context_ids: torch.Tensor
    prefix_len: int
    layers: list[int]
    config: CompactionConfig
    method: object  # the config's LayerMethod
    framing: object
    timings: dict[str, float]
    H: int  # KV heads
    G: int  # query heads per KV head
    progress: bool = False  # tqdm bars

    @property
    def doc_ids(self) -> torch.Tensor:
        return self.context_ids[:, self.prefix_len:]

    def kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _document_kv(self.cache, layer_idx, self.prefix_len)

    def add(self, stage_timings: dict[str, float]) -> None:
        for stage, sec in stage_timings.items():
            self.timings[stage] = self.timings.get(stage, 0.0) + sec

    def bar(self, total: int, desc: str, unit: str = "tok"):
        """A tqdm bar when ``progress``, else ``None``."""
        if not self.progress:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit=unit, leave=False)


def _compact_fused(run: _Run, indexer, budgets: torch.Tensor, base_pos: torch.Tensor):
    """ARC-KV's stages (the fused pipeline): one repeat-prefill gathering every statistic, allocation,
    then each layer from its statistics (:func:`compact_layer_from_stats`). ``base_pos``: the
    budget positions (:func:`reference_positions`)."""
    config, layers, G = run.config, run.layers, run.G
    T = run.doc_ids.shape[1]
    selector = lookup_method(config.method).selector
    t0 = time.perf_counter()
    bar = run.bar(T, "repeat-prefill")
    score_pos = indexer_positions(config, base_pos, T, G)
    pass_selector = selector
    if selector == "indexer":  # the pass pools the residual indexer's base only as its control variate
        pass_selector = _control_selector(indexer, run.model, layers) if config.corrected_scores else "none"
    cap = repeat_prefill_stats(run.model, run.tokenizer, run.cache, run.doc_ids, run.framing.suffix_ids, layers,
                               run.prefix_len, selector=pass_selector, pooling=config.pooling,
                               x_positions=score_pos if selector == "indexer" else None,
                               progress=bar,
                               tail_rows=config.scheduled("tail_rows"))
    if bar is not None:
        bar.close()
    run.timings["repeat_prefill"] = time.perf_counter() - t0
    run.timings["reference_stats"] = cap.stats_seconds  # part of repeat_prefill: the in-pass selection work
    queries = {i: group_queries_by_kv_head(torch.cat(cap.store.q.pop(i), dim=1)[None], run.H) for i in layers}

    N = T + cap.n_tail  # rows per query head: the repeated document, then the tail rows
    after = extra_rows(base_pos, T, cap.n_tail)  # the tail rows of the budget positions
    base_rows = grouped_rows(torch.cat([base_pos, after]), N, G)
    score_rows = grouped_rows(score_pos, N, G)
    t0 = time.perf_counter()
    scores = selection_scores(run, indexer, selector, cap, queries, score_rows)
    if isinstance(config.budgets, str) and config.budgets == "global":
        budgets = global_budgets(torch.stack([scores[i].float() for i in layers]), config.ratio,
                                 min_fraction=config.min_head_fraction)
    run.timings["selection"] = time.perf_counter() - t0

    merge_rows = None
    if config.merge_rows is not None:
        n_pos = max(1, config.merge_rows // G)
        merge_rows = grouped_rows(torch.cat([base_pos[subsample_rows(base_pos.numel(), n_pos, config.seed + 1)], after]),
                                  N, G)
    results, n_rows = {}, 0
    bar = run.bar(len(layers), f"compact ({config.method})", unit="layer")
    for li, i in enumerate(layers):
        K, V = run.kv(i)
        res = compact_layer_from_stats(K, V, queries.pop(i), cap.stats.pop(i), budgets[li].to(K.device),
                                       softmax_scale(run.model, i), run.method, base_rows, merge_rows, scores.pop(i))
        results[i] = res
        n_rows = max(n_rows, res.fit_rows)
        run.add(res.timings)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return results, n_rows


def selection_scores(run: _Run, indexer, selector: str, cap, queries: dict[int, torch.Tensor],
                     score_rows: torch.Tensor) -> dict[int, torch.Tensor]:
    """Per compacted layer, the anchor scores ``[H, T]`` that allocation and the top-t read (paper Eq.
    (background_value_selectors) pooled by the reference pass, or the learned indexer's, Eq.
    (indexer_pooling)); pops the pass's ``q_proj`` inputs of each layer it scores."""
    config, G = run.config, run.G
    scores = {}
    for i in run.layers:
        if selector == "indexer":  # indexer_rows: every captured row, the budget rows, or a sample corrected
            K, V = run.kv(i)
            X = torch.cat(cap.store.x.pop(i), dim=0)
            Q = queries[i][:, score_rows.to(K.device)]
            if config.corrected_scores:
                sample, sample_base = indexer.scores(i, group_activations(X, G), Q, K, V, pooling=config.pooling,
                                                     base=True, base_scale=softmax_scale(run.model, i))
                scores[i] = corrected_scores(cap.stats[i].scores, sample, sample_base, config.pooling,
                                             SCORE_SHRINK, Q.shape[1] / queries[i].shape[1])
            else:
                scores[i] = indexer.scores(i, group_activations(X, G), Q, K, V, pooling=config.pooling)
        else:
            scores[i] = cap.stats[i].scores
    return scores


def extra_rows(positions: torch.Tensor, T: int, n_tail: int) -> torch.Tensor:
    """The rows after the repeated document's ``T`` that hold document ``positions`` (sorted): the
    tail rows ``T + p - (T - n_tail)`` of those among the last ``n_tail``."""
    in_tail = positions[positions >= T - n_tail] if n_tail else positions[:0]
    return T + in_tail - (T - n_tail)


def indexer_positions(config: CompactionConfig, base_pos: torch.Tensor, T: int, G: int) -> torch.Tensor:
    """Document positions whose rows the learned indexer scores (``indexer_rows``): every position,
    the budget positions ``base_pos``, or (a row count ``n``) a seeded subsample of ``n // G`` of
    them; sorted, as the captured activations are."""
    if config.indexer_rows == "all":
        return torch.arange(T)
    if config.corrected_scores:
        return base_pos[subsample_rows(base_pos.numel(), max(1, config.indexer_rows // G), config.seed + 2)]
    return base_pos


def _control_selector(indexer, model, layers) -> str:
    """The reference-pass selector whose pooled scores are the control variate of
    ``indexer_rows`` given as a row count: a residual indexer's base (``ha`` or ``vi``), HA for the paper's
    form. A residual base must be at the model's own softmax scale in every compacted layer (else the
    pass and the indexer would pool different bases)."""
    cfg = indexer.config
    for i in layers:
        if cfg.base_logit_scale is not None and not math.isclose(cfg.base_logit_scale, softmax_scale(model, i), rel_tol=1e-6):
            raise ValueError(f"corrected indexer scores (indexer_rows a row count): the indexer's base_logit_scale {cfg.base_logit_scale} is not "
                             f"the model's softmax scale {softmax_scale(model, i)} (layer {i})")
    return "vi" if cfg.base_value_influence else "ha"


def _compact_am(run: _Run, budgets: torch.Tensor, repeat_pos: torch.Tensor):
    """Attention Matching's stages: the reference queries captured by the repeat-prefill at
    ``repeat_pos``, then per layer :func:`compact_layer`."""
    config, layers = run.config, run.layers
    t0 = time.perf_counter()
    bar = run.bar(run.doc_ids.shape[1], "repeat-prefill")
    store = repeat_prefill(run.model, run.tokenizer, run.cache, run.doc_ids, run.framing.suffix_ids, layers, repeat_pos,
                           progress=bar)
    if bar is not None:
        bar.close()
    run.timings["repeat_prefill"] = time.perf_counter() - t0
    results, n_rows = {}, 0
    bar = run.bar(len(layers), f"compact ({config.method})", unit="layer")
    for li, layer_idx in enumerate(layers):
        K, V = run.kv(layer_idx)
        x, q = store.layer(layer_idx)
        res = compact_layer(K, V, group_queries_by_kv_head(q[None], run.H), budgets[li].to(K.device),
                            softmax_scale(run.model, layer_idx), run.method, X=group_activations(x, run.G),
                            layer_idx=layer_idx)
        results[layer_idx] = res
        n_rows = max(n_rows, res.fit_rows)
        run.add(res.timings)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return results, n_rows


def _pack_layer(cache, layer_idx: int, prefix_len: int, T: int, H: int, res) -> None:
    """Replace an ordinary cache layer by its :class:`CompactLayer` (``res`` ``None``: ratio 1, every
    position kept with beta = 0)."""
    dyn = cache.layers[layer_idx]
    keys, values = dyn.keys, dyn.values
    K, V = _document_kv(cache, layer_idx, prefix_len)
    # clone: a slice is a view that would keep the whole uncompressed layer's storage alive
    fixed_k, fixed_v = keys[:, :, :prefix_len].clone(), values[:, :, :prefix_len].clone()
    if res is None:
        C_k, beta, C_v = K.reshape(-1, K.shape[-1]), K.new_zeros(H * T, dtype=torch.float32), V.reshape(-1, V.shape[-1])
        lengths = torch.full((H,), T, dtype=torch.long, device=K.device)
    else:
        C_k, lengths = pack_heads(res.C_k, res.valid)
        beta, _ = pack_heads(res.beta, res.valid)
        C_v, _ = pack_heads(res.C_v, res.valid)
    cache.layers[layer_idx] = CompactLayer(C_k.to(keys.dtype), beta, C_v.to(values.dtype), lengths, T, layer_idx,
                                           fixed_k, fixed_v)


def _document_kv(cache, layer_idx: int, prefix_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The document part ``K, V [H, T, D]`` of an ordinary cache layer (views)."""
    layer = cache.layers[layer_idx]
    return layer.keys[0, :, prefix_len:], layer.values[0, :, prefix_len:]
