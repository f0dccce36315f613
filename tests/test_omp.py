"""Tests for the Attention Matching baselines (arckv_press.compaction.omp).

References are independent: a plain per-head numpy float64 loop that follows AM's
``OMPCompaction._select_keys_omp`` (``numpy.linalg.lstsq`` at each refit), numpy/scipy least
squares on the selected support, a numpy re-implementation of AM's highest-attention keys, and
closed forms (planted supports, duplicated keys, a full budget).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.optimize
import torch

from arckv_press.compaction.fit import FitConfig
from arckv_press.compaction.omp import (
    AM_HA,
    AM_OMP,
    AM_OMP_FAST,
    AM_PROGRESSIVE_SCHEDULE,
    OMPConfig,
    am_compact,
    attention_mass,
    ha_select,
    omp_on_mass,
    omp_select,
)

# ------------------------------------------------------------------------------------------------
# independent references


def _softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def _mass_np(Q: np.ndarray, K: np.ndarray, scaling: float) -> tuple[np.ndarray, np.ndarray]:
    logits = scaling * Q @ K.T
    E = np.exp(logits - logits.max(axis=1, keepdims=True))
    return E, E.sum(axis=1)


def _schedule_np(cfg: OMPConfig, count: int) -> tuple[int, int]:
    if cfg.schedule is None:
        return cfg.k_choice, cfg.nnls_interval
    for max_keys, k, interval in cfg.schedule:
        if max_keys is None or count < max_keys:
            return k, interval
    raise AssertionError("unreachable")


def am_omp_reference(E: np.ndarray, target: np.ndarray, t: int, cfg: OMPConfig) -> tuple[list[int], np.ndarray]:
    """One head, plain Python/numpy float64, structured like AM's ``_select_keys_omp``.

    Deviations documented in omp.py are mirrored: final solve after the last drop round, drops
    capped at the available keys (lowest weights first).
    """
    n, T = E.shape
    taken = np.zeros(T, dtype=bool)
    sel: list[int] = []
    w = np.zeros(0)
    step, fresh, rounds = 0, True, 0

    def fit(S: list[int]) -> np.ndarray:
        if not S:
            return np.zeros(0)
        sol = np.linalg.lstsq(E[:, S], target, rcond=None)[0]
        return np.clip(sol, cfg.w_min, cfg.w_max)

    while True:
        if len(sel) < t:
            r = target - E[:, sel] @ w
            corr = E.T @ r
            corr[taken] = -np.inf
            k, interval = _schedule_np(cfg, len(sel))
            k = min(k, t - len(sel))
            for _ in range(k):
                j = int(np.argmax(corr))  # first occurrence: lowest index among ties
                sel.append(j)
                taken[j] = True
                corr[j] = -np.inf
            if fresh or step % interval == 0:
                w = fit(sel)
            else:
                w = np.concatenate([w, np.full(k, cfg.w_min)])
            fresh = False
            step += 1
            continue
        w = fit(sel)
        if cfg.drop_beta_cutoff is None or rounds >= cfg.max_drop_rounds:
            break
        low = np.log(w) < cfg.drop_beta_cutoff
        n_drop = min(int(low.sum()), T - int(taken.sum()))
        if n_drop == 0:
            break
        cand = sorted(np.flatnonzero(low), key=lambda i: (w[i], i))[:n_drop]
        keep = [i for i in range(len(sel)) if i not in set(cand)]
        sel = [sel[i] for i in keep]
        w = fit(sel)
        fresh, step, rounds = True, step + 1, rounds + 1
    return sel, w


def am_ha_reference(Q: np.ndarray, K: np.ndarray, t: int, scaling: float) -> tuple[np.ndarray, np.ndarray]:
    """One head, numpy: AM's ``highest_attn_keys_rms_nnls2_-3_3`` (power iteration from ones)."""
    P = _softmax(scaling * Q @ K.T)
    score = np.sqrt((P**2).mean(axis=0))
    idx = np.sort(np.argsort(-score, kind="stable")[:t])
    E, target = _mass_np(Q, K, scaling)
    M = E[:, idx]
    lo, hi = math.exp(-3), math.exp(3)
    w = np.clip(np.linalg.lstsq(M, target, rcond=None)[0], lo, hi)
    u = np.ones(len(idx))
    for _ in range(3):
        u = M.T @ (M @ u)
        u /= np.linalg.norm(u)
    lip = max(u @ (M.T @ (M @ u)), 1e-6)
    for _ in range(2):
        w = np.clip(w - M.T @ (M @ w - target) / lip, lo, hi)
    return idx, w


