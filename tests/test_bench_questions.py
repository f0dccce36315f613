"""scripts/bench_questions.py on a tiny local model: rows per cache and mode, batched answers equal
to one-by-one answers, and the printed ratios are the CSV's own seconds."""

from __future__ import annotations

import csv
import importlib.util
import re
from pathlib import Path

from conftest import assert_ratio_of_rounded, build_tiny_tokenizer

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_questions.py"


def test_bench_questions_tiny(tiny_model, tmp_path, capsys):
    folder = tmp_path / "model"
    model = tiny_model("llama", num_layers=2, seed=0, initializer_range=0.2)
    model.config.eos_token_id = 2
    model.save_pretrained(folder)
    build_tiny_tokenizer().save_pretrained(folder)
    spec = importlib.util.spec_from_file_location("bench_questions", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "bq.csv"
    assert mod.main(["--model", str(folder), "--dtype", "float32", "--tokens", "300", "--questions", "3",
                     "--batch-size", "2", "--max-new-tokens", "4", "--ratio", "0.25", "--out", str(out)]) == 0
    rows = list(csv.DictReader(open(out)))
    assert [(r["cache"], r["mode"], r["batch_size"]) for r in rows] == [
        ("full", "single", "1"), ("full", "batched", "2"), ("arckv-ha", "single", "1"), ("arckv-ha", "batched", "2")]
    assert all(r["same_as_single"] == "3/3" for r in rows)
    full_bytes, compact_bytes = int(rows[0]["cache_bytes"]), int(rows[2]["cache_bytes"])
    assert compact_bytes < 0.5 * full_bytes
    sec = {(r["cache"], r["mode"]): float(r["seconds"]) for r in rows}
    printed = capsys.readouterr().out
    m = re.search(r"one by one ([0-9.]+)x, batched ([0-9.]+)x", printed)
    for printed_ratio, mode in ((float(m.group(1)), "single"), (float(m.group(2)), "batched")):
        assert_ratio_of_rounded(printed_ratio, sec["arckv-ha", mode], sec["full", mode], csv_decimals=3)
