"""``compact(...)`` end to end on tiny models (and the default model for fidelity).

References: the plain ``DynamicCache`` of the same context (ratio 1 must be exact), kvpress-style
tokenization built here from the chat template, closed-form budgets/bytes, and for fidelity the
uncompressed attention outputs of held-out repeat queries.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from arckv_press.methods import COMPACTION_METHODS
from arckv_press.config import CompactionConfig
from arckv_press.api import reference_positions, compact, compact_prefilled
from arckv_press.cache import CompactCache, CompactLayer
from arckv_press.capture import framing_for, prefill, repeat_prefill
from arckv_press.compaction.fit import FitConfig, compact_attention, full_attention, fit_beta, fit_values
from arckv_press.compaction.layer import LayerMethod, compact_layer
from arckv_press.compaction.reference import group_queries_by_kv_head
from arckv_press.models import describe_attention_layout

PG_ESSAYS = Path(__file__).resolve().parents[2] / "shared" / "data" / "ruler" / "pg_essays.txt"


from conftest import make_text  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def kvpress_ids(tok, context: str, question: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Context and question ids the way kvpress's pipeline frames them (chat template split on a
    separator), plus the prefix length (tokens before the document)."""
    sep = "#" * (len(context) + 10)
    text = tok.apply_chat_template([{"role": "user", "content": context + sep}], add_generation_prompt=True, tokenize=False)
    ctx, suffix = text.split(sep)
    ctx_ids = tok.encode(ctx, add_special_tokens=False)
    prefix_len = len(tok.encode(ctx[: ctx.index(context)], add_special_tokens=False))
    q_ids = tok.encode(question + suffix, add_special_tokens=False)
    return torch.tensor([ctx_ids]), torch.tensor([q_ids]), prefix_len


# ------------------------------------------------------------------------ ratio 1 is exact

IDENTITY_CASES = [(f, {}) for f in ("llama", "qwen2", "qwen3", "mistral", "gemma3")] + [("gemma3", {"sliding_window": 8})]


@pytest.mark.parametrize("family,overrides", IDENTITY_CASES, ids=[f"{f}{'-sw8' if o else ''}" for f, o in IDENTITY_CASES])
def test_ratio_one_is_the_plain_cache(tiny_model, tiny_tokenizer, family, overrides):
    model = tiny_model(family, num_layers=2, **overrides)
    tok = tiny_tokenizer()
    text, question = make_text(50, seed=1), "which river is quiet?"
    ctx_ids, q_ids, P = kvpress_ids(tok, text, question)
    T = ctx_ids.shape[1] - P
    full_ids = torch.cat([ctx_ids, q_ids], dim=1)
    with torch.no_grad():
        dyn = DynamicCache(config=model.config)
        model(ctx_ids, past_key_values=dyn)
        prefix_keys = [layer.keys[:, :, :P].clone() for layer in dyn.layers]
        doc_keys = [layer.keys[0, :, P:].clone() for layer in dyn.layers]
        ref_logits = model(q_ids, past_key_values=dyn).logits
        ref_gen = model.generate(full_ids, max_new_tokens=8, do_sample=False, pad_token_id=2)

        cache = compact(model, tok, text, ratio=1.0)  # default method 'arckv': no indexer needed at rho = 1
        assert isinstance(cache, CompactCache)
        full_layers = describe_attention_layout(model).full_attention_layers
        for i, layer in enumerate(cache.layers):
            if i in full_layers:
                assert isinstance(layer, CompactLayer)
                assert layer.num_appended == P and layer.span == T
                assert layer.lengths.tolist() == [T, T]
                assert torch.equal(layer.beta, torch.zeros_like(layer.beta))
                assert torch.equal(layer.keys[:, :, T:], prefix_keys[i])  # prefix kept verbatim
                assert torch.equal(layer.ck.view(2, T, -1), doc_keys[i])
            else:
                assert not isinstance(layer, CompactLayer)
                assert isinstance(layer, DynamicSlidingWindowLayer if overrides else DynamicLayer)
        if family == "gemma3":
            assert [isinstance(l, CompactLayer) for l in cache.layers] == [False, True]
        assert cache.get_seq_length() == P + T
        assert cache.realised_ratio() == 1.0
        logits = model(q_ids, past_key_values=cache).logits

        fresh = compact(model, tok, text, "arckv-ha", 1.0)
        gen = model.generate(full_ids, past_key_values=fresh, max_new_tokens=8, do_sample=False, pad_token_id=2)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
    assert torch.equal(gen, ref_gen)


# ------------------------------------------------------------------- every method, rho = 0.25

METHOD_FAMILIES = ("llama", "qwen3", "gemma3")
TRAINING_FREE = [m for m in COMPACTION_METHODS if m != "arckv"]


def layer_tensors(cache: CompactCache) -> list[tuple[torch.Tensor, ...]]:
    return [(l.ck, l.beta, l.cv, l.lengths, l._new_k, l._new_v) for l in cache.compact_layers]


@pytest.mark.parametrize("family", METHOD_FAMILIES)
def test_every_method_quarter_ratio(tiny_model, tiny_tokenizer, family):
    assert sorted(TRAINING_FREE) == ["am-ha", "am-omp", "am-omp-fast", "arckv-ha", "arckv-vi"]
    model = tiny_model(family, num_layers=2)
    tok = tiny_tokenizer()
    layout = describe_attention_layout(model)
    H, D = layout.num_kv_heads, layout.head_dim
    text = make_text(70, seed=2)
    ctx_ids, q_ids, P = kvpress_ids(tok, text, "which stone?")
    T = ctx_ids.shape[1] - P
    assert T == 70
    t = math.floor(0.25 * T)  # uniform weights: floor(rho T) per head (paper Eq. (per_head_budget))
    n_full = len(layout.full_attention_layers)
    opts = dict(query_budget=64)  # 32 of the 70 positions: the seed matters
    for method in TRAINING_FREE:
        with torch.no_grad():
            cache = compact(model, tok, text, method, 0.25, **opts)
            again = compact(model, tok, text, method, 0.25, **opts)
            logits = model(q_ids, past_key_values=cache).logits
        assert len(cache.compact_layers) == n_full
        if method.startswith("am-"):  # uniform budgets; ARC-KV: global budgets with the same total
            assert all(layer.lengths.tolist() == [t] * H for layer in cache.compact_layers), method
        assert sum(int(layer.lengths.sum()) for layer in cache.compact_layers) == n_full * H * t, method
        for layer in cache.compact_layers:
            assert layer.num_appended - q_ids.shape[1] == P
            for x in (layer.ck, layer.beta, layer.cv):
                assert torch.isfinite(x).all(), method
        assert cache.realised_ratio() == pytest.approx(t / T, abs=0)
        assert cache.report.realised_ratio == pytest.approx(t / T, abs=0)
        expected_bytes = n_full * H * t * (2 * D * 4 + 4)
        assert cache.report.compact_bytes == expected_bytes == cache.compact_nbytes()
        assert cache.report.full_bytes == n_full * 2 * H * (P + T) * D * 4
        if method.startswith("am-"):  # AM fits on the budget rows; ARC-KV adds its anchors' witnesses
            assert cache.report.reference_rows == layout.group_size * 32
        else:
            assert layout.group_size * 32 < cache.report.reference_rows <= layout.group_size * T
        assert torch.isfinite(logits).all()
        for layer in again.compact_layers:  # no hidden storage (e.g. a view of the full cache)
            for x in (layer.ck, layer.beta, layer.cv, layer._new_k, layer._new_v):
                assert x.untyped_storage().nbytes() == x.nbytes, method
        for a, b in zip(layer_tensors(again), layer_tensors(compact(model, tok, text, method, 0.25, **opts))):
            for x, y in zip(a, b):
                assert torch.equal(x, y), f"{method}: not deterministic"
        other = compact(model, tok, text, method, 0.25, seed=1, **opts)
        assert any(
            not torch.equal(x, y) for a, b in zip(layer_tensors(again), layer_tensors(other)) for x, y in zip(a[:3], b[:3])
        ), f"{method}: the seed has no effect"


