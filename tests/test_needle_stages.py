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


def test_stage_options_override_the_runs_and_merge_fit_fields():
    from arckv_press.bench.needle_stages import STAGES, stage_options
    from arckv_press.compaction.fit import FitConfig

    evict = dict(STAGES)["evict"]
    got = stage_options({"tail_rows": 0, "lambda_m": 0.5, "fit": {"b_min": 0.0, "ridge_v": 0.1}}, evict)
    assert got == {"tail_rows": 0, "lambda_m": 0.0, "fit": {"b_min": -1e-6, "ridge_v": 0.1, "values": "anchor",
                                                               "b_max": 0.0}}
    assert stage_options({"fit": FitConfig(ridge_v=0.5)}, evict)["fit"]["ridge_v"] == 0.5
    assert stage_options({"tail_rows": 0}, dict(STAGES)["+merge"]) == {"tail_rows": 0}
    assert [name for name, _ in STAGES] == ["evict", "+mass", "+values", "+merge"]


def test_kept_positions_are_the_anchors_whose_keys_and_values_an_eviction_keeps(tiny_model, tiny_tokenizer):
    """Under the eviction stage each head's packed entries are the full cache's keys and values at
    ``kept_positions`` with beta 0; every stage keeps the same positions; needle_kept counts them
    as a brute-force membership test does."""
    from transformers import DynamicCache

    from arckv_press.api import compact
    from arckv_press.bench.needle_stages import STAGES, needle_kept, stage_options
    from arckv_press.capture import encode_document, prefill

    model, tok = tiny_model("llama", num_layers=2), tiny_tokenizer()
    text = "filler words go here and there, " * 8 + "the access code is 4711. " + "and a last line."
    ids, P = encode_document(tok, text)
    with torch.inference_mode():
        full = prefill(model, ids, DynamicCache(config=model.config))
        caches = {name: compact(model, tok, text, "arckv-ha", 0.25, **stage_options({}, stage)) for name, stage in STAGES}
    evict = caches["evict"]
    assert set(evict.kept_positions) == {0, 1}
    for i, pos in evict.kept_positions.items():
        layer = evict.layers[i]
        K, V = full.layers[i].keys[0, :, P:], full.layers[i].values[0, :, P:]
        start = 0
        for h in range(K.shape[0]):
            n = int(layer.lengths[h])
            keep = pos[h][pos[h] >= 0]
            assert keep.numel() == n and len(set(keep.tolist())) == n
            torch.testing.assert_close(layer.ck[start:start + n], K[h, keep])
            torch.testing.assert_close(layer.cv[start:start + n], V[h, keep])
            assert layer.beta[start:start + n].abs().max() <= 1e-6
            start += n
        for cache in caches.values():
            assert torch.equal(cache.kept_positions[i], pos)
    needle = list(range(len(ids[0]) - P - 30, len(ids[0]) - P - 24))  # near the end of the document
    counts = needle_kept(evict.kept_positions, needle)
    for i, pos in evict.kept_positions.items():
        assert counts[i] == [sum(p in set(row.tolist()) for p in needle) for row in pos]


def test_stage_ladder_writes_one_row_per_stage_and_resumes(tiny_model, tmp_path, capsys):
    """``--stages`` on a tiny model with a fact planted at depth 90%: the full cache and the four
    stages per case, written once; a rerun skips every case already in the CSV."""
    import json

    from conftest import build_tiny_tokenizer, make_text

    from arckv_press.bench import needle_stages
    from arckv_press.runinfo import read_rows

    model = tiny_model("llama", num_layers=2, seed=0)
    model.config.eos_token_id = 2
    model.save_pretrained(tmp_path / "model")
    build_tiny_tokenizer().save_pretrained(tmp_path / "model")
    articles = tmp_path / "articles.jsonl"
    articles.write_text("".join(json.dumps({"input": make_text(2500, seed=s)}) + "\n" for s in range(2)),
                        encoding="utf-8")
    out = tmp_path / "stages.csv"
    argv = ["--stages", "--model", str(tmp_path / "model"), "--articles", str(articles), "--length", "300",
            "--seeds", "0", "1", "--depths", "0.9", "--ratio", "0.25", "--out", str(out), "--threads", "1"]
    assert needle_stages.main(argv) == 0
    rows = read_rows(out)
    assert [(r["seed"], r["stage"]) for r in rows] == [(s, st) for s in ("0", "1")
                                                       for st in ("full", "evict", "+mass", "+values", "+merge")]
    for r in rows:
        assert r["correct"] == str(int(r["value"] in r["answer"])) and r["depth"] == "0.9"
        if r["stage"] != "full":
            assert int(r["heads_all_kept"]) + int(r["heads_none_kept"]) <= int(r["heads"]) == 2 * 2
    assert len({r["config_id"] for r in rows if r["stage"] != "full"}) == 4
    capsys.readouterr()
    assert needle_stages.main(argv) == 0
    assert "(done)" in capsys.readouterr().out and len(read_rows(out)) == len(rows)
    # --only +merge: the full cache and the method as configured, the same rows as in the whole ladder
    only = tmp_path / "only.csv"
    assert needle_stages.main([*argv[:-4], "--out", str(only), "--only", "+merge", "--threads", "1"]) == 0
    keep = ("seed", "stage", "config_id", "answer", "correct", "heads_all_kept", "heads_none_kept")
    assert [{k: r[k] for k in keep} for r in read_rows(only)] == [
        {k: r[k] for k in keep} for r in rows if r["stage"] in ("full", "+merge")]


