"""The continuation-damage probe (``arckv_press.probe_metrics``) and ``scripts/bench_fidelity.py``'s summary,
against independent references: one plain forward over the concatenated ids, and hand-computed
means."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import pytest
import torch

from arckv_press.capture import framing_for
from arckv_press.compaction.fit import FitConfig
from arckv_press.probe_metrics import continuation_damage, continuation_probe, reference_nlls
from arckv_press.registry import make_press
from conftest import load_script, make_text



def _plain_nll(model, ids: list[int], n_cont: int) -> float:
    """NLL of the last ``n_cont - 1`` tokens of ``ids`` from one forward over all of them."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    start = len(ids) - n_cont
    return float(torch.nn.functional.cross_entropy(logits[start:-1], torch.tensor(ids[start + 1:])))


@pytest.fixture
def tiny_setup(tiny_model, tiny_tokenizer, one_torch_thread):
    model, tok = tiny_model("llama", num_layers=2, seed=3), tiny_tokenizer()
    doc = make_text(300, seed=1)
    cont = tok.encode(make_text(40, seed=2), add_special_tokens=False)
    return model, tok, doc, cont


def test_reference_nlls_match_one_plain_forward(tiny_setup):
    model, tok, doc, cont = tiny_setup
    prefix = framing_for(tok).prefix_ids
    full, none = reference_nlls(model, tok, doc, cont)
    doc_ids = tok.encode(doc, add_special_tokens=False)
    assert full == pytest.approx(_plain_nll(model, prefix + doc_ids + cont, len(cont)), abs=1e-4)
    assert none == pytest.approx(_plain_nll(model, prefix + cont, len(cont)), abs=1e-4)


def test_full_cache_has_zero_damage_and_an_evicting_press_has_positive_nll_change(tiny_setup):
    model, tok, doc, cont = tiny_setup
    ref = reference_nlls(model, tok, doc, cont)
    res = continuation_damage(model, tok, None, doc, cont, ref)
    assert res["nll"] == pytest.approx(ref[0], abs=1e-5) and res["damage"] == pytest.approx(0.0, abs=1e-3)
    n_ctx = len(framing_for(tok).prefix_ids) + len(tok.encode(doc, add_special_tokens=False))
    layer = model.config.num_hidden_layers
    per_token = 2 * model.config.num_key_value_heads * model.config.head_dim * 4  # fp32 keys + values
    assert res["cache_bytes"] == layer * n_ctx * per_token  # measured before the continuation is appended

    pruned = continuation_damage(model, tok, make_press("streaming_llm", 0.2), doc, cont, ref)
    full, none = ref
    assert pruned["damage"] == pytest.approx((pruned["nll"] - full) / (none - full), rel=1e-6)
    assert pruned["nll"] != pytest.approx(full, abs=1e-4)  # something was really evicted
    assert pruned["cache_bytes"] < res["cache_bytes"]


def test_continuation_probe_averages_the_per_document_damages(tiny_setup, tiny_tokenizer):
    model, tok, doc, cont = tiny_setup
    docs = [(doc, cont), (make_text(280, seed=5), cont)]
    result, rows = continuation_probe(model, tok, lambda: make_press("streaming_llm", 0.3), docs)
    expected = [continuation_damage(model, tok, make_press("streaming_llm", 0.3), d, c, reference_nlls(model, tok, d, c))
                for d, c in docs]
    assert [r["damage"] for r in rows] == pytest.approx([e["damage"] for e in expected], abs=1e-6)
    assert result.value == pytest.approx(statistics.mean(e["damage"] for e in expected), abs=1e-6)
    assert result.count == 2


def test_bench_fidelity_summary_uses_only_this_configuration():
    bench = load_script("bench_fidelity")
    base = {"doc_tokens": "100", "cont_tokens": "20", "model": "m"}
    rows = [
        {"method": "arckv", "ratio": "0.1", "doc": "0", "damage": "0.2", **base},
        {"method": "arckv", "ratio": "0.1", "doc": "1", "damage": "0.4", **base},
        {"method": "snapkv", "ratio": "0.1", "doc": "0", "damage": "0.6", **base},
        {"method": "snapkv", "ratio": "0.1", "doc": "1", "damage": "0.9", **base},
        {"method": "snapkv", "ratio": "0.1", "doc": "2", "damage": "5.0", **base},  # beyond --docs 2
        {"method": "snapkv", "ratio": "0.1", "doc": "0", "damage": "9.0", **{**base, "doc_tokens": "200"}},
        {"method": "snapkv", "ratio": "0.1", "doc": "1", "damage": "nan", **{**base, "model": "other"}},
    ]
    text = bench.summarize(rows, ["arckv", "snapkv"], [0.1], 2, 100, 20, "m")
    arckv_line = next(line for line in text.splitlines() if line.startswith("arckv "))
    snap_lines = [line for line in text.splitlines() if line.startswith("snapkv")]
    sd = statistics.stdev([0.2, 0.4])
    assert f"+0.300 +- {sd:.3f} (2)" in arckv_line
    assert f"+0.750 +- {statistics.stdev([0.6, 0.9]):.3f} (2)" in snap_lines[0]
    assert snap_lines[1].split()[-1] == "2.50x"  # snapkv's mean damage 0.75 over arckv's 0.3


