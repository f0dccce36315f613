"""scripts/bench_compaction.py: the synthetic sweep writes its timings and prints ratios of the same run."""

import csv

from conftest import assert_ratio_of_rounded, load_script


def test_synthetic_sweep_prints_the_ratio_of_the_timings_it_writes(tmp_path, capsys, monkeypatch):
    mod = load_script("bench_compaction")
    out = tmp_path / "bench.csv"
    argv = ["--skip-model", "--max-T", "2048", "--queries", "64", "--repeats", "1", "--synthetic-ratios", "0.05",
            "--out", str(out)]
    scored, real = [], mod._indexer_selection
    monkeypatch.setattr(mod, "_indexer_selection", lambda *a: scored.append((a[2].shape[1], *a[-2:])) or real(*a))
    assert mod.main(argv) == 0
    # the learned indexer is timed as its default corrected scores: indexer_rows (512) of the budget
    # rows, G = 3, with the default shrinkage and the sampled share of the G T rows
    assert scored and set(scored) == {(512 // 3 * 3, 0.1, 512 // 3 * 3 / (3 * T)) for T in (1024, 2048)}
    rows = list(csv.DictReader(out.open()))
    assert {r["section"] for r in rows} == {"synthetic"} and {r["length"] for r in rows} == {"1024", "2048"}
    post = {r["length"]: float(r["seconds"]) for r in rows if r["method"] == "arckv-ha" and r["stage"] == "post"}
    rows = [r for r in rows if r["length"] == "1024"]
    arc = {r["stage"]: float(r["seconds"]) for r in rows if r["method"] == "arckv-ha"}
    assert arc["post_tensor_mib"] > 0  # the peak bytes of the tensors the post stage holds at once
    # the whole default pipeline: the statistics pass, then selection, witnesses, merging and fits
    assert {"reference_pass", "selection", "fit_rows", "merge", "beta_fit", "value_fit", "post", "total"} <= set(arc)
    assert all(v >= 0 for v in arc.values())
    assert arc["post"] >= arc["merge"] + arc["beta_fit"] + arc["value_fit"] + arc["fit_rows"] - 2e-4
    assert abs(arc["total"] - arc["post"] - arc["reference_pass"]) < 2e-4
    (omp,) = [float(r["seconds"]) for r in rows if r["method"] == "am-omp-fast"]
    (idx_sel,) = [float(r["seconds"]) for r in rows if r["method"] == "arckv"]  # the shipped indexer's selection
    assert {r["stage"] for r in rows if r["method"] == "arckv"} == {"selection"} and idx_sel > 0
    printed = capsys.readouterr().out.splitlines()
    line = next(l for l in printed if l.split()[:2] == ["1024", "0.05"])
    omp_post = float(line.split()[-1].rstrip("x"))
    assert_ratio_of_rounded(omp_post, omp, arc["post"], csv_decimals=4)  # CSV keeps 4 decimals, the print 2
    # the growth per doubling printed is that of the written post times
    growth = next(l for l in printed if "default: 1024 -> 2048: post grows" in l)
    assert_ratio_of_rounded(float(growth.split("post grows ")[1].split("x")[0]), post["2048"], post["1024"], csv_decimals=4)
    ratio = next(l for l in printed if "default: T 1024: post / statistics pass" in l)
    assert_ratio_of_rounded(float(ratio.split("= ")[1].split()[0]), arc["post"], arc["reference_pass"], csv_decimals=4,
                            print_decimals=3)


def test_model_section_ratios_come_from_the_written_stage_times(tmp_path, capsys):
    mod = load_script("bench_compaction")
    out = tmp_path / "bench.csv"
    argv = ["--skip-synthetic", "--lengths", "300", "--ratios", "0.2", "--methods", "arckv", "arckv-ha", "am-omp-fast",
            "--repeats", "1", "--dtype", "float32", "--out", str(out), "--plain-repeat"]
    assert mod.main(argv) == 0
    rows = list(csv.DictReader(out.open()))
    assert {r["dtype"] for r in rows} == {"float32"} and {r["length"] for r in rows} == {"300"}
    sec = {(r["method"], r["stage"]): float(r["seconds"]) for r in rows}
    from arckv_press.models import DEFAULT_MODEL_ID
    from arckv_press.registry import result_ids

    for r in rows:  # every time names the checkpoint and options it was measured with
        assert {"indexer": r["indexer"], "config_id": r["config_id"]} == (
            result_ids(r["method"], DEFAULT_MODEL_ID, float(r["ratio"])) if r["method"] != "none" else {"indexer": "", "config_id": ""})
    assert {r["indexer"] for r in rows if r["method"] == "arckv"} != {""}
    printed = capsys.readouterr().out.splitlines()
    pre = sec[("none", "prefill")]
    for name in ("arckv", "arckv-ha"):  # the learned indexer and HA anchors, each against OMP-fast
        stages = sum(sec[(name, s)] for s in mod.ARCKV_STAGES if s != "reference_stats")  # stats lie in the repeat
        assert sec[(name, "compact_total")] >= stages - 1e-3
        assert sec[(name, "reference_stats")] <= sec[(name, "repeat_prefill")]
        post = sec[(name, "compact_total")] - sec[(name, "repeat_prefill")]
        line = next(l for l in printed if l.strip().startswith(f"300 tok, rho 0.2, {name}:"))
        assert_ratio_of_rounded(float(line.split("post/prefill ")[1].split(";")[0]), post, pre, csv_decimals=4,
                                den_terms=1, num_terms=2)
        ratio = float(line.split(f"am-omp-fast select+fit / {name} post ")[1].split("x")[0])
        assert_ratio_of_rounded(ratio, sec[("am-omp-fast", "am_total")], post, csv_decimals=4, den_terms=2)
        e2e = float(line.split("end to end ")[1].split("x")[0])
        assert_ratio_of_rounded(e2e, sec[("am-omp-fast", "compact_total")], sec[(name, "compact_total")], csv_decimals=4)
    from arckv_press.models import load_model

    # peak memory: every method's against the full-cache prefill + answer of the same run, each above
    # the model's weights (resident in the process); the printed ratio is that of the written values
    weights_mib = sum(p.numel() * p.element_size() for p in load_model()[0].parameters()) / 2**20
    full_mib = sec[("none", "full_peak_rss_mib")]
    assert full_mib > weights_mib
    line = next(l for l in printed if "300 tok, rho 0.2: peak RSS / full-cache prefill + answer" in l)
    for name in ("arckv", "arckv-ha", "am-omp-fast"):
        assert sec[(name, "peak_rss_mib")] > weights_mib
        assert_ratio_of_rounded(float(line.split(f"{name} ")[1].split(",")[0]), sec[(name, "peak_rss_mib")], full_mib,
                                csv_decimals=4)
    # --plain-repeat: the repeat-prefill without statistics, against the prefill of the same run
    plain = sec[("none", "repeat_plain")]
    line = next(l for l in printed if "plain repeat-prefill" in l)
    assert_ratio_of_rounded(float(line.split("/ prefill ")[1].split()[0]), plain, pre, csv_decimals=4)
    assert 0 < plain < sec[("arckv-ha", "repeat_prefill")] * 3  # same forwards, no statistics
    # and the floor of an exact repeat-prefill, from the profiled prefill's attention share
    from arckv_press.bench.bench_compaction import document_ids
    from arckv_press.bench.repeat_floor import repeat_floor
    from arckv_press.capture import REPEAT_CHUNK, framing_for, repeat_chunks
    from arckv_press.haystack import load_haystack
    from arckv_press.models import load_model

    kernel, wall = sec[("none", "prefill_attention")], sec[("none", "prefill_profiled")]
    assert 0 < kernel < wall
    tok = load_model()[1]
    ids, prefix_len = document_ids(tok, load_haystack(None), 300)
    chunks = [c.shape[-1] for _, _, c in repeat_chunks(tok, ids[:, prefix_len:], framing_for(tok).suffix_ids,
                                                         REPEAT_CHUNK)]
    assert abs(sec[("none", "repeat_floor")] - repeat_floor(pre, kernel / wall, ids.shape[1], chunks)) < 1e-3
    line = next(l for l in printed if "exact repeat-prefill floor" in l)
    assert_ratio_of_rounded(float(line.split("/ prefill ")[1].split()[0]), sec[("none", "repeat_floor")], pre,
                            csv_decimals=4)
    # --summary prints the same figures from the CSV alone (what an interrupted run left behind)
    assert mod.main([*argv, "--summary"]) == 0
    again = capsys.readouterr().out.splitlines()
    assert [l for l in again if " tok, rho " in l] == [l for l in printed if " tok, rho " in l]
    line = next(l for l in printed if "indexer selection / HA selection" in l)
    sel = {n: sec[(n, "selection")] + sec[(n, "reference_stats")] for n in ("arckv", "arckv-ha")}
    assert_ratio_of_rounded(float(line.split("HA selection ")[1].split()[0]), sel["arckv"], sel["arckv-ha"],
                            csv_decimals=4, num_terms=2, den_terms=2)


def test_the_run_summarised_is_the_last_one_with_the_asked_arckv_options():
    """A default run written after an ``--option`` run (or before it): ``--summary`` with the option
    finds the option run, without it the default run, although the Attention Matching rows of both
    carry the same ids."""
    mod = load_script("bench_compaction")
    from arckv_press.models import DEFAULT_MODEL_ID
    from arckv_press.runinfo import CurrentIds

    default, option = CurrentIds(DEFAULT_MODEL_ID), CurrentIds(DEFAULT_MODEL_ID, {"merge_rows": 256})
    assert default("am-omp", 0.1) == option("am-omp", 0.1) and default("arckv-ha", 0.1) != option("arckv-ha", 0.1)

    def run(date, ids, arckv_seconds):
        rows = [{"section": "model", "method": "none", "ratio": "1", "length": "4000", "stage": "prefill",
                 "seconds": "20", "threads": "1", "date": date, "command": f"run {date}", "machine": "m"}]
        for method, stage, sec in (("arckv-ha", "merge", arckv_seconds), ("am-omp", "am_total", 100.0)):
            rows.append({"section": "model", "method": method, "ratio": "0.1", "length": "4000", "stage": stage,
                         "seconds": str(sec), "threads": "1", "date": date, "command": f"run {date}", "machine": "m",
                         **ids(method, 0.1)})
        return rows

    for order in ((("a", option, 1.0), ("b", default, 2.0)), (("a", default, 2.0), ("b", option, 1.0))):
        rows = [r for date, ids, sec in order for r in run(date, ids, sec)]
        for ids, merge in ((option, 1.0), (default, 2.0)):
            info, results = mod.last_model_run(rows, ids)
            assert results[("arckv-ha", 0.1, 4000)] == {"merge": merge}      # that run's ARC-KV row ...
            assert results[("am-omp", 0.1, 4000)] == {"am_total": 100.0}     # ... with its own AM rows
            assert info["command"] == next(f"run {d}" for d, i, _ in order if i is ids)
    # Attention Matching alone (no ARC-KV method asked for): the last run with its rows
    info, results = mod.last_model_run(rows, default, methods=["am-omp"])
    assert info["command"] == "run b" and set(results) == {("none", 1.0, 4000), ("am-omp", 0.1, 4000)}


def test_repeat_floor_counts_pairs_and_tokens_as_brute_force():
    """attention_pairs is the count of (query, key) pairs a causal forward after a cache sees; the floor
    weighs the prefill's linear part by the tokens repeated and its attention by the pairs."""
    import pytest

    from arckv_press.bench.repeat_floor import attention_pairs, repeat_floor

    def brute(lengths, past):
        return sum(1 for m in lengths for i in range(m) for j in range(past + m) if j <= past + i)

    for lengths, past in (([5], 0), ([3, 4], 7), ([1, 1, 2], 2), ([], 3)):
        assert attention_pairs(lengths, past) == brute(lengths, past)
    L, chunks = 10, [6, 7]                         # two chunks of 10 tokens' document plus prompts
    tokens, pairs = 13 / 10, brute(chunks, L) / brute([L], 0)
    assert repeat_floor(2.0, 0.25, L, chunks) == pytest.approx(2.0 * (0.75 * tokens + 0.25 * pairs))
    assert repeat_floor(2.0, 0.0, L, [L]) == pytest.approx(2.0)   # no attention: the same tokens again
    with pytest.raises(ValueError, match="attention_share"):
        repeat_floor(1.0, 1.5, L, chunks)
    with pytest.raises(ValueError, match="repeat chunk"):
        repeat_floor(1.0, 0.5, L, [])
    with pytest.raises(ValueError, match=">= 0"):
        attention_pairs([2], -1)


def test_repeat_floor_of_a_hybrid_model_counts_each_layer_in_its_window():
    """A sliding-window layer's queries see at most its window (brute force over the mask); the floor
    weighs each layer's pair ratio by its share of the attention time."""
    import pytest

    from arckv_press.bench.repeat_floor import attention_calls, attention_pairs, layer_shares, repeat_floor

    def brute(lengths, past, window):
        return sum(1 for m in lengths for i in range(m) for j in range(past + m)
                   if j <= past + i and j > past + i - window)

    for lengths, past in (([5], 0), ([3, 4], 7), ([1, 1, 2], 2), ([9], 0), ([4, 6], 5)):
        for window in (1, 2, 3, 5, 8, 100):
            assert attention_pairs(lengths, past, window) == brute(lengths, past, window)
    L, chunks, W = 40, [22, 23], 8
    full = attention_pairs(chunks, L) / attention_pairs([L], 0)
    sliding = brute(chunks, L, W) / brute([L], 0, W)
    assert sliding < full                         # the repeat's queries see a window, not the context
    a, tokens = 0.4, 45 / 40
    assert repeat_floor(3.0, a, L, chunks, [None, W], [1.0, 3.0]) == pytest.approx(
        3.0 * ((1 - a) * tokens + a * (0.25 * full + 0.75 * sliding)))
    # every layer full: the shares do not matter, and the floor is the one of one full layer
    assert repeat_floor(3.0, a, L, chunks, [None, None], [1.0, 5.0]) == pytest.approx(repeat_floor(3.0, a, L, chunks))
    with pytest.raises(ValueError, match="share per layer"):
        repeat_floor(3.0, a, L, chunks, [None, W], [1.0])
    # the layers' parts of a forward: one attention call per layer, in order; n forwards are summed
    assert layer_shares([1, 2, 3, 4, 5, 6], 3) == [5, 7, 9]
    assert layer_shares([1, 2, 3], 2) is None and layer_shares([], 2) is None
    import torch

    q = torch.randn(1, 2, 64, 16)
    mask = torch.ones(64, 64, dtype=torch.bool).tril()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls, causal, wall = attention_calls(lambda: [sdpa(q, q, q, is_causal=True), sdpa(q, q, q, attn_mask=mask),
                                                   sdpa(q.double(), q.double(), q.double(), is_causal=True)])
    assert len(calls) == 3 and all(c >= 0 for c in calls) and sum(calls) <= wall
    assert causal == [True, False, True]  # read from each call's recorded is_causal argument
    # a layer whose prefill kernel ran with a mask computed the whole L x L square: its pairs per token
    # needed again are that many fewer (the pair ratio against L * L, brute force above)
    masked = brute(chunks, L, W) / (L * L)
    assert repeat_floor(3.0, a, L, chunks, [None, W], [1.0, 3.0], [True, False]) == pytest.approx(
        3.0 * ((1 - a) * tokens + a * (0.25 * full + 0.75 * masked)))
    with pytest.raises(ValueError, match="causal flag per layer"):
        repeat_floor(3.0, a, L, chunks, [None, W], [1.0, 3.0], [True])
