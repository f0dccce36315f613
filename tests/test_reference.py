"""Tests for arckv_press.compaction.reference (row bookkeeping for the reference-query pool)."""

import pytest
import torch

from arckv_press.compaction.reference import (
    group_activations,
    group_queries_by_kv_head,
    grouped_row_index,
    mix_sources,
    split_episode,
    subsample_rows,
)


def _is_sorted_unique(x, n):
    return x.dtype == torch.long and (x[1:] > x[:-1]).all() and (x >= 0).all() and (x < n).all()


def test_subsample_rows_deterministic_sorted_subset():
    a = subsample_rows(100, 17, seed=3)
    assert a.shape == (17,) and _is_sorted_unique(a, 100)
    assert torch.equal(a, subsample_rows(100, 17, seed=3))
    assert not torch.equal(a, subsample_rows(100, 17, seed=4))
    assert torch.equal(subsample_rows(10, 10, seed=1), torch.arange(10))
    assert torch.equal(subsample_rows(5, 50, seed=1), torch.arange(5))
    assert subsample_rows(0, 5).numel() == 0
    # every row is reachable (not a fixed stride / prefix)
    seen = torch.zeros(30, dtype=torch.bool)
    for s in range(40):
        seen[subsample_rows(30, 3, seed=s)] = True
    assert seen.all()


def test_subsample_rows_bad_inputs():
    with pytest.raises(ValueError, match="budget"):
        subsample_rows(10, 0)
    with pytest.raises(ValueError, match="n must be"):
        subsample_rows(-1, 3)
    with pytest.raises(TypeError, match="budget"):
        subsample_rows(10, 2.5)
    with pytest.raises(ValueError, match="seed"):
        subsample_rows(10, 2, seed=-1)


@pytest.mark.parametrize(
    "R,C,frac,budget,n_rep,n_ctx",
    [
        (100, 100, 0.25, 40, 30, 10),   # plain split
        (100, 100, 0.5, 5, 2, 3),       # round half up: 2.5 -> 3 context rows
        (100, 4, 0.5, 20, 16, 4),       # context short: spill to repeat
        (3, 100, 0.5, 20, 3, 17),       # repeat short: spill to context
        (3, 4, 0.5, 20, 3, 4),          # both short: take everything
        (100, 100, 0.0, 12, 12, 0),
        (100, 100, 1.0, 12, 0, 12),
        (0, 100, 0.0, 12, 0, 12),       # empty repeat source
    ],
)
def test_mix_sources_counts(R, C, frac, budget, n_rep, n_ctx):
    rep, ctx = mix_sources(R, C, frac, budget, seed=7)
    assert rep.numel() == n_rep and ctx.numel() == n_ctx
    assert _is_sorted_unique(rep, max(R, 1)) and _is_sorted_unique(ctx, max(C, 1))
    rep2, ctx2 = mix_sources(R, C, frac, budget, seed=7)
    assert torch.equal(rep, rep2) and torch.equal(ctx, ctx2)


def test_mix_sources_bad_fraction():
    for frac in (-0.1, 1.2, float("nan")):
        with pytest.raises(ValueError, match="context_fraction"):
            mix_sources(10, 10, frac, 5)
    with pytest.raises(ValueError, match="budget"):
        mix_sources(10, 10, 0.5, 0)


def test_split_episode_disjoint_and_deterministic():
    s, f, h = split_episode(100, (0.5, 0.3, 0.2), seed=1, epoch=0)
    assert (s.numel(), f.numel(), h.numel()) == (50, 30, 20)
    allrows = torch.cat([s, f, h])
    assert torch.equal(torch.sort(allrows).values, torch.arange(100))
    for part in (s, f, h):
        assert _is_sorted_unique(part, 100)
    again = split_episode(100, (0.5, 0.3, 0.2), seed=1, epoch=0)
    assert all(torch.equal(a, b) for a, b in zip((s, f, h), again))
    other = split_episode(100, (0.5, 0.3, 0.2), seed=1, epoch=1)
    assert not torch.equal(s, other[0])
    other_seed = split_episode(100, (0.5, 0.3, 0.2), seed=2, epoch=0)
    assert not torch.equal(s, other_seed[0])


def test_split_episode_sizes_and_validation():
    s, f, h = split_episode(10, (0.34, 0.33, 0.33), seed=0)
    assert (s.numel(), f.numel(), h.numel()) == (3, 3, 3)
    s, f, h = split_episode(10, (0.7, 0.01, 0.1), seed=0)  # tiny positive fraction -> 1 row
    assert (s.numel(), f.numel(), h.numel()) == (7, 1, 1)
    assert len(set(s.tolist()) | set(f.tolist()) | set(h.tolist())) == 9
    with pytest.raises(ValueError, match="sum to <= 1"):
        split_episode(10, (0.6, 0.3, 0.2))
    with pytest.raises(ValueError, match=">= 0"):
        split_episode(10, (0.6, -0.1, 0.2))
    with pytest.raises(ValueError, match="3 entries"):
        split_episode(10, (0.5, 0.5))
    with pytest.raises(ValueError, match="too few"):
        split_episode(2, (0.1, 0.1, 0.1))


def test_group_queries_row_order_matches_gqa_mapping():
    H_q, H_kv, n, D = 6, 2, 5, 3
    q = torch.randn(1, H_q, n, D)
    out = group_queries_by_kv_head(q, H_kv)
    G = H_q // H_kv
    assert out.shape == (H_kv, G * n, D)
    for h in range(H_kv):
        for g in range(G):
            for i in range(n):
                assert torch.equal(out[h, g * n + i], q[0, h * G + g, i])
    # consistency with HF repeat_kv: query head a attends KV head a // G
    K = torch.randn(1, H_kv, 7, D)
    K_rep = K[:, :, None].expand(1, H_kv, G, 7, D).reshape(1, H_q, 7, D)
    logits_hf = q @ K_rep.transpose(-1, -2)                   # [1, H_q, n, 7]
    logits_grouped = out @ K[0].transpose(-1, -2)             # [H_kv, G n, 7]
    assert torch.allclose(logits_grouped.reshape(H_kv, G, n, 7).reshape(H_q, n, 7), logits_hf[0])


def test_group_activations_align_with_grouped_rows():
    n, d_x, G = 4, 3, 3
    x = torch.randn(n, d_x)
    xa = group_activations(x, G)
    assert xa.shape == (G * n, d_x)
    idx = grouped_row_index(n, G)
    for r in range(G * n):
        assert torch.equal(xa[r], x[idx[r]])
        assert idx[r] == r % n
    assert torch.equal(group_activations(x[None], G), xa)
    with pytest.raises(ValueError, match="shape"):
        group_activations(torch.randn(2, n, d_x), G)
    with pytest.raises(ValueError, match="not divisible"):
        group_queries_by_kv_head(torch.randn(1, 6, 2, 3), 4)
    with pytest.raises(ValueError, match=r"\[1, H_q, n, D\]"):
        group_queries_by_kv_head(torch.randn(2, 6, 2, 3), 2)