def test_bench_fidelity_key_is_stable_across_formatting():
    bench = load_script("bench_fidelity")
    assert bench.row_key("a", "0.1", "3", "1500", "256", "m") == bench.row_key("a", 0.1, 3, 1500, 256, "m")


def test_probe_config_parsing_builds_press_options():
    """scripts/probes.py configs: ``METHOD:key=value,...`` -> make_press options, the fit keys
    folded into one FitConfig, and the options column records only what differs from defaults."""
    mod = load_script("probes")
    method, options = mod.parse_config("arckv-ha:values=anchor,ridge=0.1,pool=max,lam=0")
    assert method == "arckv-ha"
    assert options == {"config_options": {"fit": FitConfig(values="anchor", ridge_v=0.1), "pooling": "max"}, "lambda_m": 0.0}
    assert json.loads(json.dumps(options, default=mod._jsonable)) == {
        "config_options": {"fit": {"ridge_v": 0.1, "values": "anchor"}, "pooling": "max"}, "lambda_m": 0.0}
    config = make_press(method, 0.2, **options).compaction_config()
    assert config.fit.values == "anchor" and config.pooling == "max" and config.lambda_m == 0.0
    assert mod.parse_config("kvzip") == ("kvzip", {})
    with pytest.raises(ValueError, match="unknown option 'foo'"):
        mod.parse_config("arckv:foo=1")
    with pytest.raises(ValueError, match="values must be one of"):
        mod.parse_config("arckv:values=copy")
    method, options = mod.parse_config("arckv-ha:wit=0,qb=512")
    assert options == {"config_options": {"fit": FitConfig(witnesses=False)}, "query_budget": 512}
    config = make_press(method, 0.2, **options).compaction_config()
    assert config.fit.witnesses is False and config.query_budget == 512
    assert make_press("arckv-ha", 0.2).compaction_config().fit.witnesses is True
    with pytest.raises(ValueError, match="wit= takes 0 or 1"):
        mod.parse_config("arckv-ha:wit=yes")
    method, options = mod.parse_config("arckv-ha:floor=0.75")
    assert options == {"min_head_fraction": 0.75}
    assert make_press(method, 0.1, **options).compaction_config().min_head_fraction == 0.75
    assert make_press(method, 0.1).compaction_config().min_head_fraction == 0.5  # the default


def test_probes_resume_keys_tell_damage_only_rows_apart():
    """A ``--no-needles`` row does not finish a full probe; a full row finishes both kinds."""
    mod = load_script("probes")
    rows = [{"config": "a", "ratio": "0.1", "dtype": "float32", "indexer": "", "config_id": "c1", "needle_total": "0"},
            {"config": "b", "ratio": "0.1", "dtype": "float32", "indexer": "", "config_id": "c1", "needle_total": "6"}]
    done = mod.done_keys(rows)
    assert not mod.is_done(done, ("a", 0.1, "float32", "", "c1"), no_needles=False)
    assert mod.is_done(done, ("a", 0.1, "float32", "", "c1"), no_needles=True)
    assert mod.is_done(done, ("b", 0.1, "float32", "", "c1"), no_needles=False)
    assert mod.is_done(done, ("b", 0.1, "float32", "", "c1"), no_needles=True)
    assert not mod.is_done(done, ("b", 0.2, "float32", "", "c1"), no_needles=True)
    assert not mod.is_done(done, ("b", 0.1, "float32", "", "c2"), no_needles=True)  # another default: rerun


