"""kvpress adapters (ARCKVPress, AttentionMatchingPress) and the method registry.

Tiny models get a word-level tokenizer (``_word_tokenizer``): a ``tokenizers`` WordLevel model
over exactly the tiny vocabulary (128 entries: 4 specials, the words of the prompts, fillers
``w0..``), lower-casing + whitespace/punctuation splitting, wrapped in
``PreTrainedTokenizerFast`` with a ChatML-like chat template. Every id the tiny model can emit
decodes to a word, the framing prefix ``<|im_start|> user`` is two tokens, and it can be saved
and reloaded with ``AutoTokenizer`` (which KVzip does from ``model.config.name_or_path``).
The tiny models use ``initializer_range=0.2`` so that answers depend on the question and on
the compaction (with the default 0.02 a random model answers the same to everything).

kvpress presses and our presses run under ``torch.inference_mode()`` (the pipeline itself runs
under ``no_grad``). Under a loaded 2-core machine torch's 2 intra-op threads are ~10x slower
than 1 thread (spin-waiting), so this module runs with 1 thread (restored afterwards).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel, pipeline

import arckv_press.presses as presses_mod
from arckv_press.config import CompactionConfig
from arckv_press.api import compact_prefilled
from arckv_press.attention import disable_compact_attention, enable_compact_attention
from arckv_press.cache import CompactLayer
from arckv_press.capture import framing_for
from arckv_press.indexer.checkpoint import save_indexer
from arckv_press.indexer.model import IndexerConfig, ValueAwareIndexer
from arckv_press.models import config_hash, describe_attention_layout, model_id
from arckv_press.presses import ARCKVPress, AttentionMatchingPress
from arckv_press.methods import METHOD_NAMES, METHODS
from arckv_press.registry import make_press, prefill_with_press

TINY_INIT = 0.2
QUESTIONS_TINY = ["what is the secret code ?", "what is the name ?", "city ?"]
QUESTIONS_DEFAULT = ["What is the secret ingredient of the apple cake?", "What is the name of Maria's dog?"]
DEFAULT_CONTEXT = (
    "Maria Keller runs a small bakery in the town of Lindenberg. Every morning she bakes rye bread, "
    "apple cake and forty pretzels. Her assistant, Tom, arrives at six. The bakery was founded in 1987 by "
    "her grandfather Otto. The secret ingredient of the apple cake is cardamom. On Sundays the bakery is "
    "closed, and Maria goes hiking in the hills north of town with her dog Bruno. "
) * 3  # ~250 tokens with the framing


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --------------------------------------------------------------------------- helpers
_SPECIAL = ["<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
_WORDS = ["user", "assistant", "system", "repeat", "the", "previous", "context", "verbatim", "exactly", "part",
          "of", "starting", "with", ".", ",", "?", "what", "is", "code", "secret", "name", "city"]
_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def _word_tokenizer(vocab_size: int = 128):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = _SPECIAL + _WORDS
    vocab += [f"w{i}" for i in range(vocab_size - len(vocab))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # words joined by spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<|im_start|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>", chat_template=_TEMPLATE,
    )


def _tiny_context(n_words: int = 120, seed: int = 0) -> str:
    g = torch.Generator().manual_seed(seed)
    words = [f"w{i}" for i in torch.randint(0, 100, (n_words,), generator=g).tolist()]
    return " ".join(words) + " . the secret code is w7 . the name is w42 ."


def _pipe(model, tok):
    return pipeline("kv-press-text-generation", model=model, tokenizer=tok)


def _context_ids(pipe, context: str) -> torch.Tensor:
    return pipe.preprocess(context, questions=[""], answer_prefix="", max_context_length=10**9)["context_ids"]


def _ask(pipe, context, questions, press=None, cache=None, max_new_tokens=8):
    with torch.inference_mode():
        out = pipe(context, questions=questions, press=press, cache=cache, max_new_tokens=max_new_tokens)
    return out["answers"]


def _no_hooks(model) -> bool:
    return not model.model._forward_pre_hooks and all(
        not layer.self_attn._forward_pre_hooks and not layer.self_attn._forward_hooks for layer in model.model.layers
    )


def _counting(monkeypatch) -> list:
    calls = []
    real = presses_mod.compact_prefilled

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(presses_mod, "compact_prefilled", counted)
    return calls


@pytest.fixture
def fp32_model(default_model_fp32):
    """The session fp32 default model, switched back to its own attention afterwards."""
    model, tok = default_model_fp32
    yield model, tok
    disable_compact_attention(model)


# --------------------------------------------------------------------------- ratio = 1 is the full cache
@pytest.mark.parametrize(
    "family, init, press_cls, kw",
    [("llama", TINY_INIT, ARCKVPress, {"selector": "ha"}), ("qwen3", TINY_INIT, AttentionMatchingPress, {"variant": "omp"}),
     ("gemma3", 0.05, ARCKVPress, {"selector": "vi"})],  # gemma3 (tied embeddings) repeats itself at 0.2
)
def test_ratio_one_answers_as_no_press_tiny(tiny_model, family, init, press_cls, kw):
    model, tok = tiny_model(family, num_layers=2, initializer_range=init), _word_tokenizer()
    pipe, context = _pipe(model, tok), _tiny_context()
    ref = _ask(pipe, context, QUESTIONS_TINY)
    press = press_cls(ratio=1.0, tokenizer=tok, **kw)
    assert press.compression_ratio == 0.0
    cache = DynamicCache()
    out = _ask(pipe, context, QUESTIONS_TINY, press=press, cache=cache)
    assert out == ref
    assert len(set(ref)) > 1  # the answers depend on the question (the comparison can fail)

    # the cache: every document position kept, beta = 0, values and keys of the plain prefill
    ids = _context_ids(pipe, context)
    P = len(framing_for(tok).prefix_ids)
    T = ids.shape[1] - P
    dyn = DynamicCache()
    with torch.inference_mode():
        model.model(input_ids=ids, past_key_values=dyn)
    full_layers = describe_attention_layout(model).full_attention_layers
    assert len(full_layers) == (1 if family == "gemma3" else 2)  # gemma3: layer 0 slides, is not compacted
    for i, layer in enumerate(cache.layers):
        if i not in full_layers:
            assert not isinstance(layer, CompactLayer) and torch.equal(layer.keys, dyn.layers[i].keys)
            continue
        assert isinstance(layer, CompactLayer)
        assert layer.lengths.tolist() == [T, T] and layer.span == T and layer.num_appended == P
        assert torch.equal(layer.beta, torch.zeros(2 * T))
        H, D = 2, layer.head_dim
        torch.testing.assert_close(layer.cv.view(H, T, D), dyn.layers[i].values[0, :, P:], atol=0, rtol=0)
        torch.testing.assert_close(layer.ck.view(H, T, D), dyn.layers[i].keys[0, :, P:], atol=0, rtol=0)
    assert press.last_report.realised_ratio == 1.0 and press.last_report.prefix_length == P


@pytest.mark.model
@pytest.mark.parametrize("make", [lambda: ARCKVPress(ratio=1.0, selector="ha"),
                                  lambda: AttentionMatchingPress(ratio=1.0, variant="omp-fast")],
                         ids=["arckv-ha", "am-omp-fast"])
def test_ratio_one_answers_as_no_press_default(fp32_model, make):
    model, tok = fp32_model
    pipe = _pipe(model, tok)
    questions = QUESTIONS_DEFAULT[:2]
    ref = _ask(pipe, DEFAULT_CONTEXT, questions, max_new_tokens=10)
    assert len(set(ref)) == 2  # the answers depend on the question (the comparison can fail)
    press = make()  # tokenizer reloaded from config.name_or_path (local folder)
    cache = DynamicCache()
    out = _ask(pipe, DEFAULT_CONTEXT, questions, press=press, cache=cache, max_new_tokens=10)
    assert out == ref
    P = press.last_report.prefix_length
    assert P == len(framing_for(tok).prefix_ids) > 0
    ids = _context_ids(pipe, DEFAULT_CONTEXT)
    dyn = DynamicCache()
    with torch.inference_mode():
        model.model(input_ids=ids, past_key_values=dyn)
    T = ids.shape[1] - P
    for layer, plain in zip(cache.layers, dyn.layers):  # every position kept, beta = 0, the prefill's values
        assert isinstance(layer, CompactLayer) and layer.lengths.tolist() == [T] * 3
        assert bool((layer.beta == 0).all())
        torch.testing.assert_close(layer.cv.view(3, T, -1), plain.values[0, :, P:], atol=0, rtol=0)


# --------------------------------------------------------------------------- several questions, one compaction
def _one_compaction_many_questions(monkeypatch, model, tok, context, questions, make, max_new_tokens):
    pipe = _pipe(model, tok)
    calls = _counting(monkeypatch)
    shared = _ask(pipe, context, questions, press=make(), max_new_tokens=max_new_tokens)
    assert len(calls) == 1
    for question, answer in zip(questions, shared):
        calls.clear()
        fresh = _ask(pipe, context, [question], press=make(), max_new_tokens=max_new_tokens)
        assert len(calls) == 1
        assert fresh == [answer]
    return shared


@pytest.mark.parametrize("press_cls, kw", [(ARCKVPress, {"selector": "ha"}), (AttentionMatchingPress, {"variant": "omp-fast"})])
def test_questions_share_one_compaction_tiny(tiny_model, monkeypatch, press_cls, kw):
    model, tok = tiny_model("llama", num_layers=2, initializer_range=TINY_INIT), _word_tokenizer()
    context = _tiny_context()
    shared = _one_compaction_many_questions(
        monkeypatch, model, tok, context, QUESTIONS_TINY, lambda: press_cls(ratio=0.3, tokenizer=tok, **kw), 8
    )
    assert len(set(shared)) > 1
    full = _ask(_pipe(model, tok), context, QUESTIONS_TINY)
    assert full != shared  # the compaction at ratio 0.3 is not a no-op on this model


@pytest.mark.model
def test_questions_share_one_compaction_default(fp32_model, monkeypatch):
    model, tok = fp32_model
    shared = _one_compaction_many_questions(
        monkeypatch, model, tok, DEFAULT_CONTEXT, QUESTIONS_DEFAULT,
        lambda: ARCKVPress(ratio=0.3, selector="ha", tokenizer=tok, query_budget=256), 10,
    )
    assert all(isinstance(a, str) and a for a in shared)


# --------------------------------------------------------------------------- plain transformers route
def test_plain_transformers_route_tiny(tiny_model):
    model, tok = tiny_model("qwen3", num_layers=2, initializer_range=TINY_INIT), _word_tokenizer()
    framing = framing_for(tok)
    P = len(framing.prefix_ids)
    doc = tok.encode(_tiny_context(100, seed=3), add_special_tokens=False)
    ctx = torch.tensor([framing.prefix_ids + doc])
    question = torch.tensor([tok.encode("what is the secret code ?", add_special_tokens=False) + framing.suffix_ids])
    T, ratio = len(doc), 0.3
    press = ARCKVPress(ratio=ratio, selector="ha", tokenizer=tok, query_budget=64)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        with press(model):
            model(ctx, past_key_values=cache)
        assert _no_hooks(model)
        kept = math.floor(ratio * T)  # total of the global budgets: floor(rho T) per layer-head on average
        for layer in cache.layers:
            assert isinstance(layer, CompactLayer)
            assert layer.span == T and layer.num_appended == P
        assert sum(int(layer.lengths.sum()) for layer in cache.layers) == 2 * 2 * kept
        assert cache.get_seq_length() == P + T
        assert press.last_report.realised_ratio == pytest.approx(kept / T)
        full = torch.cat([ctx, question], dim=1)
        out = model.generate(full, past_key_values=cache, max_new_tokens=6, do_sample=False)

        # reference: the library path (it prefills itself) on the same ids
        config = CompactionConfig(method="arckv-ha", ratio=ratio, query_budget=64)
        ref_cache = DynamicCache(config=model.config)
        compact_prefilled(model, tok, ref_cache, ctx, P, config)
        ref = model.generate(full, past_key_values=ref_cache, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, ref)
    assert out.shape[1] > full.shape[1]


def test_press_creates_the_cache_when_none_is_passed(tiny_model):
    model, tok = tiny_model("llama", num_layers=2), _word_tokenizer()
    ids = torch.tensor([framing_for(tok).prefix_ids + tok.encode(_tiny_context(40), add_special_tokens=False)])
    press = AttentionMatchingPress(ratio=0.5, variant="ha", tokenizer=tok)
    with torch.inference_mode(), press(model):
        out = model(ids)
    T = ids.shape[1] - 2
    assert [layer.lengths.tolist() for layer in out.past_key_values.layers] == [[T // 2, T // 2]] * 2


# --------------------------------------------------------------------------- registry
def test_registry_names_and_constructors():
    assert METHOD_NAMES == (
        "arckv", "arckv-ha", "arckv-vi", "am-omp", "am-omp-fast", "am-ha",
        "snapkv", "kvzip", "expected_attention", "knorm", "streaming_llm", "none",
    )
    assert make_press("none", 0.5) is None
    press = make_press("arckv-vi", 0.2, lambda_m=0.5)
    assert isinstance(press, ARCKVPress) and press.method == "arckv-vi" and press.lambda_m == 0.5
    assert press.ratio == 0.2 and press.compression_ratio == 0.8
    assert make_press("am-omp-fast", 0.4).method == "am-omp-fast"
    from kvpress import ExpectedAttentionPress, KnormPress, KVzipPress, SnapKVPress, StreamingLLMPress

    from arckv_press.presses import hybrid_press_class

    for name, cls in [("snapkv", SnapKVPress), ("kvzip", KVzipPress), ("expected_attention", ExpectedAttentionPress),
                      ("knorm", KnormPress), ("streaming_llm", StreamingLLMPress)]:
        p = make_press(name, 0.1)  # kvpress's class under the sliding-window convention (test_hybrid_presses.py)
        assert isinstance(p, cls) and type(p) is hybrid_press_class(cls) and p.compression_ratio == 0.9
    assert make_press("snapkv", 0.25, window_size=8).window_size == 8
    assert make_press("knorm", 1.0).compression_ratio == 0.0


def test_one_method_definition_round_trips_through_presses_configs_and_layers():
    """Every name of arckv_press.methods builds a press of its own press class whose ``method`` is that
    name again, with the selector / variant of the definition; the compaction config and the layer
    method accept exactly ARC-KV and Attention Matching names; lookups fail with the valid names."""
    from arckv_press.config import CompactionConfig
    from arckv_press.compaction.layer import LayerMethod
    from arckv_press.methods import COMPACTION_METHODS, Method, am_method, arckv_method, method
    from arckv_press.presses import hybrid_press_class

    assert COMPACTION_METHODS == tuple(n for n in METHOD_NAMES if METHODS[n].family in ("arckv", "am"))
    for name, spec in METHODS.items():
        assert method(name) is spec and spec.name == name
        press = make_press(name, 0.5)
        if spec.family == "none":
            assert press is None and spec.press_class() is None
            continue
        assert type(press) is hybrid_press_class(spec.press_class())  # ours: the class itself
        if spec.ours:
            assert press.method == name and press.compaction_config().method == name
            assert LayerMethod(name).definition is spec and CompactionConfig(method=name).family == spec.family
            found = arckv_method(spec.selector) if spec.family == "arckv" else am_method(spec.variant)
            assert found is spec
            assert (press.selector if spec.family == "arckv" else press.variant) == (spec.selector or spec.variant)
        else:
            with pytest.raises(ValueError, match=f"unknown method '{name}'; valid methods: arckv, arckv-ha"):
                CompactionConfig(method=name)
    assert [m.name for m in METHODS.values() if m.uses_indexer] == ["arckv"]
    with pytest.raises(ValueError, match="unknown method 'h2o'"):
        method("h2o")
    with pytest.raises(ValueError, match="ARC-KV methods have a selector"):
        Method("x", "kvpress", "d", selector="ha")


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_every_registry_entry_end_to_end_tiny(tiny_model, tmp_path, name):
    model, tok = tiny_model("llama", num_layers=2, initializer_range=TINY_INIT), _word_tokenizer()
    # KVzip (and our presses without tokenizer=) reload the tokenizer from config.name_or_path
    tok.save_pretrained(tmp_path)
    model.config._name_or_path = str(tmp_path)
    pipe, context, ratio = _pipe(model, tok), _tiny_context(), 0.5
    ctx_len = _context_ids(pipe, context).shape[1]
    P = len(framing_for(tok).prefix_ids)
    press = make_press(name, ratio)
    cache = DynamicCache()
    if name == "arckv":  # no indexer is shipped for a random tiny model: a clear error, not a fallback
        with pytest.raises(ValueError, match="no value-aware indexer is shipped.*arckv-ha"):
            _ask(pipe, context, QUESTIONS_TINY[:1], press=press, cache=cache)
        assert _no_hooks(model)
        # with a checkpoint trained for this model (here: freshly initialised) it runs end to end
        indexer = ValueAwareIndexer(IndexerConfig.from_model_config(model.config), seed=0)
        path = save_indexer(indexer, tmp_path / "indexer", model_id(model), config_hash(model.config))
        press, cache = make_press(name, ratio, indexer=str(path)), DynamicCache()
    answers = _ask(pipe, context, QUESTIONS_TINY[:1], press=press, cache=cache)
    assert isinstance(answers[0], str) and answers[0]
    family = METHODS[name].family
    if family in ("arckv", "am"):
        kept = math.floor(ratio * (ctx_len - P))
        if family == "am":  # uniform budgets floor(rho T); ARC-KV: global budgets with the same total
            assert [layer.lengths.tolist() for layer in cache.layers] == [[kept, kept]] * 2
        assert sum(int(layer.lengths.sum()) for layer in cache.layers) == 2 * 2 * kept
        assert cache.get_seq_length() == ctx_len  # questions trimmed away, original positions
    elif name == "kvzip":  # fake compression: pruned positions are masked at decoding time
        masked = sum(len(layer.self_attn.masked_key_indices[0]) for layer in model.model.layers)
        assert masked == int(2 * 2 * ctx_len * (1 - ratio))  # layers x KV heads x context x removed fraction
        assert cache.get_seq_length() == ctx_len
    elif name == "none":
        assert cache.get_seq_length() == ctx_len
    else:  # kvpress scorer presses keep int(T * (1 - compression_ratio)) positions per layer
        assert all(layer.keys.shape[2] == int(ctx_len * ratio) for layer in cache.layers)
    assert _no_hooks(model)


@pytest.mark.model
def test_kvzip_default_model_offline(fp32_model):
    """KVzip reloads the tokenizer from config.name_or_path: a local folder, so it works offline."""
    import os

    model, tok = fp32_model
    assert os.environ.get("HF_HUB_OFFLINE") == "1" and os.path.isdir(model.config.name_or_path)
    pipe = _pipe(model, tok)
    ctx_len = _context_ids(pipe, DEFAULT_CONTEXT).shape[1]
    answers = _ask(pipe, DEFAULT_CONTEXT, QUESTIONS_DEFAULT[1:], press=make_press("kvzip", 0.3), max_new_tokens=10)
    assert isinstance(answers[0], str) and answers[0]
    cfg = model.config
    masked = sum(len(layer.self_attn.masked_key_indices[0]) for layer in model.model.layers)
    assert masked == int(cfg.num_hidden_layers * cfg.num_key_value_heads * ctx_len * 0.7)


def _kvzip_tiny(tiny_model, tmp_path):
    model, tok = tiny_model("llama", num_layers=2, initializer_range=TINY_INIT), _word_tokenizer()
    tok.save_pretrained(tmp_path)
    model.config._name_or_path = str(tmp_path)
    return model, _pipe(model, tok), _tiny_context()


def test_kvzip_changes_answers_tiny(tiny_model, tmp_path):
    model, pipe, context = _kvzip_tiny(tiny_model, tmp_path)
    assert _ask(pipe, context, QUESTIONS_TINY, press=make_press("kvzip", 0.2)) != _ask(pipe, context, QUESTIONS_TINY)


def test_kvzip_after_arckv_attention(tiny_model, tmp_path):
    model, pipe, context = _kvzip_tiny(tiny_model, tmp_path)
    ref = _ask(pipe, context, QUESTIONS_TINY, press=make_press("kvzip", 0.2))
    enable_compact_attention(model)  # what any ARC-KV press leaves behind
    assert _ask(pipe, context, QUESTIONS_TINY, press=make_press("kvzip", 0.2)) == ref


def test_prefill_with_press_helper(tiny_model):
    model, tok = tiny_model("llama", num_layers=2), _word_tokenizer()
    ids = torch.tensor([framing_for(tok).prefix_ids + tok.encode(_tiny_context(60), add_special_tokens=False)])
    cache = prefill_with_press(model, make_press("arckv-ha", 0.5, tokenizer=tok, config_options={"budgets": "fixed"}), ids)
    T = ids.shape[1] - 2
    assert [layer.lengths.tolist() for layer in cache.layers] == [[T // 2, T // 2]] * 2
    assert prefill_with_press(model, make_press("knorm", 0.5), ids).get_seq_length() == ids.shape[1] // 2
    assert prefill_with_press(model, None, ids).get_seq_length() == ids.shape[1]


# --------------------------------------------------------------------------- ratio conventions and errors
def test_ratio_conventions():
    assert (ARCKVPress().ratio, ARCKVPress().compression_ratio) == (0.1, 0.9)
    p = ARCKVPress(compression_ratio=0.75)
    assert (p.ratio, p.compression_ratio) == (0.25, 0.75)
    p = AttentionMatchingPress(ratio=0.2, compression_ratio=0.8)
    assert (p.ratio, p.compression_ratio) == (0.2, 0.8)
    p.compression_ratio = 0.6  # as kvpress evaluation code does: both stay in sync
    assert (p.ratio, p.compression_ratio) == (0.4, 0.6)
    p.ratio = 0.05
    assert (p.ratio, p.compression_ratio) == (0.05, 0.95)
    assert p.compaction_config().ratio == 0.05


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: ARCKVPress(ratio=0.0), r"\(0, 1\], got 0.0"),
        (lambda: ARCKVPress(ratio=1.5), r"\(0, 1\], got 1.5"),
        (lambda: AttentionMatchingPress(ratio=-0.1), r"\(0, 1\], got -0.1"),
        (lambda: AttentionMatchingPress(ratio=float("nan")), "NaN"),
        (lambda: ARCKVPress(compression_ratio=1.0), r"compression_ratio .* \[0, 1\), got 1.0"),
        (lambda: ARCKVPress(ratio=0.2, compression_ratio=0.5), "inconsistent"),
        (lambda: make_press("snapkv", 0.0), r"\(0, 1\], got 0.0"),
        (lambda: make_press("arckv-ha", 1.2), r"\(0, 1\], got 1.2"),
        (lambda: make_press("none", 2.0), r"\(0, 1\], got 2.0"),
        (lambda: make_press("h2o", 0.5), "unknown method 'h2o'; valid methods: arckv, arckv-ha, .*streaming_llm, none"),
        (lambda: make_press("snapkv", 0.5, lambda_m=0.3), r"does not take option\(s\) \['lambda_m'\].*window_size"),
        (lambda: make_press("arckv-ha", 0.5, selector="vi"), r"does not take option\(s\) \['selector'\]"),
        (lambda: ARCKVPress(selector="topk"), "unknown ARC-KV selector 'topk'"),
        (lambda: AttentionMatchingPress(variant="lasso"), "unknown Attention-Matching variant 'lasso'"),
        (lambda: ARCKVPress(lambda_m=2.0), "lambda_m"),
        (lambda: ARCKVPress(config_options={"ratio": 0.5}), r"must not set \['ratio'\]"),
        (lambda: ARCKVPress(config_options={"foo": 1}), r"unknown CompactionConfig field\(s\) \['foo'\]"),
    ],
)
def test_bad_configuration(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_ratio_type_error():
    with pytest.raises(TypeError, match="ratio must be a float"):
        ARCKVPress(ratio="0.5")


def test_unsupported_model_gpt2():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=64)).eval()
    with pytest.raises(ValueError, match="GPT2LMHeadModel .*not supported by ARC-KV.*rotary"):
        with ARCKVPress(ratio=0.5, selector="ha", tokenizer=_word_tokenizer())(model):
            pass


def test_unsupported_model_with_rope_but_fused_projections():
    """Phi-3 has RoPE and GQA but one fused qkv_proj: refused by both presses, naming the reason."""
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                        intermediate_size=64, vocab_size=128, pad_token_id=0)
    model = Phi3ForCausalLM(config).eval()
    for press in (ARCKVPress(ratio=0.5, selector="ha", tokenizer=_word_tokenizer()),
                  AttentionMatchingPress(ratio=0.5, tokenizer=_word_tokenizer())):
        with pytest.raises(ValueError, match=r"Phi3ForCausalLM .*not supported by ARC-KV.*no q_proj/k_proj \(fused"):
            with press(model):
                pass


def test_batch_of_two_is_rejected(tiny_model):
    model, tok = tiny_model("llama", num_layers=2), _word_tokenizer()
    press = ARCKVPress(ratio=0.5, selector="ha", tokenizer=tok)
    with pytest.raises(ValueError, match=r"batch size 1.*shape \(2, 30\)"):
        with torch.inference_mode(), press(model):
            model.model(input_ids=torch.randint(0, 128, (2, 30)), past_key_values=DynamicCache(config=model.config))
    assert _no_hooks(model) and press.last_report is None


def test_indexer_selector_without_checkpoint(tiny_model):
    model, tok = tiny_model("llama", num_layers=2), _word_tokenizer()
    press = ARCKVPress(ratio=0.5, tokenizer=tok)  # selector="indexer" (method arckv) is the default
    assert press.method == "arckv"
    ids = torch.tensor([framing_for(tok).prefix_ids + tok.encode(_tiny_context(40), add_special_tokens=False)])
    with pytest.raises(ValueError, match="no value-aware indexer is shipped for 'unnamed-llama-.*pass indexer="):
        with torch.inference_mode(), press(model):
            model.model(input_ids=ids, past_key_values=DynamicCache(config=model.config))
    assert _no_hooks(model)


def test_misuse_inside_the_block(tiny_model):
    model, tok = tiny_model("llama", num_layers=2), _word_tokenizer()
    ids = torch.tensor([framing_for(tok).prefix_ids + tok.encode(_tiny_context(40), add_special_tokens=False)])
    press = ARCKVPress(ratio=0.5, selector="ha", tokenizer=tok)
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        with pytest.raises(ValueError, match="run only the context prefill inside the block"):
            with press(model):
                model.model(input_ids=ids, past_key_values=cache)
                model.model(input_ids=ids[:, :3], past_key_values=cache)  # a question inside the block
        with pytest.raises(ValueError, match="empty cache; the cache already holds"):
            with press(model):
                model.model(input_ids=ids, past_key_values=cache)
        with pytest.raises(RuntimeError, match="user error"):  # the body raised: hooks removed, nothing compacted
            with press(model):
                raise RuntimeError("user error")
    assert _no_hooks(model) and press.last_report is None
    with pytest.raises(ValueError, match=r"pass tokenizer=\.\.\."):
        with ARCKVPress(ratio=0.5, selector="ha")(model):
            pass


def test_tokenizer_reload_never_downloads(tiny_model, monkeypatch):
    """Without ``tokenizer=``, the press reloads it from ``config.name_or_path`` from disk only
    (whatever HF_HUB_OFFLINE says); a tokenizer that is not on disk is a clear error."""
    import transformers

    calls = []

    def not_on_disk(name, **kwargs):
        calls.append((name, kwargs))
        raise OSError(f"{name} is not in the local cache")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", not_on_disk)
    model = tiny_model("llama", num_layers=2)
    model.config.name_or_path = "some-org/not-cached-model"
    with pytest.raises(ValueError, match=r"found none for 'some-org/not-cached-model' on disk.*pass tokenizer="):
        with ARCKVPress(ratio=0.5, selector="ha")(model):
            pass
    assert calls == [("some-org/not-cached-model", {"local_files_only": True})]
