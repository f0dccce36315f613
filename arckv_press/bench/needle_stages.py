"""Where a compacted cache loses a planted needle: layer by layer, then head by head.

For one needle case of ``scripts/needle.py`` (pipeline framing: seed, length, depth), this compacts
the context with a method and compares it with the full cache of the same prefill:

1. **Layers.** The question is answered from caches that are compact in some layers and full in
   the others: every layer compact, each layer alone compact (the layers that break the answer on
   their own), and the layers below / from ``k`` compact.
2. **Heads** of a chosen layer: the question's own queries (teacher-forced with the right answer,
   from the full model) read the needle's tokens with some attention mass per query head; the
   compact layer's output for those queries is compared with the full cache's (relative error of
   the document part), beside each KV head's number of kept entries.

3. **Stages** (``--stages``, over ``--seeds`` x ``--depths``): the same anchors compacted four
   ways, each adding one step of the method (:data:`STAGES`): plain eviction of the anchors (their
   own keys and values, beta = 0), + the mass fit (Eq. (mass_fit)), + the value fit (Eq.
   (value_lstsq)), + key merging (Eq. (key_merge)): the method as configured. Selection does not
   depend on those options, so the four caches keep the same positions (checked). Each row says
   whether the answer is right and how many of the needle's positions the compacted heads kept
   (:func:`needle_kept`), so the step that loses a needle is the first row whose answer is wrong.

    python scripts/needle_stages.py --seed 4 --depth 0.9 --method arckv-ha
    python scripts/needle_stages.py --seed 4 --depth 0.9 --method arckv-ha --layer 8 --option tail_rows=0
    python scripts/needle_stages.py --stages --method arckv --length 1500 --seeds 3 4 5 --depths 0.8 0.9 0.95 \
        --out leaderboards/studies/needle_end_stages.csv
    python scripts/needle_stages.py --stages --only +merge --method arckv --length 1500 --seeds 3 4 5

``--only`` runs some of the stages (``+merge`` alone: the method as configured, the full cache beside it).

``--oracle`` runs the ladder on oracle anchors instead of the method's: each compacted head keeps the
positions the question's own queries read most (:func:`oracle_scores`: teacher-forced with the right
answer on the full cache, each key's largest attention probability over them), top-t under the
global budgets those scores give. No compactor can know these; they bound what selection alone can
win, and show whether the stages after selection keep a needle that is among the anchors. It also
prints each compacted head's ranks of the needle's tokens by the method's own scores and by the oracle's,
and, to see which queries read the needle, by the question's rows alone and the answer's rows alone
(the oracle split in two) and by the repeat-prefill's copy (:func:`copy_queries`): its largest
attention over every copied row, and over the rows that copy the needle itself.

Prints only, except ``--stages --out``, which appends one row per case and stage to a CSV
(resumable: cases already there are skipped).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
from pathlib import Path

import torch

__all__ = ["value_positions", "swap_layers", "layer_sweep", "head_report", "STAGES", "stage_options", "needle_kept",
           "oracle_scores", "score_ranks", "question_queries", "copy_queries", "scores_of_the_pass", "main"]

# One step of the method added per stage, on the same anchors (the options a stage sets over the run's own)
STAGES: tuple[tuple[str, dict], ...] = (
    ("evict", {"lambda_m": 0.0, "fit": {"values": "anchor", "b_min": -1e-6, "b_max": 0.0}}),
    ("+mass", {"lambda_m": 0.0, "fit": {"values": "anchor"}}),
    ("+values", {"lambda_m": 0.0}),
    ("+merge", {}),
)


# The stage ladder's CSV columns before the run metadata (runinfo.run_meta)
LADDER_COLUMNS = ("model", "method", "ratio", "seed", "length", "depth", "stage", "config_id", "answer", "value",
                  "correct", "needle_tokens", "heads_all_kept", "heads_none_kept", "heads", "anchors")


def value_positions(doc_ids: list[int], value_ids: list[int]) -> list[int]:
    """Document positions of the needle value's tokens (the last occurrence), or [] if absent."""
    n = len(value_ids)
    for start in range(len(doc_ids) - n, -1, -1):
        if doc_ids[start:start + n] == value_ids:
            return list(range(start, start + n))
    return []


def swap_layers(compact_cache, full_cache, compact_layers: set[int]):
    """A copy of ``compact_cache`` whose layers outside ``compact_layers`` are the full cache's."""
    cache = copy.deepcopy(compact_cache)
    for i in range(len(cache.layers)):
        if i not in compact_layers:
            cache.layers[i] = copy.deepcopy(full_cache.layers[i])
    return cache