def test_api_feeds_compact_layer_the_captured_queries(tiny_model, tiny_tokenizer):
    """Attention Matching: the compacted layer equals ``compact_layer`` on queries captured and
    grouped here."""
    model = tiny_model("qwen3", num_layers=2)
    tok = tiny_tokenizer()
    text = make_text(60, seed=3)
    config = CompactionConfig(method="am-ha", ratio=0.25, query_budget=40, seed=5)
    layout = describe_attention_layout(model)
    with torch.no_grad():
        ids, _, P = kvpress_ids(tok, text, "?")
        T = ids.shape[1] - P
        dyn = DynamicCache(config=model.config)
        prefill(model, ids, dyn)
        K = [l.keys[0, :, P:].clone() for l in dyn.layers]
        V = [l.values[0, :, P:].clone() for l in dyn.layers]
        positions = reference_positions(T, layout.group_size, config)
        assert positions.numel() == 20
        store = repeat_prefill(model, tok, dyn, ids[:, P:], framing_for(tok).suffix_ids, [0, 1], positions)
        cache = compact(model, tok, text, config.method, config.ratio, query_budget=40, seed=5)
    budgets = torch.full((2,), math.floor(0.25 * T))
    for i, layer in enumerate(cache.compact_layers):
        Q = group_queries_by_kv_head(store.layer(i)[1][None], 2)
        res = compact_layer(K[i], V[i], Q, budgets, layout.scaling, LayerMethod("am-ha"))
        torch.testing.assert_close(layer.ck, res.C_k[res.valid], atol=1e-6, rtol=0)
        torch.testing.assert_close(layer.beta, res.beta[res.valid], atol=1e-5, rtol=0)
        torch.testing.assert_close(layer.cv, res.C_v[res.valid], atol=1e-5, rtol=0)


def _three_layer_reference(tiny_model, tiny_tokenizer):
    """A 3-layer tiny llama, a 60-character text, its document K / V per layer and the repeat
    queries of every position, captured separately (the brute-force references' inputs)."""
    model = tiny_model("llama", num_layers=3)
    tok = tiny_tokenizer()
    text = make_text(60, seed=7)
    with torch.no_grad():
        ids, _, P = kvpress_ids(tok, text, "?")
        T = ids.shape[1] - P
        dyn = DynamicCache(config=model.config)
        prefill(model, ids, dyn)
        K = [l.keys[0, :, P:].clone() for l in dyn.layers]
        V = [l.values[0, :, P:].clone() for l in dyn.layers]
        store = repeat_prefill(model, tok, dyn, ids[:, P:], framing_for(tok).suffix_ids, [0, 1, 2], torch.arange(T))
    return model, tok, text, describe_attention_layout(model), T, K, V, store


def _tail_queries(model, tok, text, n: int) -> list[torch.Tensor]:
    """Per layer, the post-RoPE queries ``[Hq, n, D]`` of the tail repeat: the instruction to repeat
    "starting with" the 8 tokens before the document's last ``n``, the suffix, those ``n`` tokens,
    fed after the whole context (``conftest.forward_queries``)."""
    from conftest import forward_queries

    from arckv_press.capture import REPEAT_CHUNK_PROMPT

    ids, _, P = kvpress_ids(tok, text, "?")
    doc, T = ids[:, P:], ids.shape[1] - P
    span = torch.cat([torch.tensor([tok.encode(REPEAT_CHUNK_PROMPT, add_special_tokens=False)]),
                      doc[:, T - n - 8:T - n], torch.tensor([framing_for(tok).suffix_ids]), doc[:, T - n:]], 1)
    with torch.no_grad():
        cache = prefill(model, ids, DynamicCache(config=model.config))
    return [q[:, -n:] for q in forward_queries(model, cache, span)]


