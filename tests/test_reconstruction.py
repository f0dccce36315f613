"""Tests for arckv_press.reconstruction against independent references (numpy/scipy, per-head loops)."""

import statistics

import numpy as np
import pytest
import torch
from scipy.special import logsumexp

from arckv_press.compaction.merge import merge_keys
from arckv_press.compaction.reference import group_queries_by_kv_head, split_episode
from arckv_press.reconstruction import (
    disjoint_windows,
    evenly_spaced,
    format_pm,
    gather_slots,
    group_centroids,
    grouped_rows,
    interpolate_slots,
    join_hotpot_paragraphs,
    join_squad_paragraphs,
    layer_subset,
    log_key_mass,
    markdown_table,
    mean_sd,
    output_fidelity,
    parse_layers,
)


def _rand(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


def _anchors():
    anchors = torch.tensor([[2, 5, 11, 20, 30, 0], [0, 3, 4, 9, 17, 25], [7, 8, 28, 0, 0, 0]])
    valid = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    return anchors, valid


# ---------------------------------------------------------------- bookkeeping


def test_evenly_spaced():
    assert evenly_spaced(30, 6) == [0, 6, 12, 17, 23, 29]
    assert evenly_spaced(5, 9) == [0, 1, 2, 3, 4]
    assert evenly_spaced(7, 1) == [0]
    assert evenly_spaced(10, 2) == [0, 9]


def test_parse_layers():
    assert parse_layers(None, 4) == [0, 1, 2, 3]
    assert parse_layers("all", 3) == [0, 1, 2]
    assert parse_layers("5,0-2,2", 8) == [0, 1, 2, 5]
    assert parse_layers("even:6", 30) == [0, 6, 12, 17, 23, 29]
    with pytest.raises(ValueError, match="outside"):
        parse_layers("0,30", 30)
    with pytest.raises(ValueError, match="cannot parse"):
        parse_layers("a", 30)
    with pytest.raises(ValueError, match="cannot parse"):
        parse_layers("5-2", 30)


def test_layer_subset():
    studied = [0, 6, 12, 17, 23, 29]
    assert layer_subset(None, studied) == studied
    assert layer_subset("even:3", studied) == [0, 12, 29]  # round(2.5) = 2 (half to even)
    assert layer_subset("even:10", [4, 2]) == [2, 4]
    assert layer_subset("6,29", studied) == [6, 29]
    with pytest.raises(ValueError, match="not among the studied"):
        layer_subset("5", studied)


def test_disjoint_windows_are_disjoint_deterministic_and_seeded():
    starts = disjoint_windows(10_000, 700, 6, seed=3)
    assert starts == sorted(starts) and len(set(starts)) == 6
    assert all(s % 700 == 0 and s + 700 <= 10_000 for s in starts)
    assert all(b - a >= 700 for a, b in zip(starts, starts[1:]))
    assert disjoint_windows(10_000, 700, 6, seed=3) == starts
    draws = {tuple(disjoint_windows(10_000, 700, 6, seed=s)) for s in range(5)}
    assert len(draws) > 1
    assert disjoint_windows(1400, 700, 2) == [0, 700]
    with pytest.raises(ValueError, match="only 2 disjoint windows"):
        disjoint_windows(1400, 700, 3)


def test_grouped_rows_select_the_same_positions_of_every_query_head():
    Hq, H, n, D = 6, 2, 7, 3
    q = _rand(1, Hq, n, D)
    grouped = group_queries_by_kv_head(q, H)
    pos = torch.tensor([1, 4, 6])
    rows = grouped_rows(pos, n, Hq // H)
    sub = grouped[:, rows]
    G = Hq // H
    for h in range(H):
        expected = torch.cat([q[0, h * G + g, pos] for g in range(G)])
        torch.testing.assert_close(sub[h], expected, rtol=0, atol=0)
    _, fit, hold = split_episode(n, (0.0, 0.5, 0.5), seed=1)
    assert set(grouped_rows(fit, n, G).tolist()).isdisjoint(grouped_rows(hold, n, G).tolist())
    with pytest.raises(ValueError, match="positions must lie"):
        grouped_rows(torch.tensor([7]), n, G)


def test_gather_slots_zeroes_padding():
    X = _rand(3, 31, 4)
    anchors, valid = _anchors()
    out = gather_slots(X, anchors, valid)
    for h in range(3):
        for r in range(6):
            ref = X[h, anchors[h, r]] if valid[h, r] else torch.zeros(4, dtype=torch.float64)
            torch.testing.assert_close(out[h, r], ref, rtol=0, atol=0)


# ---------------------------------------------------------------- merging


def test_log_key_mass_matches_scipy_logsumexp():
    Q, K = _rand(3, 20, 8, seed=1, scale=3.0), _rand(3, 31, 8, seed=2, scale=3.0)
    out = log_key_mass(Q, K, 0.4, block=7)
    L = 0.4 * np.einsum("hnd,htd->hnt", Q.numpy(), K.numpy())
    ref = logsumexp(L, axis=1) - np.log(20)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-12, atol=1e-12)


def test_group_centroids_match_brute_force_loop():
    H, T, D, t = 2, 17, 5, 4
    X = _rand(H, T, D, seed=3)
    g = torch.Generator().manual_seed(4)
    assignment = torch.randint(0, t - 1, (H, T), generator=g)        # slot t-1 stays empty
    log_phi = _rand(H, T, seed=5, scale=300.0)                        # exp() would underflow
    out = group_centroids(X, assignment, log_phi, t)
    for h in range(H):
        for r in range(t):
            members = [j for j in range(T) if assignment[h, j] == r]
            if not members:
                assert torch.all(out[h, r] == 0)
                continue
            lp = np.array([log_phi[h, j].item() for j in members])
            w = np.exp(lp - lp.max())
            ref = (w[:, None] * X[h, members].numpy()).sum(0) / w.sum()
            np.testing.assert_allclose(out[h, r].numpy(), ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("lam", [0.0, 0.25, 0.7, 1.0])
def test_key_centroid_interpolation_reproduces_merge_keys(lam):
    """One merge at lambda=1 (=mu) plus interpolation equals merge_keys at any lambda."""
    Q, K = _rand(3, 20, 8, seed=6), _rand(3, 31, 8, seed=7)
    anchors, valid = _anchors()
    C_ref, assignment = merge_keys(Q, K, anchors, valid, 0.4, lambda_m=lam)
    mu = group_centroids(K, assignment, log_key_mass(Q, K, 0.4), anchors.shape[1])
    K_S = gather_slots(K, anchors, valid)
    torch.testing.assert_close(interpolate_slots(K_S, mu, lam, valid), C_ref, rtol=1e-12, atol=1e-12)
    mu_from_merge, _ = merge_keys(Q, K, anchors, valid, 0.4, lambda_m=1.0)
    torch.testing.assert_close(interpolate_slots(K_S, mu_from_merge, lam, valid), C_ref, rtol=1e-12, atol=1e-12)


def test_interpolate_slots_rejects_bad_lambda():
    A = _rand(1, 2, 3)
    with pytest.raises(ValueError, match="lambda_m"):
        interpolate_slots(A, A, 1.5)


# ---------------------------------------------------------------- metrics


def test_output_fidelity_matches_numpy_loop():
    O = _rand(3, 9, 6, seed=8)
    O_hat = O + 0.3 * _rand(3, 9, 6, seed=9)
    m = output_fidelity(O_hat, O)
    for h in range(3):
        a, b = O_hat[h].numpy(), O[h].numpy()
        assert m["rel_l2"][h].item() == pytest.approx(np.linalg.norm(a - b) / np.linalg.norm(b), rel=1e-12)
        rows = [np.linalg.norm(a[i] - b[i]) / np.linalg.norm(b[i]) for i in range(9)]
        assert m["rel_l2_row"][h].item() == pytest.approx(np.mean(rows), rel=1e-12)
        cos = [a[i] @ b[i] / (np.linalg.norm(a[i]) * np.linalg.norm(b[i])) for i in range(9)]
        assert m["cosine"][h].item() == pytest.approx(np.mean(cos), rel=1e-12)
    exact = output_fidelity(O, O)
    assert torch.all(exact["rel_l2"] == 0) and torch.allclose(exact["cosine"], torch.ones(3, dtype=torch.float64))


def test_mean_sd_and_formatting():
    xs = [0.1, 0.4, 0.35, 0.9]
    m, s = mean_sd(xs)
    assert m == pytest.approx(statistics.mean(xs)) and s == pytest.approx(statistics.stdev(xs))
    assert mean_sd([2.0]) == (2.0, 0.0)
    assert format_pm([1.0, 3.0], 2) == "2.00±1.41"
    with pytest.raises(ValueError):
        mean_sd([])
    table = markdown_table(["a", "b"], [[1, "x"]])
    assert table.splitlines() == ["| a | b |", "|---|---|", "| 1 | x |"]
    with pytest.raises(ValueError, match="cells"):
        markdown_table(["a"], [[1, 2]])


# ---------------------------------------------------------------- sources


def test_source_joiners():
    squad = {"data": [{"paragraphs": [{"context": " A. "}, {"context": "B."}]}, {"paragraphs": [{"context": "C."}]}]}
    assert join_squad_paragraphs(squad) == "A.\n\nB.\n\nC."
    hotpot = [
        {"context": [["T1", ["x.", " y."]], ["T2", ["z."]]]},
        {"context": [["T1", ["dup."]], ["T3", []], ["T4", ["w."]]]},
    ]
    assert join_hotpot_paragraphs(hotpot) == "T1\nx. y.\n\nT2\nz.\n\nT4\nw."
    with pytest.raises(ValueError, match="SQuAD"):
        join_squad_paragraphs({"data": [{}]})
