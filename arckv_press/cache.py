"""The packed compact cache: ``(C_k, beta, C_v)`` per layer with a different length per KV head.

A compacted layer replaces the ``T`` cache rows of a document by ``t(l, h)`` entries per KV head
(paper Eq. (compact_attention)): compact keys ``C_k`` (keeping the original RoPE), an
attention-mass bias ``beta`` and compact values ``C_v``. The entries of all heads are stored
**packed** (concatenated along one axis, ``lengths[h]`` rows for head ``h``), so the bytes held for
the compacted context are ``sum_h t(l, h) * (2 * head_dim * itemsize + 4)`` (beta is kept in
float32, a numerical guard: bf16 would round a bias of 10 to +-0.03, i.e. a 3% mass error).

Tokens that were not compacted (an instruction prefix or suffix around the document) and tokens
appended later (questions, generated tokens) live in an ordinary ``[B, H, A, D]`` block with zero
bias (paper Eq. (concatenated_attention_preservation)).

Positions: the layer reports ``span + A`` as its sequence length, where ``span`` is the number of
original positions the compacted block stands for, so that a caller passing only ``input_ids``
gets the original positions (new token i sits at ``original length + i``, as in kvpress's
pipeline). The attention itself only ever sees the rows actually stored.

How a layer talks to the attention function: :meth:`CompactLayer.update` returns the ordinary
rows only, keys ``[B, H, A, D + 1]`` with one extra zero channel that marks them as a compact
layer's rows, and attaches the compacted block to that key tensor as attribute ``arckv_block``
(:meth:`CompactLayer.padded`: ``C_k, beta, C_v`` padded to ``[H, t_max, ...]``, views when every
head holds the same number of entries). The attention function registered in
:mod:`arckv_press.attention` attends to the block once for the whole batch and to the ordinary
rows per sequence, so no step copies the compacted block per sequence. The marker channel makes
any attention function that does not know the layout fail loudly on the shape.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer

__all__ = ["CacheFileError", "CacheMetadata", "CompactLayer", "CompactCache", "EvictableLayer", "cache_nbytes",
           "cache_snapshot", "check_metadata", "check_save_target", "make_evictable", "new_cache", "pack_heads", "restore_cache",
           "unpack_heads"]


def pack_heads(x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack a padded per-head tensor ``[H, t_max, ...]`` into ``[sum_h t_h, ...]``.

    ``valid [H, t_max]`` must be a prefix mask per head (valid slots first). Returns the packed
    tensor and ``lengths [H]``.
    """
    if valid.shape != x.shape[:2]:
        raise ValueError(f"valid mask shape {tuple(valid.shape)} does not match tensor {tuple(x.shape[:2])}")
    lengths = valid.sum(dim=1)
    prefix = torch.arange(valid.shape[1], device=valid.device)[None, :] < lengths[:, None]
    if not torch.equal(prefix, valid):
        raise ValueError("valid mask must hold each head's valid slots first (a prefix per head)")
    return x[valid], lengths