def test_fused_default_against_brute_force(tiny_model, tiny_tokenizer):
    """The default fused pipeline against a brute-force reference from the separately captured
    queries: HA scores from every row (the copy's, then the tail repeat's of the last quarter of
    the document), the global allocation (floor and cap), and per KV head the fits on the budget
    rows (their copy rows and, in the tail, their tail rows) plus its own anchors' witness rows
    (argmax of the attention probability; ties to the lowest row, then query head), with targets
    recomputed from K."""
    from arckv_press.capture import TAIL_FRACTION
    from arckv_press.compaction.merge import merge_keys
    from arckv_press.compaction.select import global_budgets

    model, tok, text, layout, T, K, V, store = _three_layer_reference(tiny_model, tiny_tokenizer)
    H, G = layout.num_kv_heads, layout.group_size
    config = CompactionConfig(method="arckv-ha", ratio=0.2, query_budget=40, seed=3)
    with torch.no_grad():
        cache = compact(model, tok, text, "arckv-ha", 0.2, query_budget=40, seed=3)
    assert config.merge_rows >= 40  # merging on all budget rows here
    n = int(T * TAIL_FRACTION)  # the default's 512 tail rows, at most a quarter of the document
    assert config.scheduled("tail_rows") == 512 and n > 0
    tail = _tail_queries(model, tok, text, n)
    N = T + n
    budget_pos = reference_positions(T, G, config)
    rows_of = budget_pos.tolist() + [T + p - (T - n) for p in budget_pos.tolist() if p >= T - n]
    base = [g * N + r for g in range(G) for r in rows_of]
    Qs = [group_queries_by_kv_head(torch.cat([store.layer(i)[1], tail[i]], 1)[None], H).double() for i in range(3)]
    probs = [torch.softmax(Qs[i] @ K[i].double().transpose(1, 2) * layout.scaling, dim=-1) for i in range(3)]
    scores = torch.stack([p.pow(2).mean(dim=1).sqrt() for p in probs]).float()
    budgets = global_budgets(scores, 0.2, min_fraction=config.min_head_fraction)
    assert [layer.lengths.tolist() for layer in cache.compact_layers] == budgets.tolist()
    n_fit = n_alone = 0
    assert config.fit.scope == "merged"
    for i, layer in enumerate(cache.compact_layers):
        offset = 0
        for h in range(H):
            t = int(budgets[i, h])
            anchors = torch.sort(torch.sort(scores[i, h], descending=True, stable=True).indices[:t]).values
            witness = []
            for j in anchors.tolist():
                col = probs[i][h, :, j]
                best = max(range(G * N), key=lambda r: (float(col[r]), -(r % N), -(r // N)))
                witness.append(best)
            rows = base + sorted(set(witness) - set(base))
            n_fit = max(n_fit, len(rows))
            Qh, Qm = Qs[i][h:h + 1, rows].float(), Qs[i][h:h + 1, base].float()
            Kh, Vh = K[i][h:h + 1], V[i][h:h + 1]
            C_k, assign = merge_keys(Qm, Kh, anchors[None], None, layout.scaling, config.scheduled("lambda_m"))
            alone = torch.bincount(assign[0], minlength=t)[None] == 1  # fit.scope="merged"
            n_alone += int(alone.sum())
            beta, _ = fit_beta(Qh, Kh, C_k, layout.scaling, config=config.fit, fixed=alone)
            C_v = fit_values(Qh, Kh, Vh, C_k, beta, layout.scaling, config=config.fit, fixed=alone,
                             fixed_values=Vh[:, anchors])
            torch.testing.assert_close(layer.ck[offset:offset + t], C_k[0], atol=1e-5, rtol=0)
            # beta of a nearly singular mass system moves with rounding of its targets; what the fits
            # reproduce, the compact attention output on the fit rows, must agree
            got = compact_attention(Qh, layer.ck[None, offset:offset + t], layer.beta[None, offset:offset + t],
                                    layer.cv[None, offset:offset + t], layout.scaling)
            ref = compact_attention(Qh, C_k, beta.float(), C_v, layout.scaling)
            torch.testing.assert_close(got, ref, atol=2e-3, rtol=0)
            offset += t
    assert cache.report.reference_rows == n_fit
    assert n_alone > 0  # some anchors absorbed no other position and kept their own term


@pytest.mark.parametrize("as_file", [False, True])
def test_budget_weights_give_per_head_budgets(tiny_model, tiny_tokenizer, tmp_path, as_file):
    """t_lh = floor(a_lh |P| rho T), a = w / sum(w) (paper Eq. (per_head_budget)), by hand."""
    model = tiny_model("llama", num_layers=2)
    tok = tiny_tokenizer()
    w = torch.tensor([[1.0, 2.0], [3.0, 2.0]])
    weights = w
    if as_file:
        weights = tmp_path / "weights.pt"
        torch.save(w, weights)
    with torch.no_grad():
        cache = compact(model, tok, make_text(70, seed=6), "arckv-vi", 0.25, budgets=weights)
    # |P| = 4 layer-heads, rho T = 17.5: raw = w / 8 * 4 * 17.5 = [[8.75, 17.5], [26.25, 17.5]]
    assert [layer.lengths.tolist() for layer in cache.compact_layers] == [[8, 17], [26, 17]]
    assert cache.realised_ratio() == pytest.approx((8 + 17 + 26 + 17) / (4 * 70), abs=0)
    assert cache.compact_nbytes() == (8 + 17 + 26 + 17) * (2 * 16 * 4 + 4)
    with pytest.raises(ValueError, match="budget weights have shape"):
        compact(model, tok, make_text(70, seed=6), "arckv-vi", 0.25, budgets=torch.ones(3, 2))
    with pytest.raises(ValueError, match="budgets must be one of .*no such file"):
        CompactionConfig(method="arckv-vi", budgets=str(tmp_path / "missing.pt"))
    with pytest.raises(TypeError, match="budgets must be"):
        CompactionConfig(method="arckv-vi", budgets=[[1.0, 2.0]])


# ------------------------------------------------------------------------------ fidelity


@pytest.mark.model
def test_fidelity_default_model(default_model_fp32):
    """Held-out repeat queries: the compact cache (beta, C_v fitted) reproduces the layer attention
    outputs better than keeping the same anchors' original keys/values without beta (eviction).

    ``compact`` fits on a subset of the repeat positions (``query_budget``); the other positions
    are held out. Anchors are recovered by rerunning ``compact_layer`` on the same rows, which
    must reproduce the API's compact keys. Runs the press path (``already_prefilled``) on a cache
    prefilled here, to pay for one prefill only."""
    if not PG_ESSAYS.is_file():
        pytest.skip(f"{PG_ESSAYS} is missing")
    model, tok = default_model_fp32
    layout = describe_attention_layout(model)
    H, G = layout.num_kv_heads, layout.group_size
    framing = framing_for(tok)
    doc = tok.encode(PG_ESSAYS.read_text()[:4000], add_special_tokens=False)[:600]
    text = tok.decode(doc)
    ids = torch.tensor([framing.prefix_ids + tok.encode(text, add_special_tokens=False)])
    P, T = len(framing.prefix_ids), ids.shape[1] - len(framing.prefix_ids)
    config = CompactionConfig(method="am-ha", ratio=0.3, query_budget=G * 400)
    fit_pos = reference_positions(T, G, config)
    held = torch.tensor(sorted(set(range(T)) - set(fit_pos.tolist())))[::2]  # ~100 held-out positions
    layers = list(layout.full_attention_layers)[1::4]

    with torch.no_grad():
        dyn = DynamicCache(config=model.config)
        prefill(model, ids, dyn)
        K = {l: dyn.layers[l].keys[0, :, P:].clone() for l in layers}
        V = {l: dyn.layers[l].values[0, :, P:].clone() for l in layers}
        both, order = torch.sort(torch.cat([fit_pos, held]))  # positions must be increasing
        store = repeat_prefill(model, tok, dyn, ids[:, P:], framing.suffix_ids, layers, both)
        slot = torch.empty_like(order)
        slot[order] = torch.arange(order.numel())  # row of fit_pos / held in the store
        fit_rows, held_rows = slot[: fit_pos.numel()], slot[fit_pos.numel() :]
        t0 = time.perf_counter()
        cache = compact_prefilled(model, tok, dyn, ids, P, config, already_prefilled=True)  # the press path
        print(f"compact_prefilled: {time.perf_counter() - t0:.1f} s", cache.report.timings)
    assert cache.report.original_length == T

    t = math.floor(0.3 * T)
    errs_c, errs_e = [], []
    for l in layers:
        q = store.layer(l)[1]  # [Hq, n_fit + n_held, D]
        Q_fit = group_queries_by_kv_head(q[None, :, fit_rows], H)
        Q_held = group_queries_by_kv_head(q[None, :, held_rows], H)
        res = compact_layer(K[l], V[l], Q_fit, torch.full((H,), t), layout.scaling, LayerMethod("am-ha"))
        layer = cache.layers[l]
        assert layer.lengths.tolist() == [t] * H
        torch.testing.assert_close(layer.ck, res.C_k[res.valid], atol=1e-4, rtol=1e-4)
        ck, beta, cv = layer.padded()
        O = full_attention(Q_held, K[l], V[l], layout.scaling)
        O_c = compact_attention(Q_held, ck, beta.masked_fill(beta.isinf(), 0), cv, layout.scaling, res.valid)
        gather = lambda X: X.gather(1, res.anchors[..., None].expand(-1, -1, X.shape[-1]))  # noqa: E731
        O_e = compact_attention(Q_held, gather(K[l]), torch.zeros(H, t), gather(V[l]), layout.scaling, res.valid)
        errs_c.append(float((O_c - O).norm() / O.norm()))
        errs_e.append(float((O_e - O).norm() / O.norm()))
    print("held-out relative attention-output error, compact:", [f"{e:.4f}" for e in errs_c])
    print("held-out relative attention-output error, eviction:", [f"{e:.4f}" for e in errs_e])
    assert all(c < e for c, e in zip(errs_c, errs_e))
    assert sum(errs_c) < 0.8 * sum(errs_e)


# ----------------------------------------------------------------------------- bad input


def test_bad_input(tiny_model, tiny_tokenizer):
    model = tiny_model("llama", num_layers=2)
    tok = tiny_tokenizer()
    text = make_text(40)
    with pytest.raises(ValueError, match="empty"):
        compact(model, tok, "", "arckv-ha", 0.5)
    with pytest.raises(ValueError, match="empty"):
        compact(model, tok, " \n ", "arckv-ha", 0.5)
    with pytest.raises(ValueError, match="at least 16"):
        compact(model, tok, "short text", "arckv-ha", 0.5)
    for ratio in (0, 0.0, 1.5, -0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="ratio"):
            compact(model, tok, text, "arckv-ha", ratio)
    with pytest.raises(ValueError, match="unknown method 'omp'"):
        compact(model, tok, text, "omp", 0.5)
    # options checked before any forward (CompactionConfig), not after the repeat-prefill
    with pytest.raises(ValueError, match="lambda_m"):
        CompactionConfig(method="arckv-ha", lambda_m=2.0)
    with pytest.raises(ValueError, match="budgets"):
        CompactionConfig(method="arckv-ha", budgets="uniform")
    for retired in ("on_policy", "context_fraction", "min_length", "progress", "score_rows", "fit_scope", "allocation",
                    "budget_weights", "repeat_chunk", "indexer"):  # indexer: an argument of compact, not an option
        with pytest.raises(TypeError, match=retired):
            CompactionConfig(method="arckv-ha", **{retired: 1})
    with pytest.raises(ValueError, match="pooling"):
        CompactionConfig(method="arckv-ha", pooling="median")

    config = CompactionConfig(method="arckv-ha", ratio=0.5)
    ids = torch.randint(6, 100, (2, 40))
    with pytest.raises(ValueError, match=r"batch size 1 only.*\(2, 40\)"):
        compact_prefilled(model, tok, DynamicCache(config=model.config), ids, 3, config)
    for bad in (-1, 41):
        with pytest.raises(ValueError, match="prefix_len"):
            compact_prefilled(model, tok, DynamicCache(config=model.config), ids[:1], bad, config)
    with pytest.raises(TypeError, match="prefix_len"):
        compact_prefilled(model, tok, DynamicCache(config=model.config), ids[:1], 3.0, config)


def test_unsupported_model_gpt2(tiny_tokenizer):
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=256)).eval()
    with pytest.raises(ValueError, match="not supported") as err:
        compact(model, tiny_tokenizer(), make_text(40), "arckv-ha", 0.5)
    msg = str(err.value)
    assert "GPT2LMHeadModel" in msg and "rotary" in msg and "self_attn" in msg


def test_arckv_without_indexer(tiny_model, tiny_tokenizer):
    model = tiny_model("llama", num_layers=2)
    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match="indexer="):
        compact(model, tok, make_text(40), "arckv", 0.5)
    # the check comes before the (possibly long) prefill: the cache is left empty
    config = CompactionConfig(method="arckv", ratio=0.5)
    ids = torch.tensor([framing_for(tok).prefix_ids + tok.encode(make_text(40), add_special_tokens=False)])
    cache = DynamicCache(config=model.config)
    with pytest.raises(ValueError, match="indexer="):
        compact_prefilled(model, tok, cache, ids, 3, config)
    assert cache.get_seq_length() == 0


