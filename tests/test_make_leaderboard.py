"""scripts/make_leaderboard.py: the rebuild from a sources manifest, on tiny fake lm-eval results,
hf-arckv records and per-case CSVs (no model), and on the committed sources (a copy rebuilt from
scratch gives the committed CSVs and docs byte for byte)."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
from conftest import load_script

from arckv_press.bench.leaderboard import doc_blocks, doc_tables, intervals, plots, readers, table
from arckv_press.bench.leaderboard.sources import load_sources

REPO = Path(__file__).resolve().parents[1]
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
COMMON = {"package_version": "0", "command": "c"}


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
        "configs": {t: {"metadata": {"max_seq_lengths": [ruler_length]}} for t in scores
                    if readers.canonical_task(t) in readers.RULER_TASKS},
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
            "model": MODEL, "press": press, "method": press, "ratio": ratio,
            "rank": 0, "document_index": i, "document_sha1": f"{i:040x}", "prefix_tokens": 10,
            "document_tokens": 100, "context_tokens": 110, "compaction_seconds": s, "cache_bytes": 1000 * (i + 1),
            "full_cache_bytes": 9000, "compacted_bytes": 500, "compacted_full_bytes": 8000,
            "realised_ratio": 0.1 + 0.02 * i, "compacted": True, "requests": 4, "tasks": tasks,
        }, sort_keys=True))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def manifest(root: Path, runs=(), superseded=(), cases=None, blocks=()) -> Path:
    """``root/leaderboards/sources.toml`` with outputs in ``root/leaderboards``; ``runs``: (root, extra
    TOML lines) or a root; ``superseded``: (by, [folders]); paths relative to ``root``."""
    lines = ['[outputs]', 'leaderboard = "leaderboards/leaderboard.csv"', 'comparisons = "leaderboards/comparisons.csv"',
             'plots = "leaderboards/plots"']
    if cases:
        lines += ["[cases]", *[f'{k} = "{v}"' for k, v in cases.items()]]
    for run in runs:
        run_root, extra = run if isinstance(run, tuple) else (run, "")
        lines += ["[[runs]]", f'root = "{run_root}"', 'about = "test runs"', extra]
    for by, folders in superseded:
        lines += ["[[superseded]]", f'by = "{by}"', 'why = "test"', "runs = " + json.dumps(list(folders))]
    for block in blocks:
        lines += ["[[block]]", *[f"{k} = {json.dumps(v)}" for k, v in block.items()]]
    path = root / "leaderboards" / "sources.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def read(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def row(rows, **kw):
    hits = [r for r in rows if all(r[k] == v for k, v in kw.items())]
    assert len(hits) == 1, (kw, hits)
    return hits[0]


# ---------------------------------------------------------------------------- the rebuild
def test_rebuild_from_declared_runs_and_records(ml, tmp_path, capsys):
    runs = tmp_path / "runs"
    results_json(runs / "quality" / "none_1" / "results.json", "hf", f"pretrained={MODEL}", {"quality": 0.5}, 1.7e9)
    results_json(runs / "quality" / "arckv_0.1" / "results.json", "hf-arckv", f"pretrained={MODEL},press=arckv,ratio=0.1",
                 {"quality": 0.4}, 1.7e9)
    results_json(runs / "quality" / "arckv_0.2" / "results.json", "hf-arckv", f"pretrained={MODEL},press=arckv,ratio=0.2",
                 {"quality": 0.45}, 1.7e9)
    results_json(runs / "quality" / "no-context_1" / "results.json", "hf-arckv",
                 f"pretrained={MODEL},press=none,ratio=1.0,drop_document=True", {"quality": 0.3}, 1.7e9)
    rec = records_jsonl(runs / "quality" / "arckv_0.1" / "arckv_compaction.jsonl", "arckv", 0.1, [1.0, 2.0, 6.0],
                        ["quality"])
    with open(rec, "a") as f:  # a record of another task must not enter the quality mean
        f.write(json.dumps({"model": MODEL, "press": "arckv", "ratio": 0.1, "compaction_seconds": 100.0,
                            "cache_bytes": 1, "realised_ratio": 0.9, "tasks": ["other"]}) + "\n")
    nohf = tmp_path / "plain"  # plain --model hf runs without the document, declared as such
    results_json(nohf / "quality" / "x" / "results.json", "hf", f"pretrained={MODEL}", {"quality": 0.25}, 1.7e9)
    path = manifest(tmp_path, runs=["runs"])
    ml.main(["--sources", str(path)])
    printed = capsys.readouterr().out
    assert printed.startswith("python scripts/make_leaderboard.py\n")  # the default manifest's place: no --sources
    assert "| quality | 4 |" in printed

    out = tmp_path / "leaderboards"
    rows = read(out / "leaderboard.csv")
    assert len(rows) == 4
    a01 = row(rows, method="arckv", ratio="0.1")
    assert a01["benchmark"] == "quality" and a01["task"] == "quality" and a01["model"] == MODEL
    assert float(a01["score"]) == pytest.approx(0.4) and a01["metric"] == "acc,none"
    assert float(a01["full_score"]) == pytest.approx(0.5) and float(a01["nocontext_score"]) == pytest.approx(0.3)
    assert float(a01["compaction_seconds"]) == pytest.approx(3.0)  # mean(1, 2, 6), not the 'other' task
    assert float(a01["cache_bytes"]) == pytest.approx(2000.0) and float(a01["realised_ratio"]) == pytest.approx(0.12)
    assert a01["n_examples"] == "5" and a01["n_records"] == "3" and a01["context_tokens"] == "110"
    assert a01["date"] == "2023-11-14T22:13:20Z" and a01["package_version"]
    assert a01["command"] == "python scripts/make_leaderboard.py"
    assert a01["source"] == "runs/quality/arckv_0.1/results.json"  # relative to the checkout the manifest is in
    assert row(rows, method="arckv", ratio="0.2")["compaction_seconds"] == ""  # no records for that run
    assert row(rows, method="none")["ratio"] == "1" and row(rows, method="no-context")["ratio"] == "0"
    for kind in ("ratio", "time"):
        png = out / "plots" / f"quality_score_vs_{kind}.png"
        assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"

    # a rebuild from the same sources writes the same bytes (nothing is merged from the previous file)
    before = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    (out / "leaderboard.csv").write_text("stale\n")
    ml.main(["--sources", str(path)])
    assert {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before

    # a second run of one key is refused until the manifest declares which one it replaces
    results_json(tmp_path / "more" / "quality" / "arckv_0.1" / "results.json", "hf-arckv",
                 f"pretrained={MODEL},press=arckv,ratio=0.1", {"quality": 0.42}, 1.8e9)
    path = manifest(tmp_path, runs=["runs", "more"])
    with pytest.raises(ValueError, match="two sources give the row .*declare the older run superseded"):
        ml.main(["--sources", str(path), "--no-plots"])
    path = manifest(tmp_path, runs=["runs", "more"], superseded=[("more", ["runs/quality/arckv_0.1"])])
    ml.main(["--sources", str(path), "--no-plots"])
    rows = read(out / "leaderboard.csv")
    assert float(row(rows, method="arckv", ratio="0.1")["score"]) == pytest.approx(0.42) and len(rows) == 4
    # a superseded folder whose rows the other set does not all replace is refused
    results_json(runs / "quality" / "arckv_0.1" / "results.json", "hf-arckv", f"pretrained={MODEL},press=arckv,ratio=0.1",
                 {"quality": 0.4, "quality_gen": 0.1}, 1.7e9)
    with pytest.raises(ValueError, match="has no row for quality_gen / quality_gen / arckv / 0.1"):
        ml.main(["--sources", str(path), "--no-plots"])

    path = manifest(tmp_path, runs=[("plain", "no_context = true")])
    ml.main(["--sources", str(path), "--no-plots"])
    assert [(r["method"], r["ratio"], r["score"]) for r in read(out / "leaderboard.csv")] == [("no-context", "0", "0.25")]


def test_records_next_to_a_result_win_and_resumed_documents_count_once(ml, tmp_path):
    """run_evals.py layout: <bench>/<method>_<ratio>/{results.json, arckv_compaction.jsonl}. The same
    press and ratio on another benchmark must not enter this benchmark's compaction seconds, and a
    document compacted twice (run interrupted and resumed) counts once, with its last record."""
    runs = tmp_path / "lm_eval"
    for bench, secs in (("ruler", [2.0, 4.0]), ("quality", [50.0])):
        folder = runs / bench / "kvzip_0.1"
        results_json(folder / "results.json", "hf-arckv", f"pretrained={MODEL},press=kvzip,ratio=0.1", {bench: 0.5}, 1.7e9)
        records_jsonl(folder / "arckv_compaction.jsonl", "kvzip", 0.1, secs, [bench])
    with open(runs / "ruler" / "kvzip_0.1" / "arckv_compaction.jsonl") as f:
        first = json.loads(f.readline())
    with open(runs / "ruler" / "kvzip_0.1" / "arckv_compaction.jsonl", "a") as f:  # document 0 again, resumed
        f.write(json.dumps({**first, "compaction_seconds": 6.0}) + "\n")
    ml.main(["--sources", str(manifest(tmp_path, runs=["lm_eval"])), "--no-plots"])
    rows = read(tmp_path / "leaderboards" / "leaderboard.csv")
    ruler = row(rows, benchmark="ruler", method="kvzip")
    assert float(ruler["compaction_seconds"]) == pytest.approx(5.0)  # mean(6 (last copy of doc 0), 4)
    assert ruler["n_records"] == "2"
    assert float(row(rows, benchmark="quality", method="kvzip")["compaction_seconds"]) == pytest.approx(50.0)


def test_old_and_new_task_names_are_one_benchmark(ml, tmp_path):
    """A stored run of ``ruler`` / ``niah_single_1`` and a new run of ``arckv_ruler`` /
    ``arckv_niah_single_1`` (and LongBench's) give the same benchmark, task rows and example ids, so
    they pair in the comparisons; records naming the new task serve its row."""
    def run(folder, press, names, score):
        path = results_json(folder / "results.json", "hf-arckv", f"pretrained={MODEL},press={press},ratio=0.1",
                            {names[0]: score, names[1]: score, names[2]: 0.5}, 1.7e9)
        data = json.loads(path.read_text())
        data["group_subtasks"] = {names[0]: [names[1]]}  # as lm-eval writes it
        path.write_text(json.dumps(data))
        (folder / "sample_scores.json").write_text(json.dumps(
            {names[1]: {str(i): {"acc": float(i < 3 * score)} for i in range(4)}}))
        records_jsonl(folder / "arckv_compaction.jsonl", press, 0.1, [2.0], [names[1]])

    run(tmp_path / "runs" / "ruler" / "arckv_0.1", "arckv", ("ruler", "niah_single_1", "longbench_multifieldqa_zh"), 0.75)
    run(tmp_path / "runs" / "ruler" / "snapkv_0.1", "snapkv",
        ("arckv_ruler", "arckv_niah_single_1", "arckv_longbench_multifieldqa_zh"), 0.25)
    ml.main(["--sources", str(manifest(tmp_path, runs=["runs"])), "--no-plots"])
    rows = read(tmp_path / "leaderboards" / "leaderboard.csv")
    assert {(r["benchmark"], r["task"], r["method"]) for r in rows} == {
        (b, t, m) for m in ("arckv", "snapkv")
        for b, t in (("ruler", "ruler"), ("ruler", "niah_single_1"), ("longbench", "longbench_multifieldqa_zh"))}
    new = row(rows, task="niah_single_1", method="snapkv")
    assert set(json.loads(new["example_scores"])) == {f"niah_single_1/{i}" for i in range(4)}
    assert float(new["compaction_seconds"]) == 2.0
    pairs = read(tmp_path / "leaderboards" / "comparisons.csv")
    assert row(pairs, task="niah_single_1", method="arckv", other="snapkv")["n"] == "4"
    assert readers.canonical_task("arckv_quality") == "quality" and readers.canonical_task("quality") == "quality"
    assert "niah_multikey_3" in readers.RULER_TASKS and len(readers.RULER_TASKS) == 14


def test_needle_rows_and_probes_plot(ml, tmp_path):
    head = "method,ratio,length,depth,seed,context_tokens,needle,answer,correct,compaction_s,answer_s,cache_bytes,masked,model,command,date,package_version,machine\n"
    body = (
        "none,1,1000,0,0,999,1,1,1,1.0,1.0,100,0,m,c,2026-01-01T00:00:00Z,0.1.0,x\n"
        "arckv-ha,0.1,1000,0,0,999,1,2,0,3.0,1.0,10,0,m,c,2026-01-01T00:00:00Z,0.1.0,x\n"
        "arckv-ha,0.1,1000,0.5,0,999,1,1,1,5.0,1.0,20,0,m,c,2026-01-02T00:00:00Z,0.1.0,x\n"
    )
    (tmp_path / "needle.csv").write_text(head + body)
    (tmp_path / "probes.csv").write_text(
        "config,method,ratio,options,needle_found,needle_total,damage,damage_docs,compaction_seconds,date,version,command\n"
        "arckv-ha,arckv-ha,0.2,{},1,2,0.09,1,35.8,2026-11-22,0.1.0,c\n"
        "kvzip,kvzip,0.2,{},2,2,0.2,1,10.0,2026-11-22,0.1.0,c\n"
    )
    ml.main(["--sources", str(manifest(tmp_path, cases={"needle": "needle.csv", "probes": "probes.csv"}))])
    rows = read(tmp_path / "leaderboards" / "leaderboard.csv")
    ha = row(rows, benchmark="needle", method="arckv-ha")
    assert float(ha["score"]) == pytest.approx(0.5)
    assert float(ha["compaction_seconds"]) == pytest.approx(4.0) and float(ha["cache_bytes"]) == pytest.approx(15.0)
    assert float(ha["full_score"]) == pytest.approx(1.0)
    assert ha["date"] == "2026-01-02T00:00:00Z" and ha["n_examples"] == "2" and ha["source"] == "needle.csv"
    plotted = tmp_path / "leaderboards" / "plots"
    assert (plotted / "needle_score_vs_ratio.png").exists() and (plotted / "probes.png").exists()


def test_needle_framing_column_and_extra_cases(tmp_path):
    """The needle reader takes extra columns and rows: cases with ``framing`` other than ``ruler`` are
    benchmark ``needle_<framing>``, rows without the column (or empty) are ``ruler``; new depths are
    more cases of the same benchmark."""
    head = "method,ratio,length,depth,seed,correct,compaction_s,cache_bytes,model,date,framing,extra\n"
    body = ("kvzip,0.1,1000,0,0,1,1.0,10,m,d1,,a\n"
            "kvzip,0.1,1000,0.95,0,0,1.0,10,m,d1,ruler,b\n"
            "kvzip,0.1,1000,0,0,0,2.0,10,m,d2,pipeline,c\n")
    (tmp_path / "needle.csv").write_text(head + body)
    rows = readers.read_needle(tmp_path / "needle.csv", COMMON, tmp_path)
    by = {r["benchmark"]: r for r in rows}
    assert set(by) == {"needle", "needle_pipeline"} and by["needle_pipeline"]["task"] == "needle_pipeline"
    assert by["needle"]["score"] == 0.5 and json.loads(by["needle"]["example_scores"]) == {"1000/0/0": 1.0,
                                                                                         "1000/0.95/0": 0.0}
    assert by["needle_pipeline"]["score"] == 0.0 and by["needle_pipeline"]["n_examples"] == 1
    (tmp_path / "old.csv").write_text("method,ratio,length,depth,seed,correct,compaction_s,cache_bytes,model,date\n"
                                      "kvzip,0.1,1000,0,0,1,1.0,10,m,d1\n")
    assert [r["benchmark"] for r in readers.read_needle(tmp_path / "old.csv", COMMON, tmp_path)] == ["needle"]
    table_rows = [{**r, "n_examples": str(r["n_examples"])} for r in rows]
    assert doc_tables.benchmark_markdown(table_rows, "needle_pipeline", "needle_pipeline").splitlines()[2] == \
        "| `kvzip` | 0/1 |"


def case_leaderboard(ml, tmp_path, name: str, text: str) -> list[dict]:
    """The leaderboard rows the rebuild makes from one per-case CSV (``needle`` or ``fidelity``)."""
    (tmp_path / f"{name}.csv").write_text(text)
    ml.main(["--sources", str(manifest(tmp_path, cases={name: f"{name}.csv"}))])
    return read(tmp_path / "leaderboards" / "leaderboard.csv")


def test_needle_rows_of_an_older_indexer_checkpoint_are_left_out(ml, tmp_path):
    head = ("method,ratio,length,depth,seed,context_tokens,needle,answer,correct,compaction_s,answer_s,cache_bytes,"
            "masked,indexer,model,command,date,package_version,machine\n")
    rows = case_leaderboard(ml, tmp_path, "needle", head + (
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
    rows = case_leaderboard(ml, tmp_path, "fidelity", head + (
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
    assert (tmp_path / "leaderboards" / "plots" / "fidelity_score_vs_ratio.png").exists()


def test_rows_made_under_older_compaction_defaults_are_left_out(ml, tmp_path):
    """Same method and checkpoint, but another ``config_id`` (a default changed): only the newest
    row's configuration counts, and the leaderboard names it."""
    head = ("method,ratio,doc,doc_tokens,cont_tokens,nll,nll_full,nll_none,damage,compaction_s,cache_bytes,"
            "indexer,config_id,model,command,date,package_version,machine\n")
    rows = case_leaderboard(ml, tmp_path, "fidelity", head + (
        "arckv-ha,0.1,0,1500,256,2.9,2.0,3.0,0.9,99.0,100,,cfgold000000,m,c,2026-01-01T00:00:00Z,0.1.0,x\n"
        "arckv-ha,0.1,1,1500,256,2.9,2.0,3.0,0.7,99.0,100,,cfgold000000,m,c,2026-01-01T00:00:00Z,0.1.0,x\n"
        "arckv-ha,0.1,0,1500,256,2.1,2.0,3.0,0.2,10.0,100,,cfgnew111111,m,c,2026-01-02T00:00:00Z,0.1.0,x\n"
        "snapkv,0.1,0,1500,256,2.5,2.0,3.0,0.5,1.0,50,,,m,c,2026-01-01T00:00:00Z,0.1.0,x\n"
    ))
    ha = row(rows, benchmark="fidelity", method="arckv-ha")
    assert float(ha["score"]) == pytest.approx(0.8) and ha["config_id"] == "cfgnew111111" and ha["n_examples"] == "1"
    snap = row(rows, benchmark="fidelity", method="snapkv")
    assert snap["config_id"] == "" and float(snap["score"]) == pytest.approx(0.5)


def test_a_methods_rows_of_another_checkpoint_leave_its_line_whole(ml, tmp_path, capsys):
    """A method rerun with a new checkpoint at one kept fraction: its other kept fractions (old
    checkpoint) are left out of the table (and named in the output) instead of sharing a line with
    the new one; methods without ids are untouched; a resumed run whose records miss a task still
    names its checkpoint (results.json's arckv_run)."""
    runs = tmp_path / "runs"

    def run(name, press, ratio, score, date, indexer):
        path = results_json(runs / name / "results.json", "hf-arckv", f"pretrained={MODEL},press={press},ratio={ratio}",
                            {"ruler": score}, date)
        records_jsonl(runs / name / "arckv_compaction.jsonl", press, ratio, [1.0, 3.0], ["ruler"])
        lines = [json.loads(line) | {"indexer": indexer, "config_id": "cfg000000000"}
                 for line in (runs / name / "arckv_compaction.jsonl").read_text().splitlines()]
        (runs / name / "arckv_compaction.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        return path

    run("old02", "arckv", 0.2, 0.36, 1.7e9, "old000000000")
    run("new01", "arckv", 0.1, 0.31, 1.8e9, "new111111111")
    run("snap", "snapkv", 0.1, 0.05, 1.6e9, "")
    path = manifest(tmp_path, runs=["runs"])
    ml.main(["--sources", str(path), "--no-plots"])
    assert "left out (other ids than the method's current rows): ruler / ruler / arckv / 0.2 (indexer old000000000" \
        in capsys.readouterr().out
    current = read(tmp_path / "leaderboards" / "leaderboard.csv")
    assert {(r["method"], r["ratio"], r["indexer"]) for r in current} == {
        ("arckv", "0.1", "new111111111"), ("snapkv", "0.1", "")}
    assert float(row(current, method="arckv")["context_tokens"]) == 110

    shutil.rmtree(runs / "old02")
    path_new = run("new02", "arckv", 0.2, 0.37, 1.9e9, "new111111111")
    data = json.loads(path_new.read_text())
    data["results"]["other_task"] = {"alias": "other_task", "acc,none": 0.5}
    data["arckv_run"] = {"indexer": "new111111111", "config_id": "cfg000000000"}
    path_new.write_text(json.dumps(data))
    ml.main(["--sources", str(path), "--no-plots"])
    current = read(tmp_path / "leaderboards" / "leaderboard.csv")
    assert {(r["task"], r["ratio"], r["indexer"], r["config_id"]) for r in current if r["method"] == "arckv"} == {
        ("ruler", "0.1", "new111111111", "cfg000000000"), ("ruler", "0.2", "new111111111", "cfg000000000"),
        ("other_task", "0.2", "new111111111", "cfg000000000")}


def test_rows_of_a_non_default_option_never_replace_the_defaults():
    """A newer row made with ``--option`` (another config_id) does not hide the default's rows."""
    from arckv_press.models import DEFAULT_MODEL_ID
    from arckv_press.registry import result_ids

    ids = result_ids("arckv-ha", DEFAULT_MODEL_ID, 0.1)
    base = {"method": "arckv-ha", "model": DEFAULT_MODEL_ID, "indexer": ids["indexer"], "ratio": "0.1"}
    default = [{**base, "config_id": ids["config_id"], "date": "2026-01-01", "n": str(i)} for i in range(3)]
    option = {**base, "config_id": "not-the-default", "date": "2026-12-31", "n": "x"}
    chosen_ids, chosen = readers.newest_rows([*default, option])
    assert chosen_ids == ids and chosen == default
    # without any default row, the newest configuration is reported (e.g. an old model's rows)
    assert readers.newest_rows([option])[1] == [option]
    # a default that depends on the kept fraction (the lambda_m schedule): each kept fraction's own
    # default id is current, and keep 2% made with keep 10%'s coefficient is not
    low = result_ids("arckv-ha", DEFAULT_MODEL_ID, 0.02)["config_id"]
    assert low != ids["config_id"]
    at_low = {**base, "ratio": "0.02", "config_id": low, "date": "2026-02-01", "n": "low"}
    old_low = {**base, "ratio": "0.02", "config_id": ids["config_id"], "date": "2026-01-01", "n": "old"}
    assert readers.newest_rows([*default, at_low, old_low])[1] == [*default, at_low]
    assert readers.newest_rows([option], strict=True) == ({"indexer": "", "config_id": ""}, [])


def test_a_benchmark_not_rerun_after_a_default_change_shows_no_cell():
    """Once a method has rows of its current defaults in one benchmark, its rows of earlier defaults
    are left out of every benchmark, also where they are the only ones (a benchmark run at one kept
    fraction, as RULER at 4K); another model's rows, with no current row anywhere, keep their newest."""
    from arckv_press.models import DEFAULT_MODEL_ID
    from arckv_press.registry import result_ids

    ids = result_ids("arckv-ha", DEFAULT_MODEL_ID, 0.1)
    base = {"method": "arckv-ha", "model": DEFAULT_MODEL_ID, "indexer": ids["indexer"], "ratio": "0.1"}
    rerun = {**base, "benchmark": "needle", "config_id": ids["config_id"], "date": "2026-12-06"}
    stale_needle = {**base, "benchmark": "needle", "config_id": "earlier00000", "date": "2026-12-01"}
    stale_4k = {**base, "benchmark": "ruler_4k", "config_id": "earlier00000", "date": "2026-12-01"}
    other = {**base, "model": "someone/else", "benchmark": "ruler_4k", "config_id": "theirs000000", "date": "2026-12-01"}
    current, left_out = readers.current_rows([rerun, stale_needle, stale_4k, other])
    assert current == [rerun, other] and left_out == [stale_needle, stale_4k]
    # before any rerun, the earlier defaults' rows stay (each benchmark's newest)
    assert readers.current_rows([stale_needle, stale_4k])[0] == [stale_needle, stale_4k]


def test_bad_sources_are_refused_by_name(ml, tmp_path):
    with pytest.raises(ValueError, match="no sources manifest"):
        ml.main(["--sources", str(tmp_path / "nothing.toml")])
    path = manifest(tmp_path, runs=["missing"])
    with pytest.raises(ValueError, match=r"\[\[runs\]\] entry 1: 'missing' is no folder"):
        load_sources(path)
    path.write_text(path.read_text().replace('[outputs]', '[outputs]\nextra = 1'))
    with pytest.raises(ValueError, match=r"\[outputs\]: unknown key\(s\) \['extra'\]"):
        load_sources(path)
    bad = tmp_path / "runs" / "x" / "results.json"
    bad.parent.mkdir(parents=True)
    bad.write_text(json.dumps({"config": {}}))
    with pytest.raises(ValueError, match="not an lm-eval results file"):
        ml.main(["--sources", str(manifest(tmp_path, runs=["runs"]))])
    bad.unlink()
    readme = tmp_path / "README.md"
    readme.write_text("no markers\n")
    path = manifest(tmp_path, runs=["runs"], blocks=[{"doc": "README.md", "name": "headline", "table": "headline",
                                                       "source": "leaderboards/leaderboard.csv", "title": "x"}])
    with pytest.raises(ValueError, match=r"block 'headline' of README.md: unknown \['title'\] parameter"):
        ml.main(["--sources", str(path)])
    path = manifest(tmp_path, runs=["runs"], blocks=[{"doc": "README.md", "name": "headline", "table": "headline",
                                                       "source": "leaderboards/leaderboard.csv"}])
    with pytest.raises(ValueError, match="must contain the lines"):
        ml.main(["--sources", str(path), "--no-plots"])
    assert readme.read_text() == "no markers\n"


# ---------------------------------------------------------------------------- the committed sources
def _copy_inputs(sources, dest: Path) -> Path:
    """The declared inputs of ``sources`` (run folders without their request caches, CSVs, docs with
    their generated blocks emptied) copied under ``dest``; returns the copy's manifest."""
    root = sources.root

    def put(path: Path) -> None:
        target = dest / path.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir():
            shutil.copytree(path, target, ignore=shutil.ignore_patterns("*.db"), dirs_exist_ok=True)
        else:
            shutil.copy2(path, target)

    put(sources.path)
    for path in (*[r.root for r in sources.runs], sources.needle, sources.fidelity, sources.probes):
        if path is not None:
            put(path)
    for b in sources.blocks:
        if root / b.source != sources.leaderboard:
            put(root / b.source)
        for value in b.params.values():
            if isinstance(value, str) and (root / value).is_file():
                put(root / value)
        if not (dest / b.doc).exists():
            put(root / b.doc)
    for doc in {b.doc for b in sources.blocks}:  # delete the generated outputs of the docs
        doc_blocks.update_doc(dest / doc, [(b.name, b.source, "") for b in sources.blocks if b.doc == doc])
    return dest / sources.relative(sources.path)


def test_a_rebuild_from_scratch_gives_the_committed_outputs(ml, tmp_path):
    """The committed leaderboard, comparisons and every generated doc block are what a rebuild of a
    copy of the declared inputs writes, with no output left to merge with: byte for byte."""
    sources = load_sources()
    copy = load_sources(_copy_inputs(sources, tmp_path))
    assert not copy.leaderboard.exists() and not copy.comparisons.exists()
    ml.rebuild(copy, plots=False)
    for path in (sources.leaderboard, sources.comparisons, *{sources.root / b.doc for b in sources.blocks}):
        got = tmp_path / sources.relative(path)
        assert got.read_bytes() == path.read_bytes(), f"{sources.relative(path)} differs from its rebuild"


def test_every_generated_block_in_the_docs_is_the_generated_one(ml):
    """Each declared block of the README and docs/ equals its generator's output on the committed
    CSV it names (a quicker check than the rebuild, with the block named on failure); a benchmark
    table sits under the heading its title gives."""
    from arckv_press.runinfo import read_rows

    sources = load_sources()
    assert {b.doc for b in sources.blocks} >= {"README.md", "docs/results.md", "docs/indexer.md"}
    for b in sources.blocks:
        text = (sources.root / b.doc).read_text(encoding="utf-8")
        body = doc_blocks.block_body(text, b.name, b.source, b.doc)
        assert body == ml.generate_block(sources, b, lambda source: read_rows(sources.root / source)), (b.doc, b.name)
        if b.table == "benchmark":
            start = text.index(doc_blocks.block_marks(b.name, b.source)[0])
            assert text[:start].rstrip().endswith(f"### {b.params['title']}"), b.name


def test_every_run_folder_is_declared_and_every_plot_is_there():
    """Every run set under leaderboards/runs/ (but the archive) is a declared source, and the plots
    folder holds both plots of every benchmark of the leaderboard and the probes plot."""
    from arckv_press.runinfo import read_rows

    sources = load_sources()
    declared = {r.root for r in sources.runs}
    on_disk = {p.resolve() for p in (sources.root / "leaderboards" / "runs").iterdir() if p.is_dir() and p.name != "archive"}
    assert on_disk == declared
    benchmarks = {r["benchmark"] for r in read_rows(sources.leaderboard)}
    for bench in benchmarks:
        for kind in ("ratio", "time"):
            assert (sources.plots / f"{bench}_score_vs_{kind}.png").is_file(), bench
    assert (sources.plots / "probes.png").is_file() and (sources.plots / "long_context_scaling.png").is_file()


def test_plots_are_the_same_bytes_from_the_same_rows(ml, tmp_path):
    """Two rebuilds of the same sources write identical PNGs (no version or date in their metadata)."""
    shots = []
    for name in ("a", "b"):
        root = tmp_path / name
        results_json(root / "runs" / "quality" / "arckv_0.1" / "results.json", "hf-arckv",
                     f"pretrained={MODEL},press=arckv,ratio=0.1", {"quality": 0.4}, 1.7e9)
        results_json(root / "runs" / "quality" / "none_1" / "results.json", "hf", f"pretrained={MODEL}", {"quality": 0.5},
                     1.7e9)
        ml.main(["--sources", str(manifest(root, runs=["runs"]))])
        shots.append({p.name: p.read_bytes() for p in (root / "leaderboards" / "plots").iterdir()})
    assert shots[0] == shots[1] and set(shots[0]) == {"quality_score_vs_ratio.png", "quality_score_vs_time.png"}
    assert b"Matplotlib version" not in shots[0]["quality_score_vs_ratio.png"]


def test_the_leaderboards_readme_lists_every_entry():
    """leaderboards/README.md names every file and folder at the top level and one level down (as
    ``name`` or ``folder/name`` in backticks), and the top level holds at most twelve entries."""
    folder = REPO / "leaderboards"
    text = (folder / "README.md").read_text(encoding="utf-8")
    top = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    assert len(top) <= 12, [p.name for p in top]
    missing = [p.name for p in top if f"`{p.name}`" not in text and f"`{p.name}/`" not in text]
    for sub in (p for p in top if p.is_dir()):
        for p in sorted(sub.iterdir()):
            rel = f"{sub.name}/{p.name}"
            if not any(f"`{form}`" in text for form in (rel, rel + "/", p.name, p.name + "/")):
                missing.append(rel)
    assert not missing, f"leaderboards/README.md does not list {missing}"


# ---------------------------------------------------------------------------- the parts
def test_method_styles_tell_a_dozen_methods_and_their_families_apart():
    """Twelve method lines (more than tab10's ten colours): every line has its own colour, and the
    line style says the family of methods.py (ARC-KV solid, Attention Matching dashed, kvpress
    dotted; a name methods.py does not know is a kvpress press), also when labels carry the model."""
    from arckv_press.methods import METHODS

    methods = ["arckv", "arckv-ha", "arckv-vi", "am-omp", "am-omp-fast", "am-ha", "snapkv", "kvzip",
               "expected_attention", "knorm", "streaming_llm", "tova"]
    styles = plots.method_styles({m: m for m in methods})
    assert len({s["color"] for s in styles.values()}) == len(methods)
    want = {"arckv": "-", "am": "--", "kvpress": ":"}
    for m in methods:
        assert styles[m]["linestyle"] == want[METHODS[m].family if m in METHODS else "kvpress"], m
    assert plots.method_family("amazing_press") == "kvpress" and plots.method_family("am-ha") == "am"
    labelled = plots.method_styles({"smollm2 arckv": "arckv", "qwen3 arckv": "arckv", "smollm2 am-ha": "am-ha"})
    assert labelled["qwen3 arckv"]["linestyle"] == "-" and labelled["smollm2 am-ha"]["linestyle"] == "--"
    assert labelled["qwen3 arckv"]["color"] != labelled["smollm2 arckv"]["color"]
    assert plots.method_styles({m: m for m in reversed(methods)}) == styles  # order of appearance does not matter


RANKED = [("needles", "needle", "needle"), ("continuation fidelity", "fidelity", "continuation"),
          ("RULER 2K", "ruler", "ruler"), ("RULER 4K", "ruler_4k", "ruler_4k")]


def test_best_at_keep_10_percent_names_the_runner_up_and_the_test():
    """The best compact method and the runner-up at keep 10% per ranked benchmark, with the paired
    test on their shared examples; references never count; without examples it says so."""
    def r(bench, task, method, score, scores=None, ratio="0.1", n="20"):
        return {"benchmark": bench, "task": task, "method": method, "ratio": ratio, "score": score, "n_examples": n,
                "example_scores": intervals.example_scores(scores) if scores else ""}

    good = {f"e{i}": 1.0 for i in range(20)}
    bad = {f"e{i}": float(i < 2) for i in range(20)}
    rows = [r("needle", "needle", "arckv", "1.0", good), r("needle", "needle", "kvzip", "0.1", bad),
            r("needle", "needle", "none", "1.0", good), r("needle", "needle", "snapkv", "0.9", good, ratio="0.2"),
            r("ruler", "ruler", "kvzip", "0.39"), r("ruler", "ruler", "arckv-ha", "0.35"),
            r("ruler_4k", "ruler_4k", "arckv", "0.25", {"a": 0.5, "b": 0.0}),
            r("ruler_4k", "ruler_4k", "snapkv", "0.5", {"a": 1.0, "b": 0.0}),
            r("ruler_4k", "ruler_4k", "none", "0.9", {"a": 1.0, "b": 1.0})]
    lines = doc_tables.best_markdown(rows, RANKED).splitlines()
    assert lines[0].startswith("- needles: `arckv` 20/20, runner-up `kvzip` 2/20: significant (difference +0.900")
    assert lines[1] == "- RULER 2K: `kvzip` 0.39, runner-up `arckv-ha` 0.35: not tested (no per-example scores for both)"
    # the 4K rows are their own benchmark: the 2K methods never enter it, and the full cache is no candidate
    assert lines[2].startswith("- RULER 4K: `snapkv` 0.50, runner-up `arckv` 0.25: a tie (difference +0.250, "
                               "95% interval [+0.000, +0.500], sign test p = 1, 2 shared examples)")
    assert len(lines) == 3  # no fidelity rows: no line
    assert doc_tables.best_markdown(rows, RANKED[2:3]).splitlines() == [lines[1]]  # only the benchmarks declared


def test_headline_table_from_rows_and_doc_update(tmp_path):
    def r(bench, task, method, ratio, score, n="", seconds=""):
        return {"benchmark": bench, "task": task, "method": method, "ratio": ratio, "score": score,
                "n_examples": n, "compaction_seconds": seconds}

    rows = [r("needle", "needle", "arckv", "0.1", "0.8", "15"), r("needle", "needle", "none", "1", "0.85", "20"),
            r("fidelity", "continuation", "arckv", "0.2", "0.974", "4", "12.34"),
            r("fidelity", "continuation", "arckv", "0.1", "0.9", "4", "5"),
            r("fidelity", "continuation", "arckv", "0.05", "0.5", "4", "3"),
            r("ruler", "ruler", "snapkv", "0.05", "0.0449"), r("ruler", "ruler", "none", "1", "0.429"),
            r("ruler", "niah_single_1", "snapkv", "0.05", "0.9")]  # a subtask never enters the table
    rows[0].update(ci_low="0.6", ci_high="0.9333")
    rows[3].update(ci_low="0.85", ci_high="0.95")
    rows[2].update(ci_low="0.9", ci_high="1")  # keep 20%: the table shows only keep 10%'s intervals
    rows[6].update(ci_low="0.3", ci_high="0.55")
    lines = doc_tables.headline_markdown(rows).splitlines()
    arckv = next(line for line in lines if line.startswith("| `arckv` |"))
    assert arckv == "| `arckv` | - · 12/15 [0.60, 0.93] · - | 0.97 · 0.90 [0.85, 0.95] · 0.50 | - | 12.3 · 5.0 · 3.0 |"
    assert next(line for line in lines if line.startswith("| `snapkv` |")) == "| `snapkv` | - | - | - · - · 0.04 | - |"
    assert lines[-2] == "| full cache | 17/20 | - | 0.43 [0.30, 0.55] | - |"
    start, end = doc_blocks.block_marks("headline", "lb.csv")
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{start}\nold\n{end}\nrest\n")
    assert doc_blocks.update_doc(readme, [("headline", "lb.csv", "| t |")])
    assert readme.read_text() == f"intro\n{start}\n| t |\n{end}\nrest\n"
    assert not doc_blocks.update_doc(readme, [("headline", "lb.csv", "| t |")])  # unchanged
    readme.write_text(f"{end}\n{start}\n")
    with pytest.raises(ValueError, match="must contain"):
        doc_blocks.update_doc(readme, [("headline", "lb.csv", "| t |")])


def test_cross_model_table_keeps_models_apart():
    """The cross-model table: a row per benchmark and model (the default model first, models without
    rows left out), keep 10% with its interval then keep 5% per compact method, the references with
    theirs; the per-model tables (``of_model``) read the default model's rows only, so a second
    model's rows never overwrite the default model's in the headline."""
    from arckv_press.models import DEFAULT_MODEL_ID, GEMMA3_MODEL_ID

    def r(model, bench, method, ratio, score, n="4", **kw):
        task = "continuation" if bench == "fidelity" else bench
        return {"model": model, "benchmark": bench, "task": task, "method": method, "ratio": ratio, "score": score,
                "n_examples": n, **kw}

    rows = [r(GEMMA3_MODEL_ID, "fidelity", "arckv", "0.1", "0.7", ci_low="0.6", ci_high="0.8"),
            r(GEMMA3_MODEL_ID, "fidelity", "none", "1", "1", ci_low="1", ci_high="1"),
            r(GEMMA3_MODEL_ID, "needle", "kvzip", "0.05", "0.5", "2"),
            r(DEFAULT_MODEL_ID, "fidelity", "arckv", "0.1", "0.9"), r(DEFAULT_MODEL_ID, "fidelity", "arckv", "0.05", "0.8"),
            r(DEFAULT_MODEL_ID, "fidelity", "snapkv", "0.1", "0.85"), r(DEFAULT_MODEL_ID, "ruler", "arckv", "0.2", "0.3")]
    lines = doc_tables.cross_model_markdown(rows).splitlines()
    assert lines[0] == "| benchmark @ model | full | no context | AM (OMP-fast) | EA | SnapKV | KVzip | ARC-KV |"
    assert lines[2:] == [
        "| continuation fidelity @ smollm2-135m | - | - | - | - | 0.85 · - | - | 0.90 · 0.80 |",
        "| needles @ gemma3-270m | - | - | - | - | - | - · 1/2 | - |",
        "| continuation fidelity @ gemma3-270m | 1.00 [1.00, 1.00] | - | - | - | - | - | 0.70 [0.60, 0.80] · - |"]
    assert doc_tables.of_model(rows) == rows[3:]
    assert doc_tables.of_model(rows, GEMMA3_MODEL_ID) == rows[:3]
    headline = doc_tables.headline_markdown(doc_tables.of_model(rows)).splitlines()
    assert next(line for line in headline if line.startswith("| `arckv` |")) == "| `arckv` | - | - · 0.90 · 0.80 | 0.30 · - · - | - |"


def test_per_model_tables_are_made_from_one_models_rows():
    """A per-model table's block gets the rows of its ``model`` parameter only (the default model's
    without one), whatever its generator does with them; every other table gets every row."""
    from arckv_press.bench import make_leaderboard as ml
    from arckv_press.bench.leaderboard.sources import Block
    from arckv_press.models import DEFAULT_MODEL_ID, GEMMA3_MODEL_ID

    rows = [{"model": GEMMA3_MODEL_ID, "i": 0}, {"model": DEFAULT_MODEL_ID, "i": 1}, {"model": "", "i": 2}]
    per_model = sorted(name for name, gen in ml.TABLES.items() if gen.per_model)
    assert per_model == ["benchmark", "best", "evidence-cost", "headline", "needle-stages"]
    seen = {}
    saved = dict(ml.TABLES)
    try:
        for name in ("headline", "cross-model"):
            ml.TABLES[name] = ml.TABLES[name]._replace(make=lambda rs, s, p, name=name: seen.setdefault(name, []).append(
                [r["i"] for r in rs]) or "")
        for params in ({}, {"model": GEMMA3_MODEL_ID}):
            for name in ("headline", "cross-model"):
                ml.generate_block(None, Block("d.md", "b", name, "x.csv", params), lambda source: rows)
    finally:
        ml.TABLES.clear()
        ml.TABLES.update(saved)
    assert seen == {"headline": [[1, 2], [0]], "cross-model": [[0, 1, 2], [0, 1, 2]]}
    assert "model" in ml.TABLES["benchmark"].accepted and "model" not in ml.TABLES["cross-model"].accepted


def test_benchmark_table_from_rows(tmp_path):
    """A cell per (method, kept fraction) present, ``-`` for a missing one, the references on every
    column, needles as found/total; a doc without a block's markers is refused unchanged."""
    def r(method, ratio, score, n="10", bench="ruler", task="ruler"):
        return {"benchmark": bench, "task": task, "method": method, "ratio": ratio, "score": score, "n_examples": n}

    rows = [r("arckv", "0.1", "0.5"), r("arckv", "0.05", "0.25"), r("snapkv", "0.1", "0.125"),
            r("none", "1", "0.75"), r("arckv", "0.1", "0.9", task="cwe"),
            r("arckv", "0.1", "0.6", "5", "needle", "needle")]
    assert doc_tables.benchmark_markdown(rows, "ruler", "ruler").splitlines() == [
        "| method | keep 10% | keep 5% |", "|---|---:|---:|", "| `arckv` | 0.50 | 0.25 |", "| `snapkv` | 0.12 | - |",
        "| full cache | 0.75 | 0.75 |"]
    assert doc_tables.benchmark_markdown(rows, "needle", "needle").splitlines()[2] == "| `arckv` | 3/5 |"
    rows[0].update(ci_low="0.25", ci_high="0.75")
    assert doc_tables.benchmark_markdown(rows, "ruler", "ruler").splitlines()[2] == "| `arckv` | 0.50 [0.25, 0.75] | 0.25 |"
    assert doc_tables.benchmark_markdown(rows, "quality", "quality") == "No rows yet."
    doc = tmp_path / "results.md"
    doc.write_text("no markers\n")
    with pytest.raises(ValueError, match="must contain the lines"):
        doc_blocks.update_doc(doc, [("ruler", "lb.csv", "x"), ("needle", "lb.csv", "y")])
    assert doc.read_text() == "no markers\n"


def test_intervals_and_paired_comparisons_from_stored_examples():
    """Rows carry their per-example scores; intervals and comparisons are recomputed from them: only
    ARC-KV methods are compared, against every other method, on the shared examples."""
    def r(method, scores, ratio="0.1"):
        return {"model": "m", "benchmark": "needle", "task": "needle", "method": method, "ratio": ratio,
                "score": sum(scores.values()) / len(scores), "example_scores": intervals.example_scores(scores)}

    good = {f"e{i}": 1.0 for i in range(20)}
    bad = {f"e{i}": float(i < 2) for i in range(20)}
    rows = [r("arckv", good), r("arckv-ha", good), r("snapkv", bad), r("none", good), r("kvzip", {"other": 1.0})]
    assert intervals.examples_of(rows[0]) == good and intervals.examples_of({"score": 1}) == {}
    intervals.add_intervals(rows)
    assert rows[0]["ci_low"] == rows[0]["ci_high"] == 1.0 and rows[2]["ci_low"] < 0.1 < rows[2]["ci_high"]
    pairs = {(c["method"], c["other"]): c for c in intervals.comparisons(rows)}
    assert set(pairs) == {("arckv", "arckv-ha"), ("arckv", "snapkv"), ("arckv-ha", "arckv"), ("arckv-ha", "snapkv")}
    assert pairs[("arckv", "snapkv")]["verdict"] == "better" and pairs[("arckv", "snapkv")]["n"] == 20
    assert pairs[("arckv", "arckv-ha")]["verdict"] == "tie" and pairs[("arckv", "arckv-ha")]["p_sign"] == 1.0


def test_lm_eval_sample_scores_become_example_scores(tmp_path):
    """run_evals.py's sample_scores.json beside results.json: a leaf task's examples are its samples' values
    of the reported metric, a group's the union of its subtasks' (ids ``task/doc``); the interval
    brackets the mean. Without the file a row has no examples (and no interval)."""
    run_evals = load_script("run_evals")
    folder = tmp_path / "ruler" / "arckv_0.1"
    path = results_json(folder / "results.json", "hf-arckv", "pretrained=m,press=arckv,ratio=0.1",
                        {"cwe": 0.5, "vt": 1.0, "ruler": 0.75}, 1.7e9)
    data = json.loads(path.read_text())
    data["group_subtasks"] = {"ruler": ["cwe", "vt"], "cwe": [], "vt": []}
    path.write_text(json.dumps(data))
    samples = {"cwe": [{"doc_id": 0, "acc": 1.0, "acc_norm": 0.5, "doc": {"x": 1}}, {"doc_id": 1, "acc": 0.0}],
               "vt": [{"doc_id": 0, "acc": 1.0}, {"doc_id": 1, "acc": True}]}  # a bool is no score
    run_evals.write_sample_scores(folder / "sample_scores.json", samples)
    rows = {r["task"]: r for r in readers.read_results(path, {}, False, COMMON)}
    assert intervals.examples_of(rows["cwe"]) == {"cwe/0": 1.0, "cwe/1": 0.0}
    assert intervals.examples_of(rows["vt"]) == {"vt/0": 1.0}
    assert intervals.examples_of(rows["ruler"]) == {"cwe/0": 1.0, "cwe/1": 0.0, "vt/0": 1.0}
    intervals.add_intervals(list(rows.values()))
    assert rows["cwe"]["ci_low"] <= 0.5 <= rows["cwe"]["ci_high"]
    (folder / "sample_scores.json").unlink()
    assert all(r["example_scores"] == "" for r in readers.read_results(path, {}, False, COMMON))


def test_a_model_named_by_its_short_name_is_reported_by_its_id(tmp_path):
    """``run_evals.py --model gemma3-270m`` writes ``pretrained=gemma3-270m``: its rows carry the Hugging
    Face id the case benchmarks and the compaction records carry, and so take the records' timings;
    a path or an unregistered id is kept as given."""
    from arckv_press.models import MODELS

    gemma = MODELS["gemma3-270m"].model_id
    folder = tmp_path / "ruler" / "arckv_0.1"
    path = results_json(folder / "results.json", "hf-arckv", "pretrained=gemma3-270m,press=arckv,ratio=0.1",
                        {"cwe": 0.5}, 1.7e9)
    recs = records_jsonl(folder / "arckv_compaction.jsonl", "arckv", 0.1, [2.0, 4.0], ["cwe"])
    recs.write_text(recs.read_text().replace(MODEL, gemma))
    (got,) = readers.read_results(path, readers.read_records([recs]), False, COMMON)
    assert got["model"] == gemma != "gemma3-270m"
    assert float(got["compaction_seconds"]) == pytest.approx(3.0)
    other = results_json(tmp_path / "x" / "none_1" / "results.json", "hf", "pretrained=/models/my-llama", {"cwe": 0.5}, 1.7e9)
    assert [r["model"] for r in readers.read_results(other, {}, False, COMMON)] == ["/models/my-llama"]


def test_a_group_row_counts_its_subtasks_examples(tmp_path):
    """lm-eval lists no ``n-samples`` for a group: its row's ``n_examples`` is the sum of its subtasks'
    effective counts (a leaf keeps its own), and stays empty when a subtask's count is missing."""
    path = results_json(tmp_path / "ruler" / "arckv_0.1" / "results.json", "hf-arckv",
                        "pretrained=m,press=arckv,ratio=0.1", {"cwe": 0.5, "vt": 1.0, "ruler": 0.75}, 1.7e9)
    data = json.loads(path.read_text())
    data["group_subtasks"] = {"ruler": ["cwe", "vt"], "cwe": [], "vt": []}
    data["n-samples"] = {"cwe": {"original": 10, "effective": 10}, "vt": {"original": 10, "effective": 4}}
    path.write_text(json.dumps(data))
    rows = {r["task"]: r for r in readers.read_results(path, {}, False, COMMON)}
    assert (rows["cwe"]["n_examples"], rows["vt"]["n_examples"], rows["ruler"]["n_examples"]) == (10, 4, 14)
    del data["n-samples"]["vt"]
    path.write_text(json.dumps(data))
    rows = {r["task"]: r for r in readers.read_results(path, {}, False, COMMON)}
    assert (rows["cwe"]["n_examples"], rows["vt"]["n_examples"], rows["ruler"]["n_examples"]) == (10, "", "")


def test_ruler_lengths_are_separate_benchmarks(tmp_path):
    """RULER at 4K tokens is its own benchmark (``ruler_4k``, its group row named alike), so its rows never
    replace the 2K rows of the same method and kept fraction; the length comes from the tasks' metadata,
    else from the per-length metrics that hold a score; a file with several lengths or none is refused."""
    args = "pretrained=m,press=arckv,ratio=0.1"
    two = results_json(tmp_path / "a" / "results.json", "hf-arckv", args, {"ruler": 0.5, "cwe": 0.25}, 1.7e9)
    four = results_json(tmp_path / "b" / "results.json", "hf-arckv", args, {"ruler": 0.125, "cwe": 0.0}, 1.8e9, 4096)
    for path in (two, four):
        data = json.loads(path.read_text())
        data["group_subtasks"] = {"ruler": ["cwe"], "cwe": []}
        path.write_text(json.dumps(data))
    rows = table.sorted_unique(readers.read_results(two, {}, False, COMMON) + readers.read_results(four, {}, False, COMMON))
    assert {(r["benchmark"], r["task"], r["score"]) for r in rows} == {
        ("ruler", "ruler", 0.5), ("ruler", "cwe", 0.25), ("ruler_4k", "ruler_4k", 0.125), ("ruler_4k", "cwe", 0.0)}
    assert doc_tables.benchmark_markdown(rows, "ruler_4k", "ruler_4k").splitlines()[2] == "| `arckv` | 0.12 |"
    assert readers.ruler_benchmark(8192) == "ruler_8k" and readers.ruler_benchmark(3000) == "ruler_3000"

    data = json.loads(four.read_text())
    data["configs"] = {}  # no metadata: the per-length metrics tell (-1 = no samples at that length)
    data["results"]["ruler"].update({"2048,none": -1.0, "4096,none": 0.125})
    assert readers.ruler_length(data, four) == 4096
    data["results"]["ruler"]["2048,none"] = 0.5
    with pytest.raises(ValueError, match=r"\[2048, 4096\] sequence lengths"):
        readers.ruler_length(data, four)
    for t in ("ruler", "cwe"):
        data["results"][t] = {k: v for k, v in data["results"][t].items() if not k.split(",")[0].isdigit()}
    four.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="no readable sequence lengths"):
        readers.read_results(four, {}, False, COMMON)
    assert readers.ruler_length({"results": {"quality": {}}, "group_subtasks": {}}, four) is None


def test_plot_points_carry_the_rows_intervals_and_draw_them(tmp_path):
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
    points = plots.benchmark_points(rows)
    assert sorted(points[("m", "arckv")]) == [plots.Point(0.1, 0.5, 3.0, 0.25, 0.75), plots.Point(0.2, 0.6, 4.0)]
    assert points[("m", "snapkv")] == [plots.Point(0.1, pytest.approx(0.3), None)]  # mean of two tasks: no interval
    fig, ax = plt.subplots()
    pts = sorted(points[("m", "arckv")])
    plots.draw_line(ax, [p.ratio for p in pts], pts, {"color": "C0", "linestyle": "-", "marker": "o"}, "arckv")
    (bars,) = ax.containers
    (segments,) = [c.get_segments() for c in bars.lines[2]]
    assert [[tuple(xy) for xy in seg] for seg in segments] == [[(0.1, 0.25), (0.1, 0.75)]]
    plt.close(fig)
    paths = plots.plot_benchmark("ruler", rows, tmp_path)
    assert [p.name for p in paths] == ["ruler_score_vs_ratio.png", "ruler_score_vs_time.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)


# ---------------------------------------------------------------------------- study tables
def _dev_row(method, ratio, doc, damage, config_id, command="python scripts/bench_fidelity.py --split dev"):
    return {"method": method, "ratio": ratio, "doc": doc, "damage": damage, "config_id": config_id, "indexer": "",
            "command": command}


def test_development_split_labels_rows_by_their_options_and_todays_defaults():
    """A row with today's ids is ``default`` (whatever its command said), another one is labelled by
    its ``--option`` values when they give its ids, else by the label stored for its config id, else
    by its config id; cells are means over documents, with the count when a cell has fewer
    documents than the table."""
    from arckv_press.bench.study_tables import dev_damage, dev_split_markdown, selectors_markdown
    from arckv_press.models import DEFAULT_MODEL_ID
    from arckv_press.runinfo import CurrentIds

    ids = CurrentIds(DEFAULT_MODEL_ID)
    cur = {m: {r: ids(m, r)["config_id"] for r in (0.1, 0.02)} for m in ("arckv-ha", "arckv-vi", "am-omp")}
    half = CurrentIds(DEFAULT_MODEL_ID, {"lambda_m": 0.5})("arckv-ha", 0.1)["config_id"]
    rows = [_dev_row("arckv-ha", "0.1", "0", "0.2", cur["arckv-ha"][0.1], "x --option lambda_m=0.25"),
            _dev_row("arckv-ha", "0.1", "1", "0.4", cur["arckv-ha"][0.1]),
            _dev_row("arckv-ha", "0.1", "0", "0.6", half, "x --option lambda_m=0.5 --threads 1"),
            _dev_row("arckv-ha", "0.02", "0", "0.5", cur["arckv-ha"][0.1], "x --option lambda_m=0.25 --threads 1"),
            _dev_row("arckv-ha", "0.02", "0", "0.7", "feedfacecafe"),
            _dev_row("arckv-ha", "0.02", "1", "0.9", "feedfacecafe", "x --option lambda_m=0.3"),
            _dev_row("arckv-vi", "0.1", "0", "0.3", cur["arckv-vi"][0.1])]
    labels = {("arckv-ha", cur["arckv-ha"][0.1]): "keep 10%'s options"}
    damage = dev_damage(rows, labels)
    assert damage[("arckv-ha", "default")] == {"0.1": (pytest.approx(0.3), 2)}
    assert damage[("arckv-ha", "lambda_m=0.5")] == {"0.1": (0.6, 1)}  # its command's option gives its ids
    # the command's option does not give the row's ids at keep 2% (not today's there): the stored label
    assert damage[("arckv-ha", "keep 10%'s options")] == {"0.02": (0.5, 1)}
    assert damage[("arckv-ha", "config feedfacecafe")] == {"0.02": (pytest.approx(0.8), 2)}  # a command's claim is checked
    assert ("arckv-ha", "config " + cur["arckv-ha"][0.1]) in dev_damage(rows)  # without the label: its id
    # documents of another length get rows of their own, and another model's rows are not this model's
    longer = {**rows[1], "doc_tokens": "7800", "damage": "0.8"}
    other_model = {**rows[1], "model": "google/gemma-3-270m", "damage": "0.9"}
    damage_more = dev_damage([*rows, longer, other_model], labels)
    assert damage_more[("arckv-ha", "default")] == {"0.1": (pytest.approx(0.3), 2)}
    assert damage_more[("arckv-ha", "default, 7,800-token docs")] == {"0.1": (0.8, 1)}
    # on Gemma 3 (its own schedule) the default model's ids are not the defaults, its own are
    assert dev_damage([*rows, other_model], labels, model_id="google/gemma-3-270m") == {
        ("arckv-ha", "keep 10%'s options"): {"0.1": (0.9, 1)}}
    gemma = {**other_model, "config_id": CurrentIds("google/gemma-3-270m")("arckv-ha", 0.1)["config_id"]}
    assert gemma["config_id"] != other_model["config_id"]
    assert dev_damage([*rows, gemma], labels, model_id="google/gemma-3-270m") == {("arckv-ha", "default"): {"0.1": (0.9, 1)}}
    lines = dev_split_markdown(rows, labels).splitlines()
    assert lines[0] == "| method | options | keep 10% | keep 2% |"
    assert lines[2] == "| `arckv-ha` | default | 0.300 |  |"
    assert "| `arckv-ha` | `keep 10%'s options` |  | 0.500 (1 docs) |" in lines
    # the selector table needs a kept fraction every selector has: arckv has none here
    assert selectors_markdown(rows).startswith("(no kept fraction has development rows of all three selectors")
    learned = {**_dev_row("arckv", "0.1", "0", "0.25", ""), **CurrentIds(DEFAULT_MODEL_ID)("arckv", 0.1)}
    lines = selectors_markdown([*rows, learned]).splitlines()
    assert lines[0] == "| selector | keep 10% | mean |"
    assert lines[2:] == ["| learned indexer (`arckv`) | **0.250** | **0.250** |", "| HA (`arckv-ha`) | 0.300 | 0.300 |",
                         "| VI (`arckv-vi`) | 0.300 | 0.300 |"]


def test_stored_config_labels_are_read_and_checked(tmp_path):
    from arckv_press.bench.study_tables import read_config_labels

    path = tmp_path / "labels.csv"
    path.write_text('method,config_id,label\narckv,abc,"indexer_rows=all, old"\n')
    assert read_config_labels(path) == {("arckv", "abc"): "indexer_rows=all, old"}
    assert read_config_labels(None) == {}
    path.write_text("method,config_id,label\narckv,,x\n")
    with pytest.raises(ValueError, match="labels.csv:2: a label needs method, config_id and label"):
        read_config_labels(path)


def test_compaction_time_table_is_the_last_run_with_todays_defaults():
    """The block shows one run, the last with current ids (an older run and a run with other options
    are left out), with the same ratio lines bench_compaction.py prints."""
    from arckv_press.bench.bench_compaction import ratio_lines
    from arckv_press.bench.study_tables import compaction_time_markdown
    from arckv_press.models import DEFAULT_MODEL_ID
    from arckv_press.runinfo import CurrentIds

    cid = CurrentIds(DEFAULT_MODEL_ID)("arckv-ha", 0.1)["config_id"]

    def r(method, stage, seconds, date, config_id="", ratio="0.1", command="run B", threads="1"):
        return {"section": "model", "method": method, "ratio": ratio, "length": "4000", "stage": stage,
                "seconds": str(seconds), "config_id": config_id, "indexer": "", "date": date, "command": command,
                "machine": "cpu X", "threads": threads}

    am = CurrentIds(DEFAULT_MODEL_ID)("am-omp-fast", 0.1)["config_id"]
    rows = [r("none", "prefill", 10, "d1", ratio="1", command="run A"),
            r("arckv-ha", "repeat_prefill", 30, "d1", cid, command="run A"),
            r("arckv-ha", "compact_total", 99, "d1", cid, command="run A"),
            r("none", "prefill", 20, "d2", ratio="1"),
            r("arckv-ha", "repeat_prefill", 40, "d2", cid), r("arckv-ha", "merge", 2, "d2", cid),
            r("arckv-ha", "compact_total", 50, "d2", cid),
            r("am-omp-fast", "am_total", 100, "d2", am), r("am-omp-fast", "compact_total", 120, "d2", am),
            r("arckv-ha", "compact_total", 1, "d3", "0ther0ption00", command="run C"),
            r("none", "prefill", 5, "d4", ratio="1", command="run D", threads="2"),
            r("arckv-ha", "repeat_prefill", 15, "d4", cid, command="run D", threads="2"),
            r("arckv-ha", "compact_total", 18, "d4", cid, command="run D", threads="2")]
    two = compaction_time_markdown(rows, threads=2).splitlines()   # the last run on two threads, on its own
    assert two[0] == "Run of d4 on cpu X: `run D`" and any(line.endswith("| 3.0 | 18.0 |") for line in two)
    lines = compaction_time_markdown(rows).splitlines()
    assert lines[0] == "Run of d2 on cpu X: `run B`"
    cells = [line for line in lines if line.startswith("| 4,000")]
    assert cells[0].split(" | ")[2:5] == ["`arckv-ha`", "20.0", "40.0"] and cells[0].endswith("| 10.0 | 50.0 |")
    assert cells[1].endswith("| 100.0 | 120.0 | 120.0 |")
    results = {("none", 1.0, 4000): {"prefill": 20.0},
               ("arckv-ha", 0.1, 4000): {"repeat_prefill": 40.0, "merge": 2.0, "compact_total": 50.0},
               ("am-omp-fast", 0.1, 4000): {"am_total": 100.0, "compact_total": 120.0}}
    shown = ratio_lines(results, [4000], [0.1])
    assert shown == ["  4000 tok, rho 0.1, arckv-ha: post/prefill 0.50; repeat/prefill 2.00; "
                     "am-omp-fast select+fit / arckv-ha post 10.00x; end to end 2.40x"]  # no goals of a past issue
    assert f"- {shown[0].strip()}" in lines


def test_long_context_table_and_plot_are_the_newest_synthetic_sweep(tmp_path):
    """The long-context block shows the newest synthetic run only (an older sweep and another kept
    fraction are left out): seconds per stage, post / pass and the growth per doubling computed from
    the rows, blanks where a stage was not run; the plot is drawn from the same run."""
    from arckv_press.bench.leaderboard.plots import plot_long_context
    from arckv_press.bench.study_tables import long_context_markdown

    def r(method, stage, T, seconds, command="sweep B", date="d2", ratio="0.1"):
        return {"section": "synthetic", "method": method, "ratio": ratio, "length": str(T), "stage": stage,
                "seconds": str(seconds), "date": date, "command": command, "machine": "cpu X", "threads": "2"}

    rows = [r("arckv-ha", "post", 1024, 99.0, command="sweep A", date="d1"),
            r("arckv-ha", "post", 1024, 7.0, ratio="0.2")]
    for T, passed, post, mib in ((1024, 2.0, 1.0, 10.0), (2048, 8.0, 2.5, 30.0)):
        rows += [r("arckv-ha", "reference_pass", T, passed), r("arckv-ha", "post", T, post),
                 r("arckv-ha", "merge", T, post / 5),
                 r("arckv-ha", "post_tensor_mib", T, mib)]
    rows += [r("arckv-ha", "post_unchunked", 2048, 4.0), r("am-omp-fast", "total", 1024, 3.0)]
    lines = long_context_markdown(rows).splitlines()
    assert lines[0] == "Run of d2 on cpu X, keep 10%: `sweep B`"
    body = [line for line in lines if line.startswith("| 1,024") or line.startswith("| 2,048")]
    assert body[0] == "| 1,024 | 2.00 | 1.00 | 0.20 |  |  | 0.500 |  | 10 |  |  |  |  | 3.00 |"
    assert body[1] == "| 2,048 | 8.00 | 2.50 | 0.50 |  |  | 0.312 | 2.50x | 30 | 3.00x | 4.00 |  |  |  |"
    assert plot_long_context(rows, tmp_path).name == "long_context_scaling.png"
    assert plot_long_context([], tmp_path) is None


def test_needle_stages_table_counts_finds_per_depth_and_the_stage_that_first_loses_each():
    """Per length, options and stage: needles found per depth and in all; "first lost" counts the
    cases the full cache and the stage before find and this stage does not; the full cache's row is
    shared by every run's options; a rerun of a case replaces its row."""
    from arckv_press.bench.study_tables import needle_stages_markdown

    def r(seed, depth, stage, correct, command="python scripts/needle_stages.py --stages"):
        return {"seed": str(seed), "depth": depth, "stage": stage, "correct": str(correct), "length": "1500",
                "command": command}

    near = "python scripts/needle_stages.py --stages --option near_rows=True"
    # seed: full, evict, +mass, +values, +merge (defaults)
    ladder = {1: (1, 1, 1, 1, 1), 2: (1, 0, 1, 1, 0), 3: (1, 1, 0, 0, 0), 4: (0, 1, 0, 0, 0)}
    rows = []
    for seed, found in ladder.items():
        rows.append(r(seed, "0.9" if seed % 2 else "0.8", "full", found[0]))
        rows += [r(seed, "0.9" if seed % 2 else "0.8", stage, ok)
                 for stage, ok in zip(("evict", "+mass", "+values", "+merge"), found[1:])]
    rows.insert(1, r(1, "0.9", "evict", 0))            # replaced by the rerun below it
    rows += [r(2, "0.8", "evict", 1, near), r(2, "0.8", "+merge", 1, near)]
    oracle = "python scripts/needle_stages.py --stages --oracle"
    rows += [{**r(3, "0.9", "evict", 1, oracle), "anchors": "oracle"},
             {**r(3, "0.9", "+merge", 0, oracle + " --option lambda_m=0.5"), "anchors": "oracle"}]
    lines = needle_stages_markdown(rows).splitlines()
    assert lines[0] == "| length | options | stage | 80% | 90% | all | first lost |"
    assert lines[2:] == [
        "| 1,500 |  | full cache | 1/2 | 2/2 | 3/4 |  |",
        "| 1,500 | defaults | evict | 1/2 | 2/2 | 3/4 | 1 |",    # seed 2
        "| 1,500 | defaults | +mass | 1/2 | 1/2 | 2/4 | 1 |",    # seed 3
        "| 1,500 | defaults | +values | 1/2 | 1/2 | 2/4 | 0 |",  # seed 3 was lost before
        "| 1,500 | defaults | +merge | 0/2 | 1/2 | 1/4 | 1 |",   # seed 2
        "| 1,500 | near_rows=True | evict | 1/1 |  | 1/1 | 0 |",
        "| 1,500 | near_rows=True | +merge | 1/1 |  | 1/1 | 0 |",
        "| 1,500 | oracle anchors | evict |  | 1/1 | 1/1 | 0 |",
        "| 1,500 | oracle anchors, lambda_m=0.5 | +merge |  | 0/1 | 0/1 | 1 |",
    ]


def test_evidence_cost_sums_compactions_times_seconds():
    """Each cell is the sum over kept fractions of compactions x mean seconds, in hours, with the
    compaction count (n_records, else n_examples); unranked benchmarks, per-task rows and rows without
    seconds are left out; the last column and row are the sums."""
    from arckv_press.bench.study_tables import evidence_cost_markdown

    def r(method, bench, task, ratio, seconds, n_records="", n_examples=""):
        return {"method": method, "benchmark": bench, "task": task, "ratio": ratio, "compaction_seconds": seconds,
                "n_records": n_records, "n_examples": n_examples}

    rows = [r("arckv", "ruler", "ruler", "0.1", "36", n_records="130"),       # 4680 s
            r("arckv", "ruler", "ruler", "0.2", "18", n_records="26"),        # 468 s
            r("arckv", "ruler", "cwe", "0.1", "999", n_records="10"),         # a task row: not summed
            r("arckv", "needle", "needle", "0.1", "40", n_examples="45"),     # 1800 s
            r("arckv", "quality", "quality", "0.1", "999", n_records="5"),    # not ranked: left out
            r("snapkv", "ruler_4k", "ruler_4k", "0.1", "72", n_records="50"), # 3600 s
            r("no-context", "ruler", "ruler", "0", "", n_records=""),        # no seconds: left out
            r("none", "ruler", "ruler", "1", "10", n_records="360")]          # 3600 s
    lines = evidence_cost_markdown(rows, RANKED).splitlines()
    assert lines[0] == "| method | needles | continuation fidelity | RULER 2K | RULER 4K | all |"
    assert lines[2:] == [
        f"| `arckv` | 0.5 (45) |  | {(4680 + 468) / 3600:.1f} (156) |  | {(4680 + 468 + 1800) / 3600:.1f} (201) |",
        "| `snapkv` |  |  |  | 1.0 (50) | 1.0 (50) |",
        "| full cache |  |  | 1.0 (360) |  | 1.0 (360) |",
        f"| all | 0.5 (45) |  | {(4680 + 468 + 3600) / 3600:.1f} (516) | 1.0 (50) | "
        f"{(4680 + 468 + 1800 + 7200) / 3600:.1f} (611) |"]


def test_compaction_records_reader_names_the_bad_line(tmp_path):
    """The leaderboard's records reader is the task files' JSON-lines reader: bad JSON and a record
    without a required field are refused with the file and line; a resumed document counts once."""
    from arckv_press.bench.leaderboard.readers import read_records
    from arckv_press.tasks._common.records import DataFileError

    good = {"model": "m", "press": "arckv", "ratio": 0.1, "document_sha1": "d"}
    path = tmp_path / "arckv_compaction.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps({**good, "seconds": 2}) + "\n")
    [(key, recs)] = read_records([path]).items()
    assert key == ("m", "arckv", "0.1")
    assert len(recs) == 1 and recs[0]["seconds"] == 2  # the last copy of a document compacted twice
    path.write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(DataFileError, match=r"arckv_compaction\.jsonl, line 2: invalid JSON"):
        read_records([path])
    path.write_text("\n" + json.dumps({"model": "m", "press": "arckv"}) + "\n")
    with pytest.raises(ValueError, match=r"arckv_compaction\.jsonl, line 2: record lacks 'ratio'"):
        read_records([path])
