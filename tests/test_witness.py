"""Anchor witnesses (compaction/witness.py) against a brute-force float64 loop."""

import pytest
import torch

from arckv_press.compaction.fit import FitConfig
from arckv_press.compaction.stats import ReferenceStats, split_attention
from arckv_press.compaction.witness import anchor_witnesses


def _stats(Q, K, V, scaling, G=1, block=16):
    """The reference pass's statistics of the rows ``Q [H, G * N, D]`` over the document ``K, V``."""
    H, n, D = Q.shape
    st = ReferenceStats(H, G, n // G, K.shape[1], V.shape[-1], "ha", "rms", block=block)
    split_attention(Q.view(H, G, n // G, D), K, V, (0, K.shape[1]), scaling, 0, block,
                    on_block=lambda a, blk: st.update(a, blk, V), keep_logits=st.needs_logits)
    return st.result()


def _brute_witness(Q, K, anchors, valid, scaling):
    P = torch.softmax(Q.double() @ K.double().transpose(1, 2) * scaling, dim=-1)
    out = torch.zeros_like(anchors)
    for h in range(anchors.shape[0]):
        for r in range(anchors.shape[1]):
            if valid[h, r]:
                column = P[h, :, anchors[h, r]].tolist()
                out[h, r] = column.index(max(column))  # first row with the largest probability
    return out


@pytest.mark.parametrize("block_rows", [1, 7, 1024])
def test_witness_is_the_row_with_the_largest_probability(block_rows):
    g = torch.Generator().manual_seed(0)
    H, n, T, D = 3, 50, 40, 8
    Q, K = torch.randn(H, n, D, generator=g), torch.randn(H, T, D, generator=g)
    anchors = torch.stack([torch.randperm(T, generator=g)[:6] for _ in range(H)])
    valid = torch.ones(H, 6, dtype=torch.bool)
    valid[1, 4:] = False
    rows = anchor_witnesses(Q.double(), K.double(), anchors, valid, 0.5, block_rows=block_rows)
    assert torch.equal(rows, _brute_witness(Q, K, anchors, valid, 0.5))
    assert torch.equal(rows[1, 4:], torch.zeros(2, dtype=torch.long))  # padded slots -> row 0


@pytest.mark.parametrize("block_rows", [1, 2, 1024])
def test_witness_ties_go_to_the_lowest_row(block_rows):
    """Identical query rows give identical probabilities: the first of them is the witness,
    whichever row block it falls into."""
    g = torch.Generator().manual_seed(1)
    H, T, D = 2, 12, 4
    base = torch.randn(H, 3, D, generator=g)
    Q = torch.cat([base, base, base], dim=1)  # rows r, r+3, r+6 are equal
    K = torch.randn(H, T, D, generator=g)
    anchors = torch.arange(T).expand(H, T)
    rows = anchor_witnesses(Q, K, anchors, None, 1.0, block_rows=block_rows)
    assert bool((rows < 3).all())
    assert torch.equal(rows, _brute_witness(Q, K, anchors, torch.ones(H, T, dtype=torch.bool), 1.0))


def test_witness_errors():
    Q, K = torch.randn(2, 6, 4), torch.randn(2, 5, 4)
    with pytest.raises(ValueError, match=r"anchor index 5 at head 0 slot 1 is outside \[0, T=5\)"):
        anchor_witnesses(Q, K, torch.tensor([[0, 5], [1, 2]]), None, 1.0)
    with pytest.raises(TypeError, match="integer tensor"):
        anchor_witnesses(Q, K, torch.zeros(2, 2), None, 1.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_witness_keeps_an_anchor_read_by_one_sharp_query(seed):
    """The failure the witnesses fix, on a synthetic head: position 40 is read sharply (p > 0.99) by
    one pooled query that is not among the budget rows. Fitting on the budget rows only, C_v at that
    anchor is shaped by queries that barely touch it and the sharp query's output is lost; with its
    witness in the fit, the compaction's layer step reproduces that output, and held-out diffuse
    queries do no worse."""
    from arckv_press.compaction.fit import compact_attention, full_attention
    from arckv_press.compaction.layer import LayerMethod, compact_layer_from_stats

    g = torch.Generator().manual_seed(seed)
    T, D, n, star, sharp = 256, 16, 400, 40, 350
    K = torch.randn(1, T, D, generator=g, dtype=torch.float64)
    V = torch.randn(1, T, D, generator=g, dtype=torch.float64)
    Q = 0.5 * torch.randn(1, n, D, generator=g, dtype=torch.float64)
    Q[0, sharp] = 3.0 * K[0, star]
    scores = 0.1 * torch.rand(1, T, generator=g)
    scores[0, star] = 1.0
    st = _stats(Q, K, V, 1.0)
    err, held = {}, {}
    for wit in (True, False):
        res = compact_layer_from_stats(K, V, Q, st, torch.tensor([48]), 1.0, LayerMethod("arckv-ha", fit=FitConfig(witnesses=wit)),
                                       torch.arange(200), None, scores)
        assert res.fit_rows > 200 if wit else res.fit_rows == 200
        for name, rows, out in (("sharp", slice(sharp, sharp + 1), err), ("held", slice(200, 350), held)):
            q = Q[:, rows]
            y = full_attention(q, K, V, 1.0)
            y_hat = compact_attention(q, res.C_k, res.beta.double(), res.C_v, 1.0, res.valid)
            out[wit] = float(((y_hat - y).norm(dim=-1) / y.norm(dim=-1)).mean())
    assert err[True] < 0.4 and err[False] > 0.6
    assert held[True] <= held[False] + 0.01
