"""The needle-stage diagnostic: its layer swaps and head report against independent references."""

import torch


def test_value_positions_is_the_last_occurrence():
    from arckv_press.bench.needle_stages import value_positions

    assert value_positions([5, 1, 2, 9, 1, 2, 7], [1, 2]) == [4, 5]
    assert value_positions([5, 1, 2], [3]) == []


def test_swaps_and_head_report_against_the_full_cache(tiny_model, tiny_tokenizer):
    """Swapping every layer for the full cache's answers as the full cache does; every layer compact
    as the compact cache does; the head report's needle mass and compact output equal brute-force
    softmax attention over the full keys and over the packed compact entries."""
    from transformers import DynamicCache

    from arckv_press.api import compact
    from arckv_press.bench.needle_stages import head_report, layer_sweep, swap_layers
    from arckv_press.capture import encode_document, prefill
    from arckv_press.generation import answer

    model, tok = tiny_model("llama", num_layers=2), tiny_tokenizer()
    text = "the access code for the north gate is 4711 and the rest is filler text " * 6
    ids, P = encode_document(tok, text)
    with torch.inference_mode():
        cc = compact(model, tok, text, "arckv-ha", 0.25)
        full = prefill(model, ids, DynamicCache(config=model.config))

        def ask(layers):
            return answer(model, tok, swap_layers(cc, full, layers), "code?", 4, context_length=ids.shape[1])

        plain_full = answer(model, tok, full, "code?", 4, context_length=ids.shape[1])
        plain_compact = answer(model, tok, cc, "code?", 4, context_length=ids.shape[1])
        sweep = layer_sweep(ask, 2, [0, 1], step=1)
    assert sweep["none"] == plain_full and sweep["all"] == plain_compact
    assert sweep["below"][0] == plain_full and sweep["from"][0] == plain_compact
    assert set(sweep["alone"]) == {0, 1}
    layer = cc.layers[1]
    K, V = full.layers[1].keys[0, :, P:].double(), full.layers[1].values[0, :, P:].double()
    Hq, D = model.config.num_attention_heads, K.shape[-1]
    Q = torch.randn(Hq, 3, D, generator=torch.Generator().manual_seed(0))
    scaling = float(model.model.layers[1].self_attn.scaling)
    needle = [2, 3, 4]
    rows = head_report(layer, Q, K, V, scaling, needle)
    G = Hq // K.shape[0]
    for row in rows:
        h, q = row["kv_head"], Q[row["q_head"]].double()
        p = torch.softmax(scaling * q @ K[h].T, -1)
        n = int(layer.lengths[h])
        start = int(layer.lengths[:h].sum())
        ck, cv = layer.ck[start:start + n].double(), layer.cv[start:start + n].double()
        beta = layer.beta[start:start + n].double()
        pc = torch.softmax(scaling * q @ ck.T + beta, -1)
        ref = (pc @ cv - p @ V[h]).norm(dim=-1) / (p @ V[h]).norm(dim=-1)
        assert row["q_head"] // G == h and row["kept"] == n
        torch.testing.assert_close(torch.tensor(row["needle_mass"]).double(), p[:, needle].sum(-1), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(row["rel_error"]).double(), ref, atol=1e-4, rtol=1e-3)
