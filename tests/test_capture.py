"""Capture plumbing (arckv_press.capture) against cache-free full forwards of the model.

Reference for a captured row: one forward of the whole sequence (context, then the repeat input
of the chunk) with ``use_cache=False``, recording

- ``x``: the input of ``q_proj`` (forward hook on the projection itself), and
- ``q``: the post-RoPE query exactly as the model's attention function receives it (a probe
  attention function registered in transformers' ``AttentionInterface``; the model's own code
  applied ``q_norm`` and RoPE), plus the ``scaling`` the model passes.

The repeat inputs of the chunks are rebuilt here from the documented layout (capture module
docstring), not with ``capture.repeat_chunks``.
"""

from __future__ import annotations

import contextlib
import warnings
from types import SimpleNamespace

import pytest
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from arckv_press.capture import (
    REPEAT_CHUNK_PROMPT,
    REPEAT_PROMPT,
    QueryCapture,
    framing_for,
    prefill,
    repeat_prefill,
)
from arckv_press.models import describe_attention_layout

_PROBE = "arckv_test_probe"


from conftest import make_text  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
_PROBE_LOG: dict = {}


def _probe_attention(module, query, key, value, attention_mask, **kwargs):
    _PROBE_LOG.setdefault(module.layer_idx, []).append((query[0].detach().clone(), kwargs.get("scaling")))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@contextlib.contextmanager
def probe_attention(model):
    """Route the model's attention through ``_probe_attention`` (sdpa underneath)."""
    if _PROBE not in AttentionInterface._global_mapping:
        AttentionInterface.register(_PROBE, _probe_attention)
        AttentionMaskInterface.register(_PROBE, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["sdpa"])
    previous = model.config._attn_implementation
    _PROBE_LOG.clear()
    model.set_attn_implementation(_PROBE)
    try:
        yield _PROBE_LOG
    finally:
        model.set_attn_implementation(previous)
        _PROBE_LOG.clear()


def reference_queries(model, ids: torch.Tensor, layers) -> dict[int, tuple[torch.Tensor, torch.Tensor, float]]:
    """Per layer: ``x [S, d]`` (q_proj input), post-RoPE ``q [Hq, S, D]`` and the scaling, from one
    forward over ``ids [1, S]`` without a cache."""
    xs: dict[int, torch.Tensor] = {}
    blocks = model.model.layers
    handles = [
        blocks[l].self_attn.q_proj.register_forward_hook(
            lambda mod, args, out, l=l: xs.__setitem__(l, args[0][0].detach().clone())
        )
        for l in layers
    ]
    try:
        with torch.no_grad(), probe_attention(model) as log:
            model(ids, use_cache=False)
            out = {}
            for l in layers:
                assert len(log[l]) == 1
                q, scaling = log[l][0]
                out[l] = (xs[l], q, scaling)
    finally:
        for h in handles:
            h.remove()
    return out


def context_ids(tok, text: str) -> tuple[torch.Tensor, int]:
    framing = framing_for(tok)
    doc = tok.encode(text, add_special_tokens=False)
    return torch.tensor([framing.prefix_ids + doc]), len(framing.prefix_ids)


def chunk_input(tok, doc: list[int], suffix: list[int], start: int, size: int, overlap: int = 8) -> list[int]:
    """Repeat input of the chunk at ``start`` as the capture docstring defines it."""
    if start == 0:
        head = tok.encode(REPEAT_PROMPT, add_special_tokens=False)
    else:
        head = tok.encode(REPEAT_CHUNK_PROMPT, add_special_tokens=False) + doc[max(0, start - overlap) : start]
    return head + suffix + doc[start : start + size]


def snapshot(cache) -> list[tuple]:
    return [
        (l.keys.clone(), l.values.clone(), getattr(l, "cumulative_length", None), l.get_seq_length())
        for l in cache.layers
    ]