def _random_qk(seed: int, H: int, n: int, T: int, D: int, dtype=torch.float64, key_scale: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    Q = torch.randn(H, n, D, generator=g, dtype=dtype)
    K = key_scale * torch.randn(H, T, D, generator=g, dtype=dtype)
    V = torch.randn(H, T, D, generator=g, dtype=dtype)
    return Q, K, V


# ------------------------------------------------------------------------------------------------
# OMP core


def test_planted_support_recovered_on_synthetic_mass():
    """target = E_S w with a sparse positive w on sparse nonnegative columns: exact recovery by
    one-key-per-step OMP (OMP-fast picks 4 keys per residual and need not recover it exactly)."""
    g = torch.Generator().manual_seed(0)
    H, n, T, s = 3, 200, 300, 8
    E = torch.rand(H, n, T, generator=g, dtype=torch.float64) * (torch.rand(H, n, T, generator=g) < 0.1)
    support = torch.stack([torch.randperm(T, generator=g)[:s] for _ in range(H)])
    w_true = 0.5 + 1.5 * torch.rand(H, s, generator=g, dtype=torch.float64)
    target = torch.einsum("hns,hs->hn", E.gather(2, support[:, None, :].expand(H, n, s)), w_true)
    for E_in in (E, E.float()):
        idx, valid, w = omp_on_mass(E_in, target, s, AM_OMP)
        assert valid.all()
        for h in range(H):
            got = dict(zip(idx[h].tolist(), w[h].tolist()))
            want = dict(zip(support[h].tolist(), w_true[h].tolist()))
            assert set(got) == set(want)
            rtol = 1e-9 if E_in.dtype == torch.float64 else 1e-5
            np.testing.assert_allclose([got[j] for j in want], list(want.values()), rtol=rtol)


def test_duplicated_keys_pick_one_copy_per_group_with_multiplicity_weight():
    """T keys = a few distinct keys repeated m_j times: E 1 = sum_j m_j e_j, so OMP with budget
    = #distinct must take one copy of each and weight it by its multiplicity (end to end)."""
    g = torch.Generator().manual_seed(1)
    s, D, n = 6, 16, 128
    keys = 3 * torch.randn(2, s, D, generator=g)
    mult = torch.randint(1, 5, (s,), generator=g)
    group = torch.repeat_interleave(torch.arange(s), mult)
    group = group[torch.randperm(len(group), generator=g)]
    Q, K = torch.randn(2, n, D, generator=g), keys[:, group]
    for cfg in (AM_OMP, AM_OMP_FAST):
        idx, valid, w = omp_select(Q, K, torch.tensor([s, s]), D**-0.5, cfg)
        for h in range(2):
            assert sorted(group[idx[h]].tolist()) == list(range(s))
            np.testing.assert_allclose(w[h].numpy(), mult[group[idx[h]]].double().numpy(), rtol=1e-5)


@pytest.mark.parametrize(
    "cfg",
    [
        AM_OMP,
        AM_OMP_FAST,
        OMPConfig(k_choice=3, nnls_interval=3),
        OMPConfig(schedule=((5, 1, 1), (12, 2, 2), (None, 4, 3))),
        OMPConfig(k_choice=2, nnls_interval=2, drop_beta_cutoff=None),
    ],
)
def test_matches_per_head_numpy_reference(cfg):
    """Selection order and weights equal a plain per-head numpy loop after AM's code."""
    H, n, T, D = 3, 64, 90, 8
    Q, K, _ = _random_qk(2, H, n, T, D)
    budgets = torch.tensor([7, 30, 19])
    E, target = attention_mass(Q, K, D**-0.5)
    idx, valid, w = omp_on_mass(E, target, budgets, cfg)
    for h in range(H):
        E_np, tg_np = _mass_np(Q[h].numpy(), K[h].numpy(), D**-0.5)
        sel, w_ref = am_omp_reference(E_np, tg_np, int(budgets[h]), cfg)
        t = int(budgets[h])
        assert valid[h].sum() == t and valid[h, :t].all()
        assert idx[h, :t].tolist() == sel
        np.testing.assert_allclose(w[h, :t].numpy(), w_ref, rtol=1e-6, atol=1e-10)
        assert (idx[h, t:] == 0).all() and (w[h, t:] == 0).all()


def test_omp_fast_with_k1_interval1_equals_omp():
    """AM's schedule uses k_choice 1 / interval 1 below 300 keys, so the two must coincide."""
    Q, K, _ = _random_qk(3, 2, 96, 160, 16, dtype=torch.float32)
    budgets = torch.tensor([40, 25])
    a = omp_select(Q, K, budgets, 0.25, AM_OMP)
    b = omp_select(Q, K, budgets, 0.25, OMPConfig(k_choice=1, nnls_interval=1))
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert AM_PROGRESSIVE_SCHEDULE[0] == (300, 1, 1)


@pytest.mark.parametrize("cfg", [AM_OMP, AM_OMP_FAST])
def test_batched_over_heads_equals_each_head_alone(cfg):
    Q, K, _ = _random_qk(4, 4, 80, 120, 16, dtype=torch.float32)
    budgets = torch.tensor([5, 37, 12, 21])
    idx, valid, w = omp_select(Q, K, budgets, 0.25, cfg)
    assert idx.shape == (4, 37)
    for h in range(4):
        i1, v1, w1 = omp_select(Q[h : h + 1], K[h : h + 1], budgets[h : h + 1], 0.25, cfg)
        t = int(budgets[h])
        assert torch.equal(i1[0], idx[h, :t]) and v1.all() and valid[h].sum() == t
        torch.testing.assert_close(w1[0], w[h, :t], rtol=1e-9, atol=1e-12)
        assert (idx[h, t:] == 0).all() and not valid[h, t:].any()
        assert torch.all(idx[h, 1:t] > idx[h, : t - 1])  # sorted by position, distinct


def test_never_worse_than_random_subsets_in_mass_fit():
    """Peaked attention (logit std ~4). With diffuse random attention (std ~2) OMP-fast, which
    picks 8 keys from one residual at this budget, can lose to the best of 20 random subsets."""
    H, n, T, D, t = 2, 128, 256, 16, 32
    Q, K, _ = _random_qk(5, H, n, T, D, key_scale=4.0)
    E, target = attention_mass(Q, K, D**-0.5)
    g = torch.Generator().manual_seed(6)
    for cfg in (AM_OMP, AM_OMP_FAST):
        idx, _, w = omp_select(Q, K, t, D**-0.5, cfg)
        for h in range(H):
            E_np, tg = E[h].numpy(), target[h].numpy()
            err_omp = np.linalg.norm(E_np[:, idx[h].numpy()] @ w[h].numpy() - tg)
            for _ in range(20):
                S = torch.randperm(T, generator=g)[:t].numpy()
                w_r = np.clip(np.linalg.lstsq(E_np[:, S], tg, rcond=None)[0], cfg.w_min, cfg.w_max)
                assert err_omp <= np.linalg.norm(E_np[:, S] @ w_r - tg)


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-8), (torch.float32, 2e-3)])
def test_final_weights_match_scipy_on_support(dtype, rtol):
    """Where the clamp is inactive the weights are the least-squares (= NNLS) solution on S,
    computed here in float64 from the inputs by numpy/scipy."""
    H, n, T, D, t = 2, 200, 150, 16, 20
    Q, K, _ = _random_qk(7, H, n, T, D, dtype=dtype, key_scale=1.0)
    idx, valid, w = omp_select(Q, K, t, D**-0.5, AM_OMP)
    checked = 0
    for h in range(H):
        E_np, tg = _mass_np(Q[h].double().numpy(), K[h].double().numpy(), D**-0.5)
        M = E_np[:, idx[h].numpy()]
        ls = np.linalg.lstsq(M, tg, rcond=None)[0]
        if not (ls > 1e-12).all() or not (ls < math.exp(7)).all():
            continue
        nn = scipy.optimize.nnls(M, tg)[0]
        np.testing.assert_allclose(w[h].numpy(), ls, rtol=rtol)
        np.testing.assert_allclose(w[h].numpy(), nn, rtol=rtol)
        checked += 1
    assert checked >= 1


