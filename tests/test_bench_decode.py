"""scripts/bench_decode.py: a tiny grid runs, writes its rows (bytes checked against the cache
layouts), and its printed ratios are the CSV's own numbers."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

from conftest import assert_ratio_of_rounded

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_decode.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_decode", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_decode_tiny_grid(tmp_path, capsys):
    out = tmp_path / "bd.csv"
    mod = _load()
    assert mod.main(["--batch", "1", "3", "--contexts", "64", "--ratios", "0.25", "--repeats", "1", "--warmup", "0",
                     "--dtypes", "float32", "--appended", "5", "--out", str(out)]) == 0
    rows = list(csv.DictReader(open(out)))
    assert [(r["batch"], r["context"], r["t_max"]) for r in rows] == [("1", "64", "16"), ("3", "64", "16")]
    for r in rows:
        B = int(r["batch"])
        # bytes: full = B (T + A) rows of K and V; compact = 3 heads x 16 entries (2 D float32 + beta) + B x A rows
        assert int(r["full_bytes"]) == B * 3 * (64 + 5) * 2 * 64 * 4
        assert int(r["compact_bytes"]) == 3 * 16 * (2 * 64 * 4 + 4) + B * 3 * 5 * 2 * 64 * 4
        # kvpress: a pruning press keeps int(rho T) rows per head and sequence; a masking press (KVzip) all of them
        assert int(r["kvpress_pruned_bytes"]) == B * 3 * (int(0.25 * 64) + 5) * 2 * 64 * 4
        assert int(r["kvpress_masked_bytes"]) == int(r["full_bytes"])
        for ratio, num, den in (("compact_over_full", "compact_ms", "full_ms"), ("compact_over_pruned", "compact_ms", "pruned_ms")):
            assert_ratio_of_rounded(float(r[ratio]), float(r[num]), float(r[den]), csv_decimals=3, print_decimals=3)
    assert "c/p = compact / pruned" in capsys.readouterr().out
