"""Tests for arckv_press.compaction.select against float64 numpy brute force."""

from fractions import Fraction
import math

import numpy as np
import pytest
import torch

from arckv_press.compaction.select import (
    RowPool,
    chunked_topk_anchors,
    ha_scores,
    per_head_budgets,
    pool_logits,
    pool_rows,
    pooled_softmax_scores,
    topk_anchors,
    vi_scores,
)


def _rand(*shape, seed=0, dtype=torch.float64, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _np_softmax(L):
    L = L - L.max(-1, keepdims=True)
    E = np.exp(L)
    return E / E.sum(-1, keepdims=True)


def _np_pool(X, pooling):
    # X: [n, T] per head
    if pooling == "rms":
        return np.sqrt((X**2).mean(0))
    if pooling == "mean":
        return X.mean(0)
    return X.max(0)


def _np_ha(Q, K, scaling, pooling):
    out = []
    for h in range(Q.shape[0]):
        P = _np_softmax(scaling * Q[h] @ K[h].T)
        out.append(_np_pool(P, pooling))
    return np.stack(out)


def _np_vi(Q, K, V, scaling, pooling, eps):
    """Literal leave-one-out: O^(-j) recomputed from the other positions' exponentials."""
    out = []
    for h in range(Q.shape[0]):
        L = scaling * Q[h] @ K[h].T
        n, T = L.shape
        R = np.zeros((n, T))
        for i in range(n):
            e = np.exp(L[i] - L[i].max())
            O = e @ V[h] / e.sum()
            for j in range(T):
                mask = np.arange(T) != j
                O_minus = e[mask] @ V[h][mask] / e[mask].sum()
                R[i, j] = np.linalg.norm(O - O_minus) / math.sqrt(O @ O + eps)
        out.append(_np_pool(R, pooling))
    return np.stack(out)


# ----------------------------------------------------------------------------- pooling


@pytest.mark.parametrize("pooling", ["rms", "mean", "max"])
def test_ha_scores_match_numpy(pooling):
    Q, K = _rand(3, 17, 8, seed=1), _rand(3, 23, 8, seed=2)
    s = ha_scores(Q, K, 0.4, pooling=pooling, block_rows=5)
    assert s.shape == (3, 23) and s.dtype == torch.float32
    ref = _np_ha(Q.numpy(), K.numpy(), 0.4, pooling)
    np.testing.assert_allclose(s.numpy(), ref, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("pooling", ["rms", "mean", "max"])
def test_ha_scores_float32_and_bf16_inputs(pooling):
    Q, K = _rand(2, 11, 8, seed=3), _rand(2, 19, 8, seed=4)
    ref = _np_ha(Q.numpy(), K.numpy(), 0.35, pooling)
    s32 = ha_scores(Q.float(), K.float(), 0.35, pooling=pooling)
    np.testing.assert_allclose(s32.numpy(), ref, rtol=1e-5, atol=1e-7)
    Qb, Kb = Q.bfloat16(), K.bfloat16()
    refb = _np_ha(Qb.double().numpy(), Kb.double().numpy(), 0.35, pooling)
    sb = ha_scores(Qb, Kb, 0.35, pooling=pooling)
    assert sb.dtype == torch.float32
    np.testing.assert_allclose(sb.numpy(), refb, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("pooling", ["rms", "mean", "max"])
def test_blockwise_pooling_equals_unblocked(pooling):
    logits = _rand(2, 37, 29, seed=5, scale=3.0)
    whole = pool_logits([logits], pooling)
    for block in (1, 4, 10, 36):
        blocks = [logits[:, a : a + block] for a in range(0, 37, block)]
        np.testing.assert_allclose(pool_logits(blocks, pooling).numpy(), whole.numpy(), rtol=1e-6, atol=1e-9)
        via_fn = pooled_softmax_scores(lambda a, b: logits[:, a:b], 37, block, pooling)
        np.testing.assert_allclose(via_fn.numpy(), whole.numpy(), rtol=1e-6, atol=1e-9)
    ref = np.stack([_np_pool(_np_softmax(logits[h].numpy()), pooling) for h in range(2)])
    np.testing.assert_allclose(whole.numpy(), ref, rtol=1e-6, atol=1e-9)


def test_rowpool_rejects_bad_use():
    with pytest.raises(ValueError, match="pooling"):
        RowPool("median")
    with pytest.raises(ValueError, match="before any"):
        RowPool().result()
    pool = RowPool()
    pool.update(torch.ones(2, 3, 5))
    with pytest.raises(ValueError, match="does not match"):
        pool.update(torch.ones(2, 3, 6))
    with pytest.raises(ValueError, match="NaN"):
        pool_logits([torch.full((1, 2, 3), float("nan"))])
    np.testing.assert_allclose(pool_rows([torch.ones(1, 4, 3) * 2.0], "rms").numpy(), 2.0)


# ----------------------------------------------------------------------------- VI


@pytest.mark.parametrize("pooling", ["rms", "mean", "max"])
def test_vi_scores_match_leave_one_out_brute_force(pooling):
    Q, K, V = _rand(2, 9, 6, seed=6), _rand(2, 13, 6, seed=7), _rand(2, 13, 5, seed=8)
    V = V + 0.7  # a common offset (exercise the centring)
    s = vi_scores(Q, K, V, 0.5, pooling=pooling, eps=1e-6, block_rows=4)
    assert s.shape == (2, 13) and s.dtype == torch.float32
    ref = _np_vi(Q.numpy(), K.numpy(), V.numpy(), 0.5, pooling, 1e-6)
    np.testing.assert_allclose(s.numpy(), ref, rtol=2e-6, atol=1e-9)


def test_vi_scores_peaked_attention_float32():
    """Rows where p_ij is within 1e-9 of 1: the p/(1-p) form would cancel in float32."""
    Q, K, V = _rand(2, 8, 6, seed=9, scale=4.0), _rand(2, 10, 6, seed=10, scale=4.0), _rand(2, 10, 6, seed=11)
    scaling = 1.0
    L = np.einsum("hnd,htd->hnt", Q.numpy(), K.numpy())
    srt = np.sort(L, -1)
    assert (srt[..., -1] - srt[..., -2]).max() > 20  # some rows put all but ~e^-20 on one key
    ref = _np_vi(Q.numpy(), K.numpy(), V.numpy(), scaling, "rms", 1e-6)
    s = vi_scores(Q.float(), K.float(), V.float(), scaling)
    np.testing.assert_allclose(s.numpy(), ref, rtol=1e-4, atol=1e-7)


def test_vi_single_key_and_bad_inputs():
    Q, K, V = _rand(1, 3, 4, seed=12), _rand(1, 1, 4, seed=13), _rand(1, 1, 4, seed=14)
    s = vi_scores(Q, K, V, 1.0)
    # removing the only key leaves a zero output: D = ||v||, normalised by ||O|| = ||v||
    np.testing.assert_allclose(s.numpy(), [[1.0]], rtol=1e-6)
    Q, K, V = _rand(2, 3, 4), _rand(2, 5, 4), _rand(2, 5, 4)
    with pytest.raises(ValueError, match="eps"):
        vi_scores(Q, K, V, 1.0, eps=0.0)
    with pytest.raises(ValueError, match="V"):
        vi_scores(Q, K, V[:, :4], 1.0)
    with pytest.raises(ValueError, match="pooling"):
        vi_scores(Q, K, V, 1.0, pooling="sum")
    bad = K.clone()
    bad[1, 2, 0] = float("inf")
    with pytest.raises(ValueError, match="K contains NaN or inf"):
        ha_scores(Q, bad, 1.0)
    with pytest.raises(ValueError, match="share H and D"):
        ha_scores(Q[:, :, :3], K, 1.0)
    with pytest.raises(ValueError, match="scaling"):
        ha_scores(Q, K, -1.0)


# ----------------------------------------------------------------------------- budgets


def _exact_budget(a_norm: Fraction, P: int, ratio: Fraction, T: int) -> int:
    return min(max(math.floor(a_norm * P * ratio * T), 1), T)


@pytest.mark.parametrize(
    "T,ratio,L,H",
    [(1000, 0.1, 3, 4), (100, 0.29, 7, 3), (100, 0.57, 30, 8), (8191, 0.05, 32, 8), (10, 1.0, 2, 2), (7, 0.01, 2, 3)],
)
def test_uniform_budgets_are_exact_floor(T, ratio, L, H):
    t = per_head_budgets(T, ratio, num_layers=L, num_heads=H)
    assert t.shape == (L, H) and t.dtype == torch.long
    expected = _exact_budget(Fraction(1, L * H), L * H, Fraction(str(ratio)), T)
    assert (t == expected).all(), (t[0, 0].item(), expected)


def test_weighted_budgets_round_and_clip():
    w = torch.tensor([[1.0, 3.0], [0.0, 4.0]])
    t = per_head_budgets(10, 0.5, w)
    # a = [1,3,0,4]/8, |P| = 4, ratio * T = 5 -> floor(a * 20) = [2, 7, 0 -> 1, 10]
    assert t.tolist() == [[2, 7], [1, 10]]
    t = per_head_budgets(10, 0.5, torch.tensor([[1.0, 100.0]]))  # 0.099 -> 1 and 9.9 -> 9
    assert t.tolist() == [[1, 9]]
    t = per_head_budgets(10, 0.9, torch.tensor([[1.0, 9.0]]))  # 1.8 -> 1 and 16.2 -> clip 10
    assert t.tolist() == [[1, 10]]


def test_budget_validation():
    with pytest.raises(ValueError, match="ratio"):
        per_head_budgets(10, 0.0, num_layers=1, num_heads=1)
    with pytest.raises(ValueError, match="ratio"):
        per_head_budgets(10, 1.5, num_layers=1, num_heads=1)
    with pytest.raises(ValueError, match="ratio"):
        per_head_budgets(10, float("nan"), num_layers=1, num_heads=1)
    with pytest.raises(ValueError, match="num_layers"):
        per_head_budgets(10, 0.5)
    with pytest.raises(ValueError, match="nonnegative; layer 1 head 0"):
        per_head_budgets(10, 0.5, torch.tensor([[1.0, 1.0], [-1.0, 1.0]]))
    with pytest.raises(ValueError, match="NaN"):
        per_head_budgets(10, 0.5, torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="positive sum"):
        per_head_budgets(10, 0.5, torch.zeros(2, 2))
    with pytest.raises(ValueError, match="does not match"):
        per_head_budgets(10, 0.5, torch.ones(2, 2), num_layers=3)
    with pytest.raises(ValueError, match="dims"):
        per_head_budgets(10, 0.5, torch.ones(4))
    with pytest.raises(ValueError, match="T must be"):
        per_head_budgets(0, 0.5, num_layers=1, num_heads=1)


# ----------------------------------------------------------------------------- top-t


def _py_topk(s, b):
    order = sorted(range(len(s)), key=lambda j: (-s[j], j))
    return sorted(order[:b])


def test_topk_matches_brute_force_with_ties():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 4, (5, 17), generator=g).float()  # many exact ties
    budgets = torch.tensor([1, 5, 17, 3, 8])
    idx, valid = topk_anchors(scores, budgets)
    assert idx.shape == (5, 17) and idx.dtype == torch.long and valid.dtype == torch.bool
    for h in range(5):
        b = int(budgets[h])
        assert idx[h, :b].tolist() == _py_topk(scores[h].tolist(), b)
        assert valid[h].tolist() == [True] * b + [False] * (17 - b)
        assert (idx[h, b:] == 0).all()


def test_topk_tie_lowest_position_hand_example():
    scores = torch.tensor([[1.0, 3.0, 2.0, 3.0, 3.0, 0.0]])
    idx, valid = topk_anchors(scores, [2])
    assert idx.tolist() == [[1, 3]] and valid.all()
    idx, _ = topk_anchors(scores, torch.tensor([4]))
    assert idx.tolist() == [[1, 2, 3, 4]]


def test_topk_bad_inputs():
    s = torch.rand(2, 5)
    with pytest.raises(ValueError, match="head 1 has 6"):
        topk_anchors(s, [1, 6])
    with pytest.raises(ValueError, match="head 0 has 0"):
        topk_anchors(s, [0, 2])
    with pytest.raises(ValueError, match="shape"):
        topk_anchors(s, [1, 2, 3])
    with pytest.raises(TypeError, match="integer"):
        topk_anchors(s, torch.tensor([1.0, 2.0]))
    s[0, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        topk_anchors(s, [1, 1])


def test_chunked_topk_hand_example():
    # T = 10, chunks [0,4) [4,8) [8,10); t = 5 -> round(2.0)=2, 2, round(1.0)=1
    s = torch.tensor([[9.0, 1, 8, 7, 0, 6, 5, 4, 3, 2], [0.0, 1, 2, 3, 4, 5, 6, 7, 8, 9]])
    idx, valid = chunked_topk_anchors(s, [5, 1], chunk_len=4, min_length=5)
    # head 0: {0, 2} + {5, 6} + {8}; head 1: t=1 -> round(0.4)=0 -> clip 1 per chunk: {3} {7} {9}
    assert valid.tolist() == [[True] * 5, [True] * 3 + [False] * 2]
    assert idx.tolist() == [[0, 2, 5, 6, 8], [3, 7, 9, 0, 0]]


def test_chunked_topk_round_half_even_and_clip_to_chunk():
    # T = 8, chunks of 3, 3, 2; t = 6: 2.25 -> 2, 2.25 -> 2, 1.5 -> 2 (half to even)
    s = torch.arange(8.0)[None].flip(-1)
    idx, valid = chunked_topk_anchors(s, [6], chunk_len=3, min_length=0)
    assert idx.tolist() == [[0, 1, 3, 4, 6, 7]] and valid.all()
    # t = 8 = T: 3, 3, 2 (clip at T_c)
    idx, valid = chunked_topk_anchors(s, [8], chunk_len=3, min_length=0)
    assert idx.tolist() == [list(range(8))]
    # t = 2: 0.75 -> 1, 0.75 -> 1, 0.5 -> 0 -> clip 1: realised 3 != 2
    idx, valid = chunked_topk_anchors(s, [2], chunk_len=3, min_length=0)
    assert idx.tolist() == [[0, 3, 6]]


def test_chunked_topk_falls_back_below_min_length_and_matches_rule():
    g = torch.Generator().manual_seed(3)
    s = torch.rand(3, 50, generator=g)
    b = torch.tensor([5, 12, 1])
    idx, valid = chunked_topk_anchors(s, b, chunk_len=8, min_length=50)
    ref_idx, ref_valid = topk_anchors(s, b)
    assert torch.equal(idx, ref_idx) and torch.equal(valid, ref_valid)
    idx, valid = chunked_topk_anchors(s, b, chunk_len=8, min_length=10)
    for h in range(3):
        expect = []
        for a in range(0, 50, 8):
            Tc = min(a + 8, 50) - a
            tc = min(max(round(int(b[h]) * Tc / 50), 1), Tc)
            expect += [a + j for j in _py_topk(s[h, a : a + Tc].tolist(), tc)]
        got = idx[h][valid[h]].tolist()
        assert got == expect
        assert (idx[h][~valid[h]] == 0).all()
    with pytest.raises(ValueError, match="chunk_len"):
        chunked_topk_anchors(s, b, chunk_len=0)


# ------------------------------------------------------------------ global budgets
def _global_budgets_brute(scores, ratio, min_per_head=1):
    L, H, T = scores.shape
    total = L * H * max(min_per_head, math.floor(ratio * T + 1e-6))
    counts = [[0] * H for _ in range(L)]
    rest = []
    for l in range(L):
        for h in range(H):
            order = sorted(range(T), key=lambda j: (-float(scores[l, h, j]), j))
            counts[l][h] = min_per_head
            rest += [(-float(scores[l, h, j]), (l * H + h) * T + j, l, h) for j in order[min_per_head:]]
    for _, _, l, h in sorted(rest)[: total - L * H * min_per_head]:
        counts[l][h] += 1
    return torch.tensor(counts)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_global_budgets_match_brute_force(seed):
    from arckv_press.compaction.select import global_budgets

    g = torch.Generator().manual_seed(seed)
    L, H, T = 3, 2, 23
    scores = torch.rand(L, H, T, generator=g) ** 4  # peaked heads and flat heads
    scores[1, 0] = scores[1, 0] * 10  # one head dominates: it should get much more than its share
    scores[2, 1, :5] = 0.5  # ties, broken by the lowest (layer, head, position)
    for ratio, m in ((0.2, 1), (0.1, 1), (0.5, 2), (1.0, 1), (0.01, 1)):
        got = global_budgets(scores, ratio, m)
        assert torch.equal(got, _global_budgets_brute(scores, ratio, m)), (ratio, m)
        assert int(got.sum()) == L * H * max(m, math.floor(ratio * T)) and bool((got >= m).all()) and bool((got <= T).all())
    assert global_budgets(scores, 0.2)[1, 0] > math.floor(0.2 * T)
    # min_fraction is min_per_head = floor(f * ratio * T) (the brute force with that floor)
    for ratio, f in ((0.5, 0.5), (0.5, 1.0), (0.2, 0.5)):
        floor = max(1, math.floor(f * ratio * T))
        assert torch.equal(global_budgets(scores, ratio, min_fraction=f), _global_budgets_brute(scores, ratio, floor))
    assert torch.equal(global_budgets(scores, 0.5, min_fraction=1.0), torch.full((L, H), math.floor(0.5 * T)))


def test_global_budgets_errors():
    from arckv_press.compaction.select import global_budgets

    with pytest.raises(ValueError, match="ratio"):
        global_budgets(torch.rand(2, 2, 5), 0.0)
    with pytest.raises(ValueError, match="NaN or inf"):
        global_budgets(torch.full((1, 1, 5), float("nan")), 0.5)
    with pytest.raises(ValueError, match="min_per_head"):
        global_budgets(torch.rand(1, 1, 5), 0.5, min_per_head=6)
    with pytest.raises(ValueError, match="min_fraction must be in"):
        global_budgets(torch.rand(1, 1, 5), 0.5, min_fraction=-0.1)
    with pytest.raises(ValueError, match="3"):
        global_budgets(torch.rand(2, 5), 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_all_finite_matches_isfinite(dtype):
    from arckv_press.compaction.checks import all_finite

    x = torch.randn(3, 40, 8).to(dtype)
    assert all_finite(x) and all_finite(x[:, :0])
    for bad in (float("nan"), float("inf"), -float("inf")):
        for where in ((0, 0, 0), (2, 39, 7), (1, 17, 3)):
            y = x.clone()
            y[where] = bad
            assert not all_finite(y) and not bool(torch.isfinite(y).all())
    # finite entries whose sum overflows to inf: the sum's fast path must not refuse them
    big = torch.full((4, 8), torch.finfo(dtype).max / 2, dtype=dtype)
    assert not bool(torch.isfinite(big.sum())) and all_finite(big) and all_finite(-big)
    big[1, 2] = float("nan")
    assert not all_finite(big)


def test_check_ratio_is_the_one_kept_fraction_validator():
    from arckv_press.compaction.checks import check_ratio

    assert check_ratio(1) == 1.0 and check_ratio(0.05) == 0.05
    for bad in (0, 0.0, -0.1, 1.0000001, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="kept fraction and must be in"):
            check_ratio(bad)
    for bad in (True, "0.1", None):
        with pytest.raises(TypeError, match="ratio must be a float"):
            check_ratio(bad)


@pytest.mark.parametrize("pooling", ["rms", "mean"])
def test_corrected_scores_is_the_sampled_ratio_to_the_base(pooling):
    """The estimate is the base's all-row score times the indexer's shrunk ratio to it on the sample,
    checked entry by entry against the formula in Python floats; it is the learned score itself when
    the sample is every row, the base's score where the indexer agrees with it on the sample or the
    sample saw nothing of a key; and over every sample of k of the n rows (all C(n, k), by brute
    force) it is much closer to the all-row learned score than the base alone is, for an indexer that
    corrects its base key by key (as the value-aware residual does) with some noise per row."""
    from itertools import combinations

    from arckv_press.compaction.select import corrected_scores

    g = torch.Generator().manual_seed(3)
    H, n, T, k = 2, 7, 5, 3
    base = torch.softmax(torch.randn(H, n, T, generator=g, dtype=torch.float64), -1)
    key_bias = torch.randn(H, 1, T, generator=g, dtype=torch.float64)  # a per-key (value-aware) correction
    learned = torch.softmax(base.log() + key_bias + 0.2 * torch.randn(H, n, T, generator=g, dtype=torch.float64), -1)
    power = 2 if pooling == "rms" else 1

    def pooled(x):  # [H, rows, T] -> [H, T]
        return x.pow(power).mean(1).pow(1 / power)

    full, full_base = pooled(learned), pooled(base)
    rows = [0, 2, 5]
    sample, sample_base = pooled(learned[:, rows]), pooled(base[:, rows])
    shrink, fraction = 0.3, k / n
    out = corrected_scores(full_base, sample, sample_base, pooling, shrink, fraction)
    for h in range(H):
        e = shrink * (1 - fraction) * sum(float(sample_base[h, j]) ** power for j in range(T)) / T
        for j in range(T):
            ratio = (float(sample[h, j]) ** power + e) / (float(sample_base[h, j]) ** power + e)
            assert math.isclose(float(out[h, j]), (float(full_base[h, j]) ** power * ratio) ** (1 / power), rel_tol=1e-6)
    torch.testing.assert_close(corrected_scores(full_base, full, full_base, pooling, 0.3, 1.0), full.float())
    torch.testing.assert_close(corrected_scores(full_base, full_base * 0.5, full_base * 0.5, pooling, 0.3, 0.5),
                               full_base.float())
    unseen = sample.clone()
    unseen[:, 1] = 0
    unseen_base = sample_base.clone()
    unseen_base[:, 1] = 0
    est = corrected_scores(full_base, unseen, unseen_base, pooling, 0.3, fraction)
    torch.testing.assert_close(est[:, 1], full_base[:, 1].float())
    err, err_base = 0.0, 0.0
    for rows in combinations(range(n), k):
        est = corrected_scores(full_base, pooled(learned[:, list(rows)]), pooled(base[:, list(rows)]), pooling,
                               0.1, k / n).double()
        err += (est - full).square().sum().item()
        err_base += (full_base - full).square().sum().item()
    assert err < 0.2 * err_base


def test_corrected_scores_keeps_a_key_that_one_sampled_row_attends_to():
    """A planted-needle key: one row of 100 attends to it, that row is in a sample of 4, and there
    the indexer is half as sharp as its base. The ratio estimate keeps the key at the indexer's ratio
    (the base's score times 0.5 up to the shrinkage); the additive control variate of the same sample,
    m(b) + m_S(pi) - m_S(b), would be negative and drop it."""
    from arckv_press.compaction.select import corrected_scores

    N, n = 100, 4
    full_base = torch.tensor([[math.sqrt(0.8 ** 2 / N), 0.1]])
    sample_base = torch.tensor([[math.sqrt(0.8 ** 2 / n), 0.1]])
    sample = torch.tensor([[math.sqrt(0.4 ** 2 / n), 0.1]])
    assert (full_base.square() + sample.square() - sample_base.square())[0, 0] < 0
    out = corrected_scores(full_base, sample, sample_base, "rms", 0.0, n / N)
    torch.testing.assert_close(out, full_base * torch.tensor([[0.5, 1.0]]))
    shrunk = corrected_scores(full_base, sample, sample_base, "rms", 0.1, n / N)
    assert 0.5 * full_base[0, 0] < shrunk[0, 0] < full_base[0, 0]


def test_corrected_scores_refuses_bad_input():
    from arckv_press.compaction.select import corrected_scores

    a = torch.tensor([[0.1, 0.2]])
    with pytest.raises(ValueError, match="max pooling"):
        corrected_scores(a, a, a, "max")
    with pytest.raises(ValueError, match="sample has shape"):
        corrected_scores(a, a[:, :1], a)
    with pytest.raises(ValueError, match="pooling"):
        corrected_scores(a, a, a, "sum")
    with pytest.raises(ValueError, match="negative"):
        corrected_scores(a, -a, a)
    for bad in (-0.1, math.inf, math.nan, True):
        with pytest.raises(ValueError, match="shrink"):
            corrected_scores(a, a, a, shrink=bad)
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="fraction"):
            corrected_scores(a, a, a, fraction=bad)
