"""Tests of the value-aware indexer: model (paper App. "Value-Aware Indexer Architecture"),
checkpoints, and the training math (paper Sec. 3.5 and App. "Indexer Training")."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import scipy.special
import torch

from arckv_press.indexer.checkpoint import (
    default_indexer_path,
    load_indexer,
    read_metadata,
    save_indexer,
)
from arckv_press.indexer.model import PARAM_NAMES, IndexerConfig, ValueAwareIndexer
from arckv_press.models import config_hash

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


def test_config_from_model_config_and_dtype_casting():
    from types import SimpleNamespace

    hf = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         hidden_size=576, model_type="llama")
    cfg = IndexerConfig.from_model_config(hf)
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.d_x) == (30, 3, 64, 576)
    assert IndexerConfig.from_model_config(hf, n_index_heads=2).n_index_heads == 2
    assert IndexerConfig.from_dict(cfg.to_dict()) == cfg
    small = tiny_config()
    model = ValueAwareIndexer(small)
    randomize(model, 9)
    X, Q, K, V = (t.to(torch.bfloat16) for t in inputs(small, n=3, T=5))
    I = model.logits(0, X, Q, K, V)
    assert I.dtype == torch.float32
    torch.testing.assert_close(I, model.logits(0, X.float(), Q.float(), K.float(), V.float()))


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
    with torch.no_grad():  # the in-place path of pair_logits (autograd off) gives the same logits
        np.testing.assert_allclose(model.logits(1, X, Q, K, V).double().numpy(),
                                   reference_logits(model, 1, X, Q, K, V), rtol=1e-4, atol=1e-4)
    s = model.scores(1, X, Q, K, V)
    assert s.shape == (3, 9)
    # scores = RMS over rows of the row-wise softmax of the reference logits (Eq. (indexer_pooling))
    P = torch.softmax(torch.from_numpy(reference_logits(model, 1, X, Q, K, V)), dim=-1)
    np.testing.assert_allclose(s.double().numpy(), P.pow(2).mean(1).sqrt().numpy(), rtol=1e-4, atol=1e-6)


def test_pair_logits_one_index_head_at_a_time_equals_the_batched_form():
    """Without autograd pair_logits sums the index heads one [H, n, T] matrix at a time; with it, one
    batched [H, H_I, n, T] product: the same logits, at selection's shapes and a strided kbar (the
    layout scores() keeps)."""
    from arckv_press.indexer.model import pair_logits

    g = torch.Generator().manual_seed(0)
    qbar, w = torch.randn(3, 64, 4, 16, generator=g), torch.randn(3, 64, 4, generator=g)
    kbar = torch.randn(3, 4, 16, 300, generator=g).permute(0, 3, 1, 2)  # [H, T, H_I, d_I] view
    batched = pair_logits(qbar, kbar, w.requires_grad_(True)).detach()
    with torch.no_grad():
        one_at_a_time = pair_logits(qbar, kbar, w)
    torch.testing.assert_close(one_at_a_time, batched, rtol=1e-6, atol=1e-6)
    assert not torch.equal(one_at_a_time, pair_logits(qbar, kbar, w, slope=0.2).detach())  # the slope counts


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


def test_residual_form_adds_the_model_attention_logit():
    """``base_logit_scale``: the logits are the paper's plus ``s_0 q.k`` (float64 reference)."""
    plain = ValueAwareIndexer(tiny_config())
    randomize(plain, 6)
    resid = ValueAwareIndexer(tiny_config(base_logit_scale=0.3))
    resid.load_state_dict(plain.state_dict())
    X, Q, K, V = inputs(plain.config, n=5, T=9, seed=3)
    ref = reference_logits(plain, 1, X, Q, K, V) + 0.3 * np.einsum("hnd,htd->hnt", Q.double().numpy(),
                                                                   K.double().numpy())
    np.testing.assert_allclose(resid.logits(1, X, Q, K, V).detach().double().numpy(), ref, rtol=1e-4, atol=1e-4)
    P = scipy.special.softmax(ref, axis=-1)
    for br, bt in ((64, 4096), (2, 4)):  # dense and blocked scores
        s = resid.scores(1, X, Q, K, V, block_rows=br, block_T=bt)
        np.testing.assert_allclose(s.double().numpy(), np.sqrt((P ** 2).mean(1)), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("pooling", ["rms", "mean", "max"])
def test_residual_form_at_zero_head_weights_scores_like_ha(pooling):
    """With ``L_x = b_x = 0`` (the residual run's initialisation) the indexer ranks exactly as
    the training-free HA selector (``compaction.select.ha_scores``)."""
    from arckv_press.compaction.select import ha_scores

    cfg = tiny_config(base_logit_scale=8 ** -0.5, init_std_x=0.0, init_bias_x=0.0)
    model = ValueAwareIndexer(cfg, seed=1)
    assert torch.count_nonzero(model.L_x) == 0 and torch.count_nonzero(model.b_x) == 0
    X, Q, K, V = inputs(cfg, n=7, T=12, seed=4)
    s = model.scores(0, X, Q, K, V, pooling=pooling, block_rows=3, block_T=5)
    torch.testing.assert_close(s, ha_scores(Q, K, 8 ** -0.5, pooling=pooling), rtol=1e-5, atol=1e-7)
    # the paper's indexer with the same initialisation scores every position alike instead
    flat = ValueAwareIndexer(tiny_config(init_std_x=0.0, init_bias_x=0.0), seed=1)
    torch.testing.assert_close(flat.scores(0, X, Q, K, V, pooling=pooling),
                               torch.full((3, 12), 1 / 12), rtol=1e-5, atol=1e-7)


def test_residual_config_round_trip_and_validation(tiny_model):
    from arckv_press.indexer.driver import RunSettings
    from arckv_press.models import describe_attention_layout

    cfg = tiny_config(base_logit_scale=0.25)
    assert cfg.to_dict()["base_logit_scale"] == 0.25 and IndexerConfig.from_dict(cfg.to_dict()) == cfg
    # the paper's indexer keeps the dict it had before the residual form (run fingerprints)
    assert "base_logit_scale" not in tiny_config().to_dict()
    assert IndexerConfig.from_dict(tiny_config().to_dict()) == tiny_config()
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="base_logit_scale must be positive"):
            tiny_config(base_logit_scale=bad)
    model = tiny_model("llama")
    resid = RunSettings(residual="ha").indexer_config(model)
    assert resid.base_logit_scale == describe_attention_layout(model).scaling
    assert (resid.init_std_x, resid.init_bias_x, resid.base_value_influence) == (0.0, 0.0, False)
    assert RunSettings().indexer_config(model).base_logit_scale is None
    vi = RunSettings(residual="vi").indexer_config(model)
    assert vi.base_value_influence and vi.base_logit_scale == resid.base_logit_scale
    assert vi.to_dict()["base_value_influence"] is True and IndexerConfig.from_dict(vi.to_dict()) == vi
    assert "base_value_influence" not in resid.to_dict()  # the HA residual's fingerprint is unchanged
    with pytest.raises(ValueError, match="base_value_influence needs base_logit_scale"):
        tiny_config(base_value_influence=True)
    with pytest.raises(ValueError, match="residual must be None, 'ha' or 'vi'"):
        RunSettings(residual="omp").indexer_config(model)