def unpack_heads(packed: torch.Tensor, lengths: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Inverse of :func:`pack_heads`: ``[sum t_h, ...] -> [H, t_max, ...]`` padded with ``fill``."""
    H = lengths.shape[0]
    t_max = int(lengths.max()) if H else 0
    out = packed.new_full((H, t_max, *packed.shape[1:]), fill)
    valid = torch.arange(t_max, device=lengths.device)[None, :] < lengths[:, None]
    out[valid] = packed
    return out


def _check_finite(name: str, x: torch.Tensor, layer_idx: int, lengths: torch.Tensor) -> None:
    bad = ~torch.isfinite(x)
    if bad.any():
        row = int(bad.reshape(bad.shape[0], -1).any(dim=1).nonzero()[0])
        head = int(torch.searchsorted(torch.cumsum(lengths, 0), torch.tensor(row, device=lengths.device), right=True))
        raise ValueError(f"layer {layer_idx}, head {head}: {name} contains NaN or inf")


class CompactLayer(CacheLayerMixin):
    """One compacted layer: packed ``(C_k, beta, C_v)`` plus an ordinary block of appended tokens.

    Args:
        keys: packed compact keys ``[sum_h t_h, D]`` (post-RoPE, original positions).
        beta: packed bias ``[sum_h t_h]`` (stored as float32).
        values: packed compact values ``[sum_h t_h, D]``.
        lengths: ``[H]`` number of entries per KV head, each in ``[1, span]``.
        span: number of original context positions the compacted block replaces.
        layer_idx: only used in error messages.
        fixed_keys, fixed_values: optional ``[1, H, F, D]`` uncompressed tokens of the context
            (instruction prefix/suffix) kept verbatim with zero bias.
    """

    is_sliding = False
    is_compileable = False

    def __init__(
        self,
        keys: torch.Tensor,
        beta: torch.Tensor,
        values: torch.Tensor,
        lengths: torch.Tensor,
        span: int,
        layer_idx: int = -1,
        fixed_keys: torch.Tensor | None = None,
        fixed_values: torch.Tensor | None = None,
    ):
        super().__init__()
        lengths = lengths.to(device=keys.device, dtype=torch.long)
        where = f"layer {layer_idx}"
        if keys.ndim != 2 or values.ndim != 2 or beta.ndim != 1:
            raise ValueError(
                f"{where}: expected packed keys/values [N, D] and beta [N], got keys {tuple(keys.shape)}, "
                f"values {tuple(values.shape)}, beta {tuple(beta.shape)}"
            )
        if lengths.ndim != 1 or lengths.numel() == 0:
            raise ValueError(f"{where}: lengths must be a non-empty 1-D tensor, got shape {tuple(lengths.shape)}")
        n = int(lengths.sum())
        if keys.shape != values.shape or keys.shape[0] != n or beta.shape[0] != n:
            raise ValueError(
                f"{where}: packed shapes disagree with lengths (sum {n}): keys {tuple(keys.shape)}, "
                f"values {tuple(values.shape)}, beta {tuple(beta.shape)}"
            )
        for h, t in enumerate(lengths.tolist()):
            if t < 1 or t > span:
                raise ValueError(f"{where}, head {h}: t = {t} entries, must be in [1, {span}] (the original length)")
        _check_finite("C_k", keys, layer_idx, lengths)
        _check_finite("C_v", values, layer_idx, lengths)
        _check_finite("beta", beta, layer_idx, lengths)

        self.layer_idx = layer_idx
        self.ck = keys
        self.cv = values
        self.beta = beta.to(torch.float32)
        self.lengths = lengths
        self.span = int(span)
        self.dtype, self.device = keys.dtype, keys.device
        self.num_heads, self.head_dim = lengths.shape[0], keys.shape[1]
        self._t_max = int(lengths.max())
        empty = keys.new_zeros(1, self.num_heads, 0, self.head_dim)
        if (fixed_keys is None) != (fixed_values is None):
            raise ValueError(f"{where}: give both fixed_keys and fixed_values or neither")
        if fixed_keys is not None:
            if fixed_keys.shape != fixed_values.shape or fixed_keys.shape[1] != self.num_heads:
                raise ValueError(
                    f"{where}: fixed tokens must be [B, {self.num_heads}, F, {self.head_dim}], got "
                    f"{tuple(fixed_keys.shape)} and {tuple(fixed_values.shape)}"
                )
        self._new_k = fixed_keys if fixed_keys is not None else empty
        self._new_v = fixed_values if fixed_values is not None else empty
        self._gather = self._gather_index()
        self.is_initialized = True

    # ------------------------------------------------------------------ sizes
    @property
    def batch_size(self) -> int:
        return self._new_k.shape[0]

    @property
    def num_appended(self) -> int:
        """Ordinary (zero-bias) rows: fixed context tokens plus tokens appended after compaction."""
        return self._new_k.shape[-2]

    @property
    def t_max(self) -> int:
        return self._t_max

    def compact_nbytes(self) -> int:
        """Bytes held for the compacted context: sum_h t_h * (2 D itemsize + 4)."""
        return self.ck.nbytes + self.cv.nbytes + self.beta.nbytes

    def nbytes(self) -> int:
        """All bytes held by this layer (compacted entries plus ordinary rows)."""
        return self.compact_nbytes() + self._new_k.nbytes + self._new_v.nbytes

    def get_seq_length(self) -> int:
        return self.span + self.num_appended

    def get_max_cache_shape(self) -> int:
        return -1

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        return self.get_seq_length() + cache_position.shape[0], 0

    # ------------------------------------------------------------- transformers API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # always initialised

    def padded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Padded ``C_k [H, t_max, D]``, ``beta [H, t_max]`` (float32, -inf pad), ``C_v``.

        Views without a copy when every head holds the same number of entries (uniform budgets);
        otherwise transient copies gathered from the packed rows (size independent of the batch).
        """
        H, t_max = self.num_heads, self.t_max
        if self._gather is None:
            return self.ck.view(H, t_max, -1), self.beta.view(H, t_max), self.cv.view(H, t_max, -1)
        index, pad = self._gather
        ck = self.ck.index_select(0, index).view(H, t_max, -1)
        cv = self.cv.index_select(0, index).view(H, t_max, -1)
        beta = self.beta.index_select(0, index).view(H, t_max).masked_fill(pad, -math.inf)
        return ck, beta, cv

    def _gather_index(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Row index into the packed tensors for each padded slot, and the padding mask (None if uniform)."""
        if bool((self.lengths == self.lengths[0]).all()):
            return None
        slot = torch.arange(self.t_max, device=self.device)[None, :]
        pad = slot >= self.lengths[:, None]
        starts = torch.cumsum(self.lengths, 0) - self.lengths
        index = torch.where(pad, starts[:, None], starts[:, None] + slot)  # pads read the head's first row
        return index.reshape(-1), pad

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs: dict[str, Any] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new tokens; return the ordinary rows (keys marked, compacted block attached)."""
        B = key_states.shape[0]
        if key_states.shape[1] != self.num_heads or key_states.shape[-1] != self.head_dim:
            raise ValueError(
                f"layer {self.layer_idx}: new keys {tuple(key_states.shape)} do not match the compact cache "
                f"({self.num_heads} KV heads, head_dim {self.head_dim})"
            )
        if self.batch_size == B:
            base_k, base_v = self._new_k, self._new_v
        elif self.batch_size == 1:  # first use with a batch: every row shares the same context
            base_k, base_v = self._new_k.expand(B, -1, -1, -1), self._new_v.expand(B, -1, -1, -1)
        else:
            raise ValueError(f"layer {self.layer_idx}: batch size {B} does not match the cache's {self.batch_size}")
        self._new_k = torch.cat([base_k.to(key_states.dtype), key_states], dim=-2)
        self._new_v = torch.cat([base_v.to(value_states.dtype), value_states], dim=-2)
        return self.attention_inputs()

    def attention_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``keys [B, H, A, D + 1]`` (ordinary rows plus a zero marker channel, with the compacted
        block attached as ``keys.arckv_block``) and ``values [B, H, A, D]``: what
        :func:`arckv_press.attention.compact_attention_forward` reads."""
        keys = torch.cat([self._new_k, self._new_k.new_zeros(*self._new_k.shape[:-1], 1)], dim=-1)
        keys.arckv_block = self.padded()
        return keys, self._new_v

    # kvpress's pipeline trims answers with `layer.keys = layer.keys[:, :, :seq_len]`, where
    # seq_len = get_seq_length() before the question. `keys` therefore exposes span + A rows: the
    # first `span` rows are NaN placeholders (the compacted block has no per-position keys; NaN makes
    # any reader that treats them as keys fail loudly), the rest are the real appended keys.
    def _positional_view(self, appended: torch.Tensor) -> torch.Tensor:
        B, H, _, D = appended.shape
        placeholder = appended.new_full((B, H, self.span, D), math.nan)
        return torch.cat([placeholder, appended], dim=-2)

    def _keep_from_view(self, x: torch.Tensor) -> int:
        keep = x.shape[-2] - self.span
        if keep < 0 or keep > self.num_appended:
            raise ValueError(
                f"layer {self.layer_idx}: cannot set {x.shape[-2]} rows on a compact layer of span {self.span} "
                f"with {self.num_appended} ordinary rows"
            )
        return keep

    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        if not getattr(self, "is_initialized", False):
            return None
        return self._positional_view(self._new_k)

    @keys.setter
    def keys(self, x: torch.Tensor | None) -> None:
        if x is None or not getattr(self, "is_initialized", False):
            return
        self._new_k = self._new_k[..., : self._keep_from_view(x), :]

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        if not getattr(self, "is_initialized", False):
            return None
        return self._positional_view(self._new_v)

    @values.setter
    def values(self, x: torch.Tensor | None) -> None:
        if x is None or not getattr(self, "is_initialized", False):
            return
        self._new_v = self._new_v[..., : self._keep_from_view(x), :]

    def crop(self, max_length: int) -> None:
        if max_length < 0:
            max_length = self.get_seq_length() - abs(max_length)
        keep = max(0, min(self.num_appended, max_length - self.span))
        if max_length < self.span:
            raise ValueError(f"layer {self.layer_idx}: cannot crop into the compacted block (span {self.span})")
        self._new_k, self._new_v = self._new_k[..., :keep, :], self._new_v[..., :keep, :]

    def truncate_appended(self, keep: int) -> None:
        """Keep only the first ``keep`` ordinary rows (drop tokens appended after them)."""
        self._new_k, self._new_v = self._new_k[..., :keep, :], self._new_v[..., :keep, :]

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._new_k = self._new_k.repeat_interleave(repeats, dim=0)
        self._new_v = self._new_v.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._new_k, self._new_v = self._new_k[indices], self._new_v[indices]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._new_k = self._new_k.index_select(0, beam_idx.to(self.device))
        self._new_v = self._new_v.index_select(0, beam_idx.to(self.device))

    def reset(self) -> None:
        self.truncate_appended(0)

    def offload(self):
        self._move("cpu")

    def prefetch(self):
        self._move(self.device)

    def _move(self, device) -> None:
        for name in ("ck", "cv", "beta", "lengths", "_new_k", "_new_v"):
            setattr(self, name, getattr(self, name).to(device, non_blocking=True))
        self._gather = None if self._gather is None else tuple(x.to(device) for x in self._gather)

    def __repr__(self) -> str:
        return (
            f"CompactLayer(layer={self.layer_idx}, lengths={self.lengths.tolist()}, span={self.span}, "
            f"appended={self.num_appended})"
        )


class EvictableLayer(DynamicLayer):
    """A full-attention ``DynamicLayer`` that an evicting press (kvpress's SnapKV, Expected
    Attention, ...) may shorten to fewer rows than the tokens it has seen.

    transformers takes the cache positions of new tokens from layer 0 and builds the causal mask of
    the full-attention layers in those positions. On a hybrid model layer 0 is a sliding-window
    layer that counts every token seen, so after an eviction the positions run past the kept rows
    and a plain ``DynamicLayer`` would let every new token see every later one (a batched
    continuation or question reads its own future). This layer puts its rows just before the new
    tokens' positions (mask offset ``cache_position[0] - rows``; 0 when they agree, as on a model
    without sliding layers): the kept rows are visible to every new token and the new tokens are
    causal among themselves.
    """

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        kv_length, _ = super().get_mask_sizes(cache_position)
        offset = int(cache_position[0]) - self.get_seq_length() if cache_position.numel() else 0
        return kv_length, max(offset, 0)


def make_evictable(cache: Cache, model=None) -> Cache:
    """Make every plain full-attention layer of ``cache`` an :class:`EvictableLayer`, in place, and
    return it, so that a cache the caller hands to a prefill gets :func:`new_cache`'s causal mask
    after an eviction. The layers it holds keep their rows (the class only adds the mask offset).
    A cache made without a config (``DynamicCache()``, as kvpress's pipeline makes it) that holds
    no layer yet takes ``model``'s layout, as :func:`new_cache` makes it: otherwise each of its
    layers would be created full on the first update, a hybrid model's sliding layers included,
    and the mask of its global layers would be sized by its first, never-evicted layer.
    Sliding-window and compact layers are left as they are."""
    if model is not None and not cache.layers and getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
        cache.layers, cache.layer_class_to_replicate = new_cache(model).layers, None
    for layer in cache.layers:
        if type(layer) is DynamicLayer:
            layer.__class__ = EvictableLayer
    if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
        cache.layer_class_to_replicate = EvictableLayer
    return cache


def new_cache(model) -> Cache:
    """An empty ``DynamicCache`` for ``model`` whose full-attention layers are
    :class:`EvictableLayer` (sliding-window layers as transformers makes them): the cache every
    route prefills a context into, with or without a press."""
    from transformers import DynamicCache

    return make_evictable(DynamicCache(config=model.config))


def cache_nbytes(cache: Cache, layers=None) -> int:
    """Bytes really held by any transformers cache: packed entries of compact layers, keys and
    values of ordinary layers (kvpress's masked caches therefore count at full size); ``layers``:
    only those layer indices (e.g. the compacted, global layers of a model with sliding-window
    layers), default every layer (the sliding windows included)."""
    total = 0
    chosen = None if layers is None else set(layers)
    for i, layer in enumerate(cache.layers):
        if chosen is not None and i not in chosen:
            continue
        if isinstance(layer, CompactLayer):
            total += layer.nbytes()
        elif layer.is_initialized and layer.keys is not None:
            total += layer.keys.nbytes + layer.values.nbytes
    return total


# What a layer's update *replaces* (never mutates in place): DynamicLayer's keys / values, a
# sliding-window layer's cumulative_length, a CompactLayer's ordinary rows. Holding references to
# them undoes any number of appended tokens, a batch expansion and a sliding window's eviction.
_LAYER_STATE = ("keys", "values", "cumulative_length", "_new_k", "_new_v")


def cache_snapshot(cache: Cache) -> list[dict]:
    """References (no copies) to each layer's replaceable state, for :func:`restore_cache`."""
    return [{a: layer.__dict__[a] for a in _LAYER_STATE if a in layer.__dict__} for layer in cache.layers]


def restore_cache(cache: Cache, snapshot: list[dict]) -> None:
    """Put ``cache`` back in the state :func:`cache_snapshot` recorded (e.g. after a question)."""
    for layer, state in zip(cache.layers, snapshot):
        layer.__dict__.update(state)


class CacheFileError(ValueError):
    """A saved compact cache that is refused, or a save target that cannot be written.

    The message names the file and what is wrong with it (the tensor, header field, metadata field
    or layer); ``path`` holds the file. A ``ValueError``, so callers that catch bad input as
    ``ValueError`` catch it too.
    """

    def __init__(self, path: str | Path, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = Path(path)
        self.problem = problem


@dataclass
class CacheMetadata:
    """What a saved compact cache records about how it was built (checked field by field at load)."""

    model_id: str
    config_hash: str
    method: str
    ratio: float
    original_length: int  # context tokens: the verbatim prefix rows plus the compacted document (span)
    package_version: str
    extra: dict | None = None
    weights_fingerprint: str | None = None  # models.weights_fingerprint; None: the load refuses unless told


# ---------------------------------------------------------------------------------- the file format
# A saved cache is one safetensors file. Tensors: per compacted layer i ``i.ck``, ``i.cv``, ``i.beta``,
# ``i.lengths``, ``i.fixed_k``, ``i.fixed_v``; per ordinary layer ``i.k``, ``i.v``. Header fields
# (strings): ``format`` (the version below), ``metadata`` (JSON of CacheMetadata), ``layers`` (JSON
# list, one entry per model layer) and ``digests`` (JSON: a SHA-256 per tensor, over its name, dtype,
# shape and bytes, and per header field). Format 1 (no digests) is refused.
_FORMAT_VERSION = 2
_HEADER_FIELDS = ("format", "metadata", "layers", "digests")
_DIGESTED_HEADER_FIELDS = ("format", "metadata", "layers")
_LAYER_FIELDS = {"compact": ("kind", "span"), "dynamic": ("kind",), "sliding": ("kind", "window", "cumulative_length")}
_LAYER_TENSORS = {"compact": ("ck", "cv", "beta", "lengths", "fixed_k", "fixed_v"), "dynamic": ("k", "v"),
                  "sliding": ("k", "v")}
_TENSOR_NAMES = {"ck": "C_k", "cv": "C_v", "beta": "beta", "lengths": "lengths", "fixed_k": "fixed_k (verbatim prefix keys)",
                 "fixed_v": "fixed_v (verbatim prefix values)", "k": "keys", "v": "values"}
_HEX64 = frozenset("0123456789abcdef")


def _tensor_digest(name: str, tensor: torch.Tensor) -> str:
    """SHA-256 (hex) over a tensor's name, dtype, shape and raw bytes."""
    digest = hashlib.sha256(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode("utf-8"))
    digest.update(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def _field_digest(name: str, value: str) -> str:
    return hashlib.sha256(json.dumps([name, value]).encode("utf-8")).hexdigest()


def _digests(tensors: dict[str, torch.Tensor], header: dict[str, str]) -> dict[str, dict[str, str]]:
    return {
        "tensors": {name: _tensor_digest(name, t) for name, t in sorted(tensors.items())},
        "header": {name: _field_digest(name, header[name]) for name in _DIGESTED_HEADER_FIELDS},
    }


def _describe_tensor(name: str) -> str:
    layer, _, field = name.partition(".")
    return f"tensor {name!r} (layer {layer}'s {_TENSOR_NAMES.get(field, field)})"


def _is_hex64(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX64


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _json_field(path: Path, header: dict[str, str], field: str, kind: type) -> Any:
    """The header field ``field`` parsed as strict JSON (no NaN / Infinity) of type ``kind``."""
    try:
        value = json.loads(header[field], parse_constant=_refuse_constant)
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        raise CacheFileError(path, f"header field {field!r} is not valid JSON ({e})") from None
    if not isinstance(value, kind):
        raise CacheFileError(path, f"header field {field!r} must be a JSON {kind.__name__}, got {type(value).__name__}")
    return value


def check_metadata(fields: Any, path: str | Path = "<metadata>") -> CacheMetadata:
    """Validate a saved cache's metadata (a dict, as stored) and return it as :class:`CacheMetadata`.

    Every field is checked for presence, type and range; an unknown field is refused (a newer
    version of the package bumps the file format instead). Raises :class:`CacheFileError` naming
    ``path`` and the field.
    """
    from arckv_press.compaction.checks import check_ratio
    from arckv_press.methods import COMPACTION_METHODS

    if not isinstance(fields, dict):
        raise CacheFileError(path, f"metadata must be a JSON object, got {type(fields).__name__}")
    known = {f.name: f for f in dataclasses.fields(CacheMetadata)}
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise CacheFileError(
            path, f"unknown metadata field(s) {unknown}: format {_FORMAT_VERSION} files carry only {sorted(known)} "
            "(the file was edited, or written by another version of arckv-press)"
        )
    missing = [n for n, f in known.items() if n not in fields and f.default is dataclasses.MISSING]
    if missing:
        raise CacheFileError(path, f"metadata field(s) {missing} missing")

    def bad(field: str, want: str) -> CacheFileError:
        return CacheFileError(path, f"metadata field {field!r} must be {want}, got {fields[field]!r}")

    for name in ("model_id", "package_version"):
        if not isinstance(fields[name], str) or not fields[name]:
            raise bad(name, "a non-empty string")
    if not _is_hex64(fields["config_hash"]):
        raise bad("config_hash", "64 lowercase hex digits (models.config_hash)")
    if fields["method"] not in COMPACTION_METHODS:
        raise bad("method", f"one of the compaction methods {list(COMPACTION_METHODS)}")
    try:
        check_ratio(fields["ratio"])
    except (TypeError, ValueError) as e:
        raise CacheFileError(path, f"metadata field 'ratio': {e}") from None
    if not _is_int(fields["original_length"]) or fields["original_length"] < 1:
        raise bad("original_length", "an int >= 1")
    extra = fields.get("extra")
    if extra is not None and not isinstance(extra, dict):
        raise bad("extra", "a JSON object or null")
    if extra is not None and "prefix_length" in extra:
        prefix = extra["prefix_length"]
        if not _is_int(prefix) or not 0 <= prefix < fields["original_length"]:
            raise CacheFileError(
                path, f"metadata field 'extra.prefix_length' must be an int in [0, original_length "
                f"{fields['original_length']}), got {prefix!r}"
            )
    fingerprint = fields.get("weights_fingerprint")
    if fingerprint is not None and not _is_hex64(fingerprint):
        raise bad("weights_fingerprint", "64 lowercase hex digits (models.weights_fingerprint) or null")
    return CacheMetadata(**fields)


# ------------------------------------------------------------------------------------------- saving
def check_save_target(path: str | Path) -> Path:
    """Refuse a save target that :meth:`CompactCache.save` would not write: a missing folder, a
    symbolic link, a device node, a FIFO or a folder (only a regular file is ever replaced). Cheap:
    call it before a long compaction. Returns ``path`` as a ``Path``; raises :class:`CacheFileError`."""
    path = Path(path)
    parent = path.parent
    if not parent.is_dir():
        raise CacheFileError(path, f"cannot save here: the folder {str(parent)!r} does not exist or is not a folder")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return path
    except OSError as e:
        raise CacheFileError(path, f"cannot save here: {e.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise CacheFileError(
            path, f"cannot save over a symbolic link (to {os.readlink(path)!r}): saving replaces a regular file and "
            "never a link; save to the link's target or to another name"
        )
    if not stat.S_ISREG(st.st_mode):
        kind = ("folder" if stat.S_ISDIR(st.st_mode) else "device node" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                else "FIFO" if stat.S_ISFIFO(st.st_mode) else "socket" if stat.S_ISSOCK(st.st_mode) else "special file")
        raise CacheFileError(path, f"cannot save over a {kind}: only a regular file is replaced")
    return path


def _partial_prefix(path: Path) -> str:
    return f".{path.name}.tmp."


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid() or os.name != "posix":  # ours (another thread's save), or no safe probe
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. EPERM: the process exists, owned by someone else
        return True
    return True


def _remove_stale_partials(path: Path) -> None:
    """Delete ``.<name>.tmp.<pid>.<hex>`` partials of ``path`` left by a save whose process is gone."""
    prefix = _partial_prefix(path)
    with contextlib.suppress(OSError), os.scandir(path.parent) as entries:  # best effort: never blocks a save
        for entry in entries:
            if not entry.name.startswith(prefix):
                continue
            pid = entry.name[len(prefix):].split(".", 1)[0]
            if pid.isdigit() and not _pid_alive(int(pid)) and not entry.is_dir(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to a partial beside ``path`` and rename it over ``path`` (a kill leaves either
    the old file or the new one). A new file gets mode 0666 minus the umask; a file replaced keeps
    its permission bits."""
    _remove_stale_partials(path)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = None
    tmp = path.with_name(f"{_partial_prefix(path)}{os.getpid()}.{secrets.token_hex(4)}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(tmp, flags, 0o666)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
                if mode is not None:
                    os.chmod(f.fileno() if os.chmod in os.supports_fd else tmp, mode)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    except OSError as e:
        raise CacheFileError(path, f"cannot save: {e.strerror or e}") from e
    if os.name == "posix":  # make the rename durable (best effort)
        with contextlib.suppress(OSError):
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)


# ------------------------------------------------------------------------------------------ loading
def _read_file(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Header fields and every tensor (on the CPU) of a safetensors file; any failure to parse it is a
    :class:`CacheFileError`."""
    from safetensors import safe_open

    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"no compact cache at {path}") from None
    except OSError as e:
        raise CacheFileError(path, f"cannot read it: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise CacheFileError(path, "not a regular file, so not a saved compact cache")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # SafetensorError, OSError, an unsupported dtype, ...: all mean a bad file
        raise CacheFileError(path, f"not a readable safetensors file ({type(e).__name__}: {e})") from e
    return header, tensors


def _check_format(path: Path, header: dict[str, str]) -> None:
    if "metadata" not in header or "layers" not in header:
        raise CacheFileError(path, "not an arckv-press compact cache (its header has no 'metadata' and 'layers')")
    version = header.get("format")
    if version is None:
        raise CacheFileError(path, "header field 'format' (the file format version) is missing")
    if not (version.isascii() and version.isdigit()):
        raise CacheFileError(path, f"header field 'format' must be a version number, got {version!r}")
    version = int(version)
    if version > _FORMAT_VERSION:
        extra = sorted(set(header) - set(_HEADER_FIELDS))
        with contextlib.suppress(ValueError, TypeError):
            meta = json.loads(header["metadata"])
            if isinstance(meta, dict):
                known = {f.name for f in dataclasses.fields(CacheMetadata)}
                extra += [f"metadata.{n}" for n in sorted(set(meta) - known)]
        fields = f", with field(s) {extra} this version does not know" if extra else ""
        raise CacheFileError(
            path, f"written by a newer version of arckv-press (file format {version}{fields}); this version reads "
            f"format {_FORMAT_VERSION}: upgrade arckv-press to load it"
        )
    if version < _FORMAT_VERSION:
        why = " (before saved caches carried integrity digests)" if version == 1 else ""
        raise CacheFileError(
            path, f"file format {version}{why} is no longer read (this version reads format {_FORMAT_VERSION}): "
            "compact the document again"
        )
    unknown = sorted(set(header) - set(_HEADER_FIELDS))
    if unknown:
        raise CacheFileError(path, f"unknown header field(s) {unknown} for file format {_FORMAT_VERSION}")
    if "digests" not in header:
        raise CacheFileError(path, "header field 'digests' is missing: the file cannot be verified")


def _check_digests(path: Path, header: dict[str, str], tensors: dict[str, torch.Tensor]) -> None:
    stored = _json_field(path, header, "digests", dict)
    if set(stored) != {"tensors", "header"} or not all(isinstance(stored[k], dict) for k in stored):
        raise CacheFileError(path, "header field 'digests' must hold the objects 'tensors' and 'header'")
    if set(stored["header"]) != set(_DIGESTED_HEADER_FIELDS):
        raise CacheFileError(path, f"header field 'digests' must hold a digest of each of {list(_DIGESTED_HEADER_FIELDS)}")
    missing, unexpected = sorted(set(stored["tensors"]) - set(tensors)), sorted(set(tensors) - set(stored["tensors"]))
    if missing or unexpected:
        raise CacheFileError(
            path, f"the tensors differ from those recorded at save: missing {missing}, not recorded {unexpected}"
        )
    for name in _DIGESTED_HEADER_FIELDS:
        if stored["header"][name] != _field_digest(name, header[name]):
            raise CacheFileError(
                path, f"header field {name!r} differs from the digest recorded at save: the file was changed or "
                "corrupted after it was saved"
            )
    for name in sorted(tensors):
        if stored["tensors"][name] != _tensor_digest(name, tensors[name]):
            raise CacheFileError(
                path, f"{_describe_tensor(name)} differs from the digest recorded at save (bytes, dtype or shape): "
                "the file was changed or corrupted after it was saved"
            )


def _check_model(path: Path, meta: CacheMetadata, model, check_weights: bool, allow_missing_fingerprint: bool) -> None:
    from arckv_press.models import config_hash, model_id, weights_fingerprint

    want_id, want_hash = model_id(model), config_hash(model.config)
    if meta.config_hash != want_hash:
        raise CacheFileError(
            path, f"was built for model {meta.model_id!r} (config hash {meta.config_hash[:12]}), not for {want_id!r} "
            f"(config hash {want_hash[:12]}); rebuild it with this model"
        )
    if not check_weights:
        return
    if meta.weights_fingerprint is None:
        if allow_missing_fingerprint:
            return
        raise CacheFileError(
            path, "records no weights fingerprint (metadata field 'weights_fingerprint' is null), so it cannot be "
            f"checked against the weights of {want_id!r}; pass allow_missing_fingerprint=True to load it anyway"
        )
    have = weights_fingerprint(model)
    if have != meta.weights_fingerprint:
        raise CacheFileError(
            path, f"was built for model {meta.model_id!r} with other weights (fingerprint "
            f"{meta.weights_fingerprint[:12]}) than {want_id!r} has ({have[:12]}), though the architecture matches; "
            "rebuild it with this model"
        )


def _check_tensor(path: Path, t: dict[str, torch.Tensor], i: int, field: str, ndim: int, dtype=None,
                  finite: bool = True) -> torch.Tensor:
    """``t[field]`` of layer ``i`` with ``ndim`` dims, of ``dtype`` (any floating dtype if None) and,
    with ``finite``, no NaN or inf (CompactLayer checks its packed tensors itself, naming the head)."""
    from arckv_press.compaction.checks import all_finite

    x, what = t[field], f"layer {i}: {_TENSOR_NAMES[field]}"
    if x.ndim != ndim:
        raise CacheFileError(path, f"{what} must have {ndim} dims, got shape {tuple(x.shape)}")
    if dtype is not None and x.dtype != dtype:
        raise CacheFileError(path, f"{what} must be {dtype}, got {x.dtype}")
    if dtype is None and not x.is_floating_point():
        raise CacheFileError(path, f"{what} must be a floating tensor, got {x.dtype}")
    if finite and x.is_floating_point() and not all_finite(x):
        raise CacheFileError(path, f"{what} contains NaN or inf")
    return x


def _build_layers(path: Path, kinds: list, tensors: dict[str, torch.Tensor], meta: CacheMetadata, model) -> list:
    """Validate the layer list against the model, the tensors against the layer list and against each
    other (shapes, dtypes, finiteness, span, lengths, original length), and build the layers."""
    from arckv_press.models import describe_attention_layout

    layout = describe_attention_layout(model)
    if len(kinds) != layout.num_layers:
        raise CacheFileError(path, f"header field 'layers' lists {len(kinds)} layers; the model has {layout.num_layers}")
    expected = set()
    for i, kind in enumerate(kinds):
        name = kind.get("kind") if isinstance(kind, dict) else None
        if not isinstance(name, str) or name not in _LAYER_FIELDS:
            raise CacheFileError(path, f"layers[{i}]: kind must be one of {list(_LAYER_FIELDS)}, got {kind!r}")
        if set(kind) != set(_LAYER_FIELDS[name]):
            raise CacheFileError(path, f"layers[{i}]: a {name!r} layer has the fields {list(_LAYER_FIELDS[name])}, got {sorted(kind)}")
        for field in _LAYER_FIELDS[name][1:]:
            if not _is_int(kind[field]) or kind[field] < 1:
                raise CacheFileError(path, f"layers[{i}].{field} must be an int >= 1, got {kind[field]!r}")
        sliding = layout.layer_types[i] == "sliding_attention"
        if sliding != (name == "sliding"):
            raise CacheFileError(
                path, f"layers[{i}] is a {name!r} layer but the model's layer {i} is {layout.layer_types[i]}"
            )
        if sliding and kind["window"] != layout.sliding_window:
            raise CacheFileError(path, f"layers[{i}].window is {kind['window']}; the model's sliding window is {layout.sliding_window}")
        expected |= {f"{i}.{field}" for field in _LAYER_TENSORS[name]}
    if set(tensors) != expected:
        raise CacheFileError(
            path, f"the tensors do not match the layer list: missing {sorted(expected - set(tensors))}, "
            f"unexpected {sorted(set(tensors) - expected)}"
        )
    prefix = (meta.extra or {}).get("prefix_length")
    H, D, L = layout.num_kv_heads, layout.head_dim, meta.original_length
    device = next(model.parameters()).device
    layers: list[CacheLayerMixin] = []
    for i, kind in enumerate(kinds):
        t = {field: tensors[f"{i}.{field}"] for field in _LAYER_TENSORS[kind["kind"]]}
        if kind["kind"] == "compact":
            lengths = _check_tensor(path, t, i, "lengths", 1, torch.int64)
            ck, cv = _check_tensor(path, t, i, "ck", 2, finite=False), _check_tensor(path, t, i, "cv", 2, finite=False)
            _check_tensor(path, t, i, "beta", 1, torch.float32, finite=False)
            fk, fv = _check_tensor(path, t, i, "fixed_k", 4), _check_tensor(path, t, i, "fixed_v", 4)
            if lengths.shape != (H,):
                raise CacheFileError(path, f"layer {i}: lengths has {lengths.numel()} entries; the model has {H} KV heads")
            if ck.shape[1] != D or cv.dtype != ck.dtype or fk.dtype != ck.dtype or fv.dtype != ck.dtype:
                raise CacheFileError(
                    path, f"layer {i}: C_k / C_v / fixed rows must share one dtype and head_dim {D}, got C_k "
                    f"{tuple(ck.shape)} {ck.dtype}, C_v {cv.dtype}, fixed_k {fk.dtype}, fixed_v {fv.dtype}"
                )
            if fk.shape != fv.shape or fk.shape[:2] != (1, H) or fk.shape[3] != D:
                raise CacheFileError(
                    path, f"layer {i}: fixed_k / fixed_v must both be [1, {H}, F, {D}], got {tuple(fk.shape)} and {tuple(fv.shape)}"
                )
            n_fixed, span = fk.shape[2], kind["span"]
            if span + n_fixed != L:
                raise CacheFileError(
                    path, f"layers[{i}].span is {span}; with {n_fixed} verbatim prefix rows it must be original_length "
                    f"- {n_fixed} = {L - n_fixed}"
                )
            if prefix is not None and n_fixed != prefix:
                raise CacheFileError(path, f"layer {i} holds {n_fixed} verbatim prefix rows; metadata extra.prefix_length is {prefix}")
            if meta.ratio == 1.0 and bool((lengths != span).any()):
                raise CacheFileError(path, f"layer {i}: lengths {lengths.tolist()} at ratio 1.0 must all be the span {span}")
            try:
                layers.append(CompactLayer(ck.to(device), t["beta"].to(device), cv.to(device), lengths.to(device), span,
                                           i, fk.to(device), fv.to(device)))
            except ValueError as e:
                raise CacheFileError(path, str(e)) from None
            continue
        k, v = _check_tensor(path, t, i, "k", 4), _check_tensor(path, t, i, "v", 4)
        rows = L if kind["kind"] == "dynamic" else min(L, kind["window"] - 1)
        if k.shape != v.shape or k.dtype != v.dtype or k.shape != (1, H, rows, D):
            raise CacheFileError(
                path, f"layer {i}: keys / values must both be [1, {H}, {rows}, {D}] of one dtype, got {tuple(k.shape)} "
                f"{k.dtype} and {tuple(v.shape)} {v.dtype}"
            )
        if kind["kind"] == "sliding" and kind["cumulative_length"] != L:
            raise CacheFileError(path, f"layers[{i}].cumulative_length is {kind['cumulative_length']}; original_length is {L}")
        layer = DynamicSlidingWindowLayer(kind["window"]) if kind["kind"] == "sliding" else DynamicLayer()
        layer.update(k.to(device), v.to(device))
        if kind["kind"] == "sliding":
            layer.cumulative_length = kind["cumulative_length"]
        layers.append(layer)
    return layers


class CompactCache(Cache):
    """A transformers ``Cache`` whose compacted layers are :class:`CompactLayer`.

    Layers that are not compacted (e.g. Gemma-3 sliding-window layers) stay ordinary
    ``DynamicLayer``/``DynamicSlidingWindowLayer``. Use it as ``past_key_values`` with a model whose
    attention was switched with :func:`arckv_press.attention.enable_compact_attention` (``compact``
    and :meth:`load` do that).
    """

    def __init__(self, layers: list[CacheLayerMixin], metadata: CacheMetadata | None = None):
        super().__init__(layers=layers)
        self.metadata = metadata
        # layer -> [H, t_max] document positions of each head's anchors, -1 past its count; set by
        # the compaction, not saved (a loaded cache has none)
        self.kept_positions: dict[int, torch.Tensor] = {}

    # ----------------------------------------------------------------- accounting
    @property
    def compact_layers(self) -> list[CompactLayer]:
        return [layer for layer in self.layers if isinstance(layer, CompactLayer)]

    def compact_nbytes(self) -> int:
        """Bytes held for compacted entries over all layers."""
        return sum(layer.compact_nbytes() for layer in self.compact_layers)

    def nbytes(self) -> int:
        """All bytes held (compacted entries, ordinary rows and uncompacted layers)."""
        return cache_nbytes(self)

    def realised_ratio(self) -> float:
        """Kept entries over original entries, over compacted layers and heads."""
        layers = self.compact_layers
        kept = sum(int(layer.lengths.sum()) for layer in layers)
        orig = sum(layer.span * layer.num_heads for layer in layers)
        return kept / orig if orig else 1.0

    # ---------------------------------------------------------------- save / load
    def save(self, path: str | Path) -> None:
        """Save to one safetensors file (tensors, JSON metadata and a SHA-256 digest of each tensor
        and header field in its header).

        Only a regular file is replaced (a symbolic link, device node or folder is refused: see
        :func:`check_save_target`), atomically: the file is written beside the target as
        ``.<name>.tmp.<pid>.<hex>`` and renamed over it; partials left by a killed save are removed
        on the next save to the same target. A new file gets mode 0666 minus the umask, a replaced
        file keeps its mode.
        """
        from safetensors.torch import save

        path = check_save_target(path)
        if self.metadata is None:
            raise ValueError("this CompactCache has no metadata (model id, config hash); build it with compact()")
        meta = check_metadata(dict(self.metadata.__dict__), "this CompactCache's metadata")
        tensors: dict[str, torch.Tensor] = {}
        kinds = []
        for i, layer in enumerate(self.layers):
            if isinstance(layer, CompactLayer):
                if layer.batch_size != 1:
                    raise ValueError("only a batch-size-1 compact cache can be saved")
                kinds.append({"kind": "compact", "span": layer.span})
                tensors[f"{i}.ck"], tensors[f"{i}.cv"] = layer.ck, layer.cv
                tensors[f"{i}.beta"], tensors[f"{i}.lengths"] = layer.beta, layer.lengths
                tensors[f"{i}.fixed_k"], tensors[f"{i}.fixed_v"] = layer._new_k, layer._new_v
            else:
                if getattr(layer, "is_sliding", False):
                    kinds.append({"kind": "sliding", "window": layer.sliding_window,
                                  "cumulative_length": layer.cumulative_length})
                else:
                    kinds.append({"kind": "dynamic"})
                tensors[f"{i}.k"], tensors[f"{i}.v"] = layer.keys, layer.values
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        try:
            metadata = json.dumps(meta.__dict__, allow_nan=False)
        except (TypeError, ValueError) as e:  # e.g. a tensor or NaN inside extra
            raise CacheFileError(path, f"cannot save: the metadata is not JSON ({e})") from None
        header = {"format": str(_FORMAT_VERSION), "metadata": metadata, "layers": json.dumps(kinds)}
        header["digests"] = json.dumps(_digests(tensors, header))
        _write_atomic(path, save(tensors, metadata=header))

    @classmethod
    def load(
        cls, path: str | Path, model, check_weights: bool = True, allow_missing_fingerprint: bool = False
    ) -> "CompactCache":
        """Load a cache saved by :meth:`save` for ``model`` and switch ``model`` to the compact
        attention (:func:`arckv_press.attention.enable_compact_attention`), so the cache can be used
        as it is.

        Refused, with a :class:`CacheFileError` naming the file and what is wrong: a file that is
        not a regular safetensors file; another file format version (a newer one says so); a tensor
        or header field that differs from the SHA-256 digest recorded at save; metadata with a
        missing, unknown or out-of-range field; a layer list or tensors that disagree with the model
        (layer count and kinds, KV heads, head dim) or with each other (span, lengths, original
        length, prefix rows); NaN or inf in any stored tensor; a cache built for another
        architecture (:func:`~arckv_press.models.config_hash`) or for other weights of the same
        architecture (:func:`~arckv_press.models.weights_fingerprint`; ``check_weights=False`` skips
        that check, for a deliberately converted model). A file recording no weights fingerprint is
        refused unless ``allow_missing_fingerprint=True``.
        """
        from arckv_press.attention import enable_compact_attention

        path = Path(path)
        header, tensors = _read_file(path)
        _check_format(path, header)
        _check_digests(path, header, tensors)
        meta = check_metadata(_json_field(path, header, "metadata", dict), path)
        _check_model(path, meta, model, check_weights, allow_missing_fingerprint)
        layers = _build_layers(path, _json_field(path, header, "layers", list), tensors, meta, model)
        enable_compact_attention(model)
        return cls(layers, meta)
