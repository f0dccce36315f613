"""Needle in a haystack: exact retrieval of a 7-digit number per method, kept fraction, context
length and needle depth, on the default model with the Paul Graham essays.

Each case is one call of kvpress's ``pipeline("kv-press-text-generation")`` with the method's
press (``arckv_press.registry.make_press``), a RULER-style instruction before the haystack and
the answer prefix "The special magic number for <city> mentioned in the provided text is" (the
framing of ``arckv demo``). A case is correct when the needle's 7-digit value appears in the
greedy answer as a whole number.

    python scripts/needle.py --quick
    python scripts/needle.py                       # full grid (hours on a CPU)
    python scripts/needle.py --methods arckv-ha snapkv --ratios 0.1
    python scripts/needle.py --plot-only

Lengths are context tokens (instruction + haystack + needle; K = 1000 tokens, so the 8K point
plus the chat framing and question stays inside the model's 8192 positions). Depth 0 puts the
needle at the start of the haystack, 1 at its end.

Writes ``leaderboards/needle.csv`` (one row per method / ratio / length / depth / seed; the
full cache, method ``none``, once per length / depth / seed with ratio 1) and one heat map per
kept fraction, ``leaderboards/plots/needle_rho<ratio>.png`` (one panel per method, rows = depth,
columns = length, colour = share of seeds answered correctly; with ``--out DIR/NAME.csv``,
``DIR/plots/NAME_rho<ratio>.png``). The figures and the summary show the rows made with the current
defaults, or with the run's ``--option`` fields and ``--indexer`` checkpoint. Resumable: cases
already in the CSV are skipped, so re-running with nothing missing only redraws the figures.

Columns ``compaction_s`` (seconds inside ``with press(model)``: the context prefill plus the
method's compression; for ``none`` the plain prefill) and ``answer_s`` (question + greedy
answer). ``cache_bytes`` are the bytes the cache really holds after the answer was trimmed
(``CompactLayer.nbytes()`` for ARC-KV / AM layers, ``keys.nbytes + values.nbytes`` otherwise).
``masked`` is true when the press hides evicted positions behind a mask instead of removing
them (kvpress's KVzip): such a cache holds the full size. ``indexer`` is the content id of the
learned indexer checkpoint a method used (``arckv``; empty for the others) and ``config_id`` the
id of its compaction options (ARC-KV and AM; ``arckv_press.registry.result_ids``): after a new
checkpoint ships or a default changes, the affected cases run again and the figures and summary
show only the rows made with what the methods use now.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from arckv_press.bench import ROOT
from arckv_press.haystack import FRAMINGS
from arckv_press.runinfo import (
    CurrentIds,
    add_columns,
    add_option_argument,
    append_rows,
    current_rows,
    parse_length,
    print_header,
    read_rows,
    run_meta,
)

DEFAULT_OUT = ROOT / "leaderboards" / "needle.csv"
DEFAULT_METHODS = (
    "arckv", "arckv-ha", "arckv-vi", "am-omp", "am-omp-fast", "am-ha", "snapkv", "kvzip", "expected_attention",
    "knorm", "streaming_llm",
)
QUICK = dict(methods=("arckv-ha", "am-omp-fast", "snapkv"), ratios=(0.1,), lengths=(1000, 2000), depths=(0.0, 0.5, 1.0))
MAX_NEW_TOKENS = 12
FIELDS = [
    "method", "ratio", "length", "depth", "seed", "framing", "context_tokens", "needle", "answer", "correct",
    "compaction_s", "answer_s", "cache_bytes", "masked", "indexer", "config_id", "model", "command", "date", "package_version", "machine",
]


def parse_unit(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def case_key(method: str, ratio, length, depth, seed, framing="ruler") -> tuple:
    return (method, round(float(ratio), 6), int(length), round(float(depth), 6), int(seed), framing or "ruler")


def migrate_csv(path: Path) -> None:
    """Give a needle CSV written before the ``framing`` column that column (its rows are all RULER-framed),
    rewritten atomically with the current :data:`FIELDS` (:func:`~arckv_press.runinfo.add_columns`); a CSV
    that has it is left alone, and one that lacks other columns too is refused."""
    rows = read_rows(path)
    if not rows or "framing" in rows[0]:
        return
    missing = [f for f in FIELDS if f not in rows[0] and f != "framing"]
    if missing:
        raise ValueError(f"{path}: cannot add the framing column, the CSV also lacks {missing}")
    add_columns(path, FIELDS, {"framing": "ruler"})


class TimedPress:
    """Wraps a press so that the time spent inside ``with press(model)`` is recorded (the
    pipeline's context prefill plus the compression, including work done when the block exits)."""

    def __init__(self, press):
        self.press = press
        self.seconds = math.nan

    @contextlib.contextmanager
    def __call__(self, model):
        t0 = time.perf_counter()
        try:
            with self.press(model) if self.press is not None else contextlib.nullcontext():
                yield
        finally:
            self.seconds = time.perf_counter() - t0


def cache_bytes(cache) -> int:
    from arckv_press.cache import cache_nbytes

    return cache_nbytes(cache)


def attention_modules(model):
    from arckv_press.capture import decoder_layers

    return [layer.self_attn for layer in decoder_layers(model)]


def is_correct(value: str, answer: str) -> bool:
    return re.search(rf"(?<!\d){re.escape(value)}(?!\d)", answer) is not None


def run_case(pipe, model, tok, name: str, ratio: float, context: str, needle, indexer: str | None = None,
             options: dict | None = None) -> dict:
    """One pipeline call; restores the model's attention implementation afterwards."""
    from arckv_press.attention import disable_compact_attention
    from arckv_press.cache import new_cache
    from arckv_press.framing import pipeline_question
    from arckv_press.methods import METHODS
    from arckv_press.registry import make_press, press_options

    extra, options = options, {"tokenizer": tok} if METHODS[name].ours else {}
    press = make_press(name, ratio, **options, **press_options(name, extra, indexer))
    timed = TimedPress(press)
    for module in attention_modules(model):  # stale KVzip masks from an earlier case
        module.masked_key_indices = None
    cache = new_cache(model)
    try:
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = pipe(context, **pipeline_question(tok, needle.question, needle.prefix()), press=timed,
                       max_new_tokens=MAX_NEW_TOKENS, cache=cache)
            total = time.perf_counter() - t0
        masked = any(getattr(m, "masked_key_indices", None) is not None for m in attention_modules(model))
        nbytes = cache_bytes(cache)
    finally:
        # The ARC-KV / AM presses leave the model on the ARC-KV attention: switch back after every
        # case so that each case starts from the model's own attention implementation.
        disable_compact_attention(model)
    answer = out["answer"]
    return {
        "answer": answer.strip(), "correct": int(is_correct(needle.value, answer)),
        "compaction_s": f"{timed.seconds:.3f}", "answer_s": f"{total - timed.seconds:.3f}",
        "cache_bytes": nbytes, "masked": int(masked),
    }


def build_cases(args) -> list[tuple]:
    cases = []
    for framing in args.framings:
        for length in args.lengths:
            for depth in args.depths:
                for seed in args.seeds:
                    if args.full_cache:
                        cases.append(("none", 1.0, length, depth, seed, framing))
                    for ratio in args.ratios:
                        for method in args.methods:
                            if method != "none":
                                cases.append((method, ratio, length, depth, seed, framing))
    return cases


def run(args, meta: dict) -> None:
    from kvpress import KVPressTextGenerationPipeline  # noqa: F401  (registers the pipeline)
    from tqdm.auto import tqdm
    from transformers import pipeline

    from arckv_press.haystack import RULER_INSTRUCTION, article_for_seed, load_articles, load_haystack, make_needle, needle_context
    from arckv_press.methods import METHODS
    from arckv_press.models import load_model, model_id

    model, tok = load_model(args.model)
    mid = model_id(model)
    ids = CurrentIds(mid, args.options, args.indexer)
    migrate_csv(args.out)
    done = {case_key(r["method"], r["ratio"], r["length"], r["depth"], r["seed"], r["framing"]) for r in read_rows(args.out)
            if r["method"] in {*args.methods, "none"} and ids.matches(r)}  # a new checkpoint or default reruns its methods
    todo = [c for c in build_cases(args) if case_key(*c) not in done]
    print(f"{len(todo)} cases to run, {len(build_cases(args)) - len(todo)} already in {args.out}", flush=True)
    for name in args.methods:
        if METHODS[name].uses_indexer and not ids(name, 1.0)["indexer"]:
            print(f"skipping method {name}: no value-aware indexer is shipped for {mid}", flush=True)
            todo = [c for c in todo if c[0] != name]
    if not todo:
        return
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok)
    haystack = load_haystack(args.haystack)
    articles = load_articles(args.articles) if "pipeline" in args.framings else []
    instruction_len = len(tok.encode(RULER_INSTRUCTION, add_special_tokens=False))
    contexts: dict[tuple, tuple] = {}
    bar = tqdm(todo, unit="case", dynamic_ncols=True)
    for method, ratio, length, depth, seed, framing in bar:
        bar.set_description(f"{framing} {method} rho={ratio:g} {length} tok depth={depth:g}")
        if (length, depth, seed, framing) not in contexts:
            contexts.clear()
            needle = make_needle(seed, framing)
            if framing == "ruler":  # RULER's instruction, the essays from their start for every seed
                text = RULER_INSTRUCTION + needle_context(tok, haystack, length - instruction_len, depth, needle)
            else:  # no instruction; each seed reads another article
                text = needle_context(tok, article_for_seed(articles, seed), length, depth, needle)
            contexts[(length, depth, seed, framing)] = (text, needle, len(tok.encode(text, add_special_tokens=False)))
        text, needle, n_ctx = contexts[(length, depth, seed, framing)]
        torch.manual_seed(seed)
        try:
            result = run_case(pipe, model, tok, method, ratio, text, needle, args.indexer, args.options)
        except ValueError as err:  # a method that cannot run here (e.g. context too short)
            tqdm.write(f"skipped {method} rho={ratio:g} length={length} depth={depth:g}: {err}")
            continue
        row = {"method": method, "ratio": f"{ratio:g}", "length": length, "depth": f"{depth:g}", "seed": seed,
               "framing": framing,
               "context_tokens": n_ctx, "needle": needle.value, **result, **ids(method, ratio), "model": mid, **meta}
        append_rows(args.out, [row], FIELDS)
        mark = "OK" if result["correct"] else "--"
        tqdm.write(f"{mark} {framing:<8} {method:<19} rho={ratio:<5g} {length:>5} tok depth={depth:<4g} seed={seed} "
                   f"{float(result['compaction_s']):7.1f} s  {result['answer']!r}")