def test_oracle_scores_and_ranks_against_brute_force():
    """Each key's largest softmax probability over the grouped query heads' rows, computed one query
    at a time; ranks from a Python sort (ties: the lower position first)."""
    from arckv_press.bench.needle_stages import oracle_scores, score_ranks

    g = torch.Generator().manual_seed(3)
    H, G, n, N, D = 2, 3, 4, 17, 8
    Q, K = torch.randn(H * G, n, D, generator=g), torch.randn(H, N, D, generator=g)
    got = oracle_scores(Q, K, 0.7)
    assert got.shape == (H, N)
    for h in range(H):
        want = [max(float(torch.softmax(0.7 * (Q[hq, r] @ K[h].T), -1)[j]) for hq in range(h * G, h * G + G)
                    for r in range(n)) for j in range(N)]
        torch.testing.assert_close(got[h], torch.tensor(want), atol=1e-6, rtol=1e-5)
    scores = torch.tensor([[0.5, 0.9, 0.5, 0.1], [0.0, 0.0, 1.0, 0.0]])
    brute = [[sorted(range(4), key=lambda j: (-float(row[j]), j)).index(p) for p in (0, 2, 3)] for row in scores]
    assert score_ranks(scores, [0, 2, 3]) == brute == [[1, 2, 3], [1, 0, 3]]
    import pytest
    with pytest.raises(ValueError, match="do not group"):
        oracle_scores(torch.randn(3, 1, D), K, 1.0)


def test_copy_queries_are_the_queries_of_one_forward_of_the_repeat_input(tiny_model, tiny_tokenizer):
    """The copy's queries equal those a plain forward of context + repeat instruction + document
    gives at the document's rows, and the cache holds the context alone afterwards."""
    from transformers import DynamicCache

    from arckv_press.bench.needle_stages import copy_queries
    from arckv_press.capture import (CapturedQueries, QueryCapture, encode_document, framing_for, prefill,
                                     repeat_span)

    model, tok = tiny_model("llama", num_layers=2), tiny_tokenizer()
    ids, P = encode_document(tok, "the access code for the north gate is 4711 and some filler " * 5)
    doc = ids[:, P:]
    with torch.inference_mode():
        full = prefill(model, ids, DynamicCache(config=model.config))
        got = copy_queries(model, tok, full, doc, [0, 1])
        assert full.get_seq_length() == ids.shape[1]
        _, n, rep = repeat_span(tok, doc, framing_for(tok).suffix_ids, 0, doc.shape[1])
        store = CapturedQueries()
        with QueryCapture(model, [0, 1], store) as cap:
            end = ids.shape[1] + rep.shape[1]
            cap.rows = torch.arange(end - n, end)  # rows of this forward's input
            model.model(input_ids=torch.cat([ids, rep], 1))
    for i in (0, 1):
        assert got[i].shape == (model.config.num_attention_heads, doc.shape[1], got[i].shape[-1])
        torch.testing.assert_close(got[i], store.layer(i)[1], atol=1e-5, rtol=1e-4)