def assert_same_cache(cache, snap) -> None:
    assert len(cache.layers) == len(snap)
    for i, (layer, (k, v, cum, seq)) in enumerate(zip(cache.layers, snap)):
        assert torch.equal(layer.keys, k), f"layer {i} keys changed"
        assert torch.equal(layer.values, v), f"layer {i} values changed"
        assert getattr(layer, "cumulative_length", None) == cum, f"layer {i} cumulative_length changed"
        assert layer.get_seq_length() == seq


CAPTURE_FAMILIES = {
    "llama": {},
    "qwen2": {},  # q_proj bias
    "qwen3": {},  # q_norm
    "gemma3": {"query_pre_attn_scalar": 24},  # q_norm, scaling != head_dim**-0.5, sliding layer 0
}


@pytest.mark.parametrize("family", list(CAPTURE_FAMILIES))
def test_repeat_capture_matches_full_forward(tiny_model, tiny_tokenizer, family):
    model = tiny_model(family, num_layers=2, **CAPTURE_FAMILIES[family])
    tok = tiny_tokenizer()
    layout = describe_attention_layout(model)
    layers = list(layout.full_attention_layers)
    ids, P = context_ids(tok, make_text(60, seed=1))
    doc = ids[0, P:].tolist()
    T, chunk = len(doc), 16
    suffix = framing_for(tok).suffix_ids
    # chunks [0,16) [16,32) [32,48) [48,60): the third one has no selected position
    positions = torch.tensor([0, 5, 15, 16, 17, 30, 48, 50, 59])

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        prefill(model, ids, cache)
        store = repeat_prefill(model, tok, cache, ids[:, P:], suffix, layers, positions, chunk_size=chunk)

    if family == "gemma3":
        assert layers == [1] and set(store.x) == {1}  # the sliding layer 0 is not captured

    # reference: one cache-free forward per chunk over context + repeat input
    ref_x = {l: [] for l in layers}
    ref_q = {l: [] for l in layers}
    n_forwards = 0
    for start in range(0, T, chunk):
        sel = [p for p in positions.tolist() if start <= p < start + chunk]
        if not sel:
            continue
        rep = chunk_input(tok, doc, suffix, start, chunk)
        n = min(chunk, T - start)
        full = torch.cat([ids, torch.tensor([rep])], dim=1)
        rows = [ids.shape[1] + len(rep) - n + (p - start) for p in sel]
        assert all(full[0, r].item() == doc[p] for r, p in zip(rows, sel))  # the row repeats doc[p]
        ref = reference_queries(model, full, layers)
        n_forwards += 1
        for l in layers:
            x, q, scaling = ref[l]
            ref_x[l].append(x[rows])
            ref_q[l].append(q[:, rows])
            assert scaling == pytest.approx(layout.scaling)
    assert n_forwards == 3

    for l in layers:
        x, q = store.layer(l)
        assert x.shape == (positions.numel(), model.config.hidden_size)
        assert q.shape == (layout.num_q_heads, positions.numel(), layout.head_dim)
        torch.testing.assert_close(x, torch.cat(ref_x[l]), atol=1e-5, rtol=0)
        torch.testing.assert_close(q, torch.cat(ref_q[l], dim=1), atol=1e-5, rtol=0)
    if family == "gemma3":
        assert layout.scaling == pytest.approx(24**-0.5)


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("gemma3", {"sliding_window": 8})])
def test_repeat_prefill_restores_cache(tiny_model, tiny_tokenizer, family, overrides):
    model = tiny_model(family, num_layers=2, **overrides)
    tok = tiny_tokenizer()
    ids, P = context_ids(tok, make_text(40, seed=2))
    question = torch.tensor([tok.encode("what river?", add_special_tokens=False) + framing_for(tok).suffix_ids])
    layers = list(describe_attention_layout(model).full_attention_layers)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        prefill(model, ids, cache)
        before = snapshot(cache)
        if family == "gemma3":
            assert cache.layers[0].keys.shape[-2] == 7  # the window holds sliding_window - 1 tokens
        repeat_prefill(
            model, tok, cache, ids[:, P:], framing_for(tok).suffix_ids, layers, torch.arange(0, 40, 3), chunk_size=16
        )
        assert_same_cache(cache, before)
        logits = model(question, past_key_values=cache).logits

        fresh = DynamicCache(config=model.config)
        prefill(model, ids, fresh)
        ref = model(question, past_key_values=fresh).logits
    torch.testing.assert_close(logits, ref, atol=1e-6, rtol=0)

    # the check can fail: an unrestored forward does change every layer of the cache
    with torch.no_grad():
        model.model(input_ids=question, past_key_values=fresh, use_cache=True)
    changed = [not torch.equal(l.keys, b[0]) for l, b in zip(fresh.layers, before)]
    assert all(changed)
    if family == "gemma3":
        assert fresh.layers[0].keys.shape[-2] == 7  # the sliding layer dropped tokens crop cannot restore


