"""kvpress's presses on a model with sliding-window layers (tiny random Gemma 3): only the global
layers are compressed, every sliding-window layer keeps its window (the convention of
``arckv_press.presses.hybrid_press_class``), against kvpress's own presses and brute force."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from arckv_press.presses import _LayerTypeRotary, hybrid_press_class, sliding_layer_indices
from arckv_press.registry import make_press, prefill_with_press
from conftest import build_tiny_model, build_tiny_tokenizer, make_text

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RATIO = 0.25  # kept fraction
T = 400


def _gemma(window: int = 32, **overrides):
    """Layers 0, 2 slide (window ``window``), 1, 3 are global; the two RoPE bases differ."""
    return build_tiny_model("gemma3", num_layers=4, sliding_window=window, initializer_range=0.1, **overrides)


def _ids(tok, seed: int = 1) -> torch.Tensor:
    ids = tok.encode(make_text(2000, seed=seed), add_special_tokens=False)[:T]
    return torch.tensor([ids])


def _with_tokenizer_folder(model, tok, tmp_path):
    """KVzip reloads the tokenizer from ``config.name_or_path``, as for a converted model."""
    tok.save_pretrained(tmp_path)
    model.config._name_or_path = str(tmp_path)
    return model


def test_sliding_layers_of_the_tiny_gemma():
    model = _gemma()
    assert sliding_layer_indices(model) == {0, 2}
    assert sliding_layer_indices(build_tiny_model("llama", num_layers=2)) == frozenset()


def _global_only(cls):
    """Reference: kvpress's press class with its forward hook skipped on layers 0 and 2 by hand."""

    class Reference(cls):
        def forward_hook(self, module, input, kwargs, output):
            return output if module.layer_idx in (0, 2) else super().forward_hook(module, input, kwargs, output)

    return Reference


@pytest.mark.parametrize("name", ["snapkv", "knorm", "streaming_llm"])
def test_scorer_presses_compress_the_global_layers_only(name):
    """The global layers hold what kvpress's press leaves when it is applied to them alone; the
    sliding layers equal the full cache's (their window)."""
    model, tok = _gemma(), build_tiny_tokenizer(chat_template=False)
    ids = _ids(tok)
    full = prefill_with_press(model, None, ids)
    press = make_press(name, RATIO)
    cls = type(press).__mro__[2]  # kvpress's class (after ours and the mixin)
    assert type(press) is hybrid_press_class(cls) and type(press).__name__ == cls.__name__
    cache = prefill_with_press(model, press, ids)
    options = {f.name: getattr(press, f.name) for f in dataclasses.fields(press) if f.init}
    reference = prefill_with_press(model, _global_only(cls)(**options), ids)
    for i in (1, 3):
        assert cache.layers[i].keys.shape[2] == int(T * RATIO)
        assert torch.equal(cache.layers[i].keys, reference.layers[i].keys)
        assert torch.equal(cache.layers[i].values, reference.layers[i].values)
    for i in (0, 2):
        assert torch.equal(cache.layers[i].keys, full.layers[i].keys)
        assert torch.equal(cache.layers[i].values, full.layers[i].values)


def test_kvpress_alone_shrinks_the_windows():
    """Why the convention is applied: kvpress's own Knorm compresses the sliding windows of a
    Gemma3ForCausalLM too."""
    from kvpress import KnormPress

    model, tok = _gemma(), build_tiny_tokenizer(chat_template=False)
    ids = _ids(tok)
    full = prefill_with_press(model, None, ids)
    theirs = prefill_with_press(model, KnormPress(compression_ratio=1 - RATIO), ids)
    assert theirs.layers[0].keys.shape[2] < full.layers[0].keys.shape[2] == 31


