"""Needle retrieval and continuation damage for methods, reference-query sources and poolings.

    python scripts/probes.py --quick
    python scripts/probes.py --configs arckv-ha arckv-ha:ctx=0.5 arckv-ha:pool=max snapkv kvzip --ratios 0.2 0.1

A config is ``METHOD[:key=value,...]`` with keys ``ctx`` (Attention Matching only: share of reference
queries from the context's own prefill: 0 = repeat-prefill only, the paper's default), ``pool`` (rms, mean,
max), ``alloc`` (global, fixed), ``floor`` (min_head_fraction: share of the uniform budget every head keeps under global allocation; default 0.5), ``lam`` (lambda_m, key merging), ``wit`` (1: the fits also use each
anchor's witness query, the default; 0: the budget rows only), ``qb`` (query_budget rows per KV head),
and the value fit: ``values`` (fit: paper Eq. (value_lstsq);
anchor: keep the anchors' own values), ``prior`` (zero, anchor) and ``ridge`` (relative lambda_v);
``alloc=fixed`` is the paper's allocation. Results are appended to ``leaderboards/probes.csv`` (resumable: a finished config, ratio and
``--dtype`` is skipped, unless it used another learned indexer checkpoint or other compaction
options, e.g. after a default changed: columns ``indexer`` and ``config_id``,
``arckv_press.registry.result_ids``);
the haystack and documents are the Paul Graham essays in ``../shared/data/ruler/pg_essays.txt``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from arckv_press.runinfo import run_meta
from arckv_press.compaction.fit import FitConfig
from arckv_press.haystack import load_haystack
from arckv_press.models import load_model, model_help, model_id
from arckv_press.probe_metrics import continuation_probe, needle_probe, split_documents
from arckv_press.registry import make_press, result_ids

FIT_KEYS = {"values": "values", "prior": "value_prior", "ridge": "ridge_v"}  # probe key -> FitConfig field
FIELDS = ["config", "method", "ratio", "dtype", "indexer", "config_id", "options", "needle_found", "needle_total", "damage", "damage_docs",
          "compaction_seconds", "date", "version", "command"]


def _jsonable(obj):
    """FitConfig (and other dataclasses) in the options column: their non-default fields."""
    if dataclasses.is_dataclass(obj):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if getattr(obj, f.name) != f.default}
    raise TypeError(f"cannot record {type(obj).__name__} in the options column")


def _flag(value: str, text: str) -> bool:
    if value not in ("0", "1"):
        raise ValueError(f"wit= takes 0 or 1, got {value!r} in config {text!r}")
    return value == "1"


def parse_config(text: str) -> tuple[str, dict]:
    method, _, rest = text.partition(":")
    options: dict = {}
    fit: dict = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key == "pool":
            options.setdefault("config_options", {})["pooling"] = value
        elif key == "alloc":
            options.setdefault("config_options", {})["budgets"] = value
        elif key == "lam":
            options["lambda_m"] = float(value)
        elif key == "floor":
            options["min_head_fraction"] = float(value)
        elif key == "wit":
            fit["witnesses"] = _flag(value, text)
        elif key == "qb":
            options["query_budget"] = int(value)
        elif key in FIT_KEYS:
            fit[FIT_KEYS[key]] = float(value) if key == "ridge" else value
        else:
            raise ValueError(
                f"unknown option {key!r} in config {text!r} (use pool=, alloc=, lam=, floor=, wit=, qb=, values=, "
                "prior=, ridge=)"
            )
    if fit:
        options.setdefault("config_options", {})["fit"] = FitConfig(**fit)
    return method, options


def done_keys(rows) -> set[tuple]:
    """``(config, ratio, dtype, indexer, config_id, with_needles)`` of the finished rows of a probes CSV."""
    return {(r["config"], float(r["ratio"]), r["dtype"], r["indexer"], r["config_id"], r["needle_total"] not in ("", "0"))
            for r in rows}


def is_done(done: set[tuple], key: tuple, no_needles: bool) -> bool:
    """A full probe is done only by a row with needles; a damage-only run (``--no-needles``) by either."""
    return (*key, True) in done or (no_needles and (*key, False) in done)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["arckv-ha", "arckv-ha:ctx=0.5", "arckv-ha:ctx=1",
                                                    "arckv-ha:pool=max", "arckv-ha:pool=mean", "arckv-vi",
                                                    "am-omp-fast", "snapkv", "kvzip", "expected_attention"])
    p.add_argument("--ratios", nargs="+", type=float, default=[0.2, 0.1])
    p.add_argument("--model", default=None, help=model_help())
    p.add_argument("--needle-tokens", type=int, default=2000)
    p.add_argument("--depths", nargs="+", type=float, default=[0.1, 0.3, 0.5, 0.7, 0.9])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--doc-tokens", type=int, default=1500)
    p.add_argument("--cont-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="model dtype (default float32: on CPUs without native bf16, bf16 runs several times slower)")
    p.add_argument("--out", default="leaderboards/probes.csv")
    p.add_argument("--quick", action="store_true", help="2 needles, 1 document, ratio 0.2, three configs")
    p.add_argument("--no-needles", action="store_true",
                   help="continuation damage only (needle columns left empty; such a row does not count as a "
                        "finished probe for a later run with needles)")
    args = p.parse_args(argv)
    if args.quick:
        args.configs, args.ratios, args.depths, args.seeds, args.docs = ["arckv-ha", "snapkv", "kvzip"], [0.2], [0.5], [0, 1], 1
    torch.set_num_threads(args.threads)
    run = run_meta(argv=None if argv is None else [sys.argv[0], *argv])
    print(f"# {run['command']}\n# machine: {run['machine']}, arckv-press {run['package_version']}")

    out = Path(args.out)
    done = set()
    if out.exists():
        with out.open() as f:
            reader = csv.DictReader(f)
            if reader.fieldnames != FIELDS:
                raise SystemExit(f"{out} has columns {reader.fieldnames}, expected {FIELDS}; write to another --out")
            done = done_keys(reader)
    model, tok = load_model(args.model, dtype=args.dtype)
    mid = model_id(model)
    haystack = load_haystack(None)
    documents = split_documents(tok, haystack[len(haystack) // 2 :], args.docs, args.doc_tokens, args.cont_tokens)
    references: dict = {}
    out.parent.mkdir(parents=True, exist_ok=True)
    new_file = not out.exists()
    with out.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        if new_file:
            writer.writeheader()
        for config in args.configs:
            method, options = parse_config(config)
            for ratio in args.ratios:
                ids = result_ids(method, mid, ratio, **options)  # a new checkpoint or default reruns the config
                if is_done(done, (config, ratio, args.dtype, ids["indexer"], ids["config_id"]), args.no_needles):
                    print(f"skip {config} @ {ratio} {args.dtype} (done)")
                    continue
                factory = lambda: make_press(method, ratio, **options)  # noqa: E731
                t0 = time.perf_counter()
                needle = None
                if not args.no_needles:
                    needle, _ = needle_probe(model, tok, factory, haystack, args.needle_tokens, args.depths, args.seeds)
                cont, _ = continuation_probe(model, tok, factory, documents, references)
                n_needles = needle.count if needle else 0
                row = {
                    "config": config, "method": method, "ratio": ratio, "dtype": args.dtype, **ids, "options": json.dumps(options, default=_jsonable),
                    "needle_found": round(needle.value * needle.count) if needle else "", "needle_total": n_needles,
                    "damage": round(cont.value, 4), "damage_docs": cont.count,
                    "compaction_seconds": round(((needle.seconds if needle else 0.0) + cont.seconds)
                                                / (n_needles + len(documents)), 2),
                    "date": run["date"], "version": run["package_version"], "command": run["command"],
                }
                writer.writerow(row)
                f.flush()
                print(f"{config:<24} keep {ratio:<5} needles {row['needle_found'] if needle else '-'}/{n_needles}  "
                      f"damage {row['damage']:+.3f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
