"""One decode step's attention, per layer: the full cache against the ARC-KV compact cache.

Synthetic tensors with the default model's layout (9 query heads, 3 KV heads, head_dim 64) in
bfloat16 (the default model's dtype) and float32. Per batch size B, context length T and kept fraction rho, one decode step of one layer
is timed as the model runs it:

- ``full``: ``DynamicLayer.update`` with the new token (transformers concatenates it to the
  ``[B, Hkv, T + A, D]`` cache) then transformers' ``sdpa_attention_forward`` (torch SDPA with
  ``enable_gqa``), the model's normal path;
- ``compact``: ``CompactLayer.update`` with the new token then
  :func:`arckv_press.attention.compact_attention_forward` (``softmax(q C_k^T + beta) C_v`` over
  the compacted rows, paper Eq. (compact_attention)), the package's path: the compacted block is
  shared by the batch (one matmul per KV head over all queries) and never copied per sequence;
- ``pruned``: the ``full`` path on a plain cache of ``t + A`` rows (what a kvpress pruning press
  at the same kept fraction leaves), so ``compact / pruned`` is the price of the bias at equal size.

``A`` ordinary rows (the framing prefix and the question, zero bias) sit next to the compacted
block in all caches. The compact step is also split into ``inputs`` (``CompactLayer.attention_inputs``
alone: the marked ordinary rows and the padded block) and ``attn`` (the attention function on
prebuilt inputs).

Bytes per layer are what each cache really holds: the full ``DynamicLayer`` (B copies of the
context), the packed ``CompactLayer`` (one compacted block shared by the batch, plus B x A
ordinary rows), kvpress's pruning presses (SnapKV, Expected Attention: ``floor((1 - cr) T)`` rows
per head) and kvpress's masked presses (KVzip, AdaKV-style: they keep all T rows and hide evicted
ones behind a mask, so they hold the full size).

    python scripts/bench_decode.py --quick
    python scripts/bench_decode.py --batch 1 4 16 64 --contexts 1024 4096 16384 32768

Writes ``leaderboards/studies/bench_decode.csv`` (one row per B, T, rho).
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

import torch

from arckv_press.bench import ROOT
from arckv_press.runinfo import append_rows, median_seconds, print_header, run_meta

DEFAULT_OUT = ROOT / "leaderboards" / "studies" / "bench_decode.csv"
FIELDS = [
    "batch", "context", "ratio", "t_max", "appended", "dtype", "full_ms", "compact_ms", "compact_over_full", "pruned_ms", "compact_over_pruned",
    "inputs_ms", "compact_attn_ms", "full_bytes", "compact_bytes", "kvpress_pruned_bytes", "kvpress_masked_bytes", "repeats", "threads", "command", "date", "package_version", "machine",
]


class _Attn(torch.nn.Module):
    """The attributes transformers' attention functions read from the attention module."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True
        self.eval()


def median_ms(fn, reset, repeats: int, warmup: int) -> float:
    """Median wall time of ``fn()`` in ms; ``reset()`` (untimed) restores the state after each call."""
    return 1e3 * median_seconds(fn, repeats, warmup, reset)


