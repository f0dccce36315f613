"""Statistics of the reference pass: what selection, witnesses and the fits need, gathered in the
same sweep over the document logits that the repeat-prefill's own attention computes.

For a reference query q_i (one row of a KV head's pool, GQA layout: row ``g * N + p`` is query head
``g`` of the group at captured position ``p``) and the document keys k_j of that KV head, with
l_ij = scaling q_i . k_j and p_ij = softmax_j(l_ij) over the document only:

per key j (``[H, T]``)
  - ``scores``: the anchor scores of paper Eq. (background_value_selectors) pooled over rows
    (Eq. (indexer_pooling)): HA pools p_ij, VI pools the normalised influence
    D_ij / sqrt(||O_i||^2 + eps) (:func:`~arckv_press.compaction.select.value_influence`);
  - ``witness_logp`` / ``witness_row``: max_i log p_ij and the row attaining it, ties to the lowest
    row (the anchor's witness, :mod:`.witness`);
per row i (``[H, G * N]``)
  - ``row_max`` z_i = max_j l_ij and ``row_lse`` log sum_j exp(l_ij): the stabilised full-cache
    mass Phi_K 1 = exp(lse_i - z_i) of Eq. (mass_fit);
  - ``row_out`` O_i = sum_j p_ij v_j: the full-cache output Y of Eq. (value_lstsq).

:func:`split_attention` is the attention of one forward whose keys are ``[prefix | document |
appended]``: it computes the document part and the rest separately and combines them by their
log-sum-exp, which is exactly softmax over all visible keys, and returns the document part for
:meth:`ReferenceStats.update`. So the repeat-prefill yields the statistics with no second pass over
the logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .checks import check_positive_int
from .select import POOLINGS, RowPool, value_influence

__all__ = ["DocBlock", "ReferenceStats", "causal_part", "split_attention", "STAT_SELECTORS"]

STAT_SELECTORS = ("ha", "vi", "none")


@dataclass
class DocBlock:
    """The document part of one block of query rows, ``[H, G, b, ...]`` float32: ``logits`` l (scaled;
    ``None`` unless asked for), ``row_max`` z = max_j l, ``row_sum`` sum_j exp(l - z), ``probs`` p
    (softmax over the document) and ``out`` the document-only output sum_j p_j v_j."""

    logits: torch.Tensor | None
    row_max: torch.Tensor
    row_sum: torch.Tensor
    probs: torch.Tensor
    out: torch.Tensor


def _combine(parts):
    """Softmax attention over several key parts from each part's ``(max, sum, sum_j exp(l_j - max) v_j)``."""
    m = parts[0][0]
    for part in parts[1:]:
        m = torch.maximum(m, part[0])
    num = den = 0.0
    for m_p, s_p, o_p in parts:
        w = torch.exp(m_p - m) * (s_p > 0)
        num = num + o_p * w[..., None]
        den = den + s_p * w
    return num / den[..., None]


def _buffer(flat: torch.Tensor, *shape: int) -> torch.Tensor:
    """A contiguous ``shape`` view of the front of a flat scratch buffer (no new allocation)."""
    return flat[: math.prod(shape)].view(*shape)


def _softmax_part(logits: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor | None = None):
    """``(max, sum, probs, probs @ v)`` of one key part; ``logits`` is overwritten by the probabilities
    (one fused softmax pass; the sum of exponentials is 1 / max prob). True in ``hidden`` = masked."""
    if hidden is not None:
        logits.masked_fill_(hidden, -math.inf)
    m = logits.amax(-1)
    probs = torch.ops.aten._softmax.out(logits, -1, False, out=logits)
    return m, 1.0 / probs.amax(-1), probs, probs @ values


