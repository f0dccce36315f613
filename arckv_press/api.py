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

import dataclasses
import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from arckv_press import __version__
from arckv_press.attention import enable_compact_attention
from arckv_press.cache import CacheMetadata, CompactCache, CompactLayer, cache_nbytes, pack_heads
from arckv_press.capture import (QueryCapture, check_context_positions, encode_document, framing_for, prefill,
                                  repeat_prefill, repeat_prefill_stats)
from arckv_press.compaction.checks import check_nonnegative, check_ratio
from arckv_press.compaction.fit import FitConfig
from arckv_press.compaction.layer import (
    LayerMethod,
    anchor_scores,
    compact_layer,
    compact_layer_from_stats,
)
from arckv_press.compaction.reference import (
    group_activations,
    group_queries_by_kv_head,
    grouped_rows,
    mix_sources,
    subsample_rows,
)
from arckv_press.compaction.select import POOLINGS, corrected_scores, global_budgets, per_head_budgets
from arckv_press.methods import method as lookup_method

__all__ = ["CompactionConfig", "config_id", "compact", "compact_prefilled", "CompactionReport",
           "RATIO_SCHEDULE", "RatioDefaults", "capture_plan", "ratio_defaults"]

PIPELINES = ("fused", "separate")
INDEXER_ROWS = ("all", "budget", "corrected")  # CompactionConfig.indexer_rows

@dataclass(frozen=True)
class RatioDefaults:
    """ARC-KV's defaults from kept fraction ``lowest`` down to the next step of :data:`RATIO_SCHEDULE`:
    the key-merging coefficient ``lambda_m`` of Eq. (key_merge) and how anchors are found
    (``anchor_search``, :class:`~arckv_press.compaction.layer.LayerMethod`)."""

    lowest: float
    lambda_m: float
    anchor_search: str


# Steps, largest kept fraction first. Chosen on the development split of the fidelity benchmark (never
# on the documents the leaderboards report; docs/methodology.md): from keep 5% up, the top-t of the
# selector's scores (they keep planted needles); below it, where a head keeps a handful of anchors and
# no selector keeps needles, Attention Matching's OMP search on the budget rows, which picks anchors
# that together fit every row's attention mass, then ARC-KV's merging and fits.
RATIO_SCHEDULE: tuple[RatioDefaults, ...] = (RatioDefaults(0.05, 0.25, "scores"), RatioDefaults(0.0, 0.25, "omp"))


def ratio_defaults(ratio: float) -> RatioDefaults:
    """The step of :data:`RATIO_SCHEDULE` for kept fraction ``ratio``: the first whose ``lowest``
    ``ratio`` reaches."""
    ratio = check_ratio(ratio)
    return next(step for step in RATIO_SCHEDULE if ratio >= step.lowest)


