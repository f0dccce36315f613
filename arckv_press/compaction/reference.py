"""Reference-query pool bookkeeping (paper Sec. 3.2 "Reference-query pool", App.
"Method Overview and Reference-Query Construction", Sec. 3.5 "Reference-query episodes").

Pure index arithmetic on row counts: deterministic subsampling, mixing of two query sources,
the disjoint score / fit / holdout split used by indexer training, and the GQA row layout
that stacks the query heads of one KV head.

GQA row order. With H_q query heads, H_kv KV heads and G = H_q / H_kv, query head ``a`` reads
KV head ``a // G`` (Hugging Face ``repeat_kv`` convention). Row ``g * n + i`` of KV head ``h``
is query position ``i`` of query head ``h * G + g``: the G heads are stacked head-major,
positions ascending inside each head.
"""

from __future__ import annotations

import math

import torch

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant to decorrelate (seed, epoch) streams


def _check_count(value: int, name: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _generator(seed: int, stream: int = 0) -> torch.Generator:
    _check_count(seed, "seed")
    g = torch.Generator(device="cpu")
    g.manual_seed((seed * _SEED_MIX + stream) % (2**63 - 1))
    return g


def _sample(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """k distinct sorted indices from range(n) (all of them if k >= n)."""
    if k >= n:
        return torch.arange(n, dtype=torch.long)
    return torch.sort(torch.randperm(n, generator=gen)[:k]).values


def subsample_rows(n: int, budget: int, seed: int = 0) -> torch.Tensor:
    """Deterministic sorted subset of ``budget`` rows out of ``n`` (all rows if n <= budget).

    Returns a CPU LongTensor; the same (n, budget, seed) always gives the same rows.
    """
    _check_count(n, "n")
    _check_count(budget, "budget", 1)
    return _sample(n, budget, _generator(seed))


def mix_sources(
    repeat_rows: int,
    context_rows: int,
    context_fraction: float,
    budget: int,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose rows from two query sources (repeat-prefill rows and context-prefill rows).

    The context source gets round_half_up(context_fraction * budget) rows and the repeat
    source the rest; when one source has fewer rows than its share, the shortfall spills
    over to the other (up to its size). If both together have <= ``budget`` rows, all rows
    are taken. Returns (repeat_idx, context_idx), each a sorted CPU LongTensor of row indices
    into its own source; the two draws use independent streams of ``seed``.
    """
    _check_count(repeat_rows, "repeat_rows")
    _check_count(context_rows, "context_rows")
    _check_count(budget, "budget", 1)
    if isinstance(context_fraction, bool) or not isinstance(context_fraction, (int, float)):
        raise TypeError(f"context_fraction must be a float, got {type(context_fraction).__name__}")
    if not (math.isfinite(context_fraction) and 0.0 <= context_fraction <= 1.0):
        raise ValueError(f"context_fraction must be in [0, 1], got {context_fraction}")
    share_ctx = math.floor(context_fraction * budget + 0.5)     # <= budget since fraction <= 1
    n_ctx = min(share_ctx, context_rows)
    n_rep = min(budget - share_ctx, repeat_rows)
    # spill-over: give any unused share to the other source
    n_ctx = min(context_rows, max(n_ctx, budget - n_rep))
    n_rep = min(repeat_rows, max(n_rep, budget - n_ctx))
    rep = _sample(repeat_rows, n_rep, _generator(seed, 1))
    ctx = _sample(context_rows, n_ctx, _generator(seed, 2))
    return rep, ctx


def split_episode(
    n: int,
    fractions: tuple[float, float, float] = (0.5, 0.25, 0.25),
    seed: int = 0,
    epoch: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Disjoint (score, fit, holdout) row subsets of a pool of ``n`` rows (paper Sec. 3.5).

    Sizes are floor(f * n) (+1e-9 against float error); a positive fraction whose floor is 0
    gets 1 row. Fractions must be nonnegative with sum <= 1. The rows are drawn without
    replacement from one permutation that depends only on (seed, epoch), so each epoch
    resamples deterministically. Each subset is returned sorted (CPU LongTensor).
    """
    _check_count(n, "n", 1)
    _check_count(epoch, "epoch")
    if len(fractions) != 3:
        raise ValueError(f"fractions must have 3 entries (score, fit, holdout), got {len(fractions)}")
    fr = [float(f) for f in fractions]
    if any(not math.isfinite(f) or f < 0 for f in fr):
        raise ValueError(f"fractions must be finite and >= 0, got {fractions}")
    if sum(fr) > 1.0 + 1e-9:
        raise ValueError(f"fractions must sum to <= 1, got {fractions} (sum {sum(fr)})")
    sizes = [max(math.floor(f * n + 1e-9), 1 if f > 0 else 0) for f in fr]
    if sum(sizes) > n:
        raise ValueError(f"n={n} rows are too few for fractions {fractions} (need {sizes})")
    perm = torch.randperm(n, generator=_generator(seed, 1000 + epoch))
    parts = torch.split(perm[: sum(sizes)], sizes)
    return tuple(torch.sort(p).values for p in parts)  # type: ignore[return-value]


def group_queries_by_kv_head(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[1, H_q, n, D]`` query states -> ``[H_kv, G * n, D]`` rows per KV head.

    Row ``g * n + i`` of KV head ``h`` is position ``i`` of query head ``h * G + g``
    (module docstring). A view/reshape, so no copy when ``q`` is contiguous.
    """
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.ndim != 4 or q.shape[0] != 1:
        raise ValueError(f"q must have shape [1, H_q, n, D], got {tuple(q.shape)}")
    _check_count(num_kv_heads, "num_kv_heads", 1)
    _, H_q, n, D = q.shape
    if H_q % num_kv_heads != 0:
        raise ValueError(f"H_q={H_q} query heads are not divisible by num_kv_heads={num_kv_heads}")
    G = H_q // num_kv_heads
    return q[0].reshape(num_kv_heads, G * n, D)


def group_activations(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Activations ``[n, d_x]`` (or ``[1, n, d_x]``) -> ``[G * n, d_x]`` aligned with the rows
    of :func:`group_queries_by_kv_head`: row ``g * n + i`` is ``x_i`` for every g (the
    pre-projection activation is shared by all query heads of a position, and by all KV heads).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim == 3:
        if x.shape[0] != 1:
            raise ValueError(f"x must have shape [n, d_x] or [1, n, d_x], got {tuple(x.shape)}")
        x = x[0]
    if x.ndim != 2:
        raise ValueError(f"x must have shape [n, d_x] or [1, n, d_x], got {tuple(x.shape)}")
    _check_count(group_size, "group_size", 1)
    return x.repeat(group_size, 1)


def grouped_row_index(n: int, group_size: int) -> torch.Tensor:
    """Position index ``i`` of every grouped row ``g * n + i``, ``[G * n]`` long (CPU).

    Selecting a subset of positions for all G heads: :func:`grouped_rows`.
    """
    _check_count(n, "n", 1)
    _check_count(group_size, "group_size", 1)
    return torch.arange(n, dtype=torch.long).repeat(group_size)


def grouped_rows(positions: torch.Tensor, n: int, group_size: int) -> torch.Tensor:
    """Grouped row indices ``[G * m]`` of ``positions [m]`` for all G query heads of a KV head.

    Row ``g * n + p`` (module docstring) for g in range(G), head-major, so the selected rows keep
    the GQA layout with ``m`` positions per head.
    """
    _check_count(n, "n", 1)
    _check_count(group_size, "group_size", 1)
    positions = positions.long()
    if positions.ndim != 1:
        raise ValueError(f"positions must be 1-D, got shape {tuple(positions.shape)}")
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= n):
        raise ValueError(f"positions must lie in [0, n={n})")
    offsets = torch.arange(group_size, dtype=torch.long, device=positions.device) * n
    return (offsets[:, None] + positions[None, :]).reshape(-1)


__all__ = [
    "grouped_rows",
    "subsample_rows",
    "mix_sources",
    "split_episode",
    "group_queries_by_kv_head",
    "group_activations",
    "grouped_row_index",
]
