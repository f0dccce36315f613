"""CompactCache + ARC-KV attention: identity, exactness vs float64, memory, save/load, errors."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from arckv_press.attention import compact_attention, compact_attention_forward, enable_compact_attention
from arckv_press.cache import CacheFileError, CacheMetadata, CompactCache, CompactLayer, pack_heads, unpack_heads


def identity_cache(dyn: DynamicCache, prefix: int = 0) -> CompactCache:
    """A CompactCache holding every position of ``dyn`` (beta = 0, values unchanged)."""
    layers = []
    for i, layer in enumerate(dyn.layers):
        K, V = layer.keys[0, :, prefix:], layer.values[0, :, prefix:]
        H, T, D = K.shape
        layers.append(
            CompactLayer(
                K.reshape(-1, D), torch.zeros(H * T), V.reshape(-1, D), torch.full((H,), T), T, i,
                layer.keys[:, :, :prefix], layer.values[:, :, :prefix],
            )
        )
    return CompactCache(layers)


def random_layer(H=2, D=16, lengths=(3, 7), span=10, n_fixed=2, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    ck = torch.randn(n, D, generator=g, dtype=torch.float64).to(dtype)
    cv = torch.randn(n, D, generator=g, dtype=torch.float64).to(dtype)
    beta = torch.randn(n, generator=g, dtype=torch.float64).float()
    fk = torch.randn(1, H, n_fixed, D, generator=g, dtype=torch.float64).to(dtype)
    fv = torch.randn(1, H, n_fixed, D, generator=g, dtype=torch.float64).to(dtype)
    return CompactLayer(ck, beta, cv, torch.tensor(lengths), span, 0, fk, fv)


def reference_attention(layer: CompactLayer, q: torch.Tensor, scaling: float) -> torch.Tensor:
    """float64 formula per query head: softmax(s q [C_k; K_new]^T + [beta; 0] + causal) [C_v; V_new]."""
    B, Hq, n, D = q.shape
    H = layer.num_heads
    G = Hq // H
    out = torch.zeros(B, n, Hq, D, dtype=torch.float64)
    offsets = [0] + torch.cumsum(layer.lengths, 0).tolist()
    A = layer.num_appended
    for b in range(B):
        for hq in range(Hq):
            h = hq // G
            ck = layer.ck[offsets[h] : offsets[h + 1]].double()
            cv = layer.cv[offsets[h] : offsets[h + 1]].double()
            beta = layer.beta[offsets[h] : offsets[h + 1]].double()
            kn, vn = layer._new_k[b, h].double(), layer._new_v[b, h].double()
            for i in range(n):
                visible = A - n + i + 1  # ordinary rows visible to query i (causal)
                logits = torch.cat([scaling * ck @ q[b, hq, i].double() + beta, scaling * kn[:visible] @ q[b, hq, i].double()])
                p = torch.softmax(logits, 0)
                out[b, i, hq] = p @ torch.cat([cv, vn[:visible]])
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_identity_tiny(tiny_model, family):
    model = tiny_model(family, num_layers=2)
    g = torch.Generator().manual_seed(1)
    ctx, q = torch.randint(0, 128, (1, 40), generator=g), torch.randint(0, 128, (1, 6), generator=g)
    with torch.no_grad():
        ref_cache = DynamicCache(config=model.config)
        model(ctx, past_key_values=ref_cache)
        ref = model(q, past_key_values=ref_cache).logits
        dyn = DynamicCache(config=model.config)
        model(ctx, past_key_values=dyn)
        cache = identity_cache(dyn, prefix=3)
        with compact_attention(model):
            out = model(q, past_key_values=cache).logits
            assert cache.get_seq_length() == 46
            step = model(q[:, :1], past_key_values=cache).logits
        ref_step = model(q[:, :1], past_key_values=ref_cache).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(step, ref_step, atol=1e-5, rtol=0)


def test_identity_generate_tiny(tiny_model):
    model = tiny_model("llama", num_layers=2)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 128, (1, 50), generator=g)
    ctx_len = 40
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=8, do_sample=False)
        dyn = DynamicCache(config=model.config)
        model(ids[:, :ctx_len], past_key_values=dyn)
        cache = identity_cache(dyn)
        with compact_attention(model):
            out = model.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, ref)


@pytest.mark.model
def test_identity_default_model(default_model_fp32):
    model, tok = default_model_fp32
    text = "The quick brown fox jumps over the lazy dog. " * 20 + "The secret code is 4521."
    ids = torch.tensor([tok.encode(text)])
    q = torch.tensor([tok.encode(" What is the secret code? The secret code is")])
    with torch.no_grad():
        ref_cache = DynamicCache(config=model.config)
        model(ids, past_key_values=ref_cache)
        ref = model(q, past_key_values=ref_cache).logits
        dyn = DynamicCache(config=model.config)
        model(ids, past_key_values=dyn)
        cache = identity_cache(dyn)
        with compact_attention(model):
            out = model(q, past_key_values=cache).logits
            full = torch.cat([ids, q], 1)
            gen = model.generate(full, past_key_values=identity_cache(dyn), max_new_tokens=6, do_sample=False)
        ref_gen = model.generate(full, max_new_tokens=6, do_sample=False)
    # 30 layers of a different float32 summation order than the model's SDPA kernel: ~3e-5 on logits
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
    assert torch.equal(gen, ref_gen)


@pytest.mark.parametrize("n", [1, 4])
def test_exact_formula_float64(n):
    layer = random_layer(H=2, D=16, lengths=(3, 7), span=10, n_fixed=2, seed=n)
    g = torch.Generator().manual_seed(10 + n)
    Hq, D = 6, 16  # G = 3
    scaling = D**-0.5
    for step in range(2):  # two appends: n tokens, then one more
        m = n if step == 0 else 1
        new_k = torch.randn(1, 2, m, D, generator=g)
        new_v = torch.randn(1, 2, m, D, generator=g)
        q = torch.randn(1, Hq, m, D, generator=g)
        keys, values = layer.update(new_k, new_v)
        assert keys.shape == (1, 2, 2 + (n if step == 0 else n + 1), D + 1)
        out, _ = compact_attention_forward(None, q, keys, values, None, scaling=scaling)
        ref = reference_attention(layer, q, scaling)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_mask_padding_columns_used_for_appended_rows():
    """With a 4D boolean mask the last A columns govern the ordinary rows (padding respected)."""
    layer = random_layer(lengths=(2, 4), span=6, n_fixed=1)
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, 2, 3, 16, generator=g), torch.randn(1, 2, 3, 16, generator=g)
    keys, values = layer.update(k, v)
    q = torch.randn(1, 4, 3, 16, generator=g)
    # model-layout mask: span (6) + 4 ordinary rows = 10 columns; hide ordinary row 1 (a pad token)
    mask = torch.ones(1, 1, 3, 10, dtype=torch.bool).tril(diagonal=7)
    mask[..., 6 + 1] = False
    out, _ = compact_attention_forward(None, q, keys, values, mask, scaling=0.25)
    # reference: drop that row from the layer and recompute
    layer._new_k = layer._new_k[:, :, [0, 2, 3]]
    layer._new_v = layer._new_v[:, :, [0, 2, 3]]
    ref = reference_attention(layer, q, 0.25)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_memory_is_packed():
    lengths = (5, 1, 9)
    layer = random_layer(H=3, D=32, lengths=lengths, span=12, n_fixed=0, dtype=torch.bfloat16)
    expected = sum(lengths) * (2 * 32 * 2 + 4)  # bf16 keys + values, float32 beta
    assert layer.compact_nbytes() == expected
    assert layer.ck.shape == (15, 32) and layer.cv.shape == (15, 32) and layer.beta.shape == (15,)
    cache = CompactCache([layer])
    assert cache.compact_nbytes() == expected
    assert math.isclose(cache.realised_ratio(), 15 / 36)


def test_pack_unpack_roundtrip():
    x = torch.arange(24.0).view(3, 4, 2)
    valid = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    packed, lengths = pack_heads(x, valid)
    assert lengths.tolist() == [2, 4, 1]
    back = unpack_heads(packed, lengths)
    assert torch.equal(back[valid], x[valid]) and torch.equal(back[~valid], torch.zeros(5, 2))
    with pytest.raises(ValueError, match="prefix"):
        pack_heads(x, torch.tensor([[0, 1, 0, 0], [1] * 4, [1, 0, 0, 0]], dtype=torch.bool))


def test_pipeline_style_trimming():
    layer = random_layer(lengths=(3, 7), span=10, n_fixed=2)
    before = layer.get_seq_length()
    assert before == 12
    layer.update(torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16))
    assert layer.get_seq_length() == 17
    assert torch.isnan(layer.keys[:, :, :10]).all()  # placeholders, never usable as keys
    layer.keys = layer.keys[:, :, :before]
    layer.values = layer.values[:, :, :before]
    assert layer.num_appended == 2 and layer.get_seq_length() == 12


def test_batch_repeat_matches_batch_one():
    layer = random_layer(lengths=(3, 5), span=8, n_fixed=2)
    g = torch.Generator().manual_seed(4)
    k, v, q = torch.randn(2, 2, 3, 16, generator=g), torch.randn(2, 2, 3, 16, generator=g), torch.randn(2, 4, 3, 16, generator=g)
    import copy

    single = [copy.deepcopy(layer) for _ in range(2)]
    keys, values = layer.update(k, v)  # batch 2 from a batch-1 cache: rows share the context
    out, _ = compact_attention_forward(None, q, keys, values, None, scaling=0.25)
    for b in range(2):
        kb, vb = single[b].update(k[b : b + 1], v[b : b + 1])
        ob, _ = compact_attention_forward(None, q[b : b + 1], kb, vb, None, scaling=0.25)
        torch.testing.assert_close(out[b : b + 1], ob)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(lengths=torch.tensor([3, 0])), "head 1: t = 0"),
        (dict(lengths=torch.tensor([3, 11]), span=10), "head 1: t = 11"),
        (dict(beta_nan=1), "head 1: beta contains NaN"),
        (dict(value_inf=0), "head 0: C_v contains NaN or inf"),
        (dict(values_short=True), "packed shapes disagree"),
    ],
)
def test_bad_input(change, message):
    D = 8
    lengths = change.get("lengths", torch.tensor([3, 7]))
    n = int(lengths.sum())
    ck, cv, beta = torch.randn(n, D), torch.randn(n, D), torch.zeros(n)
    if "beta_nan" in change:
        beta[-1] = float("nan")
    if "value_inf" in change:
        cv[0, 0] = float("inf")
    if change.get("values_short"):
        cv = cv[:-1]
    with pytest.raises(ValueError, match=f"layer 5.*{message}"):
        CompactLayer(ck, beta, cv, lengths, change.get("span", 10), 5)


def test_save_load_roundtrip(tiny_model, tmp_path):
    from arckv_press.models import config_hash, model_id, weights_fingerprint

    model = tiny_model("llama", num_layers=2)
    other = tiny_model("qwen3", num_layers=2)
    g = torch.Generator().manual_seed(5)
    ctx, q = torch.randint(0, 128, (1, 30), generator=g), torch.randint(0, 128, (1, 5), generator=g)
    with torch.no_grad():
        dyn = DynamicCache(config=model.config)
        model(ctx, past_key_values=dyn)
        cache = identity_cache(dyn, prefix=2)
        # make it non-trivial: random bias and per-head lengths on layer 0
        layer = cache.layers[0]
        cache.layers[0] = CompactLayer(
            layer.ck[:-4], torch.randn(layer.ck.shape[0] - 4), layer.cv[:-4], layer.lengths - torch.tensor([0, 4]),
            layer.span, 0, layer._new_k, layer._new_v,
        )
        cache.metadata = CacheMetadata(model_id(model), config_hash(model.config), "arckv-ha", 0.9, 30, "0",
                                       extra={"prefix_length": 2}, weights_fingerprint=weights_fingerprint(model))
        path = tmp_path / "c.arckv"
        cache.save(path)
        loaded = CompactCache.load(path, model)
        enable_compact_attention(model)
        a = model(q, past_key_values=cache).logits
        b = model(q, past_key_values=loaded).logits
    assert torch.equal(a, b)
    assert loaded.layers[0].lengths.tolist() == [28, 24]
    assert loaded.metadata == cache.metadata
    with pytest.raises(CacheFileError, match="was built for model"):
        CompactCache.load(path, other)


def test_weights_fingerprint_tells_apart_same_architecture_models(tiny_model, tmp_path):
    """Same config, other weights (a base model and its tune, or any one parameter changed: another
    layer, the queries, the MLP, the embeddings, a norm): the saved cache is refused unless
    ``check_weights=False``; a bf16 load of the same weights matches; a file without a fingerprint
    is refused unless the caller opts out by name."""
    from arckv_press.models import config_hash, model_id, weights_fingerprint

    model, retrained = tiny_model("llama", num_layers=2, seed=0), tiny_model("llama", num_layers=2, seed=1)
    assert config_hash(model) == config_hash(retrained)
    assert weights_fingerprint(model) != weights_fingerprint(retrained)
    halved = tiny_model("llama", num_layers=2, seed=0).to(torch.bfloat16)
    assert weights_fingerprint(halved) == weights_fingerprint(model)
    names = [name for name, _ in model.named_parameters()]
    for name in ("model.layers.1.self_attn.k_proj.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight", "model.norm.weight", names[-1]):
        nudged = tiny_model("llama", num_layers=2, seed=0)
        with torch.no_grad():
            dict(nudged.named_parameters())[name].view(-1)[-1] += 1.0
        assert weights_fingerprint(nudged) != weights_fingerprint(model), name

    with torch.no_grad():
        dyn = DynamicCache(config=model.config)
        model(torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(0)), past_key_values=dyn)
    cache = identity_cache(dyn, prefix=2)
    path, unchecked = tmp_path / "c.arckv", tmp_path / "unchecked.arckv"
    cache.metadata = CacheMetadata(model_id(model), config_hash(model), "arckv-ha", 1.0, 20, "0",
                                   weights_fingerprint=weights_fingerprint(model))
    cache.save(path)
    CompactCache.load(path, model)
    with pytest.raises(CacheFileError, match="with other weights"):
        CompactCache.load(path, retrained)
    assert CompactCache.load(path, retrained, check_weights=False).layers[0].lengths.tolist() == [18, 18]
    cache.metadata = CacheMetadata(model_id(model), config_hash(model), "arckv-ha", 1.0, 20, "0")
    cache.save(unchecked)
    with pytest.raises(CacheFileError, match="no weights fingerprint.*allow_missing_fingerprint=True"):
        CompactCache.load(unchecked, model)
    assert CompactCache.load(unchecked, retrained, allow_missing_fingerprint=True).layers[1].span == 18


def test_default_attention_rejects_compact_working_copy(tiny_model):
    """Without the ARC-KV attention a compact cache fails loudly instead of answering wrongly."""
    model = tiny_model("llama", num_layers=2)
    with torch.no_grad():
        dyn = DynamicCache(config=model.config)
        model(torch.randint(0, 128, (1, 20)), past_key_values=dyn)
        cache = identity_cache(dyn)
        with pytest.raises(RuntimeError):
            model(torch.randint(0, 128, (1, 3)), past_key_values=cache)


def test_batch_before_any_appended_row():
    """A compact layer without ordinary rows accepts a batch: every row shares the context."""
    layer = random_layer(lengths=(4, 4), span=8, n_fixed=0)
    ref_layer = random_layer(lengths=(4, 4), span=8, n_fixed=0)
    g = torch.Generator().manual_seed(6)
    k, v, q = torch.randn(3, 2, 2, 16, generator=g), torch.randn(3, 2, 2, 16, generator=g), torch.randn(3, 4, 2, 16, generator=g)
    keys, values = layer.update(k, v)
    out, _ = compact_attention_forward(None, q, keys, values, None, scaling=0.25)
    kb, vb = ref_layer.update(k[1:2], v[1:2])
    ob, _ = compact_attention_forward(None, q[1:2], kb, vb, None, scaling=0.25)
    torch.testing.assert_close(out[1:2], ob)


def test_block_is_shared_views_or_gathered_padding():
    """Uniform budgets: the attached block is a view of the packed tensors (no copy); per-head
    lengths: the gathered padding equals unpack_heads with -inf bias on the pads."""
    uniform = random_layer(lengths=(4, 4), span=8, n_fixed=1)
    keys, _ = uniform.update(torch.randn(3, 2, 1, 16), torch.randn(3, 2, 1, 16))
    ck, beta, cv = keys.arckv_block
    assert ck.data_ptr() == uniform.ck.data_ptr() and cv.data_ptr() == uniform.cv.data_ptr()
    assert ck.shape == (2, 4, 16) and beta.data_ptr() == uniform.beta.data_ptr()
    ragged = random_layer(H=3, lengths=(2, 5, 3), span=8, n_fixed=1)
    keys, values = ragged.update(torch.randn(1, 3, 1, 16), torch.randn(1, 3, 1, 16))
    assert keys.shape == (1, 3, 2, 17) and torch.all(keys[..., 16] == 0) and values.shape == (1, 3, 2, 16)
    ck, beta, cv = keys.arckv_block
    valid = torch.arange(5)[None, :] < ragged.lengths[:, None]
    assert torch.equal(ck[valid], ragged.ck) and torch.equal(cv[valid], ragged.cv)  # pads: any finite rows
    assert torch.isfinite(ck).all() and torch.isfinite(cv).all()
    assert torch.equal(beta, unpack_heads(ragged.beta, ragged.lengths, fill=-math.inf))


def test_attention_refuses_keys_without_their_block():
    layer = random_layer(lengths=(3, 7), span=10, n_fixed=2)
    keys, values = layer.update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16))
    with pytest.raises(ValueError, match="without their compacted block"):
        compact_attention_forward(None, torch.randn(1, 4, 1, 16), keys.clone(), values, None)


def test_attention_survives_kvpress_wrapper_with_positional_dropout():
    """kvpress wraps every registered attention function (also ours, when kvpress is imported
    after our registration) and passes ``dropout`` positionally; the result must not change."""
    from kvpress.attention_patch import attention_patch

    layer = random_layer(lengths=(3, 7), span=10, n_fixed=2)
    keys, values = layer.update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16))
    q = torch.randn(1, 4, 1, 16)
    wrapped = attention_patch(compact_attention_forward)
    out, _ = wrapped(torch.nn.Module(), q, keys, values, None, 0.0, scaling=0.25)
    ref, _ = compact_attention_forward(None, q, keys, values, None, scaling=0.25)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
