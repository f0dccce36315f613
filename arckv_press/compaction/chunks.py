"""Chunk-local merging and chunk-separable fits for long contexts.

The paper's KV-based chunking (App. "KV-Based Chunking for Long Contexts") splits the positions
into contiguous chunks for anchor selection only (:func:`~.select.chunked_topk_anchors`). Above the
same length this package also keeps merging and the fits inside each chunk c of positions C_c:

- the anchor search, when it is Attention Matching's OMP (:func:`~.layer.omp_anchors`): chunk c's
  t_c anchors fit chunk c's own mass (below), on every budget row;
- merging (Eqs. (response_profile), (anchor_assignment), (key_merge)): a key of chunk c joins the
  most similar anchor of chunk c, so the profiles hold |C_c| x t_c entries instead of T x t;
- beta (Eq. (mass_fit)) matches chunk c's own mass, Phi_{C_c} w_c ~ sum_{j in C_c} exp(l_ij - z_i)
  with z_i the row maximum over the whole document;
- C_v (Eq. (value_lstsq)) matches each row's full output with the other chunks kept exact: the
  softmax runs over [chunk c's compact slots | the rest of the document], the rest entering with
  its exact log-sum-exp and output (:func:`rest_of_chunk`, :func:`~.fit.fit_values` ``rest``).

Both are exact statistics of the full cache restricted to a chunk: the fits of one chunk are the
full fits with every other chunk's keys and values kept unchanged, and with one chunk they are the
full fits. Each chunk's solves have size t_c, so the work after the reference pass grows linearly
with T at a fixed kept fraction.
"""

from __future__ import annotations

import torch

from .checks import check_positive_int

__all__ = ["chunk_bounds", "chunk_budgets", "rest_of_chunk"]


def chunk_bounds(T: int, chunk_len: int, min_length: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]``: contiguous chunks of ``chunk_len`` positions (the last one shorter)
    when ``T > min_length``, else one chunk ``[(0, T)]``."""
    check_positive_int(T, "T")
    check_positive_int(chunk_len, "chunk_len")
    if isinstance(min_length, bool) or not isinstance(min_length, int) or min_length < 0:
        raise ValueError(f"min_length must be an int >= 0, got {min_length}")
    if T <= min_length:
        return [(0, T)]
    return [(start, min(start + chunk_len, T)) for start in range(0, T, chunk_len)]


def chunk_budgets(budgets: torch.Tensor, chunk: int, T: int) -> torch.Tensor:
    """Per-head anchor counts ``[H]`` of one chunk of ``chunk`` positions out of ``T``, for per-head
    budgets ``budgets [H]`` over the whole document: t_c = clip_[1, chunk](round(t * chunk / T))
    (App. "KV-Based Chunking"; ``round`` half to even, so the chunks' counts may not add up to t)."""
    return torch.round(budgets.double() * chunk / T).long().clamp(1, chunk)


def rest_of_chunk(
    lse: torch.Tensor, out: torch.Tensor, lse_c: torch.Tensor, out_c: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rest of the document seen from each row, outside one chunk: ``(rest_lse [H, n],
    rest_out [H, n, Dv])``, from the row's log-sum-exp and output over the whole document
    (``lse``, ``out``) and over the chunk (``lse_c``, ``out_c``):

        rest_lse = log(e^lse - e^lse_c),   rest_out = (e^lse out - e^lse_c out_c) / e^rest_lse.

    A row whose chunk holds all of its mass (up to rounding) gets ``rest_lse = -inf`` and
    ``rest_out = 0``. Computed in float64, returned in float32 (float64 for float64 inputs)."""
    if lse.shape != lse_c.shape or out.shape != out_c.shape or tuple(out.shape[:2]) != tuple(lse.shape):
        raise ValueError(f"rest_of_chunk: shapes lse {tuple(lse.shape)}, out {tuple(out.shape)}, lse_c "
                         f"{tuple(lse_c.shape)}, out_c {tuple(out_c.shape)} do not match")
    dtype = torch.float64 if torch.float64 in (lse.dtype, out.dtype, lse_c.dtype, out_c.dtype) else torch.float32
    lse, out, lse_c, out_c = lse.double(), out.double(), lse_c.double(), out_c.double()
    share = torch.exp(lse_c - lse)                       # the chunk's share of the row's mass
    empty = share >= 1.0
    rest_share = (1.0 - share).masked_fill(empty, 1.0)
    rest_lse = (lse + torch.log(rest_share)).masked_fill(empty, -torch.inf)
    rest_out = ((out - share[..., None] * out_c) / rest_share[..., None]).masked_fill(empty[..., None], 0.0)
    return rest_lse.to(dtype), rest_out.to(dtype)