def test_scores_of_the_pass_reports_and_replaces_the_scores_selection_reads(tiny_model, tiny_tokenizer):
    """Without a replacement the compact cache is the one of a plain run and ``seen`` holds the
    pass's scores, whose top-t are the kept positions; with one, each head keeps the top-t of the
    replacement (a brute-force sort), every stage after selection unchanged."""
    import pytest

    from arckv_press.api import compact
    from arckv_press.bench.needle_stages import STAGES, scores_of_the_pass, stage_options

    model, tok = tiny_model("llama", num_layers=2), tiny_tokenizer()
    text = "filler words go here and there, " * 8 + "the access code is 4711. " + "and a last line."
    evict = stage_options({"anchor_search": "scores"}, dict(STAGES)["evict"])
    with torch.inference_mode():
        plain = compact(model, tok, text, "arckv-ha", 0.25, **evict)
        seen = {}
        with scores_of_the_pass(None, seen):
            same = compact(model, tok, text, "arckv-ha", 0.25, **evict)
        T = plain.metadata.extra["report"]["original_length"]
        ramp = {i: torch.arange(T, dtype=torch.float32).flip(0).repeat(s.shape[0], 1) * (1 + h)
                for h, (i, s) in enumerate(seen.items())}  # the first positions highest
        with scores_of_the_pass(ramp):
            moved = compact(model, tok, text, "arckv-ha", 0.25, **evict)
        with pytest.raises(ValueError, match="scores of shape"):
            with scores_of_the_pass({i: s[:, :-1] for i, s in ramp.items()}):
                compact(model, tok, text, "arckv-ha", 0.25, **evict)
    assert set(seen) == set(plain.kept_positions) == {0, 1}
    for i, pos in plain.kept_positions.items():
        assert torch.equal(same.kept_positions[i], pos)
        torch.testing.assert_close(same.layers[i].ck, plain.layers[i].ck, atol=0, rtol=0)
        for h, row in enumerate(pos):
            keep = sorted(row[row >= 0].tolist())
            order = sorted(range(T), key=lambda j: (-float(seen[i][h, j]), j))
            assert sorted(order[:len(keep)]) == keep
        for h, row in enumerate(moved.kept_positions[i]):
            keep = sorted(row[row >= 0].tolist())
            assert keep == list(range(len(keep)))  # the ramp's top-t: the first positions


def test_oracle_ladder_rows_sit_beside_the_methods_and_resume(tiny_model, tmp_path, capsys):
    """``--stages --oracle``: rows marked ``anchors=oracle`` beside the method's in one CSV (the full
    cache's row shared), the needle's ranks printed by both scores, a rerun skips what is done, and
    ``--oracle`` without ``--stages`` is refused. (That the anchors are the top-t of the scores
    given is tested above, with ``scores_of_the_pass``.)"""
    import json

    from conftest import build_tiny_tokenizer, make_text

    from arckv_press.bench import needle_stages
    from arckv_press.runinfo import read_rows

    model = tiny_model("llama", num_layers=2, seed=0)
    model.config.eos_token_id = 2
    model.save_pretrained(tmp_path / "model")
    build_tiny_tokenizer().save_pretrained(tmp_path / "model")
    articles = tmp_path / "articles.jsonl"
    articles.write_text(json.dumps({"input": make_text(2500, seed=0)}) + "\n", encoding="utf-8")
    out = tmp_path / "stages.csv"
    argv = ["--stages", "--model", str(tmp_path / "model"), "--articles", str(articles), "--length", "300",
            "--seeds", "0", "--depths", "0.5", "--ratio", "0.25", "--out", str(out), "--threads", "1",
            "--only", "evict", "+merge"]
    assert needle_stages.main(argv) == 0
    assert needle_stages.main([*argv, "--oracle"]) == 0
    printed = capsys.readouterr().out
    assert "by the oracle's" in printed and "by the copy's rows at the needle" in printed
    rows = read_rows(out)
    assert [(r["stage"], r["anchors"]) for r in rows] == [
        ("full", ""), ("evict", "method"), ("+merge", "method"), ("evict", "oracle"), ("+merge", "oracle")]
    assert needle_stages.main([*argv, "--oracle"]) == 0
    assert "(done)" in capsys.readouterr().out and len(read_rows(out)) == len(rows)
    # an --oracle run alone answers the full cache's row from the prefill its oracle read: the same answer
    alone = tmp_path / "alone.csv"
    assert needle_stages.main([*argv[:-7], "--out", str(alone), *argv[-5:], "--oracle"]) == 0
    assert [(r["stage"], r["answer"]) for r in read_rows(alone)][:1] == [("full", rows[0]["answer"])]
    # the layer sweep and one layer's heads (their teacher-forced queries are the oracle's)
    assert needle_stages.main(["--model", str(tmp_path / "model"), "--articles", str(articles), "--length", "300",
                               "--seed", "0", "--depth", "0.5", "--ratio", "0.25", "--layer", "1",
                               "--threads", "1"]) == 0
    assert "layer 1: the answer's queries" in capsys.readouterr().out
    import pytest
    with pytest.raises(SystemExit):  # --oracle is a stage ladder
        needle_stages.main(["--oracle", "--model", str(tmp_path / "model")])
    assert "add --stages" in capsys.readouterr().err
