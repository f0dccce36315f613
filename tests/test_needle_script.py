"""scripts/needle.py: rows of another indexer checkpoint are neither resumed nor drawn."""

from __future__ import annotations

from conftest import load_script

from arckv_press.models import DEFAULT_MODEL_ID
from arckv_press.registry import indexer_id


def test_needle_rows_of_another_indexer_checkpoint_are_left_out(tmp_path, capsys):
    needle = load_script("needle")
    shipped = indexer_id("arckv", DEFAULT_MODEL_ID)
    assert shipped  # the default model ships a checkpoint
    ids = needle.current_indexer_ids(["arckv", "snapkv"], DEFAULT_MODEL_ID)
    assert ids == {"arckv": shipped, "snapkv": "", "none": ""}

    def row(method, indexer, correct, depth="0"):
        return {"method": method, "ratio": "0.1", "length": "1000", "depth": depth, "seed": "0", "context_tokens": "990",
                "needle": "1234567", "answer": "x", "correct": correct, "compaction_s": "1.0", "answer_s": "1.0",
                "cache_bytes": "10", "masked": "0", "indexer": indexer, "model": DEFAULT_MODEL_ID, "command": "c",
                "date": "2026-01-01T00:00:00Z", "package_version": "0", "machine": "m"}

    rows = [row("arckv", "0123456789ab", 0), row("arckv", shipped, 1, "0.5"), row("snapkv", "", 0), row("none", "", 1)]
    kept = needle.current_indexer_rows(rows, DEFAULT_MODEL_ID)
    assert [(r["method"], r["indexer"]) for r in kept] == [("arckv", shipped), ("snapkv", ""), ("none", "")]
    assert "1 rows made with another indexer checkpoint are left out" in capsys.readouterr().out
    path = tmp_path / "needle.csv"
    needle.append_rows(path, rows, needle.FIELDS)
    needle.summary(path)  # arckv: the shipped checkpoint's single row (correct), not the old one
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("arckv "))
    assert line.split()[3:5] == ["1", "1.00"]