def test_fixed_budgets_take_the_checkpoints_weights_and_attention_matching_keeps_uniform(tiny_model, tiny_tokenizer,
                                                                                       tmp_path):
    """``budgets="fixed"`` with ``arckv``: Eq. (per_head_budget) with the checkpoint's a(l, h), by hand;
    ``arckv-ha`` (no checkpoint) takes uniform weights. Attention Matching ignores ``budgets``:
    given weights leave its uniform budgets as they are."""
    from arckv_press.indexer.checkpoint import save_indexer
    from arckv_press.indexer.model import IndexerConfig, ValueAwareIndexer
    from arckv_press.models import config_hash, model_id

    model, tok = tiny_model("llama", num_layers=2), tiny_tokenizer()
    text = make_text(70, seed=6)
    indexer = ValueAwareIndexer(IndexerConfig.from_model_config(model.config), seed=0)
    path = save_indexer(indexer, tmp_path / "ck", model_id(model), config_hash(model.config),
                        budget_weights=torch.tensor([[1.0, 2.0], [3.0, 2.0]]))
    with torch.inference_mode():
        fixed = compact(model, tok, text, "arckv", 0.25, indexer=path, budgets="fixed")
        uniform = compact(model, tok, text, "arckv-ha", 0.25, budgets="fixed")
        am = compact(model, tok, text, "am-omp-fast", 0.25, budgets=torch.tensor([[1.0, 2.0], [3.0, 2.0]]))
        am_default = compact(model, tok, text, "am-omp-fast", 0.25)
    # |P| = 4 layer-heads, rho T = 17.5: a = w / 8, raw = a * 4 * 17.5 = [[8.75, 17.5], [26.25, 17.5]]
    assert [layer.lengths.tolist() for layer in fixed.compact_layers] == [[8, 17], [26, 17]]
    assert [layer.lengths.tolist() for layer in uniform.compact_layers] == [[17, 17], [17, 17]]
    assert [layer.lengths.tolist() for layer in am.compact_layers] == [[17, 17], [17, 17]]
    for a, b in zip(am.compact_layers, am_default.compact_layers):  # bitwise, padding (NaN) included
        for x, y in ((a.keys, b.keys), (a.values, b.values), (a.beta, b.beta)):
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


