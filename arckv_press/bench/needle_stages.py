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

    python scripts/needle_stages.py --seed 4 --depth 0.9 --method arckv-ha
    python scripts/needle_stages.py --seed 4 --depth 0.9 --method arckv-ha --layer 8 --option near_rows=True

Prints only; nothing is written.
"""

from __future__ import annotations

import argparse
import copy

import torch

__all__ = ["value_positions", "swap_layers", "layer_sweep", "head_report", "main"]


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
    from arckv_press.api import compact
    from arckv_press.cache import new_cache
    from arckv_press.capture import CapturedQueries, QueryCapture, decoder_layers, encode_document, prefill
    from arckv_press.framing import question_ids
    from arckv_press.generation import answer
    from arckv_press.haystack import article_for_seed, load_articles, make_needle, needle_context
    from arckv_press.models import load_model
    from arckv_press.runinfo import add_option_argument

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=4)
    parser.add_argument("--length", type=int, default=1200)
    parser.add_argument("--depth", type=float, default=0.9)
    parser.add_argument("--method", default="arckv-ha")
    parser.add_argument("--ratio", type=float, default=0.1)
    parser.add_argument("--layer", type=int, default=None, help="also report this layer's heads")
    parser.add_argument("--model", default=None)
    parser.add_argument("--articles", default=None)
    add_option_argument(parser)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    needle = make_needle(args.seed, "pipeline")
    context = needle_context(tok, article_for_seed(load_articles(args.articles), args.seed), args.length, args.depth, needle)
    ids, P = encode_document(tok, context)
    doc = ids[0, P:].tolist()
    positions = value_positions(doc, tok.encode(" " + needle.value, add_special_tokens=False)[-len(needle.value):])
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
        qids = torch.tensor([question_ids(tok, needle.question, needle.prefix() + " " + needle.value)])
        store = CapturedQueries()
        cache = copy.deepcopy(full)
        with torch.inference_mode(), QueryCapture(model, [args.layer], store) as cap:
            cap.rows = torch.arange(qids.shape[1])
            model.model(input_ids=qids, past_key_values=cache,
                        position_ids=torch.arange(ids.shape[1], ids.shape[1] + qids.shape[1])[None])
        n = len(tok.encode(" " + needle.value, add_special_tokens=False))
        Q = torch.cat(store.q[args.layer], 1)[:, -n - 1:]  # the answer prefix's last token and the answer
        K = full.layers[args.layer].keys[0, :, P:]
        V = full.layers[args.layer].values[0, :, P:]
        scaling = float(decoder_layers(model)[args.layer].self_attn.scaling)
        print(f"\nlayer {args.layer}: the answer's queries (one value per token)")
        for row in head_report(compact_cache.layers[args.layer], Q, K, V, scaling, positions):
            print(f"  q head {row['q_head']} (KV head {row['kv_head']}, {row['kept']} kept): needle mass "
                  f"{[round(x, 2) for x in row['needle_mass']]}, rel. error {[round(x, 2) for x in row['rel_error']]}")
    return 0