@pytest.mark.parametrize("column", ["dtype", "indexer", "config_id"])
def test_probes_refuses_a_csv_without_the_dtype_indexer_or_config_id_column(tmp_path, column):
    """Rows are resumed by (config, ratio, dtype, indexer checkpoint, compaction config id): a CSV
    written before those columns existed is refused with the columns named, before the model is
    loaded, instead of mixing dtypes, indexer checkpoints or compaction defaults silently."""
    mod = load_script("probes")
    old = tmp_path / "probes.csv"
    old.write_text(",".join(f for f in mod.FIELDS if f != column) + "\n")
    with pytest.raises(SystemExit, match=f"expected .*'{column}'"):
        mod.main(["--configs", "snapkv", "--out", str(old)])
    assert mod.FIELDS[:6] == ["config", "method", "ratio", "dtype", "indexer", "config_id"]
    for committed in sorted((Path(__file__).resolve().parents[1] / "leaderboards").glob("probes*.csv")):
        with committed.open() as f:
            assert next(csv.reader(f)) == mod.FIELDS, committed.name  # the committed files resume too


def test_split_documents_skips_leading_tokens(tiny_tokenizer):
    from arckv_press.probe_metrics import split_documents

    tok = tiny_tokenizer()
    text = make_text(400, seed=5)
    ids = tok.encode(text, add_special_tokens=False)
    docs = split_documents(tok, text, 2, 30, 10, skip_tokens=50)
    assert [c for _, c in docs] == [ids[80:90], ids[120:130]]
    assert docs[0][0] == tok.decode(ids[50:80])
    with pytest.raises(ValueError, match="skip_tokens"):
        split_documents(tok, text, 1, 30, 10, skip_tokens=-1)
    with pytest.raises(ValueError, match="needed"):
        split_documents(tok, text, 2, 30, 10, skip_tokens=len(ids) - 50)


def test_bench_fidelity_dev_documents_are_disjoint_from_the_reported_ones(tiny_tokenizer):
    bench = load_script("bench_fidelity")
    tok = tiny_tokenizer()
    text = make_text(2000, seed=6)
    half = tok.encode(text[:len(text) // 2], add_special_tokens=False)
    dev = bench.split_documents_of("dev", tok, text, 3, 40, 8, skip_tokens=100)
    test = bench.split_documents_of("test", tok, text, 3, 40, 8)
    # dev documents come from the first half, after the skipped tokens; reported ones from the second
    assert dev[0][1] == half[140:148]
    assert not {tuple(c) for _, c in dev} & {tuple(c) for _, c in test}
    assert all(d not in text[:len(text) // 2] for d, _ in test)
    with pytest.raises(ValueError, match="split"):
        bench.split_documents_of("train", tok, text, 1, 40, 8)


def test_parse_option_reads_literals_and_words():
    import argparse

    from arckv_press.runinfo import parse_option

    assert parse_option("lambda_m=0.5") == ("lambda_m", 0.5)
    assert parse_option("indexer=None") == ("indexer", None)
    assert parse_option("anchor_search=omp") == ("anchor_search", "omp")
    with pytest.raises(argparse.ArgumentTypeError, match="KEY=VALUE"):
        parse_option("lambda_m")


def test_option_argument_collects_a_dict_and_press_options_split_it():
    import argparse

    from arckv_press.registry import make_press, press_options
    from arckv_press.runinfo import add_option_argument

    p = argparse.ArgumentParser()
    add_option_argument(p)
    assert p.parse_args([]).options == {}
    args = p.parse_args(["--option", "lambda_m=1.0", "--option", "anchor_search=omp", "--option", "lambda_m=0.5"])
    assert args.options == {"lambda_m": 0.5, "anchor_search": "omp"}  # the last value of a key wins
    assert p.parse_args([]).options == {}  # the default is never mutated
    # a field the press takes as an argument is passed as one, the others in config_options
    kw = press_options("arckv-ha", args.options)
    assert kw == {"lambda_m": 0.5, "config_options": {"anchor_search": "omp"}}
    config = make_press("arckv-ha", 0.1, **kw).compaction_config()
    assert (config.lambda_m, config.anchor_search) == (0.5, "omp")
    assert press_options("am-omp", {"anchor_search": "omp"}) == {"config_options": {"anchor_search": "omp"}}
    assert press_options("snapkv", args.options) == {} and press_options("arckv-ha", {}) == {}
    with pytest.raises(ValueError, match="unknown method"):
        press_options("nope", {})


def test_bench_fidelity_refuses_to_run_without_the_essays(monkeypatch, tmp_path):
    """Its rows and stored reference NLLs are keyed by document index: without the essays it stops
    before loading a model, instead of measuring the noise haystack against the essays' references."""
    bench = load_script("bench_fidelity")
    monkeypatch.setattr("arckv_press.haystack.default_haystack_path", lambda: None)
    monkeypatch.setattr("arckv_press.models.load_model", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(SystemExit, match="pg_essays.txt"):
        bench.main(["--methods", "arckv-ha", "--ratios", "0.1", "--docs", "1", "--out", str(tmp_path / "f.csv")])
    assert not (tmp_path / "f.csv").exists()
