"""Many questions about one compacted context: answered one by one vs decoded together.

The reusable-prefix use case end to end on the model: one context (a Paul Graham essay slice from
``../shared/data/ruler/pg_essays.txt``, or the noise haystack, with one planted needle) is
prefilled once into

- the full cache (``none``), and
- the compact cache of ``--method`` at ``--ratio`` (:func:`arckv_press.api.compact`),

and ``--questions`` needle questions (one about the planted needle, the others about absent ones)
are answered greedily from each cache, first one at a time (:func:`arckv_press.generation.answer`)
then ``--batch-size`` at a time (:func:`arckv_press.generation.answer_many`). The compact cache's
block is shared by the batch; the full cache is repeated for every question of a batch, as any
ordinary transformers cache is. The script checks that the batched answers equal the one-by-one
answers and prints, from the same run, batched / one-by-one throughput per cache and compact /
full time for each mode. Compaction time is reported but not part of the answering times.

    python scripts/bench_questions.py --method arckv-ha --ratio 0.1 --tokens 2000 --questions 16

Writes one row per (cache, mode) to ``leaderboards/studies/bench_questions.csv``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from arckv_press.bench import ROOT
from arckv_press.methods import COMPACTION_METHODS
from arckv_press.runinfo import add_columns, append_rows, print_header, run_meta

DEFAULT_OUT = ROOT / "leaderboards" / "studies" / "bench_questions.csv"
FIELDS = ["method", "ratio", "tokens", "questions", "max_new_tokens", "batch_size", "cache", "mode", "seconds",
          "questions_per_s", "same_as_single", "needle_found", "cache_bytes", "compacted_bytes", "compaction_s", "model",
          "dtype",
          "command", "date", "package_version", "machine"]


def timed_answers(fn) -> tuple[list[str], float]:
    t0 = time.perf_counter()
    answers = fn()
    return answers, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    from arckv_press.models import model_help

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="arckv-ha", choices=COMPACTION_METHODS)
    p.add_argument("--ratio", type=float, default=0.1, help="kept fraction in (0, 1] (default 0.1)")
    p.add_argument("--tokens", type=int, default=2000, help="context length in tokens (default 2000)")
    p.add_argument("--depth", type=float, default=0.5, help="needle depth in [0, 1]")
    p.add_argument("--questions", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help=model_help())
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if not 0.0 < args.ratio <= 1.0:
        p.error(f"--ratio is a kept fraction in (0, 1], got {args.ratio}")
    if args.questions < 2 or args.batch_size < 2:
        p.error("--questions and --batch-size must be >= 2 (a batch of one is the one-by-one mode)")
    if args.threads:
        torch.set_num_threads(args.threads)

    from arckv_press.api import compact
    from arckv_press.attention import compact_attention
    from arckv_press.cache import cache_nbytes, new_cache
    from arckv_press.capture import encode_document
    from arckv_press.generation import answer, answer_many
    from arckv_press.haystack import load_haystack, make_needle, needle_context
    from arckv_press.models import describe_attention_layout, load_model, model_id

    print_header("many questions about one compacted context (scripts/bench_questions.py)", argv=argv)
    meta = run_meta(argv=None if argv is None else [sys.argv[0], *argv])
    model, tok = load_model(args.model, dtype=args.dtype)
    needles = [make_needle(args.seed + i) for i in range(args.questions)]
    context = needle_context(tok, load_haystack(None), args.tokens, args.depth, needles[0])
    questions, prefixes = [n.question for n in needles], [n.prefix() for n in needles]

    with torch.inference_mode():
        ids, _ = encode_document(tok, context)
        full = new_cache(model)
        model.model(input_ids=ids.to(model.device), past_key_values=full)
        t0 = time.perf_counter()
        compacted = compact(model, tok, context, method=args.method, ratio=args.ratio)
        compaction_s = time.perf_counter() - t0
    print(f"context {ids.shape[1]} tokens; {args.method} keep {args.ratio:g} compacted it in {compaction_s:.1f} s; "
          f"{args.questions} questions, {args.max_new_tokens} new tokens each, batches of {args.batch_size}\n")

    rows, seconds = [], {}
    with compact_attention(model):
        for name, cache in (("full", full), (args.method, compacted)):
            single, s1 = timed_answers(lambda: [answer(model, tok, cache, q, args.max_new_tokens, a)
                                                for q, a in zip(questions, prefixes)])
            batched, s2 = timed_answers(lambda: answer_many(model, tok, cache, questions, args.max_new_tokens,
                                                            prefixes, batch_size=args.batch_size))
            same = sum(a == b for a, b in zip(single, batched))
            for mode, answers, s in (("single", single, s1), ("batched", batched, s2)):
                seconds[name, mode] = s
                rows.append({
                    "method": args.method, "ratio": f"{args.ratio:g}", "tokens": ids.shape[1],
                    "questions": args.questions, "max_new_tokens": args.max_new_tokens,
                    "batch_size": 1 if mode == "single" else args.batch_size, "cache": name, "mode": mode,
                    "seconds": f"{s:.3f}", "questions_per_s": f"{args.questions / s:.3f}",
                    "same_as_single": f"{same}/{args.questions}",
                    "needle_found": int(needles[0].value in answers[0]), "cache_bytes": cache_nbytes(cache),
                    "compacted_bytes": cache_nbytes(cache, describe_attention_layout(model).full_attention_layers),
                    "compaction_s": f"{compaction_s:.3f}" if name != "full" else "",
                    "model": model_id(model), "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
                    **meta,
                })
            print(f"{name:<12} one by one {s1:7.2f} s   batched {s2:7.2f} s   batched / one-by-one speed "
                  f"{s1 / s2:5.2f}x   batched answers equal to one-by-one: {same}/{args.questions}   "
                  f"planted needle: {'found' if needles[0].value in single[0] else 'missed'}   "
                  f"{cache_nbytes(cache) / 2**20:.2f} MiB", flush=True)
    add_columns(args.out, FIELDS)  # rows from before compacted_bytes keep it empty
    append_rows(args.out, rows, FIELDS)
    print(f"\ncompact / full answering time: one by one {seconds[args.method, 'single'] / seconds['full', 'single']:.2f}x, "
          f"batched {seconds[args.method, 'batched'] / seconds['full', 'batched']:.2f}x")
    print(f"wrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