def test_drop_and_refill_replaces_a_key_with_tiny_weight():
    """Column a = 0.6 (b + c) + 0.5 e has the largest correlation with target = b + c + 0.05 d
    and is picked first; once b and c are in, its least-squares weight is 0 (beta < -7), so it
    is dropped, excluded, and its slot refilled with d (weight 0.05)."""
    n, T = 40, 8
    E = torch.zeros(1, n, T, dtype=torch.float64)
    b, c, e, d = (torch.zeros(n, dtype=torch.float64) for _ in range(4))
    b[0:10], c[10:20], e[20:30], d[30:40] = 1, 1, 1, 1
    E[0, :, 0] = 0.6 * (b + c) + 0.5 * e  # a
    E[0, :, 1], E[0, :, 2], E[0, :, 5] = b, c, d
    E[0, 30:40, 3] = torch.linspace(0.001, 0.002, 10, dtype=torch.float64)  # weak distractors
    E[0, 0:5, 4] = 0.01
    E[0, 35:40, 6] = 0.01
    E[0, 20:25, 7] = 0.01
    target = (b + c + 0.05 * d)[None]
    # without drops, 'a' stays with the clamped weight 1e-12
    idx0, _, w0 = omp_on_mass(E, target, 3, OMPConfig(drop_beta_cutoff=None))
    assert idx0[0].tolist() == [0, 1, 2] and w0[0, 0] == 1e-12
    idx, valid, w = omp_on_mass(E, target, 3, AM_OMP)
    assert valid.all()
    assert idx[0].tolist() == [1, 2, 5]
    np.testing.assert_allclose(w[0].numpy(), [1.0, 1.0, 0.05], rtol=1e-10)
    sel, w_ref = am_omp_reference(E[0].numpy(), target[0].numpy(), 3, AM_OMP)
    assert sel == [1, 2, 5]


