"""scripts/bench_compaction.py: the synthetic sweep writes its timings and prints ratios of the same run."""

import csv

from conftest import assert_ratio_of_rounded, load_script


def test_synthetic_sweep_prints_the_ratio_of_the_timings_it_writes(tmp_path, capsys):
    mod = load_script("bench_compaction")
    out = tmp_path / "bench.csv"
    argv = ["--skip-model", "--max-T", "1024", "--queries", "64", "--repeats", "1", "--synthetic-ratios", "0.05",
            "--out", str(out)]
    assert mod.main(argv) == 0
    rows = list(csv.DictReader(out.open()))
    assert {r["section"] for r in rows} == {"synthetic"} and {r["length"] for r in rows} == {"1024"}
    arc = {r["stage"]: float(r["seconds"]) for r in rows if r["method"] == "arckv-ha"}
    assert {"selection", "merge", "beta_fit", "value_fit", "total"} <= set(arc)
    assert all(v >= 0 for v in arc.values())
    assert arc["total"] >= arc["merge"] + arc["beta_fit"] + arc["value_fit"] - 2e-4  # stages lie inside the call
    (omp,) = [float(r["seconds"]) for r in rows if r["method"] == "am-omp-fast"]
    (idx_sel,) = [float(r["seconds"]) for r in rows if r["method"] == "arckv"]  # the shipped indexer's selection
    assert {r["stage"] for r in rows if r["method"] == "arckv"} == {"selection"} and idx_sel > 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.split()[:2] == ["1024", "0.05"])
    omp_arc, omp_idx = (float(x.rstrip("x")) for x in line.split()[-2:])
    assert_ratio_of_rounded(omp_arc, omp, arc["total"], csv_decimals=4)  # CSV keeps 4 decimals, the print 2
    assert_ratio_of_rounded(omp_idx, omp, idx_sel, csv_decimals=4, print_decimals=1)


def test_model_section_ratios_come_from_the_written_stage_times(tmp_path, capsys):
    mod = load_script("bench_compaction")
    out = tmp_path / "bench.csv"
    argv = ["--skip-synthetic", "--lengths", "300", "--ratios", "0.2", "--methods", "arckv", "arckv-ha", "am-omp-fast",
            "--repeats", "1", "--dtype", "float32", "--out", str(out)]
    assert mod.main(argv) == 0
    rows = list(csv.DictReader(out.open()))
    assert {r["dtype"] for r in rows} == {"float32"} and {r["length"] for r in rows} == {"300"}
    sec = {(r["method"], r["stage"]): float(r["seconds"]) for r in rows}
    from arckv_press.models import DEFAULT_MODEL_ID
    from arckv_press.registry import result_ids

    for r in rows:  # every time names the checkpoint and options it was measured with
        assert {"indexer": r["indexer"], "config_id": r["config_id"]} == (
            result_ids(r["method"], DEFAULT_MODEL_ID) if r["method"] != "none" else {"indexer": "", "config_id": ""})
    assert {r["indexer"] for r in rows if r["method"] == "arckv"} != {""}
    printed = capsys.readouterr().out.splitlines()
    for name in ("arckv", "arckv-ha"):  # the learned indexer and HA anchors, each against OMP-fast
        arc_layers = sum(sec[(name, s)] for s in mod.ARCKV_STAGES[1:])
        assert sec[(name, "compact_total")] >= arc_layers + sec[(name, "repeat_prefill")] - 1e-3
        line = next(l for l in printed if l.strip().startswith("300 tok, rho 0.2:") and f"am-omp-fast/{name} " in l)
        per_layer = float(line.split(f"am-omp-fast/{name} ")[1].split("x")[0])
        assert_ratio_of_rounded(per_layer, sec[("am-omp-fast", "am_total")], arc_layers, csv_decimals=4,
                                den_terms=len(mod.ARCKV_STAGES) - 1)