def _reference_vi_influence(Q, K, V, scaling, eps=1e-6):
    """Float64 numpy brute force of VI's normalised influence D_ij / sqrt(||O_i||^2 + eps) by
    removing each key and recomputing the output (paper Eq. (background_value_selectors))."""
    Q, K, V = (t.double().numpy() for t in (Q, K, V))
    H, n, T = Q.shape[0], Q.shape[1], K.shape[1]
    out = np.zeros((H, n, T))
    for h in range(H):
        L = scaling * Q[h] @ K[h].T
        O = scipy.special.softmax(L, axis=-1) @ V[h]
        for j in range(T):
            keep = np.arange(T) != j
            O_minus = scipy.special.softmax(L[:, keep], axis=-1) @ V[h][keep]
            out[h, :, j] = np.linalg.norm(O - O_minus, axis=-1) / np.sqrt((O ** 2).sum(-1) + eps)
    return out


@pytest.mark.parametrize("pooling", ["rms", "mean", "max"])
def test_vi_residual_at_zero_head_weights_scores_like_vi(pooling):
    """``base_value_influence`` at the residual initialisation (``L_x = b_x = 0``) ranks exactly
    as the training-free VI selector (``compaction.select.vi_scores``), blocked or not."""
    from arckv_press.compaction.select import vi_scores

    cfg = tiny_config(base_logit_scale=8 ** -0.5, base_value_influence=True, init_std_x=0.0, init_bias_x=0.0)
    model = ValueAwareIndexer(cfg, seed=1)
    X, Q, K, V = inputs(cfg, n=7, T=12, seed=4)
    ref = vi_scores(Q, K, V, 8 ** -0.5, pooling=pooling)
    for br, bt in ((64, 4096), (3, 5)):
        s = model.scores(0, X, Q, K, V, pooling=pooling, block_rows=br, block_T=bt)
        torch.testing.assert_close(s, ref, rtol=1e-5, atol=1e-7)