def layer_sweep(ask, n_layers: int, compacted: list[int], step: int = 3) -> dict:
    """``ask(layers) -> answer`` for: every layer compact, each layer alone, the layers below ``k``
    and from ``k`` (every ``step``)."""
    every = set(compacted)
    out = {"all": ask(every), "none": ask(set()), "alone": {}, "below": {}, "from": {}}
    for i in compacted:
        out["alone"][i] = ask({i})
    for k in range(0, n_layers + 1, step):
        out["below"][k] = ask({i for i in every if i < k})
        out["from"][k] = ask({i for i in every if i >= k})
    return out


def stage_options(options: dict, stage: dict) -> dict:
    """The compaction options of one of :data:`STAGES` over a run's ``options``: the stage's values
    win, and its ``fit`` fields update the run's ``fit`` (a dict or a ``FitConfig``)."""
    import dataclasses

    out = dict(options)
    for name, value in stage.items():
        if name == "fit":
            base = out.get("fit") or {}
            base = dataclasses.asdict(base) if dataclasses.is_dataclass(base) else dict(base)
            out["fit"] = {**base, **value}
        else:
            out[name] = value
    return out


def needle_kept(kept_positions: dict[int, torch.Tensor], needle: list[int]) -> dict[int, list[int]]:
    """Per compacted layer, per KV head: how many of the ``needle`` positions are among the head's
    anchors (``CompactCache.kept_positions``, -1 padding)."""
    want = torch.tensor(needle, dtype=torch.long)
    return {i: [int(torch.isin(want, row[row >= 0].cpu()).sum()) for row in pos] for i, pos in kept_positions.items()}


@torch.no_grad()
def oracle_scores(Q: torch.Tensor, K: torch.Tensor, scaling: float) -> torch.Tensor:
    """Oracle anchor scores ``[H, N]``: for each KV head and key of ``K [H, N, D]``, the largest
    attention probability any of the queries ``Q [Hq, n, D]`` gives it (softmax over the N keys at
    ``scaling``; query head ``hq`` reads KV head ``hq // G``, grouped-query attention). With the
    question's own queries these are the positions it reads: a bound no compactor can reach."""
    H, (Hq, n, D) = K.shape[0], Q.shape
    if Hq % H:
        raise ValueError(f"{Hq} query heads do not group over {H} KV heads")
    logits = scaling * Q.float().reshape(H, (Hq // H) * n, D) @ K.float().transpose(-1, -2)
    return torch.softmax(logits, dim=-1).amax(dim=1)


def score_ranks(scores: torch.Tensor, positions: list[int]) -> list[list[int]]:
    """Per head (row of ``scores [H, T]``), the rank of each of ``positions`` (0 = the highest score;
    ties broken by the lower position, as a stable sort does)."""
    order = torch.sort(scores.float(), dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1]).expand_as(order))
    return rank[:, positions].tolist()


@torch.no_grad()
def question_queries(model, tok, full, needle, n_ctx: int, layers: list[int]) -> dict[int, torch.Tensor]:
    """Post-RoPE queries ``[Hq, n, D]`` of ``layers`` for the question, its answer prefix and the right
    answer (teacher-forced on a copy of the ``full`` cache of ``n_ctx`` context tokens)."""
    from arckv_press.capture import CapturedQueries, QueryCapture
    from arckv_press.framing import question_ids

    qids = torch.tensor([question_ids(tok, needle.question, needle.prefix() + " " + needle.value)])
    store = CapturedQueries()
    with torch.inference_mode(), QueryCapture(model, list(layers), store) as cap:
        cap.rows = torch.arange(qids.shape[1])
        model.model(input_ids=qids, past_key_values=copy.deepcopy(full),
                    position_ids=torch.arange(n_ctx, n_ctx + qids.shape[1])[None])
    return {i: torch.cat(store.q[i], 1) for i in layers}


@torch.no_grad()
def copy_queries(model, tok, full, doc_ids: torch.Tensor, layers: list[int]) -> dict[int, torch.Tensor]:
    """Post-RoPE queries ``[Hq, T, D]`` of ``layers`` at every position of the repeat-prefill's copy of
    the document ``doc_ids [1, T]`` (the reference rows, paper Sec. "Reference-query pool"), on the
    ``full`` cache of context + document (restored afterwards)."""
    from arckv_press.capture import framing_for, repeat_prefill

    store = repeat_prefill(model, tok, full, doc_ids, framing_for(tok).suffix_ids, list(layers),
                           torch.arange(doc_ids.shape[-1]))
    return {i: store.layer(i)[1] for i in layers}


