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

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer

__all__ = ["CompactLayer", "CompactCache", "cache_nbytes", "cache_snapshot", "pack_heads", "restore_cache", "unpack_heads"]

_FORMAT_VERSION = 1


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


def cache_nbytes(cache: Cache) -> int:
    """Bytes really held by any transformers cache: packed entries of compact layers, keys and
    values of ordinary layers (kvpress's masked caches therefore count at full size)."""
    total = 0
    for layer in cache.layers:
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


@dataclass
class CacheMetadata:
    """What a saved compact cache records about how it was built."""

    model_id: str
    config_hash: str
    method: str
    ratio: float
    original_length: int
    package_version: str
    extra: dict | None = None
    weights_fingerprint: str | None = None  # models.weights_fingerprint; None in files saved before it


class CompactCache(Cache):
    """A transformers ``Cache`` whose compacted layers are :class:`CompactLayer`.

    Layers that are not compacted (e.g. Gemma-3 sliding-window layers) stay ordinary
    ``DynamicLayer``/``DynamicSlidingWindowLayer``. Use it as ``past_key_values`` with a model whose
    attention was switched with :func:`arckv_press.attention.enable_compact_attention`.
    """

    def __init__(self, layers: list[CacheLayerMixin], metadata: CacheMetadata | None = None):
        super().__init__(layers=layers)
        self.metadata = metadata

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
        """Save to one safetensors file (tensors + JSON metadata in its header)."""
        from safetensors.torch import save_file

        if self.metadata is None:
            raise ValueError("this CompactCache has no metadata (model id, config hash); build it with compact()")
        tensors: dict[str, torch.Tensor] = {}
        kinds = []
        for i, layer in enumerate(self.layers):
            if isinstance(layer, CompactLayer):
                if layer.batch_size != 1:
                    raise ValueError("only a batch-size-1 compact cache can be saved")
                kinds.append({"kind": "compact", "span": layer.span})
                tensors[f"{i}.ck"], tensors[f"{i}.cv"] = layer.ck.contiguous(), layer.cv.contiguous()
                tensors[f"{i}.beta"], tensors[f"{i}.lengths"] = layer.beta.contiguous(), layer.lengths.contiguous()
                tensors[f"{i}.fixed_k"] = layer._new_k.contiguous()
                tensors[f"{i}.fixed_v"] = layer._new_v.contiguous()
            else:
                kind = {"kind": "sliding", "window": layer.sliding_window} if getattr(layer, "is_sliding", False) else {
                    "kind": "dynamic"
                }
                if getattr(layer, "is_sliding", False):
                    kind["cumulative_length"] = layer.cumulative_length
                kinds.append(kind)
                tensors[f"{i}.k"], tensors[f"{i}.v"] = layer.keys.contiguous(), layer.values.contiguous()
        header = {
            "format": str(_FORMAT_VERSION),
            "metadata": json.dumps(self.metadata.__dict__),
            "layers": json.dumps(kinds),
        }
        save_file({k: v.detach().cpu() for k, v in tensors.items()}, str(path), metadata=header)

    @classmethod
    def load(cls, path: str | Path, model, check_weights: bool = True) -> "CompactCache":
        """Load a cache saved by :meth:`save` for ``model``; refuses a cache built for another model.

        Another architecture is refused by :func:`~arckv_press.models.config_hash`; another model of
        the same architecture (e.g. the base model of an instruct tune) by
        :func:`~arckv_press.models.weights_fingerprint` (``check_weights=False`` skips that check,
        for a deliberately converted model).
        """
        from safetensors import safe_open

        from arckv_press.models import config_hash, model_id, weights_fingerprint

        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"no compact cache at {path}")
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            if "metadata" not in header or "layers" not in header:
                raise ValueError(f"{path} is not an arckv-press compact cache (missing metadata)")
            meta = CacheMetadata(**json.loads(header["metadata"]))
            want_id, want_hash = model_id(model), config_hash(model.config)
            if meta.config_hash != want_hash:
                raise ValueError(
                    f"{path} was built for model {meta.model_id!r} (config hash {meta.config_hash[:12]}), "
                    f"not for {want_id!r} (config hash {want_hash[:12]}); rebuild it with this model"
                )
            if check_weights and meta.weights_fingerprint is not None:
                have = weights_fingerprint(model)
                if have is not None and have != meta.weights_fingerprint:
                    raise ValueError(
                        f"{path} was built for model {meta.model_id!r} with other weights (fingerprint "
                        f"{meta.weights_fingerprint}) than {want_id!r} has ({have}), though the architecture "
                        "matches; rebuild it with this model"
                    )
            device = next(model.parameters()).device
            layers: list[CacheLayerMixin] = []
            for i, kind in enumerate(json.loads(header["layers"])):
                t = {k.split(".", 1)[1]: f.get_tensor(k).to(device) for k in f.keys() if k.split(".", 1)[0] == str(i)}
                if kind["kind"] == "compact":
                    layers.append(
                        CompactLayer(
                            t["ck"], t["beta"], t["cv"], t["lengths"], kind["span"], i, t["fixed_k"], t["fixed_v"]
                        )
                    )
                else:
                    layer = (
                        DynamicSlidingWindowLayer(kind["window"]) if kind["kind"] == "sliding" else DynamicLayer()
                    )
                    layer.update(t["k"], t["v"])
                    if kind["kind"] == "sliding":
                        layer.cumulative_length = kind["cumulative_length"]
                    layers.append(layer)
        return cls(layers, meta)