def test_vi_residual_scores_match_a_float64_reference_and_the_training_pooling():
    """With trained (random) parameters: scores = pool_i( r_i softmax_j(I_ij + log Dn_ij) ) with
    ``r_i = sum_j Dn_ij``, against the float64 transcription of the indexer and a brute-force
    leave-one-out ``Dn``; the training loss pools the same scores (train/inference agree)."""
    from arckv_press.indexer.model import layer_logits_and_row_weights
    from arckv_press.indexer.train import pooled_scores

    cfg = tiny_config(base_logit_scale=0.3, base_value_influence=True)
    model = ValueAwareIndexer(cfg)
    randomize(model, 8)
    plain = ValueAwareIndexer(tiny_config())
    plain.load_state_dict(model.state_dict())
    X, Q, K, V = inputs(cfg, n=6, T=11, seed=5)
    Dn = _reference_vi_influence(Q, K, V, 0.3)
    logits = reference_logits(plain, 1, X, Q, K, V) + np.log(Dn)
    P = scipy.special.softmax(logits, axis=-1) * Dn.sum(-1, keepdims=True)
    for br, bt in ((64, 4096), (4, 3)):
        s = model.scores(1, X, Q, K, V, block_rows=br, block_T=bt)
        np.testing.assert_allclose(s.double().numpy(), np.sqrt((P ** 2).mean(1)), rtol=1e-4, atol=1e-6)
    I, r = layer_logits_and_row_weights(model.layer_params(1), cfg, X, Q, K, V)
    np.testing.assert_allclose(r.double().numpy(), Dn.sum(-1), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(pooled_scores(I, "rms", r), model.scores(1, X, Q, K, V), rtol=1e-4, atol=1e-6)


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
    from transformers import LlamaConfig

    h = config_hash(LlamaConfig(num_hidden_layers=2, hidden_size=6, num_attention_heads=2))
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
    import arckv_press.indexer.checkpoint as ck

    old = ck.WEIGHTS_DIR
    try:
        ck.WEIGHTS_DIR = tmp_path / "weights"
        save_indexer(model, ck.WEIGHTS_DIR / "org--model-a", "org/model-a", "hash-a")
        assert default_indexer_path("org/model-a") == ck.WEIGHTS_DIR / "org--model-a"
    finally:
        ck.WEIGHTS_DIR = old


def test_checkpoint_id_names_the_weights_and_the_registry_reports_it(tmp_path, monkeypatch):
    import hashlib

    import safetensors.torch

    import arckv_press.indexer.checkpoint as ck
    from arckv_press.indexer.checkpoint import checkpoint_id
    from arckv_press.registry import indexer_id

    model = ValueAwareIndexer(tiny_config())
    save_indexer(model, tmp_path / "a", "org/model-a", "hash-a")
    digest = hashlib.sha256()  # independent reference: the tensors as torch holds them
    for name, t in sorted(safetensors.torch.load_file(str(tmp_path / "a" / ck.WEIGHTS_FILE)).items()):
        digest.update(json.dumps([name, "F32", list(t.shape)]).encode())
        digest.update(t.numpy().tobytes())
    want = digest.hexdigest()[:12]
    assert checkpoint_id(tmp_path / "a") == want
    save_indexer(model, tmp_path / "b", "org/model-a", "hash-a", training={"other": "metadata"})
    assert checkpoint_id(tmp_path / "b") == want  # the weights, not the metadata, name it
    for i in range(4):  # safetensors writes its header metadata in no fixed order
        save_indexer(model, tmp_path / f"again{i}", "org/model-a", "hash-a")
        assert checkpoint_id(tmp_path / f"again{i}") == want
    randomize(model, 3)
    save_indexer(model, tmp_path / "c", "org/model-a", "hash-a")
    assert checkpoint_id(tmp_path / "c") != want
    with pytest.raises(FileNotFoundError, match="indexer.safetensors"):
        checkpoint_id(tmp_path / "missing")
    # registry: only the learned-indexer method has an id; the shipped checkpoint by default
    monkeypatch.setattr(ck, "WEIGHTS_DIR", tmp_path / "weights")
    save_indexer(model, ck.WEIGHTS_DIR / "org--model-a", "org/model-a", "hash-a")
    assert indexer_id("arckv", "org/model-a") == checkpoint_id(tmp_path / "c")
    assert indexer_id("arckv", "org/model-a", str(tmp_path / "a")) == want
    assert indexer_id("arckv", "org/model-a", model) == "in-memory"
    assert indexer_id("arckv", "org/no-checkpoint") == ""
    assert indexer_id("arckv-ha", "org/model-a") == indexer_id("snapkv", "org/model-a") == ""
    with pytest.raises(ValueError, match="unknown method"):
        indexer_id("no-such-method", "org/model-a")


# ----------------------------------------------------------------------------------------------
# training math
# ----------------------------------------------------------------------------------------------

from arckv_press.compaction.fit import FitConfig, compact_attention, fit_values, full_attention  # noqa: E402
from arckv_press.indexer.train import (  # noqa: E402
    ReferencePool,
    TrainConfig,
    budget_for_ratio,
    hard_branch_loss,
    kl_loss,
    lr_factor,
    pooled_scores,
    ridge_solve,
    soft_branch_loss,
    ste_loss,
    train_layer,
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_budget_and_schedule():
    assert budget_for_ratio(0.1, 30) == 3
    assert budget_for_ratio(0.01, 50) == 1
    assert budget_for_ratio(0.2, 11) == 3
    assert budget_for_ratio(1.0, 7) == 7
    with pytest.raises(ValueError):
        budget_for_ratio(0.0, 10)
    total = 200  # 6 warm-up steps (3%), cosine to 10% at the last step
    f = [lr_factor(s, total, 0.03, 0.1) for s in range(total)]
    np.testing.assert_allclose(f[:6], [(s + 1) / 6 for s in range(6)])
    assert f[6] == pytest.approx(1.0) and f[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[6:], f[7:]))


def test_kl_loss_matches_float64_reference():
    gen = torch.Generator().manual_seed(0)
    H, n, T, D = 2, 5, 7, 4
    Q, K = torch.randn(H, n, D, generator=gen), torch.randn(H, T, D, generator=gen)
    I = torch.randn(H, n, T, generator=gen) * 2
    got = kl_loss(I, Q, K, 0.7)
    p = scipy.special.softmax(0.7 * np.einsum("hnd,htd->hnt", Q.double().numpy(), K.double().numpy()), -1)
    q = scipy.special.softmax(I.double().numpy(), -1)
    ref = (p * (np.log(p) - np.log(q))).sum(-1).mean()
    assert got.item() == pytest.approx(ref, rel=1e-5)
    assert kl_loss(0.7 * Q @ K.transpose(1, 2), Q, K, 0.7).item() == pytest.approx(0.0, abs=1e-6)


def test_ridge_solve_matches_numpy_and_has_exact_gradient():
    gen = torch.Generator().manual_seed(1)
    P = torch.rand(2, 9, 4, generator=gen, dtype=torch.float64)
    Y = torch.randn(2, 9, 3, generator=gen, dtype=torch.float64)
    for relative in (False, True):
        got = ridge_solve(P, Y, 0.1, relative=relative)
        for h in range(2):
            Ph, Yh = P[h].numpy(), Y[h].numpy()
            lam = 0.1 * (np.diag(Ph.T @ Ph).mean() if relative else 1.0)
            ref = np.linalg.solve(Ph.T @ Ph + lam * np.eye(4), Ph.T @ Yh)
            np.testing.assert_allclose(got[h].numpy(), ref, rtol=1e-9, atol=1e-10)
    P.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda A: ridge_solve(A, Y, 0.1, relative=False), (P,))


def _toy(seed=0, H=2, T=10, D=4, n_fit=12, n_hold=6):
    gen = torch.Generator().manual_seed(seed)
    K = torch.randn(H, T, D, generator=gen, dtype=torch.float64)
    V = torch.randn(H, T, D, generator=gen, dtype=torch.float64) + 1.0
    Qf = torch.randn(H, n_fit, D, generator=gen, dtype=torch.float64)
    Qh = torch.randn(H, n_hold, D, generator=gen, dtype=torch.float64)
    s = torch.rand(H, T, generator=gen, dtype=torch.float64)
    return K, V, Qf, Qh, s


