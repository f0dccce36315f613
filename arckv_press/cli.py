"""``arckv`` command line: compact a text once, ask it many questions, or run the demo.

- ``arckv compact FILE --method arckv-ha --ratio 0.1 -o FILE.arckv``
- ``arckv ask FILE.arckv "question" ["question" ...]``
- ``arckv train-indexer [...]`` (same arguments as ``scripts/train_indexer.py``)
- ``arckv demo`` (the README's main job: a needle in a haystack, answered with the full cache and
  with each compaction method, with cache sizes and times)
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import sys
import time
from pathlib import Path

import torch

__all__ = ["main"]

DEMO_METHODS = ("none", "arckv", "arckv-ha", "arckv-vi", "am-omp-fast", "am-ha", "snapkv", "kvzip", "expected_attention")


def _load(args):
    from arckv_press.models import load_model

    return load_model(args.model, dtype=args.dtype)


# argparse types: a bad number is refused with the flag's name before anything is loaded
def positive_int(text: str, least: int = 1) -> int:
    """An integer >= ``least`` (1)."""
    kind = "a positive integer" if least == 1 else f"an integer >= {least}"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {kind}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be {kind} (>= {least}), got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    return positive_int(text, 0)


def kept_fraction(text: str) -> float:
    """The kept fraction rho in (0, 1] (:func:`arckv_press.compaction.checks.check_ratio`)."""
    from arckv_press.compaction.checks import check_ratio

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}") from None
    try:
        return check_ratio(value, "ratio")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def unit_fraction(text: str) -> float:
    """A number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}") from None
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}")
    return value


def check_output_path(path: Path) -> Path:
    """Refuse an output path that cannot be written (before the compaction, whose work would be
    lost): a directory, or a file in a folder that is missing or not writable."""
    if path.is_dir():
        raise ValueError(f"the output {path} is a directory; give a file name such as {path / 'doc.arckv'}")
    folder = path.parent
    if not folder.is_dir():
        raise ValueError(f"the output folder {folder} of {path} does not exist; create it first")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"the output folder {folder} of {path} is not writable")
    return path


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset {err.start})") from None


def cmd_compact(args) -> int:
    from arckv_press.config import CompactionConfig
    from arckv_press.api import compact
    from arckv_press.capture import check_document_text

    # everything that can be checked without the model is checked before it is loaded
    text = check_document_text(_read_text(args.file), f"text of {args.file}")
    out = check_output_path(Path(args.output or f"{args.file}.arckv"))
    options = {k: v for k, v in (("lambda_m", args.lambda_m), ("min_head_fraction", args.min_head_fraction),
                                 ("anchor_search", args.anchor_search), ("tail_rows", args.tail_rows)) if v is not None}
    CompactionConfig(method=args.method, ratio=args.ratio, **options)  # validates the options
    model, tok = _load(args)
    t0 = time.perf_counter()
    with torch.inference_mode():
        cache = compact(model, tok, text, method=args.method, ratio=args.ratio, progress=True, **options)
    seconds = time.perf_counter() - t0
    cache.save(out)
    r = cache.report
    print(
        f"compacted {r.original_length} tokens with {args.method} at ratio {args.ratio} in {seconds:.1f} s: "
        f"{r.compact_bytes / 2**20:.2f} MiB in the compacted layers (full {r.full_bytes / 2**20:.2f} MiB, realised "
        f"ratio {r.realised_ratio:.3f}), whole cache {r.cache_bytes / 2**20:.2f} MiB (full "
        f"{r.full_cache_bytes / 2**20:.2f} MiB) -> {out}"
    )
    return 0


def cmd_ask(args) -> int:
    from arckv_press.attention import enable_compact_attention
    from arckv_press.cache import CompactCache
    from arckv_press.generation import answer_many

    from safetensors import SafetensorError

    if not Path(args.cache).is_file():  # before the model is loaded
        raise FileNotFoundError(errno.ENOENT, "no such compact cache file", args.cache)
    model, tok = _load(args)
    try:
        cache = CompactCache.load(args.cache, model)
    except SafetensorError as err:
        raise ValueError(f"{args.cache} is not a readable compact cache ({err})") from err
    enable_compact_attention(model)
    answers = answer_many(model, tok, cache, args.questions, args.max_new_tokens, args.answer_prefix,
                          batch_size=args.batch_size, progress=len(args.questions) > args.batch_size)
    for q, a in zip(args.questions, answers):
        print(f"Q: {q}\nA: {a}\n")
    return 0


