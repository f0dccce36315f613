"""Compaction cost: per-stage wall time of ARC-KV and the Attention-Matching baselines on the
default model, kvpress's presses end to end, and a head-level sweep on synthetic tensors.

Model part (per context length and kept fraction rho): the context (Paul Graham essays, framed
as in kvpress's pipeline) is prefilled once per length (median of ``--repeats`` prefills after a
warm-up one); each ARC-KV / AM method then compacts a copy of that prefilled cache with
:func:`arckv_press.api.compact_prefilled` and we read ``cache.report.timings``:
``repeat_prefill`` (the reference pass; for ARC-KV it includes ``reference_stats``, the statistics
its attention gathers), ``selection`` (top-t after the pass; the learned indexer's scoring),
``fit_rows`` (the anchors' witness rows), ``merge`` (key merging), ``beta_fit``, ``value_fit``
(C_v) for ARC-KV, ``am_total`` (select + fit) for AM, plus ``compact_total`` (wall time of the
whole call, repeat-prefill included, prefill excluded). kvpress presses (SnapKV, KVzip, Expected
Attention) are timed end to end (``press_total``: the prefill inside ``with press(model)`` plus
the compression); ``beyond_prefill`` subtracts the median prefill. Rows are written after each
method, so an interrupted run keeps what it measured; ``--summary`` prints the summary and ratios
of the last run from the CSV. ``--option KEY=VALUE`` times a ``CompactionConfig`` option
(e.g. ``min_head_fraction=1.0``); its rows carry that option's ``config_id``.

Memory (MiB in the ``seconds`` column, the process's resident set sampled every 5 ms by a thread,
:class:`~arckv_press.bench.memory.PeakRSS`):
``full_peak_rss_mib`` (method ``none``) is the peak over a full-cache prefill and a 16-token greedy
answer, measured while the harness holds no other cache; ``peak_rss_mib`` of each method is the
peak over its compaction of a copy of the prefilled cache (kvpress's presses: their prefill and
compression) less the bytes of the prefilled cache that only the harness keeps beside it, i.e.
the peak of a user's prefill-then-compact in place, and it is printed against
``full_peak_rss_mib``. Both include the model's weights.

Printed from the same run, as ratios: ARC-KV's
post-repeat time (everything after the repeat-prefill) / one prefill, the repeat-prefill / one
prefill, AM's select + fit / ARC-KV's post-repeat time, end-to-end AM / ARC-KV, the learned
indexer's selection / HA's (in-pass statistics included) and the post-repeat growth between
lengths. With ``--plain-repeat`` (on CPU) one more prefill runs under the profiler, and the least
time an exact repeat-prefill can take (:mod:`arckv_press.bench.repeat_floor`) is printed beside
the repeat-prefill's.

Synthetic part: the default ARC-KV pipeline on random ``K, V [H, T, D]`` and one reference row per
query head and position (``Q [H, G, T, D]``, H = 3, G = 3, D = 64): the statistics pass
(``reference_pass``, which the repeat-prefill does on a model) and everything after it
(``post``: top-t, witnesses, merging, fits; chunk by chunk above the default ``chunk_min_length``)
with the peak bytes it holds at once, tensors mostly (``post_tensor_mib``, MiB in the ``seconds`` column,
from a second, untimed run: the bytes ``malloc`` holds, sampled, :class:`~arckv_press.bench.memory.PeakHeldMemory`),
the same post without chunks up to ``--unchunked-max-T`` (``post_unchunked``,
``post_unchunked_tensor_mib``), against
``am_compact(..., "omp-fast")`` on n = max(``--queries`` (2048), 2 t) rows, T from 1024 up to
``--max-T`` (at most 131072). OMP-fast is not run at a length once a shorter one took more than
``--omp-cap`` seconds, nor beyond ``--omp-max-T`` (32768). The growth of post and of its memory per doubling of T, and post / pass at
each T, are printed from the same run. When the default model's indexer
is shipped, its default anchor selection (``indexer_rows`` a row count: layer 0's parameters on
that many of the budget rows, corrected by the pass's HA scores) is timed too.

    python scripts/bench_compaction.py --quick
    python scripts/bench_compaction.py --lengths 1K 2K 4K 8K --repeats 3 --max-T 65536
    python scripts/bench_compaction.py --skip-model --max-T 131072 --repeats 1 --threads 2
    python scripts/bench_compaction.py --summary --methods arckv-ha am-omp-fast --ratios 0.1 --lengths 4K 8K

Writes ``leaderboards/bench_compaction.csv`` (long format: one row per section / method / rho /
length / stage, seconds = median over repeats).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

from arckv_press.bench import ROOT
from arckv_press.bench.memory import PeakRSS, PeakHeldMemory, harness_free_peak_mib
from arckv_press.methods import COMPACTION_METHODS
from arckv_press.runinfo import (
    CurrentIds,
    add_option_argument,
    append_rows,
    median_seconds,
    parse_length,
    print_header,
    run_meta,
)

DEFAULT_OUT = ROOT / "leaderboards" / "bench_compaction.csv"
KVPRESS_METHODS = ("snapkv", "kvzip", "expected_attention")  # the kvpress presses timed by default
ARCKV_STAGES = ("repeat_prefill", "reference_stats", "selection", "fit_rows", "merge", "beta_fit", "value_fit")
FIELDS = ["section", "method", "ratio", "length", "stage", "seconds", "repeats", "threads", "dtype", "indexer",
          "config_id", "model", "command", "date", "package_version", "machine"]


def median_stages(runs: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for r in runs for k in r})
    return {k: statistics.median(r.get(k, 0.0) for r in runs) for k in keys}


def clone_cache(cache):
    """A deep copy of ``cache`` (compaction replaces its layers in place): every layer's keys, values
    and counters, so a sliding-window layer keeps the number of tokens it has seen."""
    import copy

    return copy.deepcopy(cache)


def document_ids(tok, haystack: str, length: int) -> tuple[torch.Tensor, int]:
    """``prefix + document`` ids with a document of ``length`` haystack tokens."""
    from arckv_press.capture import encode_document

    doc = tok.encode(haystack[: length * 8], add_special_tokens=False)
    if len(doc) < length:
        raise ValueError(f"the haystack has only {len(doc)} tokens, {length} needed")
    return encode_document(tok, tok.decode(doc[:length]))


def run_compaction(model, tok, cache, ids, prefix_len, method: str, ratio: float,
                   options: dict | None = None) -> tuple[dict[str, float], int]:
    """One ``compact_prefilled`` on a copy of the prefilled cache: its report's stage timings and
    the reference rows per KV head that merging and the fits used (max over layers). ``options``:
    further :class:`~arckv_press.config.CompactionConfig` fields (``--option``)."""
    from arckv_press.config import CompactionConfig
    from arckv_press.api import compact_prefilled
    from arckv_press.attention import disable_compact_attention

    options = dict(options or {})
    indexer = options.pop("indexer", None)  # an input of the compaction, not one of its options
    config = CompactionConfig(method=method, ratio=ratio, **options)
    try:
        with PeakRSS() as rss:
            work = clone_cache(cache)
            t0 = time.perf_counter()
            result = compact_prefilled(model, tok, work, ids, prefix_len, config, already_prefilled=True,
                                       indexer=indexer)
            total = time.perf_counter() - t0
    finally:
        disable_compact_attention(model)
    stages = {k: v for k, v in result.report.timings.items() if k != "prefill"}
    stages["compact_total"] = total
    stages["peak_rss_mib"] = harness_free_peak_mib(rss, cache)
    return stages, result.report.reference_rows


def run_press(model, name: str, ratio: float, ids, held=None) -> tuple[float, float]:
    """kvpress's press ``name`` end to end (prefill inside ``with press(model)``): seconds and the
    process's peak resident MiB (:func:`harness_free_peak_mib`, ``held`` the harness's own prefilled
    cache)."""
    from arckv_press.cache import new_cache
    from arckv_press.registry import make_press

    press = make_press(name, ratio)
    with PeakRSS() as rss:
        cache = new_cache(model)
        t0 = time.perf_counter()
        with press(model):
            model.model(input_ids=ids, past_key_values=cache)
        seconds = time.perf_counter() - t0
    return seconds, harness_free_peak_mib(rss, held)


#: the question of the full-cache peak memory measurement (:func:`full_cache_prefill`)
RSS_QUESTION, RSS_ANSWER_TOKENS = "What is the main point of the text above?", 16


def full_cache_prefill(model, tok, ids: torch.Tensor):
    """``(cache, MiB)``: a full-cache prefill of ``ids``, and the process's peak resident memory over
    it and a greedy answer of :data:`RSS_ANSWER_TOKENS` tokens to :data:`RSS_QUESTION` (which
    restores the cache): what a compaction's peak is compared with. Run while the harness holds no
    other prefilled cache; the methods then compact copies of this one."""
    from arckv_press.capture import prefill
    from arckv_press.generation import answer

    with PeakRSS() as rss:
        cache = prefill(model, ids)
        answer(model, tok, cache, RSS_QUESTION, max_new_tokens=RSS_ANSWER_TOKENS)
    return cache, rss.peak / 2**20


def model_section(args, meta: dict) -> list[dict]:
    from arckv_press.config import CompactionConfig
    from arckv_press.haystack import load_haystack
    from arckv_press.models import load_model, model_id

    model, tok = load_model(args.model, dtype=args.dtype)
    mid = model_id(model)
    dtype = str(model.dtype).removeprefix("torch.")
    methods = list(args.methods)
    if "arckv" in methods:
        from arckv_press.indexer.checkpoint import default_indexer_path

        if default_indexer_path(mid) is None:
            print(f"arckv: skipped (no value-aware indexer is shipped for {mid})")
            methods.remove("arckv")
    print(f"model {mid}, {dtype}; methods {' '.join(methods)}; rho {' '.join(f'{r:g}' for r in args.ratios)}; "
          f"lengths {' '.join(map(str, args.lengths))}; median of {args.repeats} repeat(s)\n", flush=True)
    haystack = load_haystack(args.haystack)
    rows: list[dict] = []
    results: dict[tuple, dict[str, float]] = {}
    method_ids = CurrentIds(mid, args.options)

    def record(method, ratio, length, stages):
        """Keep a method's stage times and write them at once (an interrupted run keeps them); the
        summary uses the written (rounded) values, so ``--summary`` prints the same figures."""
        results[(method, ratio, length)] = {k: float(f"{v:.4f}") for k, v in stages.items()}
        new = [{"section": "model", "method": method, "ratio": f"{ratio:g}", "length": length, "stage": stage,
                "seconds": f"{sec:.4f}", "repeats": args.repeats, "threads": torch.get_num_threads(),
                "dtype": dtype, **(method_ids(method, ratio) if method != "none" else {}), "model": mid, **meta}
               for stage, sec in stages.items()]
        append_rows(args.out, new, FIELDS)
        rows.extend(new)

    with torch.inference_mode():
        # warm-up (untimed): a prefill and each kvpress press on a short context; each ARC-KV / AM
        # method's layer compaction on synthetic tensors (compact_prefilled itself refuses documents
        # shorter than query_budget / G tokens when the prefill was run outside it)
        from arckv_press.capture import prefill
        from arckv_press.compaction.layer import compact_layer

        warm_ids, _ = document_ids(tok, haystack, 256)
        prefill(model, warm_ids)
        gen = torch.Generator().manual_seed(args.seed)
        Kw, Vw, Qw = (torch.randn(3, m, 64, generator=gen) for m in (512, 512, 256))
        for method in methods:
            if method in KVPRESS_METHODS:
                run_press(model, method, args.ratios[0], warm_ids)
            elif method != "arckv":
                compact_layer(Kw, Vw, Qw, torch.full((3,), 51), 0.125, CompactionConfig(method=method).layer_method())

        for length in args.lengths:
            ids, prefix_len = document_ids(tok, haystack, length)
            pre = median_seconds(partial(prefill, model, ids), args.repeats)  # warm-up at this length
            cache, full_mib = full_cache_prefill(model, tok, ids)
            base = {"prefill": pre, "full_peak_rss_mib": full_mib}
            if args.plain_repeat:
                base["repeat_plain"] = median_seconds(partial(plain_repeat, model, tok, cache, ids, prefix_len),
                                                      args.repeats, warmup=0)
                if model.device.type == "cpu":  # the floor of an exact repeat-prefill (repeat_floor.py)
                    base.update(floor_stages(model, tok, ids, prefix_len, pre))
            record("none", 1.0, length, base)
            print(f"{length} tokens (+{prefix_len} prefix): " + ", ".join(_shown(k, v) for k, v in base.items()),
                  flush=True)
            for ratio in args.ratios:
                for method in methods:
                    if method in KVPRESS_METHODS:
                        runs = [run_press(model, method, ratio, ids, cache) for _ in range(args.repeats)]
                        total = statistics.median(t for t, _ in runs)
                        stages = {"press_total": total, "beyond_prefill": total - pre,
                                  "peak_rss_mib": max(m for _, m in runs)}
                        fit_rows = ""
                    else:
                        runs = [run_compaction(model, tok, cache, ids, prefix_len, method, ratio, args.options)
                                for _ in range(args.repeats)]
                        stages = median_stages([r for r, _ in runs])
                        stages["peak_rss_mib"] = max(r["peak_rss_mib"] for r, _ in runs)
                        fit_rows = f" (fit rows per KV head, max over layers: {runs[0][1]})"
                    record(method, ratio, length, stages)
                    shown = " ".join(_shown(k, v, unit="") for k, v in stages.items()) + fit_rows
                    print(f"  rho {ratio:<5g} {method:<19} {shown}", flush=True)
    print_model_summary(results, args, methods)
    return rows


def _shown(stage: str, value: float, unit: str = " s") -> str:
    """``stage value`` with its unit: MiB for the peak-memory stages (``*_mib``), else seconds."""
    return f"{stage} {value:.0f} MiB" if stage.endswith("_mib") else f"{stage} {value:.2f}{unit}"


def floor_stages(model, tok, ids: torch.Tensor, prefix_len: int, prefill_seconds: float) -> dict[str, float]:
    """One profiled prefill of ``ids``: ``prefill_attention`` (its attention kernel's seconds),
    ``prefill_profiled`` (its wall seconds) and ``repeat_floor``, the seconds an exact repeat-prefill
    of the default chunks needs at least (:func:`~arckv_press.bench.repeat_floor.repeat_floor`, with the
    share of attention of the profiled prefill applied to the median prefill ``prefill_seconds``, and
    each layer's part of it, window and kernel: a sliding-window layer's queries see at most its
    window, and a kernel run with a mask computed every pair of the square)."""
    from arckv_press.capture import REPEAT_CHUNK, framing_for, prefill, repeat_chunks
    from arckv_press.models import describe_attention_layout

    from .repeat_floor import attention_calls, layer_shares, repeat_floor

    calls, causal, wall = attention_calls(partial(prefill, model, ids))
    layout = describe_attention_layout(model)
    windows = [layout.sliding_window if kind == "sliding_attention" else None for kind in layout.layer_types]
    doc = ids[:, prefix_len:].cpu()
    chunks = [c.shape[-1] for _, _, c in repeat_chunks(tok, doc, framing_for(tok).suffix_ids,
                                                         REPEAT_CHUNK)]
    kernel, n = sum(calls), len(windows)
    # per layer, whether its kernel ran causal; calls that do not divide into layers: all causal or none
    ran_causal = ([all(causal[i::n]) for i in range(n)] if layer_shares(calls, n) is not None
                  else [all(causal)] * n)
    return {"prefill_attention": kernel, "prefill_profiled": wall,
            "repeat_floor": repeat_floor(prefill_seconds, kernel / wall, ids.shape[1], chunks, windows,
                                         layer_shares(calls, n), ran_causal)}


def plain_repeat(model, tok, cache, ids: torch.Tensor, prefix_len: int) -> None:
    """The default chunked repeat-prefill with the model's own attention and no statistics: every
    chunk runs (one captured row per chunk, in one layer), nothing else is gathered."""
    from arckv_press.capture import REPEAT_CHUNK, framing_for, repeat_prefill

    chunk = REPEAT_CHUNK
    doc = ids[:, prefix_len:]
    repeat_prefill(model, tok, cache, doc, framing_for(tok).suffix_ids, [0], torch.arange(0, doc.shape[1], chunk), chunk)


def print_model_summary(results: dict, args, methods: list[str]) -> None:
    print("\nper-stage seconds (median), model contexts:")
    head = f"{'length':>6} {'rho':>5} {'method':<19}" + "".join(f"{s:>15}" for s in (*ARCKV_STAGES, "am_total", "total"))
    print(head)
    print("-" * len(head))
    for length in args.lengths:
        for ratio in args.ratios:
            for method in methods:
                st = results.get((method, ratio, length))
                if st is None:
                    continue
                total = st.get("compact_total", st.get("press_total", float("nan")))
                cells = [st.get(s) for s in (*ARCKV_STAGES, "am_total")]
                print(f"{length:>6} {ratio:>5g} {method:<19}" + "".join(f"{c:>15.2f}" if c is not None else f"{'-':>15}"
                                                                       for c in cells) + f"{total:>15.2f}")
    print("(total: compact_total = repeat-prefill + per-layer compaction, prefill excluded; kvpress: prefill + "
          "compression)")

    print("\nratios from this run (post = everything after the repeat-prefill):")
    for line in ratio_lines(results, args.lengths, args.ratios):
        print(line)


def ratio_lines(results: dict, lengths: list[int], ratios: list[float]) -> list[str]:
    """The ratios of one run, one line each: post-repeat time and repeat-prefill per prefill,
    OMP / ARC-KV, indexer / HA selection, growth between lengths."""
    lines = []
    for length in lengths:
        if ("none", 1.0, length) not in results:  # an interrupted run (--summary) that did not reach it
            continue
        base = results[("none", 1.0, length)]
        pre, plain, floor = base["prefill"], base.get("repeat_plain"), base.get("repeat_floor")
        if plain is not None:
            lines.append(f"{length:>6} tok: plain repeat-prefill (own attention, no statistics) / prefill {plain / pre:.2f}")
        if floor is not None:
            share = base["prefill_attention"] / base["prefill_profiled"]
            lines.append(f"{length:>6} tok: exact repeat-prefill floor / prefill {floor / pre:.2f} "
                         f"(the same tokens again, each chunk against the whole context; attention {share:.0%} "
                         "of a profiled prefill)")
        for ratio in ratios:
            for name in ("arckv", "arckv-ha", "arckv-vi"):  # each ARC-KV variant of the run against OMP
                arc = results.get((name, ratio, length))
                if arc is None:
                    continue
                post = post_repeat(arc)
                parts = [f"{length:>6} tok, rho {ratio:g}, {name}: post/prefill {post / pre:.2f}; "
                         f"repeat/prefill {arc.get('repeat_prefill', 0.0) / pre:.2f}"]
                for omp in ("am-omp-fast", "am-omp"):
                    o = results.get((omp, ratio, length))
                    if o is not None:
                        parts.append(f"{omp} select+fit / {name} post {o['am_total'] / post:.2f}x; "
                                     f"end to end {o['compact_total'] / arc['compact_total']:.2f}x")
                lines.append("; ".join(parts))
            full_mib = base.get("full_peak_rss_mib")
            peaks = [(m, results[(m, ratio, length)]["peak_rss_mib"]) for m in sorted({k[0] for k in results} - {"none"})
                     if "peak_rss_mib" in results.get((m, ratio, length), {})]
            if full_mib and peaks:
                lines.append(f"{length:>6} tok, rho {ratio:g}: peak RSS / full-cache prefill + answer "
                             f"({full_mib:.0f} MiB): " + ", ".join(f"{m} {mib / full_mib:.2f}" for m, mib in peaks))
            idx, ha = results.get(("arckv", ratio, length)), results.get(("arckv-ha", ratio, length))
            if idx is not None and ha is not None:
                lines.append(f"{length:>6} tok, rho {ratio:g}: indexer selection / HA selection "
                             f"{selection_seconds(idx) / selection_seconds(ha):.2f} "
                             f"({selection_seconds(idx):.2f} s / {selection_seconds(ha):.2f} s, in-pass statistics included)")
    for short, long in zip(lengths, lengths[1:]):
        for ratio in ratios:
            for name in ("arckv", "arckv-ha", "arckv-vi"):
                a, b = results.get((name, ratio, short)), results.get((name, ratio, long))
                if a is not None and b is not None:
                    lines.append(f"{name} rho {ratio:g}: post-repeat grows {post_repeat(b) / post_repeat(a):.2f}x from "
                                 f"{short} to {long} tokens")
    return lines


def post_repeat(stages: dict[str, float]) -> float:
    """Seconds of a compaction after its repeat-prefill: selection, witnesses, merging, fits, packing."""
    return stages["compact_total"] - stages.get("repeat_prefill", 0.0)


def selection_seconds(stages: dict[str, float]) -> float:
    """Anchor selection: top-t and scoring after the pass plus the statistics gathered inside it."""
    return stages.get("selection", 0.0) + stages.get("reference_stats", 0.0)


def _synthetic_indexer(H: int, D: int):
    """The default model's shipped indexer when its heads have this shape, else ``None``."""
    from arckv_press.indexer.checkpoint import default_indexer_path, load_indexer
    from arckv_press.models import DEFAULT_MODEL_ID

    path = default_indexer_path(DEFAULT_MODEL_ID)
    if path is None:
        return None
    indexer, _, _ = load_indexer(path, model_id=DEFAULT_MODEL_ID)
    if (indexer.config.num_kv_heads, indexer.config.head_dim) != (H, D):
        return None
    return indexer


def _indexer_selection(indexer, X, Q, K, V, budgets, scaling, full_base, shrink: float, fraction: float):
    """ARC-KV's default anchor selection with the learned indexer (layer 0), ``indexer_rows`` a row count:
    its learned and base scores on the scored rows ``Q`` (``X`` aligned, the ``fraction`` of every row),
    corrected by the base pooled over every row (``full_base``, which the statistics pass computes), then
    top-t."""
    from arckv_press.compaction.layer import LayerMethod
    from arckv_press.compaction.select import chunked_topk_anchors, corrected_scores

    method = LayerMethod("arckv")
    sample, sample_base = indexer.scores(0, X, Q, K, V, pooling=method.pooling, base=True, base_scale=scaling)
    scores = corrected_scores(full_base, sample, sample_base, method.pooling, shrink, fraction)
    return chunked_topk_anchors(scores, budgets, method.chunk_len, method.chunk_min_length)


def _reference_pass(K, V, Q4, scaling):
    """The reference pass's statistics over every row (as the repeat-prefill gathers them) and its seconds."""
    from arckv_press.compaction.stats import ReferenceStats, split_attention

    H, G, N, D = Q4.shape
    t0 = time.perf_counter()
    st = ReferenceStats(H, G, N, K.shape[1], V.shape[-1])
    split_attention(Q4, K, V, (0, K.shape[1]), scaling, 0, st.block, on_block=lambda a, blk: st.update(a, blk, V))
    return st.result(), time.perf_counter() - t0


def _post(K, V, Q4, stats, budgets, scaling, method, base_rows, merge_rows) -> dict[str, float]:
    """Everything after the statistics pass (:func:`compact_layer_from_stats`): stage seconds, ``post``
    (its wall time) and ``post_tensor_mib``, the peak bytes it holds at once, tensors mostly
    (:class:`~arckv_press.bench.memory.PeakHeldMemory`, measured in a second, untimed run)."""
    from arckv_press.compaction.layer import compact_layer_from_stats

    H, G, N, D = Q4.shape

    def run():
        return compact_layer_from_stats(K, V, Q4.reshape(H, G * N, D), stats, budgets, scaling, method, base_rows,
                                        merge_rows)

    t0 = time.perf_counter()
    timings = run().timings
    post = time.perf_counter() - t0
    with PeakHeldMemory(K.device) as mem:
        run()
    return {**timings, "post": post, "post_tensor_mib": mem.peak_mib}


def _fused_layer(K, V, Q4, budgets, scaling, method, base_rows, merge_rows) -> tuple[dict[str, float], torch.Tensor]:
    """The default ARC-KV pipeline on one synthetic layer: the reference pass, then
    :func:`compact_layer_from_stats`; stage seconds and the pass's HA scores over every row."""
    stats, seconds = _reference_pass(K, V, Q4, scaling)
    post = _post(K, V, Q4, stats, budgets, scaling, method, base_rows, merge_rows)
    return {"reference_pass": seconds, **post, "total": seconds + post["post"]}, stats.scores


def growth_lines(Ts: list[int], post: dict[int, float], passes: dict[int, float], mib: dict[int, float],
                 label: str) -> list[str]:
    """Per doubling of T: the growth of ``post`` seconds and of its peak memory; at each T, post / pass."""
    lines = []
    for a, b in zip(Ts, Ts[1:]):
        if a in post and b in post and b == 2 * a:
            grow_mem = f"{mib[b] / mib[a]:.2f}x" if mib.get(a, 0) > 0 else "-"
            lines.append(f"{label}: {a} -> {b}: post grows {post[b] / post[a]:.2f}x, its peak memory {grow_mem} "
                         f"({mib[a]:.0f} -> {mib[b]:.0f} MiB)")
    for T in Ts:
        if T in post:
            lines.append(f"{label}: T {T}: post / statistics pass = {post[T] / passes[T]:.3f} "
                         f"({post[T]:.2f} s / {passes[T]:.2f} s)")
    return lines


def synthetic_section(args, meta: dict) -> list[dict]:
    import dataclasses

    from arckv_press.config import SCORE_SHRINK, CompactionConfig
    from arckv_press.api import indexer_positions
    from arckv_press.compaction.omp import am_compact
    from arckv_press.compaction.reference import grouped_rows, subsample_rows

    H, G, D = 3, 3, 64
    scaling = D**-0.5
    Ts = [T for T in (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072) if T <= args.max_T]
    indexer = _synthetic_indexer(H, D)
    config = CompactionConfig(method="arckv-ha")
    method = config.layer_method()
    corrected = CompactionConfig(method="arckv")  # the learned indexer's default: corrected scores
    print(f"\nsynthetic heads: H={H} KV heads, G={G} query heads each, D={D}, float32, T in {Ts}, "
          f"rho {' '.join(f'{r:g}' for r in args.synthetic_ratios)}; median of {args.repeats} repeat(s).\n"
          f"arckv-ha: the default pipeline, one reference row per query head and position (G T rows), its "
          f"statistics pass ('pass', done inside the repeat-prefill on a model) and everything after it ('post': "
          f"top-t, witnesses, merging on {config.merge_rows} rows, fits on the {config.query_budget} budget rows + "
          f"witnesses; above {method.chunk_min_length} positions merged and fitted in chunks of {method.chunk_len}), "
          f"'MiB' the peak bytes of the tensors it holds at once (a second, untimed run). 'unchunked': the same post without chunks (the path below "
          f"{method.chunk_min_length} positions), up to --unchunked-max-T {args.unchunked_max_T}. OMP-fast on "
          f"n = max({args.queries}, 2t) rows. "
          + (f"Learned indexer: the shipped one, layer 0, selection with corrected scores (its scores on "
             f"{corrected.indexer_rows} budget rows, corrected by HA over every row)." if indexer is not None else
             "No learned indexer shipped."))
    head = (f"{'T':>6} {'rho':>5} | {'pass s':>8} {'post s':>8} {'merge':>7} {'beta':>7} {'C_v':>7} {'MiB':>6} "
            f"{'post/pass':>9} | {'unchunked':>9} {'MiB':>6} | {'idx-sel s':>9} | {'omp-fast s':>10} {'omp/post':>9}")
    print(head)
    print("-" * len(head), flush=True)
    rows = []
    gen = torch.Generator().manual_seed(args.seed)
    omp_stopped = omp_skipped = False
    post_s, pass_s, post_mib, flat_s, flat_mib = ({} for _ in range(5))

    def timing_row(method_name: str, ratio: float, T: int, stage: str, seconds: float) -> dict:
        return {"section": "synthetic", "method": method_name, "ratio": f"{ratio:g}", "length": T, "stage": stage,
                "seconds": f"{seconds:.4f}", "repeats": args.repeats, "threads": torch.get_num_threads(),
                "dtype": "float32", **meta}

    def budget_rows(T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pos = subsample_rows(T, config.query_budget // G, config.seed)
        merge = pos[subsample_rows(pos.numel(), config.merge_rows // G, config.seed + 1)]
        return grouped_rows(pos, T, G), grouped_rows(merge, T, G), grouped_rows(indexer_positions(corrected, pos, T, G), T, G)

    # warm-up (untimed)
    Kw, Vw = torch.randn(H, 512, D, generator=gen), torch.randn(H, 512, D, generator=gen)
    Qw = torch.randn(H, G, 512, D, generator=gen)
    _fused_layer(Kw, Vw, Qw, torch.full((H,), 51), scaling, method, *budget_rows(512)[:2])
    am_compact(Qw.reshape(H, -1, D)[:, :256], Kw, Vw, torch.full((H,), 51), scaling, "omp-fast")

    for T in Ts:
        K, V = torch.randn(H, T, D, generator=gen), torch.randn(H, T, D, generator=gen)
        Q4 = torch.randn(H, G, T, D, generator=gen)
        base, merge, score = budget_rows(T)
        stats, seconds = _reference_pass(K, V, Q4, scaling)
        for ratio in args.synthetic_ratios:
            t = max(1, int(ratio * T))
            budgets = torch.full((H,), t)
            runs = [_post(K, V, Q4, stats, budgets, scaling, method, base, merge) for _ in range(args.repeats)]
            arc = {"reference_pass": seconds, **median_stages(runs)}
            arc["total"] = seconds + arc["post"]
            post_mib_T = arc.pop("post_tensor_mib")
            flat = None
            if T > method.chunk_min_length and T <= args.unchunked_max_T:
                unchunked = dataclasses.replace(method, chunk_min_length=T)
                flat = median_stages([_post(K, V, Q4, stats, budgets, scaling, unchunked, base, merge)
                                      for _ in range(args.repeats)])
            if ratio == args.synthetic_ratios[0]:
                post_s[T], pass_s[T], post_mib[T] = arc["post"], seconds, post_mib_T
                if flat is not None:
                    flat_s[T], flat_mib[T] = flat["post"], flat["post_tensor_mib"]
            idx_sel = None
            if indexer is not None:
                Qs = Q4.reshape(H, -1, D)[:, score]
                X = torch.randn(Qs.shape[1], indexer.config.d_x, generator=gen)
                idx_sel = median_seconds(partial(_indexer_selection, indexer, X, Qs, K, V, budgets, scaling, stats.scores,
                                                 SCORE_SHRINK, Qs.shape[1] / (G * T)), args.repeats, warmup=0)
                rows.append(timing_row("arckv", ratio, T, "selection", idx_sel))
            omp = None
            if not omp_stopped and T > args.omp_max_T:
                omp_stopped = True  # its dense [n, T] products outgrow memory before its time does
            if not omp_stopped:
                Qo = torch.randn(H, max(args.queries, 2 * t), D, generator=gen)
                omp = median_seconds(partial(am_compact, Qo, K, V, budgets, scaling, "omp-fast"), args.repeats, warmup=0)
                omp_stopped = omp > args.omp_cap
            rows += [timing_row("arckv-ha", ratio, T, stage, sec) for stage, sec in arc.items()]
            rows.append(timing_row("arckv-ha", ratio, T, "post_tensor_mib", post_mib_T))  # MiB in the seconds column
            if flat is not None:
                rows += [timing_row("arckv-ha", ratio, T, "post_unchunked", flat["post"]),
                         timing_row("arckv-ha", ratio, T, "post_unchunked_tensor_mib", flat["post_tensor_mib"])]
            if omp is not None:
                rows.append(timing_row("am-omp-fast", ratio, T, "total", omp))
            idx_txt = f"{idx_sel:>9.2f}" if idx_sel is not None else f"{'-':>9}"
            flat_txt = f"{flat['post']:>9.2f} {flat['post_tensor_mib']:>6.0f}" if flat is not None else f"{'-':>9} {'-':>6}"
            if omp is None:
                omp_skipped = True
                omp_txt = f"{'skipped':>10} {'-':>9}"
            else:
                omp_txt = f"{omp:>10.2f} {omp / arc['post']:>8.2f}x"
            print(f"{T:>6} {ratio:>5g} | {seconds:>8.2f} {arc['post']:>8.2f} {arc.get('merge', 0):>7.2f} "
                  f"{arc.get('beta_fit', 0):>7.2f} {arc.get('value_fit', 0):>7.2f} {post_mib_T:>6.0f} "
                  f"{arc['post'] / seconds:>9.3f} | {flat_txt} | {idx_txt} | {omp_txt}", flush=True)
        del K, V, Q4, stats
    if omp_skipped:
        print(f"(OMP-fast not run beyond --omp-max-T {args.omp_max_T} or the first length where it took more than "
              f"--omp-cap {args.omp_cap:g} s)")
    print(f"\nrho {args.synthetic_ratios[0]:g}, from this run:")
    for line in [*growth_lines(Ts, post_s, pass_s, post_mib, "default"),
                 *growth_lines(sorted(flat_s), flat_s, pass_s, flat_mib, "unchunked")]:
        print("  " + line)
    return rows


def main(argv: list[str] | None = None) -> int:
    from arckv_press.models import model_help

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", choices=[*COMPACTION_METHODS, *KVPRESS_METHODS], default=None,
                   help="model-section methods (default: all; arckv only when an indexer is shipped)")
    p.add_argument("--ratios", nargs="+", type=float, default=None, help="kept fractions (default 0.2 0.1 0.05 0.02 0.01)")
    p.add_argument("--lengths", nargs="+", type=parse_length, default=None, help="context tokens (default 1K 2K 4K 8K)")
    p.add_argument("--synthetic-ratios", nargs="+", type=float, default=[0.1], help="rho of the synthetic sweep")
    p.add_argument("--max-T", type=int, default=None, help="longest synthetic length (default 65536, at most 131072; "
                                                            "quick 4096)")
    p.add_argument("--unchunked-max-T", type=int, default=65536,
                   help="longest synthetic length at which the unchunked post is timed too (default 65536)")
    p.add_argument("--queries", type=int, default=2048, help="synthetic reference rows per head")
    p.add_argument("--omp-cap", type=float, default=300.0, help="stop OMP-fast after a length taking longer (s)")
    p.add_argument("--omp-max-T", type=int, default=32768,
                   help="longest synthetic length OMP-fast runs at (default 32768: at 65536 it ran out of 24 GiB)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats, median (default 3; quick 1)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="model dtype (default auto, load_model's default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--model", default=None, help=model_help())
    p.add_argument("--haystack", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-model", action="store_true", help="only the synthetic sweep")
    p.add_argument("--plain-repeat", action="store_true",
                   help="also time the repeat-prefill with the model's own attention and no statistics (stage "
                        "repeat_plain of method none), and on CPU profile one prefill for the least time an exact "
                        "repeat-prefill takes (stages prefill_attention, prefill_profiled, repeat_floor)")
    p.add_argument("--skip-synthetic", action="store_true", help="only the model section")
    p.add_argument("--quick", action="store_true", help="1K only, rho 0.1 and 0.02, one repeat, synthetic T <= 4096")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    add_option_argument(p)
    p.add_argument("--summary", action="store_true",
                   help="run nothing: print the model section's summary and ratios from --out (current options, "
                        "the last run on --threads threads)")
    args = p.parse_args(argv)
    q = args.quick
    args.methods = args.methods or [*COMPACTION_METHODS, *KVPRESS_METHODS]
    args.ratios = args.ratios or ([0.1, 0.02] if q else [0.2, 0.1, 0.05, 0.02, 0.01])
    args.lengths = args.lengths or ([1000] if q else [1000, 2000, 4000, 8000])
    args.repeats = args.repeats or (1 if q else 3)
    args.max_T = args.max_T or (4096 if q else 65536)
    for r in [*args.ratios, *args.synthetic_ratios]:
        if not 0.0 < r <= 1.0:
            p.error(f"kept fractions must be in (0, 1], got {r}")
    torch.set_num_threads(args.threads)
    print_header("compaction cost (scripts/bench_compaction.py)", argv=None if argv is None else [sys.argv[0], *argv])
    meta = run_meta()
    if args.summary:
        summary_from_csv(args)
        return 0
    from arckv_press.models import DEFAULT_MODEL_ID
    from arckv_press.runinfo import add_columns

    add_columns(args.out, FIELDS, {"model": DEFAULT_MODEL_ID})  # rows before the model column: the default model's
    rows = []
    if not args.skip_model:
        rows += model_section(args, meta)  # written method by method
    if not args.skip_synthetic:
        synthetic = synthetic_section(args, meta)
        append_rows(args.out, synthetic, FIELDS)
        rows += synthetic
    print(f"\nwrote {len(rows)} rows to {args.out}")
    return 0


def last_model_run(rows: list[dict], ids: CurrentIds | None = None, methods=None, lengths=None, threads: int = 1
                   ) -> tuple[dict[str, str], dict[tuple, dict[str, float]]]:
    """The model-section rows of one run on ``threads`` torch threads, the last one that wrote a row
    with the ids each method uses now (``ids``; default: today's defaults for the default model),
    restricted to ``methods`` and ``lengths`` when given: ``(run, results)`` with ``run`` its
    ``date``, ``command`` and ``machine`` and ``results[(method, ratio, length)] = {stage: seconds}``.
    An interrupted run counts. The run is the last one with such an ARC-KV row when there is one:
    the Attention Matching and kvpress rows of a run with other ARC-KV options (``--option``) carry
    the same ids as a default run's, so they alone do not make it the run asked for."""
    from arckv_press.methods import method as lookup_method
    from arckv_press.models import DEFAULT_MODEL_ID

    ids = ids or CurrentIds(DEFAULT_MODEL_ID)
    rows = [r for r in rows if r["section"] == "model" and str(r["threads"]) == str(threads)
            and (r.get("model") or DEFAULT_MODEL_ID) == ids.model_id
            and (lengths is None or int(r["length"]) in lengths)
            and (r["method"] == "none" or ((methods is None or r["method"] in methods) and ids.matches(r)))]
    if not rows:
        raise ValueError("no model-section rows for these methods and lengths with the current options")
    ours = [r for r in rows if r["method"] != "none" and lookup_method(r["method"]).family == "arckv"]
    last = (ours or rows)[-1]
    results: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if (r["date"], r["command"]) == (last["date"], last["command"]):
            results.setdefault((r["method"], float(r["ratio"]), int(r["length"])), {})[r["stage"]] = float(r["seconds"])
    return {k: last[k] for k in ("date", "command", "machine")}, results


def last_synthetic_run(rows: list[dict], ratio: float = 0.1) -> tuple[dict[str, str], dict[int, dict[str, float]]]:
    """The newest synthetic-section run (the rows of one command and date) at kept fraction ``ratio``:
    ``(run, by_length)`` with ``run`` its ``date``, ``command``, ``machine`` and ``threads`` and
    ``by_length[T] = {"method/stage": seconds}`` (``*_mib`` stages hold MiB). The newest is the
    last such run in the file; an interrupted run counts."""
    rows = [r for r in rows if r["section"] == "synthetic" and abs(float(r["ratio"]) - ratio) < 1e-9]
    if not rows:
        raise ValueError(f"no synthetic-section rows at keep {ratio:g}")
    last = rows[-1]
    by_length: dict[int, dict[str, float]] = {}
    for r in rows:
        if (r["date"], r["command"]) == (last["date"], last["command"]):
            by_length.setdefault(int(r["length"]), {})[f"{r['method']}/{r['stage']}"] = float(r["seconds"])
    return {k: last[k] for k in ("date", "command", "machine", "threads")}, dict(sorted(by_length.items()))


def summary_from_csv(args) -> None:
    """Print the model section's summary and ratios from ``args.out``, from the rows of one run: the
    last one on ``--threads`` threads that wrote a row for these methods and lengths with the options
    they use now (with ``--option``: those options). An interrupted run can still be summarised."""
    from arckv_press.models import named_model_id
    from arckv_press.runinfo import read_rows

    try:
        run, results = last_model_run(read_rows(args.out), CurrentIds(named_model_id(args.model), args.options),
                                      args.methods, args.lengths, args.threads)
    except ValueError as e:
        raise SystemExit(f"{args.out}: {e}") from None
    print(f"run of {run['date']} on {run['machine']}: {run['command']}")
    if not any(k[0] == "none" for k in results):
        raise SystemExit(f"{args.out} has no prefill time at lengths {args.lengths}")
    print_model_summary(results, args, [m for m in args.methods if any(k[0] == m for k in results)])


if __name__ == "__main__":
    sys.exit(main())