def test_hard_branch_keeps_everything_at_ratio_one():
    K, V, Qf, Qh, s = _toy(n_fit=16)
    hard = hard_branch_loss(s, Qf, Qh, K, V, 0.5, 1.0, fit_config=FitConfig(ridge_v=0.0))
    assert hard.t == 10 and hard.loss.item() < 1e-8
    torch.testing.assert_close(hard.beta, torch.zeros_like(hard.beta), atol=1e-6, rtol=0)
    part = hard_branch_loss(s, Qf, Qh, K, V, 0.5, 0.3)
    from arckv_press.compaction.select import topk_anchors
    idx, _ = topk_anchors(s, torch.full((2,), part.t))
    assert torch.equal(torch.sort(part.order[:, :part.t], dim=-1).values, idx)
    assert part.loss.item() > 1e-4


def _soft_reference(s, K, V, Qf, Qh, scaling, order, beta, t, gamma, ridge_rel, s0):
    """Numpy float64 transcription of paper Eqs. (soft_candidate_gate), (soft_attention_output)
    with the stop-gradient quantities (candidates, threshold, std, ridge scale) frozen at s0."""
    H, T = s.shape
    m = min(T, 2 * t)
    total = 0.0
    for h in range(H):
        cand = order[h, :m]
        tau = np.sort(s0[h])[::-1][t - 1]
        sigma = s0[h].std()
        g = 1 / (1 + np.exp(-(s[h, cand] - tau) / (gamma * sigma)))
        b = np.zeros(m)
        b[:t] = beta[h]
        Ck = K[h, cand]

        def probs(Q):
            return scipy.special.softmax(scaling * Q @ Ck.T + b + np.log(g), axis=-1)

        def full(Q):
            return scipy.special.softmax(scaling * Q @ K[h].T, axis=-1) @ V[h]

        Pf = probs(Qf[h])
        Pf0 = None
        if True:  # ridge scale frozen at s0
            g0 = 1 / (1 + np.exp(-(s0[h, cand] - tau) / (gamma * sigma)))
            Pf0 = scipy.special.softmax(scaling * Qf[h] @ Ck.T + b + np.log(g0), axis=-1)
        lam = ridge_rel * np.diag(Pf0.T @ Pf0).mean()
        Cv = np.linalg.solve(Pf.T @ Pf + lam * np.eye(m), Pf.T @ full(Qf[h]))
        y, y_hat = full(Qh[h]), probs(Qh[h]) @ Cv
        total += (((y_hat - y) ** 2).sum(-1) / (y ** 2).sum(-1)).sum()
    return total / (H * Qh.shape[1])


def test_soft_branch_gradient_matches_finite_differences_of_reference():
    K, V, Qf, Qh, s = _toy(seed=2)
    scaling, gamma, ratio = 0.6, 0.5, 0.3
    hard = hard_branch_loss(s, Qf, Qh, K, V, scaling, ratio)
    s_leaf = s.clone().requires_grad_(True)
    soft = soft_branch_loss(s_leaf, Qf, Qh, K, V, scaling, hard, gamma)
    soft.backward()
    npy = [x.numpy() for x in (K, V, Qf, Qh)]
    args = (hard.order.numpy(), hard.beta.double().numpy(), hard.t, gamma, FitConfig().ridge_v, s.numpy())
    ref = _soft_reference(s.numpy(), *npy, scaling, *args)
    assert soft.item() == pytest.approx(ref, rel=1e-5)
    eps = 1e-6
    fd = np.zeros(s.shape)
    for h in range(s.shape[0]):
        for j in range(s.shape[1]):
            sp, sm = s.numpy().copy(), s.numpy().copy()
            sp[h, j] += eps
            sm[h, j] -= eps
            fd[h, j] = (_soft_reference(sp, *npy, scaling, *args) - _soft_reference(sm, *npy, scaling, *args)) / (2 * eps)
    np.testing.assert_allclose(s_leaf.grad.numpy(), fd, rtol=1e-4, atol=1e-7)
    # only candidates (top-2t) receive gradient
    noncand = hard.order[:, 2 * hard.t:]
    assert torch.count_nonzero(torch.gather(s_leaf.grad, 1, noncand)) == 0


def test_soft_branch_at_zero_temperature_is_the_hard_fit_with_a_half_gate():
    """gamma -> 0: gates are 1 on S (0.5 on the t-th anchor, which sits on the threshold) and 0
    elsewhere, so the soft branch equals the hard branch with beta_t + log(1/2)."""
    K, V, Qf, Qh, s = _toy(seed=3)
    fc = FitConfig(ridge_v=0.0)  # exact least squares on both sides (ridge scales differ: t vs 2t slots)
    hard = hard_branch_loss(s, Qf, Qh, K, V, 0.6, 0.3, fit_config=fc)
    soft = soft_branch_loss(s, Qf, Qh, K, V, 0.6, hard, 1e-9, fit_config=fc)
    t = hard.t
    C_k = torch.gather(K, 1, hard.order[:, :t, None].expand(-1, -1, K.shape[-1]))
    beta = hard.beta.double().clone()
    beta[:, t - 1] += math.log(0.5)
    C_v = fit_values(Qf, K, V, C_k, beta, 0.6, config=fc)
    y, y_hat = full_attention(Qh, K, V, 0.6), compact_attention(Qh, C_k, beta, C_v, 0.6)
    ref = (((y_hat - y) ** 2).sum(-1) / (y ** 2).sum(-1)).mean()
    assert soft.item() == pytest.approx(ref.item(), rel=1e-5)