def test_a_model_without_sliding_layers_gets_kvpress_unchanged():
    model, tok = build_tiny_model("llama", num_layers=2, initializer_range=0.1), build_tiny_tokenizer(chat_template=False)
    ids = _ids(tok)
    ours = prefill_with_press(model, make_press("snapkv", RATIO), ids)
    from kvpress import SnapKVPress

    theirs = prefill_with_press(model, SnapKVPress(compression_ratio=1 - RATIO), ids)
    assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) for a, b in zip(ours.layers, theirs.layers))


def test_layer_type_rotary_is_the_models_rope_of_that_layer_type():
    model = _gemma()
    rotary = model.model.rotary_emb
    x, pos = torch.zeros(1, 5, 16), torch.arange(3, 8)[None]
    for kind in ("full_attention", "sliding_attention"):
        wrapped = _LayerTypeRotary(rotary, kind)
        cos, sin = wrapped(x, pos)
        theta = model.config.rope_parameters[kind]["rope_theta"]
        inv = 1.0 / theta ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
        angles = pos[0, :, None].double() * inv[None]
        assert torch.allclose(cos[0].double(), torch.cat([angles, angles], -1).cos(), atol=1e-6)
        assert torch.allclose(sin[0].double(), torch.cat([angles, angles], -1).sin(), atol=1e-6)
        assert torch.equal(wrapped.inv_freq, getattr(rotary, f"{kind}_inv_freq"))
    assert model.config.rope_parameters["full_attention"]["rope_theta"] != model.config.rope_parameters["sliding_attention"]["rope_theta"]


def test_expected_attention_runs_with_each_global_layers_own_rope():
    """kvpress's ExpectedAttentionPress calls ``rotary_emb(x, position_ids)``, which Gemma 3's
    rotary embedding refuses (it needs the layer type). Under the convention it runs; its global
    layers equal kvpress's press run on a model whose attention modules carry the global RoPE."""
    from kvpress import ExpectedAttentionPress

    model, tok = _gemma(), build_tiny_tokenizer(chat_template=False)
    ids = _ids(tok)
    full = prefill_with_press(model, None, ids)
    with pytest.raises(AttributeError, match="None_inv_freq"):  # kvpress's own press on Gemma3ForCausalLM
        prefill_with_press(model, ExpectedAttentionPress(compression_ratio=1 - RATIO), ids)
    cache = prefill_with_press(model, make_press("expected_attention", RATIO), ids)
    for i in (1, 3):
        assert cache.layers[i].keys.shape[2] == int(T * RATIO)
    for i in (0, 2):
        assert torch.equal(cache.layers[i].keys, full.layers[i].keys)
    assert all("rotary_emb" not in layer.self_attn._modules or not isinstance(layer.self_attn.rotary_emb, _LayerTypeRotary)
               for layer in model.model.layers)  # our wrappers are gone after the press

    # reference: kvpress's press with its rotary calls bound to the global RoPE by hand
    class GlobalRope(torch.nn.Module):
        def __init__(self, rotary):
            super().__init__()
            self.rotary = rotary

        def forward(self, x, position_ids):
            return self.rotary(x, position_ids, "full_attention")

    class Reference(ExpectedAttentionPress):
        def forward_hook(self, module, input, kwargs, output):
            if module.layer_idx in (0, 2):
                return output
            module.rotary_emb = GlobalRope(model.model.rotary_emb)
            return super().forward_hook(module, input, kwargs, output)

    reference = prefill_with_press(model, Reference(compression_ratio=1 - RATIO), ids)
    for i in (1, 3):
        assert torch.equal(cache.layers[i].keys, reference.layers[i].keys)
    for layer in model.model.layers:
        if "rotary_emb" in layer.self_attn._modules:
            del layer.self_attn.rotary_emb


def _masks(model):
    return [getattr(layer.self_attn, "masked_key_indices", None) for layer in model.model.layers]


