"""The options of one compaction (:class:`CompactionConfig`) and their content id (:func:`config_id`).

ARC-KV's defaults by kept fraction (:data:`RATIO_SCHEDULE`) live here too; :mod:`arckv_press.api`
runs a compaction with a config.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from arckv_press.compaction.checks import check_ratio
from arckv_press.compaction.fit import FitConfig
from arckv_press.compaction.layer import LayerMethod
from arckv_press.compaction.select import POOLINGS
from arckv_press.methods import method as lookup_method
from arckv_press.models import GEMMA3_MODEL_ID

__all__ = ["CompactionConfig", "config_id", "RATIO_SCHEDULE", "MODEL_RATIO_SCHEDULES", "METHOD_SCHEDULES",
           "RatioDefaults", "ratio_defaults", "ratio_schedule", "SCHEDULED", "INDEXER_ROWS", "BUDGETS", "SCORE_SHRINK", "MIN_LENGTH"]

INDEXER_ROWS = ("all", "budget")  # CompactionConfig.indexer_rows, besides a row count
BUDGETS = ("global", "fixed")  # CompactionConfig.budgets, besides weights (a tensor or a file)
MIN_LENGTH = 16  # the shortest document (tokens) a compaction accepts
#: the CompactionConfig options whose ``None`` means "the schedule's value at this kept fraction"
#: (:class:`RatioDefaults`' fields; :meth:`CompactionConfig.scheduled`)
SCHEDULED = ("lambda_m", "anchor_search", "tail_rows")

@dataclass(frozen=True)
class RatioDefaults:
    """ARC-KV's defaults from kept fraction ``lowest`` down to the next step of :data:`RATIO_SCHEDULE`:
    the key-merging coefficient ``lambda_m`` of Eq. (key_merge) and how anchors are found
    (``anchor_search``, :class:`~arckv_press.compaction.layer.LayerMethod`), and the reference pass's
    tail rows (``tail_rows``, :class:`CompactionConfig`)."""

    lowest: float
    lambda_m: float
    anchor_search: str
    tail_rows: int = 0


# Steps, largest kept fraction first. Chosen on the development split of the fidelity benchmark (never
# on the documents the leaderboards report; docs/methodology.md): from keep 5% up, the top-t of the
# selector's scores (they keep planted needles); below it, where a head keeps a handful of anchors and
# no selector keeps needles, Attention Matching's OMP search on the budget rows, which picks anchors
# that together fit every row's attention mass, then ARC-KV's merging and fits. From keep 10% up the
# top-t's scores also pool 512 tail rows, chosen on development needle cases (docs/studies/needle_end.md):
# without them, heads that read only nearby text never see the end of the document in the reference
# pass, and needles there are lost; at keep 5% they raised the development split's mean continuation
# damage by 0.025, so below keep 10% there are none; ``arckv-vi`` takes none at all (METHOD_SCHEDULES).
RATIO_SCHEDULE: tuple[RatioDefaults, ...] = (RatioDefaults(0.1, 0.25, "scores", 512), RatioDefaults(0.05, 0.25, "scores"),
                                             RatioDefaults(0.0, 0.25, "omp"))


# Models whose own development data chose another schedule (``docs/studies/gemma3.md``). Gemma 3 270M,
# whose three global layers have one KV head each, takes OMP's anchors at every kept fraction: on its
# development documents they cut the continuation damage of the top-t by more than half at keep 10%
# and by a third at keep 5% (fitting every anchor instead changed nothing).
MODEL_RATIO_SCHEDULES: dict[str, tuple[RatioDefaults, ...]] = {
    GEMMA3_MODEL_ID: (RatioDefaults(0.0, 0.25, "omp"),),
}


# Methods whose own development cases chose another value of a scheduled option, at every kept fraction
# (``docs/studies/needle_end.md``, "`arckv-vi` takes no tail rows"). The tail rows were chosen on the
# learned indexer's (``arckv``) cases; with VI's scores they moved anchors off the rest of the document:
# on development needle cases VI lost needles at depths 25-50% with them and found no more at the end.
METHOD_SCHEDULES: dict[str, dict[str, object]] = {"arckv-vi": {"tail_rows": 0}}


def ratio_schedule(model_id: str | None = None) -> tuple[RatioDefaults, ...]:
    """The schedule of model ``model_id`` (its Hugging Face id, :func:`arckv_press.models.model_id`):
    its own in :data:`MODEL_RATIO_SCHEDULES`, else :data:`RATIO_SCHEDULE` (also for ``None``)."""
    return MODEL_RATIO_SCHEDULES.get(model_id, RATIO_SCHEDULE)


def ratio_defaults(ratio: float, model_id: str | None = None) -> RatioDefaults:
    """The step of model ``model_id``'s schedule (:func:`ratio_schedule`) for kept fraction ``ratio``:
    the first whose ``lowest`` ``ratio`` reaches."""
    ratio = check_ratio(ratio)
    return next(step for step in ratio_schedule(model_id) if ratio >= step.lowest)


@dataclass
class CompactionConfig:
    """Options of one compaction (defaults follow the paper where it gives one).

    The options of one layer's steps (``pooling``, ``chunk_len``, ``chunk_min_length``, ``fit``,
    ``anchor_search``; ``lambda_m`` as used) are described once, on
    :class:`~arckv_press.compaction.layer.LayerMethod`, which :meth:`layer_method` builds, and the
    fits' (which anchors, which rows, the solvers) on :class:`~arckv_press.compaction.fit.FitConfig`;
    below are what this class adds to them. ``fit`` also takes a dict of ``FitConfig`` fields
    (unknown keys are refused), e.g. ``fit={'scope': 'all'}``.

    Attributes:
        method: ``arckv`` (learned indexer), ``arckv-ha``, ``arckv-vi``, ``am-omp``,
            ``am-omp-fast`` or ``am-ha``.
        ratio: kept fraction rho in (0, 1].
        lambda_m: key-merging coefficient of Eq. (key_merge) (the paper uses 0.25 for QuALITY and
            RULER); ``None`` (default) takes it from :data:`RATIO_SCHEDULE` at ``ratio``
            (:func:`ratio_defaults`; 0.25 at every kept fraction, chosen on the fidelity dev split,
            ``docs/methodology.md``).
        query_budget: reference-query rows per KV head (G rows per captured position).
        seed: seed of every random choice (reference-row subsampling).
        budgets: how the kept positions are shared among layer--KV heads (ARC-KV methods;
            Attention Matching keeps uniform budgets, as its code). ``"global"`` (default): one
            top-k over the scores of every layer and head, with a floor per head
            (``min_head_fraction``; :func:`~arckv_press.compaction.select.global_budgets`).
            ``"fixed"``: Eq. (per_head_budget), the paper's setting, with the learned indexer
            checkpoint's weights a(l, h) for ``arckv`` and uniform weights otherwise. A ``[L, H]``
            tensor of weights, or the path of a ``.pt`` / ``.safetensors`` file holding one:
            Eq. (per_head_budget) with these weights. What each costs in planted needles is in
            ``docs/history.md``.
        min_head_fraction: with ``budgets="global"``, every layer--KV head first keeps this
            fraction of its uniform budget, ``floor(min_head_fraction * ratio * T)`` anchors (at
            least 1), and only the rest is allocated by the global top-k
            (:func:`~arckv_press.compaction.select.global_budgets`'s ``min_fraction``); 0 = fully
            global, 1 = uniform, 0.5 the default. Fully global budgets can starve diffuse heads at
            low kept fractions (measured in ``docs/results.md``, "Continuation fidelity").
        merge_rows: reference rows per KV head of the response profiles
            (Eq. (response_profile)), a seeded subsample of the budget rows (whole query-head
            groups of a position); ``None`` = each head's fit rows.
        indexer_rows: method ``arckv``: the reference rows the learned indexer scores. A row count
            (default 512): a seeded subsample of that many of the budget rows (as ``merge_rows``; all
            of them when the budget has fewer), with the indexer's base selector pooled over every
            row by the reference pass (the residual indexer's own base, HA or VI; HA for the
            paper's form): the base's all-row score scaled by the indexer's ratio to it on the
            sample (:func:`~arckv_press.compaction.select.corrected_scores`), an estimate of
            ``"all"`` at about the cost of HA's scores; rms or mean pooling. ``"all"``: every
            captured row (as HA and VI scores are pooled; about G T / 512 times the scoring work).
            ``"budget"``: the budget rows only (the paper's n_score setting, uncorrected: anchors
            picked for a planted needle by its few sharp rows are missed).
        anchor_search: ``None`` (default) takes it from :data:`RATIO_SCHEDULE` at ``ratio``
            (``"scores"`` at keep 5% and above, ``"omp"`` below).
        tail_rows: the reference pass repeats the document's last ``tail_rows`` tokens once more,
            right after the document (:func:`~arckv_press.capture.repeat_prefill_stats`), and their
            queries are reference rows too, after the copy's: all of them in
            the anchor scores and the witnesses, those of the budget positions in the merge and fit
            rows. The whole copy reads every position from a document away; a question reads the end
            of the document from nearby, and heads that read only nearby text (whose copy rows
            attend to the copy itself) see the end in these rows alone. At most a quarter of the
            document is repeated (:data:`~arckv_press.capture.TAIL_FRACTION`). ``0``: off; ``None``
            (default) takes it from :data:`RATIO_SCHEDULE` at ``ratio`` (512 at keep 10% and above,
            0 below; Gemma 3's schedule: 0; ``arckv-vi``: 0, :data:`METHOD_SCHEDULES`).
    """

    method: str = "arckv"
    ratio: float = 0.1
    lambda_m: float | None = None
    pooling: str = "rms"
    query_budget: int = 2048
    fit: FitConfig = field(default_factory=FitConfig)
    chunk_len: int = 4096
    chunk_min_length: int = 10_000
    seed: int = 0
    budgets: str | Path | torch.Tensor = "global"
    min_head_fraction: float = 0.5
    merge_rows: int | None = 512
    indexer_rows: int | str = 512
    anchor_search: str | None = None
    tail_rows: int | None = None

    def __post_init__(self) -> None:
        lookup_method(self.method, ours=True)
        if isinstance(self.fit, dict):  # e.g. --option "fit={'b_min': 0.0}", or a JSON config
            names = [f.name for f in dataclasses.fields(FitConfig)]
            unknown = sorted(set(self.fit) - set(names))
            if unknown:
                raise ValueError(f"fit has no option(s) {unknown}; FitConfig's are {names}")
            self.fit = FitConfig(**self.fit)
        if not isinstance(self.fit, FitConfig):
            raise TypeError(f"fit must be a FitConfig or a dict of its fields, got {type(self.fit).__name__}")
        check_ratio(self.ratio)
        if self.query_budget < 1:
            raise ValueError(f"query_budget must be positive, got {self.query_budget}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if isinstance(self.budgets, (str, Path)) and self.budgets not in BUDGETS and not Path(self.budgets).is_file():
            raise ValueError(f"budgets must be one of {BUDGETS}, a [L, H] tensor of weights or the path of a weights "
                             f"file, got {self.budgets!r} (no such file)")
        if not isinstance(self.budgets, (str, Path, torch.Tensor)):
            raise TypeError(f"budgets must be one of {BUDGETS}, a tensor or a path, got {type(self.budgets).__name__}")
        if not 0.0 <= self.min_head_fraction <= 1.0:
            raise ValueError(f"min_head_fraction must be in [0, 1], got {self.min_head_fraction}")
        if isinstance(self.indexer_rows, bool) or not (
                self.indexer_rows in INDEXER_ROWS or (isinstance(self.indexer_rows, int) and self.indexer_rows >= 1)):
            raise ValueError(f"indexer_rows must be a positive row count or one of {INDEXER_ROWS}, got {self.indexer_rows!r}")
        if self.method == "arckv" and self.corrected_scores and self.pooling == "max":
            raise ValueError(f"indexer_rows={self.indexer_rows} (a row count) corrects the learned indexer's scores, an "
                             "estimate of a mean over rows: it needs pooling 'rms' or 'mean', not 'max'")
        if self.merge_rows is not None and (isinstance(self.merge_rows, bool) or not isinstance(self.merge_rows, int)
                                            or self.merge_rows < 1):
            raise ValueError(f"merge_rows must be a positive int or None, got {self.merge_rows!r}")
        if self.tail_rows is not None and (isinstance(self.tail_rows, bool) or not isinstance(self.tail_rows, int)):
            raise TypeError(f"tail_rows must be an int or None, got {type(self.tail_rows).__name__}")
        if self.tail_rows is not None and self.tail_rows < 0:
            raise ValueError(f"tail_rows must be >= 0 (0: off), got {self.tail_rows}")
        self.layer_method()  # validates lambda_m now, not after the prefill and repeat-prefill

    @property
    def corrected_scores(self) -> bool:
        """Whether ``indexer_rows`` is a row count: the learned indexer scores a sample of the budget
        rows, corrected by its base selector over every row."""
        return not isinstance(self.indexer_rows, str)

    @property
    def family(self) -> str:
        """``"arckv"`` or ``"am"`` (:class:`~arckv_press.methods.Method`)."""
        return lookup_method(self.method, ours=True).family

    def scheduled(self, name: str, model_id: str | None = None):
        """Option ``name`` (one of :data:`SCHEDULED`) as used at this config's kept fraction: the value
        given, or when ``None`` this method's own value (:data:`METHOD_SCHEDULES`), else model
        ``model_id``'s schedule's (:func:`ratio_defaults`; ``None``: the default model's)."""
        value = getattr(self, name)
        if value is not None:
            return value
        own = METHOD_SCHEDULES.get(self.method, {})
        return own[name] if name in own else getattr(ratio_defaults(self.ratio, model_id), name)

    def for_model(self, model_id: str | None) -> "CompactionConfig":
        """This config with the :data:`SCHEDULED` options set where they are ``None``, to model
        ``model_id``'s defaults at ``ratio`` (:func:`ratio_defaults`). A compaction runs the config
        resolved for its model, and results store that config's id; given values are kept."""
        return dataclasses.replace(self, **{name: self.scheduled(name, model_id) for name in SCHEDULED})

    def layer_method(self) -> LayerMethod:
        return LayerMethod(self.method, self.scheduled("lambda_m"), self.pooling, self.chunk_len, self.chunk_min_length,
                           self.fit, anchor_search=self.scheduled("anchor_search"))


_RUN_ONLY_FIELDS = ("ratio",)  # stored beside the id
_INDEXER_ONLY_FIELDS = ("indexer_rows",)  # options only the learned indexer's method reads
_ARCKV_ONLY_FIELDS = ("lambda_m", "budgets", "min_head_fraction", "merge_rows", "anchor_search",
                      "tail_rows")
_ARCKV_ONLY_FIT_FIELDS = ("scope", "witnesses")
SCORE_SHRINK = 0.1  # ``shrink`` of corrected_scores when indexer_rows is a row count


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
    with ``lambda_m``, ``anchor_search`` and ``tail_rows`` as used at that kept fraction (so the default
    schedule and the same values given explicitly share an id, and the id changes where the schedule
    does), and the indexer (which has its own id, :func:`arckv_press.indexer.checkpoint.checkpoint_id`); for
    Attention Matching methods also except the ARC-KV-only options they ignore (merging, budgets,
    the fits' scope and witnesses). Benchmark rows store it, so a result made under other defaults
    (say a new ``min_head_fraction``) is never taken for a current one, while unrelated default
    changes leave the other methods' rows valid.
    """
    skip = set(_RUN_ONLY_FIELDS) | (set(_ARCKV_ONLY_FIELDS) if config.family == "am" else set())
    skip |= set(_INDEXER_ONLY_FIELDS) if config.method != "arckv" else set()
    options = {f.name: _canonical(getattr(config, f.name)) for f in dataclasses.fields(config) if f.name not in skip}
    for name in SCHEDULED:  # as used at this kept fraction: the schedule's or the value given
        if name in options:
            options[name] = _canonical(float(config.scheduled(name)) if name == "lambda_m" else config.scheduled(name))
    if config.family == "am":
        for name in ("gram_dtype", *_ARCKV_ONLY_FIT_FIELDS):  # AM always forms float64 products; no merge groups
            options["fit"].pop(name)
    return hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:12]
