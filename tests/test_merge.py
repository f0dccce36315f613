"""Tests for arckv_press.compaction.merge against a naive per-key float64 loop."""

import numpy as np
import pytest
import torch

from arckv_press.compaction.merge import assign_to_anchors, merge_keys


def _rand(*shape, seed=0, dtype=torch.float64, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _naive_merge(Q, K, anchors, valid, scaling, lam):
    """Paper Eqs. (response_profile)-(key_merge) literally, one head and one key at a time."""
    H, T, D = K.shape
    t = anchors.shape[1]
    assign = np.zeros((H, T), dtype=np.int64)
    C = np.zeros((H, t, D))
    for h in range(H):
        L = scaling * Q[h] @ K[h].T                 # [n, T]
        E = np.exp(L - L.max())                     # z_merge = max_{i,j} l_ij of this head
        slots = [r for r in range(t) if valid[h, r]]
        own = {int(anchors[h, r]): r for r in slots}
        for j in range(T):
            if j in own:
                assign[h, j] = own[j]
                continue
            u_j = E[:, j] / np.linalg.norm(E[:, j])
            best, best_r = -np.inf, -1
            for r in slots:
                s = E[:, anchors[h, r]]
                sim = u_j @ (s / np.linalg.norm(s))
                if sim > best:                       # strict: ties keep the lowest r
                    best, best_r = sim, r
            assign[h, j] = best_r
        phi = E.mean(0)
        for r in slots:
            members = [j for j in range(T) if assign[h, j] == r]
            mu = sum(phi[j] * K[h, j] for j in members) / sum(phi[j] for j in members)
            C[h, r] = (1 - lam) * K[h, anchors[h, r]] + lam * mu
    return C, assign


def _setup(H=3, n=20, T=31, D=8, seed=0):
    Q, K = _rand(H, n, D, seed=seed), _rand(H, T, D, seed=seed + 1)
    anchors = torch.tensor([[2, 5, 11, 20, 30, 0], [0, 3, 4, 9, 17, 25], [7, 8, 28, 0, 0, 0]])[:H]
    valid = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)[:H]
    return Q, K, anchors, valid


@pytest.mark.parametrize("lam", [0.0, 0.25, 1.0])
def test_merge_matches_naive_loop(lam):
    Q, K, anchors, valid = _setup()
    C, assign = merge_keys(Q, K, anchors, valid, 0.4, lambda_m=lam, block=7)
    C_ref, a_ref = _naive_merge(Q.numpy(), K.numpy(), anchors.numpy(), valid.numpy(), 0.4, lam)
    assert C.shape == (3, 6, 8) and C.dtype == torch.float64
    assert assign.dtype == torch.long
    np.testing.assert_array_equal(assign.numpy(), a_ref)
    np.testing.assert_allclose(C.numpy(), C_ref, rtol=1e-10, atol=1e-12)
    assert (C[~valid] == 0).all()
    np.testing.assert_array_equal(assign_to_anchors(Q, K, anchors, valid, 0.4, block=5).numpy(), a_ref)
    if lam == 0.0:
        K_S = torch.gather(K, 1, anchors[..., None].expand(-1, -1, 8))
        assert torch.equal(C[valid], K_S[valid])


def test_groups_contain_their_anchor_and_padding_is_ignored():
    Q, K, anchors, valid = _setup()
    assign = assign_to_anchors(Q, K, anchors, valid, 0.4)
    for h in range(3):
        for r in range(6):
            if valid[h, r]:
                assert assign[h, anchors[h, r]] == r
        assert (assign[h] < valid[h].sum()).all()  # valid slots are the leading ones here
    # head 0 pads with index 0, but position 0 is not an anchor there: not forced to slot 5
    assert assign[0, 0] != 5


def test_block_size_does_not_change_result():
    Q, K, anchors, valid = _setup(seed=4)
    C1, a1 = merge_keys(Q, K, anchors, valid, 0.3, block=1)
    C2, a2 = merge_keys(Q, K, anchors, valid, 0.3, block=10_000)
    assert torch.equal(a1, a2)
    np.testing.assert_allclose(C1.numpy(), C2.numpy(), rtol=1e-12, atol=1e-14)


def test_convex_hull_property_for_random_queries():
    Q, K, anchors, valid = _setup(seed=7)
    Q = Q * 2.0
    for lam in (0.3, 0.7, 1.0):
        C, assign = merge_keys(Q, K, anchors, valid, 0.5, lambda_m=lam)
        q = _rand(3, 50, 8, seed=99, scale=3.0)
        logit_c = torch.einsum("hnd,htd->hnt", q, C)
        logit_k = torch.einsum("hnd,htd->hnt", q, K)
        for h in range(3):
            for r in range(6):
                if not valid[h, r]:
                    continue
                members = (assign[h] == r).nonzero()[:, 0]
                lk = logit_k[h][:, members]
                assert (logit_c[h, :, r] >= lk.min(-1).values - 1e-12).all()
                assert (logit_c[h, :, r] <= lk.max(-1).values + 1e-12).all()


