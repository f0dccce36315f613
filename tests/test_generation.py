"""Batched answering (``answer_many``) against one-question-at-a-time ``answer``."""

from __future__ import annotations

import pytest
import torch

from arckv_press.api import compact
from arckv_press.attention import compact_attention
from arckv_press.generation import answer, answer_many
from conftest import make_text

QUESTIONS = ["Which river", "What is the word after maple in the text, please", "Why q", "Name one stone"]


def _state(cache):
    return [(layer.get_seq_length(), getattr(layer, "batch_size", 1)) for layer in cache.layers]


# initializer ranges at which the random tiny models' answers depend on the question (the defaults
# give one answer to every question, which could hide a batching error)
@pytest.mark.parametrize("family, init", [("llama", 0.2), ("gemma3", 0.05)])
@pytest.mark.parametrize("method, ratio", [("arckv-ha", 0.3), ("am-omp-fast", 0.3), ("arckv-ha", 1.0)])
def test_answer_many_equals_answer_one_by_one(tiny_model, tiny_tokenizer, family, init, method, ratio):
    model = tiny_model(family, num_layers=2, initializer_range=init)
    tok = tiny_tokenizer(chat_template=False)  # the completion framing: "Question: ...\nAnswer: <prefix>"
    model.generation_config.eos_token_id = 2
    # one answer prefix per question: a random tiny Gemma echoes the last token, and "Answer:" ends
    # every question alike
    prefixes = ["It", "Then", "Maybe so", "A"]
    with torch.inference_mode():
        cache = compact(model, tok, make_text(600, seed=3), method=method, ratio=ratio)
    before = _state(cache)
    with compact_attention(model):
        batched = answer_many(model, tok, cache, QUESTIONS, max_new_tokens=7, answer_prefix=prefixes,
                              batch_size=3)  # batches of 3 and 1
        assert _state(cache) == before  # restored: batch 1, no appended tokens
        single = [answer(model, tok, cache, q, 7, a) for q, a in zip(QUESTIONS, prefixes)]
    assert batched == single
    assert len(set(single)) > 1  # the questions really lead to different answers


def test_answer_many_full_cache_and_errors(tiny_model, tiny_tokenizer):
    """The same on an ordinary DynamicCache (the full-cache baseline), and a bad batch size."""
    from transformers import DynamicCache

    model, tok = tiny_model("llama", num_layers=2), tiny_tokenizer()
    model.generation_config.eos_token_id = 2
    ids = torch.tensor([tok.encode(make_text(300, seed=5))])
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(ids, past_key_values=cache)
    assert answer_many(model, tok, cache, QUESTIONS, max_new_tokens=5) == [answer(model, tok, cache, q, 5) for q in QUESTIONS]
    assert cache.layers[0].keys.shape[0] == 1 and cache.get_seq_length() == ids.shape[1]
    prefixes = ["A:", "It is", "", "Stone"]
    assert answer_many(model, tok, cache, QUESTIONS, 5, prefixes, batch_size=3) == [
        answer(model, tok, cache, q, 5, a) for q, a in zip(QUESTIONS, prefixes)]
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        answer_many(model, tok, cache, QUESTIONS, batch_size=0)
    with pytest.raises(ValueError, match="2 answer prefixes for 4 questions"):
        answer_many(model, tok, cache, QUESTIONS, answer_prefix=["a", "b"])


@pytest.mark.model
def test_answer_many_default_model(default_model_fp32):
    from arckv_press.haystack import NOISE, make_needle, needle_context

    model, tok = default_model_fp32
    needle = make_needle(seed=0)
    context = needle_context(tok, NOISE * 200, 600, 0.5, needle)
    questions = [needle.question, "What is the text mostly about?", "Repeat the first sentence."]
    with torch.inference_mode():
        cache = compact(model, tok, context, method="arckv-ha", ratio=0.2)
    with compact_attention(model):
        batched = answer_many(model, tok, cache, questions, max_new_tokens=12)
        single = [answer(model, tok, cache, q, 12) for q in questions]
    assert batched == single


def test_reused_cache_answers_as_a_fresh_one_with_sliding_layers(tiny_model, tiny_tokenizer):
    """Gemma-3's sliding-window layers evict context rows while a question is appended; answering
    must restore them, so a question asked after others gets the answer of a fresh cache."""
    model = tiny_model("gemma3", num_layers=2, initializer_range=0.05, sliding_window=32)
    tok = tiny_tokenizer(chat_template=False)
    model.generation_config.eos_token_id = 2
    text = make_text(600, seed=3)
    with torch.inference_mode():
        reused = compact(model, tok, text, method="arckv-ha", ratio=0.3)
        with compact_attention(model):
            for q in QUESTIONS[:3]:
                answer(model, tok, reused, q, 7)
            late = answer(model, tok, reused, QUESTIONS[3], 7)
            fresh = answer(model, tok, compact(model, tok, text, method="arckv-ha", ratio=0.3), QUESTIONS[3], 7)
    sliding = [layer for layer in reused.layers if getattr(layer, "is_sliding", False)]
    assert sliding and sliding[0].keys.shape[2] < reused.get_seq_length()  # the window really evicts
    assert late == fresh


def test_the_one_greedy_decoder_equals_transformers_generate(tiny_model, tiny_tokenizer):
    """``greedy_decode`` (used by ``answer`` and by lm-eval's ``hf-arckv``) against
    ``model.generate(do_sample=False)`` on a full cache: the same tokens, EOS excluded, a stop
    callback ends a row early, and the cache is restored."""
    from transformers import DynamicCache

    from arckv_press.generation import greedy_decode

    model = tiny_model("llama", num_layers=2, initializer_range=0.2)
    tok = tiny_tokenizer(chat_template=False)
    model.generation_config.eos_token_id = 2
    ids = torch.tensor([tok.encode(make_text(200, seed=5), add_special_tokens=False)])
    P, n_new = ids.shape[1] - 6, 9
    with torch.inference_mode():
        reference = model.generate(ids, do_sample=False, max_new_tokens=n_new, min_new_tokens=n_new,
                                   eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :P], past_key_values=cache, use_cache=True)
        pos = torch.arange(P, ids.shape[1])[None]
        model.generation_config.eos_token_id = None
        got = greedy_decode(model, cache, ids[:, P:], pos, n_new)[0]
        assert cache.get_seq_length() == P  # restored
        assert got == reference
        eos = reference[4]  # the fifth token as EOS: the row ends before it (first occurrence)
        model.generation_config.eos_token_id = eos
        assert greedy_decode(model, cache, ids[:, P:], pos, n_new)[0] == reference[:reference.index(eos)]
        model.generation_config.eos_token_id = None
        assert greedy_decode(model, cache, ids[:, P:], pos, n_new, stop=lambda out: len(out) == 3)[0] == reference[:3]
        assert greedy_decode(model, cache, ids[:, P:], pos, 0) == [[]]