def test_ste_has_hard_value_and_soft_gradient():
    K, V, Qf, Qh, s = _toy(seed=4)
    theta = torch.randn(2, 10, dtype=torch.float64, requires_grad=True)
    scores = pooled_scores(theta[:, None, :].expand(2, 3, 10) * torch.tensor([1.0, 2.0, 3.0],
                           dtype=torch.float64)[None, :, None])
    hard = hard_branch_loss(scores.detach(), Qf, Qh, K, V, 0.6, 0.3)
    soft = soft_branch_loss(scores, Qf, Qh, K, V, 0.6, hard, 0.7)
    ste = ste_loss(hard.loss, soft)
    assert ste.item() == hard.loss.item() and ste.item() != soft.item()
    (g_ste,) = torch.autograd.grad(ste, theta, retain_graph=True)
    (g_soft,) = torch.autograd.grad(soft, theta)
    assert torch.equal(g_ste, g_soft) and g_soft.abs().sum() > 0


# -- end-to-end training on a planted problem ---------------------------------------------------

_H, _T, _D, _DX, _G, _NREF, _NP = 2, 40, 16, 8, 2, 96, 4
_QSCALE, _VALUE_AMP = 2.0, 3.0


def _planted_pool(seed: int):
    """One context: all values equal a head-specific mean m except _NP planted positions whose
    values carry a large random signal; planted keys are slightly shorter (less attention),
    so highest-attention misses them while the best anchors for reconstructing held-out
    outputs include the planted ones."""
    gu = torch.Generator().manual_seed(1234)
    m = 0.3 * torch.randn(_H, 1, _D, generator=gu)  # shared by all contexts
    g = torch.Generator().manual_seed(seed)
    K = 0.8 * torch.randn(_H, _T, _D, generator=g)
    Q = _QSCALE * torch.randn(_H, _G * _NREF, _D, generator=g)
    V = m.expand(_H, _T, _D).clone()
    planted = torch.stack([torch.randperm(_T, generator=g)[:_NP] for _ in range(_H)])
    for h in range(_H):
        K[h, planted[h]] *= 0.8
        V[h, planted[h]] = m[h] + _VALUE_AMP * torch.randn(_NP, _D, generator=g)
    X = torch.randn(_NREF, _DX, generator=g)
    Q_eval = _QSCALE * torch.randn(_H, 256, _D, generator=g)
    return ReferencePool(X=X, Q=Q, K=K, V=V, scaling=_D ** -0.5), planted, Q_eval


def _evaluate(score_fn, contexts, ratio):
    """Inference protocol: score and fit on the whole pool, evaluate on fresh queries."""
    errs, recall = [], []
    for pool, planted, Q_eval in contexts:
        hard = hard_branch_loss(score_fn(pool), pool.Q, Q_eval, pool.K, pool.V, pool.scaling, ratio)
        errs.append(hard.loss.item())
        top = hard.order[:, :hard.t]
        recall.append(torch.isin(top, planted).sum().item() / planted.numel())
    return float(np.mean(errs)), float(np.mean(recall))


def test_training_learns_planted_value_anchors():
    from arckv_press.compaction.select import ha_scores

    ratio = 0.25
    train = [_planted_pool(i)[0] for i in range(8)]
    test = [_planted_pool(100 + i) for i in range(16)]
    cfg = IndexerConfig(num_layers=1, num_kv_heads=_H, head_dim=_D, d_x=_DX, n_index_heads=2,
                        d_index=8, d_value_attn=8)
    model = ValueAwareIndexer(cfg, seed=0)

    def indexer_scores(pool):
        rows = torch.arange(pool.Q.shape[1])
        return model.scores(0, pool.X_rows(rows), pool.Q, pool.K, pool.V)

    err_ha, rec_ha = _evaluate(lambda p: ha_scores(p.Q, p.K, p.scaling), test, ratio)
    err_0, rec_0 = _evaluate(indexer_scores, test, ratio)
    config = TrainConfig(kl_epochs=3, joint_epochs=40, lr_kl=1e-2, lr_joint=2e-2, lambda_kl=0.0,
                         ratios=(ratio,), episode_fractions=(0.5, 0.25, 0.25), seed=0)
    result = train_layer(model, 0, train, config, progress=False)
    err_1, rec_1 = _evaluate(indexer_scores, test, ratio)
    print(f"\nheld-out rel. error: HA {err_ha:.4f} (recall {rec_ha:.2f}), untrained {err_0:.4f} "
          f"({rec_0:.2f}), trained {err_1:.4f} ({rec_1:.2f}); {len(result.metrics)} epochs")
    assert result.finished and len(result.metrics) == 43
    assert [r["stage"] for r in result.metrics] == ["kl"] * 3 + ["joint"] * 40
    assert result.metrics[-1]["gamma"] == pytest.approx(0.1)
    assert err_1 < 0.97 * err_0 and err_1 < 0.85 * err_ha
    assert rec_1 >= rec_0 + 0.15


def _small_pools(n=2):
    pools = []
    for k in range(n):
        gen = torch.Generator().manual_seed(50 + k)
        pools.append(ReferencePool(X=torch.randn(10, 6, generator=gen),
                                   Q=torch.randn(3, 20, 8, generator=gen),
                                   K=torch.randn(3, 12, 8, generator=gen),
                                   V=torch.randn(3, 12, 8, generator=gen), scaling=8 ** -0.5))
    return pools


