"""Tests of the value-aware indexer: model (paper App. "Value-Aware Indexer Architecture"),
checkpoints, and the training math (paper Sec. 3.4 and App. "Indexer Training")."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import scipy.special
import torch

from arckv_press.indexer.checkpoint import (
    config_hash,
    default_indexer_path,
    load_indexer,
    read_metadata,
    save_indexer,
)
from arckv_press.indexer.model import PARAM_NAMES, IndexerConfig, ValueAwareIndexer

SMOLLM2_PARAMS = 134.5e6


def tiny_config(**kw) -> IndexerConfig:
    base = dict(num_layers=2, num_kv_heads=3, head_dim=8, d_x=6, n_index_heads=3, d_index=4,
                d_value_attn=5)
    base.update(kw)
    return IndexerConfig(**base)


def randomize(model: ValueAwareIndexer, seed: int, scale: float = 0.5) -> None:
    """Random values for every parameter, including the zero-initialised L_c and L_v."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale)


def inputs(cfg: IndexerConfig, n: int, T: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    H, D = cfg.num_kv_heads, cfg.head_dim
    X = torch.randn(n, cfg.d_x, generator=gen)
    Q = torch.randn(H, n, D, generator=gen) * 2
    K = torch.randn(H, T, D, generator=gen) * 2
    V = torch.randn(H, T, D, generator=gen)
    return X, Q, K, V


def reference_logits(model: ValueAwareIndexer, layer: int, X, Q, K, V) -> np.ndarray:
    """Float64 numpy transcription of paper Eqs. (value_context), (indexer_projection),
    (pairwise_index_score), one KV head and one row at a time."""
    cfg = model.config
    H, n, T = Q.shape[0], Q.shape[1], K.shape[1]
    HI, dI = cfg.n_index_heads, cfg.d_index
    out = np.zeros((H, n, T))
    X, Q, K, V = (t.double().numpy() for t in (X, Q, K, V))

    def N(z):
        return z / np.sqrt((z ** 2).sum(-1, keepdims=True) / dI + cfg.rms_eps)

    for h in range(H):
        p = {name: getattr(model, name)[layer * H + h].detach().double().numpy() for name in PARAM_NAMES}
        kz = K[h] @ p["L_k"].T + V[h] @ p["L_v"].T  # [T, HI*dI]
        for i in range(n):
            a = cfg.attn_scale * (p["U_k"] @ K[h].T).T @ (p["U_q"] @ Q[h, i])  # [T]
            A = scipy.special.softmax(a)
            c = (A[:, None] * (V[h] @ p["U_v"].T)).sum(0)
            qz = p["L_q"] @ Q[h, i] + p["L_c"] @ c
            w = p["L_x"] @ X[i] + p["b_x"]
            for a_ in range(HI):
                sl = slice(a_ * dI, (a_ + 1) * dI)
                s = N(kz[:, sl]) @ N(qz[sl]) / math.sqrt(dI)
                out[h, i] += w[a_] * np.where(s > 0, s, cfg.leaky_slope * s)
    return out


# ----------------------------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------------------------


def test_default_size_for_smollm2():
    cfg = IndexerConfig(num_layers=30, num_kv_heads=3, head_dim=64, d_x=576)
    model = ValueAwareIndexer(cfg)
    n = model.num_parameters()
    expected = 90 * (2 * 4 * 16 * 64 + 4 * 576 + 4 + 3 * 16 * 64 + 4 * 16 * 16 + 4 * 16 * 64)
    print(f"\nindexer params for SmolLM2-135M: {n:,} ({100 * n / SMOLLM2_PARAMS:.2f}% of 134.5M)")
    assert n == cfg.num_parameters() == expected
    assert 0.01 <= n / SMOLLM2_PARAMS <= 0.02
    for name, shape in cfg.param_shapes().items():
        assert tuple(getattr(model, name).shape) == shape


def test_initialisation_follows_paper():
    cfg = IndexerConfig(num_layers=2, num_kv_heads=2, head_dim=64, d_x=32, d_value_attn=64)
    model = ValueAwareIndexer(cfg, seed=3)
    assert torch.count_nonzero(model.L_c) == 0 and torch.count_nonzero(model.L_v) == 0
    for name in ("U_q", "U_k", "U_v"):
        assert abs(getattr(model, name).std().item() - 64 ** -0.5) < 0.01
    assert torch.equal(model.L_q, model.L_k)
    again = ValueAwareIndexer(cfg, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


def test_shapes_and_reference_logits():
    cfg = tiny_config()
    model = ValueAwareIndexer(cfg)
    randomize(model, 1)
    X, Q, K, V = inputs(cfg, n=5, T=9)
    I = model.logits(1, X, Q, K, V)
    assert I.shape == (3, 5, 9) and I.dtype == torch.float32
    np.testing.assert_allclose(I.detach().double().numpy(), reference_logits(model, 1, X, Q, K, V),
                               rtol=1e-4, atol=1e-4)
    s = model.scores(1, X, Q, K, V)
    assert s.shape == (3, 9)


def test_query_key_only_checkpoint_reproduces_logits_exactly():
    """Paper: with L_c = L_v = 0 the logits do not depend on U_* (nor on V)."""
    cfg = tiny_config()
    model = ValueAwareIndexer(cfg)
    randomize(model, 2)
    with torch.no_grad():
        model.L_c.zero_()
        model.L_v.zero_()
    X, Q, K, V = inputs(cfg, n=4, T=11, seed=5)
    before = model.logits(0, X, Q, K, V)
    with torch.no_grad():
        for name in ("U_q", "U_k", "U_v"):
            getattr(model, name).normal_(0.0, 3.0)
    after = model.logits(0, X, Q, K, V)
    assert torch.equal(before, after)
    assert torch.equal(before, model.logits(0, X, Q, K, torch.randn_like(V)))
    # and the value path is live once L_c / L_v are nonzero
    with torch.no_grad():
        model.L_v.normal_()
    assert not torch.allclose(before, model.logits(0, X, Q, K, V))


def test_batched_over_heads_equals_per_head_loop():
    cfg = tiny_config()
    model = ValueAwareIndexer(cfg)
    randomize(model, 3)
    X, Q, K, V = inputs(cfg, n=6, T=10, seed=1)
    I = model.logits(1, X, Q, K, V)
    single = ValueAwareIndexer(tiny_config(num_layers=1, num_kv_heads=1))
    for h in range(cfg.num_kv_heads):
        with torch.no_grad():
            for name in PARAM_NAMES:
                getattr(single, name).copy_(getattr(model, name)[cfg.num_kv_heads + h: cfg.num_kv_heads + h + 1])
        Ih = single.logits(0, X, Q[h:h + 1], K[h:h + 1], V[h:h + 1])
        torch.testing.assert_close(Ih[0], I[h], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pooling", ["rms", "mean", "max"])
def test_blocked_scores_equal_unblocked(pooling):
    cfg = tiny_config()
    model = ValueAwareIndexer(cfg)
    randomize(model, 4)
    X, Q, K, V = inputs(cfg, n=13, T=29, seed=2)
    pi = torch.softmax(model.logits(0, X, Q, K, V).detach().double(), dim=-1)
    ref = {"rms": pi.pow(2).mean(1).sqrt(), "mean": pi.mean(1), "max": pi.amax(1)}[pooling]
    dense = model.scores(0, X, Q, K, V, pooling=pooling, block_rows=1000, block_T=1000)
    for br, bt in ((4, 7), (1, 29), (13, 5), (5, 1)):
        blocked = model.scores(0, X, Q, K, V, pooling=pooling, block_rows=br, block_T=bt)
        torch.testing.assert_close(blocked, dense, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(dense.double(), ref, rtol=1e-5, atol=1e-7)


def test_bad_inputs_raise():
    cfg = tiny_config()
    model = ValueAwareIndexer(cfg)
    X, Q, K, V = inputs(cfg, n=4, T=6)
    with pytest.raises(ValueError, match="layer 2 out of range"):
        model.logits(2, X, Q, K, V)
    with pytest.raises(ValueError, match="X must be"):
        model.logits(0, X[:3], Q, K, V)
    with pytest.raises(ValueError, match="K must be"):
        model.logits(0, X, Q, K[:2], V[:2])
    bad = K.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        model.scores(0, X, Q, bad, V)
    with pytest.raises(ValueError, match="pooling"):
        model.scores(0, X, Q, K, V, pooling="sum")
    with pytest.raises(ValueError, match="block_T"):
        model.scores(0, X, Q, K, V, block_T=0)
    with pytest.raises(ValueError, match="n_index_heads"):
        tiny_config(n_index_heads=0)


# ----------------------------------------------------------------------------------------------
# checkpoints
# ----------------------------------------------------------------------------------------------


def test_checkpoint_round_trip(tmp_path):
    cfg = tiny_config()
    model = ValueAwareIndexer(cfg)
    randomize(model, 5)
    bw = torch.rand(cfg.num_layers, cfg.num_kv_heads)
    bw = bw / bw.sum()
    h = config_hash({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 6})
    save_indexer(model, tmp_path / "ck", "org/tiny-model", h, budget_weights=bw,
                 training={"contexts": 3, "tokens": 123})
    loaded, meta, bw2 = load_indexer(tmp_path / "ck", model_id="org/tiny-model", config_hash=h)
    for name in PARAM_NAMES:
        assert torch.equal(getattr(loaded, name), getattr(model, name))
    assert torch.equal(bw2, bw)
    assert loaded.config == cfg
    assert meta.model_id == "org/tiny-model" and meta.config_hash == h
    assert meta.training == {"contexts": 3, "tokens": 123} and meta.package_version
    assert json.loads((tmp_path / "ck" / "metadata.json").read_text())["has_budget_weights"] is True
    # without budget weights
    save_indexer(model, tmp_path / "ck2", "org/tiny-model", h)
    assert load_indexer(tmp_path / "ck2")[2] is None
    assert read_metadata(tmp_path / "ck2").has_budget_weights is False


def test_checkpoint_mismatch_raises(tmp_path):
    model = ValueAwareIndexer(tiny_config())
    save_indexer(model, tmp_path, "org/model-a", "hash-a")
    with pytest.raises(ValueError, match=r"'org/model-a'.*'org/model-b'"):
        load_indexer(tmp_path, model_id="org/model-b")
    with pytest.raises(ValueError, match=r"'hash-a'.*'hash-b'"):
        load_indexer(tmp_path, model_id="org/model-a", config_hash="hash-b")
    with pytest.raises(ValueError, match="budget_weights must have shape"):
        save_indexer(model, tmp_path / "x", "org/model-a", "h", budget_weights=torch.ones(3, 3))
    assert default_indexer_path("org/no-such-model") is None
    assert config_hash({"num_hidden_layers": 2, "torch_dtype": "float16"}) == config_hash(
        {"num_hidden_layers": 2, "torch_dtype": "bfloat16"})
    assert config_hash({"num_hidden_layers": 2}) != config_hash({"num_hidden_layers": 3})
