"""The least time an exact repeat-prefill can take, from one profiled prefill.

A repeat-prefill (the reference pass of paper Sec. 3.1) runs the document's tokens through the model
a second time, in chunks, each chunk after the whole cached context. Its linear work (projections,
MLPs) is the prefill's times ``M / L`` (``M`` tokens repeated, the chunks' prompts included, against
the ``L`` tokens prefilled). Its attention work, layer by layer, is the query-key pairs the layer
needs at the prefill's kernel speed per pair computed: a full-attention layer's queries see every
earlier position, ``sum_k (m_k L + m_k (m_k + 1) / 2)`` pairs; a sliding-window layer's (window
``W``) at most ``W`` (:func:`attention_pairs`). The prefill's kernel computed the pairs the layer needs
(the causal triangle, ``L (L + 1) / 2`` pairs, in a full layer) when it ran causal, and the whole
``L x L`` square when it ran with an explicit mask (a sliding-window layer's, in transformers): then the pairs outside the window were
computed too, and the repeat needs fewer per token than the prefill did. With ``a`` the attention
kernel's share of a prefill's time and ``a_l`` layer ``l``'s part of it, an exact repeat-prefill at
the prefill's kernel speeds costs at least

    floor = prefill * ((1 - a) * M / L + a * sum_l a_l * pairs needed_l / pairs computed_l)

which is what :func:`repeat_floor` returns. ``a``, the ``a_l`` and whether each layer's kernel ran
causal come from :func:`attention_calls`: the self time and ``is_causal`` argument of PyTorch's
attention kernels under :mod:`torch.profiler`, one call per layer in layer order (CPU only: on CUDA
the profiler's CPU time of a kernel is its launch, not its run).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

__all__ = ["ATTENTION_KERNELS", "attention_pairs", "attention_calls", "layer_shares", "repeat_floor"]

#: The CPU attention kernels behind ``scaled_dot_product_attention`` (profiler names), each with the
#: index of its ``is_causal`` argument
ATTENTION_KERNELS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": 4,
    "aten::_scaled_dot_product_attention_math": 5,
}


def attention_pairs(query_lengths: Sequence[int], past: int, window: int | None = None) -> int:
    """Query-key pairs of causal forwards of ``query_lengths`` tokens, each after ``past`` cached ones;
    with ``window``, each query sees at most the ``window`` last positions, itself included (a
    sliding-window layer)."""
    if past < 0 or any(m < 0 for m in query_lengths):
        raise ValueError(f"lengths must be >= 0, got past {past} and queries {list(query_lengths)}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")

    def upto(p: int) -> int:  # sum over query positions 1..p of the keys each sees
        if window is None or p <= window:
            return p * (p + 1) // 2
        return window * (window + 1) // 2 + (p - window) * window

    return sum(upto(past + m) - upto(past) for m in query_lengths)


def repeat_floor(prefill_seconds: float, attention_share: float, length: int, chunk_lengths: Sequence[int],
                 windows: Sequence[int | None] | None = None, shares: Sequence[float] | None = None,
                 causal: Sequence[bool] | None = None) -> float:
    """Seconds an exact repeat-prefill needs at least: forwards of ``chunk_lengths`` tokens, each after
    the ``length`` tokens of the prefilled context, at the speeds of a prefill of ``length`` tokens
    that took ``prefill_seconds``, ``attention_share`` of it in the attention kernel (module docstring).
    ``windows``: per layer, its sliding window or ``None`` (full attention; the default: every layer);
    ``shares``: each layer's part of the attention time (default equal parts; they are normalised);
    ``causal``: per layer, whether the prefill's kernel computed only the pairs the layer needs (it ran
    causal; the default) or every pair of the square (it ran with a mask)."""
    if not 0.0 <= attention_share <= 1.0:
        raise ValueError(f"attention_share must be in [0, 1], got {attention_share}")
    if length < 1 or not chunk_lengths:
        raise ValueError(f"need a context (length {length}) and at least one repeat chunk")
    windows = [None] if windows is None else list(windows)
    shares = [1.0] * len(windows) if shares is None else list(shares)
    causal = [True] * len(windows) if causal is None else list(causal)
    if len(shares) != len(windows) or not windows or min(shares) < 0 or sum(shares) <= 0:
        raise ValueError(f"need one non-negative share per layer, got {len(shares)} shares for {len(windows)} layers")
    if len(causal) != len(windows):
        raise ValueError(f"need one causal flag per layer, got {len(causal)} for {len(windows)} layers")
    tokens = sum(chunk_lengths) / length
    pairs = sum(s * attention_pairs(chunk_lengths, length, w) / (attention_pairs([length], 0, w) if c else length ** 2)
                for s, w, c in zip(shares, windows, causal)) / sum(shares)
    return prefill_seconds * ((1.0 - attention_share) * tokens + attention_share * pairs)


def attention_calls(fn: Callable[[], object]) -> tuple[list[float], list[bool], float]:
    """``(seconds of each attention kernel call in the order they ran, whether each ran causal, wall
    seconds)`` of one call of ``fn`` under the CPU profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t0 = time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
    calls = sorted((e.time_range.start, e.self_cpu_time_total, _ran_causal(e)) for e in prof.events()
                   if e.name in ATTENTION_KERNELS)
    return [us / 1e6 for _, us, _ in calls], [c for _, _, c in calls], wall


def _ran_causal(event) -> bool:
    """Whether a profiled attention kernel call ran with ``is_causal=True`` (its recorded arguments)."""
    args = getattr(event, "concrete_inputs", None) or []
    i = ATTENTION_KERNELS[event.name]
    if len(args) <= i or not isinstance(args[i], bool):
        raise RuntimeError(f"the profiler recorded no is_causal argument for {event.name}; cannot tell which "
                           "query-key pairs the prefill's attention computed")
    return args[i]


def layer_shares(calls: Sequence[float], num_layers: int) -> list[float] | None:
    """Each layer's seconds of a one-forward prefill's attention calls (one per layer, in layer order;
    a forward of ``n`` such passes is summed layer by layer), or ``None`` when the calls do not divide
    into ``num_layers``."""
    if not calls or num_layers < 1 or len(calls) % num_layers:
        return None
    return [sum(calls[i::num_layers]) for i in range(num_layers)]
