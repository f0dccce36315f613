"""scripts/run_evals.py: the plan, resumption by results.json, and the leaderboard reading its output."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
from conftest import load_script

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def re_():
    return load_script("run_evals")


def test_plan_orders_baselines_first_and_mild_ratios_first(re_):
    runs = re_.plan(["ruler"], ["arckv", "snapkv", "none"], [0.05, 0.2])
    names = [r.name for r in runs]
    assert names == ["none_1", "no-context_1", "arckv_0.2", "snapkv_0.2", "arckv_0.05", "snapkv_0.05"]
    assert re_.plan(["quality"], ["kvzip"], [0.1], baselines=False) == [re_.Run("quality", "kvzip", 0.1)]


def test_list_skips_finished_runs_and_rejects_bad_input(re_, tmp_path, capsys):
    done = re_.Run("ruler", "snapkv", 0.1).folder(tmp_path)
    done.mkdir(parents=True)
    (done / "results.json").write_text("{}")
    assert re_.main(["--benchmarks", "ruler", "--methods", "snapkv", "--ratios", "0.1", "0.2", "--out", str(tmp_path), "--list"]) == 0
    out = capsys.readouterr().out
    assert "4 runs planned, 1 done, 3 to run" in out
    assert "done ruler      snapkv_0.1" in out and "todo ruler      snapkv_0.2" in out
    for bad in (["--methods", "nope"], ["--ratios", "1.0"], ["--ratios", "0"]):
        with pytest.raises(SystemExit):
            re_.main(["--list", "--out", str(tmp_path), *bad])


@pytest.mark.parametrize("model_path", ["/m/SmolLM2", None])
def test_leaderboard_reads_run_evals_output(re_, tmp_path, model_path):
    """The model_args run_evals writes are parsed back into the right method and ratio; for the
    embedded default (no ``pretrained``) the leaderboard names the model by its HF id."""
    ml = load_script("make_leaderboard")
    hf_id = "HuggingFaceTB/SmolLM2-135M-Instruct"
    for run, score in ((re_.Run("ruler", "arckv-ha", 0.05), 0.25), (re_.Run("ruler", "no-context", 1.0), 0.05),
                       (re_.Run("ruler", "none", 1.0), 0.75)):
        folder = run.folder(tmp_path)
        folder.mkdir(parents=True)
        data = {"results": {"ruler": {"alias": "ruler", "score,none": score}}, "group_subtasks": {"ruler": []},
                "configs": {"ruler": {"metadata": {"max_seq_lengths": [2048]}}},  # as run_evals passes them
                "config": {"model": "hf-arckv", "model_args": re_.model_args_string(run, model_path, "float32")},
                "date": 1.7e9, "n-samples": {}, "model_name": hf_id}
        (folder / "results.json").write_text(json.dumps(data))
    rows = []
    for path in sorted(tmp_path.rglob("results.json")):
        rows += ml.read_results(path, {}, False, {})
    got = {(r["method"], r["ratio"]): r["score"] for r in rows}
    assert got == {("arckv-ha", "0.05"): 0.25, ("no-context", "0"): 0.05, ("none", "1"): 0.75}
    assert {r["model"] for r in rows} == {model_path or hf_id}
    assert ("pretrained=" in re_.model_args_string(re_.Run("ruler", "snapkv", 0.1), model_path, "float32")) == bool(model_path)


def test_runs_of_another_indexer_checkpoint_or_config_are_moved_away_and_rerun(re_, tmp_path, capsys):
    out = tmp_path / "lm_eval"

    def ids(indexer, config="c-now"):
        return {"indexer": indexer, "config_id": config}

    def make(run, indexer, finished=True, config="c-now"):
        folder = run.folder(out)
        folder.mkdir(parents=True)
        (folder / "arckv_compaction.jsonl").write_text(
            json.dumps({"press": run.method, "indexer": indexer, "config_id": config}) + "\n")
        if finished:
            (folder / "results.json").write_text(json.dumps({"results": {}, "arckv_run": ids(indexer, config)}))
        (folder / "requests.db").write_text("cached answers")
        return folder

    current = make(re_.Run("ruler", "arckv", 0.2), "new")
    stale = make(re_.Run("ruler", "arckv", 0.1), "old")
    partial = make(re_.Run("ruler", "arckv", 0.05), "old", finished=False)
    legacy = make(re_.Run("quality", "arckv", 0.1), None)  # written before ids were recorded
    (legacy / "results.json").write_text(json.dumps({"results": {}, "arckv_run": {}}))
    snap = make(re_.Run("ruler", "snapkv", 0.1), "", config="")
    old_default = make(re_.Run("ruler", "arckv-ha", 0.1), "", config="c-old")  # made before a default changed
    assert re_.retire_stale(re_.Run("ruler", "arckv", 0.2), out, ids("new")) is True and current.exists()
    assert re_.retire_stale(re_.Run("ruler", "snapkv", 0.1), out, ids("", "")) is True and snap.exists()
    assert re_.retire_stale(re_.Run("ruler", "arckv", 0.1), out, ids("new")) is False and not stale.exists()
    assert (tmp_path / "archive" / "lm_eval_indexer_old" / "ruler" / "arckv_0.1" / "requests.db").exists()
    assert re_.retire_stale(re_.Run("ruler", "arckv", 0.05), out, ids("new")) is False and not partial.exists()
    assert (tmp_path / "archive" / "lm_eval_indexer_old" / "ruler" / "arckv_0.05" / "arckv_compaction.jsonl").exists()
    assert re_.retire_stale(re_.Run("quality", "arckv", 0.1), out, ids("new")) is False
    assert (tmp_path / "archive" / "lm_eval_indexer_unknown" / "quality" / "arckv_0.1" / "results.json").exists()
    assert re_.retire_stale(re_.Run("ruler", "arckv-ha", 0.1), out, ids("")) is False and not old_default.exists()
    assert (tmp_path / "archive" / "lm_eval_config_c-old" / "ruler" / "arckv-ha_0.1" / "requests.db").exists()
    assert re_.retire_stale(re_.Run("ruler", "arckv", 0.1), out, ids("new")) is False  # nothing left to move
    assert "moved" in capsys.readouterr().out
    stale.mkdir(parents=True)  # an archive that exists already is never overwritten
    (stale / "results.json").write_text(json.dumps({"results": {}, "arckv_run": ids("old")}))
    with pytest.raises(SystemExit, match="exists"):
        re_.retire_stale(re_.Run("ruler", "arckv", 0.1), out, ids("new"))


def test_a_folder_of_other_sizes_is_refused_not_counted_as_done(re_, tmp_path):
    """A finished run made with another --limit or --ruler-length is not taken for this one: the
    command stops, naming both sizes, before loading any model; the same sizes count as done."""
    folder = re_.Run("ruler", "snapkv", 0.1).folder(tmp_path)
    folder.mkdir(parents=True)
    stored = {"limit": None, "metadata": {"max_seq_lengths": [2048], "num_samples": 2, "seed": 42}}
    (folder / "results.json").write_text(json.dumps({"config": stored, "arckv_run": {"indexer": "", "config_id": ""}}))
    common = ["--benchmarks", "ruler", "--methods", "snapkv", "--ratios", "0.1", "--no-baselines", "--out", str(tmp_path)]
    for other in (["--limit", "10"], ["--limit", "2", "--ruler-length", "4096"]):
        with pytest.raises(SystemExit, match="write these sizes to another --out"):
            re_.main([*common, *other])
    assert re_.main([*common, "--limit", "2"]) == 0  # the same sizes: done, nothing to run


def test_option_runs_carry_their_options_and_never_retire_default_runs(re_, tmp_path, capsys):
    """``--option`` reaches the ARC-KV / AM presses (``press_KEY`` model args, the option's config
    id), not kvpress presses or the baselines; a folder of the default options is refused, unmoved."""
    from arckv_press.models import DEFAULT_MODEL_ID
    from arckv_press.registry import result_ids

    ha, snap, blank = re_.Run("ruler", "arckv-ha", 0.1), re_.Run("ruler", "snapkv", 0.1), re_.Run("ruler", "no-context", 1.0)
    opts = {"merge_rows": 256}
    assert re_.model_args_string(ha, None, "float32", opts) == "press=arckv-ha,ratio=0.1,dtype=float32,press_merge_rows=256"
    assert re_.model_args_string(snap, None, "float32", opts) == "press=snapkv,ratio=0.1,dtype=float32"
    assert "press_" not in re_.model_args_string(blank, None, "float32", opts)
    option_ids = result_ids("arckv-ha", DEFAULT_MODEL_ID, 0.1, config_options=opts)
    default_ids = result_ids("arckv-ha", DEFAULT_MODEL_ID, 0.1)
    assert option_ids["config_id"] != default_ids["config_id"]

    folder = ha.folder(tmp_path)
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps({"results": {}, "arckv_run": default_ids}))
    argv = ["--benchmarks", "ruler", "--methods", "arckv-ha", "--ratios", "0.1", "--no-baselines", "--out", str(tmp_path)]
    with pytest.raises(SystemExit):
        re_.main([*argv, "--option", "merge_rows=256"])
    assert "holds a run of the default compaction options" in capsys.readouterr().err
    assert (folder / "results.json").exists()
    assert re_.main([*argv, "--list"]) == 0 and "1 done" in capsys.readouterr().out  # the default run counts
    (folder / "results.json").write_text(json.dumps({"results": {}, "arckv_run": option_ids}))
    assert re_.main([*argv, "--list", "--option", "merge_rows=256"]) == 0 and "1 done" in capsys.readouterr().out


def test_stored_tasks_are_the_groups_else_every_task(re_):
    ruler = {"group_subtasks": {"ruler": ["niah_single_1", "vt"]}, "results": {"ruler": {}, "vt": {}}}
    assert re_.stored_tasks(ruler) == ["ruler"]
    longbench = {"group_subtasks": {}, "results": {"longbench_b": {}, "longbench_a": {}}}
    assert re_.stored_tasks(longbench) == ["longbench_a", "longbench_b"]
    metrics = re_.stored_metrics({"quality": {"acc,none": 0.5, "acc_stderr,none": "N/A", "alias": "q", "flag": True}})
    assert metrics == {("quality", "acc,none"): 0.5}


_STORED_RUN = REPO / "leaderboards" / "runs" / "lm_eval" / "quality" / "am-omp_0.01"  # made before runs kept sample_scores.json


def _stored_run_copy(tmp_path):
    from arckv_press.tasks._common import resources

    if not (resources.SHARED_DATA_DIR / "quality" / "leval_quality.jsonl").is_file():
        pytest.skip("no shared QuALITY data")
    if not (_STORED_RUN / "requests_rank0.db").is_file():
        pytest.skip("the stored QuALITY run is not in this checkout")
    folder = tmp_path / "quality" / "am-omp_0.01"
    shutil.copytree(_STORED_RUN, folder)
    (folder / "sample_scores.json").unlink(missing_ok=True)  # as the run was made (rescored since)
    return folder


def test_rescore_recovers_the_per_sample_scores_of_a_stored_run(re_, tmp_path):
    """The committed QuALITY run (29 questions, no per-sample scores) is rescored from its own request
    cache with no model: every question gets a score, and their mean is the stored accuracy."""
    folder = _stored_run_copy(tmp_path)
    stored = json.loads((folder / "results.json").read_text())["results"]["quality"]
    re_.rescore(folder)
    samples = json.loads((folder / "sample_scores.json").read_text())["quality"]
    assert len(samples) == 29
    for metric in ("acc", "acc_norm"):
        values = [s[metric] for s in samples.values()]
        assert set(values) <= {0.0, 1.0}
        assert sum(values) / len(values) == pytest.approx(stored[f"{metric},none"], abs=1e-12)
    committed = _STORED_RUN / "sample_scores.json"  # the rescore committed beside the run
    if committed.is_file():
        assert json.loads(committed.read_text())["quality"] == samples
    # a second --rescore leaves a run that has its scores alone
    assert re_.main(["--rescore", "--benchmarks", "quality", "--methods", "am-omp", "--ratios", "0.01",
                     "--no-baselines", "--out", str(tmp_path)]) == 0


def test_rescore_refuses_a_cache_without_every_answer(re_, tmp_path):
    folder = _stored_run_copy(tmp_path)
    with sqlite3.connect(folder / "requests_rank0.db") as db:
        db.execute("DELETE FROM unnamed WHERE rowid = (SELECT min(rowid) FROM unnamed)")
    with pytest.raises(ValueError, match="1 requests are not in the run's request cache"):
        re_.rescore(folder)
    assert not (folder / "sample_scores.json").exists()


def test_rescore_refuses_cached_answers_that_score_otherwise(re_, tmp_path, capsys):
    folder = _stored_run_copy(tmp_path)
    data = json.loads((folder / "results.json").read_text())
    data["results"]["quality"]["acc,none"] += 1 / 29
    (folder / "results.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="not the stored .*nothing written"):
        re_.rescore(folder)
    assert not (folder / "sample_scores.json").exists()
    assert re_.main(["--rescore", "--benchmarks", "quality", "--methods", "am-omp", "--ratios", "0.01",
                     "--no-baselines", "--out", str(tmp_path)]) == 1
    assert "nothing written" in capsys.readouterr().out


@pytest.mark.parametrize("text", ["{not json", "[]", '{"config": {}}'])
def test_rescore_refuses_a_damaged_results_file(re_, tmp_path, text):
    """Checked before lm-eval is asked anything: no task data or cache is needed to refuse it."""
    folder = tmp_path / "quality" / "am-omp_0.01"
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(text)
    with pytest.raises(ValueError, match=r"results\.json (is not valid JSON|holds no lm-eval results)"):
        re_.rescore(folder)
    assert not (folder / "sample_scores.json").exists()


@pytest.mark.parametrize("bench, old_task", [("ruler", "niah_single_1"), ("longbench", "longbench_multifieldqa_zh")])
def test_rescore_reads_a_run_stored_under_the_former_task_names(re_, tmp_path, bench, old_task):
    """A committed run stored before the tasks took their ``arckv_`` names (``ruler``,
    ``niah_single_1``, ``longbench_*``) is rescored from its request cache under today's names: the
    per-sample scores equal those committed beside it, under the names of its results.json."""
    from arckv_press.tasks._common import resources

    stored = REPO / "leaderboards" / "runs" / "lm_eval" / bench / "snapkv_0.1"
    if not (resources.SHARED_DATA_DIR / bench).is_dir():
        pytest.skip(f"no shared {bench} data")
    if not (stored / "requests_rank0.db").is_file() or not (stored / "sample_scores.json").is_file():
        pytest.skip(f"the stored {bench} run is not in this checkout")
    assert old_task in json.loads((stored / "results.json").read_text())["results"]  # the former names
    folder = tmp_path / bench / "snapkv_0.1"
    shutil.copytree(stored, folder)
    (folder / "sample_scores.json").unlink()
    re_.rescore(folder)
    assert json.loads((folder / "sample_scores.json").read_text()) == json.loads((stored / "sample_scores.json").read_text())
