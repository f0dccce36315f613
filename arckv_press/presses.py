"""kvpress adapters: ``ARCKVPress`` and ``AttentionMatchingPress``.

Both follow kvpress's ``BasePress`` contract (a dataclass used as ``with press(model): <prefill>``)
but, like kvpress's ``KVzipPress``, they act *after* the prefill instead of inside attention
hooks: a forward pre-hook on the decoder records the prefill's ``input_ids`` and cache, and when
the ``with`` block exits the document part of the context is compacted with
:func:`arckv_press.api.compact_prefilled` (repeat-prefill, then per layer select / merge / fit;
paper Sec. 3). The compacted layers are written into the caller's cache as
:class:`~arckv_press.cache.CompactLayer` objects (``(C_k, beta, C_v)`` packed per KV head, paper
Eq. (compact_attention)), so kvpress's pipeline, or plain ``model(...)`` / ``model.generate(...)``
calls, answer questions from the compacted cache.

Ratio convention: ``ratio`` is the kept fraction rho = t/T (paper convention);
``compression_ratio = 1 - ratio`` is kvpress's removed fraction and is kept in sync so that code
written for kvpress presses (which reads or sets ``press.compression_ratio``) keeps working.

Which tokens are compacted: the framing prefix of ``framing_for(tokenizer)`` (chat template up to
the user message, or BOS) is kept verbatim when the context ids start with it; everything after
it (the document) is compacted. The repeat-prefill uses the same framing (see
:mod:`arckv_press.capture`).

Models with sliding-window layers (Gemma 3): these presses compact the global (full-attention)
layers only, and the sliding-window layers keep their window; kvpress's own presses are made to
follow the same convention by :func:`hybrid_press_class` (``registry.make_press`` uses it).
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Generator

import torch
from kvpress import BasePress

from arckv_press.config import CompactionConfig
from arckv_press.api import CompactionReport, compact_prefilled
from arckv_press.cache import new_cache
from arckv_press.capture import framing_for
from arckv_press.compaction.checks import check_ratio
from arckv_press.methods import am_method, arckv_method

__all__ = ["ARCKVPress", "AttentionMatchingPress", "hybrid_press_class", "kept_to_compression", "resolve_kept_ratio",
           "sliding_layer_indices"]

_DEFAULTS = CompactionConfig(method="arckv-ha")  # defaults are read from here, never restated
_DEFAULT_RATIO = 0.1
_RATIO_TOL = 1e-9


def kept_to_compression(ratio: float) -> float:
    """kvpress's ``compression_ratio`` (removed fraction) for a kept fraction ``ratio``.

    Rounded to 12 decimals so that ``1 - 0.9`` gives ``0.1`` rather than ``0.09999999999999998``
    (far below any budget granularity).
    """
    return round(1.0 - ratio, 12)


def _check_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} must be a number, got NaN")
    return value


def resolve_kept_ratio(ratio: float | None, compression_ratio: float | None) -> float:
    """The kept fraction from ``ratio`` (kept) and/or ``compression_ratio`` (removed).

    Give one, or both consistently (``|ratio - (1 - compression_ratio)| < 1e-9``); neither gives
    the default 0.1. The result must lie in (0, 1].
    """
    if ratio is None and compression_ratio is None:
        kept = _DEFAULT_RATIO
    elif compression_ratio is None:
        kept = _check_number("ratio", ratio)
    else:
        removed = _check_number("compression_ratio", compression_ratio)
        kept = round(1.0 - removed, 12)
        if ratio is not None:
            given = _check_number("ratio", ratio)
            if abs(given - (1.0 - removed)) >= _RATIO_TOL:
                raise ValueError(
                    f"ratio={given!r} (kept fraction) and compression_ratio={removed!r} (removed fraction) are "
                    f"inconsistent: they must satisfy ratio == 1 - compression_ratio; give only one of them"
                )
            kept = given
        elif not 0.0 <= removed < 1.0:
            raise ValueError(
                f"compression_ratio (removed fraction) must be in [0, 1), got {removed!r} "
                f"(kept fraction ratio = {kept!r})"
            )
    return check_ratio(kept)


@dataclass
class _PrefillRecord:
    """What the decoder pre-hook saw of the first forward inside ``with press(model)``."""

    input_ids: torch.Tensor | None = None
    cache: Any = None
    prefix_len: int = 0


@dataclass
class _CompactionPress(BasePress):
    """Shared machinery of the ARC-KV and Attention-Matching presses (see the module docstring).

    Attributes:
        ratio: kept fraction rho in (0, 1] (default 0.1 when neither ratio field is given).
        compression_ratio: kvpress's removed fraction, ``1 - ratio``; give ``ratio`` or
            ``compression_ratio`` or both consistently. After construction, assigning either one
            updates the other (``press.ratio = 0.2``); ``dataclasses.replace`` passes both, so
            change both there or assign instead.
        tokenizer: the model's tokenizer (framing and repeat prompt); ``None`` loads it with
            ``AutoTokenizer.from_pretrained(model.config.name_or_path)``, as kvpress's
            ``KVzipPress`` does (the default model's ``name_or_path`` is a local folder).
        query_budget, seed: as in :class:`~arckv_press.config.CompactionConfig` (defaults taken
            from it).
        progress: show tqdm bars while compacting.
        use_chat_template: framing choice (None: chat template when the tokenizer has one, the
            same rule as kvpress's pipeline).
        config_options: further :class:`~arckv_press.config.CompactionConfig` fields passed through
            unchanged (e.g. ``pooling``, ``fit=FitConfig(...)``, ``budgets``).

    State (the press's own, not the model's): ``last_report`` holds the
    :class:`~arckv_press.api.CompactionReport` of the latest compaction run by this press
    instance (``None`` before the first one).
    """

    ratio: float | None = None
    compression_ratio: float | None = None
    tokenizer: Any = None
    query_budget: int = _DEFAULTS.query_budget
    seed: int = _DEFAULTS.seed
    progress: bool = False
    use_chat_template: bool | None = None
    config_options: dict[str, Any] = field(default_factory=dict)
    last_report: CompactionReport | None = field(default=None, init=False, repr=False, compare=False)

    # ------------------------------------------------------------------ configuration
    def __post_init__(self) -> None:
        kept = resolve_kept_ratio(self.ratio, self.compression_ratio)
        object.__setattr__(self, "ratio", kept)
        object.__setattr__(self, "compression_ratio", kept_to_compression(kept))
        object.__setattr__(self, "_ratio_synced", True)
        self.compaction_config()  # validate everything now, not after the user's prefill

    def __setattr__(self, name: str, value: Any) -> None:
        # keep ratio and compression_ratio in sync once constructed (kvpress code sets compression_ratio)
        if name in ("ratio", "compression_ratio") and getattr(self, "_ratio_synced", False):
            kept = resolve_kept_ratio(value, None) if name == "ratio" else resolve_kept_ratio(None, value)
            object.__setattr__(self, "ratio", kept)
            object.__setattr__(self, "compression_ratio", kept_to_compression(kept))
            return
        object.__setattr__(self, name, value)

    @property
    def method(self) -> str:
        """The method name (``arckv``, ``arckv-ha``, ..., ``am-omp``, ...)."""
        raise NotImplementedError

    def _method_options(self) -> dict[str, Any]:
        """CompactionConfig fields set by the concrete press (besides ``method``)."""
        return {}

    def compaction_indexer(self) -> Any:
        """The learned indexer the compaction takes (``indexer`` of
        :func:`~arckv_press.api.compact_prefilled`); ``None``: the shipped one, or none used."""
        return None

    def compaction_config(self) -> CompactionConfig:
        """The :class:`CompactionConfig` of this press (validated)."""
        own = dict(
            method=self.method,
            ratio=self.ratio,
            query_budget=self.query_budget,
            seed=self.seed,
            **self._method_options(),
        )
        extra = dict(self.config_options or {})
        clash = sorted(set(extra) & set(own))
        if clash:
            raise ValueError(f"config_options must not set {clash}: pass them as press arguments instead")
        known = {f.name for f in dataclasses.fields(CompactionConfig)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"config_options has unknown CompactionConfig field(s) {unknown}; valid ones: "
                f"{sorted(known - set(own))}"
            )
        config = CompactionConfig(**own, **extra)
        config.layer_method()  # validates lambda_m / pooling
        return config

    def _tokenizer_for(self, model):
        if self.tokenizer is not None:
            return self.tokenizer
        name = getattr(model.config, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
        if not name:
            raise ValueError(
                f"{type(self).__name__} needs the model's tokenizer: pass tokenizer=... (the model's "
                "config.name_or_path is empty, so it cannot be reloaded)"
            )
        cached = getattr(self, "_loaded_tokenizer", None)
        if cached is not None and cached[0] == name:
            return cached[1]
        from transformers import AutoTokenizer

        try:  # never downloads: the repeat-prefill must not reach the network behind the user's back
            tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
        except OSError as err:
            raise ValueError(
                f"{type(self).__name__} needs the model's tokenizer and found none for {name!r} on disk "
                f"(it never downloads one): pass tokenizer=... ({err})"
            ) from err
        object.__setattr__(self, "_loaded_tokenizer", (name, tokenizer))
        return tokenizer

    # ------------------------------------------------------------------ kvpress contract
    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        raise NotImplementedError(
            f"{type(self).__name__} compacts the whole context after the prefill (use `with press(model):`), "
            "not per attention layer"
        )

    @contextmanager
    def __call__(self, model) -> Generator[None, None, None]:
        """Record the prefill run inside the block; compact its document part on exit.

        Inside the block, run exactly one forward of the context (batch size 1) on an empty
        cache, e.g. ``model.model(input_ids=ids, past_key_values=cache)`` (kvpress's pipeline)
        or ``model(ids, past_key_values=cache)``; if no cache is passed, a ``DynamicCache`` is
        created and returned in the output's ``past_key_values``. On exit that cache is
        compacted in place. Hooks are removed on exit whatever happens; nothing is compacted if
        the block raised or ran no forward.
        """
        from arckv_press.models import describe_attention_layout

        describe_attention_layout(model)  # unsupported architectures fail before the prefill
        config = self.compaction_config()
        tokenizer = self._tokenizer_for(model)
        self.post_init_from_model(model)
        prefix_ids = framing_for(tokenizer, self.use_chat_template).prefix_ids
        record = _PrefillRecord()

        def pre_hook(module, args, kwargs):
            if record.input_ids is not None:  # only the first forward is the context prefill
                return None
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is None:
                raise ValueError(f"{type(self).__name__} needs the context as input_ids (inputs_embeds are not supported)")
            if ids.ndim != 2 or ids.shape[0] != 1:
                raise ValueError(
                    f"{type(self).__name__} compacts one context at a time (batch size 1); got input_ids of "
                    f"shape {tuple(ids.shape)}. Prefill each context separately."
                )
            cache = kwargs.get("past_key_values")
            if cache is None:
                if kwargs.get("use_cache") is False:
                    raise ValueError(f"{type(self).__name__} needs the context's cache: do not pass use_cache=False")
                cache = new_cache(model)
                kwargs["past_key_values"] = cache
            if cache.get_seq_length() != 0:
                raise ValueError(
                    f"{type(self).__name__} must see the context prefill on an empty cache; the cache already "
                    f"holds {cache.get_seq_length()} tokens"
                )
            n = len(prefix_ids)
            prefix_len = n if n and ids.shape[1] >= n and ids[0, :n].tolist() == prefix_ids else 0
            record.input_ids, record.cache, record.prefix_len = ids.detach(), cache, prefix_len
            return args, kwargs

        # The module kvpress's pipeline and arckv_press.capture.prefill call. For multimodal wrappers
        # (Gemma3ForConditionalGeneration) this is the multimodal model, which receives input_ids;
        # its `language_model` only receives inputs_embeds, so it cannot be the hooked module.
        decoder = model.model
        handles = []
        try:
            handles.append(decoder.register_forward_pre_hook(pre_hook, with_kwargs=True))
            yield
        finally:
            for handle in handles:
                handle.remove()

        if record.input_ids is None:
            return
        seq = record.cache.get_seq_length()
        if seq != record.input_ids.shape[1]:
            raise ValueError(
                f"{type(self).__name__} compacts the context prefill when the `with` block exits, but the cache "
                f"holds {seq} tokens for a context of {record.input_ids.shape[1]}: run only the context prefill "
                "inside the block and ask questions after it"
            )
        with torch.inference_mode():
            result = compact_prefilled(
                model, tokenizer, record.cache, record.input_ids, record.prefix_len, config,
                already_prefilled=True, use_chat_template=self.use_chat_template, progress=self.progress,
                indexer=self.compaction_indexer(),
            )
        self.last_report = result.report


@dataclass
class ARCKVPress(_CompactionPress):
    """ARC-KV as a kvpress press: anchors + key merging + fitted ``beta``/``C_v`` (paper Sec. 3).

    ``with press(model): <context prefill>`` records the prefill (a forward pre-hook on
    ``model.model``; ``model.forward`` is never patched) and, on exit, compacts the document part
    of the context in place: the compacted layers of the cache become
    :class:`~arckv_press.cache.CompactLayer` objects (packed per KV head). Questions are then
    asked with the same cache, e.g. by kvpress's ``pipeline("kv-press-text-generation")``
    (which answers after the press has exited and trims each answer through
    ``CompactLayer.keys``) or by ``model.generate(context + question, past_key_values=cache)``.

    Side effect on the model: the compaction switches the model's attention to the ARC-KV
    implementation (:func:`arckv_press.attention.enable_compact_attention`) and it stays switched
    after the press exits (a compact cache needs it); on ordinary caches it delegates unchanged to
    the previous implementation. Use :func:`arckv_press.attention.disable_compact_attention` to
    switch back. The compacted tensors are created under ``torch.inference_mode()``: ask
    questions under ``torch.no_grad()``/``torch.inference_mode()`` (``generate`` and the pipeline
    do).

    Args:
        ratio: kept fraction rho in (0, 1] (or ``compression_ratio = 1 - ratio``); ``ratio=1.0``
            keeps every position with beta = 0 and answers exactly as the full cache.
        lambda_m: key-merging coefficient (paper Eq. (key_merge); 0.25 in the paper); ``None``
            (default) takes it from the schedule by kept fraction
            (:data:`~arckv_press.config.RATIO_SCHEDULE`).
        selector: anchor selector: ``"indexer"`` (learned value-aware indexer, method ``arckv``),
            ``"ha"`` (highest attention, ``arckv-ha``) or ``"vi"`` (value influence, ``arckv-vi``);
            paper App. C.1.
        indexer: indexer checkpoint path or loaded indexer for ``selector="indexer"``; ``None``
            uses the checkpoint shipped for the model, and compaction raises a ValueError when
            none is shipped.
        min_head_fraction: share of its uniform budget every layer--KV head keeps before the rest
            is allocated globally (see :class:`~arckv_press.config.CompactionConfig`; 0 = fully
            global, 1 = uniform budgets).
        Other fields: see ``_CompactionPress`` (tokenizer, query_budget, seed,
        progress, use_chat_template, config_options) and ``last_report``.
    """

    lambda_m: float | None = _DEFAULTS.lambda_m
    selector: str = "indexer"
    indexer: Any = None
    min_head_fraction: float = _DEFAULTS.min_head_fraction

    @property
    def method(self) -> str:
        return arckv_method(self.selector).name

    def _method_options(self) -> dict[str, Any]:
        return {"lambda_m": self.lambda_m, "min_head_fraction": self.min_head_fraction}

    def compaction_indexer(self) -> Any:
        return self.indexer


@dataclass
class AttentionMatchingPress(_CompactionPress):
    """Attention Matching (Zweiger et al.) baselines as a kvpress press: methods ``am-*``.

    Same mechanics, cache layout and side effect on the model's attention as :class:`ARCKVPress`
    (read its docstring): the context prefill is recorded and compacted on exit, the cache then
    holds :class:`~arckv_press.cache.CompactLayer` objects and the model's attention stays
    switched to the ARC-KV implementation.

    Args:
        ratio: kept fraction rho in (0, 1] (or ``compression_ratio = 1 - ratio``).
        variant: ``"omp"`` (greedy OMP key selection, ``am-omp``), ``"omp-fast"`` (``am-omp-fast``)
            or ``"ha"`` (highest attention, ``am-ha``).
        Other fields: see ``_CompactionPress``.
    """

    variant: str = "omp"

    @property
    def method(self) -> str:
        return am_method(self.variant).name


# ---------------------------------------------------------------------------------------------
# kvpress's presses on models with sliding-window layers (Gemma 3)
#
# The convention (kvpress's own for Gemma3ForConditionalGeneration, and ARC-KV's): only the global
# (full-attention) layers are compressed; a sliding-window layer keeps its window. kvpress 0.5.5
# applies it to Gemma3ForConditionalGeneration only: on Gemma3ForCausalLM (Gemma 3 270M, 1B) its
# scorer presses compress the windows too, Expected Attention fails (Gemma 3's rotary embedding
# needs the layer type, which kvpress does not pass) and KVzip refuses the model. The classes
# below are kvpress's presses with the convention applied to every model whose config has
# sliding-window layers; on other models they behave exactly as kvpress's.


class _LayerTypeRotary(torch.nn.Module):
    """A model's rotary embedding for one layer type (Gemma 3's ``rotary_emb(x, position_ids,
    layer_type)``), called as kvpress calls it: ``rotary_emb(x, position_ids)``."""

    def __init__(self, rotary: torch.nn.Module, layer_type: str):
        super().__init__()
        self.rotary = rotary
        self.layer_type = layer_type

    def forward(self, x, position_ids):
        return self.rotary(x, position_ids, self.layer_type)

    @property
    def inv_freq(self) -> torch.Tensor:
        return getattr(self.rotary, f"{self.layer_type}_inv_freq")


def sliding_layer_indices(model) -> frozenset[int]:
    """Indices of the decoder layers with sliding-window attention (empty for most models)."""
    from arckv_press.models import attention_layer_types

    return frozenset(i for i, kind in enumerate(attention_layer_types(model)) if kind == "sliding_attention")


@contextmanager
def _per_layer_rotary(model) -> Generator[None, None, None]:
    """While inside: each attention module's ``rotary_emb`` is the model's rotary embedding for its
    own layer type, when that embedding takes the layer type (Gemma 3); restored on exit."""
    import inspect

    from arckv_press.capture import decoder_layers
    from arckv_press.models import attention_layer_types

    inner = getattr(model.model, "language_model", model.model)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or "layer_type" not in inspect.signature(rotary.forward).parameters:
        yield
        return
    kinds = attention_layer_types(model)
    saved = []
    for layer, kind in zip(decoder_layers(model), kinds):
        attn = layer.self_attn
        saved.append((attn, attn._modules.get("rotary_emb", attn.__dict__.get("rotary_emb"))))
        attn.rotary_emb = _LayerTypeRotary(rotary, kind)
    try:
        yield
    finally:
        for attn, previous in saved:
            if previous is None:
                delattr(attn, "rotary_emb")
            else:
                attn.rotary_emb = previous


class _GlobalLayersOnly:
    """Mixin for a kvpress press compressing in its attention forward hooks (``ScorerPress``):
    the hooks of sliding-window layers do nothing."""

    @contextmanager
    def __call__(self, model) -> Generator[None, None, None]:
        object.__setattr__(self, "_arckv_sliding", sliding_layer_indices(model))
        try:
            with super().__call__(model), _per_layer_rotary(model):
                yield
        finally:
            object.__setattr__(self, "_arckv_sliding", frozenset())

    def forward_hook(self, module, input, kwargs, output):
        if int(module.layer_idx) in getattr(self, "_arckv_sliding", ()):
            return output
        return super().forward_hook(module, input, kwargs, output)


class _GlobalLayersKVzip:
    """Mixin for kvpress's ``KVzipPress``: on a model with sliding-window layers (which kvpress
    refuses for Gemma 3) the context reconstruction scores the global layers only, the sliding
    layers' windows are put back after every reconstruction chunk (the chunk's tokens would
    otherwise evict the context from them), and the budget of ``compression_ratio`` is spent over
    the global layers alone. The procedure is kvpress 0.5.5's ``KVzipPress`` otherwise."""

    @contextmanager
    def __call__(self, model) -> Generator[None, None, None]:
        sliding = sliding_layer_indices(model)
        if not sliding:
            with super().__call__(model):
                yield
            return
        from types import MethodType

        from transformers import AutoTokenizer

        self.post_init_from_model(model)
        tokenizer = AutoTokenizer.from_pretrained(model.config.name_or_path, local_files_only=True)
        prefix_ids, suffix_ids = _kvzip_framing(tokenizer)
        self.prefix_length = len(prefix_ids)
        self._suffix_ids = torch.tensor([suffix_ids], dtype=torch.long)
        object.__setattr__(self, "_arckv_sliding", sliding)
        original_forward = model.model.forward

        def wrapped_forward(model_self, *args, **kwargs):
            self._context_ids = kwargs["input_ids"]
            self._cache = kwargs["past_key_values"]
            return original_forward(*args, **kwargs)

        model.model.forward = MethodType(wrapped_forward, model.model)
        try:
            try:
                yield
            finally:
                model.model.forward = original_forward
            if self.compression_ratio > 0 and self._context_ids is not None:
                with _per_layer_rotary(model):
                    self._perform_kvzip_compression(model, tokenizer)
        finally:
            self._reset_internal_parameters()
            object.__setattr__(self, "_arckv_sliding", frozenset())

    def _perform_kvzip_compression(self, model, tokenizer) -> None:
        from arckv_press.cache import cache_snapshot, restore_cache
        from arckv_press.capture import decoder_layers

        sliding = getattr(self, "_arckv_sliding", frozenset())
        if not sliding:
            return super()._perform_kvzip_compression(model, tokenizer)
        self.context_length = self._context_ids.shape[1]
        chunks = self.prepare(model, tokenizer)
        hooks = [layer.self_attn.register_forward_hook(self.forward_hook, with_kwargs=True)
                 for i, layer in enumerate(decoder_layers(model)) if i not in sliding]
        state = cache_snapshot(self._cache)
        try:
            self.start_idx = self.prefix_length
            for prefill_ids, repeat_ids in chunks:
                self.end_idx = self.start_idx + prefill_ids.shape[1]
                model.model(input_ids=repeat_ids.to(model.device), past_key_values=self._cache)
                restore_cache(self._cache, state)  # the sliding windows hold the context's end again
                self.start_idx = self.end_idx
        finally:
            for hook in hooks:
                hook.remove()
            restore_cache(self._cache, state)
        self.compress_post(model)

    def compress_post(self, model) -> None:
        from arckv_press.capture import decoder_layers

        sliding = getattr(self, "_arckv_sliding", frozenset())
        if not sliding:
            return super().compress_post(model)
        layers = decoder_layers(model)
        for i in sliding:
            layers[i].self_attn.masked_key_indices = None
        if self.compression_ratio <= 0:
            return
        kept = [i for i in range(len(layers)) if i not in sliding]
        if not kept:
            return
        scores = self.score_val[kept]  # [global layers, batch, kv heads, context]
        scores[..., : self.n_sink] = scores.amax() + 1.0  # attention sinks are never evicted
        n_layer, bsz, heads, ctx_len = scores.shape
        per_layer = bsz * heads * ctx_len
        if self.layerwise:
            n_pruned = torch.full((n_layer,), int(per_layer * self.compression_ratio), dtype=torch.int)
        else:
            pruned = torch.topk(-scores.reshape(-1), int(scores.numel() * self.compression_ratio)).indices
            n_pruned = torch.bincount(pruned // per_layer, minlength=n_layer).int().cpu()
        for j, layer_idx in enumerate(kept):
            module = layers[layer_idx].self_attn
            if module.config._attn_implementation == "eager":
                raise ValueError("KVzipPress needs an sdpa / flash attention implementation, not eager")
            count = int(n_pruned[j])
            indices = torch.topk(-scores[j].reshape(bsz, -1), count, dim=1).indices.flatten().cpu()
            batch_indices = torch.arange(bsz).repeat_interleave(count)
            module.masked_key_indices = (batch_indices, indices // ctx_len, indices % ctx_len)


def _kvzip_framing(tokenizer) -> tuple[list[int], list[int]]:
    """KVzip's prefix and suffix ids (kvpress 0.5.5: the chat template's, or none and a newline)."""
    if tokenizer.chat_template is None:
        return [], tokenizer.encode("\n", add_special_tokens=False)
    framing = framing_for(tokenizer, True)
    return framing.prefix_ids, framing.suffix_ids


_HYBRID_CLASSES: dict[type, type] = {}


def hybrid_press_class(cls: type) -> type:
    """kvpress press class ``cls`` under the sliding-window convention (section comment above): a
    subclass of the same name that compresses only the global layers of a model with
    sliding-window layers and is ``cls`` itself on every other model. Our own presses (which
    compact the global layers already) are returned unchanged."""
    if issubclass(cls, _CompactionPress) or not issubclass(cls, BasePress):
        return cls
    if cls not in _HYBRID_CLASSES:
        from kvpress import KVzipPress

        mixin = _GlobalLayersKVzip if issubclass(cls, KVzipPress) else _GlobalLayersOnly
        _HYBRID_CLASSES[cls] = type(cls.__name__, (mixin, cls), {
            "__module__": __name__, "__qualname__": cls.__qualname__,
            "__doc__": f"kvpress's {cls.__name__}, compressing only the global layers of a model with "
                       f"sliding-window layers (arckv_press.presses.hybrid_press_class).\n\n{cls.__doc__ or ''}"})
    return _HYBRID_CLASSES[cls]
