"""Interpreter start-up cost of the installed package (its lm-eval start-up hook runs in every
Python process of the environment).

Builds the wheel from this checkout, creates two fresh virtual environments without system
site-packages, installs the wheel (``--no-deps``) into one of them, and times ``python -c pass``
in both, alternating A/B runs so that drift hits both alike. Prints the median wall time of each,
the difference (goal: at most 5 ms) and the hook module's own import time from ``-X importtime``.

    python scripts/bench_startup.py            # 40 runs each
    python scripts/bench_startup.py --runs 100

Writes nothing to the repository (everything lives in a temporary folder).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from arckv_press.bench import checkout

HOOK_MODULE = "_arckv_press_lm_eval_hook"
GOAL_MS = 5.0


def _python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")


def _wall(python: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run([str(python), "-c", "pass"], check=True)
    return time.perf_counter() - t0


def _hook_import_us(python: Path) -> int | None:
    out = subprocess.run([str(python), "-X", "importtime", "-c", "pass"], check=True, capture_output=True, text=True)
    for line in out.stderr.splitlines():  # "import time: self [us] | cumulative | name"
        m = re.match(r"import time:\s+\d+\s+\|\s+(\d+)\s+\|\s+(\S+)", line)
        if m and m.group(2).strip() == HOOK_MODULE:
            return int(m.group(1))
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=40, help="timed runs per environment (default 40)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(checkout()),
                        "-w", str(tmp / "dist")], check=True, cwd=tmp)
        (wheel,) = (tmp / "dist").glob("*.whl")
        envs = {}
        for name in ("without", "with"):
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp / name)], check=True)
            envs[name] = _python(tmp / name)
        subprocess.run([sys.executable, "-m", "pip", "--python", str(envs["with"]), "install", "--no-deps",
                        "--no-index", "-q", str(wheel)], check=True, cwd=tmp)
        for python in envs.values():  # warm the file cache
            _wall(python)
        times = {name: [] for name in envs}
        for _ in range(args.runs):
            for name, python in envs.items():
                times[name].append(_wall(python))
        hook_us = [_hook_import_us(envs["with"]) for _ in range(10)]
    med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    diff = med["with"] - med["without"]
    print(f"python -c pass, median of {args.runs} alternating runs ({sys.version.split()[0]}, {sys.platform}):")
    print(f"  fresh venv without arckv-press: {med['without']:7.2f} ms")
    print(f"  fresh venv with the wheel:      {med['with']:7.2f} ms")
    print(f"  difference:                     {diff:+7.2f} ms (goal <= {GOAL_MS:g} ms: {'met' if diff <= GOAL_MS else 'NOT met'})")
    found = [u for u in hook_us if u is not None]
    if found:
        print(f"  -X importtime of {HOOK_MODULE} (cumulative, median of {len(found)}): {statistics.median(found)} us")
    else:
        print(f"  {HOOK_MODULE} was not imported at start-up: is the .pth file in the wheel?")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