@contextlib.contextmanager
def scores_of_the_pass(replace: dict[int, torch.Tensor] | None = None, seen: dict | None = None):
    """Diagnostics only: while active, the anchor scores :func:`arckv_press.api.compact` selects by
    (:func:`arckv_press.api.selection_scores`: HA / VI pooled by the reference pass, or the learned
    indexer's) for layer ``i`` are replaced by ``replace[i]`` (``[H, T]``; its own when ``None``), and
    ``seen[i]`` receives the method's own. Allocation and the top-t then run on them, the rest of the
    method unchanged."""
    from unittest import mock

    import arckv_press.api as api

    own_scores = api.selection_scores

    def swap(*args, **kwargs):
        scores = own_scores(*args, **kwargs)
        if seen is not None:
            seen.update(scores)
        if replace is None:
            return scores
        for i, mine in scores.items():
            if tuple(replace[i].shape) != tuple(mine.shape):
                raise ValueError(f"layer {i}: scores of shape {tuple(replace[i].shape)}, the method's are "
                                 f"{tuple(mine.shape)}")
        return {i: replace[i].to(dtype=mine.dtype, device=mine.device) for i, mine in scores.items()}

    with mock.patch.object(api, "selection_scores", swap):
        yield


@torch.no_grad()
def head_report(layer, Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, scaling: float, needle: list[int]) -> list[dict]:
    """Per query head: attention mass of queries ``Q [Hq, n, D]`` on the ``needle`` positions of the
    full document keys ``K, V [H, T, D]``, and the relative error of the compact ``layer``'s
    document output for them (softmax over ``C_k`` with ``beta``, values ``C_v``)."""
    ck, beta, cv = layer.padded()
    G = Q.shape[0] // K.shape[0]
    rows = []
    for hq in range(Q.shape[0]):
        h = hq // G
        q = Q[hq].float()
        p = torch.softmax(scaling * q @ K[h].float().T, -1)
        pc = torch.softmax(scaling * q @ ck[h].float().T + beta[h].float(), -1)
        full, comp = p @ V[h].float(), pc @ cv[h].float()
        err = (comp - full).norm(dim=-1) / full.norm(dim=-1).clamp_min(1e-12)
        rows.append({"q_head": hq, "kv_head": h, "kept": int(layer.lengths[h]),
                     "needle_mass": p[:, needle].sum(-1).tolist(), "rel_error": err.tolist()})
    return rows


def main(argv: list[str] | None = None) -> int:
    from arckv_press.models import load_model
    from arckv_press.runinfo import add_option_argument

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=4)
    parser.add_argument("--length", type=int, default=1200)
    parser.add_argument("--depth", type=float, default=0.9)
    parser.add_argument("--method", default="arckv-ha")
    parser.add_argument("--ratio", type=float, default=0.1)
    parser.add_argument("--layer", type=int, default=None, help="also report this layer's heads")
    parser.add_argument("--stages", action="store_true", help="the stage ladder (STAGES) instead of the layer sweep")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="--stages: cases (default --seed)")
    parser.add_argument("--depths", type=float, nargs="+", default=None, help="--stages: depths (default --depth)")
    parser.add_argument("--out", type=Path, default=None, help="--stages: append rows to this CSV")
    parser.add_argument("--only", nargs="+", choices=[name for name, _ in STAGES], default=None,
                        help="--stages: run only these stages (besides the full cache); '+merge' is the method as "
                             "configured")
    parser.add_argument("--oracle", action="store_true",
                        help="--stages: oracle anchors (the question's own attention) instead of the method's")
    parser.add_argument("--model", default=None)
    parser.add_argument("--articles", default=None)
    add_option_argument(parser)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.out is not None and not args.stages:
        parser.error("--out writes the rows of --stages")
    if args.oracle and not args.stages:
        parser.error("--oracle runs the stage ladder: add --stages")
    model, tok = load_model(args.model)
    if args.stages:
        return _stage_ladder(model, tok, args)
    return _layer_sweep(model, tok, args)


def _case(tok, args, seed: int, depth: float):
    """The needle case of ``scripts/needle.py``'s pipeline framing: needle, context, ids, prefix
    length and the needle value's document positions."""
    from arckv_press.capture import encode_document
    from arckv_press.haystack import article_for_seed, load_articles, make_needle, needle_context

    needle = make_needle(seed, "pipeline")
    context = needle_context(tok, article_for_seed(load_articles(args.articles), seed), args.length, depth, needle)
    ids, P = encode_document(tok, context)
    doc = ids[0, P:].tolist()
    positions = value_positions(doc, tok.encode(" " + needle.value, add_special_tokens=False)[-len(needle.value):])
    return needle, context, ids, P, positions


