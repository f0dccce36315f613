"""Cache-reconstruction fidelity: paper Table (motivation_reconstruction) and Table
(key_merging_coefficient_ablation) on the default model and real contexts.

For each article (a disjoint window of Paul Graham essays, SQuAD or HotpotQA paragraphs) we
prefill ``prefix + document``, capture reference queries with the repeat-prefill at seeded
positions, and split those positions into disjoint FIT and HELD-OUT halves (all query heads of a
position stay on one side). Per layer, all KV heads at once:

  anchors   HA scores (RMS pooling) on the fit rows, top-t with t = floor(rho T) per head;
  1 hard subset        softmax(q K_S^T) V_S
  2 mass calibration   K_S, beta fitted, V_S
  3 key/value merging  C_k^mrg (lambda_m), beta fitted, C_v^mrg (value centroids of the same
                       groups and weights, same interpolation; no C_v fit)
  4 value fitting      K_S, beta fitted, C_v fitted
  5 ARC-KV             C_k^mrg, beta fitted, C_v fitted

All fits use the fit rows only; the metrics (relative L2 and cosine of the attention output) use
the held-out rows only. Constructions 2-5 are repeated with the NNLS mass solver. The lambda_m
sweep (ls_clamp mass fit, on ``--sweep-layers``, default 6 evenly spaced studied layers, because
it dominates the run time) reports E_mass = ||Z_c - Z_f|| / ||Z_f|| on the fit rows as in the
paper (``--mass-holdout`` adds the held-out rows) and the share of anchors with w <= 0 (beta at
its floor).

    python scripts/reconstruction.py --quick                 # 2 articles, 6 layers (~11 min under load)
    python scripts/reconstruction.py                         # 2 articles, all 30 layers, sweep on 6
    python scripts/reconstruction.py --articles 10 --sweep-layers all --mass-holdout

Writes ``--out`` (one row per article x layer x KV head x construction x mass solver) and
``<out stem>_lambda.csv`` (one row per article x layer x KV head x ratio x lambda_m), and prints
markdown tables for the README.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from arckv_press.cache import new_cache
from arckv_press.capture import encode_document, framing_for, prefill, repeat_prefill
from arckv_press.compaction.fit import (
    FitConfig,
    attention_mass_error,
    compact_attention,
    fit_beta,
    fit_values,
    full_attention,
)
from arckv_press.compaction.merge import merge_keys
from arckv_press.compaction.reference import (
    group_queries_by_kv_head,
    split_episode,
    subsample_rows,
)
from arckv_press.compaction.select import ha_scores, per_head_budgets, topk_anchors
from arckv_press.reconstruction import (
    SOURCES,
    disjoint_windows,
    format_pm,
    gather_slots,
    group_centroids,
    grouped_rows,
    interpolate_slots,
    layer_subset,
    load_source_text,
    log_key_mass,
    markdown_table,
    mean_sd,
    output_fidelity,
    parse_layers,
)
from arckv_press.models import describe_attention_layout, load_model, model_help, model_id
from arckv_press.bench import SHARED_DATA_DIR
from arckv_press.runinfo import run_meta

CONSTRUCTIONS = {  # name -> (C_k, beta, C_v, paper rel. l2, paper cosine) of paper Table 1
    "hard subset": ("K_S", "0", "V_S", "0.8778±0.2973", "0.7543±0.1055"),
    "mass calibration": ("K_S", "fitted", "V_S", "0.8782±0.3189", "0.7503±0.1100"),
    "key/value merging": ("C_k^mrg", "fitted", "C_v^mrg", "0.5109±0.1481", "0.8558±0.0738"),
    "value fitting": ("K_S", "fitted", "C_v^LS", "0.3546±0.1265", "0.9135±0.0586"),
    "key merging + value fitting": ("C_k^mrg", "fitted", "C_v^LS", "0.3200±0.1291", "0.9250±0.0566"),
}
SOLVERS = ("ls_clamp", "nnls")
STAGES = {  # key -> (label, unit)
    "prefill": ("prefill (prefix + document)", "article"),
    "repeat_prefill": ("repeat-prefill (query capture)", "article"),
    "selection": ("selection (HA, RMS, top-t)", "layer"),
    "merge": ("key merge (merge_keys)", "layer"),
    "value_merge": ("value merge (diagnostic)", "layer"),
    "beta_fit": ("beta fit, ls_clamp (merged keys)", "layer"),
    "beta_fit_nnls": ("beta fit, nnls (merged keys)", "layer"),
    "value_fit": ("C_v fit (merged keys)", "layer"),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--articles", type=int, default=2, help="number of disjoint articles (default 2)")
    p.add_argument("--tokens", type=int, default=1536, help="document tokens per article (default 1536)")
    p.add_argument("--ratio", type=float, default=0.05, help="kept fraction rho of Table 1 (default 0.05)")
    p.add_argument("--lambda-m", type=float, default=0.25, help="key-merging coefficient of Table 1 (default 0.25)")
    p.add_argument("--layers", default="all", help="layer subset: all, 0,5,10, 0-3 or even:K (default all)")
    p.add_argument("--sweep-layers", default="even:6",
                   help="layers of the lambda_m sweep, a subset of --layers: even:K (K evenly spaced studied "
                        "layers), all, or layer ids (default even:6; the sweep dominates the run time)")
    p.add_argument("--seed", type=int, default=0, help="seed of article choice, positions and split (default 0)")
    p.add_argument("--quick", action="store_true", help="2 articles, 6 evenly spaced layers")
    p.add_argument("--source", choices=sorted(SOURCES), default="pg", help="context source (default pg essays)")
    p.add_argument("--data-dir", default=None if SHARED_DATA_DIR is None else str(SHARED_DATA_DIR),
                   required=SHARED_DATA_DIR is None,
                   help="root of the shared data (default in a checkout: ../shared/data beside the repository)")
    p.add_argument("--rows", type=int, default=1024,
                   help="reference rows per KV head in EACH split (fit, held-out); default 1024")
    p.add_argument("--lambdas", default="0,0.2,0.3,0.4,0.5,0.6,0.7,1.0", help="lambda_m sweep (Table 4)")
    p.add_argument("--ratios", default="0.2,0.1,0.05,0.02,0.01", help="rho sweep (Table 4)")
    p.add_argument("--mass-holdout", action="store_true",
                   help="also report E_mass on the held-out rows in the lambda sweep (about +25%% time)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="model dtype (default float32)")
    p.add_argument("--model", default=None, help=model_help())
    p.add_argument("--out", default="leaderboards/studies/fidelity.csv", help="per-cell CSV (+ <stem>_lambda.csv)")
    args = p.parse_args(argv)
    if args.quick:
        args.articles, args.layers = 2, "even:6"
    if args.articles < 1 or args.tokens < 64 or args.rows < 1:
        p.error("--articles >= 1, --tokens >= 64 and --rows >= 1 are required")
    if not 0.0 < args.ratio <= 1.0 or not 0.0 <= args.lambda_m <= 1.0:
        p.error("--ratio must be in (0, 1] and --lambda-m in [0, 1]")
    args.lambda_grid = [float(x) for x in args.lambdas.split(",") if x.strip()]
    args.ratio_grid = [float(x) for x in args.ratios.split(",") if x.strip()]
    return args


# --------------------------------------------------------------------------------------
# data and reference queries
# --------------------------------------------------------------------------------------


@dataclass
class Article:
    index: int
    offset: int  # token offset of the window in the source stream
    text: str


def load_articles(tokenizer, args) -> tuple[list[Article], str]:
    """Disjoint ``--tokens`` windows of the source's token stream, chosen by ``--seed``."""
    from transformers.utils import logging as hf_logging

    text = load_source_text(args.source, args.data_dir)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "sequence longer than max length": we only cut windows
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    finally:
        hf_logging.set_verbosity(verbosity)
    starts = disjoint_windows(len(ids), args.tokens, args.articles, args.seed)
    articles = [Article(i, s, tokenizer.decode(ids[s : s + args.tokens])) for i, s in enumerate(starts)]
    desc = (
        f"{args.source} ({SOURCES[args.source]}; NOT QuALITY): {len(ids):,} tokens cut into "
        f"{len(ids) // args.tokens} disjoint {args.tokens}-token windows; {args.articles} drawn with seed "
        f"{args.seed} at token offsets {starts} (decoded and re-encoded by encode_document)"
    )
    return articles, desc


