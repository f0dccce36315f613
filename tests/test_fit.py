"""Tests for arckv_press.compaction.fit against numpy / scipy float64 references."""

import dataclasses
import logging

import numpy as np
import pytest
import scipy.optimize
import torch

from arckv_press.compaction.fit import (
    FitConfig,
    GramSum,
    attention_mass_error,
    compact_attention,
    compact_logits,
    fit_beta,
    fit_values,
    full_attention,
    spd_solve,
)


def _rand(*shape, seed=0, dtype=torch.float64, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _np_softmax(L):
    E = np.exp(L - L.max(-1, keepdims=True))
    return E / E.sum(-1, keepdims=True)


def _np_phi(Q, K, C, scaling):
    """Phi_K 1 and Phi_C of paper Eq. (mass_fit) for one head (z over the full K)."""
    Lk = scaling * Q @ K.T
    z = Lk.max(-1, keepdims=True)
    return np.exp(Lk - z).sum(-1), np.exp(scaling * Q @ C.T - z)


def _np_beta(w, eps=1e-12, b_min=-20.0, b_max=20.0):
    return np.clip(np.log(np.maximum(w, eps)), b_min, b_max)


def _problem(H=2, n=40, T=25, t=6, D=8, seed=0):
    Q, K, V = _rand(H, n, D, seed=seed), _rand(H, T, D, seed=seed + 1), _rand(H, T, D, seed=seed + 2)
    C = _rand(H, t, D, seed=seed + 3, scale=0.8)   # compact keys unrelated to K: some w~ < 0
    return Q, K, V, C


# ----------------------------------------------------------------------------- beta


def test_fit_beta_ls_clamp_matches_numpy_lstsq():
    Q, K, V, C = _problem()
    beta, w = fit_beta(Q, K, C, 0.4, config=FitConfig(block_rows=7))
    assert beta.dtype == torch.float64 and w.dtype == torch.float32 and beta.shape == (2, 6)
    saw_clamp = False
    for h in range(2):
        y, Phi = _np_phi(Q[h].numpy(), K[h].numpy(), C[h].numpy(), 0.4)
        w_ls = np.linalg.lstsq(Phi, y, rcond=None)[0]
        saw_clamp |= bool((w_ls < 0).any())
        w_ref = np.maximum(w_ls, 0)
        np.testing.assert_allclose(w[h].numpy(), w_ref, rtol=1e-6, atol=1e-6 * np.abs(w_ls).max())
        np.testing.assert_allclose(beta[h].numpy()[w_ref > 0], _np_beta(w_ref)[w_ref > 0], rtol=1e-7, atol=1e-7)
        assert (beta[h].numpy()[w_ref == 0] == -20.0).all()
    assert saw_clamp  # the clamp branch was exercised


def test_fit_beta_nnls_matches_scipy():
    for seed in (0, 10, 20):
        Q, K, V, C = _problem(H=3, n=50, T=30, t=9, seed=seed)
        beta, w = fit_beta(Q, K, C, 0.5, config=FitConfig(mass_solver="nnls"))
        n_zero = 0
        for h in range(3):
            y, Phi = _np_phi(Q[h].numpy(), K[h].numpy(), C[h].numpy(), 0.5)
            w_ref, _ = scipy.optimize.nnls(Phi, y)
            n_zero += int((w_ref == 0).sum())
            np.testing.assert_allclose(w[h].numpy(), w_ref, rtol=1e-5, atol=1e-6 * w_ref.max())
            assert ((w[h].numpy() == 0) == (w_ref == 0)).all()
        assert n_zero > 0  # active constraints exercised


def test_fit_beta_nnls_differs_from_ls_clamp_and_is_no_worse():
    Q, K, V, C = _problem(H=3, n=50, T=30, t=9, seed=10)
    _, w_ls = fit_beta(Q, K, C, 0.5)
    _, w_nn = fit_beta(Q, K, C, 0.5, config=FitConfig(mass_solver="nnls"))
    err_ls, _ = attention_mass_error(Q, K, C, w_ls, 0.5)
    err_nn, _ = attention_mass_error(Q, K, C, w_nn, 0.5)
    assert (err_nn <= err_ls + 1e-6).all()
    assert not torch.allclose(w_ls, w_nn)


def test_fit_beta_invalid_slots_are_ignored():
    Q, K, V, C = _problem(t=6)
    valid = torch.tensor([[1, 1, 0, 1, 1, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    C_pad = C.clone()
    C_pad[0, 2] = 5.0  # garbage in padded slots must not matter
    beta, w = fit_beta(Q, K, C_pad, 0.4, valid=valid)
    assert beta[0, 2] == 0 and beta[0, 5] == 0 and w[0, 2] == 0 and w[0, 5] == 0
    keep = [0, 1, 3, 4]
    b0, w0 = fit_beta(Q[:1], K[:1], C[:1, keep], 0.4)
    np.testing.assert_allclose(w[0, keep].numpy(), w0[0].numpy(), rtol=1e-6)
    np.testing.assert_allclose(beta[0, keep].numpy(), b0[0].numpy(), rtol=1e-6, atol=1e-9)


def test_fit_beta_bf16_inputs_solved_in_float():
    Q, K, V, C = _problem(seed=30)
    Qb, Kb, Cb = Q.bfloat16(), K.bfloat16(), C.bfloat16()
    beta, w = fit_beta(Qb, Kb, Cb, 0.4)
    assert beta.dtype == torch.bfloat16
    for h in range(2):
        y, Phi = _np_phi(Qb[h].double().numpy(), Kb[h].double().numpy(), Cb[h].double().numpy(), 0.4)
        w_ref = np.maximum(np.linalg.lstsq(Phi, y, rcond=None)[0], 0)
        np.testing.assert_allclose(w[h].numpy(), w_ref, rtol=1e-3, atol=1e-4 * w_ref.max())


# ----------------------------------------------------------------------------- C_v


def _np_cv(Q, K, V, C, beta, scaling, lam, relative, valid):
    P = _np_softmax(np.where(valid[None], scaling * Q @ C.T + beta[None], -np.inf))[:, valid]
    Y = _np_softmax(scaling * Q @ K.T) @ V
    G = P.T @ P
    ridge = lam * (np.mean(np.diag(G)) if relative else 1.0)
    Cv = np.zeros((C.shape[0], V.shape[1]))
    Cv[valid] = np.linalg.solve(G + ridge * np.eye(G.shape[0]), P.T @ Y)
    return Cv


@pytest.mark.parametrize("ridge,relative", [(1e-3, True), (0.05, False), (0.0, True)])
def test_fit_values_matches_numpy_closed_form(ridge, relative):
    Q, K, V, C = _problem(seed=40)
    V = V[..., :5].contiguous()  # Dv != D is allowed
    valid = torch.tensor([[1, 1, 1, 0, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    beta, _ = fit_beta(Q, K, C, 0.4, valid=valid)
    cfg = FitConfig(ridge_v=ridge, ridge_relative=relative, block_rows=9)
    Cv = fit_values(Q, K, V, C, beta, 0.4, valid=valid, config=cfg)
    assert Cv.shape == (2, 6, 5) and Cv.dtype == torch.float64
    for h in range(2):
        ref = _np_cv(*(x[h].numpy() for x in (Q, K, V, C, beta)), 0.4, ridge, relative, valid[h].numpy())
        np.testing.assert_allclose(Cv[h].numpy(), ref, rtol=1e-8, atol=1e-10)
    assert (Cv[0, 3] == 0).all()
    # the ridge argument overrides the config
    other = FitConfig(ridge_v=7.0, ridge_relative=relative)
    Cv2 = fit_values(Q, K, V, C, beta, 0.4, valid=valid, config=other, ridge=ridge)
    np.testing.assert_allclose(Cv2.numpy(), Cv.numpy(), rtol=1e-10, atol=1e-12)


def test_fit_values_bf16_inputs():
    Q, K, V, C = _problem(seed=50)
    Qb, Kb, Vb, Cb = Q.bfloat16(), K.bfloat16(), V.bfloat16(), C.bfloat16()
    beta, _ = fit_beta(Qb, Kb, Cb, 0.4)
    Cv = fit_values(Qb, Kb, Vb, Cb, beta, 0.4)
    assert Cv.dtype == torch.bfloat16
    valid = np.ones(6, dtype=bool)
    for h in range(2):
        ref = _np_cv(*(x[h].double().numpy() for x in (Qb, Kb, Vb, Cb, beta)), 0.4, 1e-3, True, valid)
        np.testing.assert_allclose(Cv[h].double().numpy(), ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())


def test_fit_values_rank_deficient_without_ridge_uses_jitter(caplog):
    Q, K, V, C = _problem(seed=60)
    C[:, 3] = C[:, 1]                       # duplicate compact key -> P_hat columns identical
    beta = torch.zeros(2, 6, dtype=torch.float64)
    with caplog.at_level(logging.WARNING, logger="arckv_press.compaction.fit"):
        Cv = fit_values(Q, K, V, C, beta, 0.4, ridge=0.0)
    assert "jitter" in caplog.text
    assert torch.isfinite(Cv).all()
    for h in range(2):
        P = _np_softmax(0.4 * Q[h].numpy() @ C[h].numpy().T)
        Y = _np_softmax(0.4 * Q[h].numpy() @ K[h].numpy().T) @ V[h].numpy()
        best = np.linalg.lstsq(P, Y, rcond=None)[0]
        res = np.linalg.norm(P @ Cv[h].numpy() - Y)
        assert res <= np.linalg.norm(P @ best - Y) * (1 + 1e-6) + 1e-9
        # the null direction e_1 - e_3 only sees rounding noise: no blow-up (min-norm-like)
        assert np.linalg.norm(Cv[h].numpy()) <= 1.05 * np.linalg.norm(best)
        np.testing.assert_allclose((Cv[h, 1] + Cv[h, 3]).numpy(), best[1] + best[3], rtol=1e-6, atol=1e-8)


def test_spd_solve_reports_jitter():
    A = torch.tensor([[[4.0, 2.0], [2.0, 1.0]], [[2.0, 0.0], [0.0, 3.0]]], dtype=torch.float64)
    X, jitter = spd_solve(A, torch.tensor([[2.0, 1.0], [2.0, 3.0]], dtype=torch.float64))
    assert jitter[0] > 0 and jitter[1] == 0
    np.testing.assert_allclose(X[1].numpy(), [1.0, 1.0])
    np.testing.assert_allclose((A[0] @ X[0]).numpy(), [2.0, 1.0], rtol=1e-6)
    with pytest.raises(ValueError, match="not positive definite"):
        spd_solve(-torch.eye(2, dtype=torch.float64)[None], torch.ones(1, 2, dtype=torch.float64))


# ----------------------------------------------------------------------------- attention


def test_full_and_compact_attention_match_numpy():
    Q, K, V, C = _problem(seed=70)
    beta = _rand(2, 6, seed=71)
    Cv = _rand(2, 6, 5, seed=72)
    valid = torch.tensor([[1, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    O = full_attention(Q, K, V, 0.3, block_rows=7)
    Oc = compact_attention(Q, C, beta, Cv, 0.3, valid=valid, block_rows=7)
    for h in range(2):
        ref = _np_softmax(0.3 * Q[h].numpy() @ K[h].numpy().T) @ V[h].numpy()
        np.testing.assert_allclose(O[h].numpy(), ref, rtol=1e-10, atol=1e-12)
        m = valid[h].numpy()
        P = _np_softmax(0.3 * Q[h].numpy() @ C[h].numpy()[m].T + beta[h].numpy()[m])
        np.testing.assert_allclose(Oc[h].numpy(), P @ Cv[h].numpy()[m], rtol=1e-10, atol=1e-12)
    # differentiable (used by training)
    Qg = Q.clone().requires_grad_(True)
    compact_attention(Qg, C, beta, Cv, 0.3, valid=valid).sum().backward()
    assert Qg.grad is not None and torch.isfinite(Qg.grad).all()


def test_planted_all_anchors_reproduce_full_attention():
    """C_k = K (anchors = all positions, lambda_m = 0): w = 1, C_v = V, outputs exact."""
    from arckv_press.compaction.merge import merge_keys

    H, n, T, D = 2, 48, 12, 8
    Q, K, V = _rand(H, n, D, seed=80), _rand(H, T, D, seed=81), _rand(H, T, D, seed=82)
    anchors = torch.arange(T).expand(H, T).contiguous()
    valid = torch.ones(H, T, dtype=torch.bool)
    C_k, assign = merge_keys(Q, K, anchors, valid, 0.35, lambda_m=0.0)
    assert torch.equal(C_k, K) and torch.equal(assign, anchors)
    beta, w = fit_beta(Q, K, C_k, 0.35, valid=valid)
    np.testing.assert_allclose(w.numpy(), 1.0, rtol=1e-6)
    np.testing.assert_allclose(beta.numpy(), 0.0, atol=1e-6)
    C_v = fit_values(Q, K, V, C_k, beta, 0.35, valid=valid, ridge=0.0)
    np.testing.assert_allclose(C_v.numpy(), V.numpy(), rtol=1e-6, atol=1e-6)
    Q_new = _rand(H, 30, D, seed=83)
    O = full_attention(Q_new, K, V, 0.35)
    Oc = compact_attention(Q_new, C_k, beta, C_v, 0.35, valid=valid)
    np.testing.assert_allclose(Oc.numpy(), O.numpy(), rtol=0, atol=1e-6)
    err, dead = attention_mass_error(Q, K, C_k, w, 0.35, valid=valid)
    assert (err < 1e-6).all() and (dead == 0).all()


def test_attention_mass_error_matches_numpy():
    Q, K, V, C = _problem(seed=90)
    valid = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    w = torch.tensor([[0.5, 0.0, 2.0, 1.0, 9.0, 9.0], [1.0, 0.0, 0.0, 3.0, 1.0, 0.2]])
    err, dead = attention_mass_error(Q, K, C, w, 0.4, valid=valid, block_rows=11)
    for h in range(2):
        y, Phi = _np_phi(Q[h].numpy(), K[h].numpy(), C[h].numpy(), 0.4)
        m = valid[h].numpy()
        zc = Phi[:, m] @ w[h].double().numpy()[m]
        np.testing.assert_allclose(err[h].item(), np.linalg.norm(zc - y) / np.linalg.norm(y), rtol=1e-6)
    np.testing.assert_allclose(dead.numpy(), [1 / 4, 2 / 6], rtol=1e-7)


# ----------------------------------------------------------------------------- validation


def test_bad_inputs():
    Q, K, V, C = _problem()
    with pytest.raises(ValueError, match="mass_solver"):
        FitConfig(mass_solver="lbfgs")
    with pytest.raises(ValueError, match="b_min"):
        FitConfig(b_min=1.0, b_max=-1.0)
    with pytest.raises(ValueError, match="eps_w"):
        FitConfig(eps_w=0.0)
    with pytest.raises(ValueError, match="ridge_v"):
        FitConfig(ridge_v=-1.0)
    with pytest.raises(ValueError, match="C_k"):
        fit_beta(Q, K, C[..., :4], 0.4)
    with pytest.raises(ValueError, match="valid must have shape"):
        fit_beta(Q, K, C, 0.4, valid=torch.ones(2, 5, dtype=torch.bool))
    bad = Q.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="Q contains NaN"):
        fit_beta(bad, K, C, 0.4)
    beta = torch.zeros(2, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match="beta must have shape"):
        fit_values(Q, K, V, C, beta[:, :5], 0.4)
    with pytest.raises(ValueError, match="ridge"):
        fit_values(Q, K, V, C, beta, 0.4, ridge=-1.0)
    with pytest.raises(ValueError, match="no valid compact slot"):
        compact_attention(Q, C, beta, V[:, :6], 0.4, valid=torch.zeros(2, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="w must have shape"):
        attention_mass_error(Q, K, C, beta[:, :3], 0.4)
    with pytest.raises(TypeError, match="config"):
        fit_beta(Q, K, C, 0.4, config={"eps_w": 1.0})


# ----------------------------------------------------------------- values="anchor"


def test_anchor_values_keep_the_original_values_and_the_same_beta():
    """``FitConfig(values="anchor")``: C_v is V at the anchor positions exactly (no solve), while
    the anchors, merged keys and beta are those of the default ``values="fit"`` run; the fitted
    C_v differs from V_S (so the option changes something)."""
    from arckv_press.compaction.layer import LayerMethod, compact_layer

    Q, K, V, _ = _problem(H=3, n=60, T=30)
    budgets = torch.tensor([5, 7, 3])
    fitted = compact_layer(K, V, Q, budgets, 0.3, LayerMethod("arckv-ha"))
    kept = compact_layer(K, V, Q, budgets, 0.3, LayerMethod("arckv-ha", fit=FitConfig(values="anchor")))
    for a, b in [(fitted.anchors, kept.anchors), (fitted.valid, kept.valid), (fitted.C_k, kept.C_k), (fitted.beta, kept.beta)]:
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for h in range(3):
        n = int(budgets[h])
        assert kept.valid[h].sum() == n
        np.testing.assert_array_equal(kept.C_v[h, :n].numpy(), V[h, kept.anchors[h, :n]].numpy())
        assert not torch.allclose(fitted.C_v[h, :n], kept.C_v[h, :n])
        assert bool((kept.C_v[h, n:] == 0).all())


def test_compact_layer_fits_each_head_at_its_own_anchor_count():
    """Heads with very different budgets: ``compact_layer`` (one head at a time, unpadded) gives the
    result of the padded batched composition select -> merge_keys -> fit_beta -> fit_values over all
    heads at t_max (padded slots masked), and zeros in the padded slots."""
    from arckv_press.compaction.layer import LayerMethod, _prefix_order, compact_layer
    from arckv_press.compaction.merge import merge_keys
    from arckv_press.compaction.select import chunked_topk_anchors, ha_scores

    Q, K, V, _ = _problem(H=3, n=80, T=40)
    budgets = torch.tensor([2, 17, 6])
    res = compact_layer(K, V, Q, budgets, 0.3, LayerMethod("arckv-ha", fit=FitConfig(scope="all")))
    idx, valid = _prefix_order(*chunked_topk_anchors(ha_scores(Q, K, 0.3, pooling="rms"), budgets, 4096, 10_000))
    C_k, _ = merge_keys(Q, K, idx, valid, 0.3, lambda_m=0.25)
    beta, w = fit_beta(Q, K, C_k, 0.3, valid)
    C_v = fit_values(Q, K, V, C_k, beta, 0.3, valid)
    torch.testing.assert_close(res.anchors[valid], idx[valid], rtol=0, atol=0)
    torch.testing.assert_close(res.valid, valid, rtol=0, atol=0)
    for got, ref in [(res.C_k, C_k), (res.beta, beta.float()), (res.C_v, C_v), (res.w, w)]:
        torch.testing.assert_close(got * valid[..., None] if got.ndim == 3 else got * valid, ref, rtol=1e-6, atol=1e-8)
        assert bool((got[~valid] == 0).all())


def test_anchor_values_bad_inputs():
    from arckv_press.compaction.layer import LayerMethod

    with pytest.raises(ValueError, match="values must be one of"):
        FitConfig(values="copy")
    with pytest.raises(ValueError, match="ARC-KV methods only"):
        LayerMethod("am-omp", fit=FitConfig(values="anchor"))


# ----------------------------------------------------------------------------- fixed slots (FitConfig.scope="merged")


def _fixed_problem():
    Q, K, V, C = _problem(H=2, n=60, T=25, t=8, seed=70)
    valid = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    fixed = torch.tensor([[1, 0, 0, 1, 0, 0, 1, 0], [0, 1, 1, 0, 1, 1, 0, 0]], dtype=torch.bool)  # padded 6 ignored
    return Q, K, V, C, valid, fixed


def test_fit_beta_fixed_slots_match_lstsq_on_the_remaining_mass():
    """Fixed slots keep w = 1; the free ones solve min ||Phi_F w - (Phi_K 1 - Phi_U 1)|| (numpy lstsq)."""
    Q, K, V, C, valid, fixed = _fixed_problem()
    beta, w = fit_beta(Q, K, C, 0.4, valid=valid, config=FitConfig(block_rows=11, mass_ridge=0.0), fixed=fixed)
    for h in range(2):
        vf, fx = valid[h].numpy(), (fixed[h] & valid[h]).numpy()
        free = vf & ~fx
        y, Phi = _np_phi(Q[h].numpy(), K[h].numpy(), C[h].numpy(), 0.4)
        w_ref = np.zeros(8)
        w_ref[fx] = 1.0
        w_ref[free] = np.maximum(np.linalg.lstsq(Phi[:, free], y - Phi[:, fx].sum(-1), rcond=None)[0], 0)
        np.testing.assert_allclose(w[h].numpy(), w_ref, rtol=1e-6, atol=1e-6)
        assert (beta[h].numpy()[fx] == 0).all() and (beta[h].numpy()[~vf] == 0).all()


def test_fit_values_fixed_slots_match_lstsq_on_the_remaining_output():
    """Fixed slots keep their given values; the free ones solve the ridge problem on Y - P_U V_U."""
    Q, K, V, C, valid, fixed = _fixed_problem()
    beta, _ = fit_beta(Q, K, C, 0.4, valid=valid, fixed=fixed)
    given = _rand(2, 8, 8, seed=71)
    lam = 1e-3
    Cv = fit_values(Q, K, V, C, beta, 0.4, valid=valid, config=FitConfig(ridge_v=lam, block_rows=13),
                    fixed=fixed, fixed_values=given)
    for h in range(2):
        vf, fx = valid[h].numpy(), (fixed[h] & valid[h]).numpy()
        free = vf & ~fx
        P = _np_softmax(np.where(vf[None], 0.4 * Q[h].numpy() @ C[h].numpy().T + beta[h].numpy()[None], -np.inf))
        Y = _np_softmax(0.4 * Q[h].numpy() @ K[h].numpy().T) @ V[h].numpy() - P[:, fx] @ given[h].numpy()[fx]
        G = P[:, free].T @ P[:, free]
        ref = np.linalg.solve(G + lam * np.mean(np.diag(G)) * np.eye(free.sum()), P[:, free].T @ Y)
        np.testing.assert_allclose(Cv[h].numpy()[free], ref, rtol=1e-8, atol=1e-10)
        np.testing.assert_array_equal(Cv[h].numpy()[fx], given[h].numpy()[fx])
        assert (Cv[h].numpy()[~vf] == 0).all()


def test_fixed_slots_none_fixed_equals_the_plain_fit_and_all_fixed_keeps_everything():
    Q, K, V, C, valid, _ = _fixed_problem()
    none = torch.zeros_like(valid)
    b0, w0 = fit_beta(Q, K, C, 0.4, valid=valid)
    b1, w1 = fit_beta(Q, K, C, 0.4, valid=valid, fixed=none)
    torch.testing.assert_close(b1, b0, rtol=1e-10, atol=1e-12)
    c0 = fit_values(Q, K, V, C, b0, 0.4, valid=valid)
    c1 = fit_values(Q, K, V, C, b0, 0.4, valid=valid, fixed=none, fixed_values=V[:, :8])
    torch.testing.assert_close(c1, c0, rtol=1e-10, atol=1e-12)
    everything = valid.clone()
    b2, w2 = fit_beta(Q, K, C, 0.4, valid=valid, fixed=everything)
    assert (w2 == valid.float()).all() and (b2 == 0).all()
    c2 = fit_values(Q, K, V, C, b2, 0.4, valid=valid, fixed=everything, fixed_values=V[:, :8])
    torch.testing.assert_close(c2, V[:, :8] * valid[..., None], rtol=0, atol=0)


def test_fixed_slots_bad_inputs():
    Q, K, V, C, valid, fixed = _fixed_problem()
    beta, _ = fit_beta(Q, K, C, 0.4, valid=valid)
    with pytest.raises(TypeError, match="fixed must be a bool"):
        fit_beta(Q, K, C, 0.4, valid=valid, fixed=fixed.float())
    with pytest.raises(ValueError, match="shape"):
        fit_beta(Q, K, C, 0.4, valid=valid, fixed=fixed[:, :5])
    with pytest.raises(ValueError, match="together"):
        fit_values(Q, K, V, C, beta, 0.4, valid=valid, fixed=fixed)
    with pytest.raises(ValueError, match="fixed_values must have shape"):
        fit_values(Q, K, V, C, beta, 0.4, valid=valid, fixed=fixed, fixed_values=V[:, :3])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fits_from_shared_logits_equal_the_fits_that_multiply_their_own(dtype):
    """compact_logits computed once give the same beta and C_v as each fit's own products, with fixed
    slots, padding, row targets and several row blocks (the layer pipeline shares them)."""
    Q, K, V, C, valid, fixed = (x.to(dtype) if x.is_floating_point() else x for x in _fixed_problem())
    cfg = FitConfig(block_rows=16)                                   # 60 rows: 4 blocks, the last short
    Lk = 0.4 * Q.double() @ K.double().transpose(1, 2)
    targets = (Lk.amax(-1).to(dtype), torch.logsumexp(Lk, -1).to(dtype))
    logits = compact_logits(Q, C, 0.4, cfg.block_rows)
    assert [tuple(x.shape) for x in logits] == [(2, 16, 8)] * 3 + [(2, 12, 8)]
    b0, w0 = fit_beta(Q, K, C, 0.4, valid, cfg, targets=targets, fixed=fixed)
    b1, w1 = fit_beta(Q, K, C, 0.4, valid, cfg, targets=targets, fixed=fixed, logits=logits)
    torch.testing.assert_close(b1, b0, rtol=0, atol=0)
    torch.testing.assert_close(w1, w0, rtol=0, atol=0)
    c0 = fit_values(Q, K, V, C, b0, 0.4, valid, cfg, fixed=fixed, fixed_values=V[:, :8])
    c1 = fit_values(Q, K, V, C, b0, 0.4, valid, cfg, fixed=fixed, fixed_values=V[:, :8], logits=logits)
    tol = 1e-12 if dtype == torch.float64 else 1e-5                  # baddbmm vs matmul + add: rounding only
    torch.testing.assert_close(c1, c0, rtol=tol, atol=tol)


def test_shared_logits_of_other_rows_or_blocks_are_refused():
    Q, K, V, C, valid, _ = _fixed_problem()
    cfg = FitConfig(block_rows=16)
    with pytest.raises(ValueError, match="logits are not the 4 blocks of 16 rows"):
        fit_beta(Q, K, C, 0.4, valid, cfg, logits=compact_logits(Q, C, 0.4, 32))
    with pytest.raises(ValueError, match="logits are not"):
        fit_values(Q, K, V, C, torch.zeros(2, 8, dtype=Q.dtype), 0.4, valid, cfg,
                   logits=compact_logits(Q[:, :50], C, 0.4, 16))
    with pytest.raises(TypeError, match="list of compact_logits"):
        fit_beta(Q, K, C, 0.4, valid, cfg, logits=torch.zeros(2, 60, 8))
    with pytest.raises(ValueError, match=r"logits are \['torch.float32'\] but this fit computes in torch.float64"):
        fit_beta(Q, K, C, 0.4, valid, cfg, logits=compact_logits(Q.float(), C.float(), 0.4, 16))


@pytest.mark.parametrize("lam", [0.25, 0.0])
def test_fit_scope_merged_keeps_lone_anchors_and_fits_the_rest(lam):
    """``FitConfig.scope="merged"``: an anchor whose group (Eq. (anchor_assignment)) holds no other position
    keeps its key, value and beta = 0; the others are fitted to what those leave (numpy lstsq on
    the remaining mass and output). Checked head by head against the naive merge of test_merge."""
    from test_merge import _naive_merge

    from arckv_press.compaction.layer import LayerMethod, compact_layer

    Q, K, V, _ = _problem(H=3, n=70, T=30, seed=80)
    budgets = torch.tensor([4, 22, 9])  # head 1 keeps most positions: most of its anchors are alone
    fit = FitConfig(mass_ridge=0.0, ridge_v=1e-3)
    res = compact_layer(K, V, Q, budgets, 0.3, LayerMethod("arckv-ha", lambda_m=lam, fit=dataclasses.replace(fit, scope="merged")))
    full = compact_layer(K, V, Q, budgets, 0.3, LayerMethod("arckv-ha", lambda_m=lam, fit=dataclasses.replace(fit, scope="all")))
    C_ref, assign = _naive_merge(Q.numpy(), K.numpy(), res.anchors.numpy(), res.valid.numpy(), 0.3, lam)
    n_alone = 0
    for h in range(3):
        t = int(budgets[h])
        anchors = res.anchors[h, :t].numpy()
        alone = np.bincount(assign[h], minlength=t)[:t] == 1
        n_alone += int(alone.sum())
        np.testing.assert_allclose(res.C_k[h, :t].numpy(), C_ref[h, :t], rtol=1e-10, atol=1e-12)
        np.testing.assert_array_equal(res.C_k[h, :t].numpy()[alone], K[h, anchors[alone]].numpy())
        np.testing.assert_array_equal(res.C_v[h, :t].numpy()[alone], V[h, anchors[alone]].numpy())
        assert (res.beta[h, :t].numpy()[alone] == 0).all()
        y, Phi = _np_phi(Q[h].numpy(), K[h].numpy(), C_ref[h, :t], 0.3)
        w_ref = np.maximum(np.linalg.lstsq(Phi[:, ~alone], y - Phi[:, alone].sum(-1), rcond=None)[0], 0)
        np.testing.assert_allclose(res.w[h, :t].numpy()[~alone], w_ref, rtol=1e-5, atol=1e-7)
        P = _np_softmax(0.3 * Q[h].numpy() @ C_ref[h, :t].T + res.beta[h, :t].numpy()[None])
        Y = _np_softmax(0.3 * Q[h].numpy() @ K[h].numpy().T) @ V[h].numpy() - P[:, alone] @ V[h, anchors[alone]].numpy()
        G = P[:, ~alone].T @ P[:, ~alone]
        cv = np.linalg.solve(G + 1e-3 * np.mean(np.diag(G)) * np.eye(G.shape[0]), P[:, ~alone].T @ Y)
        np.testing.assert_allclose(res.C_v[h, :t].numpy()[~alone], cv, rtol=1e-6, atol=1e-8)
    assert 0 < n_alone < int(budgets.sum())
    assert not torch.allclose(res.C_v, full.C_v)  # the scope changes the fit


# ----------------------------------------------------------------------------- symmetric normal matrices


@pytest.mark.parametrize("rows,col_block", [(1, 1), (7, 3), (64, 5), (2048, 128), (2048, 4)])
def test_gram_sum_equals_the_full_product_and_is_exactly_symmetric(rows, col_block):
    """Lower-block-triangle sums over uneven row blocks equal numpy's X^T X (float64), whatever the
    flush size and column block (t = 13 is no multiple of them; col_block 128: one full product per
    block)."""
    X = _rand(2, 50, 13, seed=5)
    acc = GramSum(2, 13, torch.float64, X.device, rows=rows, col_block=col_block)
    for lo, hi in [(0, 4), (4, 5), (5, 31), (31, 50)]:
        acc.add(X[:, lo:hi])
    A = acc.total()
    ref = np.einsum("hni,hnj->hij", X.numpy(), X.numpy())
    np.testing.assert_allclose(A.numpy(), ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(A, A.transpose(1, 2))


def test_gram_sum_refuses_rows_of_another_width_or_dtype():
    acc = GramSum(2, 13, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="do not fit"):
        acc.add(torch.zeros(2, 4, 12))
    with pytest.raises(ValueError, match="do not fit"):
        acc.add(torch.zeros(2, 4, 13, dtype=torch.float64))
    with pytest.raises(ValueError, match="rows"):
        GramSum(2, 13, torch.float32, torch.device("cpu"), rows=0)


def test_fits_with_several_column_blocks_match_numpy():
    """t = 300 anchors (three column blocks of the normal matrices) against numpy's lstsq and ridge."""
    H, n, T, t, D = 1, 700, 400, 300, 8
    Q, K, V = _rand(H, n, D, seed=81), _rand(H, T, D, seed=82), _rand(H, T, D, seed=83)
    C = K[:, :t] + 0.05 * _rand(H, t, D, seed=84)
    beta, w = fit_beta(Q, K, C, 0.3, config=FitConfig(mass_ridge=0.0))
    y, Phi = _np_phi(Q[0].numpy(), K[0].numpy(), C[0].numpy(), 0.3)
    w_ref = np.maximum(np.linalg.lstsq(Phi, y, rcond=None)[0], 0)
    np.testing.assert_allclose(w[0].numpy(), w_ref, rtol=1e-4, atol=1e-6 * np.abs(w_ref).max())
    lam = 1e-3
    Cv = fit_values(Q, K, V, C, beta, 0.3, config=FitConfig(ridge_v=lam))
    P = _np_softmax(0.3 * Q[0].numpy() @ C[0].numpy().T + beta[0].numpy()[None])
    Y = _np_softmax(0.3 * Q[0].numpy() @ K[0].numpy().T) @ V[0].numpy()
    G = P.T @ P
    ref = np.linalg.solve(G + lam * np.mean(np.diag(G)) * np.eye(t), P.T @ Y)
    np.testing.assert_allclose(Cv[0].numpy(), ref, rtol=1e-7, atol=1e-9)
