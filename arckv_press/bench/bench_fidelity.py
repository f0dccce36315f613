"""Context fidelity benchmark: how much of a document's help to its own continuation survives
compaction, for every method at the five kept fractions.

For each held-out document (a ``--doc-tokens`` slice of the Paul Graham essays, second half of
``../shared/data/ruler/pg_essays.txt``: never used to train the shipped indexer, and disjoint from
the needle haystack's start) the NLL of its next ``--cont-tokens`` tokens is measured after

- the full cache (``NLL_full``), the bare chat framing with no document (``NLL_none``), and
- the document compacted by each method (``NLL_method``, same route as kvpress's pipeline:
  :func:`arckv_press.registry.prefill_with_press`),

and reported as the damage ratio ``(NLL_method - NLL_full) / (NLL_none - NLL_full)``: 0 = as good
as the full cache, 1 = as bad as no context (it can leave [0, 1]). Unlike QuALITY accuracy it does
not depend on the model's question-answering skill, which is what matters on a 135M model.

    python scripts/bench_fidelity.py --quick                      # 2 docs, 3 methods, keep 20%/10%
    python scripts/bench_fidelity.py                              # every method, 5 ratios, 8 docs
    python scripts/bench_fidelity.py --methods arckv snapkv --ratios 0.1 --docs 4
    python scripts/bench_fidelity.py --split dev --methods arckv-ha --ratios 0.02 --option lambda_m=0.5

``--split dev`` measures on development documents instead: slices of the *first* half of the essays
after its first 16,384 tokens (beyond every needle / RULER haystack, which start at the beginning
of the file, and disjoint from the reported second half), written to
``leaderboards/studies/fidelity_dev.csv``. Defaults that depend on the kept fraction are chosen there, never
on the reported documents. ``--option KEY=VALUE`` sets a ``CompactionConfig`` field of the ARC-KV /
Attention Matching methods (e.g. ``lambda_m=0.5``); its rows carry that option's ``config_id``.

Writes one row per (method, ratio, document) to ``leaderboards/bench_fidelity.csv`` (resumable:
finished rows are skipped, unless they used another learned indexer checkpoint or other compaction
options, columns ``indexer`` and ``config_id``: ``arckv_press.registry.result_ids``) and prints mean +- SD damage per method and ratio, plus the ratio of
each method's damage to ARC-KV's at the same kept fraction, all from the CSV rows of this
configuration (documents, lengths, model). ``scripts/make_leaderboard.py`` turns the rows into
benchmark ``fidelity`` (score = 1 - mean damage).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

from arckv_press.bench import ROOT
from arckv_press.runinfo import (
    CurrentIds,
    add_option_argument,
    add_columns,
    append_rows,
    print_header,
    read_rows,
    run_meta,
)

DEFAULT_OUT = ROOT / "leaderboards" / "bench_fidelity.csv"
DEV_OUT = ROOT / "leaderboards" / "studies" / "fidelity_dev.csv"
DEV_SKIP_TOKENS = 16384  # the dev documents start this far into the first half (past every haystack)
DOC_TOKENS = 1500  # --doc-tokens default: the length of the reported and development documents
DEFAULT_METHODS = ("arckv", "arckv-ha", "arckv-vi", "am-omp", "am-omp-fast", "am-ha", "snapkv", "kvzip",
                   "expected_attention", "knorm", "streaming_llm")
DEFAULT_RATIOS = (0.2, 0.1, 0.05, 0.02, 0.01)
QUICK = dict(methods=("arckv-ha", "snapkv", "expected_attention"), ratios=(0.2, 0.1), docs=2)
FIELDS = ["method", "ratio", "doc", "doc_tokens", "cont_tokens", "nll", "nll_full", "nll_none", "damage",
          "compaction_s", "cache_bytes", "compacted_bytes", "indexer", "config_id", "model", "command", "date",
          "package_version", "machine"]


def split_documents_of(split: str, tokenizer, haystack: str, n_docs: int, doc_tokens: int, cont_tokens: int,
                       skip_tokens: int = DEV_SKIP_TOKENS) -> list[tuple[str, list[int]]]:
    """The ``(document, continuation ids)`` pairs of ``split``: ``test`` cuts the second half of the
    haystack text, ``dev`` the first half after its first ``skip_tokens`` tokens."""
    from arckv_press.probe_metrics import split_documents

    half = len(haystack) // 2
    if split == "test":
        return split_documents(tokenizer, haystack[half:], n_docs, doc_tokens, cont_tokens)
    if split == "dev":
        return split_documents(tokenizer, haystack[:half], n_docs, doc_tokens, cont_tokens, skip_tokens)
    raise ValueError(f"split must be 'test' or 'dev', got {split!r}")


def row_key(method: str, ratio, doc, doc_tokens, cont_tokens, model: str) -> tuple:
    return (method, round(float(ratio), 6), int(doc), int(doc_tokens), int(cont_tokens), model)


def summarize(rows: list[dict], methods, ratios, n_docs: int, doc_tokens: int, cont_tokens: int, model: str) -> str:
    """Mean +- SD damage per method and ratio over this configuration's rows, and damage / ARC-KV's."""
    damage: dict[tuple[str, float], list[float]] = {}
    for r in rows:
        if (int(r["doc"]) < n_docs and int(r["doc_tokens"]) == doc_tokens and int(r["cont_tokens"]) == cont_tokens
                and r["model"] == model and r["damage"] not in ("", "nan")):
            damage.setdefault((r["method"], round(float(r["ratio"]), 6)), []).append(float(r["damage"]))
    ratios = sorted({round(float(x), 6) for x in ratios}, reverse=True)
    ref = next((m for m in ("arckv", "arckv-ha") if m in methods), None)
    lines = [f"damage (0 = full cache, 1 = no context), mean +- SD over documents ({model}, "
             f"{doc_tokens}-token documents, next {cont_tokens} tokens)",
             f"{'method':<20}" + "".join(f"{'keep ' + format(r, 'g'):>18}" for r in ratios)]
    for m in methods:
        cells = []
        for r in ratios:
            vals = damage.get((m, r), [])
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            cells.append(f"{statistics.mean(vals):+.3f} +- {sd:.3f} ({len(vals)})" if vals else "-")
        lines.append(f"{m:<20}" + "".join(f"{c:>18}" for c in cells))
    if ref:
        lines.append(f"mean damage / {ref}'s mean damage at the same kept fraction (> 1: {ref} better)")
        for m in methods:
            cells = []
            for r in ratios:
                a, b = damage.get((m, r)), damage.get((ref, r))
                ok = a and b and statistics.mean(a) > 0 and statistics.mean(b) > 0  # a ratio of positive damages
                cells.append(f"{statistics.mean(a) / statistics.mean(b):.2f}x" if ok else "-")
            lines.append(f"{m:<20}" + "".join(f"{c:>18}" for c in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from arckv_press.methods import METHODS
    from arckv_press.models import model_help

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", choices=sorted(m for m in METHODS if m != "none"), default=None)
    p.add_argument("--ratios", nargs="+", type=float, default=None, help="kept fractions (default the five)")
    p.add_argument("--docs", type=int, default=None, help="held-out documents (default 8)")
    p.add_argument("--doc-tokens", type=int, default=DOC_TOKENS)
    p.add_argument("--cont-tokens", type=int, default=256)
    p.add_argument("--quick", action="store_true", help="2 documents, 3 methods, keep 20%% and 10%%")
    p.add_argument("--model", default=None, help=model_help())
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--split", choices=("test", "dev"), default="test",
                   help="test: the reported documents (second half of the essays); dev: development documents "
                        "(first half, after 16,384 tokens) for choosing defaults")
    add_option_argument(p)
    p.add_argument("--out", type=Path, default=None, help="CSV (default leaderboards/bench_fidelity.csv; "
                   "with --split dev leaderboards/studies/fidelity_dev.csv)")
    args = p.parse_args(argv)
    args.out = args.out or (DEV_OUT if args.split == "dev" else DEFAULT_OUT)
    quick = QUICK if args.quick else {}
    methods = args.methods or quick.get("methods", DEFAULT_METHODS)
    ratios = args.ratios or quick.get("ratios", DEFAULT_RATIOS)
    n_docs = args.docs or quick.get("docs", 8)
    bad = [r for r in ratios if not 0.0 < r < 1.0]
    if bad:
        p.error(f"ratios are kept fractions in (0, 1), got {bad}")
    if args.threads:
        torch.set_num_threads(args.threads)

    from tqdm.auto import tqdm

    from arckv_press.haystack import default_haystack_path, load_haystack
    from arckv_press.models import load_model, model_id
    from arckv_press.probe_metrics import continuation_damage, reference_nlls
    from arckv_press.registry import make_press, press_options

    if default_haystack_path() is None:  # rows and reference NLLs are keyed by document index: same text always
        raise SystemExit("bench_fidelity needs ../shared/data/ruler/pg_essays.txt (beside the checkout or the "
                         "working directory); it never falls back to another text, whose documents would be "
                         "compared with the stored reference NLLs of the essays")
    print_header("context fidelity (continuation damage)", argv=argv)
    meta = run_meta(argv=None if argv is None else [sys.argv[0], *argv])
    model, tok = load_model(args.model)
    mid = model_id(model)
    haystack = load_haystack(None)
    documents = split_documents_of(args.split, tok, haystack, n_docs, args.doc_tokens, args.cont_tokens)
    options = {m: press_options(m, args.options) for m in methods}
    # rows of another indexer checkpoint or config do not count
    ids = CurrentIds(mid, args.options)
    add_columns(args.out, FIELDS)  # rows from before compacted_bytes keep it empty
    rows = read_rows(args.out)
    done = {row_key(r["method"], r["ratio"], r["doc"], r["doc_tokens"], r["cont_tokens"], r["model"]) for r in rows
            if r["method"] in methods and ids.matches(r)}
    references = {(int(r["doc"]), int(r["doc_tokens"]), int(r["cont_tokens"]), r["model"]):
                  (float(r["nll_full"]), float(r["nll_none"])) for r in rows}
    todo = [(m, r, d) for r in sorted(ratios, reverse=True) for m in methods for d in range(n_docs)
            if row_key(m, r, d, args.doc_tokens, args.cont_tokens, mid) not in done]
    print(f"{len(todo)} cases to run, {len(methods) * len(ratios) * n_docs - len(todo)} already in {args.out}", flush=True)
    bar = tqdm(todo, unit="case", dynamic_ncols=True)
    for method, ratio, d in bar:
        bar.set_description(f"{method} keep {ratio:g} doc {d}")
        doc, cont = documents[d]
        ref_key = (d, args.doc_tokens, args.cont_tokens, mid)
        if ref_key not in references:
            references[ref_key] = reference_nlls(model, tok, doc, cont)
        res = continuation_damage(model, tok, make_press(method, ratio, **options[method]), doc, cont,
                                  references[ref_key])
        full, none = references[ref_key]
        row = {"method": method, "ratio": f"{ratio:g}", "doc": d, "doc_tokens": args.doc_tokens,
               "cont_tokens": args.cont_tokens, "nll": f"{res['nll']:.5f}", "nll_full": f"{full:.5f}",
               "nll_none": f"{none:.5f}", "damage": "nan" if math.isnan(res["damage"]) else f"{res['damage']:.5f}",
               "compaction_s": f"{res['seconds']:.3f}", "cache_bytes": res["cache_bytes"],
               "compacted_bytes": res["compacted_bytes"], **ids(method, ratio), "model": mid, **meta}
        append_rows(args.out, [row], FIELDS)
        rows.append(row)
        tqdm.write(f"{method:<19} keep {ratio:<5g} doc {d}  damage {res['damage']:+.3f}  {res['seconds']:6.1f} s")
    current = [r for r in rows if r["method"] in methods and ids.matches(r)]
    print(summarize(current, methods, ratios, n_docs, args.doc_tokens, args.cont_tokens, mid))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
