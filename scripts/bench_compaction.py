#!/usr/bin/env python
"""Compaction cost: per-stage wall time of ARC-KV and the Attention-Matching baselines on the
default model, kvpress's presses end to end, and a head-level sweep on synthetic tensors.

Model part (per context length and kept fraction rho): the context (Paul Graham essays, framed
as in kvpress's pipeline) is prefilled once per length (median of ``--repeats`` prefills after a
warm-up one); each ARC-KV / AM method then compacts a copy of that prefilled cache with
:func:`arckv_press.api.compact_prefilled` and we read ``cache.report.timings``:
``repeat_prefill`` (reference queries), ``selection`` (anchor scores + top-t), ``fit_rows`` (the
anchors' witness queries), ``merge`` (key merging), ``beta_fit``, ``value_fit`` (C_v) for ARC-KV, ``am_total`` (select + fit) for AM,
plus ``compact_total`` (wall time of the whole call, repeat-prefill included, prefill
excluded). kvpress presses (SnapKV, KVzip, Expected Attention) are timed end to end
(``press_total``: the prefill inside ``with press(model)`` plus the compression);
``beyond_prefill`` subtracts the median prefill.

Synthetic part: ``compact_layer`` with ``arckv-ha`` (select + merge + fit) against
``am_compact(..., "omp-fast")`` on random ``K, V [H, T, D]``, ``Q [H, n, D]`` (H = 3, D = 64,
n = max(``--queries`` (2048), 2 t) reference rows per head, so there are always at least twice
as many rows as kept keys, as with a real repeat-prefill; OMP refuses t > n), T from 1024 up to
``--max-T``. OMP-fast is not run at a
length once a shorter one took more than ``--omp-cap`` seconds. When the default model's
indexer is shipped, its anchor selection (method ``arckv``, stage ``selection``: the scoring
pass of layer 0's parameters on random activations ``X [n, d_x]`` plus top-t) is timed on the
same tensors; it replaces HA's selection and leaves merging and the fits unchanged, so the
printed ``omp/idx-sel`` (OMP-fast select + fit / the indexer's selection) is the paper's
"OMP key selection vs one scoring pass" comparison, slightly in OMP's disfavour (its time
includes AM's fits).

Printed from the same run: OMP time / ARC-KV time (per ratio and length; per-layer compaction
only, and end to end with the shared repeat-prefill), and ARC-KV's time beyond the
repeat-prefill relative to one prefill of the context.

    python scripts/bench_compaction.py --quick
    python scripts/bench_compaction.py --lengths 1K 2K 4K 8K --repeats 3 --max-T 65536

Writes ``leaderboards/bench_compaction.csv`` (long format: one row per section / method / rho /
length / stage, seconds = median over repeats).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

from arckv_press.runinfo import append_rows, median_seconds, parse_length, print_header, run_meta  # noqa: E402

DEFAULT_OUT = ROOT / "leaderboards" / "bench_compaction.csv"
COMPACTION_METHODS = ("arckv", "arckv-ha", "arckv-vi", "am-omp", "am-omp-fast", "am-ha")
KVPRESS_METHODS = ("snapkv", "kvzip", "expected_attention")
ARCKV_STAGES = ("repeat_prefill", "selection", "fit_rows", "merge", "beta_fit", "value_fit")
FIELDS = ["section", "method", "ratio", "length", "stage", "seconds", "repeats", "threads", "dtype", "indexer",
          "config_id", "command", "date", "package_version", "machine"]




def median_stages(runs: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for r in runs for k in r})
    return {k: statistics.median(r.get(k, 0.0) for r in runs) for k in keys}


def clone_cache(model, cache):
    """A new DynamicCache holding copies of ``cache``'s keys and values (compaction replaces layers)."""
    from transformers import DynamicCache

    new = DynamicCache(config=model.config)
    for i, layer in enumerate(cache.layers):
        new.update(layer.keys.clone(), layer.values.clone(), i)
    return new


def document_ids(tok, haystack: str, length: int) -> tuple[torch.Tensor, int]:
    """``prefix + document`` ids with a document of ``length`` haystack tokens."""
    from arckv_press.api import encode_document

    doc = tok.encode(haystack[: length * 8], add_special_tokens=False)
    if len(doc) < length:
        raise ValueError(f"the haystack has only {len(doc)} tokens, {length} needed")
    return encode_document(tok, tok.decode(doc[:length]))


def run_compaction(model, tok, cache, ids, prefix_len, method: str, ratio: float) -> tuple[dict[str, float], int]:
    """One ``compact_prefilled`` on a copy of the prefilled cache: its report's stage timings and
    the reference rows per KV head that merging and the fits used (max over layers)."""
    from arckv_press.api import CompactionConfig, compact_prefilled
    from arckv_press.attention import disable_compact_attention

    work = clone_cache(model, cache)
    config = CompactionConfig(method=method, ratio=ratio)
    try:
        t0 = time.perf_counter()
        result = compact_prefilled(model, tok, work, ids, prefix_len, config, already_prefilled=True)
        total = time.perf_counter() - t0
    finally:
        disable_compact_attention(model)
    stages = {k: v for k, v in result.report.timings.items() if k != "prefill"}
    stages["compact_total"] = total
    return stages, result.report.reference_rows