def test_kvzip_scores_the_global_layers_and_spends_the_budget_there(tmp_path):
    """kvpress refuses KVzip on Gemma 3. Under the convention: the sliding layers keep their window
    and no mask; the global layers' reconstruction scores equal kvpress's own KVzip procedure run
    (past its model check) on a window longer than context + reconstruction, where the sliding
    layers never evict; the masks are the lowest scores over the global layers alone, at
    ``compression_ratio`` of their entries (brute-force top-k)."""
    from kvpress import KVzipPress

    tok = build_tiny_tokenizer(chat_template=False)
    ids = _ids(tok)
    with pytest.raises(ValueError, match="not supported for Gemma3"):
        prefill_with_press(_with_tokenizer_folder(_gemma(), tok, tmp_path), KVzipPress(compression_ratio=0.5), ids)

    model = _with_tokenizer_folder(_gemma(window=1024), tok, tmp_path)
    press = make_press("kvzip", RATIO, chunk_size=150)  # three reconstruction chunks
    scores = {}
    original_post = type(press).compress_post

    def keep_scores(self, m):
        scores["ours"] = self.score_val.clone()
        return original_post(self, m)

    type(press).compress_post = keep_scores
    try:
        full = prefill_with_press(model, None, ids)
        cache = prefill_with_press(model, press, ids)
    finally:
        type(press).compress_post = original_post
    masks = _masks(model)
    assert masks[0] is None and masks[2] is None
    for i in range(4):
        assert torch.equal(cache.layers[i].keys, full.layers[i].keys)  # KVzip masks, it does not remove

    # kvpress's own procedure, driven past its model check, hooks on every layer, on a cache of
    # plain layers (kvpress's slicing back of a layer would not reset a sliding layer's length)
    from transformers import DynamicCache

    ref = KVzipPress(compression_ratio=1 - RATIO, chunk_size=150)
    ref_cache = DynamicCache()  # bare: prefill_with_press would give it the model's layout
    with torch.inference_mode():
        model.model(input_ids=ids, past_key_values=ref_cache)
    ref._context_ids, ref._cache, ref.prefix_length = ids, ref_cache, 0
    ref._suffix_ids = torch.tensor([tok.encode("\n", add_special_tokens=False)])
    ref.compress_post = lambda m: None
    with torch.inference_mode():
        KVzipPress._perform_kvzip_compression(ref, model, tok)
    for i in (1, 3):
        assert torch.allclose(scores["ours"][i], ref.score_val[i], rtol=1e-5, atol=1e-7)

    glob = scores["ours"][[1, 3]].clone()
    glob[..., : press.n_sink] = glob.amax() + 1.0
    n_pruned = int(glob.numel() * (1 - RATIO))
    lowest = set(torch.topk(-glob.reshape(-1), n_pruned).indices.tolist())
    per_layer = glob[0].numel()
    got = set()
    for j, i in enumerate((1, 3)):
        _, heads, positions = masks[i]
        got |= {j * per_layer + int(h) * T + int(p) for h, p in zip(heads, positions)}
    assert got == lowest and len(got) == n_pruned
    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None


def test_kvzip_on_a_short_window_keeps_the_windows_and_answers(tmp_path):
    """With a window shorter than the context, the reconstruction chunks would evict the context
    from the sliding layers; they hold the context's last window again afterwards, and the cache
    decodes."""
    tok = build_tiny_tokenizer(chat_template=False)
    model = _with_tokenizer_folder(_gemma(window=32), tok, tmp_path)
    model.generation_config.eos_token_id = 2
    ids = _ids(tok)
    full = prefill_with_press(model, None, ids)
    cache = prefill_with_press(model, make_press("kvzip", RATIO, chunk_size=150), ids)
    for i in (0, 2):
        assert torch.equal(cache.layers[i].keys, full.layers[i].keys)
        assert torch.equal(cache.layers[i].values, full.layers[i].values)
    masks = _masks(model)
    assert masks[0] is None and masks[2] is None
    assert sum(len(masks[i][0]) for i in (1, 3)) == int(2 * 2 * T * (1 - RATIO))
    # decoding one token at a time (kvpress's fake keys for the masked entries need the queries of a
    # step to lie in a half-space, which a random tiny model's many question rows need not)
    from arckv_press.generation import greedy_decode

    with torch.inference_mode():
        out = greedy_decode(model, cache, ids[:, -1:], torch.tensor([[T]]), 4)[0]
    assert len(out) >= 1 and cache.get_seq_length() == full.get_seq_length()
    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None


