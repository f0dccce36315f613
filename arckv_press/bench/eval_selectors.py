"""Anchor selectors on held-out development contexts: learned indexer vs HA vs VI vs AM OMP-fast.

For each development context (SQuAD test-half articles held out from indexer training by
``arckv_press.indexer.data.build_contexts``, with the split settings stored in the checkpoint's
metadata) and each evaluated layer, the cached reference pool (prefill + repeat-prefill, the same
construction as training and inference) is split into disjoint FIT and HOLDOUT reference
positions (75% / 25%; all query heads of a position on one side). Per layer, all KV heads at once:

  select   scores from the FIT rows only: learned indexer (paper Eq. (indexer_pooling)),
           HA and VI (paper Eq. (background_value_selectors)), or AM's OMP-fast key selection
           (``compaction.omp.omp_select`` with ``AM_OMP_FAST``); top-t per head with
           t = per_head_budgets(T, rho) (uniform) or the checkpoint's budget weights a(l, h)
           (paper Eq. (per_head_budget)); hard anchors C_k = K_S (no key merging)
  fit      beta (Eq. (mass_fit)) and C_v (Eq. (value_lstsq)) on the FIT rows, identical for
           every selector (so only the selection differs)
  metric   relative L2 error ||O_hat - O||_F / ||O||_F of the attention output on the HOLDOUT
           rows, per KV head; selection time (scores + top-t, or OMP) per layer

Rows: ``indexer`` (trained), ``indexer-init`` (the same architecture at its initialisation: is
training doing anything?), ``ha``, ``vi``, ``omp-fast``; ablations: pooling rms / mean / max
(indexer, HA, VI) and per-head vs uniform budgets (indexer, HA). Errors are means over
(context, layer, KV head).

    python scripts/eval_selectors.py --quick
    python scripts/eval_selectors.py --layers all --contexts 4
    python scripts/eval_selectors.py --dev-tokens 3000 6700 --no-omp --out leaderboards/studies/eval_selectors/eval_selectors_long_contexts.csv

Prints markdown tables (command line, machine, data at the top) and writes
``leaderboards/studies/eval_selectors/eval_selectors.csv`` (one row per context x layer x selector x pooling x
budgets x ratio; column ``indexer``: the checkpoint id of the ``indexer`` rows,
``arckv_press.indexer.checkpoint_id``, plus ``+shards:DIR`` when ``--shards`` replaced layers).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from arckv_press.compaction.fit import full_attention
from arckv_press.compaction.omp import AM_OMP_FAST, omp_select
from arckv_press.compaction.select import (
    ha_scores,
    per_head_budgets,
    topk_anchors,
    vi_scores,
)
from arckv_press.indexer.budget import fit_holdout_split, heldout_error
from arckv_press.indexer.checkpoint import (
    checkpoint_id,
    default_indexer_path,
    load_indexer,
)
from arckv_press.indexer.data import (
    SQUAD_TRAIN_FILE,
    ContextSpec,
    PoolSettings,
    build_contexts,
    build_pools,
    contexts_summary,
    default_data_dir,
    default_pool_dir,
    load_pool,
    load_squad_articles,
)
from arckv_press.indexer.model import ValueAwareIndexer
from arckv_press.indexer.driver import load_shard_layers, parse_layers, shard_config
from arckv_press.runinfo import run_meta

RATIOS = (0.2, 0.1, 0.05, 0.02, 0.01)
POOLINGS = ("rms", "mean", "max")


def parse_args(argv=None) -> argparse.Namespace:
    from arckv_press.models import model_help

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 contexts, 5 layers, 3 ratios")
    p.add_argument("--indexer", default=None, help="checkpoint dir (default: the shipped one)")
    p.add_argument("--shards", default=None,
                   help="layer-shard dir of a `train_indexer.py --layers ...` run: its layers replace the checkpoint's")
    p.add_argument("--contexts", type=int, default=None, help="development contexts (default all)")
    p.add_argument("--dev-tokens", type=int, nargs=2, metavar=("MIN", "MAX"), default=None,
                   help="pack the development articles into contexts of MIN-MAX tokens instead of the checkpoint's "
                        "training lengths (the same held-out articles: the split does not depend on lengths)")
    p.add_argument("--layers", default=None, help="e.g. 0-29, 0,6,12 or all (default every 3rd layer)")
    p.add_argument("--ratios", type=float, nargs="+", default=list(RATIOS))
    p.add_argument("--holdout", type=float, default=0.25)
    p.add_argument("--no-omp", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model", default=None, help=model_help())
    p.add_argument("--out", default="leaderboards/studies/eval_selectors/eval_selectors.csv")
    p.add_argument("--dtype", default="auto",
                   help="model dtype of the reference pools (default auto, as inference: bfloat16 on CUDA, float32 on "
                        "CPU; the README's table of 2026-11-22 used bfloat16 pools)")
    return p.parse_args(argv)


def dev_context_spec(training: dict, dev_tokens: tuple[int, int] | list[int] | None = None) -> ContextSpec:
    """The :class:`ContextSpec` of the development contexts: the checkpoint's training spec
    (``training["context_spec"]``; 1,200-1,800 tokens for checkpoints without one), with its
    lengths replaced by ``dev_tokens = (min, max)`` when given. The article split depends only on
    the seed and ``dev_fraction``, so other lengths repack the same held-out articles."""
    spec = ContextSpec(**training["context_spec"]) if training.get("context_spec") else ContextSpec(1200, 1800)
    if dev_tokens is not None:
        lo, hi = dev_tokens
        spec = dataclasses.replace(spec, min_tokens=int(lo), max_tokens=int(hi))
    return spec


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def evaluate_layer(pool, layer, indexer, init_indexer, weights_layer, ratios, holdout, seed, use_omp):
    """Yield result dicts for one pool (context x layer)."""
    fit_rows, hold_rows = fit_holdout_split(pool, holdout, seed)
    Q, K, V = pool.Q.float(), pool.K.float(), pool.V.float()
    Qf, Qh, X = Q[:, fit_rows], Q[:, hold_rows], pool.X_rows(fit_rows).float()
    H, T = K.shape[0], K.shape[1]
    Y_hold = full_attention(Qh, K, V, pool.scaling)
    scorers = {}
    for pooling in POOLINGS:
        scorers[("indexer", pooling)] = lambda p=pooling: indexer.scores(layer, X, Qf, K, V, pooling=p)
        scorers[("ha", pooling)] = lambda p=pooling: ha_scores(Qf, K, pool.scaling, pooling=p)
        scorers[("vi", pooling)] = lambda p=pooling: vi_scores(Qf, K, V, pool.scaling, pooling=p)
    scorers[("indexer-init", "rms")] = lambda: init_indexer.scores(layer, X, Qf, K, V, pooling="rms")
    scores = {key: _timed(fn) for key, fn in scorers.items()}
    for rho in ratios:
        budget_modes = {"uniform": per_head_budgets(T, rho, None, 1, H)[0]}
        if weights_layer is not None:
            budget_modes["per-head"] = weights_layer(T, rho)
        for (name, pooling), (s, sec) in scores.items():
            for mode, budgets in budget_modes.items():
                if mode == "per-head" and (pooling != "rms" or name not in ("indexer", "ha")):
                    continue
                (idx, valid), sec_top = _timed(lambda: topk_anchors(s, budgets))
                err = heldout_error(Qf, Qh, K, V, pool.scaling, idx, valid, Y_hold=Y_hold)
                yield dict(selector=name, pooling=pooling, budgets=mode, ratio=rho, err=err,
                           kept=float(valid.sum()) / (H * T), seconds=sec + sec_top)
        budgets = budget_modes["uniform"]
        if use_omp and int(budgets.max()) > Qf.shape[1]:
            print(f"omp-fast skipped at rho {rho:g}, T {T}: {int(budgets.max())} kept keys > {Qf.shape[1]} fit rows "
                  "(OMP needs at least as many rows as keys)")
        elif use_omp:
            (idx, valid, _w), sec = _timed(lambda: omp_select(Qf, K, budgets, pool.scaling, AM_OMP_FAST))
            err = heldout_error(Qf, Qh, K, V, pool.scaling, idx, valid, Y_hold=Y_hold)
            yield dict(selector="omp-fast", pooling="-", budgets="uniform", ratio=rho, err=err,
                       kept=float(valid.sum()) / (H * T), seconds=sec)


def md_table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from arckv_press.models import describe_attention_layout, load_model, model_id

    model, tok = load_model(args.model, dtype=args.dtype)
    args.dtype = str(model.dtype).removeprefix("torch.")  # the resolved dtype, as printed and recorded
    mid = model_id(model)
    ck = Path(args.indexer) if args.indexer else default_indexer_path(mid)
    if ck is None:
        raise SystemExit(f"no indexer checkpoint for {mid}; train one with scripts/train_indexer.py")
    from arckv_press.models import config_hash

    indexer, meta, bw = load_indexer(ck, model_id=mid, config_hash=config_hash(model.config))
    ident = checkpoint_id(ck) + (f"+shards:{args.shards}" if args.shards else "")
    shard_layers = None
    if args.shards:
        shards_cfg = shard_config(args.shards)
        if shards_cfg != indexer.config:  # another size (e.g. --n-index-heads): only its layers exist
            indexer = ValueAwareIndexer(shards_cfg)
            shard_layers = load_shard_layers(indexer, args.shards)
            print(f"indexer config {indexer.config.to_dict()} of the shards: only layers {shard_layers} are evaluated")
        else:
            print(f"layers {load_shard_layers(indexer, args.shards)} from the shards in {args.shards}")
    init_indexer = ValueAwareIndexer(indexer.config, seed=int(meta.training.get("init_seed", 0)))
    spec = dev_context_spec(meta.training, args.dev_tokens)
    pset = PoolSettings(**meta.training.get("pool_settings", {})) if meta.training.get("pool_settings") else PoolSettings()
    source = default_data_dir() / meta.training.get("source_file", SQUAD_TRAIN_FILE)
    _, dev = build_contexts(load_squad_articles(source), tok, spec)
    n_ctx = 2 if args.quick and args.contexts is None else (args.contexts or len(dev))
    dev = dev[:n_ctx]
    L = indexer.config.num_layers
    full = list(describe_attention_layout(model).full_attention_layers)  # the compacted layers (hybrids: global only)
    if args.layers is None:
        layers = full[::7] if args.quick else full[::3]
    else:
        layers = parse_layers(args.layers, L) or full
        if set(layers) - set(full):
            raise SystemExit(f"--layers {args.layers}: layers {sorted(set(layers) - set(full))} are not compacted "
                             f"(full-attention layers: {full})")
    if shard_layers is not None and not set(layers) <= set(shard_layers):
        raise SystemExit(f"--shards {args.shards} has another indexer config than the checkpoint and only layers "
                         f"{shard_layers}; pass --layers within them (asked for {layers})")
    ratios = tuple(args.ratios) if not (args.quick and args.ratios == list(RATIOS)) else (0.2, 0.05, 0.01)
    paths = build_pools(model, tok, dev, default_pool_dir(model), pset, progress=True)
    weights_sel = bw[layers].double() if bw is not None else None

    def weights_layer_fn(li):
        if weights_sel is None:
            return None
        return lambda T, rho: per_head_budgets(T, rho, weights_sel, len(layers), weights_sel.shape[1])[li]

    run = run_meta(argv=None if argv is None else [sys.argv[0], *argv])
    command, machine, date = run["command"], run["machine"], run["date"]
    header = [
        f"command: `{command}`",
        f"machine: {machine}; date {date}; arckv-press {run['package_version']}",
        f"model: {mid} ({args.dtype}); indexer: {ck}, id {ident} (checkpoint trained on "
        f"{meta.training.get('train_contexts')})" + ("" if shard_layers is None else
        f"; layers {shard_layers} from shards of another indexer config, whose per-head budget rows use "
        f"the checkpoint's weights"),
        f"data: {len(dev)} held-out dev contexts {contexts_summary(dev)} from {source.name} "
        f"(articles disjoint from training); layers {layers}; query_budget {pset.query_budget} rows/KV head, "
        f"fit/holdout positions {1 - args.holdout:.2f}/{args.holdout:.2f}",
    ]
    print("\n".join(header), flush=True)
    rows = []
    t0 = time.perf_counter()
    for ci, (ctx, path) in enumerate(zip(dev, paths)):
        for li, layer in enumerate(layers):
            pool = load_pool(path, layer)
            for r in evaluate_layer(pool, layer, indexer, init_indexer, weights_layer_fn(li), ratios,
                                    args.holdout, ci, not args.no_omp):
                rows.append(dict(context=ctx.id, layer=layer, T=pool.T, **r))
        print(f"  context {ci + 1}/{len(dev)} done ({time.perf_counter() - t0:.0f} s)", flush=True)

    # aggregate: mean over (context, layer, head)
    agg = defaultdict(list)
    sec = defaultdict(list)
    kept = defaultdict(list)
    for r in rows:
        key = (r["selector"], r["pooling"], r["budgets"])
        agg[key + (r["ratio"],)].extend(r["err"].tolist())
        sec[key].append(r["seconds"])
        kept[key + (r["ratio"],)].append(r["kept"])

    def line(key):
        cells = [f"{sum(agg[key + (rho,)]) / len(agg[key + (rho,)]):.4f}" for rho in ratios]
        return cells + [f"{1000 * sum(sec[key]) / len(sec[key]):.1f}"]

    rho_hdr = [f"rho={rho:g}" for rho in ratios]
    main_keys = [("indexer", "rms", "uniform"), ("indexer-init", "rms", "uniform"), ("ha", "rms", "uniform"),
                 ("vi", "rms", "uniform")] + ([] if args.no_omp else [("omp-fast", "-", "uniform")])
    out = ["", "### Held-out relative L2 error of the attention output (lower is better), uniform budgets, RMS pooling", "",
           md_table(["selector"] + rho_hdr + ["selection ms / layer"], [[k[0]] + line(k) for k in main_keys])]
    out += ["", "### Aggregation ablation (uniform budgets)", "",
            md_table(["selector", "pooling"] + rho_hdr + ["selection ms / layer"],
                     [[s, p] + line((s, p, "uniform")) for s in ("indexer", "ha", "vi") for p in POOLINGS])]
    if weights_sel is not None:
        def kept_cells(key):
            return [f"{sum(kept[key + (rho,)]) / len(kept[key + (rho,)]):.4f}" for rho in ratios]

        out += ["", "### Per-head budget weights a(l,h) vs uniform budgets (RMS pooling); realised kept fraction below", "",
                md_table(["selector", "budgets"] + rho_hdr + ["selection ms / layer"],
                         [[s, m] + line((s, "rms", m)) for s in ("indexer", "ha") for m in ("uniform", "per-head")]),
                "", md_table(["selector", "budgets"] + [f"kept@{r:g}" for r in ratios],
                             [[s, m] + kept_cells((s, "rms", m)) for s in ("indexer", "ha") for m in ("uniform", "per-head")])]
    print("\n".join(out))
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")

    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with out_path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["context", "layer", "T", "selector", "pooling", "budgets", "ratio", "kept_fraction",
                    "rel_l2_mean_over_heads", "rel_l2_per_head", "selection_seconds", "indexer",
                    "command", "date", "package_version", "machine"])
        for r in rows:
            w.writerow([r["context"], r["layer"], r["T"], r["selector"], r["pooling"], r["budgets"], r["ratio"],
                        f"{r['kept']:.5f}", f"{float(r['err'].mean()):.6f}",
                        " ".join(f"{x:.6f}" for x in r["err"].tolist()), f"{r['seconds']:.5f}",
                        ident if r["selector"] == "indexer" else "", command, date, run["package_version"], machine])
    print(f"wrote {out_path} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
