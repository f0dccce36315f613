"""Prefill and repeat-prefill with hooks: where the model is run and reference queries captured.

This is model plumbing; the math lives in :mod:`arckv_press.compaction`.

Framing (the same as kvpress's pipeline and KVzipPress, so a compacted context plugs into their
question loop): with a chat template the context is ``prefix + document`` where ``prefix`` is the
template up to the user message content (kept verbatim, never compacted) and questions follow as
``question + suffix`` (``suffix`` closes the user turn and opens the assistant turn). Without a chat
template ``prefix`` is the BOS token (if any) and ``suffix`` is a newline.

Reference queries (paper App. (reference_queries)): after the context prefill we append
``"\\n\\nRepeat the previous context verbatim." + suffix + document`` and teacher-force the copy,
reusing the context's cache, so only the repeat part is computed. Long documents are repeated in
chunks (KVzip-style: later chunks say "Repeat the part of the previous context exactly, starting
with" followed by the last tokens of the previous chunk). At the repeated-document positions only,
hooks on the attention modules capture the input of ``q_proj`` (``x``) and the post-RoPE query
(after ``q_norm`` where the model has one). The cache is restored to the context afterwards:
the keys and values compacted always come from the original prefill.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

__all__ = [
    "Framing",
    "framing_for",
    "CapturedQueries",
    "QueryCapture",
    "decoder_layers",
    "prefill",
    "repeat_prefill",
    "REPEAT_PROMPT",
    "REPEAT_CHUNK_PROMPT",
]

REPEAT_PROMPT = "\n\nRepeat the previous context verbatim."
REPEAT_CHUNK_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"


@dataclass
class Framing:
    """Token ids around a document: ``prefix`` before it, ``suffix`` opening the answer turn."""

    prefix_ids: list[int]
    suffix_ids: list[int]


def framing_for(tokenizer, use_chat_template: bool | None = None) -> Framing:
    """The framing kvpress's pipeline uses for ``tokenizer`` (chat template when it has one)."""
    if use_chat_template is None:
        use_chat_template = getattr(tokenizer, "chat_template", None) is not None
    if not use_chat_template:
        bos = getattr(tokenizer, "bos_token", None) or ""
        return Framing(tokenizer.encode(bos, add_special_tokens=False) if bos else [], tokenizer.encode("\n", add_special_tokens=False))
    dummy = "dummy context"
    separator = "\n" + "#" * len(dummy)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": dummy + separator}], add_generation_prompt=True, tokenize=False
    )
    context, suffix = text.split(separator)
    prefix = context.split(dummy)[0]
    return Framing(
        tokenizer.encode(prefix, add_special_tokens=False), tokenizer.encode(suffix, add_special_tokens=False)
    )


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layers of a causal LM (handles multimodal wrappers such as Gemma-3)."""
    inner = model.model
    inner = getattr(inner, "language_model", inner)
    return inner.layers


def _apply_rope(module: torch.nn.Module, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply the model's own ``apply_rotary_pos_emb`` (looked up in the module's modeling file)."""
    fn = getattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb", None)
    if fn is None:
        raise ValueError(f"{type(module).__name__} has no apply_rotary_pos_emb: not a RoPE model arckv-press supports")
    q_rot, _ = fn(q, q, cos, sin)
    return q_rot


@dataclass
class CapturedQueries:
    """Per layer: ``x`` rows ``[n_pos, d_x]`` and post-RoPE queries ``[H_q, n_pos, D]`` (batch 1)."""

    x: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    q: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat(self.x[layer_idx], dim=0), torch.cat(self.q[layer_idx], dim=1)