@dataclass
class CompactionConfig:
    """Options of one compaction (defaults follow the paper where it gives one).

    Attributes:
        method: ``arckv`` (learned indexer), ``arckv-ha``, ``arckv-vi``, ``am-omp``,
            ``am-omp-fast`` or ``am-ha``.
        ratio: kept fraction rho in (0, 1].
        lambda_m: key-merging coefficient of Eq. (key_merge) (the paper uses 0.25 for QuALITY and
            RULER); ``None`` (default) takes it from :data:`RATIO_SCHEDULE` at ``ratio``
            (:func:`ratio_defaults`; 0.25 at every kept fraction, chosen on the fidelity dev split,
            ``docs/methodology.md``).
        pooling: ``rms`` (paper Eq. (indexer_pooling)), ``mean`` or ``max``.
        query_budget: reference-query rows per KV head (G rows per captured position).
        context_fraction: share of reference rows taken from the context's own prefill queries
            (AM's "context-prefill" option) instead of the repeat-prefill; 0 = paper default.
        repeat_chunk: document tokens repeated per forward of the chunked repeat-prefill.
        budget_weights: per layer-head weights a(l, h) ``[L, H]`` (tensor or path to a
            ``.pt``/``.safetensors`` file); None = the indexer checkpoint's weights for ``arckv``,
            uniform otherwise.
        indexer: indexer checkpoint path (or a loaded indexer); None = shipped default.
        min_length: shortest document (tokens) accepted.
        seed: seed of every random choice (reference-row subsampling).
        progress: show tqdm progress bars.
        on_policy: Attention Matching's option: the reference queries of layer l are recaptured by
            a repeat-prefill through a cache whose layers below l are already compacted (one
            repeat-prefill per layer, so about L times the cost); off by default.
        score_queries: ARC-KV anchor scoring from ``"all"`` captured positions of each reference
            source (default; the fits still use the ``query_budget`` rows) or from the
            ``"budget"`` rows only (the paper's setting). See ``allocation``.
        allocation: ARC-KV per-head budgets: ``"global"`` (default; one top-k over the scores of
            every layer and head, :func:`~arckv_press.compaction.select.global_budgets`) or
            ``"fixed"`` (Eq. (per_head_budget) with ``budget_weights`` / the checkpoint's weights /
            uniform, the paper's setting); what each costs in planted needles is in
            ``docs/results.md``. Attention Matching methods ignore both options (uniform budgets,
            as its code).
        min_head_fraction: with ``allocation="global"``, every layer--KV head first keeps this
            fraction of its uniform budget, ``floor(min_head_fraction * ratio * T)`` anchors (at
            least 1), and only the rest is allocated by the global top-k
            (:func:`~arckv_press.compaction.select.global_budgets`'s ``min_fraction``); 0 = fully
            global, 1 = uniform, 0.5 the default. Fully global budgets can starve diffuse heads at
            low kept fractions (measured in ``docs/results.md``, "Continuation fidelity").
        pipeline: how ARC-KV with ``score_queries="all"`` reads its reference rows. ``"fused"``
            (default): the repeat-prefill's own attention gathers the anchor scores, each key's
            witness row and every row's full-cache targets in one pass
            (:mod:`arckv_press.compaction.stats`); each KV head then fits on the budget rows plus
            its own anchors' witness rows, and merges keys on ``merge_rows`` of the budget rows.
            ``"separate"``: the previous pipeline, which scores, finds witnesses and fits in
            separate passes over all captured rows, fits on the union of every KV head's witness
            positions (all query heads of each) and merges on all fit rows. The fused pipeline
            needs ``context_fraction=0`` and ``on_policy=False``; otherwise the separate one runs.
        merge_rows: fused pipeline: reference rows per KV head of the response profiles
            (Eq. (response_profile)), a seeded subsample of the budget rows (whole query-head
            groups of a position); ``None`` = each head's fit rows.
        max_head_multiple: with ``allocation="global"``, no layer--KV head gets more than this multiple
            of its uniform budget (``floor(max_head_multiple * ratio * T)``); what a capped head
            would have taken goes to the next best positions of other heads. Without a cap a few
            heads (those whose rows each attend sharply to a different position) take most of
            their positions, and their merge and fits, which grow with the square of a head's
            anchor count, dominate the compaction time; but those heads are the copy heads that keep
            planted needles, so capping them loses needles. ``None`` (default) = no cap.
        verbatim_fraction: fused pipeline: a KV head that keeps more than this fraction of its
            positions keeps its anchors' keys and values as they are, with beta = 0 (no merging, no
            fits), which saves the merge and fits that cost about the square of its anchor count;
            but those heads lose the mass of the positions they drop, and continuation damage
            rises. ``None`` (default) = every head is merged and fitted.
        indexer_rows: fused pipeline, method ``arckv``: the reference rows the learned indexer
            scores. ``"corrected"`` (default): ``score_rows`` of the budget rows, with the indexer's
            base selector pooled over every row by the reference pass (the residual indexer's own
            base, HA or VI; HA for the paper's form): the base's all-row score scaled by the
            indexer's ratio to it on the sample
            (:func:`~arckv_press.compaction.select.corrected_scores`), an estimate of ``"all"`` at
            about the cost of HA's scores; rms or mean pooling. ``"all"``: every captured row (as HA
            and VI scores are pooled; about G T / score_rows times the scoring work). ``"budget"``:
            the budget rows only (the paper's n_score setting, uncorrected: anchors picked for a
            planted needle by its few sharp rows are missed).
        score_rows: ``indexer_rows="corrected"``: reference rows per KV head the learned indexer
            scores, a seeded subsample of the budget rows (as ``merge_rows``); ``None`` = every
            budget row.
        score_shrink: ``indexer_rows="corrected"``: how far the sampled ratio is shrunk towards 1
            for keys the sample saw little of (``shrink`` of ``corrected_scores``).
        fit_scope: ARC-KV: the anchors whose beta and C_v are fitted, ``"merged"`` (default: only
            anchors that absorbed other positions; the others keep their own key, value and
            beta = 0) or ``"all"`` (the paper; :class:`~arckv_press.compaction.layer.LayerMethod`).
        anchor_search: ARC-KV: ``"scores"`` (top-t of the anchor scores) or ``"omp"`` / ``"omp-fast"``
            (Attention Matching's greedy search on the budget rows, with the budgets the scores
            allocate, then ARC-KV's merging and fits; :class:`~arckv_press.compaction.layer.LayerMethod`).
            ``None`` (default) takes it from :data:`RATIO_SCHEDULE` at ``ratio``: ``"scores"`` at
            keep 5% and above, ``"omp"`` below.
        fit_witnesses: with ``score_queries="all"``, the fits (and key merging) use the
            ``query_budget`` rows plus every anchor's witness query, the captured row that attends
            to it most (:mod:`arckv_press.compaction.witness`): without them, anchors picked for a
            planted needle get C_v fitted from queries that barely touch them (``docs/results.md``,
            "Why ARC-KV lost needles"). ``False`` = the budget rows only.
        instruction_rows: fused pipeline: the repeat-prefill's instruction tokens (the repeat prompt
            and the answer-turn suffix of its first chunk) are reference rows too, in the anchor
            scores, the merge rows and every head's fit rows. They sit right after the document, as
            every question does, and attend to its last part as questions do; the repeated copy's
            rows sit a whole document further on and do not, so without them positions near the
            end of the document are fitted for queries unlike the questions that read them.
            ``False`` (default): the repeated document's rows only.
        near_rows: fused pipeline: every repeated copy's query, moved by its rotary embedding from
            where the copy sits (a document after the original) to a position right after the
            document, where a question's tokens sit (the instruction's positions, in turn;
            :meth:`~arckv_press.capture.StatsCapture.add_near_rows`), is a reference row too: all
            of them in the anchor scores and the witnesses, those of the budget positions in the
            merge and fit rows. A question reads a position near the document's end from a few
            tokens away, the copy from a whole document away; heads whose reading depends on the
            distance see the end of the document only in these rows. ``False`` (default): off.
    """

    method: str = "arckv"
    ratio: float = 0.1
    lambda_m: float | None = None
    pooling: str = "rms"
    query_budget: int = 2048
    context_fraction: float = 0.0
    repeat_chunk: int = 2048
    budget_weights: torch.Tensor | str | Path | None = None
    indexer: object = None
    fit: FitConfig = field(default_factory=FitConfig)
    chunk_len: int = 4096
    chunk_min_length: int = 10_000
    min_length: int = 16
    seed: int = 0
    progress: bool = False
    on_policy: bool = False
    score_queries: str = "all"
    allocation: str = "global"
    min_head_fraction: float = 0.5
    fit_witnesses: bool = True
    pipeline: str = "fused"
    merge_rows: int | None = 512
    max_head_multiple: float | None = None
    verbatim_fraction: float | None = None
    indexer_rows: str = "corrected"
    score_rows: int | None = 512
    score_shrink: float = 0.1
    fit_scope: str = "merged"
    anchor_search: str | None = None
    instruction_rows: bool = False
    near_rows: bool = False

    def __post_init__(self) -> None:
        lookup_method(self.method, ours=True)
        check_ratio(self.ratio)
        if not 0.0 <= self.context_fraction <= 1.0:
            raise ValueError(f"context_fraction must be in [0, 1], got {self.context_fraction}")
        if self.query_budget < 1 or self.repeat_chunk < 1:
            raise ValueError("query_budget and repeat_chunk must be positive")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if self.score_queries not in ("all", "budget"):
            raise ValueError(f"score_queries must be 'all' or 'budget', got {self.score_queries!r}")
        if self.allocation not in ("global", "fixed"):
            raise ValueError(f"allocation must be 'global' or 'fixed', got {self.allocation!r}")
        if not 0.0 <= self.min_head_fraction <= 1.0:
            raise ValueError(f"min_head_fraction must be in [0, 1], got {self.min_head_fraction}")
        if self.on_policy and self.allocation == "global" and self.family == "arckv":
            raise ValueError("on_policy=True needs allocation='fixed' (global budgets need every layer's queries up front)")
        if self.min_length < 1:
            raise ValueError(f"min_length must be >= 1, got {self.min_length}")
        if self.max_head_multiple is not None and not (isinstance(self.max_head_multiple, (int, float))
                                                       and not isinstance(self.max_head_multiple, bool)
                                                       and math.isfinite(self.max_head_multiple)
                                                       and self.max_head_multiple >= 1):
            raise ValueError(f"max_head_multiple must be a number >= 1 or None, got {self.max_head_multiple!r}")
        if self.score_rows is not None and (isinstance(self.score_rows, bool) or not isinstance(self.score_rows, int)
                                            or self.score_rows < 1):
            raise ValueError(f"score_rows must be a positive int or None, got {self.score_rows!r}")
        if self.indexer_rows not in INDEXER_ROWS:
            raise ValueError(f"indexer_rows must be one of {INDEXER_ROWS}, got {self.indexer_rows!r}")
        check_nonnegative(self.score_shrink, "score_shrink")
        if self.method == "arckv" and self.indexer_rows == "corrected" and self.pooling == "max":
            raise ValueError("indexer_rows='corrected' estimates a mean over rows: it needs pooling 'rms' or 'mean', "
                             "not 'max'")
        if self.pipeline not in PIPELINES:
            raise ValueError(f"pipeline must be one of {PIPELINES}, got {self.pipeline!r}")
        if self.merge_rows is not None and (isinstance(self.merge_rows, bool) or not isinstance(self.merge_rows, int)
                                            or self.merge_rows < 1):
            raise ValueError(f"merge_rows must be a positive int or None, got {self.merge_rows!r}")
        for name in ("instruction_rows", "near_rows"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if self.family == "arckv" and (self.instruction_rows or self.near_rows) and not _fused(self):
            raise ValueError("instruction_rows and near_rows need the fused pipeline (pipeline='fused', "
                             "score_queries='all', context_fraction=0, on_policy=False)")
        self.layer_method()  # validates lambda_m now, not after the prefill and repeat-prefill

    @property
    def family(self) -> str:
        """``"arckv"`` or ``"am"`` (:class:`~arckv_press.methods.Method`)."""
        return lookup_method(self.method, ours=True).family

    def merging_coefficient(self) -> float:
        """``lambda_m`` as used at this config's kept fraction (the schedule's when ``None``)."""
        return ratio_defaults(self.ratio).lambda_m if self.lambda_m is None else self.lambda_m

    def anchor_search_used(self) -> str:
        """``anchor_search`` as used at this config's kept fraction (the schedule's when ``None``)."""
        return ratio_defaults(self.ratio).anchor_search if self.anchor_search is None else self.anchor_search

    def layer_method(self) -> LayerMethod:
        return LayerMethod(self.method, self.merging_coefficient(), self.pooling, self.chunk_len, self.chunk_min_length, self.fit,
                           fit_witnesses=self.fit_witnesses, verbatim_fraction=self.verbatim_fraction,
                           fit_scope=self.fit_scope, anchor_search=self.anchor_search_used())


_RUN_ONLY_FIELDS = ("ratio", "progress", "indexer", "min_length")
_INDEXER_ONLY_FIELDS = ("indexer_rows", "score_rows", "score_shrink")  # options only the learned indexer's method reads  # never change a result (the indexer has its own id)
_ARCKV_ONLY_FIELDS = ("lambda_m", "budget_weights", "score_queries", "allocation", "min_head_fraction", "fit_witnesses",
                      "pipeline", "merge_rows", "max_head_multiple", "verbatim_fraction", "fit_scope",
                      "anchor_search", "instruction_rows", "near_rows")


# options added after results were stored: they enter the id only when set to something else, so
# the ids (and the stored rows) of the configurations that existed before stay valid
_OMITTED_AT_DEFAULT = {"anchor_search": "scores", "score_rows": 512, "instruction_rows": False, "near_rows": False}
# options only indexer_rows="corrected" reads (score_shrink entered the id with the ratio estimate,
# so rows of the earlier additive estimate keep an id of their own)
_CORRECTED_ONLY_FIELDS = ("score_shrink",)


def _canonical(value):
    """A JSON-able, content-based stand-in for one config value (tensors and weight files by content)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _canonical(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu", torch.float64).contiguous()
        return "tensor:" + hashlib.sha256(str(tuple(t.shape)).encode() + t.numpy().tobytes()).hexdigest()[:16]
    if isinstance(value, (str, Path)) and Path(value).is_file():
        return "file:" + hashlib.sha256(Path(value).read_bytes()).hexdigest()[:16]
    if isinstance(value, float):
        return repr(value)
    return value if value is None or isinstance(value, (bool, int, str)) else repr(value)


def config_id(config: CompactionConfig) -> str:
    """Short content id (12 hex digits) of the options that shape a compaction's result.

    Covers every :class:`CompactionConfig` field (and :class:`FitConfig`) except the kept fraction,
    with ``lambda_m`` and ``anchor_search`` as used at that kept fraction (so the default schedule and
    the same values given explicitly share an id, and the id changes where the schedule does),
    progress bars, ``min_length`` (it only refuses inputs) and the indexer (which has its own id,
    :func:`arckv_press.indexer.checkpoint.checkpoint_id`); for Attention Matching methods also
    except the ARC-KV-only options they ignore (merging, budgets, witnesses). Benchmark rows store
    it, so a result made under other defaults (say a new ``min_head_fraction``) is never taken for
    a current one, while unrelated default changes leave the other methods' rows valid.
    """
    skip = set(_RUN_ONLY_FIELDS) | (set(_ARCKV_ONLY_FIELDS) if config.family == "am" else set())
    skip |= set(_INDEXER_ONLY_FIELDS) if config.method != "arckv" else set()
    used = {"anchor_search": config.anchor_search_used()}  # resolved from the schedule where it decides
    skip |= {name for name, default in _OMITTED_AT_DEFAULT.items() if used.get(name, getattr(config, name)) == default}
    skip |= set(_CORRECTED_ONLY_FIELDS) if config.indexer_rows != "corrected" else set()
    options = {f.name: _canonical(getattr(config, f.name)) for f in dataclasses.fields(config) if f.name not in skip}
    if "lambda_m" in options:  # the coefficient used at this kept fraction: the schedule's or the one given
        options["lambda_m"] = _canonical(float(config.merging_coefficient()))
    if "anchor_search" in options:
        options["anchor_search"] = used["anchor_search"]
    if config.family == "am":
        options["fit"].pop("gram_dtype")  # Attention Matching always forms float64 products
    return hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:12]


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
    any layer used (the budget rows plus that layer's anchor witnesses, see ``fit_witnesses``).
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


def _resolve_indexer(config: CompactionConfig, model):
    """``(indexer, budget weights shipped with it)`` for method ``arckv``, else ``(None, None)``."""
    if config.method != "arckv":
        return None, None
    if config.indexer is not None and not isinstance(config.indexer, (str, Path)):
        _check_indexer_shape(config.indexer, model)
        return config.indexer, None
    from arckv_press.indexer.checkpoint import default_indexer_path, load_indexer
    from arckv_press.models import config_hash, model_id

    mid = model_id(model)
    path = config.indexer or default_indexer_path(mid)
    if path is None:
        raise ValueError(
            f"no value-aware indexer is shipped for {mid!r}: pass indexer=<checkpoint path> "
            "(train one with scripts/train_indexer.py) or use a training-free method (arckv-ha, arckv-vi)"
        )
    indexer, _meta, budget_weights = load_indexer(path, model_id=mid, config_hash=config_hash(model.config))
    return indexer, budget_weights


def _check_indexer_shape(indexer, model) -> None:
    """A loaded indexer (no checkpoint metadata to compare) must have the model's layer, KV-head and
    width sizes; a mismatch is an error naming both, not a shape failure deep inside its scores."""
    from arckv_press.indexer.model import IndexerConfig

    fields = ("num_layers", "num_kv_heads", "head_dim", "d_x")
    have = getattr(indexer, "config", None)
    if not isinstance(have, IndexerConfig):
        raise TypeError(f"indexer must be a checkpoint path or a ValueAwareIndexer, got {type(indexer).__name__}")
    want = IndexerConfig.from_model_config(model.config)
    if any(getattr(have, f) != getattr(want, f) for f in fields):
        raise ValueError(
            "the indexer was built for another model: "
            + ", ".join(f"{f}={getattr(have, f)}" for f in fields)
            + " against the model's "
            + ", ".join(f"{f}={getattr(want, f)}" for f in fields)
        )


def _reference_positions(T: int, G: int, config: CompactionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Document positions whose repeat / context queries are captured (``query_budget // G`` in all).

    A pure source (``context_fraction`` 0 or 1) never borrows rows from the other one, even when the
    document has fewer positions than the budget; mixed sources spill over as ``mix_sources`` does.
    """
    n_pos = max(1, config.query_budget // G)
    empty = torch.zeros(0, dtype=torch.long)
    if config.context_fraction == 0.0:
        return subsample_rows(T, n_pos, config.seed), empty
    if config.context_fraction == 1.0:
        return empty, subsample_rows(T, n_pos, config.seed)
    return mix_sources(T, T, config.context_fraction, n_pos, config.seed)


def compact(
    model,
    tokenizer,
    context: str,
    method: str = "arckv",
    ratio: float = 0.1,
    use_chat_template: bool | None = None,
    **options,
) -> CompactCache:
    """Prefill ``context`` and compact its document tokens with ``method`` at kept fraction ``ratio``.

    Returns a :class:`CompactCache` (batch size 1) for ``model``; the model's attention is switched
    to the ARC-KV function (:func:`arckv_press.attention.enable_compact_attention`), which behaves
    as before on ordinary caches. Ask questions by feeding ``question + suffix`` tokens (see
    :func:`arckv_press.capture.framing_for`) with ``past_key_values=cache``.
    """
    config = CompactionConfig(method=method, ratio=ratio, **options)
    ids, prefix_len = encode_document(tokenizer, context, use_chat_template)
    cache = DynamicCache(config=model.config)
    return compact_prefilled(model, tokenizer, cache, ids, prefix_len, config, use_chat_template=use_chat_template)


@torch.no_grad()
def compact_prefilled(
    model,
    tokenizer,
    cache,
    context_ids: torch.Tensor,
    prefix_len: int,
    config: CompactionConfig,
    already_prefilled: bool = False,
    context_queries=None,
    use_chat_template: bool | None = None,
) -> CompactCache:
    """Compact the document ``context_ids[:, prefix_len:]`` held in ``cache``, in place.

    ``cache`` is prefilled here unless ``already_prefilled`` (the press path, where kvpress's
    pipeline ran the prefill; then ``context_queries`` holds queries captured during it, if any).
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
    T = context_ids.shape[1] - prefix_len
    if T < config.min_length:
        raise ValueError(f"the document has {T} tokens; at least {config.min_length} are needed to compact it")
    check_context_positions(model, n_ctx, prefix_len)  # before the (long) prefill and repeat-prefill
    layers = list(layout.full_attention_layers)
    H, G = layout.num_kv_heads, layout.group_size
    timings: dict[str, float] = {}
    plan = capture_plan(T, G, config)

    # Indexer and budgets are resolved before the (possibly long) prefill: a missing checkpoint or
    # malformed budget weights fail fast and leave ``cache`` untouched.
    indexer, shipped_weights = _resolve_indexer(config, model) if config.ratio < 1.0 else (None, None)
    chosen = config.budget_weights if config.budget_weights is not None else shipped_weights
    weights = _load_weights(chosen, (len(layers), H), layout.num_layers)
    if weights is not None and weights.shape[0] == layout.num_layers != len(layers):
        weights = weights[list(layers)]  # checkpoint weights cover every layer; keep the compacted ones
    budgets = per_head_budgets(T, config.ratio, weights, len(layers), H)

    t0 = time.perf_counter()
    if already_prefilled and config.ratio < 1.0 and plan.context_capture.numel() and context_queries is None:
        raise ValueError(
            f"context_fraction={config.context_fraction} needs the queries captured during the prefill "
            "(context_queries); capture them with QueryCapture or set context_fraction=0"
        )
    if not already_prefilled:
        if config.ratio < 1.0 and plan.context_capture.numel():
            context_queries = _prefill_capturing(model, cache, context_ids, layers, plan.context_capture + prefix_len)
        else:
            prefill(model, context_ids, cache)
    timings["prefill"] = time.perf_counter() - t0 if not already_prefilled else 0.0

    full_bytes = sum(cache.layers[i].keys.nbytes + cache.layers[i].values.nbytes for i in layers)
    full_cache_bytes = cache_nbytes(cache)  # every layer, the sliding windows included
    framing = framing_for(tokenizer, use_chat_template)
    method = config.layer_method()
    if config.ratio >= 1.0:
        layer_results = {i: None for i in layers}
        n_rows = 0
    elif _fused(config):
        layer_results, n_rows = _compact_fused(model, tokenizer, cache, context_ids, prefix_len, layers, config, method,
                                               framing, indexer, budgets, plan, timings, H, G)
    else:
        layer_results, n_rows = _compact_separate(model, tokenizer, cache, context_ids, prefix_len, layers, config,
                                                  method, framing, indexer, budgets, plan, context_queries, timings, H, G)
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
        extra={"prefix_length": prefix_len, "lambda_m": config.merging_coefficient(), "config_id": config_id(config),
               "report": report.__dict__},
    )
    result.report = report
    return result


def _progress(config: CompactionConfig, total: int, desc: str, unit: str = "tok"):
    if not config.progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, leave=False)


def _fused(config: CompactionConfig) -> bool:
    """Whether ARC-KV runs the fused reference pass (``CompactionConfig.pipeline``)."""
    return (config.pipeline == "fused" and config.family == "arckv" and config.score_queries == "all"
            and not config.on_policy and config.context_fraction == 0.0)


def _compact_fused(model, tokenizer, cache, context_ids, prefix_len, layers, config, method, framing, indexer,
                   budgets, plan, timings, H, G):
    """Stages of the fused pipeline: one repeat-prefill gathering every statistic, allocation,
    then each layer from its statistics (:func:`compact_layer_from_stats`)."""
    T = context_ids.shape[1] - prefix_len
    selector = lookup_method(config.method).selector
    t0 = time.perf_counter()
    bar = _progress(config, T, "repeat-prefill")
    base_pos = plan.repeat_rows
    score_pos = indexer_positions(config, base_pos, T, G)
    pass_selector = selector
    if selector == "indexer":  # the pass pools the residual indexer's base only as its control variate
        pass_selector = _control_selector(indexer, model, layers) if config.indexer_rows == "corrected" else "none"
    cap = repeat_prefill_stats(model, tokenizer, cache, context_ids[:, prefix_len:], framing.suffix_ids, layers,
                               prefix_len, selector=pass_selector, pooling=config.pooling,
                               x_positions=score_pos if selector == "indexer" else None,
                               chunk_size=config.repeat_chunk, progress=bar, instruction_rows=config.instruction_rows,
                               near_positions=torch.arange(T) if config.near_rows else None)
    if bar is not None:
        bar.close()
    timings["repeat_prefill"] = time.perf_counter() - t0
    timings["reference_stats"] = cap.stats_seconds  # part of repeat_prefill: the in-pass selection work
    queries = {i: group_queries_by_kv_head(torch.cat(cap.store.q.pop(i), dim=1)[None], H) for i in layers}

    N = T + cap.n_instruction + cap.n_near  # rows per query head: the repeated document, the instruction, near rows
    after = torch.arange(T, T + cap.n_instruction)  # every instruction row, and the near rows of the budget positions
    if cap.n_near:
        after = torch.cat([after, T + cap.n_instruction + base_pos])
    base_rows = grouped_rows(torch.cat([base_pos, after]), N, G)
    score_rows = grouped_rows(score_pos, N, G)
    t0 = time.perf_counter()
    scores = {}
    for i in layers:
        if selector == "indexer":  # indexer_rows: every captured row, the budget rows, or those corrected
            K, V = _document_kv(cache, i, prefix_len)
            X = torch.cat(cap.store.x.pop(i), dim=0)
            Q = queries[i] if config.indexer_rows == "all" else queries[i][:, score_rows.to(K.device)]
            if config.indexer_rows == "corrected":
                sample, sample_base = indexer.scores(i, group_activations(X, G), Q, K, V, pooling=config.pooling,
                                                     base=True, base_scale=_scaling(model, i))
                scores[i] = corrected_scores(cap.stats[i].scores, sample, sample_base, config.pooling,
                                             config.score_shrink, Q.shape[1] / queries[i].shape[1])
            else:
                scores[i] = indexer.scores(i, group_activations(X, G), Q, K, V, pooling=config.pooling)
        else:
            scores[i] = cap.stats[i].scores
    if config.allocation == "global":
        budgets = global_budgets(torch.stack([scores[i].float() for i in layers]), config.ratio,
                                 min_fraction=config.min_head_fraction, max_multiple=config.max_head_multiple)
    timings["selection"] = time.perf_counter() - t0

    merge_rows = None
    if config.merge_rows is not None:
        n_pos = max(1, config.merge_rows // G)
        merge_rows = grouped_rows(torch.cat([base_pos[subsample_rows(base_pos.numel(), n_pos, config.seed + 1)], after]),
                                  N, G)
    results, n_rows = {}, 0
    bar = _progress(config, len(layers), f"compact ({config.method})", unit="layer")
    for li, i in enumerate(layers):
        K, V = _document_kv(cache, i, prefix_len)
        res = compact_layer_from_stats(K, V, queries.pop(i), cap.stats.pop(i), budgets[li].to(K.device),
                                       _scaling(model, i), method, base_rows, merge_rows, scores.pop(i))
        results[i] = res
        n_rows = max(n_rows, res.fit_rows)
        for stage, sec in res.timings.items():
            timings[stage] = timings.get(stage, 0.0) + sec
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return results, n_rows


def indexer_positions(config: CompactionConfig, base_pos: torch.Tensor, T: int, G: int) -> torch.Tensor:
    """Document positions whose rows the learned indexer scores (``indexer_rows``): every position,
    the budget positions ``base_pos``, or (``"corrected"``) a seeded subsample of ``score_rows // G``
    of them; sorted, as the captured activations are."""
    if config.indexer_rows == "all":
        return torch.arange(T)
    if config.indexer_rows == "corrected" and config.score_rows is not None:
        return base_pos[subsample_rows(base_pos.numel(), max(1, config.score_rows // G), config.seed + 2)]
    return base_pos


def _control_selector(indexer, model, layers) -> str:
    """The reference-pass selector whose pooled scores are the control variate of
    ``indexer_rows="corrected"``: a residual indexer's base (``ha`` or ``vi``), HA for the paper's
    form. A residual base must be at the model's own softmax scale in every compacted layer (else the
    pass and the indexer would pool different bases)."""
    cfg = indexer.config
    for i in layers:
        if cfg.base_logit_scale is not None and not math.isclose(cfg.base_logit_scale, _scaling(model, i), rel_tol=1e-6):
            raise ValueError(f"indexer_rows='corrected': the indexer's base_logit_scale {cfg.base_logit_scale} is not "
                             f"the model's softmax scale {_scaling(model, i)} (layer {i})")
    return "vi" if cfg.base_value_influence else "ha"


def _compact_separate(model, tokenizer, cache, context_ids, prefix_len, layers, config, method, framing, indexer,
                      budgets, plan, context_queries, timings, H, G):
    """The separate pipeline (``pipeline="separate"``, Attention Matching, ``on_policy``, mixed
    reference sources): captured queries, then per layer :func:`compact_layer`."""
    repeat_store = None
    if plan.repeat_capture.numel():
        t0 = time.perf_counter()
        bar = _progress(config, context_ids.shape[1] - prefix_len, "repeat-prefill")
        repeat_store = repeat_prefill(
            model, tokenizer, cache, context_ids[:, prefix_len:], framing.suffix_ids,
            layers[:1] if config.on_policy else layers, plan.repeat_capture, config.repeat_chunk, bar,
        )
        if bar is not None:
            bar.close()
        timings["repeat_prefill"] = time.perf_counter() - t0
    scored = config.family == "arckv" and not config.on_policy

    def layer_scores(layer_idx: int) -> torch.Tensor:
        """Anchor scores of a layer from every captured reference row (``score_queries``)."""
        X, Q = _layer_queries(layer_idx, repeat_store, context_queries, H)
        K, V = _document_kv(cache, layer_idx, prefix_len)
        return anchor_scores(method, Q, K, V, _scaling(model, layer_idx),
                             group_activations(X, G) if X is not None else None, indexer, layer_idx)

    scores: dict[int, torch.Tensor] = {}
    if scored and config.allocation == "global":
        t0 = time.perf_counter()
        scores = {layer_idx: layer_scores(layer_idx) for layer_idx in layers}
        budgets = global_budgets(torch.stack([scores[i].float() for i in layers]), config.ratio,
                                 min_fraction=config.min_head_fraction, max_multiple=config.max_head_multiple)
        timings["selection"] = time.perf_counter() - t0

    results, n_rows = {}, 0
    bar = _progress(config, len(layers), f"compact ({config.method})", unit="layer")
    for li, layer_idx in enumerate(layers):
        K, V = _document_kv(cache, layer_idx, prefix_len)
        if config.on_policy and li > 0 and plan.repeat_capture.numel():
            t0 = time.perf_counter()
            enable_compact_attention(model)  # layers below are compact now
            repeat_store = repeat_prefill(
                model, tokenizer, cache, context_ids[:, prefix_len:], framing.suffix_ids, [layer_idx],
                plan.repeat_capture, config.repeat_chunk,
            )
            timings["repeat_prefill"] = timings.get("repeat_prefill", 0.0) + time.perf_counter() - t0
        layer_score = scores.pop(layer_idx, None)
        if scored and layer_score is None:
            t0 = time.perf_counter()
            layer_score = layer_scores(layer_idx)
            timings["selection"] = timings.get("selection", 0.0) + time.perf_counter() - t0
        fit_pos = _fit_positions(layer_idx, repeat_store, context_queries, plan)
        X, Q = _layer_queries(layer_idx, repeat_store, context_queries, H,
                              *((None, None) if fit_pos is not None else (plan.repeat_rows, plan.context_rows)))
        res = compact_layer(
            K, V, Q, budgets[li].to(K.device), _scaling(model, layer_idx), method,
            X=group_activations(X, G) if X is not None else None, indexer=indexer, layer_idx=layer_idx,
            scores=layer_score, fit_positions=fit_pos, group_size=G,
        )
        results[layer_idx] = res
        n_rows = max(n_rows, res.fit_rows)
        for stage, sec in res.timings.items():
            timings[stage] = timings.get(stage, 0.0) + sec
        # on_policy: the next layer's repeat-prefill reads this layer compacted
        if config.on_policy:
            _pack_layer(cache, layer_idx, prefix_len, K.shape[1], H, res)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return results, n_rows


def _pack_layer(cache, layer_idx: int, prefix_len: int, T: int, H: int, res) -> None:
    """Replace an ordinary cache layer by its :class:`CompactLayer` (``res`` ``None``: ratio 1, every
    position kept with beta = 0); a layer packed already (``on_policy``) is left as it is."""
    dyn = cache.layers[layer_idx]
    if isinstance(dyn, CompactLayer):
        return
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


def _scaling(model, layer_idx: int) -> float:
    from arckv_press.capture import decoder_layers

    return float(decoder_layers(model)[layer_idx].self_attn.scaling)


def _prefill_capturing(model, cache, context_ids, layers, rows):
    with QueryCapture(model, layers) as cap:
        prefill(model, context_ids, cache, cap, rows=rows)
    return cap.store


def _document_kv(cache, layer_idx: int, prefix_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The document part ``K, V [H, T, D]`` of an ordinary cache layer (views)."""
    layer = cache.layers[layer_idx]
    return layer.keys[0, :, prefix_len:], layer.values[0, :, prefix_len:]


@dataclass
class _CapturePlan:
    """Document positions captured per reference source, and which captured rows feed the fits.

    ``*_rows`` index the captured rows of a source (``None``: all of them). With
    ``score_queries="all"`` (ARC-KV) every position is captured so the anchor scores see all
    reference queries, and the fits use the ``query_budget`` subset.
    """

    repeat_capture: torch.Tensor
    context_capture: torch.Tensor
    repeat_rows: torch.Tensor | None
    context_rows: torch.Tensor | None


def capture_plan(T: int, G: int, config: CompactionConfig) -> _CapturePlan:
    """The document positions each reference source captures for ``T`` document tokens and ``G``
    query heads per KV head, and which captured rows feed the fits (shared with the presses)."""
    repeat_pos, context_pos = _reference_positions(T, G, config)
    score_all = config.score_queries == "all" and config.family == "arckv" and not config.on_policy

    def widen(pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if score_all and pos.numel():
            return torch.arange(T), pos  # captured row i is position i
        return pos, None

    (rep_cap, rep_rows), (ctx_cap, ctx_rows) = widen(repeat_pos), widen(context_pos)
    return _CapturePlan(rep_cap, ctx_cap, rep_rows, ctx_rows)


def _fit_positions(layer_idx: int, repeat_store, context_store, plan: _CapturePlan) -> torch.Tensor | None:
    """Positions of the layer's whole reference pool (repeat captures, then context captures, as
    :func:`_layer_queries` concatenates them) that feed the fits, or ``None`` when the pool is
    the fit rows already (no ``score_queries="all"`` widening)."""
    if plan.repeat_rows is None and plan.context_rows is None:
        return None
    parts, offset = [], 0
    for store, rows in ((repeat_store, plan.repeat_rows), (context_store, plan.context_rows)):
        if store is not None and layer_idx in store.x:
            n = sum(chunk.shape[0] for chunk in store.x[layer_idx])
            parts.append((torch.arange(n) if rows is None else rows.cpu().long()) + offset)
            offset += n
    return torch.cat(parts)


def _layer_queries(
    layer_idx: int, repeat_store, context_store, H: int, repeat_rows=None, context_rows=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``X [n, d_x]`` and ``Q [H_kv, G * n, D]`` from the repeat and context captures of a layer
    (``*_rows``: the captured rows to use, ``None`` = all)."""
    xs, qs = [], []
    for store, rows in ((repeat_store, repeat_rows), (context_store, context_rows)):
        if store is not None and layer_idx in store.x:
            x, q = store.layer(layer_idx)
            if rows is not None:
                rows = rows.to(x.device)
                x, q = x[rows], q[:, rows]
            xs.append(x)
            qs.append(q)
    if not xs:
        raise ValueError(f"layer {layer_idx}: no reference queries were captured")
    x, q = torch.cat(xs, dim=0), torch.cat(qs, dim=1)
    return x, group_queries_by_kv_head(q[None], H)

