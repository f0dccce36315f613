"""The leaderboard's plots: per benchmark, score against kept fraction and against compaction
seconds (``<benchmark>_score_vs_ratio.png``, ``<benchmark>_score_vs_time.png``), and the probes'
bars (``probes.png``) and the synthetic sweep's time per stage against the length
(``long_context_scaling.png``). PNGs are written without the matplotlib version in their metadata, so the
same rows give the same bytes."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from statistics import mean
from typing import Any, NamedTuple

from arckv_press.methods import METHODS

from .table import REFERENCE_METHODS, fmt_ratio, num, short_model

__all__ = ["Point", "benchmark_points", "draw_line", "method_family", "method_styles", "plot_benchmark",
           "plot_long_context", "plot_probes", "save_png"]

_FAMILY_STYLE = {"arckv": ("-", "o"), "am": ("--", "s"), "kvpress": (":", "^")}


class Point(NamedTuple):
    """One method's point of a benchmark plot: kept fraction, score, compaction seconds, and the 95%
    interval of the score (``None`` when the point is no single row with stored examples)."""

    ratio: float
    score: float
    seconds: float | None
    low: float | None = None
    high: float | None = None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: Path, dpi: int = 100) -> Path:
    """``fig`` as a PNG at ``path`` with no software version in its metadata (reproducible bytes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, metadata={"Software": None})
    return path


def benchmark_points(rows: list[dict]) -> dict[tuple[str, str], list[Point]]:
    """Per (model, method): the points of the benchmark: its group row (with that row's interval), else
    the mean over its task rows (an interval only when there is one task row: a mean of intervals is
    none)."""
    by: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        by[(r["model"], r["method"], fmt_ratio(r["ratio"]))].append(r)
    out: dict[tuple[str, str], list] = defaultdict(list)
    for (model, method, ratio), rs in by.items():
        group = [r for r in rs if r["task"] == r["benchmark"]]
        rs = group or rs
        scores = [num(r["score"]) for r in rs if num(r["score"]) is not None]
        secs = [num(r.get("compaction_seconds")) for r in rs if num(r.get("compaction_seconds")) is not None]
        if scores:
            low, high = (num(rs[0].get("ci_low")), num(rs[0].get("ci_high"))) if len(rs) == 1 else (None, None)
            if low is None or high is None:
                low = high = None
            out[(model, method)].append(Point(float(ratio), mean(scores), mean(secs) if secs else None, low, high))
    return out


def draw_line(ax, xs: list[float], pts: list[Point], style: dict[str, Any], label: str) -> None:
    """A method's line, with its points' 95% intervals as error bars where the rows store them."""
    ax.plot(xs, [p.score for p in pts], label=label, **style)
    bars = [(x, p) for x, p in zip(xs, pts) if p.low is not None]
    if bars:
        ax.errorbar([x for x, _ in bars], [p.score for _, p in bars],
                    yerr=[[max(0.0, p.score - p.low) for _, p in bars], [max(0.0, p.high - p.score) for _, p in bars]],
                    fmt="none", ecolor=style["color"], elinewidth=1, capsize=3, alpha=0.7)


def method_family(method: str) -> str:
    """The family of a compressing method (:data:`arckv_press.methods.METHODS`): ``arckv``, ``am``
    or ``kvpress``; a name the package does not define is a kvpress press."""
    m = METHODS.get(method)
    return m.family if m is not None and m.family in _FAMILY_STYLE else "kvpress"