@dataclass
class References:
    keys: dict[int, torch.Tensor]  # layer -> K [H, T, D]
    values: dict[int, torch.Tensor]  # layer -> V [H, T, D]
    fit: dict[int, torch.Tensor]  # layer -> Q_fit [H, G * n_fit, D]
    holdout: dict[int, torch.Tensor]  # layer -> Q_holdout [H, G * n_holdout, D]
    T: int


def capture_references(model, tokenizer, layout, article: Article, layers, args, timings) -> References:
    """Prefill, repeat-prefill at seeded positions, and the disjoint fit / held-out position split."""
    ids, prefix_len = encode_document(tokenizer, article.text)
    T, G, H = ids.shape[1] - prefix_len, layout.group_size, layout.num_kv_heads
    seed = args.seed * 10007 + article.index
    t0 = time.perf_counter()
    cache = prefill(model, ids, new_cache(model))
    timings["prefill"].append(time.perf_counter() - t0)
    n_pos = min(T, -(-2 * args.rows // G))  # ceil: both splits get >= rows // G positions
    positions = subsample_rows(T, n_pos, seed)
    t0 = time.perf_counter()
    store = repeat_prefill(
        model, tokenizer, cache, ids[:, prefix_len:], framing_for(tokenizer).suffix_ids, layers, positions,
        chunk_size=max(2048, T),
    )
    timings["repeat_prefill"].append(time.perf_counter() - t0)
    _, fit_pos, hold_pos = split_episode(n_pos, (0.0, 0.5, 0.5), seed=seed)
    fit_rows, hold_rows = grouped_rows(fit_pos, n_pos, G), grouped_rows(hold_pos, n_pos, G)
    refs = References({}, {}, {}, {}, T)
    for layer in layers:
        _, q = store.layer(layer)
        Q = group_queries_by_kv_head(q[None].float(), H)
        refs.fit[layer], refs.holdout[layer] = Q[:, fit_rows], Q[:, hold_rows]
        refs.keys[layer] = cache.layers[layer].keys[0, :, prefix_len:].float()
        refs.values[layer] = cache.layers[layer].values[0, :, prefix_len:].float()
    return refs


# --------------------------------------------------------------------------------------
# per-layer experiments (all KV heads at once)
# --------------------------------------------------------------------------------------


def _timed(timings, stage, fn, *a, **kw):
    t0 = time.perf_counter()
    out = fn(*a, **kw)
    timings[stage].append(time.perf_counter() - t0)
    return out


def select_anchors(Qf, K, scaling, ratio):
    """HA (RMS pooling) on the fit rows; uniform per-head budgets t = floor(ratio T)."""
    budgets = per_head_budgets(K.shape[1], ratio, None, 1, K.shape[0])[0]
    return topk_anchors(ha_scores(Qf, K, scaling, pooling="rms"), budgets)


def table1_layer(Qf, Qh, K, V, scaling, args, timings) -> list[dict]:
    """The five constructions on the same anchors; rows of per-head metrics."""
    idx, valid = _timed(timings, "selection", select_anchors, Qf, K, scaling, args.ratio)
    t = idx.shape[1]
    K_S, V_S = gather_slots(K, idx, valid), gather_slots(V, idx, valid)
    C_k, assignment = _timed(timings, "merge", merge_keys, Qf, K, idx, valid, scaling, lambda_m=args.lambda_m)

    def value_merge():
        nu = group_centroids(V, assignment, log_key_mass(Qf, K, scaling), t)
        return interpolate_slots(V_S, nu, args.lambda_m, valid)

    C_v_mrg = _timed(timings, "value_merge", value_merge)
    O = full_attention(Qh, K, V, scaling)
    zero = torch.zeros_like(valid, dtype=K.dtype)
    outputs = [("hard subset", "none", compact_attention(Qh, K_S, zero, V_S, scaling, valid), None)]
    for solver in SOLVERS:
        cfg = FitConfig(mass_solver=solver)
        suffix = "" if solver == "ls_clamp" else "_nnls"
        beta_S, w_S = fit_beta(Qf, K, K_S, scaling, valid, cfg)
        beta_m, w_m = _timed(timings, "beta_fit" + suffix, fit_beta, Qf, K, C_k, scaling, valid, cfg)
        C_v_S = fit_values(Qf, K, V, K_S, beta_S, scaling, valid, cfg)
        if solver == "ls_clamp":
            C_v_m = _timed(timings, "value_fit", fit_values, Qf, K, V, C_k, beta_m, scaling, valid, cfg)
        else:
            C_v_m = fit_values(Qf, K, V, C_k, beta_m, scaling, valid, cfg)
        outputs += [
            ("mass calibration", solver, compact_attention(Qh, K_S, beta_S, V_S, scaling, valid), w_S),
            ("key/value merging", solver, compact_attention(Qh, C_k, beta_m, C_v_mrg, scaling, valid), w_m),
            ("value fitting", solver, compact_attention(Qh, K_S, beta_S, C_v_S, scaling, valid), w_S),
            ("key merging + value fitting", solver, compact_attention(Qh, C_k, beta_m, C_v_m, scaling, valid), w_m),
        ]
    rows = []
    anchors = valid.sum(-1)
    for name, solver, O_hat, w in outputs:
        m = output_fidelity(O_hat, O)
        dead = ((w <= 0) & valid).sum(-1) / anchors if w is not None else torch.zeros(K.shape[0])
        for h in range(K.shape[0]):
            rows.append({
                "kv_head": h, "construction": name, "mass_solver": solver, "anchors": int(anchors[h]),
                "rel_l2": m["rel_l2"][h].item(), "rel_l2_row": m["rel_l2_row"][h].item(),
                "cosine": m["cosine"][h].item(), "dead_frac": float(dead[h]),
            })
    return rows


def lambda_layer(Qf, Qh, K, scaling, args) -> list[dict]:
    """Table 4: E_mass and dead-anchor share for every (rho, lambda_m), ls_clamp mass fit.

    One merge at lambda_m = 1 gives the centroids mu; C_k(lambda) = (1 - lambda) K_S + lambda mu
    equals merge_keys(lambda) exactly (tests/test_reconstruction.py).
    """
    rows = []
    for ratio in args.ratio_grid:
        idx, valid = select_anchors(Qf, K, scaling, ratio)
        mu, _ = merge_keys(Qf, K, idx, valid, scaling, lambda_m=1.0)
        K_S = gather_slots(K, idx, valid)
        for lam in args.lambda_grid:
            C_k = interpolate_slots(K_S, mu, lam, valid)
            _, w = fit_beta(Qf, K, C_k, scaling, valid)
            e_fit, dead = attention_mass_error(Qf, K, C_k, w, scaling, valid)
            e_ho = attention_mass_error(Qh, K, C_k, w, scaling, valid)[0] if args.mass_holdout else None
            for h in range(K.shape[0]):
                rows.append({
                    "kv_head": h, "ratio": ratio, "lambda_m": lam, "anchors": int(valid[h].sum()),
                    "mass_err_fit": e_fit[h].item(), "mass_err_holdout": e_ho[h].item() if e_ho is not None else "",
                    "dead_frac": dead[h].item(),
                })
    return rows


# --------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------


def write_csv(path: Path, rows: list[dict], meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{**r, **meta} for r in rows]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def table1_markdown(rows: list[dict]) -> str:
    by = defaultdict(list)
    for r in rows:
        if r["mass_solver"] in ("none", "ls_clamp"):
            by[r["construction"]].append(r)
    body = []
    for name, (ck, beta, cv, p_l2, p_cos) in CONSTRUCTIONS.items():
        cell = by[name]
        body.append([name, ck, beta, cv, format_pm([r["rel_l2"] for r in cell]),
                     format_pm([r["cosine"] for r in cell]), format_pm([r["rel_l2_row"] for r in cell]),
                     f"{p_l2} / {p_cos}"])
    header = ["Construction", "C_k", "β", "C_v", "Rel. ℓ2 ↓", "Cosine ↑", "per-query rel. ℓ2 ↓",
              "paper (Llama-3.1-8B, QuALITY) ℓ2 / cos"]
    return markdown_table(header, body)


def nnls_markdown(rows: list[dict]) -> str:
    from scipy.stats import wilcoxon

    key = lambda r: (r["article"], r["layer"], r["kv_head"])  # noqa: E731
    table = defaultdict(dict)
    for r in rows:
        table[(r["construction"], r["mass_solver"])][key(r)] = r
    body = []
    for name in list(CONSTRUCTIONS)[1:]:
        ls, nn = table[(name, "ls_clamp")], table[(name, "nnls")]
        cells = sorted(ls)
        diff = [nn[c]["rel_l2"] - ls[c]["rel_l2"] for c in cells]
        nonzero = [d for d in diff if d != 0.0]
        p = wilcoxon(nonzero).pvalue if len(nonzero) >= 10 else float("nan")
        better = sum(d < 0 for d in diff) / len(diff)
        body.append([
            name, format_pm([ls[c]["rel_l2"] for c in cells]), format_pm([nn[c]["rel_l2"] for c in cells]),
            format_pm(diff, 5), f"{100 * better:.1f}%", f"{p:.2g}",
            f"{mean_sd([ls[c]['dead_frac'] for c in cells])[0]:.3f} / {mean_sd([nn[c]['dead_frac'] for c in cells])[0]:.3f}",
        ])
    header = ["Construction", "Rel. ℓ2 ls_clamp", "Rel. ℓ2 nnls", "Δ (nnls − ls_clamp)", "cells nnls better",
              "Wilcoxon p", "w ≤ 0 share ls / nnls"]
    return markdown_table(header, body)


def lambda_markdown(rows: list[dict], field: str, args, digits: int = 3, bold_min: bool = True) -> str:
    cells = defaultdict(list)
    for r in rows:
        cells[(r["lambda_m"], r["ratio"])].append(r[field])
    means = {k: mean_sd(v)[0] for k, v in cells.items()}
    best = {rho: min(round(means[(lam, rho)], digits) for lam in args.lambda_grid) for rho in args.ratio_grid}
    body = []
    for lam in args.lambda_grid:
        row = [f"{lam:.1f}"]
        for rho in args.ratio_grid:
            v = f"{means[(lam, rho)]:.{digits}f}"
            row.append(f"**{v}**" if bold_min and round(means[(lam, rho)], digits) == best[rho] else v)
        body.append(row)
    return markdown_table(["λ_m"] + [f"ρ={rho:g}" for rho in args.ratio_grid], body)


def timing_markdown(timings: dict[str, list[float]]) -> str:
    body = []
    for key, (label, unit) in STAGES.items():
        xs = timings.get(key, [])
        if xs:
            body.append([label, f"per {unit}", len(xs), f"{statistics.median(xs):.3f}", f"{sum(xs):.1f}"])
    return markdown_table(["Stage", "Unit", "Calls", "Median s", "Total s"], body)


def main(argv=None) -> None:
    args = parse_args(argv)
    run = run_meta(argv=None if argv is None else [sys.argv[0], *argv])
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype))
    layout = describe_attention_layout(model)
    layers = parse_layers(args.layers, layout.num_layers)
    sweep_layers = layer_subset(args.sweep_layers, layers)
    full = set(layout.full_attention_layers)
    if any(layer not in full for layer in layers):
        raise SystemExit(f"--layers {args.layers}: only full-attention layers {sorted(full)} can be studied")
    articles, data_desc = load_articles(tokenizer, args)
    scaling = layout.scaling
    with torch.inference_mode():  # warm-up forward (first-call overhead is not a prefill cost)
        prefill(model, torch.tensor([tokenizer.encode("warm up " * 8, add_special_tokens=False)]))

    timings: dict[str, list[float]] = defaultdict(list)
    t1_rows, lam_rows = [], []
    Ts = []
    with torch.inference_mode():
        for art in tqdm(articles, desc="articles", unit="article"):
            refs = capture_references(model, tokenizer, layout, art, layers, args, timings)
            Ts.append(refs.T)
            for layer in tqdm(layers, desc=f"article {art.index} layers", unit="layer", leave=False):
                Qf, Qh, K, V = refs.fit[layer], refs.holdout[layer], refs.keys[layer], refs.values[layer]
                base = {"article": art.index, "offset": art.offset, "doc_tokens": refs.T, "layer": layer,
                        "n_fit": Qf.shape[1], "n_holdout": Qh.shape[1]}
                for r in table1_layer(Qf, Qh, K, V, scaling, args, timings):
                    t1_rows.append({**base, "ratio": args.ratio, "lambda_m": args.lambda_m, **r})
                if layer in sweep_layers:
                    for r in lambda_layer(Qf, Qh, K, scaling, args):
                        lam_rows.append({**base, **r})
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0

    meta = {
        "model": model_id(model), "dtype": args.dtype, "source": args.source, "selector": "HA-rms(fit rows)",
        "seed": args.seed, **run,
    }
    out = Path(args.out)
    lam_out = out.with_name(out.stem + "_lambda" + out.suffix)
    write_csv(out, t1_rows, meta)
    write_csv(lam_out, lam_rows, meta)

    n_cells = len(articles) * len(layers) * layout.num_kv_heads
    n_fit, n_ho = t1_rows[0]["n_fit"], t1_rows[0]["n_holdout"]
    anchors = sorted({r["anchors"] for r in t1_rows})
    print(f"\n## Cache-reconstruction fidelity ({model_id(model)}, {args.dtype})\n")
    print(f"- command: `{run['command']}`")
    print(f"- machine: {run['machine']}, arckv-press {run['package_version']}; wall time {wall:.0f} s, process CPU time {cpu:.0f} s "
          f"(load average at the end {os.getloadavg()[0]:.1f})")
    print(f"- data: {data_desc}; document lengths T = {sorted(set(Ts))} tokens")
    print(f"- layers: {layers} ({len(layers)} of {layout.num_layers}); {layout.num_kv_heads} KV heads, "
          f"G = {layout.group_size} query heads per KV head; {n_cells} article-layer-KV-head cells")
    print(f"- reference queries: repeat-prefill at positions from reference.subsample_rows, split by position "
          f"(reference.split_episode) into DISJOINT fit / held-out halves: {n_fit} fit rows and {n_ho} held-out "
          f"rows per KV head")
    print(f"- anchors: HA selector (RMS pooling) on the fit rows, the same {args.ratio:g} retention anchors "
          f"(t = {anchors} per head) for all constructions; λ_m = {args.lambda_m}; beta, C_v and merge groups "
          f"from the fit rows; metrics on held-out rows; default FitConfig (ls_clamp) unless stated")
    print(f"- CSVs: {out}, {lam_out}\n")
    print(f"### Table 1: held-out reconstruction at ρ = {args.ratio:g} (mean ± SD over {n_cells} cells)\n")
    print(table1_markdown(t1_rows))
    print("\nRel. ℓ2 = ||Ô − O||_F / ||O||_F over the held-out rows of a cell; cosine = mean row cosine. "
          "The key/value-merging row fits β but not C_v (C_v^mrg = (1 − λ_m) V_S + λ_m · mass-weighted value "
          "centroid of each merge group).\n")
    print(f"### Mass solver: ls_clamp (paper) vs nnls, held-out rel. ℓ2 at ρ = {args.ratio:g}\n")
    print(nnls_markdown(t1_rows))
    print("\nΔ < 0 means nnls is better; Wilcoxon signed-rank test over paired cells; "
          "w ≤ 0 share = fraction of anchors whose mass weight is 0 (β at its floor b_min).\n")
    n_sweep = len(articles) * len(sweep_layers) * layout.num_kv_heads
    print(f"### Table 4: relative attention-mass error E_mass = ||Z_c − Z_f|| / ||Z_f||, fit rows (as the paper); "
          f"mean over {n_sweep} cells (layers {sweep_layers}), ls_clamp mass fit\n")
    print(lambda_markdown(lam_rows, "mass_err_fit", args))
    if args.mass_holdout:
        print("\n### E_mass on held-out rows (same compact keys and w)\n")
        print(lambda_markdown(lam_rows, "mass_err_holdout", args))
    print("\n### Share of anchors with w ≤ 0 (β at its floor), ls_clamp\n")
    print(lambda_markdown(lam_rows, "dead_frac", args, bold_min=False))
    print(f"\n### Stage timings ({layout.num_kv_heads} KV heads per layer call; ρ = {args.ratio:g})\n")
    print(timing_markdown(timings))


if __name__ == "__main__":
    main()