def test_arckv_refuses_an_indexer_of_another_model(tiny_model, tiny_tokenizer, tmp_path):
    """Through ``compact``: a checkpoint trained for another model (metadata), or a loaded indexer of
    other sizes, is a clear error before any prefill; the matching checkpoint compacts."""
    from arckv_press.indexer.checkpoint import save_indexer
    from arckv_press.indexer.model import IndexerConfig, ValueAwareIndexer
    from arckv_press.models import config_hash, model_id

    model, other, tok = tiny_model("llama", num_layers=2), tiny_model("llama", num_layers=3), tiny_tokenizer()
    text = make_text(200, seed=1)
    theirs = ValueAwareIndexer(IndexerConfig.from_model_config(other.config), seed=0)
    path = save_indexer(theirs, tmp_path / "other", model_id(other), config_hash(other.config))
    with pytest.raises(ValueError, match="was trained for model"):
        compact(model, tok, text, "arckv", 0.5, indexer=path)
    with pytest.raises(ValueError, match="indexer was built for another model: num_layers=3"):
        compact(model, tok, text, "arckv", 0.5, indexer=theirs)
    with pytest.raises(TypeError, match="checkpoint path or a ValueAwareIndexer"):
        compact(model, tok, text, "arckv", 0.5, indexer=object())
    ours = ValueAwareIndexer(IndexerConfig.from_model_config(model.config), seed=0)
    path = save_indexer(ours, tmp_path / "ours", model_id(model), config_hash(model.config))
    with torch.inference_mode():
        from_path, from_object = compact(model, tok, text, "arckv", 0.5, indexer=path), compact(
            model, tok, text, "arckv", 0.5, indexer=ours)
    for a, b in zip(from_path.layers, from_object.layers):
        assert torch.equal(a.lengths, b.lengths) and torch.equal(a.ck, b.ck) and torch.equal(a.cv, b.cv)


def test_compact_builds_no_autograd_graph(tiny_model, tiny_tokenizer):
    """``compact`` called with autograd on (as a user would) must not keep graphs of the prefill,
    repeat-prefill and fits alive (that cost 16.9 GB for a 2K-token document on the default
    model): every tensor of the returned cache is a leaf without grad."""
    model = tiny_model("llama", num_layers=2)
    assert any(p.requires_grad for p in model.parameters())
    assert torch.is_grad_enabled()
    cache = compact(model, tiny_tokenizer(), make_text(60, seed=2), "arckv-ha", 0.25, query_budget=40)
    assert torch.is_grad_enabled()  # the caller's mode is restored
    for layer in cache.compact_layers:
        for x in (*layer.padded(), layer._new_k, layer._new_v, layer.beta):
            assert x.grad_fn is None and not x.requires_grad


def test_min_head_fraction_floors_global_budgets(tiny_model, tiny_tokenizer):
    """Global allocation with a floor: every head keeps floor(f * ratio * T) anchors, the total
    stays L * H * floor(ratio * T); f = 1 is the uniform allocation; f outside [0, 1] is refused."""
    model, tok = tiny_model("llama", num_layers=3), tiny_tokenizer()
    text = make_text(200, seed=11)
    with torch.no_grad():
        lengths = {f: torch.stack([layer.lengths for layer in compact(
            model, tok, text, "arckv-ha", 0.2, query_budget=40, min_head_fraction=f).compact_layers])
            for f in (0.0, 0.5, 1.0)}
    T = compact(model, tok, text, "arckv-ha", 1.0, query_budget=40).compact_layers[0].span
    per_head = math.floor(0.2 * T)
    for f, got in lengths.items():
        assert int(got.sum()) == got.numel() * per_head
        assert int(got.min()) >= max(1, math.floor(f * per_head))
    assert int(lengths[0.0].min()) < math.floor(0.5 * per_head)  # the floor really binds here
    assert torch.equal(lengths[1.0], torch.full_like(lengths[1.0], per_head))
    with pytest.raises(ValueError, match="min_head_fraction must be in"):
        compact(model, tok, text, "arckv-ha", 0.2, min_head_fraction=1.5)


@pytest.mark.parametrize("bad", [dict(merge_rows=0), dict(merge_rows=2.5), dict(indexer_rows=0), dict(indexer_rows="some"),
                                 dict(indexer_rows=True), dict(indexer_rows="corrected")])