def run_press(model, name: str, ratio: float, ids) -> float:
    from transformers import DynamicCache

    from arckv_press.registry import make_press

    press = make_press(name, ratio)
    cache = DynamicCache(config=model.config)
    t0 = time.perf_counter()
    with press(model):
        model.model(input_ids=ids, past_key_values=cache)
    return time.perf_counter() - t0


def model_section(args, meta: dict) -> list[dict]:
    from arckv_press.api import CompactionConfig
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

    from arckv_press.registry import result_ids

    method_ids = {m: result_ids(m, mid) for m in methods if m != "none"}  # checkpoint and options behind each time

    def record(method, ratio, length, stages):
        results[(method, ratio, length)] = stages
        for stage, sec in stages.items():
            rows.append({"section": "model", "method": method, "ratio": f"{ratio:g}", "length": length, "stage": stage,
                         "seconds": f"{sec:.4f}", "repeats": args.repeats, "threads": torch.get_num_threads(),
                         "dtype": dtype, **method_ids.get(method, {}), **meta})

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
            record("none", 1.0, length, {"prefill": pre})
            print(f"{length} tokens (+{prefix_len} prefix): prefill {pre:.2f} s", flush=True)
            cache = prefill(model, ids)
            for ratio in args.ratios:
                for method in methods:
                    if method in KVPRESS_METHODS:
                        total = median_seconds(partial(run_press, model, method, ratio, ids), args.repeats, warmup=0)
                        stages = {"press_total": total, "beyond_prefill": total - pre}
                        fit_rows = ""
                    else:
                        runs = [run_compaction(model, tok, cache, ids, prefix_len, method, ratio)
                                for _ in range(args.repeats)]
                        stages = median_stages([r for r, _ in runs])
                        fit_rows = f" (fit rows per KV head, max over layers: {runs[0][1]})"
                    record(method, ratio, length, stages)
                    shown = " ".join(f"{k} {v:.2f}" for k, v in stages.items()) + fit_rows
                    print(f"  rho {ratio:<5g} {method:<19} {shown}", flush=True)
    print_model_summary(results, args, methods)
    return rows


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

    print("\nratios from this run:")
    for length in args.lengths:
        pre = results[("none", 1.0, length)]["prefill"]
        for ratio in args.ratios:
            for name in ("arckv", "arckv-ha", "arckv-vi"):  # each ARC-KV variant of the run against OMP
                arc = results.get((name, ratio, length))
                if arc is None:
                    continue
                arc_layers = sum(arc.get(s, 0.0) for s in ARCKV_STAGES[1:])
                parts = [f"{length:>6} tok, rho {ratio:g}:"]
                for omp in ("am-omp", "am-omp-fast"):
                    o = results.get((omp, ratio, length))
                    if o is not None:
                        parts.append(f"{omp}/{name} {o['am_total'] / arc_layers:.2f}x per-layer, "
                                     f"{o['compact_total'] / arc['compact_total']:.2f}x end-to-end;")
                parts.append(f"{name} beyond repeat-prefill / prefill = {arc_layers / pre:.2f}, "
                             f"repeat-prefill / prefill = {arc.get('repeat_prefill', 0.0) / pre:.2f}")
                print(" ".join(parts))


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


def _indexer_selection(indexer, X, Q, K, V, budgets, scaling):
    """ARC-KV's anchor selection with the learned indexer (layer 0): one scoring pass + top-t."""
    from arckv_press.compaction.layer import LayerMethod, anchor_scores
    from arckv_press.compaction.select import chunked_topk_anchors

    method = LayerMethod("arckv")
    scores = anchor_scores(method, Q, K, V, scaling, X, indexer, 0)
    return chunked_topk_anchors(scores, budgets, method.chunk_len, method.chunk_min_length)


