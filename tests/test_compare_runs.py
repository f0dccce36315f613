"""scripts/compare_runs.py: two lm-eval runs paired on the prompts both answered."""

from __future__ import annotations

import json

import pytest
from conftest import load_script
from scipy.stats import binomtest


@pytest.fixture(scope="module")
def cr():
    return load_script("compare_runs")


def _run(folder, scores: dict[str, list[float]], press="arckv-ha", samples=True):
    """A run_evals-style folder: results.json with the group ``ruler`` over the tasks of ``scores``."""
    folder.mkdir(parents=True)
    results = {t: {"alias": t, "score,none": sum(v) / len(v)} for t, v in scores.items()}
    every = [x for v in scores.values() for x in v]
    results["ruler"] = {"alias": "ruler", "score,none": sum(every) / len(every)}
    data = {"results": results, "group_subtasks": {"ruler": sorted(scores)},
            "configs": {t: {"metadata": {"max_seq_lengths": [2048]}} for t in scores},
            "config": {"model": "hf-arckv", "model_args": f"press={press},ratio=0.1,dtype=float32"},
            "date": 1.7e9, "n-samples": {}, "model_name": "m"}
    (folder / "results.json").write_text(json.dumps(data))
    if samples:
        (folder / "sample_scores.json").write_text(json.dumps(
            {t: {str(i): {"score": x} for i, x in enumerate(v)} for t, v in scores.items()}))
    return folder / "results.json"


def test_pairs_each_task_and_the_group_on_shared_prompts(cr, tmp_path, capsys):
    a = _run(tmp_path / "a", {"niah_single_1": [1, 1, 0, 1, 1], "vt": [0.5, 0.0, 1.0]})
    b = _run(tmp_path / "b", {"niah_single_1": [1, 0, 0, 0], "vt": [0.5, 0.0, 1.0]}, press="snapkv")
    rows = {r["task"]: r for r in cr.main([str(a), str(b)])}
    assert set(rows) == {"niah_single_1", "vt", "ruler"}
    n1 = rows["niah_single_1"]  # prompt 4 only in A: left out
    assert (n1["n"], n1["score_a"], n1["score_b"], n1["wins"], n1["losses"]) == (4, 0.75, 0.25, 2, 0)
    assert n1["mean_difference"] == pytest.approx(0.5)
    assert n1["p_sign"] == pytest.approx(binomtest(2, 2, 0.5).pvalue)
    assert rows["vt"]["mean_difference"] == 0 and rows["vt"]["verdict"] == "tie"
    group = rows["ruler"]  # every task's shared prompts
    assert group["n"] == 7 and group["mean_difference"] == pytest.approx(2 / 7)
    assert group["ci_low"] <= group["mean_difference"] <= group["ci_high"]
    assert "| niah_single_1 | 4 | 0.750 | 0.250 | +0.500 |" in capsys.readouterr().out
    assert [r["task"] for r in cr.compare(a, b, ["vt"])] == ["vt"]


def test_refuses_runs_without_scores_and_unknown_tasks(cr, tmp_path):
    a = _run(tmp_path / "a", {"vt": [1.0, 0.0]})
    bare = _run(tmp_path / "b", {"vt": [1.0, 0.0]}, samples=False)
    with pytest.raises(ValueError, match="no per-example scores"):
        cr.compare(a, bare)
    with pytest.raises(ValueError, match="not scored by both"):
        cr.compare(a, a, ["cwe"])
    with pytest.raises(SystemExit):
        cr.main([str(a), str(tmp_path / "missing.json")])
