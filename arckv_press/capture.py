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
import time
import warnings
from dataclasses import dataclass, field

import torch

from arckv_press.cache import cache_snapshot, make_evictable, new_cache, restore_cache
from arckv_press.compaction.checks import check_positive_int
from arckv_press.compaction.stats import ReferenceStats, causal_part, split_attention

__all__ = [
    "Framing",
    "framing_for",
    "check_document_text",
    "check_context_positions",
    "encode_document",
    "encode_text",
    "special_token_ids",
    "CapturedQueries",
    "QueryCapture",
    "StatsCapture",
    "decoder_layers",
    "softmax_scale",
    "prefill",
    "repeat_prefill",
    "repeat_prefill_stats",
    "REPEAT_PROMPT",
    "REPEAT_CHUNK_PROMPT",
    "REPEAT_CHUNK",
    "TAIL_FRACTION",
]

REPEAT_PROMPT = "\n\nRepeat the previous context verbatim."
REPEAT_CHUNK_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
REPEAT_CHUNK = 2048  # document tokens repeated per forward of the chunked repeat-prefill (bounds its memory)
# The tail rows cover at most this share of the document: more would outweigh the copy's rows in the
# pooled scores and move anchors off the rest of the document (chosen on development needle cases at
# 1,000 tokens, where 512 tail rows lost needles at depths 10-50%; docs/studies/needle_end.md)
TAIL_FRACTION = 0.25


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


def softmax_scale(model, layer_idx: int) -> float:
    """The softmax scale of decoder layer ``layer_idx``'s attention (its ``self_attn.scaling``)."""
    return float(decoder_layers(model)[layer_idx].self_attn.scaling)


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


_STATS_IMPL = "arckv_stats"


