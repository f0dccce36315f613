"""The fused reference pass (``arckv_press.compaction.stats``, ``capture.repeat_prefill_stats``)
against the separate passes it replaces: plain softmax attention, ``ha_scores`` / ``vi_scores``,
``anchor_witnesses``, ``full_attention`` and the fits computed from K; and the per-head fit rows,
per-head budget cap and stats-based layer compaction against brute-force references."""

from __future__ import annotations

import math

import pytest
import torch

from arckv_press.compaction.fit import FitConfig, fit_beta, fit_values, full_attention
from arckv_press.compaction.layer import LayerMethod, compact_layer, compact_layer_from_stats
from arckv_press.compaction.reference import group_queries_by_kv_head, grouped_rows
from arckv_press.compaction.select import global_budgets, ha_scores, topk_anchors, vi_scores
from arckv_press.capture import StatsCapture
from arckv_press.compaction.stats import DocBlock, ReferenceStats, causal_part, split_attention
from arckv_press.compaction.witness import anchor_witnesses, block_witnesses, head_fit_rows


def _layout(H=2, G=3, P=5, T=70, c=40, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    L = P + T + c
    k, v = torch.randn(H, L, D, generator=g), torch.randn(H, L, D, generator=g)
    q = torch.randn(H, G, c, D, generator=g) * 1.5
    return q, k, v, (P, P + T)


def _reference_attention(q, k, v, doc, first_row, scaling):
    """softmax over prefix + document + causal new keys, one query head at a time (float64)."""
    H, G, c, D = q.shape
    lo, hi = doc
    out = torch.empty(H, G, c, v.shape[-1], dtype=torch.float64)
    for h in range(H):
        for g in range(G):
            for r in range(c):
                visible = hi + first_row + r + 1
                logits = scaling * (k[h, :visible].double() @ q[h, g, r].double())
                out[h, g, r] = torch.softmax(logits, 0) @ v[h, :visible].double()
    return out


@pytest.mark.parametrize("first_row", [0, 7])
@pytest.mark.parametrize("flash", [False, True])
def test_split_attention_is_softmax_attention(first_row, flash):
    q, k, v, doc = _layout()
    q = q[:, :, : 40 - first_row]
    new = causal_part(torch.cat([torch.zeros_like(q[:, :, :first_row]), q], 2), k[:, doc[1]:], v[:, doc[1]:], 0.3) \
        if flash else None
    if new is not None:
        new = (new[0][:, :, first_row:], new[1][:, :, first_row:])
    out = split_attention(q, k, v, doc, 0.3, first_row, block=16, new_part=new)
    torch.testing.assert_close(out.double(), _reference_attention(q, k, v, doc, first_row, 0.3), atol=2e-6, rtol=0)


def test_split_attention_without_prefix():
    q, k, v, _ = _layout(P=0)
    out = split_attention(q, k, v, (0, 70), 0.25, 0, block=9)
    torch.testing.assert_close(out.double(), _reference_attention(q, k, v, (0, 70), 0, 0.25), atol=2e-6, rtol=0)


def _stats(q, k, v, doc, selector="ha", pooling="rms", block=16):
    H, G, c, D = q.shape
    lo, hi = doc
    st = ReferenceStats(H, G, c, hi - lo, v.shape[-1], selector, pooling, block=block)
    split_attention(q, k, v, doc, 0.3, 0, block, on_block=lambda a, blk: st.update(a, blk, v[:, lo:hi]),
                    keep_logits=st.needs_logits)
    return st.result()


@pytest.mark.parametrize("pooling", ["rms", "mean", "max"])
def test_stats_scores_equal_separate_selectors(pooling):
    q, k, v, doc = _layout(seed=1)
    Q = q.reshape(2, -1, 16)  # GQA row layout: row g * N + p
    K, V = k[:, doc[0]:doc[1]], v[:, doc[0]:doc[1]]
    ha = _stats(q, k, v, doc, "ha", pooling)
    torch.testing.assert_close(ha.scores, ha_scores(Q, K, 0.3, pooling), atol=1e-6, rtol=1e-5)
    vi = _stats(q, k, v, doc, "vi", pooling)
    torch.testing.assert_close(vi.scores, vi_scores(Q, K, V, 0.3, pooling), atol=1e-6, rtol=1e-5)


def test_stats_row_targets_equal_full_cache():
    q, k, v, doc = _layout(seed=2)
    Q = q.reshape(2, -1, 16)
    K, V = k[:, doc[0]:doc[1]], v[:, doc[0]:doc[1]]
    st = _stats(q, k, v, doc)
    L = 0.3 * Q.double() @ K.double().transpose(1, 2)
    torch.testing.assert_close(st.rows("row_max").double(), L.amax(-1), atol=1e-5, rtol=0)
    torch.testing.assert_close(st.rows("row_lse").double(), torch.logsumexp(L, -1), atol=1e-5, rtol=0)
    torch.testing.assert_close(st.rows("row_out"), full_attention(Q, K, V, 0.3), atol=1e-5, rtol=0)


def test_stats_without_scores_keep_the_witnesses_and_targets():
    """``selector="none"`` (the learned indexer scores elsewhere): the same witness blocks and row
    targets as with HA, and asking for scores is an error."""
    q, k, v, doc = _layout(seed=4)
    ha, none = _stats(q, k, v, doc, "ha"), _stats(q, k, v, doc, "none")
    for name in ("witness_p", "witness_pos", "row_max", "row_lse", "row_out"):
        assert torch.equal(getattr(none, name), getattr(ha, name)), name
    with pytest.raises(ValueError, match="no anchor scores"):
        none.scores


def test_block_witnesses_equal_brute_force_argmax():
    q, k, v, doc = _layout(seed=3)
    Q = q.reshape(2, -1, 16)
    K = k[:, doc[0]:doc[1]]
    st = _stats(q, k, v, doc, block=16)
    anchors, valid = topk_anchors(st.scores, torch.tensor([9, 13]))
    rows = block_witnesses(Q, K, anchors, 0.3, st.rows("row_lse"), st.witness_pos, st.block, st.G)
    torch.testing.assert_close(rows[valid], anchor_witnesses(Q, K, anchors, valid, 0.3)[valid])


def test_stats_do_not_depend_on_the_row_block():
    """The row block (``ReferenceStats.block``, a speed setting) changes no discrete choice: the same
    anchors, the same witness rows for them, and the same scores and row targets up to float rounding."""
    q, k, v, doc = _layout(seed=5, c=70)
    Q = q.reshape(2, -1, 16)
    K = k[:, doc[0]:doc[1]]
    ref = _stats(q, k, v, doc, block=64)
    anchors, valid = topk_anchors(ref.scores, torch.tensor([9, 13]))
    want = block_witnesses(Q, K, anchors, 0.3, ref.rows("row_lse"), ref.witness_pos, ref.block, ref.G)
    for block in (5, 16, 32):
        st = _stats(q, k, v, doc, block=block)
        torch.testing.assert_close(st.scores, ref.scores, atol=0, rtol=1e-6)
        for name in ("row_max", "row_lse", "row_out"):
            torch.testing.assert_close(st.rows(name), ref.rows(name), atol=1e-6, rtol=0)
        assert torch.equal(topk_anchors(st.scores, torch.tensor([9, 13]))[0], anchors)
        got = block_witnesses(Q, K, anchors, 0.3, st.rows("row_lse"), st.witness_pos, st.block, st.G)
        assert torch.equal(got, want), block


def test_stats_refuse_a_block_that_is_not_a_positive_int():
    for bad, err in ((0, ValueError), (-3, ValueError), (2.0, TypeError), (True, TypeError)):
        with pytest.raises(err, match="block"):
            ReferenceStats(1, 1, 4, 4, 2, block=bad)
        with pytest.raises(err, match="block"):  # the capture refuses it before any forward
            StatsCapture(None, [0], 0, 4, block=bad)


def test_block_witness_ties_go_to_lowest_position_then_query_head():
    """Two rows give an anchor the same log-probability: the lower position wins, and among the
    query heads of one position the lower head."""
    H, G, N, D = 1, 2, 6, 4
    K = torch.eye(D)[None, :3] * 2.0                     # T = 3 keys
    Q = torch.zeros(H, G * N, D)
    Q[0, 1 * N + 2] = K[0, 1]                             # head 1, position 2
    Q[0, 0 * N + 4] = K[0, 1]                             # head 0, position 4: same log p, later position
    Q[0, 0 * N + 2] = K[0, 1]                             # head 0, position 2: same position, lower head
    L = Q[0] @ K[0].T
    lse = torch.logsumexp(L, -1)[None]
    rows = block_witnesses(Q, K, torch.tensor([[1]]), 1.0, lse, torch.zeros(1, 3, dtype=torch.long), N, G)
    assert rows.tolist() == [[0 * N + 2]]


def test_stats_refuse_blocks_out_of_order():
    q, k, v, doc = _layout()
    st = ReferenceStats(2, 3, 40, 70, 16, block=16)
    blocks = []
    split_attention(q, k, v, doc, 0.3, 0, 16, on_block=lambda a, blk: blocks.append((a, blk)))
    with pytest.raises(ValueError, match="does not fit"):
        st.update(16, blocks[1][1])
    st.update(0, blocks[0][1])
    with pytest.raises(ValueError, match="incomplete"):
        st.result()
    with pytest.raises(ValueError, match="selector"):
        ReferenceStats(2, 3, 40, 70, 16, selector="omp")


def test_fits_from_targets_equal_fits_from_keys():
    q, k, v, doc = _layout(seed=4, T=90)
    Q = q.reshape(2, -1, 16)
    K, V = k[:, doc[0]:doc[1]], v[:, doc[0]:doc[1]]
    st = _stats(q, k, v, doc)
    C = K[:, ::6] + 0.1
    targets = (st.rows("row_max"), st.rows("row_lse"))
    for cfg in (FitConfig(), FitConfig(gram_dtype="float64"), FitConfig(mass_solver="nnls")):
        b0, w0 = fit_beta(Q, K, C, 0.3, config=cfg)
        b1, w1 = fit_beta(Q, K, C, 0.3, config=cfg, targets=targets)
        torch.testing.assert_close(b1, b0, atol=1e-4, rtol=1e-4)
        c0 = fit_values(Q, K, V, C, b0, 0.3, config=cfg)
        c1 = fit_values(Q, K, V, C, b0, 0.3, config=cfg, Y=st.rows("row_out"))
        torch.testing.assert_close(c1, c0, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="row_lse must have shape"):
        fit_beta(Q, K, C, 0.3, targets=(targets[0], targets[1][:, :5]))
    with pytest.raises(ValueError, match="Y must have shape"):
        fit_values(Q, K, V, C, b0, 0.3, Y=st.rows("row_out")[:, :5])


def test_float32_products_match_float64_with_a_ridge():
    """The float32 Gram products (the fused default) against float64 ones on an ordinary problem."""
    q, k, v, doc = _layout(seed=5, T=120)
    Q = q.reshape(2, -1, 16)
    K, V = k[:, doc[0]:doc[1]], v[:, doc[0]:doc[1]]
    C = K[:, ::8]
    b32, _ = fit_beta(Q, K, C, 0.3, config=FitConfig(gram_dtype="float32"))
    b64, _ = fit_beta(Q, K, C, 0.3, config=FitConfig(gram_dtype="float64"))
    alive = b64 > -19
    torch.testing.assert_close(b32[alive], b64[alive], atol=2e-3, rtol=0)
    c32 = fit_values(Q, K, V, C, b64, 0.3, config=FitConfig(gram_dtype="float32"))
    c64 = fit_values(Q, K, V, C, b64, 0.3, config=FitConfig(gram_dtype="float64"))
    torch.testing.assert_close(c32, c64, atol=1e-3, rtol=0)


def test_head_fit_rows_add_each_new_witness_once():
    base = torch.tensor([0, 3, 5, 10 + 0, 10 + 3, 10 + 5])  # positions 0, 3, 5 of two query heads, N = 10
    rows = head_fit_rows(torch.tensor([3, 14, 14, 7, 19]), base)
    assert rows.tolist() == [0, 3, 5, 10, 13, 15, 7, 14, 19]


def test_global_budget_floor_against_greedy_reference():
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(4, 3, 100, generator=g)
    scores[1, 2] *= 10  # one head would take most of the budget
    for floor in (0.5, 0.0, 1.0):
        got = global_budgets(scores, 0.1, min_fraction=floor)
        per_min = max(1, math.floor(floor * 10 + 1e-6))
        limit = 100
        flat = scores.reshape(12, 100).double()
        order = torch.sort(flat, dim=1, descending=True, stable=True).indices
        counts = [per_min] * 12
        cands = sorted((-flat[h, j].item(), h * 100 + j) for h in range(12) for j in order[h, per_min:].tolist())
        rest = 120 - 12 * per_min
        for _, i in cands:
            if rest == 0:
                break
            if counts[i // 100] < limit:
                counts[i // 100] += 1
                rest -= 1
        assert got.reshape(-1).tolist() == counts
        assert int(got.min()) >= per_min and int(got.sum()) == 120
    assert int(global_budgets(scores, 0.1, min_fraction=0.5)[1, 2]) > 20
    assert global_budgets(scores, 0.1, min_fraction=1.0).unique().tolist() == [10]


def _layer_problem(seed: int):
    """A 2-KV-head layer (T = 80, 60 captured positions), its statistics and every third position as
    the budget rows: ``(Q, K, V, stats, base_rows)``."""
    q, k, v, doc = _layout(seed=seed, T=80, c=60)
    H, G, N, D = q.shape
    K, V = k[:, doc[0]:doc[1]], v[:, doc[0]:doc[1]]
    return q.reshape(H, -1, D), K, V, _stats(q, k, v, doc), grouped_rows(torch.arange(0, N, 3), N, G)


def test_compact_layer_from_stats_equals_compact_layer_on_the_same_rows():
    """Without witnesses and with merging on the fit rows, the stats-based composition is the
    separate one on the budget rows (targets from the pass instead of recomputed from K)."""
    Q, K, V, st, base = _layer_problem(6)
    H = Q.shape[0]
    budgets = torch.tensor([8, 12])
    method = LayerMethod("arckv-ha", fit=FitConfig(witnesses=False))
    got = compact_layer_from_stats(K, V, Q, st, budgets, 0.3, method, base, None)
    ref = compact_layer(K, V, Q[:, base], budgets, 0.3, method, scores=st.scores)
    assert torch.equal(got.anchors[got.valid], ref.anchors[ref.valid])
    torch.testing.assert_close(got.C_k, ref.C_k, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.beta, ref.beta, atol=1e-3, rtol=0)
    torch.testing.assert_close(got.C_v, ref.C_v, atol=1e-3, rtol=0)
    # with witnesses: each head fits on the budget rows plus its own anchors' witness rows
    wit = compact_layer_from_stats(K, V, Q, st, budgets, 0.3, LayerMethod("arckv-ha"), base, None)
    w_rows = anchor_witnesses(Q, K, wit.anchors, wit.valid, 0.3)
    for h in range(H):
        rows = head_fit_rows(w_rows[h, wit.valid[h]], base)
        assert wit.fit_rows >= rows.numel()
        one = compact_layer(K[h:h + 1], V[h:h + 1], Q[h:h + 1, rows], budgets[h:h + 1], 0.3, LayerMethod("arckv-ha"),
                            scores=st.scores[h:h + 1])
        t = int(budgets[h])
        torch.testing.assert_close(wit.C_k[h, :t], one.C_k[0, :t], atol=1e-5, rtol=0)
        torch.testing.assert_close(wit.C_v[h, :t], one.C_v[0, :t], atol=1e-3, rtol=0)


@pytest.mark.model
def test_fused_repeat_prefill_equals_separate_passes_on_the_model(default_model_fp32):
    """On real captured layers of the default model: the fused pass's queries (so its attention
    output), HA / VI scores, witnesses and fit targets equal the separate passes'."""
    from arckv_press.capture import encode_document
    from arckv_press.capture import framing_for, prefill, repeat_prefill, repeat_prefill_stats
    from arckv_press.haystack import load_haystack

    model, tok = default_model_fp32
    doc = tok.decode(tok.encode(load_haystack(None)[:6000], add_special_tokens=False)[:300])
    ids, P = encode_document(tok, doc)
    T = ids.shape[1] - P
    layers = [0, 11, 29]
    with torch.inference_mode():
        cache = prefill(model, ids)
        suffix = framing_for(tok).suffix_ids
        old = repeat_prefill(model, tok, cache, ids[:, P:], suffix, layers, torch.arange(T), 128)
        cap = repeat_prefill_stats(model, tok, cache, ids[:, P:], suffix, layers, P, "ha", "rms", None, 128)
        vi = repeat_prefill_stats(model, tok, cache, ids[:, P:], suffix, [11], P, "vi", "rms", None, 128)
    scaling = float(model.model.layers[0].self_attn.scaling)
    for i in layers:
        q_old = old.layer(i)[1]
        q_new = torch.cat(cap.store.q[i], 1)
        torch.testing.assert_close(q_new, q_old, atol=1e-4, rtol=1e-5)
        Q = group_queries_by_kv_head(q_old[None], 3)
        K, V = cache.layers[i].keys[0, :, P:], cache.layers[i].values[0, :, P:]
        st = cap.stats[i]
        torch.testing.assert_close(st.scores, ha_scores(Q, K, scaling), atol=1e-6, rtol=1e-4)
        anchors, valid = topk_anchors(st.scores, torch.full((3,), 30))
        got = block_witnesses(Q, K, anchors, scaling, st.rows("row_lse"), st.witness_pos, st.block, st.G)
        assert torch.equal(got, anchor_witnesses(Q, K, anchors, valid, scaling))
        torch.testing.assert_close(st.rows("row_out"), full_attention(Q, K, V, scaling), atol=1e-4, rtol=0)
        L = scaling * Q @ K.transpose(1, 2)
        torch.testing.assert_close(st.rows("row_lse"), torch.logsumexp(L, -1), atol=1e-4, rtol=0)
        if i == 11:
            torch.testing.assert_close(vi.stats[11].scores, vi_scores(Q, K, V, scaling), atol=1e-6, rtol=1e-4)


@pytest.mark.model
def test_stats_block_changes_nothing_on_the_model(default_model_fp32):
    """On real captured layers of the default model, statistics swept 64 rows at a time (the block
    before) and 32 (the default) pick the same anchors and the same witness rows, with equal row
    targets and scores equal to float rounding."""
    from arckv_press.capture import encode_document, framing_for, prefill, repeat_prefill_stats
    from arckv_press.haystack import load_haystack

    model, tok = default_model_fp32
    doc = tok.decode(tok.encode(load_haystack(None)[:6000], add_special_tokens=False)[:300])
    ids, P = encode_document(tok, doc)
    layers = [0, 11, 29]
    with torch.inference_mode():
        cache = prefill(model, ids)
        suffix = framing_for(tok).suffix_ids
        args = (model, tok, cache, ids[:, P:], suffix, layers, P, "ha", "rms", None, 128)
        runs = {64: repeat_prefill_stats(*args, block=64), None: repeat_prefill_stats(*args)}
    assert runs[None].stats[0].block == 32
    scaling = float(model.model.layers[0].self_attn.scaling)
    for i in layers:
        old, new = runs[64].stats[i], runs[None].stats[i]
        Q = group_queries_by_kv_head(torch.cat(runs[64].store.q[i], 1)[None], 3)
        K = cache.layers[i].keys[0, :, P:]
        torch.testing.assert_close(new.scores, old.scores, atol=0, rtol=1e-5)
        for name in ("row_max", "row_lse", "row_out"):
            torch.testing.assert_close(new.rows(name), old.rows(name), atol=1e-6, rtol=0)
        for t in (3, 15, 30):
            anchors, _ = topk_anchors(old.scores, torch.full((3,), t))
            assert torch.equal(topk_anchors(new.scores, torch.full((3,), t))[0], anchors)
            assert torch.equal(
                block_witnesses(Q, K, anchors, scaling, new.rows("row_lse"), new.witness_pos, new.block, new.G),
                block_witnesses(Q, K, anchors, scaling, old.rows("row_lse"), old.witness_pos, old.block, old.G))


def test_stats_capture_restores_attention_and_refuses_a_wrong_cache(tiny_model, tiny_tokenizer, monkeypatch):
    """The pass switches the model to its attention only while it runs (also when it fails), and a
    cache that does not hold prefix + document is refused before any forward."""
    from transformers import DynamicCache

    from arckv_press.capture import encode_document
    from arckv_press.capture import framing_for, prefill, repeat_prefill_stats

    model, tok = tiny_model("llama", num_layers=2), tiny_tokenizer()
    ids, P = encode_document(tok, "a short document " * 6)
    before = model.config._attn_implementation
    with torch.no_grad():
        cache = prefill(model, ids)
        suffix = framing_for(tok).suffix_ids
        with pytest.raises(ValueError, match="the cache holds"):
            repeat_prefill_stats(model, tok, DynamicCache(config=model.config), ids[:, P:], suffix, [0, 1], P)
        cap = repeat_prefill_stats(model, tok, cache, ids[:, P:], suffix, [0, 1], P, chunk_size=8)
        assert model.config._attn_implementation == before
        assert cache.get_seq_length() == ids.shape[1]  # restored to the context
        assert sorted(cap.stats) == [0, 1] and all(st.next_pos == ids.shape[1] - P for st in cap.stats.values())
        st = cap.stats[0]
        with pytest.raises(ValueError, match="does not fit"):  # every position was fed: no more blocks
            z = torch.zeros(st.H, st.G, 1)
            st.update(0, DocBlock(None, z, z + 1, torch.zeros(st.H, st.G, 1, st.T), torch.zeros(st.H, st.G, 1, st.Dv)))

        def broken(self, *args, **kwargs):
            raise RuntimeError("boom")

        monkeypatch.setattr(ReferenceStats, "update", broken)
        with pytest.raises(RuntimeError, match="boom"):
            repeat_prefill_stats(model, tok, cache, ids[:, P:], suffix, [0, 1], P, chunk_size=8)
    assert model.config._attn_implementation == before and cache.get_seq_length() == ids.shape[1]


def _assert_rows_after(st, q: torch.Tensor, layer, scaling: float, P: int, T: int, first: int) -> None:
    """The statistics ``st`` of rows ``first ..`` (queries ``q [Hq, N, D]``) against float64 softmax
    attention over the document keys of the cache ``layer``, and every row's pooled HA score."""
    Q = group_queries_by_kv_head(q[None], layer.keys.shape[1]).double()
    K, V = layer.keys[0, :, P:P + T].double(), layer.values[0, :, P:P + T].double()
    L = scaling * Q @ K.transpose(1, 2)
    rows = grouped_rows(torch.arange(first, st.N), st.N, st.G)
    torch.testing.assert_close(st.rows("row_lse")[:, rows].double(), torch.logsumexp(L, -1)[:, rows], atol=1e-5, rtol=0)
    torch.testing.assert_close(st.rows("row_out")[:, rows].double(), (torch.softmax(L, -1) @ V)[:, rows],
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(st.scores.double(), torch.softmax(L, -1).square().mean(1).sqrt(), atol=1e-6, rtol=1e-4)


def test_tail_rows_are_a_short_repeat_of_the_document_end(tiny_model, tiny_tokenizer):
    """``tail_rows=W`` appends, after the document's rows, the queries of one more forward: the
    instruction to repeat "starting with" the 8 tokens before the last W, the suffix, then the last W
    document tokens, fed after the whole context. Each tail row equals the layer's own query of that
    forward (computed independently: the model's hidden states, ``input_layernorm``, ``q_proj`` and
    the rotary module at the positions after the context), and its statistics equal float64
    softmax attention over the document keys; the scores pool the document's rows and the tail rows.
    The document's rows (queries, statistics, ``q_proj`` inputs) are exactly those of the pass
    without tail rows; at most a quarter of the document is repeated."""
    import copy

    from conftest import forward_queries

    from arckv_press.capture import (REPEAT_CHUNK_PROMPT, TAIL_FRACTION, encode_document, framing_for, prefill,
                                     repeat_prefill_stats)

    model, tok = tiny_model("llama", num_layers=2), tiny_tokenizer()
    ids, P = encode_document(tok, "a short document about the north gate and its code " * 4)
    T, W = ids.shape[1] - P, 24
    suffix = framing_for(tok).suffix_ids
    doc = ids[:, P:]
    with torch.no_grad():
        cache = prefill(model, ids)
        args = (model, tok, cache, doc, suffix, [0, 1], P, "ha", "rms", None, 16)
        plain = repeat_prefill_stats(*args)
        cap = repeat_prefill_stats(*args, tail_rows=W)
        assert cap.n_tail == W
        for longer in (T, 10 * T):  # at most a quarter of the document (TAIL_FRACTION)
            other = repeat_prefill_stats(*args, tail_rows=longer)
            assert other.n_tail == T // 4 == int(T * TAIL_FRACTION) and other.stats[0].N == T + T // 4
        assert W < T // 4
        assert cache.get_seq_length() == ids.shape[1]  # restored to the context
        # the tail forward's rows are not document positions: it adds no q_proj inputs
        every = torch.arange(T)
        xs = [repeat_prefill_stats(*args[:9], every, 16, tail_rows=w).store.x for w in (0, W)]
        for i in (0, 1):
            assert torch.equal(torch.cat(xs[1][i]), torch.cat(xs[0][i])) and torch.cat(xs[0][i]).shape[0] == T
        # the tail forward, independently: its ids, then the model's hidden state at every layer
        span = torch.cat([torch.tensor([tok.encode(REPEAT_CHUNK_PROMPT, add_special_tokens=False)]),
                          doc[:, T - W - 8:T - W], torch.tensor([suffix]), doc[:, T - W:]], 1)
        ref_q = forward_queries(model, copy.deepcopy(cache), span)
        for i in (0, 1):
            attn = model.model.layers[i].self_attn
            st, st0 = cap.stats[i], plain.stats[i]
            assert (st.N, st0.N) == (T + W, T)
            q = torch.cat(cap.store.q[i], 1)
            assert torch.equal(q[:, :T], torch.cat(plain.store.q[i], 1))
            for name in ("row_max", "row_lse", "row_out"):
                assert torch.equal(getattr(st, name)[:, :, :T], getattr(st0, name))
            torch.testing.assert_close(q[:, T:], ref_q[i][:, -W:], atol=1e-5, rtol=1e-5)
            _assert_rows_after(st, q, cache.layers[i], float(attn.scaling), P, T, T)


def test_tail_rows_of_the_budget_positions_join_the_fit_rows():
    """``api.extra_rows``: after the T document rows, the tail rows hold the last ``n_tail`` positions
    (row T + p - (T - n_tail)); budget positions before them have none."""
    from arckv_press.api import extra_rows

    pos = torch.tensor([0, 5, 17, 18, 19])
    assert extra_rows(pos, 20, 0).tolist() == []
    assert extra_rows(pos, 20, 4).tolist() == [20 + 1, 20 + 2, 20 + 3]
    assert extra_rows(pos, 20, 20).tolist() == [20, 25, 37, 38, 39]
    assert extra_rows(pos[:2], 20, 4).tolist() == []


def test_tail_rows_option_checks_and_id():
    """``tail_rows`` is a non-negative int and has an id of its own."""
    from arckv_press.config import CompactionConfig, config_id

    assert config_id(CompactionConfig(tail_rows=0)) != config_id(CompactionConfig(tail_rows=512))
    assert config_id(CompactionConfig(tail_rows=256)) != config_id(CompactionConfig(tail_rows=512))
    with pytest.raises(TypeError, match="tail_rows"):
        CompactionConfig(tail_rows=True)
    with pytest.raises(TypeError, match="tail_rows"):
        CompactionConfig(tail_rows=2.0)
    with pytest.raises(ValueError, match="tail_rows"):
        CompactionConfig(tail_rows=-1)
    assert config_id(CompactionConfig(method="am-omp", tail_rows=512)) == config_id(CompactionConfig(method="am-omp"))


def test_retired_near_rows_option_is_refused():
    """``near_rows`` (the copies' queries moved after the document, a study superseded by the tail rows)
    is retired: passing it is an error, not a silently ignored option."""
    from arckv_press.config import CompactionConfig

    with pytest.raises(TypeError, match="near_rows"):
        CompactionConfig(near_rows=True)