def bench_case(B: int, T: int, rho: float, dtype_name: str, args, gen: torch.Generator) -> dict:
    from transformers.cache_utils import DynamicLayer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from arckv_press.attention import compact_attention_forward
    from arckv_press.cache import CompactLayer

    Hq, Hkv, D, A = args.heads, args.kv_heads, args.head_dim, args.appended
    dtype = getattr(torch, dtype_name)
    scaling = D**-0.5
    module = _Attn(Hq // Hkv)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731

    # full cache: B rows of context + A ordinary rows
    full = DynamicLayer()
    full.update(rand(B, Hkv, T + A, D), rand(B, Hkv, T + A, D))
    q, k1, v1 = rand(B, Hq, 1, D), rand(B, Hkv, 1, D), rand(B, Hkv, 1, D)

    def full_step():
        keys, values = full.update(k1, v1)
        return sdpa_attention_forward(module, q, keys, values, None, scaling=scaling)[0]

    full_ms = median_ms(full_step, lambda: full.crop(T + A), args.repeats, args.warmup)

    # a pruned cache of the same size as the compact one (kvpress SnapKV-style), same normal path
    t = max(1, math.floor(rho * T))
    pruned = DynamicLayer()
    pruned.update(rand(B, Hkv, t + A, D), rand(B, Hkv, t + A, D))

    def pruned_step():
        keys, values = pruned.update(k1, v1)
        return sdpa_attention_forward(module, q, keys, values, None, scaling=scaling)[0]

    pruned_ms = median_ms(pruned_step, lambda: pruned.crop(t + A), args.repeats, args.warmup)

    # compact cache: t = floor(rho T) rows per KV head (uniform budgets), beta ~ N(0, 1)
    lengths = torch.full((Hkv,), t, dtype=torch.long)
    layer = CompactLayer(rand(Hkv * t, D), torch.randn(Hkv * t, generator=gen), rand(Hkv * t, D), lengths, T, 0,
                         rand(1, Hkv, A, D), rand(1, Hkv, A, D))
    layer.update(rand(B, Hkv, 1, D), rand(B, Hkv, 1, D))  # first batched step expands the ordinary rows to B
    layer.truncate_appended(A)

    def compact_step():
        keys, values = layer.update(k1, v1)
        return compact_attention_forward(module, q, keys, values, None, scaling=scaling)[0]

    reset = lambda: layer.truncate_appended(A)  # noqa: E731
    compact_ms = median_ms(compact_step, reset, args.repeats, args.warmup)
    layer.update(k1, v1)
    keys, values = layer.attention_inputs()
    inputs_ms = median_ms(layer.attention_inputs, lambda: None, args.repeats, args.warmup)
    attn_ms = median_ms(lambda: compact_attention_forward(module, q, keys, values, None, scaling=scaling),
                        lambda: None, args.repeats, args.warmup)
    reset()

    item = torch.finfo(dtype).bits // 8
    row = 2 * D * item  # key + value bytes of one cache row of one head
    from kvpress.utils import (
        compute_n_kept,  # SnapKV / Expected Attention keep this many rows per head
    )

    pruned_rows = compute_n_kept(T, round(1.0 - rho, 12))
    return {
        "batch": B, "context": T, "ratio": f"{rho:g}", "t_max": layer.t_max, "appended": A, "dtype": dtype_name,
        "full_ms": f"{full_ms:.3f}", "compact_ms": f"{compact_ms:.3f}", "compact_over_full": f"{compact_ms / full_ms:.3f}",
        "pruned_ms": f"{pruned_ms:.3f}", "compact_over_pruned": f"{compact_ms / pruned_ms:.3f}",
        "inputs_ms": f"{inputs_ms:.3f}", "compact_attn_ms": f"{attn_ms:.3f}",
        "full_bytes": full.keys.nbytes + full.values.nbytes,
        "compact_bytes": layer.nbytes(),
        "kvpress_pruned_bytes": B * Hkv * (pruned_rows + A) * row,
        "kvpress_masked_bytes": B * Hkv * (T + A) * row,
        "repeats": args.repeats, "threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", nargs="+", type=int, default=None, help="batch sizes (default 1 4 16 64)")
    p.add_argument("--contexts", nargs="+", type=int, default=None,
                   help="context lengths T (default 1024 2048 4096 8192 16384 32768)")
    p.add_argument("--ratios", nargs="+", type=float, default=[0.2, 0.1], help="kept fractions (default 0.2 0.1)")
    p.add_argument("--heads", type=int, default=9, help="query heads (default 9, SmolLM2-135M)")
    p.add_argument("--kv-heads", type=int, default=3, help="KV heads (default 3)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--appended", type=int, default=48, help="ordinary rows next to the context (prefix + question)")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float16", "float32"],
                   help="cache/query dtypes (default bfloat16, the default model's, and float32)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per measurement, median (default 7)")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up calls per measurement")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="B in {1, 16}, T in {1024, 8192}, 3 repeats")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    quick = args.quick
    args.batch = args.batch or ([1, 16] if quick else [1, 4, 16, 64])
    args.contexts = args.contexts or ([1024, 8192] if quick else [1024, 2048, 4096, 8192, 16384, 32768])
    args.repeats = args.repeats or (3 if quick else 7)
    if args.heads % args.kv_heads:
        p.error("--heads must be a multiple of --kv-heads")
    torch.set_num_threads(args.threads)
    print_header("decode-step attention, full cache vs compact cache (scripts/bench_decode.py)",
                 argv=None if argv is None else [sys.argv[0], *argv])
    print(f"layout: {args.heads} query heads, {args.kv_heads} KV heads, head_dim {args.head_dim}, "
          f"{args.appended} ordinary rows; median of {args.repeats} repeats after {args.warmup} warm-up calls\n")

    meta = run_meta()
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    head = (f"{'dtype':>8} {'B':>3} {'T':>6} {'rho':>5} | {'full ms':>8} {'compact':>8} {'ratio':>6} | {'pruned':>7} {'c/p':>5} | {'inputs':>7} {'attn':>7} "
            f"| {'full MiB':>9} {'compact':>8} {'pruned':>7} {'masked':>7}")
    print(head)
    print("-" * len(head))
    for dtype_name, T, B, rho in itertools.product(args.dtypes, args.contexts, args.batch, args.ratios):
        r = bench_case(B, T, rho, dtype_name, args, gen)
        rows.append({**r, **meta})
        mib = lambda k: r[k] / 2**20  # noqa: E731
        print(f"{dtype_name:>8} {B:>3} {T:>6} {rho:>5g} | {float(r['full_ms']):>8.3f} {float(r['compact_ms']):>8.3f} "
              f"{float(r['compact_over_full']):>6.2f} | {float(r['pruned_ms']):>7.3f} {float(r['compact_over_pruned']):>5.2f} | "
              f"{float(r['inputs_ms']):>7.3f} "
              f"{float(r['compact_attn_ms']):>7.3f} | "
              f"{mib('full_bytes'):>9.3f} {mib('compact_bytes'):>8.3f} "
              f"{mib('kvpress_pruned_bytes'):>7.3f} {mib('kvpress_masked_bytes'):>7.3f}", flush=True)
    append_rows(args.out, rows, FIELDS)
    print(f"\nwrote {len(rows)} rows to {args.out}")
    print("columns: ratio = compact / full time of one decode step of one layer (update + attention); pruned = the "
          "same step on a plain DynamicLayer of t + A rows (a kvpress-pruned cache of the same size), c/p = compact / "
          "pruned, the price of the bias; inputs = CompactLayer.attention_inputs alone; attn = "
          "compact_attention_forward on prebuilt inputs.")
    print("bytes per layer: full = DynamicLayer (B copies of the context); compact = packed CompactLayer (shared "
          "compact block + B x A ordinary rows); pruned = kvpress SnapKV / Expected Attention at the same kept fraction; masked = kvpress KVzip "
          "(mask, not removal): the full size.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