def causal_part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lse, out)`` of causal softmax attention of ``c`` new tokens over themselves: ``q [H, G, c, D]``,
    ``k, v [H, c, D]`` (query head ``h * G + g`` reads KV head ``h``); ``lse [H, G, c]`` and
    ``out [H, G, c, Dv]`` float32. On the CPU this is the fused flash kernel behind
    ``scaled_dot_product_attention`` (it returns the log-sum-exp); elsewhere ``None`` is returned
    and :func:`split_attention` computes the part blockwise."""
    if q.device.type != "cpu":
        return None
    H, G, c, D = q.shape
    kq = k.float().repeat_interleave(G, dim=0)[None]                      # [1, H*G, c, D]
    vq = v.float().repeat_interleave(G, dim=0)[None]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.float().reshape(1, H * G, c, D), kq, vq, 0.0, True, scale=scaling)
    return lse.view(H, G, c), out.view(H, G, c, -1)


def split_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc: tuple[int, int],
    scaling: float,
    first_row: int = 0,
    block: int = 64,
    on_block=None,
    keep_logits: bool = False,
    new_part: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Softmax attention of rows appended after a document, split into parts and combined exactly.

    ``k, v [H, L, D]`` are ``[prefix | document | new]`` with the document at ``doc = (lo, hi)`` and
    ``L - hi`` new tokens; ``q [H, G, c, D]`` (query head ``h * G + g``) are new tokens
    ``first_row .. first_row + c - 1`` (with no new keys, ``L == hi``, rows that see only the prefix
    and the document). Prefix and document keys are visible to every row; new key
    ``r'`` to row ``r`` iff ``r' <= r`` (causal; only that triangle is computed). Rows go ``block``
    positions at a time; each part's softmax gives its row maximum, sum of exponentials and output,
    and the parts are combined by their maxima, which is exactly softmax over all visible keys.
    ``on_block(start, DocBlock)`` receives each block's document part (``start`` relative to ``q``;
    the logits only with ``keep_logits``); its probabilities live in a scratch buffer that the next
    block overwrites. ``new_part = (lse, out)`` ``[H, G, c]`` / ``[H, G, c, Dv]``: the causal part over
    the new keys computed beforehand (:func:`causal_part`); ``None`` computes it blockwise here.
    Returns ``[H, G, c, Dv]`` float32.
    """
    lo, hi = doc
    H, G, c, D = q.shape
    n_new = k.shape[1] - hi
    if n_new and first_row + c > n_new:
        raise ValueError(f"rows {first_row}..{first_row + c - 1} are not among the {n_new} new tokens")
    kf, vf = k.float(), v.float()
    k_doc, v_doc = kf[:, lo:hi].transpose(1, 2), vf[:, lo:hi]
    k_pre, v_pre = kf[:, :lo].transpose(1, 2), vf[:, :lo]
    k_new, v_new = kf[:, hi:].transpose(1, 2), vf[:, hi:]
    qs = q.float() * scaling
    out = torch.empty(H, G, c, v.shape[-1], dtype=torch.float32, device=q.device)
    rows = G * min(block, c)
    scratch_doc = torch.empty(H * rows * (hi - lo), dtype=torch.float32, device=q.device)
    scratch_new = torch.empty(0 if new_part is not None else H * rows * (first_row + c), dtype=torch.float32,
                              device=q.device)
    for a in range(0, c, block):
        b = min(a + block, c)
        n = b - a
        qb = qs[:, :, a:b].reshape(H, G * n, D)
        l_doc = torch.bmm(qb, k_doc, out=_buffer(scratch_doc, H, G * n, hi - lo))
        logits = l_doc.clone().view(H, G, n, -1) if keep_logits else None
        m_d, s_d, p_d, o_d = _softmax_part(l_doc, v_doc)
        parts = [(m_d, s_d, o_d * s_d[..., None])]
        if lo:
            m_p, s_p, _, o_p = _softmax_part(qb @ k_pre, v_pre)
            parts.append((m_p, s_p, o_p * s_p[..., None]))
        if not n_new:                                                   # no new keys: prefix + document only
            pass
        elif new_part is not None:
            lse_n = new_part[0][:, :, a:b].reshape(H, G * n)
            parts.append((lse_n, torch.ones_like(lse_n), new_part[1][:, :, a:b].reshape(H, G * n, -1).float()))
        else:
            end = first_row + b                                         # new keys visible to this block
            l_new = torch.bmm(qb, k_new[:, :, :end], out=_buffer(scratch_new, H, G * n, end))
            r = torch.arange(first_row + a, first_row + b, device=q.device).repeat(G)
            m_n, s_n, _, o_n = _softmax_part(l_new, v_new[:, :end], torch.arange(end, device=q.device) > r[:, None])
            parts.append((m_n, s_n, o_n * s_n[..., None]))
        out[:, :, a:b] = _combine(parts).view(H, G, n, -1)
        if on_block is not None:
            on_block(a, DocBlock(logits, m_d.view(H, G, n), s_d.view(H, G, n), p_d.view(H, G, n, -1),
                                 o_d.view(H, G, n, -1)))
    return out