def test_fused_pipeline_options_are_validated(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        CompactionConfig(method="arckv-ha", **bad)
    with pytest.raises(ValueError, match="gram_dtype"):
        FitConfig(gram_dtype="float16")
    with pytest.raises(ValueError, match="scope"):
        FitConfig(scope="some")
    with pytest.raises(TypeError, match="witnesses"):
        FitConfig(witnesses=1)
    assert CompactionConfig(method="arckv-ha", fit={"scope": "all", "witnesses": False}).fit == FitConfig(scope="all",
                                                                                                       witnesses=False)


def test_config_id_covers_the_options_that_shape_a_result():
    """``config_id`` changes with every option that changes a compaction's result and with nothing
    else: not the kept fraction, and for Attention Matching not the ARC-KV-only
    options it ignores. Budget weights count by content. ``method_config_id`` is the press's id."""
    from arckv_press.config import config_id
    from arckv_press.compaction.fit import FitConfig
    from arckv_press.registry import method_config_id

    def cid(**kw):
        return config_id(CompactionConfig(**kw))

    base = cid(method="arckv-ha")
    assert base == cid(method="arckv-ha", ratio=0.3) and len(base) == 12
    # keep 5%: the same but for the tail rows (none below keep 10%)
    assert cid(method="arckv-ha", ratio=0.05) == cid(method="arckv-ha", tail_rows=0) != base
    # the kept fraction counts only through the schedule: the id is that of the lambda_m / anchor search used
    assert base == cid(method="arckv-ha", lambda_m=0.25) == cid(method="arckv-ha", ratio=0.3, lambda_m=0.25)
    assert base == cid(method="arckv-ha", anchor_search="scores", tail_rows=512) == cid(
        method="arckv-ha", ratio=0.01, anchor_search="scores", tail_rows=512)
    low = cid(method="arckv-ha", ratio=0.02)
    assert low == cid(method="arckv-ha", ratio=0.01) == cid(method="arckv-ha", anchor_search="omp", tail_rows=0) != base
    assert cid(method="arckv-ha", ratio=0.01, anchor_search="scores") not in (base, low)  # the low step's tail_rows
    assert cid(method="arckv-ha", ratio=0.01, lambda_m=1.0) == cid(method="arckv-ha", lambda_m=1.0, anchor_search="omp",
                                                                   tail_rows=0) != low
    for change in (dict(min_head_fraction=0.25), dict(lambda_m=0.0), dict(fit={"witnesses": False}), dict(seed=1),
                   dict(query_budget=512), dict(budgets="fixed"), dict(fit=FitConfig(ridge_v=0.5)),
                   dict(budgets=torch.ones(3, 2)), dict(merge_rows=None), dict(tail_rows=0),
                   dict(fit=FitConfig(gram_dtype="float64")), dict(fit={"scope": "all"})):
        assert cid(method="arckv-ha", **change) != base, change
    assert cid(method="arckv-vi") != base
    # indexer_rows shapes only the learned indexer's results
    assert cid(method="arckv-ha", indexer_rows="budget") == base
    assert cid(method="arckv", indexer_rows="budget") != cid(method="arckv")
    assert cid(method="arckv", indexer_rows=512) == cid(method="arckv") != cid(method="arckv", indexer_rows=256)
    assert cid(method="arckv", indexer_rows="all") != cid(method="arckv")
    assert cid(method="arckv-ha", budgets=torch.ones(3, 2)) == cid(method="arckv-ha", budgets=torch.ones(3, 2))
    assert cid(method="arckv-ha", budgets=torch.ones(3, 2)) != cid(method="arckv-ha", budgets=2 * torch.ones(3, 2))
    am = cid(method="am-omp")
    assert am == cid(method="am-omp", min_head_fraction=0.25, lambda_m=0.0, budgets="fixed", merge_rows=7,
                     tail_rows=0, fit=FitConfig(gram_dtype="float64", witnesses=False, scope="all"))
    # the id of the AM defaults, as the stored AM results carry it (relabelled once when allocation and
    # budget_weights became budgets: leaderboards/archive/config_ids_2026-12-07.csv)
    assert am == "e51ef7866907" and cid(method="am-omp-fast") == "d86ee4e2095b"
    assert am != cid(method="am-omp", query_budget=512) and am != cid(method="am-omp-fast")
    assert method_config_id("arckv-ha", 0.1) == base
    assert method_config_id("arckv-ha", 0.02) == cid(method="arckv-ha", ratio=0.02)
    assert method_config_id("arckv-ha", 0.1, min_head_fraction=0.25) == cid(method="arckv-ha", min_head_fraction=0.25)
    assert method_config_id("arckv-ha", 0.1, config_options={"pooling": "max"}) == cid(method="arckv-ha", pooling="max")
    with pytest.raises(ValueError, match="pass them as press arguments"):  # a press field, not config_options
        method_config_id("arckv-ha", 0.1, config_options={"min_head_fraction": 0.25})
    assert method_config_id("snapkv", 0.1) == method_config_id("none", 1.0) == ""


def test_fit_options_as_a_dict():
    """``fit`` also takes a dict of FitConfig fields (what ``--option "fit={...}"`` and JSON configs give):
    the same config, the same id; an unknown key or another type is refused by name."""
    from arckv_press.config import config_id
    from arckv_press.compaction.fit import FitConfig

    as_dict = CompactionConfig(method="arckv-ha", fit={"b_min": 0.0, "mass_solver": "nnls"})
    as_config = CompactionConfig(method="arckv-ha", fit=FitConfig(b_min=0.0, mass_solver="nnls"))
    assert as_dict.fit == as_config.fit and isinstance(as_dict.fit, FitConfig)
    assert config_id(as_dict) == config_id(as_config) != config_id(CompactionConfig(method="arckv-ha"))
    assert CompactionConfig(method="arckv-ha", fit={}).fit == FitConfig()
    with pytest.raises(ValueError, match=r"no option\(s\) \['bmin'\]"):
        CompactionConfig(method="arckv-ha", fit={"bmin": 0.0})
    with pytest.raises(ValueError, match="gram_dtype"):  # FitConfig's own validation still applies
        CompactionConfig(method="arckv-ha", fit={"gram_dtype": "float16"})
    with pytest.raises(TypeError, match="fit must be a FitConfig or a dict"):
        CompactionConfig(method="arckv-ha", fit=0.5)


def test_ratio_schedule_gives_the_defaults_and_explicit_options_win():
    """``lambda_m=None`` / ``anchor_search=None`` (defaults) take RATIO_SCHEDULE's step at the kept
    fraction: the step boundaries are inclusive, every kept fraction in (0, 1] is covered, and the
    layer method and the press both see the scheduled values; given options override them."""
    from arckv_press.config import RATIO_SCHEDULE, SCHEDULED, RatioDefaults, ratio_defaults
    from arckv_press.presses import ARCKVPress

    assert set(SCHEDULED) == {f.name for f in dataclasses.fields(RatioDefaults)} - {"lowest"}  # one list of them
    lowest = [step.lowest for step in RATIO_SCHEDULE]
    assert lowest == sorted(lowest, reverse=True) and lowest[-1] == 0.0  # every kept fraction is covered
    for ratio, search in ((1.0, "scores"), (0.1, "scores"), (0.05, "scores"), (0.0499, "omp"), (0.02, "omp"),
                          (0.01, "omp"), (1e-6, "omp")):
        assert ratio_defaults(ratio).anchor_search == search and ratio_defaults(ratio).lambda_m == 0.25, ratio
        assert ratio_defaults(ratio).tail_rows == CompactionConfig(ratio=ratio).scheduled("tail_rows") == (
            512 if ratio >= 0.1 else 0), ratio
        config = CompactionConfig(method="arckv-ha", ratio=ratio)
        assert config.scheduled("lambda_m") == config.layer_method().lambda_m == 0.25
        assert config.scheduled("anchor_search") == config.layer_method().anchor_search == search
        press = ARCKVPress(ratio=ratio, selector="ha").compaction_config().layer_method()
        assert (press.lambda_m, press.anchor_search) == (0.25, search)
        given = CompactionConfig(method="arckv-ha", ratio=ratio, lambda_m=0.6, anchor_search="omp-fast").layer_method()
        assert (given.lambda_m, given.anchor_search) == (0.6, "omp-fast")
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="ratio"):
            ratio_defaults(bad)


def test_a_models_own_schedule_resolves_its_defaults_and_keeps_given_options():
    """``for_model``: Gemma 3's schedule takes OMP's anchors at every kept fraction, the default
    model's and any other model's keep the default schedule; given options are kept, and the resolved
    config's id is that of the same options given explicitly (so the default model's ids do not move)."""
    from arckv_press.config import RATIO_SCHEDULE, config_id, ratio_defaults, ratio_schedule
    from arckv_press.models import DEFAULT_MODEL_ID, GEMMA3_MODEL_ID

    assert ratio_schedule(None) == ratio_schedule(DEFAULT_MODEL_ID) == ratio_schedule("other/model") == RATIO_SCHEDULE
    assert ratio_schedule(GEMMA3_MODEL_ID)[-1].lowest == 0.0  # every kept fraction is covered
    for ratio in (1.0, 0.1, 0.05, 0.0499, 0.02):
        base = CompactionConfig(method="arckv-ha", ratio=ratio)
        gemma = base.for_model(GEMMA3_MODEL_ID)
        step = ratio_defaults(ratio, GEMMA3_MODEL_ID)
        assert (gemma.lambda_m, gemma.anchor_search) == (0.25, "omp") == (step.lambda_m, step.anchor_search)
        assert gemma.tail_rows == step.tail_rows == 0
        assert config_id(gemma) == config_id(CompactionConfig(method="arckv-ha", ratio=ratio, anchor_search="omp",
                                                              tail_rows=0))
        mine = base.for_model(DEFAULT_MODEL_ID)
        assert config_id(mine) == config_id(base) and mine.fit == base.fit
        assert (mine.lambda_m, mine.anchor_search) == (0.25, ratio_defaults(ratio).anchor_search)
        assert mine.tail_rows == ratio_defaults(ratio).tail_rows == (512 if ratio >= 0.1 else 0)
    given = CompactionConfig(method="arckv-ha", ratio=0.1, lambda_m=0.5, anchor_search="scores").for_model(GEMMA3_MODEL_ID)
    assert (given.lambda_m, given.anchor_search) == (0.5, "scores")


