"""Chunk-local merging and chunk-separable fits (arckv_press.compaction.chunks) against references:
the rest of a chunk from brute-force attention, each chunk's fits against the full fits with every
other chunk's keys and values kept exact, the chunked layer step against a per-chunk reference, and
one chunk against the unchunked path on a real captured document."""

import pytest
import torch

from arckv_press.compaction.chunks import chunk_bounds, rest_of_chunk
from arckv_press.compaction.fit import FitConfig, attention_lse, fit_beta, fit_values, full_attention
from arckv_press.compaction.layer import LayerMethod, compact_layer_from_stats
from arckv_press.compaction.merge import merge_keys
from arckv_press.compaction.reference import grouped_rows
from arckv_press.compaction.stats import ReferenceStats, split_attention
from arckv_press.compaction.witness import head_fit_rows


def _rand(*shape, seed=0, dtype=torch.float64, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def test_chunk_bounds():
    assert chunk_bounds(10, 4, 9) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(10, 4, 10) == [(0, 10)]
    assert chunk_bounds(8, 4, 0) == [(0, 4), (4, 8)]
    assert chunk_bounds(3, 100, 0) == [(0, 3)]
    for bad in [dict(T=0, chunk_len=4, min_length=0), dict(T=5, chunk_len=0, min_length=0),
                dict(T=5, chunk_len=4, min_length=-1), dict(T=5, chunk_len=4, min_length=True)]:
        with pytest.raises(ValueError):
            chunk_bounds(**bad)


def test_attention_lse_is_brute_force():
    Q, K, V = _rand(2, 7, 5, seed=1), _rand(2, 11, 5, seed=2), _rand(2, 11, 3, seed=3)
    lse, out = attention_lse(Q, K, V, 0.4, block_rows=3)
    L = 0.4 * Q @ K.transpose(1, 2)
    torch.testing.assert_close(lse, torch.logsumexp(L, -1), rtol=0, atol=1e-12)
    torch.testing.assert_close(out, full_attention(Q, K, V, 0.4), rtol=0, atol=1e-12)


def test_rest_of_chunk_is_the_attention_over_the_other_keys():
    Q, K, V = _rand(2, 9, 4, seed=4, scale=2.0), _rand(2, 20, 4, seed=5), _rand(2, 20, 3, seed=6)
    lse, out = attention_lse(Q, K, V, 1.0)
    inside = torch.zeros(20, dtype=torch.bool)
    inside[6:13] = True
    lse_c, out_c = attention_lse(Q, K[:, inside], V[:, inside], 1.0)
    rest_lse, rest_out = rest_of_chunk(lse, out, lse_c, out_c)
    ref_lse, ref_out = attention_lse(Q, K[:, ~inside], V[:, ~inside], 1.0)
    torch.testing.assert_close(rest_lse, ref_lse, rtol=0, atol=1e-10)
    torch.testing.assert_close(rest_out, ref_out, rtol=0, atol=1e-10)
    # a chunk that is the whole document leaves no rest
    none_lse, none_out = rest_of_chunk(lse, out, lse, out)
    assert torch.isneginf(none_lse).all() and (none_out == 0).all()
    with pytest.raises(ValueError, match="do not match"):
        rest_of_chunk(lse, out, lse_c[:, :3], out_c)


def _chunk_and_rest(seed=7):
    """A document of 30 keys, a chunk of it (positions 10..21) with 4 compact slots (2 fixed), and
    the same problem written over the whole document with the rest kept as exact fixed slots."""
    H, n, T, D = 2, 40, 30, 4
    Q, K, V = _rand(H, n, D, seed=seed, scale=1.5), _rand(H, T, D, seed=seed + 1), _rand(H, T, 3, seed=seed + 2)
    lo, hi = 10, 22
    C_k = K[:, [11, 14, 17, 20]] + 0.1 * _rand(H, 4, D, seed=seed + 3)
    fixed = torch.tensor([[True, False, False, True], [False, True, True, False]])
    V_S = V[:, [11, 14, 17, 20]]
    outside = torch.ones(T, dtype=torch.bool)
    outside[lo:hi] = False
    full_ck = torch.cat([C_k, K[:, outside]], 1)
    full_fixed = torch.cat([fixed, torch.ones(H, int(outside.sum()), dtype=torch.bool)], 1)
    full_vals = torch.cat([V_S, V[:, outside]], 1)
    return Q, K, V, (lo, hi), C_k, fixed, V_S, full_ck, full_fixed, full_vals


@pytest.mark.parametrize("solver", ["ls_clamp", "nnls"])
def test_chunk_mass_fit_is_the_full_fit_with_the_rest_fixed(solver):
    """beta of a chunk fitted to its own mass (targets (z, lse_c)) equals the full Eq. (mass_fit) on
    the whole document with every key outside the chunk kept as itself (w = 1)."""
    Q, K, V, (lo, hi), C_k, fixed, _, full_ck, full_fixed, _ = _chunk_and_rest()
    config = FitConfig(mass_solver=solver, mass_ridge=0.0)
    L = Q @ K.transpose(1, 2)
    z = L.amax(-1)
    lse_c, _ = attention_lse(Q, K[:, lo:hi], V[:, lo:hi], 1.0)
    beta, w = fit_beta(Q, K[:, lo:hi], C_k, 1.0, config=config, targets=(z, lse_c), fixed=fixed)
    ref_beta, ref_w = fit_beta(Q, K, full_ck, 1.0, config=config, fixed=full_fixed)
    torch.testing.assert_close(w, ref_w[:, :4], rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(beta, ref_beta[:, :4], rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("ridge", [0.0, 1e-3])
def test_chunk_value_fit_is_the_full_fit_with_the_rest_fixed(ridge):
    """C_v of a chunk fitted with the rest of the document as exact log-sum-exp and output
    (``rest``) equals the full Eq. (value_lstsq) on the whole document with every key outside the
    chunk a fixed slot holding its own key, beta = 0 and its own value."""
    Q, K, V, (lo, hi), C_k, fixed, V_S, full_ck, full_fixed, full_vals = _chunk_and_rest(seed=11)
    config = FitConfig(ridge_v=ridge)
    beta = 0.3 * _rand(2, 4, seed=12)
    lse, Y = attention_lse(Q, K, V, 1.0)
    lse_c, out_c = attention_lse(Q, K[:, lo:hi], V[:, lo:hi], 1.0)
    C_v = fit_values(Q, K[:, lo:hi], V[:, lo:hi], C_k, beta, 1.0, config=config, Y=Y, fixed=fixed, fixed_values=V_S,
                     rest=rest_of_chunk(lse, Y, lse_c, out_c))
    full_beta = torch.cat([beta, torch.zeros(2, full_ck.shape[1] - 4, dtype=beta.dtype)], 1)
    ref = fit_values(Q, K, V, full_ck, full_beta, 1.0, config=config, fixed=full_fixed, fixed_values=full_vals)
    torch.testing.assert_close(C_v, ref[:, :4], rtol=1e-6, atol=1e-8)
    with pytest.raises(ValueError, match="rest needs Y"):
        fit_values(Q, K[:, lo:hi], V[:, lo:hi], C_k, beta, 1.0, rest=rest_of_chunk(lse, Y, lse_c, out_c))


def _stats(Q, K, V, G, N, T, block=16):
    st = ReferenceStats(Q.shape[0], G, N, T, V.shape[-1], "ha", "rms", block=block)
    split_attention(Q.view(Q.shape[0], G, N, -1), K, V, (0, T), 0.3, 0, block, on_block=lambda a, b: st.update(a, b, V))
    return st.result()


def test_chunked_layer_step_against_per_chunk_reference():
    """Above ``chunk_min_length`` the layer step merges each key into an anchor of its own chunk and
    fits each chunk with the rest of the document exact: per head and chunk, the brute-force merge on
    that chunk's keys and the full fits with the other chunks kept as fixed slots, on the budget
    rows plus the chunk's anchors' witness rows (recomputed here by argmax over every row)."""
    H, G, N, T, D = 2, 2, 48, 48, 6
    Q, K, V = (_rand(H, G * N, D, seed=20, dtype=torch.float32, scale=1.5), _rand(H, T, D, seed=21, dtype=torch.float32),
               _rand(H, T, D, seed=22, dtype=torch.float32))
    st = _stats(Q, K, V, G, N, T)
    base = grouped_rows(torch.tensor([0, 5, 9, 14, 20, 26, 31, 37, 40, 45]), N, G)
    budgets = torch.tensor([9, 12])
    method = LayerMethod("arckv-ha", lambda_m=0.25, chunk_len=16, chunk_min_length=0)
    res = compact_layer_from_stats(K, V, Q, st, budgets, 0.3, method, base)
    Qd, Kd, Vd = Q.double(), K.double(), V.double()
    probs = torch.softmax(0.3 * Qd @ Kd.transpose(1, 2), -1)
    cfg = method.fit
    for h in range(H):
        t_h = int(res.valid[h].sum())
        anchors = res.anchors[h, :t_h]
        for lo, hi in chunk_bounds(T, 16, 0):
            slots = ((anchors >= lo) & (anchors < hi)).nonzero().flatten()
            a = anchors[slots]
            assert slots.numel() == round(int(budgets[h]) * 16 / T)       # chunked top-t
            wit = [max(range(G * N), key=lambda r: (float(probs[h, r, j]), -(r % N), -(r // N))) for j in a.tolist()]
            rows = head_fit_rows(torch.tensor(wit), base)
            Qh = Qd[h:h + 1, rows]
            Ck, assign = merge_keys(Qh, Kd[h:h + 1, lo:hi], (a - lo)[None], None, 0.3, 0.25)
            fixed = torch.bincount(assign[0], minlength=a.numel())[None] == 1
            out = torch.ones(T, dtype=torch.bool)
            out[lo:hi] = False
            full_ck = torch.cat([Ck, Kd[h:h + 1, out]], 1)
            full_fixed = torch.cat([fixed, torch.ones(1, int(out.sum()), dtype=torch.bool)], 1)
            full_vals = torch.cat([Vd[h:h + 1, a], Vd[h:h + 1, out]], 1)
            beta, _ = fit_beta(Qh, Kd[h:h + 1], full_ck, 0.3, config=cfg, fixed=full_fixed)
            C_v = fit_values(Qh, Kd[h:h + 1], Vd[h:h + 1], full_ck, beta, 0.3, config=cfg, fixed=full_fixed,
                             fixed_values=full_vals)
            n = a.numel()
            torch.testing.assert_close(res.C_k[h, slots].double(), Ck[0], rtol=0, atol=1e-5)
            torch.testing.assert_close(res.beta[h, slots].double(), beta[0, :n].double(), rtol=0, atol=2e-3)
            torch.testing.assert_close(res.C_v[h, slots].double(), C_v[0, :n], rtol=0, atol=2e-3)


def test_one_chunk_is_the_unchunked_path():
    """The chunked code with one chunk over the whole document (``chunk_len >= T``,
    ``chunk_min_length = 0``) is the unchunked layer step, up to rounding."""
    H, G, N, T, D = 2, 3, 40, 40, 8
    Q, K, V = (_rand(H, G * N, D, seed=30, dtype=torch.float32, scale=1.5), _rand(H, T, D, seed=31, dtype=torch.float32),
               _rand(H, T, D, seed=32, dtype=torch.float32))
    st = _stats(Q, K, V, G, N, T)
    base = grouped_rows(torch.arange(0, N, 3), N, G)
    budgets = torch.tensor([6, 9])
    one = compact_layer_from_stats(K, V, Q, st, budgets, 0.3, LayerMethod("arckv-ha", chunk_len=T, chunk_min_length=0), base)
    ref = compact_layer_from_stats(K, V, Q, st, budgets, 0.3, LayerMethod("arckv-ha"), base)
    assert torch.equal(one.anchors, ref.anchors) and torch.equal(one.valid, ref.valid)
    torch.testing.assert_close(one.C_k, ref.C_k, rtol=0, atol=1e-6)
    torch.testing.assert_close(one.beta, ref.beta, rtol=0, atol=1e-4)
    torch.testing.assert_close(one.C_v, ref.C_v, rtol=0, atol=1e-4)


@pytest.mark.model
@pytest.mark.parametrize("anchor_search", ["scores", "omp"])
def test_one_chunk_is_the_unchunked_path_on_the_default_model(default_model_fp32, anchor_search):
    """On real captured layers of the default model (every layer, about 500 tokens), the compaction
    with one chunk over the whole document through the chunked code equals today's unchunked one,
    with either anchor search (the top-t of the scores, or OMP's)."""
    from arckv_press.api import compact
    from tests.conftest import make_text

    model, tok = default_model_fp32
    text = make_text(2400, seed=3)
    with torch.inference_mode():
        ref = compact(model, tok, text, "arckv-ha", 0.1, anchor_search=anchor_search)
        one = compact(model, tok, text, "arckv-ha", 0.1, anchor_search=anchor_search, chunk_len=100_000,
                      chunk_min_length=0)
    for a, b in zip(ref.compact_layers, one.compact_layers):
        assert torch.equal(a.lengths, b.lengths)
        torch.testing.assert_close(b.ck, a.ck, rtol=0, atol=1e-5)
        alive = (a.beta > -19) & (b.beta > -19)          # beta at the floor is an inert anchor either way
        torch.testing.assert_close(b.beta[alive], a.beta[alive], rtol=0, atol=5e-3)
        torch.testing.assert_close(b.cv[alive], a.cv[alive], rtol=0, atol=5e-3 * max(1.0, float(a.cv.abs().max())))