def test_repeat_prefill_restores_cache_on_error(tiny_model, tiny_tokenizer):
    model = tiny_model("gemma3", num_layers=2, sliding_window=8)
    tok = tiny_tokenizer()
    ids, P = context_ids(tok, make_text(40, seed=3))
    cache = DynamicCache(config=model.config)
    calls = []

    def fail_on_second_chunk(module, args, output):
        calls.append(1)
        if len(calls) == 2:  # the second chunk's forward, after its keys were appended
            raise RuntimeError("boom")

    with torch.no_grad():
        prefill(model, ids, cache)
        before = snapshot(cache)
        handle = model.model.layers[1].register_forward_hook(fail_on_second_chunk)
        try:
            with pytest.raises(RuntimeError, match="boom"):
                repeat_prefill(
                    model, tok, cache, ids[:, P:], framing_for(tok).suffix_ids, [1], torch.arange(0, 40, 5), 16
                )
        finally:
            handle.remove()
    assert len(calls) == 2
    assert_same_cache(cache, before)
    assert not model.model.layers[1].self_attn._forward_pre_hooks  # capture hooks removed


def test_repeat_prefill_warns_past_the_trained_window(tiny_model, tiny_tokenizer):
    tok = tiny_tokenizer()
    ids, P = context_ids(tok, make_text(40, seed=4))
    suffix = framing_for(tok).suffix_ids
    first = len(tok.encode(REPEAT_PROMPT, add_special_tokens=False))
    later = len(tok.encode(REPEAT_CHUNK_PROMPT, add_special_tokens=False)) + 8  # + 8 overlap tokens
    furthest = ids.shape[1] + max(first, later) + len(suffix) + 16  # context + prompt + suffix + a chunk of 16
    for window, warns in ((furthest - 1, True), (furthest, False)):
        model = tiny_model("llama", max_position_embeddings=window)
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cache = DynamicCache(config=model.config)
            prefill(model, ids, cache)
            repeat_prefill(model, tok, cache, ids[:, P:], suffix, [0], torch.arange(0, 40, 4), chunk_size=16)
        hits = [w for w in caught if "past the model's" in str(w.message)]
        assert bool(hits) == warns, (window, [str(w.message) for w in caught])
        if warns:
            assert f"reaches position {furthest}" in str(hits[0].message)