def _stage_ladder(model, tok, args) -> int:
    from tqdm import tqdm

    from arckv_press.api import compact
    from arckv_press.cache import new_cache
    from arckv_press.capture import prefill, softmax_scale
    from arckv_press.config import CompactionConfig, config_id
    from arckv_press.generation import answer
    from arckv_press.models import describe_attention_layout, model_id
    from arckv_press.runinfo import add_columns, append_rows, read_rows, run_meta

    mid = model_id(model)
    anchors_of = "oracle" if args.oracle else "method"
    meta = run_meta()
    if args.out is not None:
        add_columns(args.out, [*LADDER_COLUMNS, *meta], {"anchors": "method"})  # files from before the column
    done = {(r["model"], r["seed"], r["length"], r["depth"], r["stage"], r["config_id"],
             "" if r["stage"] == "full" else r["anchors"]) for r in read_rows(args.out)} if args.out is not None else set()
    layers = list(describe_attention_layout(model).full_attention_layers)
    cases = [(seed, depth) for seed in (args.seeds or [args.seed]) for depth in (args.depths or [args.depth])]
    print(f"{args.method}, keep {args.ratio:g}, {args.length} tokens, options {args.options}, {anchors_of}'s anchors")
    stages = [(name, stage) for name, stage in STAGES if args.only is None or name in args.only]
    print(f"{'seed':>4} {'depth':>5}  " + "  ".join(f"{name:>14}" for name in ("full", *dict(stages))))
    for seed, depth in tqdm(cases, desc="cases", disable=len(cases) < 2):
        needle, context, ids, P, positions = _case(tok, args, seed, depth)
        oracle, own, ranks, full = None, {}, [], None
        if args.oracle:  # its full cache also answers the "full" row (question_queries reads a copy)
            with torch.inference_mode():
                full = prefill(model, ids, new_cache(model))
            Q = question_queries(model, tok, full, needle, ids.shape[1], layers)
            oracle = {i: oracle_scores(Q[i], full.layers[i].keys[0], softmax_scale(model, i))[:, P:] for i in layers}
            readers = _reader_ranks(model, tok, full, needle, ids, P, positions, layers, Q)
        cells, rows, anchors = [], [], None
        for name, stage in (("full", None), *stages):
            options = stage_options(args.options, stage or {})
            if args.oracle and stage is not None:
                options["anchor_search"] = "scores"  # the top-t of the oracle's scores
            cid = "full" if stage is None else config_id(CompactionConfig(
                method=args.method, ratio=args.ratio, **{k: v for k, v in options.items() if k != "indexer"}).for_model(mid))
            key = (mid, str(seed), str(args.length), str(depth), name, cid, "" if stage is None else anchors_of)
            if key in done:
                cells.append(f"{'(done)':>14}")
                continue
            with torch.inference_mode():
                if stage is None:
                    cc, full = (full if full is not None else prefill(model, ids, new_cache(model))), None
                else:
                    with scores_of_the_pass(oracle, own):
                        cc = compact(model, tok, context, method=args.method, ratio=args.ratio, **options)
                text = answer(model, tok, cc, needle.question, 12, needle.prefix(), context_length=ids.shape[1]).strip()
            found = needle.value in text
            if stage is None:
                cells.append(f"{('OK ' if found else '-- ') + repr(text)[:11]:>14}")
                rows.append({"model": mid, "method": "none", "ratio": 1.0, "seed": seed, "length": args.length,
                             "depth": depth, "stage": name, "config_id": cid, "answer": text, "value": needle.value,
                             "correct": int(found), "needle_tokens": len(positions), "heads_all_kept": "",
                             "heads_none_kept": "", "heads": "", "anchors": "", **meta})
                continue
            if anchors is None:
                anchors = cc.kept_positions
                ranks = [f"layer {i}: kept {[int((r >= 0).sum()) for r in cc.kept_positions[i]]}, needle ranks by "
                         f"the method's scores {score_ranks(own[i], positions)}"
                         + (f", by the oracle's {score_ranks(oracle[i], positions)}; {readers[i]}" if oracle else "")
                         for i in layers if own.get(i) is not None]
            elif any(not torch.equal(anchors[i], cc.kept_positions[i]) for i in anchors):
                raise RuntimeError(f"stage {name!r} kept other positions than stage {stages[0][0]!r}: the stages "
                                   "must differ only after selection")
            kept = needle_kept(cc.kept_positions, positions)
            heads = [n for per_layer in kept.values() for n in per_layer]
            cells.append(f"{('OK ' if found else '-- ') + repr(text)[:11]:>14}")
            rows.append({"model": mid, "method": args.method, "ratio": args.ratio, "seed": seed, "length": args.length,
                         "depth": depth, "stage": name, "config_id": cid, "answer": text, "value": needle.value,
                         "correct": int(found), "needle_tokens": len(positions),
                         "heads_all_kept": sum(n == len(positions) for n in heads),
                         "heads_none_kept": sum(n == 0 for n in heads), "heads": len(heads), "anchors": anchors_of,
                         **meta})
        print(f"{seed:>4} {depth:>5}  " + "  ".join(cells))
        for line in ranks:
            print(f"            {line}")
        if args.out is not None and rows:
            append_rows(args.out, rows, list(rows[0]))
    return 0


