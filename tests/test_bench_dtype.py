"""scripts/bench_dtype.py: prints one row per measurement with the bf16 / float32 ratio of the same run."""

from conftest import load_script


def test_bench_dtype_prints_the_ratio_of_its_own_timings(capsys, monkeypatch):
    mod = load_script("bench_dtype")
    fake = {"float32": 0.002, "bfloat16": 0.010}  # seconds, keyed by dtype name
    monkeypatch.setattr(mod, "matmul_seconds", lambda dtype, *a: fake[str(dtype).removeprefix("torch.")])
    assert mod.main(["--shape", "4", "4", "4", "--tokens", "0", "--repeats", "1"]) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert row[:2] == ["matmul", "4x4x4"] and [float(v) for v in row[2:]] == [2.0, 10.0, 5.0]


def test_matmul_seconds_times_the_product_of_its_shape_and_dtype(monkeypatch):
    import torch

    mod = load_script("bench_dtype")
    seen = {}

    def fake_median(fn, repeats):
        seen["repeats"], seen["out"] = repeats, fn()
        return 0.5

    monkeypatch.setattr(mod, "median_seconds", fake_median)
    assert mod.matmul_seconds(torch.bfloat16, 3, 5, 7, 4) == 0.5
    assert seen["repeats"] == 4 and seen["out"].shape == (3, 7) and seen["out"].dtype == torch.bfloat16


def test_median_seconds_skips_warmup_and_takes_the_median(monkeypatch):
    from arckv_press import runinfo

    ticks = iter([0.0, 100.0, 0.0, 3.0, 0.0, 1.0, 0.0, 2.0])  # warm-up takes 100 s, then 3, 1, 2
    monkeypatch.setattr(runinfo.time, "perf_counter", lambda: next(ticks))
    calls, resets = [], []
    assert runinfo.median_seconds(lambda: calls.append(1), 3, warmup=1, reset=lambda: resets.append(1)) == 2.0
    assert len(calls) == 4 and len(resets) == 4