def method_styles(methods: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Matplotlib styles for the method lines of one plot, ``{label: method}`` to ``{label: style}``
    (a label is ``method`` or ``model method``): line style and marker by the method's family (ARC-KV
    solid, Attention Matching dashed, kvpress dotted) and a colour of ``tab20`` per label in sorted
    order, so every line differs in colour even with a dozen methods (``tab10`` repeats after ten)."""
    import matplotlib

    palette = matplotlib.colormaps["tab20"].colors
    palette = palette[0::2] + palette[1::2]  # the ten strong colours first, then their light twins
    styles = {}
    for i, label in enumerate(sorted(methods)):
        ls, marker = _FAMILY_STYLE[method_family(methods[label])]
        styles[label] = {"color": palette[i % len(palette)], "linestyle": ls, "marker": marker}
    return styles


def plot_benchmark(benchmark: str, rows: list[dict], out_dir: Path) -> list[Path]:
    """The two plots of one benchmark's rows in ``out_dir``; the references as horizontal lines."""
    plt = _pyplot()
    points = benchmark_points(rows)
    many = len({m for m, _ in points}) > 1
    labels = {key: f"{short_model(key[0])} {key[1]}" if many else key[1] for key in points}
    styles = method_styles({labels[key]: key[1] for key in points if key[1] not in REFERENCE_METHODS})
    paths = []
    for kind in ("ratio", "time"):
        fig, ax = plt.subplots(figsize=(6, 4))
        for (model, method), pts in sorted(points.items()):
            label = labels[(model, method)]
            if method in REFERENCE_METHODS:
                ref, color = pts[0], "k" if method == "none" else "grey"
                ax.axhline(ref.score, ls="--" if method == "none" else ":", color=color,
                           label=f"{label} (full context)" if method == "none" else label)
                if ref.low is not None:  # the reference's 95% interval as a band
                    ax.axhspan(ref.low, ref.high, color=color, alpha=0.08, lw=0)
                continue
            pts = sorted(pts)
            if kind == "ratio":
                draw_line(ax, [p.ratio for p in pts], pts, styles[label], label)
            else:
                timed = [p for p in pts if p.seconds is not None and p.seconds > 0]
                if timed:
                    draw_line(ax, [p.seconds for p in timed], timed, styles[label], label)
        ax.set_xscale("log")
        ax.set_xlabel("kept ratio" if kind == "ratio" else "compaction seconds per document")
        ax.set_ylabel("score (bars, band: 95% interval over examples)")
        ax.set_title(benchmark)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(save_png(fig, out_dir / f"{benchmark}_score_vs_{kind}.png"))
        plt.close(fig)
    return paths


def plot_probes(rows: list[dict], out_dir: Path) -> Path | None:
    """``probes.png``: damage and needle fraction per probes row (``scripts/probes.py``); ``None``
    without rows."""
    if not rows:
        return None
    plt = _pyplot()

    def same(r):
        return r["config"], r["ratio"], r.get("dtype"), r.get("indexer")

    config_ids = defaultdict(set)  # name the compaction options only where they tell rows apart
    for r in rows:
        config_ids[same(r)].add(r.get("config_id") or "")
    labels = [f"{r['config']} @{r['ratio']}" + (f" {r['dtype']}" if r.get("dtype") else "")
              + (f" [{r['indexer'][:6]}]" if r.get("indexer") else "")  # one bar per checkpoint / config
              + (f" <{(r.get('config_id') or '-')[:6]}>" if len(config_ids[same(r)]) > 1 else "") for r in rows]
    damage = [num(r.get("damage")) or 0.0 for r in rows]
    found = [(num(r.get("needle_found")) or 0.0) / t if (t := num(r.get("needle_total"))) else math.nan for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, vals, title in zip(axes, (damage, found), ("damage (lower is better)", "needle fraction found")):
        ax.bar(range(len(vals)), vals)
        ax.set_xticks(range(len(vals)), labels, rotation=45, ha="right", fontsize=7)
        ax.set_title(title)
    fig.tight_layout()
    out = save_png(fig, out_dir / "probes.png")
    plt.close(fig)
    return out


#: the lines of ``long_context_scaling.png``: (key of ``last_synthetic_run``, label, line style)
SCALING_LINES = (
    ("arckv-ha/reference_pass", "statistics pass (the exact floor of the repeat-prefill's work)", "k-"),
    ("arckv-ha/post", "ARC-KV after the pass, chunk-local (default above 10,000)", "C0-o"),
    ("arckv-ha/merge", "  of it: merge", "C0:"),
    ("arckv-ha/beta_fit", "  of it: beta fit", "C0-."),
    ("arckv-ha/value_fit", "  of it: C_v fit", "C0--"),
    ("arckv-ha/post_unchunked", "ARC-KV after the pass, unchunked (before)", "C3-s"),
    ("am-omp-fast/total", "AM OMP-fast (while under its cap)", "C2-^"),
)


def plot_long_context(rows: list[dict], out_dir: Path, ratio: float = 0.1) -> Path | None:
    """``long_context_scaling.png``: seconds per stage against the length, log-log, from the newest
    synthetic sweep of ``bench_compaction.py`` at keep ``ratio``; ``None`` without one."""
    from arckv_press.bench.bench_compaction import last_synthetic_run

    try:
        run, by_length = last_synthetic_run(rows, ratio)
    except ValueError:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for key, label, style in SCALING_LINES:
        pts = [(T, st[key]) for T, st in by_length.items() if key in st]
        if pts:
            ax.plot(*zip(*pts), style, label=label, markersize=4)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("positions T (synthetic heads, H = G = 3, D = 64)")
    ax.set_ylabel("seconds")
    ax.set_title(f"Long-context scaling, keep {ratio * 100:g}% ({run['date'][:10]}, {run['threads']} threads)",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = save_png(fig, out_dir / "long_context_scaling.png")
    plt.close(fig)
    return out