def test_train_layer_is_deterministic_and_resumable():
    import io

    pools = _small_pools()
    config = TrainConfig(kl_epochs=2, joint_epochs=2, lr_kl=1e-3, lr_joint=1e-3, ratios=(0.3, 0.2),
                         kl_max_rows=12, seed=7)
    full = ValueAwareIndexer(tiny_config(), seed=1)
    res_full = train_layer(full, 1, pools, config, progress=False)
    again = ValueAwareIndexer(tiny_config(), seed=1)
    train_layer(again, 1, pools, config, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(full.parameters(), again.parameters()))
    # layer 0 untouched, layer 1 changed
    ref = ValueAwareIndexer(tiny_config(), seed=1)
    assert all(torch.equal(a, b) for a, b in zip(full.layer_params(0).values(), ref.layer_params(0).values()))
    assert not torch.equal(full.layer_params(1)["L_q"], ref.layer_params(1)["L_q"])

    states = []
    part = ValueAwareIndexer(tiny_config(), seed=1)
    res1 = train_layer(part, 1, pools, config, progress=False, max_epochs=3, on_epoch_end=states.append)
    assert not res1.finished and len(states) == 3 and states[-1]["stage"] == 1 and states[-1]["epoch"] == 1
    buf = io.BytesIO()
    torch.save(res1.state, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=False)
    resumed = ValueAwareIndexer(tiny_config(), seed=1)  # fresh model: params come from the state
    res2 = train_layer(resumed, 1, pools, config, progress=False, resume_state=state)
    assert res2.finished
    assert all(torch.equal(a, b) for a, b in zip(full.parameters(), resumed.parameters()))
    assert res2.metrics == res_full.metrics
    with pytest.raises(ValueError, match="resume_state"):
        train_layer(resumed, 0, pools, config, progress=False, resume_state=state)


def test_pool_and_config_validation():
    gen = torch.Generator().manual_seed(0)
    X, K = torch.randn(4, 6, generator=gen), torch.randn(3, 5, 8, generator=gen)
    with pytest.raises(ValueError, match="G\\*n_ref"):
        ReferencePool(X=X, Q=torch.randn(3, 7, 8), K=K, V=K.clone(), scaling=0.3)
    with pytest.raises(ValueError, match="scaling"):
        ReferencePool(X=X, Q=torch.randn(3, 8, 8), K=K, V=K.clone(), scaling=-1.0)
    pool = ReferencePool(X=X, Q=torch.randn(3, 8, 8), K=K, V=K.clone(), scaling=0.3)
    assert pool.group_size == 2 and pool.rows(torch.tensor([1, 3])).tolist() == [1, 3, 5, 7]
    assert torch.equal(pool.X_rows(torch.tensor([5])), X[1:2])
    with pytest.raises(ValueError, match="ratios"):
        TrainConfig(ratios=(0.0,))
    with pytest.raises(ValueError, match="episode_fractions"):
        TrainConfig(episode_fractions=(0.6, 0.3, 0.3))
    with pytest.raises(ValueError, match="expects H=3"):
        train_layer(ValueAwareIndexer(tiny_config(num_kv_heads=3, head_dim=4)), 0, [pool],
                    TrainConfig(kl_epochs=1, joint_epochs=0), progress=False)


# ----------------------------------------------------------------------------------------------
# one config hash for the whole package
# ----------------------------------------------------------------------------------------------


def test_checkpoint_uses_the_package_config_hash(tmp_path):
    """The indexer has no hash of its own: a checkpoint saved with models.config_hash loads
    under the hash api.py computes (and the CompactCache metadata stores)."""
    import arckv_press.indexer as pkg
    import arckv_press.indexer.checkpoint as ck
    from transformers import LlamaConfig

    assert not hasattr(ck, "config_hash") and "config_hash" not in pkg.__all__
    a = LlamaConfig(num_hidden_layers=2, hidden_size=8, num_attention_heads=2, num_key_value_heads=1)
    b = LlamaConfig(num_hidden_layers=3, hidden_size=8, num_attention_heads=2, num_key_value_heads=1)
    model = ValueAwareIndexer(IndexerConfig.from_model_config(a, n_index_heads=1, d_index=2, d_value_attn=2))
    save_indexer(model, tmp_path, "org/m", config_hash(a))
    assert load_indexer(tmp_path, "org/m", config_hash(LlamaConfig.from_dict(a.to_dict())))[1].config_hash == config_hash(a)
    with pytest.raises(ValueError, match="config hash"):
        load_indexer(tmp_path, "org/m", config_hash(b))


# ----------------------------------------------------------------------------------------------
# per-head budget weights
# ----------------------------------------------------------------------------------------------

from arckv_press.indexer.budget import (  # noqa: E402
    budget_weights_from_curves,
    convexify,
    error_curves,
    heldout_error,
    water_fill,
)


def _convex_curves(P, F, seed):
    """Random decreasing convex curves on the integer grid 1..F (positive, decreasing steps)."""
    gen = torch.Generator().manual_seed(seed)
    steps = torch.sort(torch.rand(P, F - 1, generator=gen, dtype=torch.float64), dim=1, descending=True).values
    return torch.cat([torch.zeros(P, 1, dtype=torch.float64), torch.cumsum(steps, 1)], 1).neg() + 5.0


def test_water_fill_matches_brute_force_allocation():
    import itertools

    F = 6
    grid = list(range(1, F + 1))  # integer units: the optimum of the LP is an integer allocation
    for seed in range(6):
        P = 3 + seed % 2
        curves = _convex_curves(P, F, seed)
        for total in (P, P + 2, 2 * P + 1, 3 * P + 4, F * P - 1, F * P):
            alloc = water_fill(curves, grid, float(total))
            assert alloc.sum().item() == pytest.approx(total)
            assert (alloc >= 1 - 1e-12).all() and (alloc <= F + 1e-12).all()
            got = sum(float(np.interp(alloc[p].item(), grid, curves[p].numpy())) for p in range(P))
            best = min(sum(curves[p, c - 1].item() for p, c in enumerate(combo))
                       for combo in itertools.product(grid, repeat=P) if sum(combo) == total)
            assert got == pytest.approx(best, abs=1e-9), (seed, total)


