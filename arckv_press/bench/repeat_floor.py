"""The least time an exact repeat-prefill can take, from one profiled prefill.

A repeat-prefill (the reference pass of paper Sec. 3.1) runs the document's tokens through the model
a second time, in chunks, each chunk after the whole cached context. Its linear work (projections,
MLPs) is the prefill's times ``M / L`` (``M`` tokens repeated, the chunks' prompts included, against
the ``L`` tokens prefilled), and its attention work is the prefill's times the ratio of query-key
pairs, ``sum_k (m_k L + m_k (m_k + 1) / 2) / (L (L + 1) / 2)``. With ``a`` the attention kernel's
share of a prefill's time, an exact repeat-prefill at the prefill's kernel speeds costs at least

    floor = prefill * ((1 - a) * M / L + a * pairs ratio)

which is what :func:`repeat_floor` returns. ``a`` comes from :func:`attention_seconds`, the self time
of PyTorch's attention kernels under :mod:`torch.profiler` (CPU only: on CUDA the profiler's CPU
time of a kernel is its launch, not its run).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

__all__ = ["ATTENTION_KERNELS", "attention_pairs", "attention_seconds", "repeat_floor"]

#: The CPU attention kernels behind ``scaled_dot_product_attention`` (profiler names).
ATTENTION_KERNELS = (
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_attention_math",
)


def attention_pairs(query_lengths: Sequence[int], past: int) -> int:
    """Query-key pairs of causal forwards of ``query_lengths`` tokens, each after ``past`` cached ones."""
    if past < 0 or any(m < 0 for m in query_lengths):
        raise ValueError(f"lengths must be >= 0, got past {past} and queries {list(query_lengths)}")
    return sum(m * past + m * (m + 1) // 2 for m in query_lengths)


def repeat_floor(prefill_seconds: float, attention_share: float, length: int, chunk_lengths: Sequence[int]) -> float:
    """Seconds an exact repeat-prefill needs at least: forwards of ``chunk_lengths`` tokens, each after
    the ``length`` tokens of the prefilled context, at the speeds of a prefill of ``length`` tokens
    that took ``prefill_seconds``, ``attention_share`` of it in the attention kernel (module docstring)."""
    if not 0.0 <= attention_share <= 1.0:
        raise ValueError(f"attention_share must be in [0, 1], got {attention_share}")
    if length < 1 or not chunk_lengths:
        raise ValueError(f"need a context (length {length}) and at least one repeat chunk")
    tokens = sum(chunk_lengths) / length
    pairs = attention_pairs(chunk_lengths, length) / attention_pairs([length], 0)
    return prefill_seconds * ((1.0 - attention_share) * tokens + attention_share * pairs)


def attention_seconds(fn: Callable[[], object]) -> tuple[float, float]:
    """``(attention kernel seconds, wall seconds)`` of one call of ``fn`` under the CPU profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
    kernel = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in ATTENTION_KERNELS) / 1e6
    return kernel, wall