def test_a_methods_own_schedule_wins_over_the_models_and_given_options_win_over_it():
    """``METHOD_SCHEDULES``: ``arckv-vi`` takes its own tail rows at every kept fraction and on every
    model, the other methods the schedule's; its id is that of the same value given explicitly, and a
    value given by the user still wins."""
    from arckv_press.config import METHOD_SCHEDULES, SCHEDULED, config_id
    from arckv_press.models import DEFAULT_MODEL_ID, GEMMA3_MODEL_ID

    assert set(METHOD_SCHEDULES["arckv-vi"]) <= set(SCHEDULED)
    own = METHOD_SCHEDULES["arckv-vi"]["tail_rows"]
    for ratio in (1.0, 0.2, 0.1, 0.05, 0.02):
        for model in (None, DEFAULT_MODEL_ID, GEMMA3_MODEL_ID):
            vi = CompactionConfig(method="arckv-vi", ratio=ratio)
            assert vi.scheduled("tail_rows", model) == vi.for_model(model).tail_rows == own
            ha = CompactionConfig(method="arckv-ha", ratio=ratio)
            assert ha.for_model(model).tail_rows == (512 if ratio >= 0.1 and model != GEMMA3_MODEL_ID else 0)
        assert config_id(CompactionConfig(method="arckv-vi", ratio=ratio)) == config_id(
            CompactionConfig(method="arckv-vi", ratio=ratio, tail_rows=own))
        assert CompactionConfig(method="arckv-vi", ratio=ratio, tail_rows=300).scheduled("tail_rows") == 300
    assert config_id(CompactionConfig(method="arckv-vi", ratio=0.1)) != config_id(
        CompactionConfig(method="arckv-vi", ratio=0.1, tail_rows=512))


def test_compaction_runs_its_models_schedule(tiny_model, tiny_tokenizer, monkeypatch):
    """``compact`` resolves the config for the model it compacts: a model given Gemma 3's id compacts
    exactly as the same model with Gemma 3's anchor search given by hand, and unlike the default
    schedule."""
    from arckv_press.models import GEMMA3_MODEL_ID, MODEL_ID_ATTR

    model, tok = tiny_model("llama", num_layers=2), tiny_tokenizer()
    text = make_text(70, seed=2)
    with torch.no_grad():
        default = compact(model, tok, text, "arckv-ha", 0.25, query_budget=64)
        explicit = compact(model, tok, text, "arckv-ha", 0.25, query_budget=64, anchor_search="omp", tail_rows=0)
        monkeypatch.setattr(model.config, MODEL_ID_ATTR, GEMMA3_MODEL_ID, raising=False)
        scheduled = compact(model, tok, text, "arckv-ha", 0.25, query_budget=64)
    ids = [c.metadata.extra["config_id"] for c in (scheduled, explicit, default)]
    assert ids[0] == ids[1] != ids[2]
    for a, b in zip(layer_tensors(scheduled), layer_tensors(explicit)):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    assert any(not torch.equal(x, y) for a, b in zip(layer_tensors(scheduled), layer_tensors(default))
               for x, y in zip(a[:3], b[:3]))


@pytest.mark.parametrize("base", ["ha", "vi"])
def test_residual_indexer_at_initialisation_compacts_like_its_training_free_base(tiny_model, tiny_tokenizer, base):
    """End to end: method ``arckv`` with a residual indexer at its initialisation (zero head
    weights) selects exactly the anchors of ``arckv-ha`` / ``arckv-vi``, so the whole compact
    cache (keys, beta, values, per-head lengths) is the same: the learned indexer plugs into
    the same selection, merge and fits as the training-free selectors. The tail rows are given
    (``arckv-vi``'s own schedule has none, ``arckv``'s has them), so both read the same rows."""
    from arckv_press.indexer.model import IndexerConfig, ValueAwareIndexer

    model, tok = tiny_model("llama", num_layers=2), tiny_tokenizer()
    cfg = IndexerConfig.from_model_config(model.config, base_logit_scale=describe_attention_layout(model).scaling,
                                          base_value_influence=base == "vi", init_std_x=0.0, init_bias_x=0.0)
    indexer = ValueAwareIndexer(cfg, seed=3)
    text = make_text(400, seed=2)
    with torch.inference_mode():
        learned = compact(model, tok, text, "arckv", 0.25, indexer=indexer, tail_rows=512)
        free = compact(model, tok, text, f"arckv-{base}", 0.25, tail_rows=512)
    for a, b in zip(learned.layers, free.layers):
        assert torch.equal(a.lengths, b.lengths)
        for name in ("ck", "beta", "cv"):
            torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=1e-5, atol=1e-6)


def test_indexer_on_budget_rows_equals_all_rows_when_the_budget_covers_every_position(tiny_model, tiny_tokenizer):
    """``indexer_rows="budget"`` scores the budget rows only; when the budget holds every position
    the two settings score the same rows and give the same cache, and with a smaller budget the
    anchors come from fewer rows (different lengths or keys somewhere)."""
    from arckv_press.indexer.model import IndexerConfig, ValueAwareIndexer

    model, tok = tiny_model("llama", num_layers=2), tiny_tokenizer()
    cfg = IndexerConfig.from_model_config(model.config, base_logit_scale=describe_attention_layout(model).scaling)
    indexer = ValueAwareIndexer(cfg, seed=5)
    text = make_text(400, seed=3)
    with torch.inference_mode():
        every = compact(model, tok, text, "arckv", 0.25, indexer=indexer, query_budget=100_000, indexer_rows="all")
        budget = compact(model, tok, text, "arckv", 0.25, indexer=indexer, query_budget=100_000, indexer_rows="budget")
        few = compact(model, tok, text, "arckv", 0.25, indexer=indexer, query_budget=24, indexer_rows="budget")
        few_all = compact(model, tok, text, "arckv", 0.25, indexer=indexer, query_budget=24, indexer_rows="all")
    for a, b in zip(every.layers, budget.layers):
        assert torch.equal(a.lengths, b.lengths)
        for name in ("ck", "beta", "cv"):
            torch.testing.assert_close(getattr(a, name), getattr(b, name))
    assert any(not torch.equal(a.lengths, b.lengths) or a.ck.shape != b.ck.shape or not torch.equal(a.ck, b.ck)
               for a, b in zip(few.layers, few_all.layers))