def test_convexify_is_the_lower_hull_of_the_nonincreasing_envelope():
    grid = torch.tensor([0.01, 0.02, 0.05, 0.1, 0.2])
    curves = torch.tensor([[1.0, 0.5, 0.45, 0.1, 0.05],   # non-convex kink at 0.05
                           [1.0, 0.8, 0.9, 0.3, 0.31],    # not monotone
                           [0.9, 0.5, 0.2, 0.1, 0.05]])   # check convexity below
    hull = convexify(grid, curves).numpy()
    x = grid.double().numpy()
    env = np.minimum.accumulate(curves.double().numpy(), axis=1)
    for p in range(3):
        # brute force: lower hull value at x_k = min over chords through envelope points
        for k in range(5):
            best = env[p, k]
            for i in range(k):
                for j in range(k + 1, 5):
                    w = (x[k] - x[i]) / (x[j] - x[i])
                    best = min(best, (1 - w) * env[p, i] + w * env[p, j])
            assert hull[p, k] == pytest.approx(best)
        slopes = np.diff(hull[p]) / np.diff(x)
        assert (np.diff(slopes) >= -1e-9).all() and (np.diff(hull[p]) <= 1e-12).all()


def test_budget_weights_favour_heads_whose_error_drops():
    grid = (0.01, 0.02, 0.05, 0.1, 0.2, 0.4)
    flat = torch.full((6,), 0.2)
    steep = torch.tensor([1.0, 0.7, 0.4, 0.2, 0.1, 0.05])
    curves = torch.stack([flat, steep, flat, steep]).reshape(2, 2, 6)
    w = budget_weights_from_curves(curves, grid, ratios=(0.1, 0.05))
    assert w.shape == (2, 2) and w.sum().item() == pytest.approx(1.0)
    assert w[0, 1] > 2 * w[0, 0] and torch.allclose(w[0], w[1])
    # identical curves -> uniform weights
    same = budget_weights_from_curves(steep.expand(2, 3, 6).clone(), grid)
    torch.testing.assert_close(same, torch.full((2, 3), 1 / 6))
    with pytest.raises(ValueError, match="below the minimum"):
        water_fill(curves.reshape(4, 6), grid, 0.01)


def test_heldout_error_and_error_curves():
    K, V, Qf, Qh, s = _toy(seed=5, T=12, n_fit=40, n_hold=9)
    idx = torch.arange(12).expand(2, 12)
    exact = FitConfig(ridge_v=0.0, gram_dtype="float64")  # no ridge: exact only with float64 products
    err = heldout_error(Qf, Qh, K, V, 0.5, idx, torch.ones(2, 12, dtype=torch.bool), exact)
    assert err.shape == (2,) and (err < 1e-4).all()  # every key kept, no ridge: exact reconstruction
    # one anchor: compare with a per-head float64 numpy transcription of the hard branch
    top = torch.argmax(s, dim=1, keepdim=True)
    err1 = heldout_error(Qf, Qh, K, V, 0.5, top, torch.ones(2, 1, dtype=torch.bool))
    for h in range(2):
        y = scipy.special.softmax(0.5 * Qh[h].numpy() @ K[h].numpy().T, -1) @ V[h].numpy()
        y_fit = scipy.special.softmax(0.5 * Qf[h].numpy() @ K[h].numpy().T, -1) @ V[h].numpy()
        # one slot: the compact output is the constant C_v row = mean of fitted targets (ridge ~ 0)
        c = y_fit.mean(0) / (1 + 1e-3)
        ref = np.linalg.norm(c[None] - y) / np.linalg.norm(y)
        assert err1[h].item() == pytest.approx(ref, rel=1e-4)
    pools = [ReferencePool(X=torch.randn(8, 6), Q=torch.randn(2, 16, 4) * 2, K=K.float(), V=V.float(),
                           scaling=0.5)]
    curves = error_curves(lambda pool, rows: s.float(), pools, (0.1, 0.5, 1.0), holdout_fraction=0.25,
                          fit_config=exact)
    assert curves.shape == (2, 3) and (curves[:, -1] < 1e-3).all() and (curves[:, 0] > curves[:, -1]).all()


def test_kl_of_the_vi_residual_is_zero_at_initialisation_and_targets_vi():
    """The VI residual's L_KL targets VI's row distribution ``Dn / sum_j Dn`` (the attention for
    the HA residual): 0 at zero head weights, and the float64 KL against that target otherwise."""
    from arckv_press.indexer.model import layer_logits_and_row_weights, vi_base
    from arckv_press.indexer.train import kl_loss

    cfg = tiny_config(base_logit_scale=0.3, base_value_influence=True, init_std_x=0.0, init_bias_x=0.0)
    model = ValueAwareIndexer(cfg, seed=2)
    X, Q, K, V = inputs(cfg, n=6, T=11, seed=6)
    with torch.no_grad():
        I0, _ = layer_logits_and_row_weights(model.layer_params(0), cfg, X, Q, K, V)
    target = vi_base(Q, K, V, cfg)[0]
    assert abs(kl_loss(I0, Q, K, 0.3, target).item()) < 1e-6
    assert kl_loss(I0, Q, K, 0.3).item() > 1e-3  # the attention is another distribution
    randomize(model, 3)
    with torch.no_grad():
        I, _ = layer_logits_and_row_weights(model.layer_params(0), cfg, X, Q, K, V)
    Dn = _reference_vi_influence(Q, K, V, 0.3)
    p = Dn / Dn.sum(-1, keepdims=True)
    log_q = scipy.special.log_softmax(I.detach().double().numpy(), axis=-1)
    ref = (p * (np.log(p) - log_q)).sum(-1).mean()
    assert kl_loss(I, Q, K, 0.3, target).item() == pytest.approx(ref, rel=1e-4)