def synthetic_section(args, meta: dict) -> list[dict]:
    from arckv_press.compaction.layer import LayerMethod, compact_layer
    from arckv_press.compaction.omp import am_compact

    H, D = 3, 64
    scaling = D**-0.5
    Ts = [T for T in (1024, 2048, 4096, 8192, 16384, 32768, 65536) if T <= args.max_T]
    indexer = _synthetic_indexer(H, D)
    print(f"\nsynthetic heads: H={H}, D={D}, n = max({args.queries}, 2t) reference rows per head, float32, T in {Ts}, "
          f"rho {' '.join(f'{r:g}' for r in args.synthetic_ratios)}; median of {args.repeats} repeat(s); "
          + ("learned indexer: the shipped one, layer 0" if indexer is not None else "no learned indexer shipped"))
    head = (f"{'T':>6} {'rho':>5} {'n':>5} | {'arckv-ha s':>10} {'select':>7} {'merge':>7} {'beta':>7} {'C_v':>7} | "
            f"{'idx-sel s':>9} | {'omp-fast s':>10} {'omp/arc':>8} {'omp/idx-sel':>11}")
    print(head)
    print("-" * len(head), flush=True)
    rows = []
    gen = torch.Generator().manual_seed(args.seed)
    method = LayerMethod("arckv-ha")
    omp_stopped = omp_skipped = False
    # warm-up (untimed)
    Kw, Vw, Qw = (torch.randn(H, m, D, generator=gen) for m in (512, 512, 256))
    compact_layer(Kw, Vw, Qw, torch.full((H,), 51), scaling, method)
    am_compact(Qw, Kw, Vw, torch.full((H,), 51), scaling, "omp-fast")
    if indexer is not None:
        _indexer_selection(indexer, torch.randn(Qw.shape[1], indexer.config.d_x, generator=gen), Qw, Kw, Vw, torch.full((H,), 51), scaling)

    def timing_row(method_name: str, ratio: float, T: int, stage: str, seconds: float) -> dict:
        return {"section": "synthetic", "method": method_name, "ratio": f"{ratio:g}", "length": T, "stage": stage,
                "seconds": f"{seconds:.4f}", "repeats": args.repeats, "threads": torch.get_num_threads(),
                "dtype": "float32", **meta}

    for T in Ts:
        K, V = torch.randn(H, T, D, generator=gen), torch.randn(H, T, D, generator=gen)
        for ratio in args.synthetic_ratios:
            t = max(1, int(ratio * T))
            budgets = torch.full((H,), t)
            n = max(args.queries, 2 * t)
            Q = torch.randn(H, n, D, generator=gen)
            X = torch.randn(n, indexer.config.d_x, generator=gen) if indexer is not None else None
            runs = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                res = compact_layer(K, V, Q, budgets, scaling, method)
                runs.append({**res.timings, "total": time.perf_counter() - t0})
            arc = median_stages(runs)
            idx_sel = None
            if indexer is not None:
                idx_sel = median_seconds(partial(_indexer_selection, indexer, X, Q, K, V, budgets, scaling), args.repeats,
                                         warmup=0)
                rows.append(timing_row("arckv", ratio, T, "selection", idx_sel))
            omp = None
            if not omp_stopped:
                omp = median_seconds(partial(am_compact, Q, K, V, budgets, scaling, "omp-fast"), args.repeats, warmup=0)
                omp_stopped = omp > args.omp_cap
            rows += [timing_row("arckv-ha", ratio, T, stage, sec) for stage, sec in arc.items()]
            if omp is not None:
                rows.append(timing_row("am-omp-fast", ratio, T, "total", omp))
            idx_txt = f"{idx_sel:>9.2f}" if idx_sel is not None else f"{'-':>9}"
            if omp is None:
                omp_skipped = True
                omp_txt = f"{'skipped':>10} {'-':>8} {'-':>11}"
            else:
                per_idx = f"{omp / idx_sel:>10.1f}x" if idx_sel is not None else f"{'-':>11}"
                omp_txt = f"{omp:>10.2f} {omp / arc['total']:>7.2f}x {per_idx}"
            print(f"{T:>6} {ratio:>5g} {n:>5} | {arc['total']:>10.2f} {arc.get('selection', 0):>7.2f} {arc.get('merge', 0):>7.2f} "
                  f"{arc.get('beta_fit', 0):>7.2f} {arc.get('value_fit', 0):>7.2f} | {idx_txt} | {omp_txt}", flush=True)
    if omp_skipped:
        print(f"(OMP-fast not run beyond the first length where it took more than --omp-cap {args.omp_cap:g} s)")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", choices=[*COMPACTION_METHODS, *KVPRESS_METHODS], default=None,
                   help="model-section methods (default: all; arckv only when an indexer is shipped)")
    p.add_argument("--ratios", nargs="+", type=float, default=None, help="kept fractions (default 0.2 0.1 0.05 0.02 0.01)")
    p.add_argument("--lengths", nargs="+", type=parse_length, default=None, help="context tokens (default 1K 2K 4K 8K)")
    p.add_argument("--synthetic-ratios", nargs="+", type=float, default=[0.1], help="rho of the synthetic sweep")
    p.add_argument("--max-T", type=int, default=None, help="longest synthetic length (default 65536; quick 4096)")
    p.add_argument("--queries", type=int, default=2048, help="synthetic reference rows per head")
    p.add_argument("--omp-cap", type=float, default=300.0, help="stop OMP-fast after a length taking longer (s)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats, median (default 3; quick 1)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="model dtype (default auto, load_model's default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--model", default=None, help="HF id or path (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--haystack", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-model", action="store_true", help="only the synthetic sweep")
    p.add_argument("--skip-synthetic", action="store_true", help="only the model section")
    p.add_argument("--quick", action="store_true", help="1K only, rho 0.1 and 0.02, one repeat, synthetic T <= 4096")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
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
    rows = []
    if not args.skip_model:
        rows += model_section(args, meta)
    if not args.skip_synthetic:
        rows += synthetic_section(args, meta)
    append_rows(args.out, rows, FIELDS)
    print(f"\nwrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