class StatsCapture:
    """The reference pass with statistics: while active, the attention of each layer in ``layers``
    runs :func:`~arckv_press.compaction.stats.split_attention` (exactly softmax attention over all
    visible keys) and feeds the document part of the captured rows to that layer's
    :class:`~arckv_press.compaction.stats.ReferenceStats`; it also keeps the post-RoPE queries of the
    captured rows (``store.q``) and, at the document positions ``x_positions`` (if given), the inputs
    of ``q_proj`` (``store.x``).

    The document is ``doc_len`` keys after ``prefix_len`` prefix keys in every forward's cache; the
    captured rows are the last ``n`` input tokens of a forward (set with :meth:`expect`) and are
    rows ``start .. start + n - 1``: document positions for the copy's rows, ``doc_len ..`` for the
    tail rows (``tail``: a second, short repeat of the document's last positions, read from nearby,
    as a question reads the end of the document, where the whole copy reads every position from a
    document away; heads that read only nearby text see the end of the document in these rows
    alone). Every row's statistics are over the document only. Other layers and forwards run the
    model's own attention unchanged. Use as a context manager: it switches the model's attention
    implementation and restores it on exit.
    """

    def __init__(self, model, layers: list[int], prefix_len: int, doc_len: int, selector: str = "ha",
                 pooling: str = "rms", x_positions: torch.Tensor | None = None, block: int = ReferenceStats.block,
                 tail: int = 0):
        self.model, self.layers = model, list(layers)
        # tail rows: a second, short copy of the document's last positions, read from nearby: at most
        # ``tail`` of them and at most TAIL_FRACTION of the document
        self.n_tail = min(check_positive_int(tail, "tail"), int(doc_len * TAIL_FRACTION)) if tail != 0 else 0
        self.block = check_positive_int(block, "block")  # query rows per statistics block
        self.prefix_len, self.doc_len = prefix_len, doc_len
        self.selector, self.pooling = selector, pooling
        self.x_positions = None if x_positions is None else _check_positions(x_positions, doc_len)
        self.stats: dict[int, ReferenceStats] = {}
        self.stats_seconds = 0.0  # time spent accumulating statistics (scores, witness search, targets)
        self.store = CapturedQueries()
        self._rows: tuple[int, int] | None = None  # (first row, rows captured) of the next forward
        self._previous: str | None = None
        self._handles: list = []

    def expect(self, start: int, n: int) -> None:
        """The next forward's last ``n`` input tokens are rows ``start .. start + n - 1``."""
        self._rows = (start, n)

    def __enter__(self) -> "StatsCapture":
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

        AttentionInterface.register(_STATS_IMPL, _stats_dispatch)
        if _STATS_IMPL not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
            AttentionMaskInterface.register(_STATS_IMPL, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["sdpa"])
        self._previous = self.model.config._attn_implementation
        _ACTIVE.append(self)
        self.model.set_attn_implementation(_STATS_IMPL)
        blocks = decoder_layers(self.model)
        for idx in self.layers:
            if self.x_positions is not None:
                self._handles.append(blocks[idx].self_attn.register_forward_pre_hook(self._x_hook(idx), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        _ACTIVE.remove(self)
        self.model.set_attn_implementation(self._previous)

    def _x_hook(self, layer_idx: int):
        def hook(module, args, kwargs):
            if self._rows is not None:
                start, n = self._rows
                hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                pos = self.x_positions[(self.x_positions >= start) & (self.x_positions < start + n)]
                if pos.numel():  # never in the tail forward (its rows start at doc_len)
                    rows = (pos - start + hidden.shape[1] - n).to(hidden.device)
                    self.store.x.setdefault(layer_idx, []).append(hidden[0, rows].detach())
            return None

        return hook

    def attend(self, module, query, key, value, scaling):
        """The stats path of one layer's attention: ``[1, c, Hq, D]`` as transformers expects."""
        B, Hq, c, D = query.shape
        Hkv, L = key.shape[1], key.shape[2]
        if B != 1:
            raise ValueError("the reference pass supports batch size 1 only")
        G, lo, hi = Hq // Hkv, self.prefix_len, self.prefix_len + self.doc_len
        start, n = self._rows
        if L != hi + c or n > c:
            raise ValueError(f"layer {module.layer_idx}: {L} keys, expected prefix {lo} + document {self.doc_len} "
                             f"+ {c} new tokens")
        q = query[0].view(Hkv, G, c, D)
        idx = module.layer_idx
        stats = self.stats.get(idx)
        off = c - n
        if stats is None:
            stats = self.stats[idx] = ReferenceStats(Hkv, G, self.doc_len + self.n_tail, self.doc_len,
                                                     value.shape[-1], self.selector, self.pooling, query.device,
                                                     block=self.block)
        V_doc = value[0, :, lo:hi]
        new = causal_part(q, key[0, :, hi:], value[0, :, hi:], scaling)     # None off the CPU: blockwise below
        cut = (lambda sl: None) if new is None else (lambda sl: (new[0][:, :, sl], new[1][:, :, sl]))
        parts = []
        if off:  # the repeat instruction's tokens: attention only
            parts.append(split_attention(q[:, :, :off], key[0], value[0], (lo, hi), scaling, 0, stats.block,
                                         new_part=cut(slice(0, off))))
        def on_block(a, blk):
            t0 = time.perf_counter()
            stats.update(start + a, blk, V_doc)
            self.stats_seconds += time.perf_counter() - t0

        parts.append(split_attention(q[:, :, off:], key[0], value[0], (lo, hi), scaling, off, stats.block,
                                     on_block=on_block,
                                     keep_logits=stats.needs_logits, new_part=cut(slice(off, c))))
        self.store.q.setdefault(idx, []).append(query[0, :, off:].detach())
        out = torch.cat(parts, 2) if len(parts) > 1 else parts[0]
        return out.reshape(Hq, c, -1).transpose(0, 1)[None].to(query.dtype), None


_ACTIVE: list[StatsCapture] = []


def _stats_dispatch(module, query, key, value, attention_mask, *args, **kwargs):
    cap = _ACTIVE[-1] if _ACTIVE else None
    if cap is not None and cap._rows is not None and getattr(module, "layer_idx", None) in cap.layers:
        scaling = kwargs.get("scaling", args[1] if len(args) > 1 else None)
        return cap.attend(module, query, key, value, module.scaling if scaling is None else scaling)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    base = cap._previous if cap is not None else "sdpa"
    return ALL_ATTENTION_FUNCTIONS[base](module, query, key, value, attention_mask, *args, **kwargs)


def prefill(model, input_ids: torch.Tensor, cache=None, capture: QueryCapture | None = None, rows=None):
    """Run the decoder over ``input_ids`` (no LM head), filling ``cache``; optional capture rows."""
    cache = new_cache(model) if cache is None else make_evictable(cache, model)
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
    for start in range(0, T, chunk_size):
        yield repeat_span(tokenizer, doc_ids, suffix_ids, start, min(T, start + chunk_size), overlap)


def repeat_span(tokenizer, doc_ids: torch.Tensor, suffix_ids: list[int], start: int, end: int, overlap: int = 8):
    """``(start, end - start, repeat_input_ids)``: the instruction to repeat the document from
    ``start`` (the whole context's instruction at 0, else "starting with" the ``overlap`` tokens
    before ``start``), the suffix, then document tokens ``start .. end - 1``."""
    suffix = torch.tensor([suffix_ids], dtype=torch.long)
    prompt = REPEAT_PROMPT if start == 0 else REPEAT_CHUNK_PROMPT
    head = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)], dtype=torch.long)
    if start > 0:
        head = torch.cat([head, doc_ids[:, max(0, start - overlap) : start]], dim=1)
    return start, end - start, torch.cat([head, suffix, doc_ids[:, start:end]], dim=1)