def _reader_ranks(model, tok, full, needle, ids, P: int, positions: list[int], layers, Q) -> dict[int, str]:
    """Per layer, the needle's ranks by the oracle's two parts (the question's rows, the answer's rows:
    ``Q`` of :func:`question_queries`) and by the copy's rows (:func:`copy_queries`): all of them, and
    those that copy the needle (from three positions before its first token to its last)."""
    from arckv_press.capture import softmax_scale
    from arckv_press.framing import question_ids

    n_question = len(question_ids(tok, needle.question, needle.prefix()))
    with torch.inference_mode():
        C = copy_queries(model, tok, full, ids[:, P:], layers)
    at = slice(max(0, positions[0] - 3), positions[-1] + 1)
    out = {}
    for i in layers:
        K, s = full.layers[i].keys[0], softmax_scale(model, i)
        ranks = {name: score_ranks(oracle_scores(q, K, s)[:, P:], positions) for name, q in (
            ("question's rows", Q[i][:, :n_question]), ("answer's rows", Q[i][:, n_question:]),
            ("copy's rows", C[i]), ("copy's rows at the needle", C[i][:, at]))}
        out[i] = ", ".join(f"by the {name} {r}" for name, r in ranks.items())
    return out


def _layer_sweep(model, tok, args) -> int:
    from arckv_press.api import compact
    from arckv_press.cache import new_cache
    from arckv_press.capture import prefill, softmax_scale
    from arckv_press.generation import answer

    needle, context, ids, P, positions = _case(tok, args, args.seed, args.depth)
    doc = ids[0, P:].tolist()
    with torch.inference_mode():
        compact_cache = compact(model, tok, context, method=args.method, ratio=args.ratio, **args.options)
        full = prefill(model, ids, new_cache(model))
    compacted = [i for i, layer in enumerate(compact_cache.layers) if hasattr(layer, "padded")]

    def ask(layers):
        with torch.inference_mode():
            return answer(model, tok, swap_layers(compact_cache, full, layers), needle.question, 12, needle.prefix(),
                          context_length=ids.shape[1]).strip()

    print(f"needle {needle.value!r} at document positions {positions} of {len(doc)}; method {args.method}, "
          f"keep {args.ratio:g}, options {args.options}")
    sweep = layer_sweep(ask, len(compact_cache.layers), compacted)
    mark = lambda a: "OK" if needle.value in a else "--"  # noqa: E731
    print(f"every layer compact: {mark(sweep['all'])} {sweep['all']!r}; full cache: {mark(sweep['none'])} {sweep['none']!r}")
    alone = [i for i, a in sweep["alone"].items() if needle.value not in a]
    print(f"layers that lose it alone: {alone or 'none'}")
    for name in ("below", "from"):
        print(f"layers {'<' if name == 'below' else '>='} k compact: "
              + "  ".join(f"{k}:{mark(a)}" for k, a in sweep[name].items()))
    if args.layer is not None:
        n = len(tok.encode(" " + needle.value, add_special_tokens=False))
        Q = question_queries(model, tok, full, needle, ids.shape[1], [args.layer])[args.layer][:, -n - 1:]
        # the answer prefix's last token and the answer
        K = full.layers[args.layer].keys[0, :, P:]
        V = full.layers[args.layer].values[0, :, P:]
        scaling = softmax_scale(model, args.layer)
        print(f"\nlayer {args.layer}: the answer's queries (one value per token)")
        for row in head_report(compact_cache.layers[args.layer], Q, K, V, scaling, positions):
            print(f"  q head {row['q_head']} (KV head {row['kv_head']}, {row['kept']} kept): needle mass "
                  f"{[round(x, 2) for x in row['needle_mass']]}, rel. error {[round(x, 2) for x in row['rel_error']]}")
    return 0
