"""bf16 vs float32 speed on this machine: one matmul shaped like the default model's MLP input and
one prefill of the default model, median of repeats, ratio printed.

Why: CPUs without native bf16 (AVX2-only x86, e.g. the AMD EPYC of 2026-11-24) emulate bf16
matmuls, so ``load_model(dtype="auto")`` picks float32 on CPU. Run this to see what your CPU does.

    python scripts/bench_dtype.py
    python scripts/bench_dtype.py --tokens 256 --repeats 3 --threads 2
"""

from __future__ import annotations

import argparse
import sys

import torch

from arckv_press.runinfo import median_seconds, print_header

DTYPES = (torch.float32, torch.bfloat16)


def matmul_seconds(dtype: torch.dtype, m: int, k: int, n: int, repeats: int) -> float:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=g).to(dtype), torch.randn(k, n, generator=g).to(dtype)
    return median_seconds(lambda: a @ b, repeats)


def prefill_seconds(dtype: torch.dtype, tokens: int, repeats: int, model_name: str | None = None) -> float:
    from arckv_press.models import load_model

    model, _ = load_model(model_name, dtype=dtype)
    ids = torch.randint(10, 1000, (1, tokens), generator=torch.Generator().manual_seed(0))

    def run():
        with torch.inference_mode():
            model(ids, use_cache=False)

    return median_seconds(run, repeats)


def main(argv: list[str] | None = None) -> int:
    from arckv_press.models import model_help

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", nargs=3, type=int, default=[2048, 576, 1536], metavar=("M", "K", "N"),
                   help="matmul [M, K] @ [K, N] (default 2048 576 1536: 2K tokens into the default model's MLP)")
    p.add_argument("--tokens", type=int, default=512, help="prefill length on --model (0: skip)")
    p.add_argument("--model", default=None, help=model_help())
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print_header("bf16 vs float32 (scripts/bench_dtype.py)", argv=None if argv is None else [sys.argv[0], *argv])
    rows = [("matmul " + "x".join(map(str, args.shape)), {d: matmul_seconds(d, *args.shape, args.repeats) for d in DTYPES})]
    if args.tokens:
        rows.append((f"prefill {args.tokens} tokens", {d: prefill_seconds(d, args.tokens, args.repeats, args.model) for d in DTYPES}))
    print(f"{'what':<28}{'float32 ms':>12}{'bf16 ms':>12}{'bf16 / float32':>16}")
    for name, sec in rows:
        f32, b16 = sec[torch.float32], sec[torch.bfloat16]
        print(f"{name:<28}{f32 * 1e3:>12.1f}{b16 * 1e3:>12.1f}{b16 / f32:>16.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