def test_compaction_report_gives_the_compacted_layers_and_the_whole_cache():
    """ARC-KV on the tiny Gemma compacts the global layers; the report's sizes against brute force:
    ``compact_bytes`` the entries of the global layers, ``full_bytes`` their uncompressed rows,
    ``cache_bytes`` / ``full_cache_bytes`` every layer, the sliding windows included."""
    from arckv_press.api import compact

    model, tok = _gemma(), build_tiny_tokenizer(chat_template=False)
    text = make_text(600, seed=2)
    with torch.inference_mode():
        cache = compact(model, tok, text, method="arckv-ha", ratio=RATIO)
    r = cache.report
    P, n = r.prefix_length, r.prefix_length + r.original_length
    H, D, f32 = 2, 16, 4
    window = 31  # the sliding layers keep sliding_window - 1 rows after the prefill
    entries = sum(int(cache.layers[i].lengths.sum()) for i in (1, 3))
    assert r.compact_bytes == entries * (2 * D * f32 + 4)
    assert r.full_bytes == 2 * (2 * H * n * D * f32)
    sliding = 2 * (2 * H * window * D * f32)
    assert r.full_cache_bytes == r.full_bytes + sliding
    assert r.cache_bytes == r.compact_bytes + 2 * (2 * H * P * D * f32) + sliding
    assert r.cache_bytes < r.full_cache_bytes and r.compact_bytes < RATIO * r.full_bytes * 1.2


def test_demo_table_gives_the_compacted_layers_and_the_whole_cache(tmp_path, capsys):
    """``arckv demo`` on a tiny Gemma (a base tokenizer, no chat template): per method the bytes of
    the compacted (global) layers and of the whole cache, sliding windows included; the full
    cache's row against brute force, and every method leaves the windows alone."""
    from arckv_press import cli

    folder = tmp_path / "model"
    model = _gemma()
    model.config.eos_token_id = 2
    model.save_pretrained(folder)
    build_tiny_tokenizer(chat_template=False).save_pretrained(folder)
    haystack = tmp_path / "hay.txt"
    haystack.write_text(make_text(3000, seed=2), encoding="utf-8")
    methods = ["none", "arckv-ha", "snapkv", "expected_attention"]  # KVzip: its own tests (random queries)
    assert cli.main(["--model", str(folder), "--dtype", "float32", "demo", "--tokens", "300", "--ratio", "0.25",
                     "--haystack", str(haystack), "--max-new-tokens", "2", "--methods", *methods]) == 0
    out = capsys.readouterr().out
    assert "[completion (Question: ... Answer:)]" in out and "global layers [1, 3]" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0] in methods}
    assert list(rows) == methods, out
    n = int(out.split("context ")[1].split()[0]) + 1  # + BOS
    row_bytes = 2 * 2 * 16 * 4  # keys + values, 2 KV heads, head_dim 16, float32
    window = 2 * 31 * row_bytes  # two sliding layers, 31 rows each
    layers_mib, cache_mib = float(rows["none"][2]), float(rows["none"][3])
    assert layers_mib == pytest.approx(2 * n * row_bytes / 2**20, abs=0.006)
    assert cache_mib == pytest.approx((2 * n * row_bytes + window) / 2**20, abs=0.006)
    for name in ("arckv-ha", "snapkv", "expected_attention"):
        layers, cache = float(rows[name][2]), float(rows[name][3])
        assert layers < 0.5 * layers_mib and cache == pytest.approx(layers + window / 2**20, abs=0.011), rows[name]