def repeat_prefill(
    model,
    tokenizer,
    cache,
    doc_ids: torch.Tensor,
    suffix_ids: list[int],
    layers: list[int],
    positions: torch.Tensor,
    chunk_size: int = REPEAT_CHUNK,
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
    positions = _check_positions(positions, doc_ids.shape[-1])
    store = CapturedQueries()
    with QueryCapture(model, layers, store) as cap:
        def forward(start: int, n: int, ids: torch.Tensor, is_tail: bool) -> None:  # no tail forward here
            sel = positions[(positions >= start) & (positions < start + n)]
            if sel.numel():
                prefill(model, ids, cache, cap, rows=sel - start + ids.shape[-1] - n)  # chunk sits last

        _repeat_forwards(model, tokenizer, cache, doc_ids, suffix_ids, chunk_size, progress, forward)
    return store


def repeat_prefill_stats(
    model,
    tokenizer,
    cache,
    doc_ids: torch.Tensor,
    suffix_ids: list[int],
    layers: list[int],
    prefix_len: int,
    selector: str = "ha",
    pooling: str = "rms",
    x_positions: torch.Tensor | None = None,
    chunk_size: int = REPEAT_CHUNK,
    progress=None,
    block: int = ReferenceStats.block,
    tail_rows: int = 0,
) -> StatsCapture:
    """The repeat-prefill of :func:`repeat_prefill` capturing every document position, with the
    reference statistics of :mod:`arckv_press.compaction.stats` gathered by the forward's own
    attention (:class:`StatsCapture`). ``cache`` holds ``prefix_len`` prefix tokens and the document;
    it is restored afterwards. Returns the capture: ``stats[layer]`` and ``store`` (queries, and the
    ``q_proj`` inputs at ``x_positions``), rows in position order. ``block``: query rows per block
    of the statistics (:class:`~arckv_press.compaction.stats.ReferenceStats`' default).
    ``tail_rows``: the tail rows (:class:`StatsCapture`), rows ``T ..`` after the document's: one
    more forward repeats the document's last ``min(tail_rows, T * TAIL_FRACTION)`` tokens
    (:func:`repeat_span`), its statistics gathered by its own attention as the copy's are."""
    if cache.get_seq_length() != prefix_len + doc_ids.shape[-1]:
        raise ValueError(f"the cache holds {cache.get_seq_length()} tokens, expected prefix {prefix_len} + "
                         f"document {doc_ids.shape[-1]}")
    cap = StatsCapture(model, layers, prefix_len, doc_ids.shape[-1], selector, pooling, x_positions, block,
                       tail_rows)
    with cap:
        def forward(start: int, n: int, ids: torch.Tensor, is_tail: bool) -> None:
            cap.expect(cap.doc_len if is_tail else start, n)  # the tail rows follow the document's
            prefill(model, ids, cache)
            cap._rows = None

        _repeat_forwards(model, tokenizer, cache, doc_ids, suffix_ids, chunk_size, progress, forward, cap.n_tail)
    for stats in cap.stats.values():
        stats.result()
    return cap


def _repeat_forwards(model, tokenizer, cache, doc_ids, suffix_ids, chunk_size, progress, forward, tail: int = 0) -> None:
    """Run ``forward(start, n, ids, False)`` for each repeat chunk on ``cache``, restoring it after each;
    with ``tail``, then ``forward(T - tail, tail, ids, True)`` for the repeat of the last ``tail`` tokens."""
    if doc_ids.ndim != 2 or doc_ids.shape[0] != 1:
        raise ValueError(f"repeat-prefill supports batch size 1 only, got doc_ids of shape {tuple(doc_ids.shape)}")
    T = doc_ids.shape[-1]
    spans = [(*chunk, False) for chunk in repeat_chunks(tokenizer, doc_ids.cpu(), suffix_ids, chunk_size)]
    if tail:
        spans.append((*repeat_span(tokenizer, doc_ids.cpu(), suffix_ids, T - tail, T), True))
    _warn_past_window(model, cache.get_seq_length() + max(ids.shape[-1] for _, _, ids, _ in spans), chunk_size)
    snapshot = cache_snapshot(cache)  # restoring it also undoes what a sliding-window layer dropped
    try:
        for start, n, ids, is_tail in spans:
            forward(start, n, ids, is_tail)
            restore_cache(cache, snapshot)
            if progress is not None and not is_tail:
                progress.update(n)
    finally:
        restore_cache(cache, snapshot)


def _warn_past_window(model, furthest: int, chunk_size: int) -> None:
    """Warn when the repeat-prefill runs past the model's trained positions (``max_position_embeddings``).

    Each repeated chunk sits after the whole context, so the furthest position is about
    ``context + prompt + chunk``: for a context close to the window, RoPE extrapolates and the
    reference queries (and so the anchors) are less reliable. A smaller ``chunk_size`` of
    :func:`repeat_prefill_stats` / :func:`repeat_prefill` helps when the context itself fits with
    room to spare (it changes the statistics, so the results).
    """
    window = getattr(model.config, "max_position_embeddings", None)
    if window is not None and furthest > window:
        warnings.warn(
            f"the repeat-prefill reaches position {furthest}, past the model's {window} trained positions "
            f"(context + repeat prompt + a chunk of {chunk_size} tokens); reference queries past the window "
            "are extrapolated. Use a shorter context.",
            UserWarning,
            stacklevel=3,
        )


def check_context_positions(model, n_context: int, prefix_len: int = 0) -> None:
    """Refuse a context of more tokens than the model has positions (``max_position_embeddings``),
    with a ``ValueError`` naming both numbers, before anything runs: past the window the prefill
    itself (the keys and values that are kept) extrapolates the position encoding.

    The repeat-prefill of ARC-KV / Attention Matching puts each repeated chunk after the whole
    context, so it reaches ``n_context + instruction + suffix + chunk`` positions
    (:func:`repeat_chunks`); a context that fits but whose repeat does not is not refused (the
    benchmarks' 8K contexts and QuALITY's longest articles are such cases): the repeat-prefill
    warns (:func:`_warn_past_window`) with the numbers. Models without ``max_position_embeddings``
    are not checked."""
    window = getattr(model.config, "max_position_embeddings", None)
    if isinstance(window, int) and n_context > window:
        raise ValueError(
            f"the context has {n_context} tokens (prefix {prefix_len} + document {n_context - prefix_len}), more than "
            f"the {window} positions of the model (max_position_embeddings); shorten or split the document, or use a "
            "model with more positions")


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


def check_document_text(text, name: str = "context") -> str:
    """``text`` if it is non-empty Unicode text: a ``TypeError`` for anything but a ``str`` (bytes
    included: decode them first), a ``ValueError`` for an empty string or one holding a lone
    surrogate (not encodable as UTF-8, which the tokenizer would reject with its own error)."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        raise TypeError(f"the {name} must be a str, got {type(text).__name__}; decode it first "
                        "(for example data.decode('utf-8'))")
    if not isinstance(text, str):
        raise TypeError(f"the {name} must be a str, got {type(text).__name__}")
    if not text.strip():
        raise ValueError(f"the {name} to compact is empty")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"the {name} holds a lone surrogate {text[err.start]!r} (U+{ord(text[err.start]):04X}) at "
                         f"character {err.start}: not valid Unicode text; decode the source with errors='replace' "
                         "or remove it") from None
    return text


def special_token_ids(tokenizer) -> set[int]:
    """Ids of the tokenizer's special tokens (chat control, BOS/EOS, the unknown token, ...)."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    for idx, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(token, "special", False):
            ids.add(int(idx))
    return ids


def encode_text(tokenizer, text: str, name: str = "document") -> list[int]:
    """Token ids of untrusted ``text`` encoded as text: a string that spells a special token
    (``<|im_end|>``, ``<|im_start|>assistant``, ...) becomes ordinary tokens
    (``split_special_tokens=True``), never the control token itself; text without such strings
    encodes to the same ids as before. A ``ValueError`` if the tokenizer still returns a special
    token id (one that ignores ``split_special_tokens``)."""
    ids = list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
    leaked = set(ids) & special_token_ids(tokenizer)
    unk = getattr(tokenizer, "unk_token", None)
    if unk and unk not in text:  # the unknown token stands for characters the vocabulary lacks
        leaked.discard(getattr(tokenizer, "unk_token_id", None))
    leaked = sorted(leaked)
    if leaked:
        names = [tokenizer.convert_ids_to_tokens(i) for i in leaked]
        raise ValueError(f"the {name} spells the special tokens {names} and {type(tokenizer).__name__} encodes them "
                         "as control tokens even with split_special_tokens=True; remove them from the text")
    return ids


def encode_document(tokenizer, text: str, use_chat_template: bool | None = None) -> tuple[torch.Tensor, int]:
    """``prefix + document`` token ids ``[1, P + T]`` and the prefix length ``P`` (kvpress framing).

    The prefix (the chat template up to the user message) keeps its real special tokens; the
    document is untrusted text and is encoded as text (:func:`encode_text`), so a document
    cannot close the user turn or open an assistant turn. ``text`` is checked by
    :func:`check_document_text`."""
    check_document_text(text)
    framing = framing_for(tokenizer, use_chat_template)
    doc = encode_text(tokenizer, text)
    ids = torch.tensor([framing.prefix_ids + doc], dtype=torch.long)
    return ids, len(framing.prefix_ids)