def test_repeat_prefill_bad_input(tiny_model, tiny_tokenizer):
    model = tiny_model("llama")
    tok = tiny_tokenizer()
    doc = torch.full((1, 20), 40)
    with pytest.raises(ValueError, match="batch size 1"):
        repeat_prefill(model, tok, DynamicCache(), torch.zeros(2, 20, dtype=torch.long), [6], [1], torch.arange(3))
    cases = [
        (torch.tensor([0, 20]), r"\[0, 20\)"),  # past the document: would be dropped silently
        (torch.tensor([-1, 3]), r"\[0, 20\)"),
        (torch.tensor([5, 3]), "increasing"),  # rows would not follow positions across chunks
        (torch.tensor([3, 3]), "increasing"),
        (torch.tensor([1.0, 2.0]), "integer"),
        (torch.tensor([[1, 2]]), "1-D"),
    ]
    for positions, msg in cases:
        cache = DynamicCache(config=model.config)
        with pytest.raises(ValueError, match=msg):
            repeat_prefill(model, tok, cache, doc, [6], [1], positions, chunk_size=8)
        assert cache.get_seq_length() == 0


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_context_capture_matches_full_forward(tiny_model, tiny_tokenizer, family):
    model = tiny_model(family, num_layers=2)
    tok = tiny_tokenizer()
    layers = list(describe_attention_layout(model).full_attention_layers)
    ids, P = context_ids(tok, make_text(50, seed=4))
    rows = torch.tensor([P, P + 1, P + 20, ids.shape[1] - 1])
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), QueryCapture(model, layers) as cap:
        prefill(model, ids, cache, cap, rows=rows)
        assert cap.rows is None  # reset after the forward
        prefill(model, torch.tensor([[7, 8, 9]]), cache, cap)  # no rows: nothing captured
    ref = reference_queries(model, ids, layers)
    for l in layers:
        x, q = cap.store.layer(l)
        torch.testing.assert_close(x, ref[l][0][rows], atol=1e-5, rtol=0)
        torch.testing.assert_close(q, ref[l][1][:, rows], atol=1e-5, rtol=0)
    # the hooks are gone after the context manager
    n_before = len(cap.store.x[layers[0]])
    with torch.no_grad():
        model(ids)
    assert len(cap.store.x[layers[0]]) == n_before


# ----------------------------------------------------------------------------- framing


def kvpress_preprocess(tok, context: str, question: str):
    from kvpress.pipeline import KVPressTextGenerationPipeline

    out = KVPressTextGenerationPipeline.preprocess(
        SimpleNamespace(tokenizer=tok), context, [question], answer_prefix="", max_context_length=10**6
    )
    return out["context_ids"][0].tolist(), out["questions_ids"][0][0].tolist()


def check_framing(tok, context: str, question: str, use_chat_template=None) -> None:
    framing = framing_for(tok, use_chat_template)
    ctx_ids, q_ids = kvpress_preprocess(tok, context, question)
    assert ctx_ids == framing.prefix_ids + tok.encode(context, add_special_tokens=False)
    assert q_ids == tok.encode(question, add_special_tokens=False) + framing.suffix_ids


def test_framing_tiny_tokenizer(tiny_tokenizer):
    tok = tiny_tokenizer()
    framing = framing_for(tok)
    assert tok.decode(framing.prefix_ids) == "<bos><|user|>\n"
    assert tok.decode(framing.suffix_ids) == "<|end|>\n<|assistant|>\n"
    check_framing(tok, "Some context. With a second sentence.", "What is it?")
    plain = tiny_tokenizer(chat_template=False)
    assert framing_for(plain).prefix_ids == [plain.bos_token_id]
    assert framing_for(plain).suffix_ids == plain.encode("\n", add_special_tokens=False)
    check_framing(plain, "Some context.", "What is it?")


@pytest.mark.model
def test_framing_default_model_matches_kvpress(default_model):
    _, tok = default_model
    assert tok.chat_template is not None
    context = (
        "The committee met on Tuesday to discuss the budget.\nAfter a long debate, it approved 4,521 euros "
        "for new books and a reading room."
    )
    check_framing(tok, context, "How much money was approved?")
    check_framing(tok, " starts with a space and ends with a newline\n", " Who?")
    framing = framing_for(tok)
    assert "<|im_start|>user" in tok.decode(framing.prefix_ids)
    assert tok.decode(framing.suffix_ids).startswith("<|im_end|>")
    assert tok.decode(framing.suffix_ids).endswith("<|im_start|>assistant\n")
