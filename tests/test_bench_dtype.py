"""scripts/bench_dtype.py: prints one row per measurement with the bf16 / float32 ratio of the same run."""

from conftest import load_script


def test_bench_dtype_prints_the_ratio_of_its_own_timings(capsys, monkeypatch):
    mod = load_script("bench_dtype")
    fake = {"float32": 0.002, "bfloat16": 0.010}  # seconds, keyed by dtype name
    monkeypatch.setattr(mod, "matmul_seconds", lambda dtype, *a: fake[str(dtype).removeprefix("torch.")])
    assert mod.main(["--shape", "4", "4", "4", "--tokens", "0", "--repeats", "1"]) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert row[:2] == ["matmul", "4x4x4"] and [float(v) for v in row[2:]] == [2.0, 10.0, 5.0]


def test_matmul_seconds_is_a_positive_median():
    import torch

    mod = load_script("bench_dtype")
    assert mod.matmul_seconds(torch.float32, 8, 8, 8, 3) > 0