@pytest.mark.parametrize("family,name,given", [("gemma3", "snapkv", None), ("gemma3", "expected_attention", None),
                                               ("gemma3", None, None), ("llama", "snapkv", None),
                                               ("gemma3", "snapkv", "config"), ("gemma3", "snapkv", "bare")])
def test_tokens_fed_after_an_evicted_cache_do_not_see_their_future(family, name, given):
    """A batched continuation after an evicting press equals feeding it one token at a time (where
    no later token exists to be seen), and so does the benchmark's NLL. On a hybrid model the new
    tokens' cache positions come from a sliding layer that counts every token seen, past the global
    layers' kept rows; before ``EvictableLayer`` every continuation token saw every later one there
    (continuation NLLs far below the full cache's). ``given``: the caller hands the prefill its own
    plain ``DynamicCache`` (made from the config, or bare as kvpress's pipeline makes it), which
    gets the same mask (:func:`~arckv_press.cache.make_evictable`)."""
    from transformers import DynamicCache

    from arckv_press.cache import EvictableLayer, cache_snapshot, restore_cache
    from arckv_press.probe_metrics import continuation_nll

    model = _gemma() if family == "gemma3" else build_tiny_model("llama", num_layers=2, initializer_range=0.1)
    tok = build_tiny_tokenizer(chat_template=False)
    ids = _ids(tok)
    cont = torch.tensor([tok.encode(make_text(300, seed=2), add_special_tokens=False)[:24]])
    mine = {None: None, "config": lambda: DynamicCache(config=model.config), "bare": DynamicCache}[given]
    cache = prefill_with_press(model, make_press(name, RATIO) if name else None, ids, mine() if mine else None)
    globals_ = [i for i in range(len(cache.layers)) if i not in sliding_layer_indices(model)]
    assert all(type(cache.layers[i]) is EvictableLayer for i in globals_)
    assert cache.layers[globals_[0]].keys.shape[2] == (int(T * RATIO) if name else T)
    state = cache_snapshot(cache)
    pos = torch.arange(T, T + cont.shape[1])[None]
    with torch.no_grad():
        batched = model(input_ids=cont, past_key_values=cache, position_ids=pos).logits[0]
        restore_cache(cache, state)
        stepwise = torch.stack([model(input_ids=cont[:, i : i + 1], past_key_values=cache,
                                      position_ids=pos[:, i : i + 1]).logits[0, 0] for i in range(cont.shape[1])])
        restore_cache(cache, state)
        nll = continuation_nll(model, cache, cont, T)
    torch.testing.assert_close(batched, stepwise, atol=1e-4, rtol=1e-4)
    reference = torch.nn.functional.cross_entropy(stepwise[:-1], cont[0, 1:])
    assert nll == pytest.approx(float(reference), abs=1e-4)


def test_the_compaction_bench_clones_a_hybrid_cache_with_its_counts():
    """``bench_compaction.clone_cache`` (each method compacts a copy of one prefill): on a model with
    sliding-window layers the copy holds the same rows, in new storage, and the same token counts
    (a sliding layer holds its window but has seen the whole context; the compaction checks that
    count against the document)."""
    from arckv_press.bench.bench_compaction import clone_cache
    from arckv_press.cache import new_cache

    model, tok = _gemma(), build_tiny_tokenizer(chat_template=False)
    ids = _ids(tok)
    cache = prefill_with_press(model, None, ids)
    copy = clone_cache(cache)
    assert [type(a) for a in copy.layers] == [type(a) for a in new_cache(model).layers]
    assert [copy.get_seq_length(i) for i in range(len(copy.layers))] == [ids.shape[1]] * len(copy.layers)
    for a, b in zip(cache.layers, copy.layers):
        assert a.keys.shape[2] == b.keys.shape[2] < ids.shape[1] or a.keys.shape[2] == ids.shape[1]
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert a.keys.data_ptr() != b.keys.data_ptr()