def test_exact_duplicate_keys_tie_to_lowest_slot():
    Q = _rand(1, 12, 4, seed=3)
    K = _rand(1, 9, 4, seed=4)
    K[0, 6] = K[0, 2]           # anchor slot 0 and anchor slot 1 share a key
    K[0, 7] = K[0, 2]           # non-anchor duplicate of both: tie -> slot 0
    K[0, 8] = K[0, 4]           # non-anchor duplicate of anchor 4 (slot 2 after sorting)
    anchors = torch.tensor([[2, 6, 4]])
    valid = torch.ones(1, 3, dtype=torch.bool)
    for dtype in (torch.float64, torch.float32):
        assign = assign_to_anchors(Q.to(dtype), K.to(dtype), anchors, valid, 1.0, block=4)
        assert assign[0, 2] == 0 and assign[0, 6] == 1 and assign[0, 4] == 2
        assert assign[0, 7] == 0
        assert assign[0, 8] == 2


def test_far_below_max_keys_underflow_safely():
    """Keys whose exp(l - z_merge) underflows to 0 even in float64 still get a centroid."""
    Q = _rand(1, 6, 4, seed=5)
    K = _rand(1, 8, 4, seed=6)
    K[0, 0] = Q[0].mean(0) * 400.0   # one huge key sets z_merge far above the rest
    K[0, 5:] = -Q[0].mean(0) * 300.0 + 0.05 * _rand(3, 4, seed=8)  # a group whose logits sit ~1e3 below
    anchors = torch.tensor([[0, 5]])
    valid = torch.ones(1, 2, dtype=torch.bool)
    L = (Q[0] @ K[0].T).numpy()
    assert (np.exp(L[:, 5:] - L.max()) == 0).all()   # the paper's literal formula gives 0/0 here
    C, assign = merge_keys(Q, K, anchors, valid, 1.0, lambda_m=1.0)
    assert torch.isfinite(C).all()
    # reference centroid of group 1 from log-space weights
    members = (assign[0] == 1).nonzero()[:, 0].numpy()
    logphi = np.array([np.log(np.mean(np.exp(L[:, j] - L[:, j].max()))) + L[:, j].max() for j in members])
    wts = np.exp(logphi - logphi.max())
    mu = (wts[:, None] * K[0].numpy()[members]).sum(0) / wts.sum()
    np.testing.assert_allclose(C[0, 1].numpy(), mu, rtol=1e-10)


def test_bf16_inputs_run_in_float_and_return_bf16():
    Q, K, anchors, valid = _setup(seed=11)
    Qb, Kb = Q.bfloat16(), K.bfloat16()
    C, assign = merge_keys(Qb, Kb, anchors, valid, 0.4)
    assert C.dtype == torch.bfloat16
    C_ref, a_ref = _naive_merge(Qb.double().numpy(), Kb.double().numpy(), anchors.numpy(), valid.numpy(), 0.4, 0.25)
    np.testing.assert_array_equal(assign.numpy(), a_ref)
    np.testing.assert_allclose(C.double().numpy(), C_ref, rtol=1e-2, atol=1e-2)


def test_bad_inputs():
    Q, K, anchors, valid = _setup()
    with pytest.raises(ValueError, match="lambda_m"):
        merge_keys(Q, K, anchors, valid, 0.4, lambda_m=1.5)
    with pytest.raises(ValueError, match="lambda_m"):
        merge_keys(Q, K, anchors, valid, 0.4, lambda_m=-0.1)
    dup = anchors.clone()
    dup[1, 2] = dup[1, 1]
    with pytest.raises(ValueError, match="head 1 has duplicate anchor position 3"):
        merge_keys(Q, K, dup, valid, 0.4)
    oob = anchors.clone()
    oob[2, 1] = 31
    with pytest.raises(ValueError, match="head 2 slot 1"):
        assign_to_anchors(Q, K, oob, valid, 0.4)
    none = valid.clone()
    none[2] = False
    with pytest.raises(ValueError, match="head 2 has no valid anchor"):
        assign_to_anchors(Q, K, anchors, none, 0.4)
    with pytest.raises(TypeError, match="bool"):
        assign_to_anchors(Q, K, anchors, valid.long(), 0.4)
    with pytest.raises(TypeError, match="integer"):
        assign_to_anchors(Q, K, anchors.double(), valid, 0.4)
    bad = K.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="K contains NaN"):
        merge_keys(Q, bad, anchors, valid, 0.4)
    with pytest.raises(ValueError, match="block"):
        merge_keys(Q, K, anchors, valid, 0.4, block=0)
    with pytest.raises(ValueError, match="heads"):
        merge_keys(Q[:2], K[:2], anchors, valid, 0.4)


def test_heads_keeping_every_position_merge_nothing():
    """Only non-anchor positions are compared with the anchors; a head whose anchors are every
    position (and a layer where every head is so) keeps its keys, each its own group."""
    Q, K = _rand(2, 12, 4, seed=20), _rand(2, 6, 4, seed=21)
    anchors = torch.tensor([[5, 4, 3, 2, 1, 0], [1, 4, 0, 0, 0, 0]])
    valid = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    C, assign = merge_keys(Q, K, anchors, valid, 0.5, lambda_m=0.5, block=2)
    C_ref, a_ref = _naive_merge(Q.numpy(), K.numpy(), anchors.numpy(), valid.numpy(), 0.5, 0.5)
    np.testing.assert_array_equal(assign.numpy(), a_ref)
    np.testing.assert_allclose(C.numpy(), C_ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(assign[0].numpy(), [5, 4, 3, 2, 1, 0])
    C1, a1 = merge_keys(Q[:1], K[:1], anchors[:1], valid[:1], 0.5, lambda_m=0.5)
    assert torch.equal(C1[0], K[0, anchors[0]]) and torch.equal(a1, assign[:1])