def test_corrected_indexer_rows_estimate_all_rows_from_the_budget_rows(tiny_model, tiny_tokenizer, monkeypatch):
    """``indexer_rows`` a row count (corrected scores): when the budget holds every position the estimate is
    the all-row score and the cache is the one of ``"all"``; with a small budget each layer's scores
    are ``corrected_scores`` of the pass's HA scores over every row and the indexer's learned and base
    scores on that many of the budget rows (recomputed here independently), for the residual and
    the paper's form (HA at the model's scale); max pooling and a residual base at another scale than
    the model's are refused."""
    import arckv_press.api as api_mod
    from arckv_press.capture import TAIL_FRACTION
    from arckv_press.compaction.select import corrected_scores, ha_scores
    from arckv_press.indexer.model import IndexerConfig, ValueAwareIndexer

    model, tok = tiny_model("llama", num_layers=2), tiny_tokenizer()
    scaling = describe_attention_layout(model).scaling
    indexer = ValueAwareIndexer(IndexerConfig.from_model_config(model.config, base_logit_scale=scaling), seed=5)
    text = make_text(400, seed=3)
    with torch.inference_mode():
        every = compact(model, tok, text, "arckv", 0.25, indexer=indexer, query_budget=100_000, indexer_rows="all")
        corrected = compact(model, tok, text, "arckv", 0.25, indexer=indexer, query_budget=100_000,
                            indexer_rows=100_000)
    for a, b in zip(every.layers, corrected.layers):
        assert torch.equal(a.lengths, b.lengths)
        for name in ("ck", "beta", "cv"):
            torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=1e-4, atol=1e-5)

    seen = []
    real = api_mod.corrected_scores
    monkeypatch.setattr(api_mod, "corrected_scores", lambda *a: seen.append((a, real(*a))) or seen[-1][1])
    captured = {}
    real_scores = ValueAwareIndexer.scores

    def spy(self, layer, X, Q, K, V, **kw):
        captured[layer] = (X, Q, K, V)
        return real_scores(self, layer, X, Q, K, V, **kw)

    monkeypatch.setattr(ValueAwareIndexer, "scores", spy)
    G = describe_attention_layout(model).group_size
    paper = ValueAwareIndexer(IndexerConfig.from_model_config(model.config), seed=5)
    for form in (indexer, paper):
        seen.clear()
        captured.clear()
        with torch.inference_mode():
            compact(model, tok, text, "arckv", 0.25, indexer=form, query_budget=48, indexer_rows=24)
        assert len(seen) == 2 and sorted(captured) == [0, 1]
        for layer, ((full_base, sample, sample_base, pooling, shrink, fraction), out) in enumerate(seen):
            X, Q, K, V = captured[layer]
            assert Q.shape[1] == 24 // G * G and pooling == "rms"  # indexer_rows of the 48 budget rows
            T = K.shape[1]  # of every captured row: the copy's and the tail repeat's (a quarter of the document)
            assert shrink == 0.1 and fraction == Q.shape[1] / (G * (T + int(T * TAIL_FRACTION)))
            torch.testing.assert_close(sample_base, ha_scores(Q, K, scaling), rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(sample, real_scores(form, layer, X, Q, K, V), rtol=1e-5, atol=1e-7)
            assert full_base.shape == sample.shape and not torch.allclose(full_base, sample_base)
            torch.testing.assert_close(out, corrected_scores(full_base, sample, sample_base, "rms", 0.1, fraction))
    monkeypatch.undo()

    with pytest.raises(ValueError, match="pooling 'rms' or 'mean'"):
        CompactionConfig(method="arckv", ratio=0.25, pooling="max")
    off = ValueAwareIndexer(IndexerConfig.from_model_config(model.config, base_logit_scale=scaling * 2), seed=5)
    with torch.inference_mode(), pytest.raises(ValueError, match="not the model's softmax scale"):
        compact(model, tok, text, "arckv", 0.25, indexer=off)


def test_omp_anchor_search_takes_the_am_search_on_the_budget_rows(tiny_model, tiny_tokenizer, monkeypatch):
    """``anchor_search="omp-fast"``: each layer's anchors are Attention Matching's OMP-fast choice on
    that layer's budget rows (all query heads of the budget positions' copy and tail rows) with the
    allocated budgets,
    then merged and fitted as usual; the default (top-t of the scores) gives another cache, and the
    option has its own config id while the default's id is unchanged."""
    import arckv_press.compaction.layer as layer_mod
    from arckv_press.config import config_id
    from arckv_press.compaction.omp import AM_OMP_FAST

    model, tok, text, layout, T, K, V, store = _three_layer_reference(tiny_model, tiny_tokenizer)
    G = layout.group_size
    calls, real = [], layer_mod.omp_select

    def spy(Q, K_, budgets, scaling, config, row_max=None):
        assert row_max is None                       # one chunk: the whole document's own maxima
        out = real(Q, K_, budgets, scaling, config, row_max)
        calls.append((Q.shape[1], budgets.clone(), out[1], config))
        return out

    monkeypatch.setattr(layer_mod, "omp_select", spy)
    with torch.no_grad():
        cache = compact(model, tok, text, "arckv-ha", 0.2, query_budget=40, seed=3, anchor_search="omp-fast")
        default = compact(model, tok, text, "arckv-ha", 0.2, query_budget=40, seed=3)
    config = CompactionConfig(method="arckv-ha", ratio=0.2, query_budget=40, seed=3)
    budget_pos = reference_positions(T, G, config)
    assert len(calls) == 3
    from arckv_press.capture import TAIL_FRACTION

    in_tail = int((budget_pos >= T - int(T * TAIL_FRACTION)).sum())  # their tail rows are budget rows too
    for (n_rows, budgets, valid, cfg), layer in zip(calls, cache.compact_layers):
        assert n_rows == G * (budget_pos.numel() + in_tail) and cfg is AM_OMP_FAST
        assert layer.lengths.tolist() == valid.sum(-1).tolist() == budgets.tolist()
    assert any(not torch.equal(a.ck, b.ck) for a, b in zip(cache.compact_layers, default.compact_layers))
    assert config_id(config) == config_id(CompactionConfig(method="arckv-ha", ratio=0.2, query_budget=40, seed=3,
                                                           anchor_search="scores"))
    assert config_id(CompactionConfig(method="arckv-ha", anchor_search="omp-fast")) != config_id(CompactionConfig(method="arckv-ha"))
    with pytest.raises(ValueError, match="anchor_search"):
        CompactionConfig(method="arckv-ha", anchor_search="lasso")


def test_default_below_keep_5_percent_is_the_omp_search(tiny_model, tiny_tokenizer, monkeypatch):
    """The schedule's anchor search: below keep 5% the default compaction runs OMP on every layer and
    builds exactly the cache of ``anchor_search="omp"`` given explicitly; at keep 5% it runs none."""
    import arckv_press.compaction.layer as layer_mod

    model, tok, text, *_ = _three_layer_reference(tiny_model, tiny_tokenizer)
    calls, real = [], layer_mod.omp_select
    monkeypatch.setattr(layer_mod, "omp_select", lambda *a: calls.append(a[4]) or real(*a))
    with torch.no_grad():
        default = compact(model, tok, text, "arckv-ha", 0.04, query_budget=40, seed=3)
        assert calls == [layer_mod.AM_OMP] * 3
        given = compact(model, tok, text, "arckv-ha", 0.04, query_budget=40, seed=3, anchor_search="omp")
        calls.clear()
        compact(model, tok, text, "arckv-ha", 0.05, query_budget=40, seed=3)
    assert calls == []
    for a, b in zip(default.compact_layers, given.compact_layers):
        assert torch.equal(a.ck, b.ck) and torch.equal(a.beta, b.beta) and torch.equal(a.cv, b.cv)