def test_paper_optimiser_settings_reach_training(monkeypatch):
    """TrainConfig's defaults are the paper's training details, and ``train_layer`` really uses
    them: one AdamW per stage at the stage's peak lr with betas (0.9, 0.999) and weight decay 0.01,
    a gradient-norm clip of 1.0 at every step, and each joint episode's retention ratio drawn from
    the five (all of them over enough episodes)."""
    import dataclasses

    import arckv_press.indexer.train as train_mod

    cfg = TrainConfig()
    assert (cfg.kl_epochs, cfg.joint_epochs, cfg.lr_kl, cfg.lr_joint, cfg.warmup_frac, cfg.final_lr_frac) == (
        10, 5, 1e-4, 3e-5, 0.03, 0.1)
    assert (cfg.betas, cfg.weight_decay, cfg.grad_clip, cfg.lambda_out, cfg.lambda_kl) == ((0.9, 0.999), 0.01, 1.0, 2.0, 1.0)
    assert (cfg.ratios, cfg.gamma_start, cfg.gamma_end) == ((0.2, 0.1, 0.05, 0.02, 0.01), 1.0, 0.1)

    optimisers, clips, ratios = [], [], []
    real_adamw, real_clip, real_hard = torch.optim.AdamW, torch.nn.utils.clip_grad_norm_, train_mod.hard_branch_loss

    def adamw(params, **kw):
        optimisers.append(kw)
        return real_adamw(params, **kw)

    def clip(params, max_norm, *args, **kw):
        clips.append(max_norm)
        return real_clip(params, max_norm, *args, **kw)

    def hard(s, Q_f, Q_h, K, V, scaling, ratio, **kw):
        ratios.append(ratio)
        return real_hard(s, Q_f, Q_h, K, V, scaling, ratio, **kw)

    monkeypatch.setattr(torch.optim, "AdamW", adamw)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    monkeypatch.setattr(train_mod, "hard_branch_loss", hard)
    pools = _small_pools(4)
    config = dataclasses.replace(cfg, kl_epochs=1, joint_epochs=6, kl_max_rows=12)
    train_layer(ValueAwareIndexer(tiny_config(), seed=1), 1, pools, config, progress=False)
    assert [(o["lr"], o["betas"], o["weight_decay"]) for o in optimisers] == [(1e-4, (0.9, 0.999), 0.01),
                                                                             (3e-5, (0.9, 0.999), 0.01)]
    assert clips == [1.0] * (1 + 6) * len(pools)
    assert len(ratios) == 6 * len(pools) and set(ratios) == set(cfg.ratios)


@pytest.mark.model
def test_shipped_checkpoint_is_the_default_models_and_arckv_uses_it(default_model_fp32):
    """The checkpoint inside the package loads for the real default model (model id and config
    hash), is 1-2% of its parameters and a few MB, carries its training summary and budget
    weights, and is what method ``arckv`` uses when no indexer is given."""
    from arckv_press.api import compact
    from arckv_press.indexer.checkpoint import checkpoint_id
    from arckv_press.models import DEFAULT_MODEL_ID, model_id
    from arckv_press.registry import indexer_id
    from conftest import make_text

    model, tok = default_model_fp32
    path = default_indexer_path(DEFAULT_MODEL_ID)
    assert path is not None and model_id(model) == DEFAULT_MODEL_ID
    indexer, meta, weights = load_indexer(path, model_id=DEFAULT_MODEL_ID, config_hash=config_hash(model.config))
    share = sum(p.numel() for p in indexer.parameters()) / sum(p.numel() for p in model.parameters())
    assert 0.01 <= share <= 0.02, share
    assert sum(f.stat().st_size for f in path.iterdir()) < 10 * 2**20
    assert meta.package_version and meta.created and {"command", "context_spec", "budget_weights"} <= set(meta.training)
    assert weights.shape == (30, 3) and torch.isfinite(weights).all() and (weights >= 0).all()
    assert checkpoint_id(path) == indexer_id("arckv", DEFAULT_MODEL_ID)

    text = make_text(300, seed=6)
    with torch.inference_mode():
        default = compact(model, tok, text, "arckv", 0.2)
        explicit = compact(model, tok, text, "arckv", 0.2, indexer=str(path))
        ha = compact(model, tok, text, "arckv-ha", 0.2)
    for a, b in zip(default.layers, explicit.layers):
        assert torch.equal(a.lengths, b.lengths) and torch.equal(a.ck, b.ck) and torch.equal(a.cv, b.cv)
    assert any(not torch.equal(a.ck, b.ck) for a, b in zip(default.layers, ha.layers))


@pytest.mark.parametrize("vi", [False, True])
@pytest.mark.parametrize("pooling", ["rms", "mean", "max"])
def test_scores_with_base_pool_the_base_selector_over_the_same_rows(pooling, vi):
    """``scores(base=True)``: the learned scores as without it, and the residual's base selector (HA or
    VI, ``compaction.select``) pooled over the same rows, blocked or not; the paper's form has no base."""
    from arckv_press.compaction.select import ha_scores, vi_scores

    cfg = tiny_config(base_logit_scale=8 ** -0.5, base_value_influence=vi)
    model = ValueAwareIndexer(cfg)
    randomize(model, 9)
    X, Q, K, V = inputs(cfg, n=9, T=13, seed=6)
    ref = (vi_scores(Q, K, V, 8 ** -0.5, pooling=pooling) if vi else ha_scores(Q, K, 8 ** -0.5, pooling=pooling))
    for br, bt in ((64, 4096), (4, 5), (1, 13)):
        s, s_base = model.scores(0, X, Q, K, V, pooling=pooling, block_rows=br, block_T=bt, base=True)
        torch.testing.assert_close(s, model.scores(0, X, Q, K, V, pooling=pooling), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(s_base, ref.float(), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="base_scale 0.5 is not this residual indexer's"):
        model.scores(0, X, Q, K, V, base=True, base_scale=0.5)
    # the paper's form: HA at the scale given as its control variate, the learned scores unchanged
    paper = ValueAwareIndexer(tiny_config())
    randomize(paper, 9)
    s, s_base = paper.scores(0, X, Q, K, V, pooling=pooling, block_T=5, base=True, base_scale=0.4)
    torch.testing.assert_close(s, paper.scores(0, X, Q, K, V, pooling=pooling), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(s_base, ha_scores(Q, K, 0.4, pooling=pooling).float(), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="needs base_scale"):
        paper.scores(0, X, Q, K, V, base=True)