@dataclass
class ReferenceStats:
    """Accumulates the statistics of one layer's reference rows (module docstring), block by block.

    ``H`` KV heads, ``G`` query heads per KV head, ``N`` captured positions, ``T`` document keys,
    ``Dv`` value width. ``selector`` ``ha`` or ``vi`` fixes what ``scores`` pools (``pooling`` as in
    :class:`~arckv_press.compaction.select.RowPool`; ``none``: no scores, when another scorer, the learned
    indexer, picks the anchors). Blocks arrive in increasing position order and
    cover every position once (:meth:`result` checks).

    The witness search keeps, per key, the largest probability any row gave it and the first
    position of the block of at most ``block`` positions that holds that row (``witness_pos``;
    ties: the earlier block); :func:`~arckv_press.compaction.witness.block_witnesses` then finds
    the row inside that block for the anchors only. A reduction over rows without indices costs a
    quarter of one with them, and only anchors need their row.
    """

    H: int
    G: int
    N: int
    T: int
    Dv: int
    selector: str = "ha"
    pooling: str = "rms"
    device: torch.device | str = "cpu"
    eps: float = 1e-6
    block: int = 32  # rows per block: keeps the [H, G * block, T] probabilities small enough for the caches
    pool: RowPool = field(init=False)

    def __post_init__(self) -> None:
        if self.selector not in STAT_SELECTORS:
            raise ValueError(f"selector must be one of {STAT_SELECTORS}, got {self.selector!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        check_positive_int(self.block, "block")
        H, G, N, T = self.H, self.G, self.N, self.T
        self.pool = RowPool(self.pooling)
        self.witness_p = torch.full((H, T), -1.0, device=self.device)
        self.witness_pos = torch.zeros(H, T, dtype=torch.long, device=self.device)
        self.row_max = torch.zeros(H, G, N, device=self.device)
        self.row_lse = torch.zeros(H, G, N, device=self.device)
        self.row_out = torch.zeros(H, G, N, self.Dv, device=self.device)
        self.next_pos = 0

    @property
    def needs_logits(self) -> bool:
        return self.selector == "vi"

    def update(self, pos: int, blk: DocBlock, V: torch.Tensor | None = None) -> None:
        """Add the rows of positions ``pos .. pos + b - 1`` (``blk`` from :func:`split_attention`,
        with its logits when :attr:`needs_logits`; ``V [H, T, Dv]`` the document values, for VI).
        ``blk.probs`` is overwritten."""
        H, G, b, T = blk.probs.shape
        if (H, G, T) != (self.H, self.G, self.T) or pos != self.next_pos or pos + b > self.N or b > self.block:
            raise ValueError(f"block {tuple(blk.probs.shape)} at position {pos} does not fit stats [H={self.H}, "
                             f"G={self.G}, N={self.N}, T={self.T}, block={self.block}] after position {self.next_pos}")
        self.next_pos = pos + b
        self.row_max[:, :, pos:pos + b] = blk.row_max
        self.row_lse[:, :, pos:pos + b] = blk.row_max + torch.log(blk.row_sum)
        self.row_out[:, :, pos:pos + b] = blk.out
        p = blk.probs.view(H, G * b, T)
        top = p.amax(dim=1)
        if self.selector == "ha":
            self.pool.update(p, inplace=True)                                    # consumes the probabilities
        elif self.selector == "vi":
            if V is None or blk.logits is None:
                raise ValueError("the VI selector needs the block's logits and the document values V")
            Vf = V.float()
            self.pool.update(value_influence(blk.logits.reshape(H, G * b, T), Vf, self.eps,
                                             Vf - Vf.mean(dim=1, keepdim=True)))
        better = top > self.witness_p                                            # strict: earlier block keeps ties
        self.witness_p = torch.where(better, top, self.witness_p)
        self.witness_pos = torch.where(better, pos, self.witness_pos)

    def result(self) -> "ReferenceStats":
        if self.next_pos != self.N:
            raise ValueError(f"reference statistics are incomplete: positions {self.next_pos}.. were never added")
        return self

    @property
    def scores(self) -> torch.Tensor:
        """Pooled anchor scores ``[H, T]`` float32."""
        if self.selector == "none":
            raise ValueError("these reference statistics pool no anchor scores (selector='none')")
        return self.pool.result()

    def rows(self, name: str) -> torch.Tensor:
        """A row statistic in the GQA row layout: ``[H, G * N]`` (``row_out``: ``[H, G * N, Dv]``)."""
        x = getattr(self, name)
        return x.reshape(self.H, self.G * self.N, *x.shape[3:])