def test_ties_go_to_lowest_index_and_drop_rounds_are_bounded():
    """All columns identical: the first pick is key 0 with weight T; every other key is redundant
    (weight ~0 -> dropped), so after 3 drop rounds the second slot holds key 1 + 3 = 4."""
    T = 10
    E = torch.full((1, 16, T), 0.5, dtype=torch.float64)
    target = E.sum(dim=2)
    idx, _, w = omp_on_mass(E, target, 1, AM_OMP)
    assert idx.tolist() == [[0]] and abs(float(w[0, 0]) - T) < 1e-9
    idx, _, w = omp_on_mass(E, target, 2, AM_OMP)
    assert idx.tolist() == [[0, 4]]
    assert abs(float(w[0, 0]) - T) < 1e-6 and float(w[0, 1]) == 1e-12


def test_budget_equal_to_T_reconstructs_exactly():
    """With every key kept (n > T), w = 1, beta = 0, C_k = K and C_v = V."""
    Q, K, V = _random_qk(8, 2, 64, 12, 8, key_scale=1.0)
    for variant in ("omp", "omp-fast"):
        C_k, beta, C_v, idx, valid = am_compact(Q, K, V, 12, 8**-0.5, variant)
        assert valid.all() and idx.tolist() == [list(range(12))] * 2
        torch.testing.assert_close(C_k, K)
        torch.testing.assert_close(beta, torch.zeros(2, 12), atol=1e-5, rtol=0)
        torch.testing.assert_close(C_v, V, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# highest-attention keys


def test_ha_matches_numpy_reference_and_beta_box():
    H, n, T, D = 3, 96, 140, 16
    Q, K, _ = _random_qk(9, H, n, T, D)
    budgets = torch.tensor([10, 33, 21])
    idx, valid, w = ha_select(Q, K, budgets, D**-0.5, AM_HA)
    for h in range(H):
        t = int(budgets[h])
        idx_ref, w_ref = am_ha_reference(Q[h].numpy(), K[h].numpy(), t, D**-0.5)
        assert idx[h, :t].tolist() == idx_ref.tolist()
        np.testing.assert_allclose(w[h, :t].numpy(), w_ref, rtol=1e-8)
        assert not valid[h, t:].any() and (w[h, t:] == 0).all()
    _, beta, _, _, valid = am_compact(Q, K, torch.randn(H, T, D, dtype=Q.dtype), budgets, D**-0.5, "ha")
    assert (beta[valid] >= -3 - 1e-6).all() and (beta[valid] <= 3 + 1e-6).all()
    assert (beta[~valid] == 0).all()


def test_ha_ties_take_lowest_index():
    """All keys identical (exact integer logits): every score ties, so top-t = keys 0..t-1."""
    Q = torch.ones(1, 8, 4)
    K = torch.ones(1, 20, 4)
    idx, valid, _ = ha_select(Q, K, 5, 0.5)
    assert idx.tolist() == [[0, 1, 2, 3, 4]] and valid.all()


# ------------------------------------------------------------------------------------------------
# full compaction


def test_am_compact_values_match_numpy_lstsq_and_dtypes():
    H, n, T, D = 2, 120, 100, 8
    Q, K, V = _random_qk(10, H, n, T, D, key_scale=1.0)
    budgets = torch.tensor([15, 9])
    for variant in ("omp", "omp-fast", "ha"):
        C_k, beta, C_v, idx, valid = am_compact(Q, K, V, budgets, D**-0.5, variant)
        assert beta.dtype == torch.float32 and C_k.dtype == C_v.dtype == torch.float64
        for h in range(H):
            t = int(budgets[h])
            S = idx[h, :t].numpy()
            np.testing.assert_array_equal(C_k[h, :t].numpy(), K[h].numpy()[S])
            X = _softmax(D**-0.5 * Q[h].numpy() @ K[h].numpy()[S].T + beta[h, :t].double().numpy())
            Y = _softmax(D**-0.5 * Q[h].numpy() @ K[h].numpy().T) @ V[h].numpy()
            C_ref = np.linalg.lstsq(X, Y, rcond=None)[0]
            np.testing.assert_allclose(C_v[h, :t].numpy(), C_ref, rtol=1e-6, atol=1e-8)
            assert (C_k[h, t:] == 0).all() and (C_v[h, t:] == 0).all()
    Qb, Kb, Vb = Q.bfloat16(), K.bfloat16(), V.bfloat16()
    C_k, beta, C_v, idx, valid = am_compact(Qb, Kb, Vb, budgets, D**-0.5, "omp-fast")
    assert C_k.dtype == C_v.dtype == torch.bfloat16 and beta.dtype == torch.float32
    assert torch.isfinite(C_v.float()).all() and torch.isfinite(beta).all()


# ------------------------------------------------------------------------------------------------
# bad inputs


def test_bad_inputs_raise():
    Q, K, V = _random_qk(11, 2, 16, 20, 8, dtype=torch.float32)
    s = 8**-0.5
    with pytest.raises(ValueError, match="budgets"):
        omp_select(Q, K, torch.tensor([5, 21]), s)
    with pytest.raises(ValueError, match="budgets"):
        omp_select(Q, K, torch.tensor([0, 3]), s)
    with pytest.raises(ValueError, match="budgets"):
        am_compact(Q, K, V, torch.tensor([5, 21]), s, "ha")
    with pytest.raises(ValueError, match="budgets"):
        omp_select(Q, K, torch.tensor([5]), s)
    with pytest.raises(TypeError, match="budgets"):
        omp_select(Q, K, torch.tensor([5.0, 3.0]), s)
    for name in ("Q", "K", "V"):
        bad = {"Q": Q.clone(), "K": K.clone(), "V": V.clone()}
        bad[name][1, 3, 2] = float("nan")
        with pytest.raises(ValueError, match=f"{name} contains NaN"):
            am_compact(bad["Q"], bad["K"], bad["V"], 4, s)
    K_inf = K.clone()
    K_inf[0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="K contains NaN"):
        omp_select(Q, K_inf, 4, s)
    with pytest.raises(ValueError, match="scaling"):
        omp_select(Q, K, 4, float("nan"))
    with pytest.raises(ValueError, match="scaling"):
        omp_select(Q, K, 4, -1.0)
    with pytest.raises(ValueError, match="variant"):
        am_compact(Q, K, V, 4, s, "lasso")
    # more kept keys (17) than reference rows (16): OMP refuses (it returned NaN weights before)
    for variant in ("omp", "omp-fast"):
        with pytest.raises(ValueError, match="at least as many reference query rows"):
            am_compact(Q, K, V, 17, s, variant)
    with pytest.raises(ValueError, match="at least as many reference query rows"):
        omp_on_mass(torch.rand(2, 16, 20), torch.rand(2, 16), 17)
    with pytest.raises(ValueError, match="must share H and D"):
        omp_select(Q, K[:, :, :4], 4, s)
    with pytest.raises(ValueError, match="V"):
        am_compact(Q, K, V[:, :10], 4, s)
    with pytest.raises(ValueError, match="target"):
        omp_on_mass(torch.rand(2, 16, 20), torch.rand(2, 15), 4)
    with pytest.raises(ValueError, match="target contains NaN"):
        omp_on_mass(torch.rand(2, 16, 20), torch.full((2, 16), float("nan")), 4)
    with pytest.raises(ValueError, match="k_choice"):
        OMPConfig(k_choice=0)
    with pytest.raises(ValueError, match="schedule"):
        OMPConfig(schedule=((None, 1, 1), (300, 2, 2)))
    with pytest.raises(TypeError, match="config"):
        omp_select(Q, K, 4, s, AM_HA)


# ------------------------------------------------------------------------------------------------
# ARC-KV's OMP anchor search (compaction.layer.omp_anchors; the default below keep 5%)


def test_omp_anchors_are_the_am_search_and_fill_budgets_beyond_the_rows_with_top_scores():
    """A head whose budget fits the rows gets exactly OMP's anchors; a head asking for more keys than
    there are rows gets OMP's choice of ``n`` plus the best-scored positions OMP left (brute force), no
    duplicates; the scores are read only when needed."""
    from arckv_press.compaction.layer import omp_anchors

    Q, K, _ = _random_qk(11, H=3, n=12, T=40, D=8, dtype=torch.float32)
    scores = torch.rand(3, 40, generator=torch.Generator().manual_seed(2))
    calls = []

    def lazy():
        calls.append(1)
        return scores

    budgets = torch.tensor([5, 9, 12])
    idx, valid = omp_anchors(Q, K, budgets, 0.3, "omp", lazy)
    ref_idx, ref_valid, _ = omp_select(Q, K, budgets, 0.3, AM_OMP)
    assert not calls and torch.equal(idx, ref_idx) and torch.equal(valid, ref_valid)

    budgets = torch.tensor([5, 20, 12])                      # head 1 asks for 20 keys from 12 rows
    idx, valid = omp_anchors(Q, K, budgets, 0.3, "omp-fast", lazy)
    capped, _, _ = omp_select(Q, K, budgets.clamp_max(12), 0.3, AM_OMP_FAST)
    assert len(calls) == 1 and valid.sum(-1).tolist() == [5, 20, 12] and idx.shape == (3, 20)
    for h in (0, 2):
        assert torch.equal(idx[h, :int(budgets[h])], capped[h, :int(budgets[h])])
    got = idx[1, valid[1]].tolist()
    first = capped[1, :12].tolist()
    rest = [j for j in sorted(range(40), key=lambda j: (-float(scores[1, j]), j)) if j not in first][:8]
    assert len(set(got)) == 20 and set(got) == set(first) | set(rest)


def test_omp_anchors_search_half_the_rows_where_the_mass_fit_overflows(monkeypatch):
    """Where OMP's mass fit overflows (a head asking for about as many keys as rows; here raised by a
    stand-in for every search beyond half the rows), each head's search is capped at ``n // 2`` and the
    rest of its budget is the best-scored positions OMP left (brute force), no duplicates; a search
    that fits is not retried."""
    import arckv_press.compaction.layer as layer_mod
    from arckv_press.compaction.omp import OMPOverflowError

    Q, K, _ = _random_qk(11, H=3, n=12, T=40, D=8, dtype=torch.float32)
    scores = torch.rand(3, 40, generator=torch.Generator().manual_seed(2))
    seen = []

    def overflowing(rows, keys, budgets, *args):
        seen.append(budgets.tolist())
        if int(budgets.max()) > rows.shape[1] // 2:
            raise OMPOverflowError("stand-in")
        return omp_select(rows, keys, budgets, *args)

    monkeypatch.setattr(layer_mod, "omp_select", overflowing)
    budgets = torch.tensor([5, 12, 9])
    idx, valid = layer_mod.omp_anchors(Q, K, budgets, 0.3, "omp", scores)
    assert seen == [[5, 12, 9], [5, 6, 6]]
    half, half_valid, _ = omp_select(Q, K, torch.tensor([5, 6, 6]), 0.3, AM_OMP)
    assert valid.sum(-1).tolist() == [5, 12, 9]
    for h, t in enumerate((5, 12, 9)):
        first = half[h, half_valid[h]].tolist()
        rest = [j for j in sorted(range(40), key=lambda j: (-float(scores[h, j]), j)) if j not in first][:t - len(first)]
        got = idx[h, valid[h]].tolist()
        assert len(set(got)) == t and set(got) == set(first) | set(rest)
    seen.clear()
    idx, valid = layer_mod.omp_anchors(Q, K, torch.tensor([5, 6, 3]), 0.3, "omp", scores)
    assert seen == [[5, 6, 3]]


def test_layer_step_searches_omp_anchors_on_its_budget_rows():
    """The compaction's layer step with ``anchor_search="omp"`` takes OMP's anchors on its budget
    rows (all query heads of each position, GQA layout), not on the whole pool."""
    from arckv_press.compaction.layer import LayerMethod, compact_layer_from_stats
    from arckv_press.compaction.reference import grouped_rows
    from arckv_press.compaction.stats import ReferenceStats, split_attention

    G, N = 2, 30
    Q, K, V = _random_qk(5, H=2, n=G * N, T=24, D=8, dtype=torch.float32)
    st = ReferenceStats(2, G, N, 24, 8, "ha", "rms", block=16)
    split_attention(Q.view(2, G, N, 8), K, V, (0, 24), 0.3, 0, 16, on_block=lambda a, blk: st.update(a, blk, V),
                    keep_logits=st.needs_logits)
    st = st.result()
    positions = torch.tensor([1, 4, 7, 9, 15, 20, 22, 28])
    budgets = torch.tensor([4, 6])
    method = LayerMethod("arckv-ha", anchor_search="omp", fit=FitConfig(witnesses=False))
    res = compact_layer_from_stats(K, V, Q, st, budgets, 0.3, method, grouped_rows(positions, N, G))
    ref, ref_valid, _ = omp_select(Q[:, grouped_rows(positions, N, G)], K, budgets, 0.3, AM_OMP)
    for h in range(2):
        assert sorted(res.anchors[h, res.valid[h]].tolist()) == sorted(ref[h, ref_valid[h]].tolist())
    other = compact_layer_from_stats(K, V, Q, st, budgets, 0.3, method, grouped_rows(torch.arange(N), N, G))
    assert any(set(res.anchors[h, res.valid[h]].tolist()) != set(other.anchors[h, other.valid[h]].tolist())
               for h in range(2))


def test_chunked_omp_anchors_fit_each_chunks_own_mass_against_the_documents_row_maximum():
    """Above ``chunk_min_length`` the OMP anchor search runs per chunk: chunk c keeps the chunked top-t's
    count t_c of anchors, all inside it, and they are OMP's choice on the chunk's own mass matrix with
    every row's logits taken against its maximum over the whole document (E built here in numpy,
    float64); one chunk is the whole-document search."""
    from arckv_press.compaction.chunks import chunk_bounds
    from arckv_press.compaction.layer import omp_anchors
    from arckv_press.compaction.omp import omp_on_mass

    H, n, T, D, scaling = 2, 30, 48, 8, 0.3
    Q, K, _ = _random_qk(21, H=H, n=n, T=T, D=D)
    budgets = torch.tensor([9, 14])
    chunks = chunk_bounds(T, 16, 0)
    idx, valid = omp_anchors(Q, K, budgets, scaling, "omp", None, chunks)
    logits = scaling * np.einsum("hnd,htd->hnt", Q.numpy(), K.numpy())
    z = logits.max(axis=2, keepdims=True)
    for h in range(H):
        got = idx[h, valid[h]].tolist()
        assert len(set(got)) == len(got)
        for lo, hi in chunks:
            t_c = round(int(budgets[h]) * (hi - lo) / T)
            E = torch.from_numpy(np.exp(logits[h:h + 1, :, lo:hi] - z[h:h + 1]))
            ref, ref_valid, _ = omp_on_mass(E, E.sum(2), t_c, AM_OMP)
            assert sorted(j for j in got if lo <= j < hi) == sorted((ref[0, ref_valid[0]] + lo).tolist())
    again = omp_anchors(Q, K, budgets, scaling, "omp", None, chunks, torch.from_numpy(z[..., 0]))
    assert torch.equal(again[0], idx) and torch.equal(again[1], valid)          # the given maximum is the same
    one = omp_anchors(Q, K, budgets, scaling, "omp", None, [(0, T)])
    whole, whole_valid, _ = omp_select(Q, K, budgets, scaling, AM_OMP)
    assert torch.equal(one[0], whole) and torch.equal(one[1], whole_valid)


def test_chunked_omp_anchors_survive_a_chunk_without_mass():
    """A chunk that holds no row's mass (its logits 200 below the document's maximum, so exp underflows
    to 0 in float32) still gets its t_c distinct anchors, and the other chunks are searched as usual."""
    from arckv_press.compaction.layer import omp_anchors

    Q, K, _ = _random_qk(22, H=1, n=20, T=32, D=4, dtype=torch.float32)
    Q = Q.abs()
    K[:, :16] = K[:, :16].abs() + 1.0
    K[:, 16:] = -K[:, 16:].abs() - 200.0 / (0.3 * float(Q.sum(-1).min()))  # every row's logit < max - 200
    idx, valid = omp_anchors(Q, K, torch.tensor([8]), 0.3, "omp-fast", None, [(0, 16), (16, 32)])
    got = idx[0, valid[0]].tolist()
    assert len(got) == 8 and len(set(got)) == 8
    assert sum(j >= 16 for j in got) == 4 and sum(j < 16 for j in got) == 4


def test_layer_step_searches_omp_anchors_chunk_by_chunk_above_chunk_min_length():
    """The compaction's layer step, above ``chunk_min_length``, takes each chunk's OMP anchors on its
    budget rows against the rows' maxima recorded by the reference pass (brute force here)."""
    from arckv_press.compaction.layer import LayerMethod, compact_layer_from_stats
    from arckv_press.compaction.reference import grouped_rows
    from arckv_press.compaction.stats import ReferenceStats, split_attention

    G, N, T = 2, 30, 36
    Q, K, V = _random_qk(6, H=2, n=G * N, T=T, D=8, dtype=torch.float32)
    st = ReferenceStats(2, G, N, T, 8, "ha", "rms", block=16)
    split_attention(Q.view(2, G, N, 8), K, V, (0, T), 0.3, 0, 16, on_block=lambda a, blk: st.update(a, blk, V),
                    keep_logits=st.needs_logits)
    st = st.result()
    rows = grouped_rows(torch.tensor([1, 4, 7, 9, 15, 20, 22, 28]), N, G)
    budgets = torch.tensor([6, 9])
    method = LayerMethod("arckv-ha", anchor_search="omp", chunk_len=12, chunk_min_length=0,
                         fit=FitConfig(witnesses=False))
    res = compact_layer_from_stats(K, V, Q, st, budgets, 0.3, method, rows)
    z = (0.3 * Q[:, rows].double() @ K.double().transpose(1, 2)).amax(2)
    for h in range(2):
        got = res.anchors[h, res.valid[h]].tolist()
        for lo in (0, 12, 24):
            t_c = round(int(budgets[h]) * 12 / T)
            ref, ref_valid, _ = omp_select(Q[h:h + 1, rows], K[h:h + 1, lo:lo + 12], t_c, 0.3, AM_OMP,
                                           row_max=z[h:h + 1].float())
            assert sorted(j for j in got if lo <= j < lo + 12) == sorted((ref[0, ref_valid[0]] + lo).tolist())