# ------------------------------------------------------------------------------------ plots


def framing_of(row: dict) -> str:
    """A row's needle framing (rows written before the column existed are RULER-framed)."""
    return row.get("framing") or "ruler"


def plot(csv_path: Path, out_dir: Path, options: dict | None = None, indexer: str | None = None,
         framing: str = "ruler", model: str | None = None) -> list[Path]:
    """One heat-map figure per kept fraction (full cache shown as the first panel of each), named
    after the CSV (``needle.csv`` -> ``needle_rho0.1.png``; another model than the default adds its
    short name, ``needle_gemma-3-270m_rho0.1.png``), of ``model``'s rows (:func:`.leaderboard.doc_tables.of_model`) made
    with the current defaults or, when given, the ``--option`` fields ``options`` and ``--indexer``
    checkpoint."""
    from arckv_press.models import DEFAULT_MODEL_ID

    from .leaderboard.doc_tables import of_model
    from .leaderboard.table import short_model

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    model = model or DEFAULT_MODEL_ID
    rows = of_model(read_rows(csv_path), model)
    if not rows:
        print(f"nothing to plot: {csv_path} has no rows of {model}")
        return []
    rows = [r for r in current_rows(rows, model, options, indexer) if framing_of(r) == framing]
    if not rows:
        print(f"nothing to plot: {csv_path} has no {framing}-framed rows made with these options")
        return []
    acc: dict[tuple, list[int]] = defaultdict(list)
    masked: set[str] = set()
    for r in rows:
        acc[(r["method"], float(r["ratio"]), int(r["length"]), float(r["depth"]))].append(int(r["correct"]))
        if r["masked"] == "1":
            masked.add(r["method"])
    lengths = sorted({k[2] for k in acc})
    depths = sorted({k[3] for k in acc})
    ratios = sorted({k[1] for k in acc if k[0] != "none"}, reverse=True)
    order = {name: i for i, name in enumerate(("none",) + DEFAULT_METHODS)}
    cmap = matplotlib.colormaps["RdYlGn"].with_extremes(bad="#dddddd")
    written = []
    for ratio in ratios:
        methods = sorted({k[0] for k in acc if k[1] == ratio}, key=lambda m: (order.get(m, 99), m))
        panels = ([("none", 1.0)] if any(k[0] == "none" for k in acc) else []) + [(m, ratio) for m in methods]
        ncols = min(4, len(panels))
        nrows = math.ceil(len(panels) / ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(0.9 * len(lengths) * ncols + 1.5, 0.55 * len(depths) * nrows + 1.4),
                                 squeeze=False, constrained_layout=True)
        image = None
        for ax, (method, r) in zip(axes.flat, panels):
            grid = np.full((len(depths), len(lengths)), np.nan)
            for i, d in enumerate(depths):
                for j, n in enumerate(lengths):
                    vals = acc.get((method, r, n, d))
                    if vals:
                        grid[i, j] = sum(vals) / len(vals)
            image = ax.imshow(grid, cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
            for i in range(len(depths)):
                for j in range(len(lengths)):
                    if not np.isnan(grid[i, j]):
                        ax.text(j, i, f"{grid[i, j]:.2g}", ha="center", va="center", fontsize=7)
            mean = np.nanmean(grid) if np.isfinite(grid).any() else float("nan")
            title = "full cache" if method == "none" else method
            title += " (masked: full bytes)" if method in masked else ""
            ax.set_title(f"{title}\nmean {mean:.2f}", fontsize=9)
            ax.set_xticks(range(len(lengths)), [f"{n / 1000:g}K" for n in lengths], fontsize=7)
            ax.set_yticks(range(len(depths)), [f"{100 * d:.0f}%" for d in depths], fontsize=7)
            ax.set_xlabel("context tokens", fontsize=8)
            ax.set_ylabel("needle depth", fontsize=8)
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        if image is not None:
            fig.colorbar(image, ax=axes, shrink=0.8, label="exact retrieval")
        fig.suptitle(f"Needle in a haystack ({framing} framing), kept fraction rho = {ratio:g} ({model}; grey: not run)",
                     fontsize=10)
        stem = csv_path.stem if model == DEFAULT_MODEL_ID else f"{csv_path.stem}_{short_model(model)}"
        stem = stem if framing == "ruler" else f"{stem}_{framing}"
        path = out_dir / f"{stem}_rho{ratio:g}.png"
        fig.savefig(path, dpi=130)
        plt.close(fig)
        written.append(path)
    return written


def summary(csv_path: Path, options: dict | None = None, indexer: str | None = None, model: str | None = None) -> None:
    """Accuracy, median compaction seconds and median cache MiB per method, kept fraction and length
    (``model``'s rows made with the current defaults, or with ``options`` / ``indexer`` as :func:`plot`)."""
    from arckv_press.models import DEFAULT_MODEL_ID

    from .leaderboard.doc_tables import of_model

    model = model or DEFAULT_MODEL_ID
    rows = current_rows(of_model(read_rows(csv_path), model), model, options, indexer)
    by: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        by[(framing_of(r), r["method"], float(r["ratio"]), int(r["length"]))].append(r)
    print(f"\n{'framing':<10}{'method':<20}{'rho':>6}{'length':>8}{'cases':>7}{'accuracy':>10}{'median s':>10}{'MiB (med)':>11}")
    for (framing, method, ratio, length), rs in sorted(by.items(), key=lambda kv: (kv[0][0], -kv[0][2], kv[0][1], kv[0][3])):
        secs = sorted(float(r["compaction_s"]) for r in rs)
        mib = sorted(int(r["cache_bytes"]) / 2**20 for r in rs)
        note = "  masked: holds the full cache" if any(r["masked"] == "1" for r in rs) else ""
        print(f"{framing:<10}{method:<20}{ratio:>6g}{length:>8}{len(rs):>7}{sum(int(r['correct']) for r in rs) / len(rs):>10.2f}"
              f"{secs[len(secs) // 2]:>10.1f}{mib[len(mib) // 2]:>11.2f}{note}")
    print("(seconds: prefill + compression inside `with press(model)`; for none the prefill alone)")


def depth_table(rows: list[dict], ratio: float, framing: str) -> str:
    """Markdown recall by needle depth at kept fraction ``ratio``: per method (the full cache first)
    one row per context length and, when it has several, one row over all of them; one column per
    depth, each cell ``found/cases`` over the seeds of that length and depth, so that a weakness at
    one depth or one length cannot hide in a total. ``rows``: current rows (:func:`current_rows`)."""
    order = {name: i for i, name in enumerate(("none",) + DEFAULT_METHODS)}
    cells: dict[tuple[str, int, float], list[int]] = defaultdict(list)
    for r in rows:
        if framing_of(r) != framing or (r["method"] != "none" and not math.isclose(float(r["ratio"]), ratio)):
            continue
        cells[(r["method"], int(r["length"]), float(r["depth"]))].append(int(r["correct"]))
    if not cells:
        return f"(no {framing}-framed rows at keep {ratio:g})\n"
    depths = sorted({d for _, _, d in cells})
    methods = sorted({m for m, _, _ in cells}, key=lambda m: (order.get(m, 99), m))
    lines = ["| method | length | " + " | ".join(f"{100 * d:g}%" for d in depths) + " | all |",
             "|---|---:|" + "---:|" * (len(depths) + 1)]

    def line(name: str, length: str, got: list[list[int]]) -> str:
        total = [x for g in got for x in g]
        return (f"| {name} | {length} | " + " | ".join(f"{sum(g)}/{len(g)}" if g else "-" for g in got)
                + f" | {sum(total)}/{len(total)} |")

    for m in methods:
        name = "full cache" if m == "none" else f"`{m}`"
        lengths = sorted({n for mm, n, _ in cells if mm == m})
        for n in lengths:
            lines.append(line(name, f"{n / 1000:g}K", [cells.get((m, n, d), []) for d in depths]))
        if len(lengths) > 1:
            lines.append(line(name, "all", [[x for n in lengths for x in cells.get((m, n, d), [])] for d in depths]))
    return "\n".join(lines) + f"\n\n({framing} framing, keep {ratio:g}; cells: needles found / cases)\n"


def write_depth_tables(csv_path: Path, out: Path, options: dict | None = None, indexer: str | None = None,
                       model: str | None = None) -> None:
    """Write the recall-by-depth tables of every framing and kept fraction of ``csv_path``'s current
    rows of ``model`` (default the default model's)."""
    from arckv_press.models import DEFAULT_MODEL_ID

    from .leaderboard.doc_tables import of_model

    model = model or DEFAULT_MODEL_ID
    rows = current_rows(of_model(read_rows(csv_path), model), model, options, indexer)
    parts = [f"# Needle recall by depth\n\nGenerated by `python scripts/needle.py --plot-only --depth-table {out}` "
             f"from `{csv_path.name}` ({model}, float32, CPU; current defaults); "
             "do not edit. Haystacks: the Paul Graham essays for the RULER framing, one QuALITY article per seed for "
             "the pipeline framing (`scripts/needle.py --help`). Each row's machine is in the CSV.\n"]
    for framing in sorted({framing_of(r) for r in rows}):
        for ratio in sorted({float(r["ratio"]) for r in rows if r["method"] != "none" and framing_of(r) == framing},
                            reverse=True):
            parts.append(f"## {framing} framing, keep {100 * ratio:g}%\n\n" + depth_table(rows, ratio, framing))
    out.write_text("\n".join(parts), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    from arckv_press.methods import METHOD_NAMES
    from arckv_press.models import named_model_id

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", choices=[m for m in METHOD_NAMES], default=None,
                   help=f"methods (default: {' '.join(DEFAULT_METHODS)}; the full cache runs unless --no-full-cache)")
    p.add_argument("--ratios", nargs="+", type=parse_unit, default=None, help="kept fractions (default 0.2 0.1 0.05)")
    p.add_argument("--lengths", nargs="+", type=parse_length, default=None, help="context tokens (default 1K 2K 4K 8K)")
    p.add_argument("--depths", nargs="+", type=parse_unit, default=None, help="needle depths (default 0 .25 .5 .75 1)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0], help="needle seeds (default 0)")
    p.add_argument("--framings", nargs="+", choices=FRAMINGS, default=["ruler"],
                   help="needle framings: ruler (RULER's instruction and answer prefix; default) and/or pipeline "
                        "(an access code, a plain question, answer_prefix='Answer:', in one article per seed of --articles)")
    p.add_argument("--articles", default=None,
                   help="JSON lines with an 'input' article each, the pipeline framing's haystacks (default: QuALITY's)")
    p.add_argument("--depth-table", type=Path, default=None,
                   help="also write the recall-by-depth tables (markdown) of the CSV's current rows to this file")
    p.add_argument("--quick", action="store_true",
                   help="small grid: arckv-ha, am-omp-fast, snapkv at rho 0.1, 1K and 2K, depths 0 .5 1")
    p.add_argument("--no-full-cache", dest="full_cache", action="store_false", help="do not run method none")
    p.add_argument("--plot-only", action="store_true", help="only redraw the figures from the CSV")
    p.add_argument("--model", default=None, help="HF id or path (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--indexer", default=None,
                   help="indexer checkpoint dir for the methods that use one (default: the shipped one); rows record "
                        "its id, and the summary and figures show that checkpoint's rows")
    add_option_argument(p)
    p.add_argument("--haystack", default=None, help="haystack text file (default: the Paul Graham essays)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"CSV (default {DEFAULT_OUT.relative_to(ROOT)})")
    args = p.parse_args(argv)
    grid = QUICK if args.quick else dict(methods=DEFAULT_METHODS, ratios=(0.2, 0.1, 0.05), lengths=(1000, 2000, 4000, 8000),
                                         depths=(0.0, 0.25, 0.5, 0.75, 1.0))
    for name, default in grid.items():
        if getattr(args, name) is None:
            setattr(args, name, list(default))
    if "none" in args.methods:
        args.methods = [m for m in args.methods if m != "none"]
        args.full_cache = True
    if args.threads:
        torch.set_num_threads(args.threads)

    print_header("needle in a haystack (scripts/needle.py)", argv=None if argv is None else [sys.argv[0], *argv])
    if not args.plot_only:
        run(args, run_meta())
    (args.out.parent / "plots").mkdir(parents=True, exist_ok=True)
    model = named_model_id(args.model)  # the figures, depth tables and summary of this model's rows
    for framing in FRAMINGS:
        for path in plot(args.out, args.out.parent / "plots", args.options, args.indexer, framing, model):
            print(f"wrote {path}")
    if args.depth_table is not None:
        write_depth_tables(args.out, args.depth_table, args.options, args.indexer, model)
        print(f"wrote {args.depth_table}")
    summary(args.out, args.options, args.indexer, model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