def cmd_demo(args) -> int:
    from kvpress import KVPressTextGenerationPipeline  # noqa: F401  (registers the pipeline)
    from transformers import pipeline

    from arckv_press.cache import cache_nbytes, new_cache
    from arckv_press.framing import pipeline_question, uses_chat_template
    from arckv_press.haystack import RULER_INSTRUCTION, load_haystack, make_needle, needle_context
    from arckv_press.methods import METHODS
    from arckv_press.models import describe_attention_layout, model_id
    from arckv_press.registry import make_press

    model, tok = _load(args)
    layout = describe_attention_layout(model)
    compacted = layout.full_attention_layers  # the layers every method compresses
    needle = make_needle(args.seed)
    context = RULER_INSTRUCTION + needle_context(tok, load_haystack(args.haystack), args.tokens, args.depth, needle)
    n_ctx = len(tok.encode(context, add_special_tokens=False))
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok)
    framing = "chat template" if uses_chat_template(tok) else "completion (Question: ... Answer:)"
    print(f"model: {model_id(model)}, context {n_ctx} tokens, needle at depth {args.depth}: "
          f"{needle.sentence.strip()!r}")
    print(f"question: {needle.question}  [{framing}]")
    if layout.sliding_layers:
        print(f"compacted layers: the {len(compacted)} global layers {list(compacted)}; the "
              f"{len(layout.sliding_layers)} sliding-window layers keep their window of {layout.sliding_window} "
              "(counted in 'cache MiB')")
    print(f"\n{'method':<20}{'kept':>6}{'compacted MiB':>15}{'cache MiB':>11}{'seconds':>9}  answer")
    for name in args.methods:
        ratio = 1.0 if name == "none" else args.ratio
        try:
            ours = name in METHODS and METHODS[name].ours  # our presses show per-layer progress bars
            press = make_press(name, ratio, **({"progress": True} if ours else {}))
        except ValueError as err:  # e.g. no indexer shipped for this model
            print(f"{name:<20}{'-':>6}{'-':>15}{'-':>11}{'-':>9}  skipped: {err}")
            continue
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                cache = new_cache(model)
                out = pipe(context, **pipeline_question(tok, needle.question, needle.prefix()), press=press,
                           max_new_tokens=args.max_new_tokens, cache=cache)
        except ValueError as err:
            print(f"{name:<20}{'-':>6}{'-':>15}{'-':>11}{'-':>9}  skipped: {err}")
            continue
        seconds = time.perf_counter() - t0
        mib, layers_mib = cache_nbytes(cache) / 2**20, cache_nbytes(cache, compacted) / 2**20
        ok = "OK " if needle.value in out["answer"] else "-- "
        print(f"{name:<20}{ratio:>6.2f}{layers_mib:>15.2f}{mib:>11.2f}{seconds:>9.1f}  {ok}{out['answer'].strip()!r}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from arckv_press.config import METHOD_SCHEDULES, MODEL_RATIO_SCHEDULES, RATIO_SCHEDULE, CompactionConfig
    from arckv_press.compaction.layer import ANCHOR_SEARCHES
    from arckv_press.methods import COMPACTION_METHODS
    from arckv_press.models import model_help

    defaults = CompactionConfig()
    parser = argparse.ArgumentParser(prog="arckv", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help=model_help("the embedded SmolLM2-135M-Instruct"))
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                        help="model dtype (default auto: bfloat16 on CUDA, float32 on CPU, where bf16 is often emulated)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("compact", help="prefill and compact a text file, save the compact cache")
    p.add_argument("file")
    p.add_argument("--method", default="arckv", choices=list(COMPACTION_METHODS))
    p.add_argument("--ratio", type=kept_fraction, default=0.1, help="kept fraction rho in (0, 1]")
    def schedule(field: str) -> str:
        """The default of ``field`` by kept fraction, as RATIO_SCHEDULE gives it (the default model's;
        a model with its own schedule, arckv_press.config.MODEL_RATIO_SCHEDULES, and a method with its
        own value, METHOD_SCHEDULES, are named)."""
        values = [getattr(step, field) for step in RATIO_SCHEDULE]
        own = f"; models with their own schedule: {', '.join(MODEL_RATIO_SCHEDULES)}" + "".join(
            f"; {name}: {given[field]}" for name, given in METHOD_SCHEDULES.items() if field in given)
        if len(set(values)) == 1:
            return f"{values[0]} at every kept fraction{own}"
        runs = []  # (value, lowest kept fraction) of each run of steps with the same value, largest first
        for v, step in zip(values, RATIO_SCHEDULE):
            runs = runs[:-1] + [(v, step.lowest)] if runs and runs[-1][0] == v else runs + [(v, step.lowest)]
        return "by kept fraction, " + ", ".join(f"{v} at ratio >= {lowest:g}" if lowest > 0 else f"{v} below"
                                                for v, lowest in runs) + own

    p.add_argument("--lambda-m", type=unit_fraction, default=None,
                   help=f"ARC-KV key-merging coefficient (default: {schedule('lambda_m')})")
    p.add_argument("--anchor-search", default=None, choices=list(ANCHOR_SEARCHES),
                   help=f"ARC-KV: top-t of the anchor scores or Attention Matching's OMP search (default: "
                        f"{schedule('anchor_search')})")
    p.add_argument("--tail-rows", type=non_negative_int, default=None,
                   help="ARC-KV: the document's last tokens repeated once more after it, as reference rows that read the "
                        f"end from nearby (at most a quarter of the document; 0 = none; default: {schedule('tail_rows')})")
    p.add_argument("--min-head-fraction", type=unit_fraction, default=None,
                   help=f"ARC-KV: share of its uniform budget every layer-head keeps (default {defaults.min_head_fraction}; "
                        "0 = fully global, 1 = uniform budgets)")
    p.add_argument("-o", "--output")
    p.set_defaults(func=cmd_compact)

    p = sub.add_parser("ask", help="answer questions from a saved compact cache")
    p.add_argument("cache")
    p.add_argument("questions", nargs="+")
    p.add_argument("--max-new-tokens", type=positive_int, default=48)
    p.add_argument("--answer-prefix", default="")
    p.add_argument("--batch-size", type=positive_int, default=16,
                   help="questions decoded together (they share the compacted block; default 16)")
    p.set_defaults(func=cmd_ask)

    p = sub.add_parser("train-indexer", help="train the value-aware indexer (arguments: see --help of the subcommand)",
                       add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER)

    p = sub.add_parser("demo", help="needle-in-a-haystack with the full cache and each method")
    p.add_argument("--tokens", type=positive_int, default=2000)
    p.add_argument("--depth", type=unit_fraction, default=0.5, help="needle depth in [0, 1] (0 = start)")
    p.add_argument("--ratio", type=kept_fraction, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--haystack", default=None, help="text file (default: ../shared/data/ruler/pg_essays.txt or noise)")
    p.add_argument("--methods", nargs="+", default=list(DEMO_METHODS))
    p.add_argument("--max-new-tokens", type=positive_int, default=12)
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train-indexer"]:  # its own parser (scripts/train_indexer.py's arguments)
        from arckv_press.indexer.driver import main as train_main

        return train_main(argv[1:])
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as stop:  # argparse's usage error (its message is printed) or --help
        return stop.code if isinstance(stop.code, int) else 2
    try:
        return args.func(args)
    except Exception as err:  # noqa: BLE001  (only the kinds below; anything else is a bug: traceback)
        message = _error_message(err)
        if message is None:
            raise
        print(f"arckv: error: {message}", file=sys.stderr)
        return 2


def _error_message(err: Exception) -> str | None:
    """One line for a bad input or file (the package's errors are ``ValueError`` subclasses, a file
    that cannot be read an ``OSError`` or a safetensors error), ``None`` for anything else."""
    from safetensors import SafetensorError

    if isinstance(err, OSError):
        where = f": {err.filename}" if err.filename else ""
        return f"{err.strerror or err}{where}"
    if isinstance(err, SafetensorError):
        return f"not a readable safetensors file ({err})"
    if isinstance(err, ValueError):
        return str(err)
    return None


if __name__ == "__main__":
    sys.exit(main())