class QueryCapture:
    """Forward pre-hooks on attention modules capturing ``x`` and post-RoPE ``q`` at chosen rows.

    Use as a context manager; hooks are removed on exit. ``rows`` (set before each forward) selects
    which sequence positions of the next forward are kept (``None`` keeps none).
    """

    def __init__(self, model, layers: list[int], store: CapturedQueries | None = None):
        self.model = model
        self.layers = layers
        self.store = store if store is not None else CapturedQueries()
        self.rows: torch.Tensor | None = None
        self._handles: list = []

    def __enter__(self) -> "QueryCapture":
        blocks = decoder_layers(self.model)
        for idx in self.layers:
            attn = blocks[idx].self_attn
            self._handles.append(attn.register_forward_pre_hook(self._hook(idx), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, layer_idx: int):
        def hook(module, args, kwargs):
            if self.rows is None or self.rows.numel() == 0:
                return None
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cos, sin = kwargs["position_embeddings"]
            if hidden.shape[0] != 1:
                raise ValueError("reference-query capture supports batch size 1 only")
            rows = self.rows.to(hidden.device)
            x = hidden[:, rows]  # [1, n, d_x]
            q = module.q_proj(x).view(1, rows.numel(), -1, module.head_dim).transpose(1, 2)
            if hasattr(module, "q_norm"):
                q = module.q_norm(q)
            q = _apply_rope(module, q, cos[:, rows], sin[:, rows])
            self.store.x.setdefault(layer_idx, []).append(x[0].detach())
            self.store.q.setdefault(layer_idx, []).append(q[0].detach())
            return None

        return hook


def prefill(model, input_ids: torch.Tensor, cache=None, capture: QueryCapture | None = None, rows=None):
    """Run the decoder over ``input_ids`` (no LM head), filling ``cache``; optional capture rows."""
    cache = DynamicCache(config=model.config) if cache is None else cache
    if capture is not None:
        capture.rows = rows
    inner = model.model
    inner(input_ids=input_ids.to(model.device), past_key_values=cache, use_cache=True)
    if capture is not None:
        capture.rows = None
    return cache


def repeat_chunks(tokenizer, doc_ids: torch.Tensor, suffix_ids: list[int], chunk_size: int, overlap: int = 8):
    """Yield ``(chunk_start, chunk_len, repeat_input_ids)`` for the chunked repeat-prefill."""
    T = doc_ids.shape[-1]
    suffix = torch.tensor([suffix_ids], dtype=torch.long)
    first = torch.tensor([tokenizer.encode(REPEAT_PROMPT, add_special_tokens=False)], dtype=torch.long)
    later = torch.tensor([tokenizer.encode(REPEAT_CHUNK_PROMPT, add_special_tokens=False)], dtype=torch.long)
    for start in range(0, T, chunk_size):
        chunk = doc_ids[:, start : start + chunk_size]
        if start == 0:
            head = first
        else:
            head = torch.cat([later, doc_ids[:, max(0, start - overlap) : start]], dim=1)
        yield start, chunk.shape[-1], torch.cat([head, suffix, chunk], dim=1)


def repeat_prefill(
    model,
    tokenizer,
    cache,
    doc_ids: torch.Tensor,
    suffix_ids: list[int],
    layers: list[int],
    positions: torch.Tensor,
    chunk_size: int = 2048,
    progress=None,
) -> CapturedQueries:
    """Teacher-force the document after a repeat instruction and capture queries at ``positions``.

    Args:
        cache: the context's cache (``prefix + document``); it is restored afterwards.
        doc_ids: ``[1, T]`` document tokens.
        positions: sorted document positions (0..T-1) whose repeated copy is captured.
        chunk_size: document tokens repeated per forward (bounds memory for long documents).

    Returns the captured queries, rows in the order of ``positions``.
    """
    if doc_ids.ndim != 2 or doc_ids.shape[0] != 1:
        raise ValueError(f"repeat-prefill supports batch size 1 only, got doc_ids of shape {tuple(doc_ids.shape)}")
    positions = _check_positions(positions, doc_ids.shape[1])
    chunks = list(repeat_chunks(tokenizer, doc_ids.cpu(), suffix_ids, chunk_size))
    _warn_past_window(model, cache.get_seq_length() + max(ids.shape[-1] for _, _, ids in chunks), chunk_size)
    snapshot = _snapshot(cache)
    store = CapturedQueries()
    try:
        with QueryCapture(model, layers, store) as cap:
            for start, n, ids in chunks:
                sel = positions[(positions >= start) & (positions < start + n)]
                if sel.numel():
                    offset = ids.shape[-1] - n  # repeated chunk sits at the end of the input
                    prefill(model, ids, cache, cap, rows=sel - start + offset)
                    _restore(cache, snapshot)
                if progress is not None:
                    progress.update(n)
    finally:
        _restore(cache, snapshot)
    return store


def _warn_past_window(model, furthest: int, chunk_size: int) -> None:
    """Warn when the repeat-prefill runs past the model's trained positions (``max_position_embeddings``).

    Each repeated chunk sits after the whole context, so the furthest position is about
    ``context + prompt + chunk``: for a context close to the window, RoPE extrapolates and the
    reference queries (and so the anchors) are less reliable. A smaller ``repeat_chunk`` helps
    when the context itself fits with room to spare.
    """
    window = getattr(model.config, "max_position_embeddings", None)
    if window is not None and furthest > window:
        warnings.warn(
            f"the repeat-prefill reaches position {furthest}, past the model's {window} trained positions "
            f"(context + repeat prompt + a chunk of {chunk_size} tokens); reference queries past the window "
            "are extrapolated. Use a shorter context or a smaller repeat_chunk.",
            UserWarning,
            stacklevel=3,
        )


def _check_positions(positions, T: int) -> torch.Tensor:
    """Strictly increasing integer document positions in ``[0, T)`` (CPU); else ValueError."""
    if not isinstance(positions, torch.Tensor) or positions.ndim != 1:
        raise ValueError(f"positions must be a 1-D tensor of document positions, got {positions!r}")
    if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
        raise ValueError(f"positions must be integer, got dtype {positions.dtype}")
    positions = positions.cpu().long()
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= T):
        raise ValueError(
            f"positions must lie in [0, {T}) (the document length), "
            f"got min {int(positions.min())}, max {int(positions.max())}"
        )
    if bool((positions[1:] <= positions[:-1]).any()):
        raise ValueError("positions must be strictly increasing (sorted, no duplicates)")
    return positions


def _snapshot(cache) -> list[tuple]:
    """References to each layer's tensors (cache updates concatenate into new tensors, so these
    stay valid); restoring them also undoes what a sliding-window layer dropped, which ``crop``
    cannot."""
    return [(layer.keys, layer.values, getattr(layer, "cumulative_length", None)) for layer in cache.layers]


def _restore(cache, snapshot: list[tuple]) -> None:
    for layer, (k, v, cum) in zip(cache.layers, snapshot):
        layer.keys, layer.values = k, v
        if cum is not None:
            layer.cumulative_length = cum
