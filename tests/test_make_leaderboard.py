"""scripts/make_leaderboard.py on tiny fake lm-eval results and hf-arckv records (no model)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from conftest import load_script

from arckv_press.bench.make_leaderboard import RULER_TASKS



@pytest.fixture(scope="module")
def ml():
    return load_script("make_leaderboard")


def results_json(path: Path, model: str, model_args: str, scores: dict[str, float], date: float,
                 ruler_length: int = 2048) -> Path:
    """A results file shaped like lm-eval 0.4.13 ``--output_path`` output (RULER tasks at ``ruler_length``
    tokens, in their config's metadata as run_evals.py passes it)."""
    data = {
        "results": {
            t: {"alias": t, "acc,none": s, "acc_stderr,none": 0.01, "acc_norm,none": s / 2} for t, s in scores.items()
        },
        "group_subtasks": {t: [] for t in scores},
        "configs": {t: {"metadata": {"max_seq_lengths": [ruler_length]}} for t in scores if t in RULER_TASKS},
        "versions": {t: 1.0 for t in scores},
        "n-samples": {t: {"original": 7, "effective": 5} for t in scores},
        "config": {"model": model, "model_args": model_args, "batch_size": 1},
        "git_hash": "abc",
        "date": date,
        "model_name": model_args.split(",")[0].split("=")[1],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def records_jsonl(path: Path, press: str, ratio: float, secs: list[float], tasks: list[str]) -> Path:
    lines = []
    for i, s in enumerate(secs):
        lines.append(json.dumps({
            "model": "HuggingFaceTB/SmolLM2-135M-Instruct", "press": press, "method": press, "ratio": ratio,
            "rank": 0, "document_index": i, "document_sha1": f"{i:040x}", "prefix_tokens": 10,
            "document_tokens": 100, "context_tokens": 110, "compaction_seconds": s, "cache_bytes": 1000 * (i + 1),
            "full_cache_bytes": 9000, "compacted_bytes": 500, "compacted_full_bytes": 8000,
            "realised_ratio": 0.1 + 0.02 * i, "compacted": True, "requests": 4, "tasks": tasks,
        }, sort_keys=True))
    path.write_text("\n".join(lines) + "\n")
    return path


def read(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def row(rows, **kw):
    hits = [r for r in rows if all(r[k] == v for k, v in kw.items())]
    assert len(hits) == 1, (kw, hits)
    return hits[0]


def test_leaderboard_rows_merge_and_plots(ml, tmp_path, capsys):
    model = "HuggingFaceTB/SmolLM2-135M-Instruct"
    runs, out = tmp_path / "runs", tmp_path / "lb"
    results_json(runs / "full" / "results_1.json", "hf", f"pretrained={model}", {"quality": 0.5}, 1.7e9)
    results_json(runs / "a01" / "results_2.json", "hf-arckv", f"pretrained={model},press=arckv,ratio=0.1",
                 {"quality": 0.4}, 1.7e9)
    results_json(runs / "a02" / "results_3.json", "hf-arckv", f"pretrained={model},press=arckv,ratio=0.2",
                 {"quality": 0.45}, 1.7e9)
    results_json(runs / "nc" / "results_4.json", "hf", f"pretrained={model}", {"quality": 0.3}, 1.7e9)
    records_jsonl(runs / "arckv_compaction_SmolLM2-135M-Instruct_arckv_0.1.jsonl", "arckv", 0.1, [1.0, 2.0, 6.0],
                  ["quality"])
    # a record of another task must not enter the quality mean
    with open(runs / "arckv_compaction_SmolLM2-135M-Instruct_arckv_0.1.jsonl", "a") as f:
        f.write(json.dumps({"model": model, "press": "arckv", "ratio": 0.1, "compaction_seconds": 100.0,
                            "cache_bytes": 1, "realised_ratio": 0.9, "tasks": ["other"]}) + "\n")

    args = ["--results", str(runs / "full" / "*.json"), str(runs / "a0*" / "*.json"),
            "--nocontext-results", str(runs / "nc" / "*.json"),
            "--records", str(runs / "*.jsonl"), "--out-dir", str(out)]
    ml.main(args)
    printed = capsys.readouterr().out
    assert printed.startswith("python scripts/make_leaderboard.py --results")
    assert "| model | benchmark | task |" in printed

    rows = read(out / "leaderboard.csv")
    assert len(rows) == 4
    a01 = row(rows, method="arckv", ratio="0.1")
    assert a01["benchmark"] == "quality" and a01["task"] == "quality" and a01["model"] == model
    assert float(a01["score"]) == pytest.approx(0.4)
    assert a01["metric"] == "acc,none"
    assert float(a01["full_score"]) == pytest.approx(0.5)
    assert float(a01["nocontext_score"]) == pytest.approx(0.3)
    assert float(a01["compaction_seconds"]) == pytest.approx(3.0)  # mean(1, 2, 6), not the 'other' task
    assert float(a01["cache_bytes"]) == pytest.approx(2000.0)
    assert float(a01["realised_ratio"]) == pytest.approx(0.12)
    assert a01["n_examples"] == "5" and a01["n_records"] == "3"
    assert a01["date"] == "2023-11-14T22:13:20Z"
    assert a01["package_version"] and a01["command"].startswith("python scripts/make_leaderboard.py")
    a02 = row(rows, method="arckv", ratio="0.2")
    assert a02["compaction_seconds"] == ""  # no records for that run
    full = row(rows, method="none")
    assert full["ratio"] == "1" and float(full["full_score"]) == pytest.approx(0.5)
    assert row(rows, method="no-context")["ratio"] == "0"
    for kind in ("ratio", "time"):
        png = out / f"quality_score_vs_{kind}.png"
        assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"

    # rerun with a newer ratio-0.1 result only: merged, one row per key, newer value, others kept
    newer = results_json(runs / "a01b" / "results_5.json", "hf-arckv",
                         f"pretrained={model},press=arckv,ratio=0.1", {"quality": 0.42}, 1.8e9)
    ml.main(["--results", str(newer), "--out-dir", str(out), "--no-plots"])
    rows2 = read(out / "leaderboard.csv")
    assert len(rows2) == 4
    a01 = row(rows2, method="arckv", ratio="0.1")
    assert float(a01["score"]) == pytest.approx(0.42)
    assert float(a01["full_score"]) == pytest.approx(0.5)
    assert float(row(rows2, method="arckv", ratio="0.2")["score"]) == pytest.approx(0.45)

    # an hf-arckv drop_document run is the no-context baseline (found among --results)
    nc2 = results_json(runs / "nc2" / "results_7.json", "hf-arckv",
                       f"pretrained={model},press=none,ratio=1.0,drop_document=True", {"quality": 0.28}, 1.9e9)
    ml.main(["--results", str(nc2), "--out-dir", str(out), "--no-plots"])
    rows3 = read(out / "leaderboard.csv")
    assert len(rows3) == 4 and float(row(rows3, method="no-context")["score"]) == pytest.approx(0.28)
    assert float(row(rows3, method="arckv", ratio="0.1")["nocontext_score"]) == pytest.approx(0.28)

    # an older result does not overwrite the newer row
    older = results_json(runs / "old" / "results_6.json", "hf-arckv",
                         f"pretrained={model},press=arckv,ratio=0.1", {"quality": 0.1}, 1.0e9)
    ml.main(["--results", str(older), "--out-dir", str(out), "--no-plots"])
    assert float(row(read(out / "leaderboard.csv"), method="arckv", ratio="0.1")["score"]) == pytest.approx(0.42)


def test_records_next_to_a_result_win_and_resumed_documents_count_once(ml, tmp_path):
    """run_evals.py layout: <bench>/<method>_<ratio>/{results.json, arckv_compaction.jsonl}. The same
    press and ratio on another benchmark must not enter this benchmark's compaction seconds, and a
    document compacted twice (run interrupted and resumed) counts once, with its last record."""
    model = "HuggingFaceTB/SmolLM2-135M-Instruct"
    runs, out = tmp_path / "lm_eval", tmp_path / "lb"
    for bench, secs in (("ruler", [2.0, 4.0]), ("quality", [50.0])):
        folder = runs / bench / "kvzip_0.1"
        results_json(folder / "results.json", "hf-arckv", f"pretrained={model},press=kvzip,ratio=0.1",
                     {bench: 0.5}, 1.7e9)
        records_jsonl(folder / "arckv_compaction.jsonl", "kvzip", 0.1, secs, [bench])
    with open(runs / "ruler" / "kvzip_0.1" / "arckv_compaction.jsonl") as f:
        first = json.loads(f.readline())
    with open(runs / "ruler" / "kvzip_0.1" / "arckv_compaction.jsonl", "a") as f:  # document 0 again, resumed
        f.write(json.dumps({**first, "compaction_seconds": 6.0}) + "\n")
    ml.main(["--results", str(runs / "**" / "results.json"), "--records", str(runs / "**" / "*.jsonl"),
             "--out-dir", str(out), "--no-plots"])
    rows = read(out / "leaderboard.csv")
    ruler = row(rows, benchmark="ruler", method="kvzip")
    assert float(ruler["compaction_seconds"]) == pytest.approx(5.0)  # mean(6 (last copy of doc 0), 4)
    assert ruler["n_records"] == "2"
    assert float(row(rows, benchmark="quality", method="kvzip")["compaction_seconds"]) == pytest.approx(50.0)


def test_needle_and_probes(ml, tmp_path):
    out = tmp_path / "lb"
    out.mkdir()
    head = "method,ratio,length,depth,seed,context_tokens,needle,answer,correct,compaction_s,answer_s,cache_bytes,masked,model,command,date,package_version,machine\n"
    body = (
        "none,1,1000,0,0,999,1,1,1,1.0,1.0,100,0,m,c,2026-01-01T00:00:00Z,0.1.0,x\n"
        "arckv-ha,0.1,1000,0,0,999,1,2,0,3.0,1.0,10,0,m,c,2026-01-01T00:00:00Z,0.1.0,x\n"
        "arckv-ha,0.1,1000,0.5,0,999,1,1,1,5.0,1.0,20,0,m,c,2026-01-02T00:00:00Z,0.1.0,x\n"
    )
    (out / "needle.csv").write_text(head + body)
    (out / "probes.csv").write_text(
        "config,method,ratio,options,needle_found,needle_total,damage,damage_docs,compaction_seconds,date,version,command\n"
        "arckv-ha,arckv-ha,0.2,{},1,2,0.09,1,35.8,2026-11-22,0.1.0,c\n"
        "kvzip,kvzip,0.2,{},2,2,0.2,1,10.0,2026-11-22,0.1.0,c\n"
    )
    ml.main(["--out-dir", str(out)])
    rows = read(out / "leaderboard.csv")
    ha = row(rows, benchmark="needle", method="arckv-ha")
    assert float(ha["score"]) == pytest.approx(0.5)
    assert float(ha["compaction_seconds"]) == pytest.approx(4.0)
    assert float(ha["cache_bytes"]) == pytest.approx(15.0)
    assert float(ha["full_score"]) == pytest.approx(1.0)
    assert ha["date"] == "2026-01-02T00:00:00Z" and ha["n_examples"] == "2"
    assert (out / "needle_score_vs_ratio.png").exists() and (out / "probes.png").exists()


def leaderboard_from(ml, tmp_path, name: str, text: str) -> list[dict]:
    """The leaderboard rows ``make_leaderboard`` builds from one benchmark CSV ``name``."""
    out = tmp_path / "lb"
    out.mkdir()
    (out / name).write_text(text)
    ml.main(["--out-dir", str(out)])
    return read(out / "leaderboard.csv")


def test_needle_rows_of_an_older_indexer_checkpoint_are_left_out(ml, tmp_path):
    head = ("method,ratio,length,depth,seed,context_tokens,needle,answer,correct,compaction_s,answer_s,cache_bytes,"
            "masked,indexer,model,command,date,package_version,machine\n")
    rows = leaderboard_from(ml, tmp_path, "needle.csv", head + (
        "arckv,0.1,1000,0,0,999,1,2,0,30.0,1.0,10,0,old111111111,m,c,2026-01-01T00:00:00Z,0.1.0,x\n"
        "arckv,0.1,1000,0.5,0,999,1,2,0,30.0,1.0,10,0,old111111111,m,c,2026-01-01T00:00:00Z,0.1.0,x\n"
        "arckv,0.1,1000,0,0,999,1,1,1,10.0,1.0,20,0,new222222222,m,c,2026-01-03T00:00:00Z,0.1.0,x\n"
        "snapkv,0.1,1000,0,0,999,1,2,0,2.0,1.0,10,0,,m,c,2026-01-01T00:00:00Z,0.1.0,x\n"
    ))
    arckv = row(rows, benchmark="needle", method="arckv")
    assert arckv["indexer"] == "new222222222" and arckv["n_examples"] == "1"
    assert float(arckv["score"]) == 1.0 and float(arckv["compaction_seconds"]) == pytest.approx(10.0)
    snap = row(rows, benchmark="needle", method="snapkv")
    assert snap["indexer"] == "" and float(snap["score"]) == 0.0


def test_fidelity_rows_score_one_minus_mean_damage(ml, tmp_path):
    head = ("method,ratio,doc,doc_tokens,cont_tokens,nll,nll_full,nll_none,damage,compaction_s,cache_bytes,"
            "indexer,model,command,date,package_version,machine\n")
    rows = leaderboard_from(ml, tmp_path, "bench_fidelity.csv", head + (
        "arckv,0.1,0,1500,256,2.9,2.0,3.0,0.9,99.0,100,old111111111,m,c,2025-12-01T00:00:00Z,0.1.0,x\n"
        "arckv,0.1,0,1500,256,2.1,2.0,3.0,0.1,10.0,100,new222222222,m,c,2026-01-01T00:00:00Z,0.1.0,x\n"
        "arckv,0.1,1,1500,256,2.3,2.0,3.0,0.3,20.0,300,new222222222,m,c,2026-01-02T00:00:00Z,0.1.0,x\n"
        "arckv,0.1,2,1500,256,2.3,2.3,2.3,nan,30.0,900,new222222222,m,c,2026-01-02T00:00:00Z,0.1.0,x\n"
        "snapkv,0.1,0,1500,256,2.5,2.0,3.0,0.5,1.0,50,,m,c,2026-01-01T00:00:00Z,0.1.0,x\n"
    ))
    arckv = row(rows, benchmark="fidelity", method="arckv")
    # the nan document and the older checkpoint's row are left out
    assert float(arckv["score"]) == pytest.approx(1 - (0.1 + 0.3) / 2) and arckv["indexer"] == "new222222222"
    assert float(arckv["compaction_seconds"]) == pytest.approx(15.0) and arckv["n_examples"] == "2"
    assert float(row(rows, benchmark="fidelity", method="snapkv")["score"]) == pytest.approx(0.5)
    assert float(arckv["full_score"]) == 1.0 and float(arckv["nocontext_score"]) == 0.0
    # the references are exact on every document a method was scored on: a point interval
    for method, score in (("none", 1.0), ("no-context", 0.0)):
        ref = row(rows, benchmark="fidelity", method=method)
        assert json.loads(ref["example_scores"]) == {"doc0/1500/256": score, "doc1/1500/256": score}
        assert ref["n_examples"] == "2" and float(ref["ci_low"]) == float(ref["ci_high"]) == score
    assert (tmp_path / "lb" / "fidelity_score_vs_ratio.png").exists()


def test_bad_inputs(ml, tmp_path):
    with pytest.raises(ValueError, match="no file matches"):
        ml.main(["--results", str(tmp_path / "nothing_*.json"), "--out-dir", str(tmp_path)])
    bad = tmp_path / "results_x.json"
    bad.write_text(json.dumps({"config": {}}))
    with pytest.raises(ValueError, match="not an lm-eval results file"):
        ml.main(["--results", str(bad), "--out-dir", str(tmp_path)])


def test_rows_made_under_older_compaction_defaults_are_left_out(ml, tmp_path):
    """Same method and checkpoint, but another ``config_id`` (a default changed): only the newest
    row's configuration counts, and the leaderboard names it."""
    head = ("method,ratio,doc,doc_tokens,cont_tokens,nll,nll_full,nll_none,damage,compaction_s,cache_bytes,"
            "indexer,config_id,model,command,date,package_version,machine\n")
    rows = leaderboard_from(ml, tmp_path, "bench_fidelity.csv", head + (
        "arckv-ha,0.1,0,1500,256,2.9,2.0,3.0,0.9,99.0,100,,cfgold000000,m,c,2026-01-01T00:00:00Z,0.1.0,x\n"
        "arckv-ha,0.1,1,1500,256,2.9,2.0,3.0,0.7,99.0,100,,cfgold000000,m,c,2026-01-01T00:00:00Z,0.1.0,x\n"
        "arckv-ha,0.1,0,1500,256,2.1,2.0,3.0,0.2,10.0,100,,cfgnew111111,m,c,2026-01-02T00:00:00Z,0.1.0,x\n"
        "snapkv,0.1,0,1500,256,2.5,2.0,3.0,0.5,1.0,50,,,m,c,2026-01-01T00:00:00Z,0.1.0,x\n"
    ))
    ha = row(rows, benchmark="fidelity", method="arckv-ha")
    assert float(ha["score"]) == pytest.approx(0.8) and ha["config_id"] == "cfgnew111111" and ha["n_examples"] == "1"
    snap = row(rows, benchmark="fidelity", method="snapkv")
    assert snap["config_id"] == "" and float(snap["score"]) == pytest.approx(0.5)


def test_rows_of_a_superseded_checkpoint_leave_the_table_whole(ml, tmp_path):
    """A method rerun with a new checkpoint at one kept fraction: its other kept fractions (old
    checkpoint) move to leaderboard_superseded.csv instead of sharing a line with the new one;
    methods without ids are untouched; the context length comes from the records."""
    model = "HuggingFaceTB/SmolLM2-135M-Instruct"
    runs, out = tmp_path / "runs", tmp_path / "lb"

    def run(name, press, ratio, score, date, indexer):
        path = results_json(runs / name / "results.json", "hf-arckv", f"pretrained={model},press={press},ratio={ratio}",
                            {"ruler": score}, date)
        records_jsonl(runs / name / "arckv_compaction.jsonl", press, ratio, [1.0, 3.0], ["ruler"])
        lines = [json.loads(line) | {"indexer": indexer, "config_id": "cfg000000000"}
                 for line in (runs / name / "arckv_compaction.jsonl").read_text().splitlines()]
        (runs / name / "arckv_compaction.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        return path

    run("old01", "arckv", 0.1, 0.30, 1.7e9, "old000000000")
    run("old02", "arckv", 0.2, 0.36, 1.7e9, "old000000000")
    run("snap", "snapkv", 0.1, 0.05, 1.6e9, "")
    args = ["--results", str(runs / "*" / "results.json"), "--records", str(runs / "*" / "*.jsonl"),
            "--out-dir", str(out), "--no-plots"]
    ml.main(args)
    assert {(r["method"], r["ratio"], r["indexer"]) for r in read(out / "leaderboard.csv")} == {
        ("arckv", "0.1", "old000000000"), ("arckv", "0.2", "old000000000"), ("snapkv", "0.1", "")}
    assert not (out / "leaderboard_superseded.csv").exists()
    assert float(row(read(out / "leaderboard.csv"), method="arckv", ratio="0.1")["context_tokens"]) == 110

    (runs / "old01").rename(runs / "moved")  # run_evals moves an old checkpoint's folder away ...
    run("new01", "arckv", 0.1, 0.31, 1.8e9, "new111111111")  # ... and reruns that kept fraction
    ml.main(["--results", str(runs / "new01" / "results.json"), "--records", str(runs / "new01" / "*.jsonl"),
             "--out-dir", str(out), "--no-plots"])
    current = read(out / "leaderboard.csv")
    assert {(r["method"], r["ratio"], r["indexer"]) for r in current} == {
        ("arckv", "0.1", "new111111111"), ("snapkv", "0.1", "")}
    old = read(out / "leaderboard_superseded.csv")
    assert [(r["method"], r["ratio"], r["indexer"], r["score"]) for r in old] == [("arckv", "0.2", "old000000000", "0.36")]
    ml.main(["--out-dir", str(out), "--no-plots"])  # a rebuild keeps both files as they are
    assert read(out / "leaderboard.csv") == current and read(out / "leaderboard_superseded.csv") == old

    # a resumed run whose records miss a task still names its checkpoint (results.json's arckv_run)
    path = run("new02", "arckv", 0.2, 0.37, 1.9e9, "new111111111")
    data = json.loads(path.read_text())
    data["results"]["other_task"] = {"alias": "other_task", "acc,none": 0.5}
    data["arckv_run"] = {"indexer": "new111111111", "config_id": "cfg000000000"}
    path.write_text(json.dumps(data))
    ml.main(["--results", str(path), "--records", str(runs / "new02" / "*.jsonl"), "--out-dir", str(out), "--no-plots"])
    current = read(out / "leaderboard.csv")
    assert {(r["task"], r["ratio"], r["indexer"], r["config_id"]) for r in current if r["method"] == "arckv"} == {
        ("ruler", "0.1", "new111111111", "cfg000000000"), ("ruler", "0.2", "new111111111", "cfg000000000"),
        ("other_task", "0.2", "new111111111", "cfg000000000")}


def test_method_styles_tell_a_dozen_methods_and_their_families_apart(ml):
    """Twelve method lines (more than tab10's ten colours): every line has its own colour, and the
    line style says the family (ARC-KV solid, Attention Matching dashed, kvpress dotted), also
    when labels carry the model's name."""
    methods = ["arckv", "arckv-ha", "arckv-vi", "am-omp", "am-omp-fast", "am-ha", "snapkv", "kvzip",
               "expected_attention", "knorm", "streaming_llm", "tova"]
    styles = ml.method_styles({m: m for m in methods})
    assert len({s["color"] for s in styles.values()}) == len(methods)
    want = {"arckv": "-", "am": "--", "kvpress": ":"}
    for m in methods:
        family = "arckv" if m.startswith("arckv") else "am" if m.startswith("am-") else "kvpress"
        assert styles[m]["linestyle"] == want[family], m
    assert ml.method_family("amazing_press") == "kvpress"  # 'am-' prefix, not 'am'
    labelled = ml.method_styles({"smollm2 arckv": "arckv", "qwen3 arckv": "arckv", "smollm2 am-ha": "am-ha"})
    assert labelled["qwen3 arckv"]["linestyle"] == "-" and labelled["smollm2 am-ha"]["linestyle"] == "--"
    assert labelled["qwen3 arckv"]["color"] != labelled["smollm2 arckv"]["color"]
    assert ml.method_styles({m: m for m in reversed(methods)}) == styles  # order of appearance does not matter


def test_readme_headline_table_is_the_generated_one(ml):
    """The README's headline table is exactly what make_leaderboard writes from leaderboard.csv."""
    repo = Path(__file__).resolve().parents[1]
    text = (repo / "README.md").read_text(encoding="utf-8")
    start, end = text.index(ml.HEADLINE_START), text.index(ml.HEADLINE_END)
    in_readme = text[start + len(ml.HEADLINE_START):end].strip("\n")
    rows = ml.read_csv(repo / "leaderboards" / "leaderboard.csv")
    assert in_readme == ml.headline_markdown(rows)
    start, end = text.index(ml.BEST_START), text.index(ml.BEST_END)
    assert text[start + len(ml.BEST_START):end].strip("\n") == ml.best_markdown(rows)


def test_best_at_keep_10_percent_names_the_runner_up_and_the_test(ml):
    """The best compact method and the runner-up at keep 10% per headline benchmark, with the paired
    test on their shared examples; references never count; without examples it says so."""
    def row(bench, task, method, score, scores=None, ratio="0.1", n="20"):
        return {"benchmark": bench, "task": task, "method": method, "ratio": ratio, "score": score, "n_examples": n,
                "example_scores": ml.example_scores(scores) if scores else ""}

    good = {f"e{i}": 1.0 for i in range(20)}
    bad = {f"e{i}": float(i < 2) for i in range(20)}
    rows = [row("needle", "needle", "arckv", "1.0", good), row("needle", "needle", "kvzip", "0.1", bad),
            row("needle", "needle", "none", "1.0", good), row("needle", "needle", "snapkv", "0.9", good, ratio="0.2"),
            row("ruler", "ruler", "kvzip", "0.39"), row("ruler", "ruler", "arckv-ha", "0.35"),
            row("ruler_4k", "ruler_4k", "arckv", "0.25", {"a": 0.5, "b": 0.0}),
            row("ruler_4k", "ruler_4k", "snapkv", "0.5", {"a": 1.0, "b": 0.0}),
            row("ruler_4k", "ruler_4k", "none", "0.9", {"a": 1.0, "b": 1.0})]
    lines = ml.best_markdown(rows).splitlines()
    assert lines[0].startswith("- needles: `arckv` 20/20, runner-up `kvzip` 2/20: significant (difference +0.900")
    assert lines[1] == "- RULER 2K: `kvzip` 0.39, runner-up `arckv-ha` 0.35: not tested (no per-example scores for both)"
    # the 4K rows are their own benchmark: the 2K methods never enter it, and the full cache is no candidate
    assert lines[2].startswith("- RULER 4K: `snapkv` 0.50, runner-up `arckv` 0.25: a tie (difference +0.250, "
                               "95% interval [+0.000, +0.500], sign test p = 1, 2 shared examples)")
    assert len(lines) == 3  # no fidelity rows: no line


def test_headline_table_from_rows_and_readme_update(ml, tmp_path):
    def row(bench, task, method, ratio, score, n="", seconds=""):
        return {"benchmark": bench, "task": task, "method": method, "ratio": ratio, "score": score,
                "n_examples": n, "compaction_seconds": seconds}

    rows = [row("needle", "needle", "arckv", "0.1", "0.8", "15"), row("needle", "needle", "none", "1", "0.85", "20"),
            row("fidelity", "continuation", "arckv", "0.2", "0.974", "4", "12.34"),
            row("fidelity", "continuation", "arckv", "0.1", "0.9", "4", "5"),
            row("fidelity", "continuation", "arckv", "0.05", "0.5", "4", "3"),
            row("ruler", "ruler", "snapkv", "0.05", "0.0449"), row("ruler", "ruler", "none", "1", "0.429"),
            row("ruler", "niah_single_1", "snapkv", "0.05", "0.9")]  # a subtask never enters the table
    rows[0].update(ci_low="0.6", ci_high="0.9333")
    rows[3].update(ci_low="0.85", ci_high="0.95")
    rows[2].update(ci_low="0.9", ci_high="1")  # keep 20%: the table shows only keep 10%'s intervals
    rows[6].update(ci_low="0.3", ci_high="0.55")
    table = ml.headline_markdown(rows).splitlines()
    arckv = next(line for line in table if line.startswith("| `arckv` |"))
    assert arckv == "| `arckv` | - · 12/15 [0.60, 0.93] · - | 0.97 · 0.90 [0.85, 0.95] · 0.50 | - | 12.3 · 5.0 · 3.0 |"
    assert next(line for line in table if line.startswith("| `snapkv` |")) == "| `snapkv` | - | - | - · - · 0.04 | - |"
    assert table[-2] == "| full cache | 17/20 | - | 0.43 [0.30, 0.55] | - |"
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{ml.HEADLINE_START}\nold\n{ml.HEADLINE_END}\nrest\n")
    assert ml.update_readme(readme, "| t |") and readme.read_text() == (
        f"intro\n{ml.HEADLINE_START}\n| t |\n{ml.HEADLINE_END}\nrest\n")
    assert not ml.update_readme(readme, "| t |")  # unchanged
    readme.write_text(f"{ml.HEADLINE_END}\n{ml.HEADLINE_START}\n")
    with pytest.raises(ValueError, match="must contain"):
        ml.update_readme(readme, "| t |")


def test_rows_of_a_non_default_option_never_replace_the_defaults(ml):
    """A newer row made with ``--option`` (another config_id) does not hide the default's rows."""
    from arckv_press.models import DEFAULT_MODEL_ID
    from arckv_press.registry import result_ids

    ids = result_ids("arckv-ha", DEFAULT_MODEL_ID, 0.1)
    base = {"method": "arckv-ha", "model": DEFAULT_MODEL_ID, "indexer": ids["indexer"], "ratio": "0.1"}
    default = [{**base, "config_id": ids["config_id"], "date": "2026-01-01", "n": str(i)} for i in range(3)]
    option = {**base, "config_id": "not-the-default", "date": "2026-12-31", "n": "x"}
    chosen_ids, chosen = ml.newest_rows([*default, option])
    assert chosen_ids == ids and chosen == default
    # without any default row, the newest configuration is reported (e.g. an old model's rows)
    assert ml.newest_rows([option])[1] == [option]
    # a default that depends on the kept fraction (the lambda_m schedule): each kept fraction's own
    # default id is current, and keep 2% made with keep 10%'s coefficient is not
    low = result_ids("arckv-ha", DEFAULT_MODEL_ID, 0.02)["config_id"]
    assert low != ids["config_id"]
    at_low = {**base, "ratio": "0.02", "config_id": low, "date": "2026-02-01", "n": "low"}
    old_low = {**base, "ratio": "0.02", "config_id": ids["config_id"], "date": "2026-01-01", "n": "old"}
    assert ml.newest_rows([*default, at_low, old_low])[1] == [*default, at_low]


def test_results_doc_tables_are_the_generated_ones(ml):
    """docs/results.md's per-benchmark tables are exactly what make_leaderboard writes from leaderboard.csv."""
    repo = Path(__file__).resolve().parents[1]
    rows = ml.read_csv(repo / "leaderboards" / "leaderboard.csv")
    text = (repo / "docs" / "results.md").read_text(encoding="utf-8")
    for t in ml.RESULT_TABLES:
        start_mark, end_mark = ml.block_marks(t.name)
        start, end = text.index(start_mark), text.index(end_mark)
        assert text[:start].rstrip().endswith(f"### {t.title}"), t.name  # its heading says what it holds
        assert text[start + len(start_mark):end].strip("\n") == ml.benchmark_markdown(rows, t.benchmark, t.task), t.name


def test_benchmark_table_from_rows(ml, tmp_path):
    """A cell per (method, kept fraction) present, ``-`` for a missing one, the references on every
    column, needles as found/total; a doc without a block's markers is refused unchanged."""
    def row(method, ratio, score, n="10", bench="ruler", task="ruler"):
        return {"benchmark": bench, "task": task, "method": method, "ratio": ratio, "score": score, "n_examples": n}

    rows = [row("arckv", "0.1", "0.5"), row("arckv", "0.05", "0.25"), row("snapkv", "0.1", "0.125"),
            row("none", "1", "0.75"), row("arckv", "0.1", "0.9", task="cwe"),
            row("arckv", "0.1", "0.6", "5", "needle", "needle")]
    assert ml.benchmark_markdown(rows, "ruler", "ruler").splitlines() == [
        "| method | keep 10% | keep 5% |", "|---|---:|---:|", "| `arckv` | 0.50 | 0.25 |", "| `snapkv` | 0.12 | - |",
        "| full cache | 0.75 | 0.75 |"]
    assert ml.benchmark_markdown(rows, "needle", "needle").splitlines()[2] == "| `arckv` | 3/5 |"
    rows[0].update(ci_low="0.25", ci_high="0.75")
    assert ml.benchmark_markdown(rows, "ruler", "ruler").splitlines()[2] == "| `arckv` | 0.50 [0.25, 0.75] | 0.25 |"
    doc = tmp_path / "results.md"
    doc.write_text("no markers\n")
    with pytest.raises(ValueError, match="must contain the lines"):
        ml.update_results_doc(doc, rows)
    assert doc.read_text() == "no markers\n"


def test_intervals_and_paired_comparisons_from_stored_examples(ml):
    """Rows carry their per-example scores; intervals and comparisons are recomputed from them: only
    ARC-KV methods are compared, against every other method, on the shared examples."""
    def row(method, scores, ratio="0.1"):
        return {"model": "m", "benchmark": "needle", "task": "needle", "method": method, "ratio": ratio,
                "score": sum(scores.values()) / len(scores), "example_scores": ml.example_scores(scores)}

    good = {f"e{i}": 1.0 for i in range(20)}
    bad = {f"e{i}": float(i < 2) for i in range(20)}
    rows = [row("arckv", good), row("arckv-ha", good), row("snapkv", bad), row("none", good),
            row("kvzip", {"other": 1.0})]
    assert ml.examples_of(rows[0]) == good and ml.examples_of({"score": 1}) == {}
    ml.add_intervals(rows)
    assert rows[0]["ci_low"] == rows[0]["ci_high"] == 1.0 and rows[2]["ci_low"] < 0.1 < rows[2]["ci_high"]
    out = ml.comparisons(rows)
    pairs = {(c["method"], c["other"]): c for c in out}
    assert set(pairs) == {("arckv", "arckv-ha"), ("arckv", "snapkv"), ("arckv-ha", "arckv"), ("arckv-ha", "snapkv")}
    assert pairs[("arckv", "snapkv")]["verdict"] == "better" and pairs[("arckv", "snapkv")]["n"] == 20
    assert pairs[("arckv", "arckv-ha")]["verdict"] == "tie" and pairs[("arckv", "arckv-ha")]["p_sign"] == 1.0


def test_lm_eval_sample_scores_become_example_scores(ml, tmp_path):
    """run_evals.py's sample_scores.json beside results.json: a leaf task's examples are its samples' values
    of the reported metric, a group's the union of its subtasks' (ids ``task/doc``); the interval
    brackets the mean. Without the file a row has no examples (and no interval)."""
    import importlib

    run_evals = importlib.import_module("arckv_press.bench.run_evals")
    folder = tmp_path / "ruler" / "arckv_0.1"
    path = results_json(folder / "results.json", "hf-arckv", "pretrained=m,press=arckv,ratio=0.1",
                        {"cwe": 0.5, "vt": 1.0, "ruler": 0.75}, 1.7e9)
    data = json.loads(path.read_text())
    data["group_subtasks"] = {"ruler": ["cwe", "vt"], "cwe": [], "vt": []}
    path.write_text(json.dumps(data))
    samples = {"cwe": [{"doc_id": 0, "acc": 1.0, "acc_norm": 0.5, "doc": {"x": 1}}, {"doc_id": 1, "acc": 0.0}],
               "vt": [{"doc_id": 0, "acc": 1.0}, {"doc_id": 1, "acc": True}]}  # a bool is no score
    run_evals.write_sample_scores(folder / "sample_scores.json", samples)
    rows = {r["task"]: r for r in ml.read_results(path, {}, False, {"package_version": "0", "command": "c"})}
    assert ml.examples_of(rows["cwe"]) == {"cwe/0": 1.0, "cwe/1": 0.0}
    assert ml.examples_of(rows["vt"]) == {"vt/0": 1.0}
    assert ml.examples_of(rows["ruler"]) == {"cwe/0": 1.0, "cwe/1": 0.0, "vt/0": 1.0}
    ml.add_intervals(list(rows.values()))
    assert rows["cwe"]["ci_low"] <= 0.5 <= rows["cwe"]["ci_high"]
    (folder / "sample_scores.json").unlink()
    assert all(r["example_scores"] == "" for r in ml.read_results(path, {}, False, {"package_version": "0", "command": "c"}))


def test_a_group_row_counts_its_subtasks_examples(ml, tmp_path):
    """lm-eval lists no ``n-samples`` for a group: its row's ``n_examples`` is the sum of its subtasks'
    effective counts (a leaf keeps its own), and stays empty when a subtask's count is missing."""
    path = results_json(tmp_path / "ruler" / "arckv_0.1" / "results.json", "hf-arckv",
                        "pretrained=m,press=arckv,ratio=0.1", {"cwe": 0.5, "vt": 1.0, "ruler": 0.75}, 1.7e9)
    data = json.loads(path.read_text())
    data["group_subtasks"] = {"ruler": ["cwe", "vt"], "cwe": [], "vt": []}
    data["n-samples"] = {"cwe": {"original": 10, "effective": 10}, "vt": {"original": 10, "effective": 4}}
    path.write_text(json.dumps(data))
    common = {"package_version": "0", "command": "c"}
    rows = {r["task"]: r for r in ml.read_results(path, {}, False, common)}
    assert (rows["cwe"]["n_examples"], rows["vt"]["n_examples"], rows["ruler"]["n_examples"]) == (10, 4, 14)
    del data["n-samples"]["vt"]
    path.write_text(json.dumps(data))
    rows = {r["task"]: r for r in ml.read_results(path, {}, False, common)}
    assert (rows["cwe"]["n_examples"], rows["vt"]["n_examples"], rows["ruler"]["n_examples"]) == (10, "", "")


def test_study_tables_in_the_docs_are_the_generated_ones():
    """docs/results.md's compaction-time and development-split tables and docs/indexer.md's selector
    table are exactly what study_tables generates from the committed CSVs."""
    from arckv_press.bench.make_leaderboard import block_marks
    from arckv_press.bench.study_tables import STUDY_BLOCKS
    from arckv_press.runinfo import read_rows

    repo = Path(__file__).resolve().parents[1]
    for doc, name, source, make in STUDY_BLOCKS:
        text = (repo / doc).read_text(encoding="utf-8")
        start_mark, end_mark = block_marks(name, source)
        start, end = text.index(start_mark), text.index(end_mark)
        assert text[start + len(start_mark):end].strip("\n") == make(read_rows(repo / source)), (doc, name)


def _dev_row(method, ratio, doc, damage, config_id, command="python scripts/bench_fidelity.py --split dev"):
    return {"method": method, "ratio": ratio, "doc": doc, "damage": damage, "config_id": config_id, "indexer": "",
            "command": command}


def test_development_split_labels_rows_by_their_options_and_todays_defaults():
    """A row with today's ids is ``default`` (whatever its command said), another one is labelled by
    its ``--option`` values plus the known options that were defaults when it ran (checked against
    its ids), or by its config id when nothing gives its ids; cells are means over documents, with
    the count when a cell has fewer documents than the table."""
    from arckv_press.bench.study_tables import dev_damage, dev_split_markdown, selectors_markdown
    from arckv_press.models import DEFAULT_MODEL_ID
    from arckv_press.runinfo import CurrentIds

    ids = CurrentIds(DEFAULT_MODEL_ID)
    cur = {m: {r: ids(m, r)["config_id"] for r in (0.1, 0.02)} for m in ("arckv-ha", "arckv-vi", "am-omp")}
    rows = [_dev_row("arckv-ha", "0.1", "0", "0.2", cur["arckv-ha"][0.1], "x --option lambda_m=0.25"),
            _dev_row("arckv-ha", "0.1", "1", "0.4", cur["arckv-ha"][0.1]),
            _dev_row("arckv-ha", "0.02", "0", "0.5", cur["arckv-ha"][0.1], "x --option lambda_m=0.25 --threads 1"),
            _dev_row("arckv-ha", "0.02", "0", "0.7", "feedfacecafe"),
            _dev_row("arckv-ha", "0.02", "1", "0.9", "feedfacecafe", "x --option lambda_m=0.3"),
            _dev_row("arckv-vi", "0.1", "0", "0.3", cur["arckv-vi"][0.1])]
    damage = dev_damage(rows)
    assert damage[("arckv-ha", "default")] == {"0.1": (pytest.approx(0.3), 2)}
    # keep 10%'s defaults at keep 2%: the option named, plus the anchor search that was the default then
    assert damage[("arckv-ha", "lambda_m=0.25 anchor_search=scores")] == {"0.02": (0.5, 1)}
    assert damage[("arckv-ha", "config feedfacecafe")] == {"0.02": (pytest.approx(0.8), 2)}  # a command's claim is checked
    # a row whose command names no option but whose ids are those of a known option is named by it
    former = {**_dev_row("arckv", "0.1", "0", "0.5", ""),
              **CurrentIds(DEFAULT_MODEL_ID, {"indexer_rows": "all"})("arckv", 0.1)}
    assert dev_damage([former]) == {("arckv", "indexer_rows=all"): {"0.1": (0.5, 1)}}
    # a row of an option whose code changed since keeps the label of what it measured
    additive = {**former, "config_id": "30d356828b2a", "command": "x --option indexer_rows=corrected"}
    assert dev_damage([additive]) == {("arckv", "indexer_rows=corrected, additive estimate (superseded)"):
                                      {"0.1": (0.5, 1)}}
    lines = dev_split_markdown(rows).splitlines()
    assert lines[0] == "| method | options | keep 10% | keep 2% |"
    assert lines[2] == "| `arckv-ha` | default | 0.300 |  |"
    assert "| `arckv-ha` | `lambda_m=0.25 anchor_search=scores` |  | 0.500 (1 docs) |" in lines
    # the selector table needs a kept fraction every selector has: arckv has none here
    assert selectors_markdown(rows).startswith("(no kept fraction has development rows of all three selectors")
    learned = {**_dev_row("arckv", "0.1", "0", "0.25", ""), **CurrentIds(DEFAULT_MODEL_ID)("arckv", 0.1)}
    table = selectors_markdown([*rows, learned]).splitlines()
    assert table[0] == "| selector | keep 10% | mean |"
    assert table[2:] == ["| learned indexer (`arckv`) | **0.250** | **0.250** |", "| HA (`arckv-ha`) | 0.300 | 0.300 |",
                         "| VI (`arckv-vi`) | 0.300 | 0.300 |"]


def test_compaction_time_table_is_the_last_run_with_todays_defaults():
    """The block shows one run, the last with current ids (an older run and a run with other options
    are left out), with the same ratio lines bench_compaction.py prints."""
    from arckv_press.bench.bench_compaction import ratio_lines
    from arckv_press.bench.study_tables import compaction_time_markdown
    from arckv_press.models import DEFAULT_MODEL_ID
    from arckv_press.runinfo import CurrentIds

    cid = CurrentIds(DEFAULT_MODEL_ID)("arckv-ha", 0.1)["config_id"]

    def row(method, stage, seconds, date, config_id="", ratio="0.1", command="run B", threads="1"):
        return {"section": "model", "method": method, "ratio": ratio, "length": "4000", "stage": stage,
                "seconds": str(seconds), "config_id": config_id, "indexer": "", "date": date, "command": command,
                "machine": "cpu X", "threads": threads}

    rows = [row("none", "prefill", 10, "d1", ratio="1", command="run A"),
            row("arckv-ha", "repeat_prefill", 30, "d1", cid, command="run A"),
            row("arckv-ha", "compact_total", 99, "d1", cid, command="run A"),
            row("none", "prefill", 20, "d2", ratio="1"),
            row("arckv-ha", "repeat_prefill", 40, "d2", cid), row("arckv-ha", "merge", 2, "d2", cid),
            row("arckv-ha", "compact_total", 50, "d2", cid),
            row("am-omp-fast", "am_total", 100, "d2", CurrentIds(DEFAULT_MODEL_ID)("am-omp-fast", 0.1)["config_id"]),
            row("am-omp-fast", "compact_total", 120, "d2", CurrentIds(DEFAULT_MODEL_ID)("am-omp-fast", 0.1)["config_id"]),
            row("arckv-ha", "compact_total", 1, "d3", "0ther0ption00", command="run C"),
            row("none", "prefill", 5, "d4", ratio="1", command="run D", threads="2"),
            row("arckv-ha", "repeat_prefill", 15, "d4", cid, command="run D", threads="2"),
            row("arckv-ha", "compact_total", 18, "d4", cid, command="run D", threads="2")]
    two = compaction_time_markdown(rows, threads=2).splitlines()   # the last run on two threads, on its own
    assert two[0] == "Run of d4 on cpu X: `run D`" and any(line.endswith("| 3.0 | 18.0 |") for line in two)
    md = compaction_time_markdown(rows)
    lines = md.splitlines()
    assert lines[0] == "Run of d2 on cpu X: `run B`"
    table = [line for line in lines if line.startswith("| 4,000")]
    assert table[0].split(" | ")[2:5] == ["`arckv-ha`", "20.0", "40.0"] and table[0].endswith("| 10.0 | 50.0 |")
    assert table[1].endswith("| 100.0 | 120.0 | 120.0 |")
    results = {("none", 1.0, 4000): {"prefill": 20.0},
               ("arckv-ha", 0.1, 4000): {"repeat_prefill": 40.0, "merge": 2.0, "compact_total": 50.0},
               ("am-omp-fast", 0.1, 4000): {"am_total": 100.0, "compact_total": 120.0}}
    shown = ratio_lines(results, [4000], [0.1])
    assert len(shown) == 1 and "post/prefill 0.50" in shown[0] and "post 10.00x" in shown[0]
    assert f"- {shown[0].strip()}" in lines


def test_study_docs_without_their_markers_are_refused_unchanged(tmp_path):
    from arckv_press.bench.study_tables import STUDY_BLOCKS, update_study_docs

    for doc, _, source, _ in STUDY_BLOCKS:
        (tmp_path / doc).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / doc).write_text("no markers\n")
        (tmp_path / source).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / source).write_text("")
    with pytest.raises(ValueError, match="must contain the lines"):
        update_study_docs(tmp_path)
    assert all((tmp_path / doc).read_text() == "no markers\n" for doc, *_ in STUDY_BLOCKS)


def test_ruler_lengths_are_separate_benchmarks(ml, tmp_path):
    """RULER at 4K tokens is its own benchmark (``ruler_4k``, its group row named alike), so its rows never
    replace the 2K rows of the same method and kept fraction; the length comes from the tasks' metadata,
    else from the per-length metrics that hold a score; a file with several lengths or none is refused."""
    common = {"package_version": "0", "command": "c"}
    args = "pretrained=m,press=arckv,ratio=0.1"
    two = results_json(tmp_path / "a" / "results.json", "hf-arckv", args, {"ruler": 0.5, "cwe": 0.25}, 1.7e9)
    four = results_json(tmp_path / "b" / "results.json", "hf-arckv", args, {"ruler": 0.125, "cwe": 0.0}, 1.8e9, 4096)
    for path in (two, four):
        data = json.loads(path.read_text())
        data["group_subtasks"] = {"ruler": ["cwe"], "cwe": []}
        path.write_text(json.dumps(data))
    rows = ml.merge(ml.read_results(two, {}, False, common), ml.read_results(four, {}, False, common))
    assert {(r["benchmark"], r["task"], r["score"]) for r in rows} == {
        ("ruler", "ruler", 0.5), ("ruler", "cwe", 0.25), ("ruler_4k", "ruler_4k", 0.125), ("ruler_4k", "cwe", 0.0)}
    assert ml.benchmark_markdown(rows, "ruler_4k", "ruler_4k").splitlines()[2] == "| `arckv` | 0.12 |"
    assert ml.benchmark_markdown(rows, "quality", "quality") == "No rows yet."
    assert ml.ruler_benchmark(8192) == "ruler_8k" and ml.ruler_benchmark(3000) == "ruler_3000"

    data = json.loads(four.read_text())
    data["configs"] = {}  # no metadata: the per-length metrics tell (-1 = no samples at that length)
    data["results"]["ruler"].update({"2048,none": -1.0, "4096,none": 0.125})
    assert ml.ruler_length(data, four) == 4096
    data["results"]["ruler"]["2048,none"] = 0.5
    with pytest.raises(ValueError, match=r"\[2048, 4096\] sequence lengths"):
        ml.ruler_length(data, four)
    for t in ("ruler", "cwe"):
        data["results"][t] = {k: v for k, v in data["results"][t].items() if not k.split(",")[0].isdigit()}
    four.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="no readable sequence lengths"):
        ml.read_results(four, {}, False, common)
    assert ml.ruler_length({"results": {"quality": {}}, "group_subtasks": {}}, four) is None


def test_plot_points_carry_the_rows_intervals_and_draw_them(ml, tmp_path):
    """A point is the benchmark's group row with that row's interval; a mean over several task rows has
    none; the drawn error bars span exactly the interval; the plots are written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def r(method, ratio, task, score, lo="", hi="", secs=""):
        return {"model": "m", "benchmark": "ruler", "task": task, "method": method, "ratio": ratio, "score": score,
                "ci_low": lo, "ci_high": hi, "compaction_seconds": secs}

    rows = [r("arckv", "0.1", "ruler", "0.5", "0.25", "0.75", "3"), r("arckv", "0.1", "cwe", "0.9", "0.8", "1"),
            r("arckv", "0.2", "ruler", "0.6", secs="4"),
            r("snapkv", "0.1", "cwe", "0.2", "0.1", "0.3"), r("snapkv", "0.1", "vt", "0.4", "0.3", "0.5"),
            r("none", "1", "ruler", "0.7", "0.6", "0.8")]
    points = ml._benchmark_points(rows)
    assert sorted(points[("m", "arckv")]) == [ml.Point(0.1, 0.5, 3.0, 0.25, 0.75), ml.Point(0.2, 0.6, 4.0)]
    assert points[("m", "snapkv")] == [ml.Point(0.1, pytest.approx(0.3), None)]  # mean of two tasks: no interval
    fig, ax = plt.subplots()
    pts = sorted(points[("m", "arckv")])
    ml._draw(ax, [p.ratio for p in pts], pts, {"color": "C0", "linestyle": "-", "marker": "o"}, "arckv")
    (bars,) = ax.containers
    (segments,) = [c.get_segments() for c in bars.lines[2]]
    assert [[tuple(xy) for xy in seg] for seg in segments] == [[(0.1, 0.25), (0.1, 0.75)]]
    plt.close(fig)
    paths = ml.plot_benchmark("ruler", rows, tmp_path)
    assert [p.name for p in paths] == ["ruler_score_vs_ratio.png", "ruler_score_vs_time.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)


def test_evidence_cost_sums_compactions_times_seconds():
    """Each cell is the sum over kept fractions of compactions x mean seconds, in hours, with the
    compaction count (n_records, else n_examples); unranked benchmarks, per-task rows and rows without
    seconds are left out; the last column and row are the sums."""
    from arckv_press.bench.study_tables import evidence_cost_markdown

    def row(method, bench, task, ratio, seconds, n_records="", n_examples=""):
        return {"method": method, "benchmark": bench, "task": task, "ratio": ratio, "compaction_seconds": seconds,
                "n_records": n_records, "n_examples": n_examples}

    rows = [row("arckv", "ruler", "ruler", "0.1", "36", n_records="130"),       # 4680 s
            row("arckv", "ruler", "ruler", "0.2", "18", n_records="26"),        # 468 s
            row("arckv", "ruler", "cwe", "0.1", "999", n_records="10"),         # a task row: not summed
            row("arckv", "needle", "needle", "0.1", "40", n_examples="45"),     # 1800 s
            row("arckv", "quality", "quality", "0.1", "999", n_records="5"),    # not ranked: left out
            row("snapkv", "ruler_4k", "ruler_4k", "0.1", "72", n_records="50"), # 3600 s
            row("no-context", "ruler", "ruler", "0", "", n_records=""),        # no seconds: left out
            row("none", "ruler", "ruler", "1", "10", n_records="360")]          # 3600 s
    lines = evidence_cost_markdown(rows).splitlines()
    assert lines[0] == "| method | needles | continuation fidelity | RULER 2K | RULER 4K | all |"
    assert lines[2:] == [
        f"| `arckv` | 0.5 (45) |  | {(4680 + 468) / 3600:.1f} (156) |  | {(4680 + 468 + 1800) / 3600:.1f} (201) |",
        "| `snapkv` |  |  |  | 1.0 (50) | 1.0 (50) |",
        "| full cache |  |  | 1.0 (360) |  | 1.0 (360) |",
        f"| all | 0.5 (45) |  | {(4680 + 468 + 3600) / 3600:.1f} (516) | 1.0 (50) | "
        f"{(4680 + 468 + 1800 + 7200) / 3600:.1f} (611) |"]
