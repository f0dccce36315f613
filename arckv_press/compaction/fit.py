"""Attention-mass bias and compact value fitting (paper App. "Attention Mass and Compact
Value Fitting", Eqs. (mass_fit), (value_lstsq)) and the attention operators
(paper Eqs. (full_attention), (compact_attention)).

All row-wise quantities are computed blockwise over query rows (``block_rows``): only the
normal equations ``[H, t, t]`` / ``[H, t, D]`` are accumulated (in ``FitConfig.gram_dtype``) and
solved in float64 with a batched Cholesky factorisation (never LU: batched float64
``torch.linalg.solve`` can hang on this CPU build). The one exception is :func:`compact_logits`,
which a caller running both fits holds for all rows, ``[H, n, t]``, so the second fit does not
multiply them again. Logits/exponentials are computed in float32 (float64 for float64 inputs).
Results are returned in the dtype of ``K`` except the diagnostic mass weights ``w``
(float32, so that ``w <= 0`` is exact for dead-anchor counts).

Invalid (padded) slots are handled by masking: their columns are removed from every design
matrix, their rows/columns of the normal equations are replaced by the identity, and they
come back as beta = 0, w = 0, C_v = 0. Callers must pass ``valid`` to the attention helpers.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from .checks import (
    check_float,
    check_positive_int,
    check_qk,
    check_scaling,
    check_valid,
    check_values,
    compute_dtype,
    hidden_slots,
    row_blocks,
)

logger = logging.getLogger(__name__)

MASS_SOLVERS = ("ls_clamp", "nnls")
VALUE_MODES = ("fit", "anchor")
FIT_SCOPES = ("all", "merged")
_PIVOT_RTOL = 1e-13  # Cholesky pivots below this fraction of their diagonal count as zero


@dataclass
class FitConfig:
    """Hyperparameters of paper Eqs. (mass_fit) and (value_lstsq): which anchors and rows are fitted,
    and how.

    scope: which anchors beta (Eq. (mass_fit)) and C_v (Eq. (value_lstsq)) are fitted for, in
        :mod:`~arckv_press.compaction.layer` (ARC-KV methods): ``"merged"`` (default): only anchors
        whose group (Eq. (anchor_assignment)) holds other positions; an anchor that absorbed none
        keeps its key, its value and beta = 0, exactly its own term of the full attention, and the
        fits solve for what the others must add (:func:`fit_beta` / :func:`fit_values` ``fixed``),
        so they grow with the square of the merged anchors instead of all anchors. ``"all"``: every
        anchor (the paper).
    witnesses: when merging and the fits use a subset of the scoring pool, add every anchor's
        witness query (the pooled row that attends to it most,
        :mod:`~arckv_press.compaction.witness`) to that subset (ARC-KV methods): without it, anchors
        picked for a planted needle get C_v fitted from queries that barely touch them.
    eps_w: floor before the log in Eq. (mass_fit). 1e-12 only prevents log(0); with the
        default ``b_min`` the clip is what actually bounds beta (log 1e-12 = -27.6 < -20).
    b_min, b_max: finite guard on beta. exp(-20) ~ 2e-9 makes an anchor with w* = 0 inert
        (dead) while keeping every logit finite in fp16/bf16 (no -inf, so an all-dead row still
        has a well-defined softmax); +20 (a weight of ~5e8 real keys' worth of mass) is far
        above any realistic w (w is at most ~T times the ratio of full to compact mass per
        query) and keeps logit + beta well inside the fp16 range.
    mass_solver: "ls_clamp" (paper default: unconstrained least squares, then clamp at 0)
        or "nnls" (exact non-negative least squares, batched Lawson--Hanson on the normal
        equations; costs up to ``nnls_max_iter`` batched Cholesky solves).
    mass_ridge: Tikhonov term for the mass normal equations, relative to the mean diagonal
        of Phi_C^T Phi_C. 1e-12 leaves well-posed solves unchanged to ~1e-12 relative
        (cond <~ 1e4 gives < 1e-8) while making exactly rank-deficient systems (e.g.
        duplicate compact keys) factorisable in float64, where it then acts like a minimum-
        norm solution.
    ridge_v: lambda_v of Eq. (value_lstsq). Relative (``ridge_relative=True``, default): the
        ridge is ridge_v * mean(diag(P_hat^T P_hat)), i.e. a fraction of the mean eigenvalue,
        so it does not depend on n_fit or t; 1e-3 only damps directions whose curvature is
        below 0.1% of the average. ``ridge_relative=False`` uses ridge_v as the absolute
        lambda_v of the paper.
    value_prior: what the ridge of Eq. (value_lstsq) shrinks C_v toward. "zero" (paper:
        lambda ||C_v||^2) or "anchor" (lambda ||C_v - V_S||^2 with V_S the original values at
        the anchor positions, so a large ridge falls back to plain eviction's values instead
        of to zero; ``docs/results.md`` has the needle evidence).
    values: "fit" (paper Eq. (value_lstsq), the default) or "anchor": C_v = V_S, the original
        values at the anchor positions, with no value solve (beta and the merged C_k are still
        fitted). A diagnostic option (measured in ``docs/results.md``, "Why ARC-KV lost
        needles"). ARC-KV methods only (the AM baselines always fit C_v).
    block_rows: query rows per block. 256 keeps each ``[rows, T]`` temporary small enough for the
        CPU caches at T of a few thousand.
    nnls_max_iter: cap on Lawson--Hanson iterations (None: 3 * t + 10).
    gram_dtype: dtype of each row block's products Phi^T Phi, P^T P and P^T Y ("float32" or
        "float64") for float32 inputs (float64 inputs always use float64), summed over row blocks
        in that dtype and solved in float64. The rows are float32 exponentials, so float32
        products lose no input precision; "float64" was the default before the fused pipeline.
    """

    scope: str = "merged"
    witnesses: bool = True
    eps_w: float = 1e-12
    b_min: float = -20.0
    b_max: float = 20.0
    mass_solver: str = "ls_clamp"
    mass_ridge: float = 1e-12
    ridge_v: float = 1e-3
    ridge_relative: bool = True
    value_prior: str = "zero"
    values: str = "fit"
    block_rows: int = 256
    nnls_max_iter: int | None = None
    gram_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.scope not in FIT_SCOPES:
            raise ValueError(f"scope must be one of {FIT_SCOPES}, got {self.scope!r}")
        if not isinstance(self.witnesses, bool):
            raise TypeError(f"witnesses must be a bool, got {type(self.witnesses).__name__}")
        if not (math.isfinite(self.eps_w) and self.eps_w > 0):
            raise ValueError(f"eps_w must be finite and > 0, got {self.eps_w}")
        if not (math.isfinite(self.b_min) and math.isfinite(self.b_max) and self.b_min < self.b_max):
            raise ValueError(f"need finite b_min < b_max, got b_min={self.b_min}, b_max={self.b_max}")
        if self.mass_solver not in MASS_SOLVERS:
            raise ValueError(f"mass_solver must be one of {MASS_SOLVERS}, got {self.mass_solver!r}")
        if not (math.isfinite(self.mass_ridge) and self.mass_ridge >= 0):
            raise ValueError(f"mass_ridge must be finite and >= 0, got {self.mass_ridge}")
        if not (math.isfinite(self.ridge_v) and self.ridge_v >= 0):
            raise ValueError(f"ridge_v must be finite and >= 0, got {self.ridge_v}")
        if self.value_prior not in ("zero", "anchor"):
            raise ValueError(f"value_prior must be 'zero' or 'anchor', got {self.value_prior!r}")
        if self.values not in VALUE_MODES:
            raise ValueError(f"values must be one of {VALUE_MODES}, got {self.values!r}")
        check_positive_int(self.block_rows, "block_rows")
        if self.gram_dtype not in ("float32", "float64"):
            raise ValueError(f"gram_dtype must be 'float32' or 'float64', got {self.gram_dtype!r}")
        if self.nnls_max_iter is not None:
            check_positive_int(self.nnls_max_iter, "nnls_max_iter")


# --------------------------------------------------------------------------------------
# SPD solves
# --------------------------------------------------------------------------------------


def _mask_system(A: torch.Tensor, B: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Restrict ``A x = B`` to the slots in ``keep`` ``[H, t]``: other rows/cols -> identity, rhs 0."""
    km = keep.to(A.dtype)
    A = A * km[:, :, None] * km[:, None, :] + torch.diag_embed(1.0 - km)
    B = B * km.view(*km.shape, *([1] * (B.ndim - 2)))
    return A, B


def _mean_diag(A: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Mean diagonal of A over kept slots, ``[H]``; 1 where it is 0 (nothing to scale by)."""
    km = keep.to(A.dtype)
    md = (torch.diagonal(A, dim1=-2, dim2=-1) * km).sum(-1) / km.sum(-1).clamp_min(1.0)
    return torch.where(md > 0, md, torch.ones_like(md))


def spd_solve(
    A: torch.Tensor, B: torch.Tensor, max_tries: int = 12
) -> tuple[torch.Tensor, torch.Tensor]:
    """Solve batched SPD systems ``A X = B`` (A ``[H, t, t]``, B ``[H, t]`` or ``[H, t, k]``).

    Uses ``cholesky_ex`` + ``cholesky_solve`` in float64. A factorisation counts as failed if
    it breaks down or if some pivot is numerically zero, L_kk^2 < 1e-13 * A_kk (column k is
    a linear combination of the previous ones to within rounding: an exactly rank-deficient
    system that rounding let through). Failed heads get a diagonal jitter of
    1e-14 * mean(diag A), multiplied by 10 on each retry (up to ``max_tries``). Returns
    ``(X, jitter)`` with ``jitter`` ``[H]`` the absolute jitter that was added (0 where none
    was needed). Raises ``ValueError`` if A is not SPD even then.
    """
    A = A.to(torch.float64)
    vec = B.ndim == 2
    Bm = (B[..., None] if vec else B).to(torch.float64)
    H, t, _ = A.shape
    scale = torch.diagonal(A, dim1=-2, dim2=-1).abs().mean(-1).clamp_min(torch.finfo(torch.float64).tiny)
    jitter = torch.zeros(H, dtype=torch.float64, device=A.device)
    eye = torch.eye(t, dtype=torch.float64, device=A.device)

    def factorise(M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        factor, info = torch.linalg.cholesky_ex(M)
        pivot2 = torch.diagonal(factor, dim1=-2, dim2=-1) ** 2
        diag = torch.diagonal(M, dim1=-2, dim2=-1)
        degenerate = (pivot2 < _PIVOT_RTOL * diag).any(-1) | ~torch.isfinite(factor).all(-1).all(-1)
        return factor, (info > 0) | degenerate

    factor, failed = factorise(A)
    rel = 1e-14
    tries = 0
    while bool(failed.any()):
        if tries >= max_tries:
            h = int(failed.nonzero()[0])
            raise ValueError(
                f"normal equations of head {h} are not positive definite even with jitter {jitter[h].item():.3g}"
            )
        jitter = torch.where(failed, rel * scale, jitter)
        factor, failed = factorise(A + jitter[:, None, None] * eye)
        rel *= 10.0
        tries += 1
    X = torch.cholesky_solve(Bm, factor)
    return (X[..., 0] if vec else X), jitter


def _masked_spd_solve(
    A: torch.Tensor, B: torch.Tensor, keep: torch.Tensor, ridge: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Solve (A_kk + ridge I) x_k = B_k on the ``keep`` slots; x = 0 elsewhere. ``ridge`` ``[H]``."""
    A, B = _mask_system(A, B, keep)
    A = A + torch.diag_embed(ridge[:, None] * keep.to(A.dtype))
    X, jitter = spd_solve(A, B)
    km = keep.to(X.dtype)
    return X * km.view(*km.shape, *([1] * (X.ndim - 2))), jitter


def _nnls_normal(
    A: torch.Tensor, b: torch.Tensor, valid: torch.Tensor, ridge: torch.Tensor, max_iter: int
) -> torch.Tensor:
    """Batched Lawson--Hanson NNLS on the normal equations: min_w>=0 ||Phi w - y||^2.

    A = Phi^T Phi (+ ridge on the passive set), b = Phi^T y, ``[H, t, t]`` / ``[H, t]`` float64.
    All heads advance together, one masked Cholesky solve per step (loop over steps, not
    heads). Warm start: the passive set is shrunk from all valid slots by dropping negative
    restricted solutions until the restricted solution is positive, which yields a feasible
    point satisfying the Lawson--Hanson invariant; the standard outer/inner loops follow.
    """
    H, t = b.shape
    tol = 1e-10 * b.abs().amax(-1).clamp_min(torch.finfo(b.dtype).tiny)   # KKT tolerance per head

    def restricted(passive: torch.Tensor) -> torch.Tensor:
        return _masked_spd_solve(A, b, passive, ridge)[0]

    passive = valid.clone()
    for _ in range(t + 1):                       # warm start (passive set only shrinks)
        s = restricted(passive)
        negative = passive & (s <= 0)
        if not bool(negative.any()):
            break
        passive &= ~negative
    w = s * passive
    done = torch.zeros(H, dtype=torch.bool, device=b.device)
    for _ in range(max_iter):
        g = b - (A @ w[..., None])[..., 0]       # negative gradient of 1/2 w'Aw - b'w
        cand = valid & ~passive
        g_c = torch.where(cand, g, torch.full_like(g, -torch.inf))
        g_max, j = g_c.max(dim=-1)
        done |= ~(g_max > tol)
        if bool(done.all()):
            break
        new = torch.nn.functional.one_hot(j, t).bool() & ~done[:, None]
        passive = passive | new
        s = restricted(passive)
        # in exact arithmetic the entering variable is positive; if rounding says otherwise
        # the remaining gradient is noise: undo and stop that head (avoids cycling)
        stuck = (new & (s <= 0)).any(-1)
        passive = passive & ~(new & stuck[:, None])
        done |= stuck
        inner = ~done
        for step in range(t + 1):
            if not bool(inner.any()):
                break
            if step > 0:
                s = restricted(passive)
            negative = passive & (s <= 0) & inner[:, None]
            infeasible = negative.any(-1)
            feasible = inner & ~infeasible
            w = torch.where(feasible[:, None], s * passive, w)
            inner = infeasible
            if not bool(inner.any()):
                break
            frac = w / (w - s).clamp_min(torch.finfo(w.dtype).tiny)   # step to the boundary
            ratio = torch.where(negative, frac, torch.full_like(w, torch.inf))
            alpha, i_min = ratio.min(dim=-1)
            alpha = torch.where(inner, alpha, torch.zeros_like(alpha))
            w_new = w + alpha[:, None] * (s - w)
            hit = torch.nn.functional.one_hot(i_min, t).bool() & inner[:, None]
            w_new = torch.where(hit, torch.zeros_like(w_new), w_new)
            w = torch.where(inner[:, None], w_new, w)
            drop = inner[:, None] & passive & (w <= 0)
            passive = passive & ~drop
            w = w * passive
    else:
        if not bool(done.all()):
            logger.warning("nnls: %d head(s) hit nnls_max_iter=%d before the KKT check", int((~done).sum()), max_iter)
    return w


# --------------------------------------------------------------------------------------
# beta (paper Eq. (mass_fit))
# --------------------------------------------------------------------------------------


def _check_compact(C: torch.Tensor, name: str, H: int, D: int | None, device: torch.device) -> None:
    check_float(C, name, 3)
    if C.shape[0] != H or (D is not None and C.shape[2] != D):
        raise ValueError(f"{name} {tuple(C.shape)} must be [H={H}, t, D={D}]")
    if C.shape[1] < 1:
        raise ValueError(f"{name} must have at least one slot, got shape {tuple(C.shape)}")
    if C.device != device:
        raise ValueError(f"{name} on {C.device} but expected {device}")


def _gram_dtype(config: FitConfig, compute_dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, else ``config.gram_dtype``."""
    return torch.float64 if compute_dtype == torch.float64 else getattr(torch, config.gram_dtype)


@dataclass
class _FreeSlots:
    """The slots a fit solves for when some valid slots are ``fixed`` (kept as they are): ``idx [H, t_f]``
    the free slots of each head in slot order, padded, ``valid [H, t_f]`` which of them are real."""

    idx: torch.Tensor
    valid: torch.Tensor
    fixed: torch.Tensor  # [H, t] bool
    hidden: torch.Tensor | None  # padding to zero (hidden_slots of valid)

    @classmethod
    def of(cls, valid: torch.Tensor, fixed: torch.Tensor) -> "_FreeSlots":
        if not isinstance(fixed, torch.Tensor) or fixed.dtype != torch.bool:
            raise TypeError(f"fixed must be a bool tensor, got {getattr(fixed, 'dtype', type(fixed).__name__)}")
        if tuple(fixed.shape) != tuple(valid.shape) or fixed.device != valid.device:
            raise ValueError(f"fixed must have shape {tuple(valid.shape)} on {valid.device}, got "
                             f"{tuple(fixed.shape)} on {fixed.device}")
        fixed = fixed & valid
        free = valid & ~fixed
        t_f = max(int(free.sum(-1).max()), 1)
        idx = torch.sort((~free).to(torch.int8), dim=1, stable=True).indices[:, :t_f]
        free_valid = free.gather(1, idx)
        return cls(idx, free_valid, fixed, hidden_slots(free_valid))

    def columns(self, X: torch.Tensor) -> torch.Tensor:
        """The free columns of ``X [H, b, t]``, ``[H, b, t_f]`` (padding zeroed)."""
        cols = X.gather(2, self.idx[:, None, :].expand(-1, X.shape[1], -1))
        return cols if self.hidden is None else cols.masked_fill_(self.hidden, 0.0)

    def rows(self, X: torch.Tensor) -> torch.Tensor:
        """The free rows of ``X [H, t, D]``, ``[H, t_f, D]``."""
        return X.gather(1, self.idx[..., None].expand(-1, -1, X.shape[2]))

    def scatter(self, x_free: torch.Tensor, x_fixed: torch.Tensor) -> torch.Tensor:
        """``[H, t, ...]``: ``x_fixed`` on fixed slots, the free solution ``x_free [H, t_f, ...]`` elsewhere."""
        idx = self.idx.view(*self.idx.shape, *([1] * (x_free.ndim - 2))).expand_as(x_free)
        vm = self.valid.view(*self.valid.shape, *([1] * (x_free.ndim - 2)))
        fm = self.fixed.view(*self.fixed.shape, *([1] * (x_fixed.ndim - 2)))
        out = torch.zeros_like(x_fixed).scatter_(1, idx, x_free * vm)
        return torch.where(fm, x_fixed, out)


class GramSum:
    """Running sum of ``X^T X`` ``[H, t, t]`` over row blocks ``X [H, b, t]`` (the normal matrices of
    Eqs. (mass_fit) and (value_lstsq)), computed on its lower block triangle only.

    The product is symmetric, so when t exceeds two column blocks only the column blocks ``j <= i``
    of ``col_block`` columns are multiplied (about half the work of one full ``X^T X`` for large t),
    and rows are gathered into blocks of at least ``rows`` before each update, so the ``[t, t]`` sum
    is swept once per ``rows`` rows rather than once per caller block (smaller t: one full product
    per block as it comes). :meth:`total` mirrors the lower triangle, so the result is exactly
    symmetric. Sums are kept in ``dtype``.
    """

    def __init__(self, H: int, t: int, dtype: torch.dtype, device: torch.device, rows: int = 2048,
                 col_block: int = 128):
        check_positive_int(rows, "rows")
        check_positive_int(col_block, "col_block")
        self.A = torch.zeros(H, t, t, dtype=dtype, device=device)
        self.rows, self.col_block = rows, col_block
        self._pending: list[torch.Tensor] = []
        self._n = 0

    def add(self, X: torch.Tensor) -> None:
        """Add the rows of ``X [H, b, t]`` (dtype of the sum)."""
        if X.dtype != self.A.dtype or tuple(X.shape[::2]) != (self.A.shape[0], self.A.shape[2]):
            raise ValueError(f"rows of shape {tuple(X.shape)} ({X.dtype}) do not fit a {tuple(self.A.shape)} "
                             f"{self.A.dtype} sum")
        if X.shape[2] <= 2 * self.col_block:
            self.A.baddbmm_(X.transpose(1, 2), X)
            return
        self._pending.append(X)
        self._n += X.shape[1]
        if self._n >= self.rows:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        X = self._pending[0] if len(self._pending) == 1 else torch.cat(self._pending, dim=1)
        self._pending, self._n = [], 0
        t, cb = X.shape[2], self.col_block
        for i in range(0, t, cb):
            self.A[:, i:i + cb, :i + cb].baddbmm_(X[:, :, i:i + cb].transpose(1, 2), X[:, :, :i + cb])

    def total(self) -> torch.Tensor:
        """The symmetric sum ``[H, t, t]`` (lower triangle mirrored)."""
        self._flush()
        return self.A.tril() + self.A.tril(-1).transpose(1, 2)


def compact_logits(Q: torch.Tensor, C_k: torch.Tensor, scaling: float, block_rows: int = 256) -> list[torch.Tensor]:
    """The logits ``scaling * Q_b C_k^T`` ``[H, b, t]`` of each row block of ``block_rows`` (compute
    dtype), shared by :func:`fit_beta` (Phi_C of Eq. (mass_fit)) and :func:`fit_values` (P_hat of
    Eq. (value_lstsq)) so that the second fit does not multiply them again."""
    check_float(Q, "Q", 3)
    _check_compact(C_k, "C_k", Q.shape[0], Q.shape[2], Q.device)
    scaling = check_scaling(scaling)
    check_positive_int(block_rows, "block_rows")
    cd = compute_dtype(Q, C_k)
    Ct = C_k.to(cd).transpose(1, 2)
    return [(Q[:, lo:hi].to(cd) * scaling) @ Ct for lo, hi in row_blocks(Q.shape[1], block_rows)]


def _check_logits(logits, Q: torch.Tensor, C_k: torch.Tensor, block_rows: int, dtype: torch.dtype) -> None:
    """``logits`` must be :func:`compact_logits` of these ``Q``, ``C_k`` and ``block_rows``, in the
    fit's compute ``dtype``."""
    if not isinstance(logits, list):
        raise TypeError(f"logits must be the list of compact_logits, got {type(logits).__name__}")
    shapes = [(Q.shape[0], hi - lo, C_k.shape[1]) for lo, hi in row_blocks(Q.shape[1], block_rows)]
    got = [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in logits]
    if got != shapes:
        raise ValueError(f"logits are not the {len(shapes)} blocks of {block_rows} rows of Q against C_k "
                         f"(blocks {shapes[:2]}...), got {got[:2]}... ({len(got)} blocks)")
    wrong = {x.dtype for x in logits} - {dtype}
    if wrong:
        raise ValueError(f"logits are {sorted(map(str, wrong))} but this fit computes in {dtype}")


def _mass_normal_equations(
    Q: torch.Tensor, K: torch.Tensor, C_k: torch.Tensor, scaling: float, valid: torch.Tensor, block_rows: int,
    targets: tuple[torch.Tensor, torch.Tensor] | None = None, gram_dtype: torch.dtype = torch.float64,
    free: _FreeSlots | None = None, logits: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accumulate A = Phi_C^T Phi_C and b = Phi_C^T Phi_K 1 per head (float64).

    Phi rows are shifted by z_i = max_j scaling * q_i . k_j over the FULL K (paper
    Eq. (mass_fit)). ``targets = (z, lse)`` ``[H, n]`` (the row maxima and log-sum-exps of the
    full-cache logits, :mod:`.stats`) replace the pass over K: Phi_K 1 = exp(lse - z).
    ``free``: only the free columns enter A and b, and the fixed slots' mass (weight 1) is taken
    off the target: b = Phi_F^T (Phi_K 1 - Phi_U 1). ``logits``: :func:`compact_logits` of the rows.
    """
    cd = compute_dtype(Q, K, C_k)
    Kt, Ct = K.to(cd).transpose(1, 2), C_k.to(cd).transpose(1, 2)
    H = valid.shape[0]
    t = valid.shape[1] if free is None else free.idx.shape[1]
    A = GramSum(H, t, gram_dtype, K.device)                           # summed in gram_dtype
    b = torch.zeros(H, t, dtype=torch.float64, device=K.device)
    hidden = hidden_slots(valid)
    fixed = None if free is None else free.fixed.to(torch.float64)[..., None]
    for bi, (lo, hi) in enumerate(row_blocks(Q.shape[1], block_rows)):
        Qb = Q[:, lo:hi].to(cd) * scaling
        if targets is None:
            Lk = Qb @ Kt
            z = Lk.amax(-1, keepdim=True)
            zf = torch.exp(Lk - z).sum(-1).double()                   # Phi_K 1, [H, b]
        else:
            z = targets[0][:, lo:hi, None].to(cd)
            zf = torch.exp(targets[1][:, lo:hi].double() - targets[0][:, lo:hi].double())
        phi_c = torch.exp((Qb @ Ct if logits is None else logits[bi]) - z)     # Phi_C, [H, b, t]
        if hidden is not None:
            phi_c.masked_fill_(hidden, 0.0)
        if free is not None:
            zf = zf - (phi_c.double() @ fixed)[..., 0]                          # mass the fixed slots leave
            phi_c = free.columns(phi_c)
        phi_c = phi_c.to(gram_dtype)
        A.add(phi_c)
        b.add_((phi_c.double().transpose(1, 2) @ zf[..., None])[..., 0])
    return A.total().double(), b


def _check_row_targets(targets, shape) -> None:
    if not isinstance(targets, tuple) or len(targets) != 2:
        raise TypeError("targets must be a (row_max, row_lse) pair")
    for name, x in zip(("row_max", "row_lse"), targets):
        check_float(x, name, 2)
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name} must have shape {tuple(shape)} (heads x rows of Q), got {tuple(x.shape)}")


def fit_beta(
    Q: torch.Tensor,
    K: torch.Tensor,
    C_k: torch.Tensor,
    scaling: float,
    valid: torch.Tensor | None = None,
    config: FitConfig = FitConfig(),
    targets: tuple[torch.Tensor, torch.Tensor] | None = None,
    fixed: torch.Tensor | None = None,
    logits: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention-mass bias (paper Eq. (mass_fit)).

    Phi_K = exp(scaling Q K^T - z 1^T), Phi_C = exp(scaling Q C_k^T - z 1^T) with
    z_i = max_j scaling q_i . k_j over the full K; w~ = argmin ||Phi_C w - Phi_K 1||
    (``ls_clamp``: normal equations with a ``mass_ridge`` relative Tikhonov term, Cholesky in
    float64, then w* = max(w~, 0); ``nnls``: exact NNLS); beta = clip(log(max(w*, eps_w)),
    b_min, b_max).

    ``targets = (z, lse)`` ``[H, n]``: the full-cache row maxima and log-sum-exps, when the
    reference pass already computed them (:mod:`.stats`); ``K`` is then not read again.

    ``fixed`` ``[H, t]`` bool: valid slots that keep w = 1 (beta = 0); only the others are fitted,
    to the mass the fixed ones leave, w~_F = argmin ||Phi_F w_F - (Phi_K 1 - Phi_U 1)||.

    ``logits``: :func:`compact_logits` ``(Q, C_k, scaling, config.block_rows)``, computed once for
    this fit and :func:`fit_values`.

    Returns ``beta`` ``[H, t]`` (dtype of K) and ``w*`` ``[H, t]`` float32. Invalid slots
    get beta = 0 and w = 0; callers must pass ``valid`` downstream.
    """
    check_qk(Q, K)
    scaling = check_scaling(scaling)
    H, T, D = K.shape
    _check_compact(C_k, "C_k", H, D, K.device)
    t = C_k.shape[1]
    valid = check_valid(valid, H, t, K.device)
    if not isinstance(config, FitConfig):
        raise TypeError(f"config must be a FitConfig, got {type(config).__name__}")
    if targets is not None:
        _check_row_targets(targets, Q.shape[:2])
    cd = compute_dtype(Q, K, C_k)
    if logits is not None:
        _check_logits(logits, Q, C_k, config.block_rows, cd)
    free = None if fixed is None else _FreeSlots.of(valid, fixed)
    A, b = _mass_normal_equations(Q, K, C_k, scaling, valid, config.block_rows, targets,
                                  _gram_dtype(config, cd), free, logits)
    solve_valid = valid if free is None else free.valid
    ridge = config.mass_ridge * _mean_diag(A, solve_valid)
    if config.mass_solver == "ls_clamp":
        w, jitter = _masked_spd_solve(A, b, solve_valid, ridge)
        if bool((jitter > 0).any()):
            logger.warning("fit_beta: jitter added to the mass normal equations of %d head(s)", int((jitter > 0).sum()))
        w = w.clamp_min(0.0)
    else:
        max_iter = config.nnls_max_iter if config.nnls_max_iter is not None else 3 * A.shape[-1] + 10
        w = _nnls_normal(A, b, solve_valid, ridge, max_iter).clamp_min(0.0)
    if free is not None:
        w = free.scatter(w, torch.ones(H, t, dtype=w.dtype, device=w.device))
    w = w * valid
    beta = torch.log(w.clamp_min(config.eps_w)).clamp(config.b_min, config.b_max)
    beta = beta.masked_fill(~valid, 0.0)
    return beta.to(K.dtype), w.to(torch.float32)


# --------------------------------------------------------------------------------------
# attention operators (paper Eqs. (full_attention), (compact_attention))
# --------------------------------------------------------------------------------------


def _compact_probs(
    Qb: torch.Tensor, Ct: torch.Tensor, beta: torch.Tensor, hidden: torch.Tensor | None,
    logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(Qb C_k^T + beta) over the slots not ``hidden`` (:func:`hidden_slots`); ``Qb`` already scaled;
    ``logits``: ``Qb C_k^T`` when already computed."""
    logits = torch.baddbmm(beta[:, None, :], Qb, Ct) if logits is None else logits + beta[:, None, :]
    if hidden is not None:
        logits.masked_fill_(hidden, -torch.inf)
    return torch.softmax(logits, dim=-1)


def _probs_with_rest(
    Qb: torch.Tensor, Ct: torch.Tensor, beta: torch.Tensor, hidden: torch.Tensor | None,
    logits: torch.Tensor | None, rest_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax over ``[Qb C_k^T + beta | rest_lse]`` (one virtual slot per row holding the rest's mass):
    the compact slots' probabilities ``[H, b, t]`` and the rest's ``[H, b]``."""
    logits = torch.baddbmm(beta[:, None, :], Qb, Ct) if logits is None else logits + beta[:, None, :]
    if hidden is not None:
        logits.masked_fill_(hidden, -torch.inf)
    m = torch.maximum(logits.amax(-1), rest_lse)
    e = torch.exp(logits - m[..., None])
    e_rest = torch.exp(rest_lse - m)
    den = e.sum(-1) + e_rest
    return e / den[..., None], e_rest / den


def full_attention(
    Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, scaling: float, block_rows: int = 256
) -> torch.Tensor:
    """O = softmax(scaling Q K^T) V, ``[H, n, Dv]`` in the dtype of V (paper Eq. (full_attention)).

    Computed in float32 (float64 for float64 inputs), blockwise over rows; differentiable.
    """
    return attention_lse(Q, K, V, scaling, block_rows)[1].to(V.dtype)


def attention_lse(
    Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, scaling: float, block_rows: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lse, O)``: each row's log-sum-exp of ``scaling Q K^T`` ``[H, n]`` and its output
    softmax(scaling Q K^T) V ``[H, n, Dv]`` (paper Eq. (full_attention)), both float32 (float64 for
    float64 inputs), blockwise over rows."""
    check_qk(Q, K)
    check_values(V, K)
    scaling = check_scaling(scaling)
    check_positive_int(block_rows, "block_rows")
    cd = compute_dtype(Q, K, V)
    Kt, Vc = K.to(cd).transpose(1, 2), V.to(cd)
    lse, out = [], []
    for lo, hi in row_blocks(Q.shape[1], block_rows):
        logits = (Q[:, lo:hi].to(cd) * scaling) @ Kt
        lse.append(torch.logsumexp(logits, dim=-1))
        out.append(torch.softmax(logits, dim=-1) @ Vc)
    return torch.cat(lse, dim=1), torch.cat(out, dim=1)


def _check_compact_cache(
    Q: torch.Tensor, C_k: torch.Tensor, beta: torch.Tensor, C_v: torch.Tensor | None, valid: torch.Tensor | None
) -> torch.Tensor:
    check_float(Q, "Q", 3)
    H, _, D = Q.shape
    _check_compact(C_k, "C_k", H, D, Q.device)
    t = C_k.shape[1]
    check_float(beta, "beta", 2)
    if tuple(beta.shape) != (H, t):
        raise ValueError(f"beta must have shape {(H, t)}, got {tuple(beta.shape)}")
    if C_v is not None:
        _check_compact(C_v, "C_v", H, None, Q.device)
        if C_v.shape[1] != t:
            raise ValueError(f"C_v {tuple(C_v.shape)} must have t={t} slots like C_k")
    valid = check_valid(valid, H, t, Q.device)
    if not bool(valid.any(-1).all()):
        raise ValueError(f"head {int((~valid.any(-1)).nonzero()[0])} has no valid compact slot")
    return valid


def compact_attention(
    Q: torch.Tensor,
    C_k: torch.Tensor,
    beta: torch.Tensor,
    C_v: torch.Tensor,
    scaling: float,
    valid: torch.Tensor | None = None,
    block_rows: int = 256,
) -> torch.Tensor:
    """O^ = softmax(scaling Q C_k^T + 1 beta^T) C_v over valid slots (paper Eq. (compact_attention)).

    ``[H, n, Dv]`` in the dtype of C_v; blockwise over rows; differentiable.
    """
    valid = _check_compact_cache(Q, C_k, beta, C_v, valid)
    scaling = check_scaling(scaling)
    check_positive_int(block_rows, "block_rows")
    cd = compute_dtype(Q, C_k, beta, C_v)
    Ct, bc, Cv = C_k.to(cd).transpose(1, 2), beta.to(cd), C_v.to(cd)
    hidden = hidden_slots(valid)
    out = [
        _compact_probs(Q[:, lo:hi].to(cd) * scaling, Ct, bc, hidden) @ Cv
        for lo, hi in row_blocks(Q.shape[1], block_rows)
    ]
    return torch.cat(out, dim=1).to(C_v.dtype)


# --------------------------------------------------------------------------------------
# C_v (paper Eq. (value_lstsq))
# --------------------------------------------------------------------------------------


def fit_values(
    Q: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    C_k: torch.Tensor,
    beta: torch.Tensor,
    scaling: float,
    valid: torch.Tensor | None = None,
    config: FitConfig = FitConfig(),
    ridge: float | None = None,
    prior: torch.Tensor | None = None,
    Y: torch.Tensor | None = None,
    fixed: torch.Tensor | None = None,
    fixed_values: torch.Tensor | None = None,
    logits: list[torch.Tensor] | None = None,
    rest: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Compact values C_v ``[H, t, Dv]`` (dtype of K), paper Eq. (value_lstsq).

    P_hat = softmax(scaling Q C_k^T + beta) over valid slots, Y = softmax(scaling Q K^T) V,
    C_v = argmin ||P_hat C - Y||_F^2 + lambda ||C||_F^2 via (P^T P + lambda I) C = P^T Y,
    accumulated blockwise in float64 and solved by Cholesky. ``ridge`` overrides
    ``config.ridge_v`` (relative to mean(diag(P^T P)) when ``config.ridge_relative``).
    ``ridge=0`` is exact least squares when P_hat has full column rank; if the Cholesky
    factorisation fails a tiny escalating jitter is added and a warning is logged (use
    :func:`spd_solve` directly to get the jitter per head). Invalid slots get zero rows.

    ``prior`` ``[H, t, Dv]`` (required iff ``config.value_prior == "anchor"``): the ridge then
    shrinks toward it, (P^T P + lambda I) C = P^T Y + lambda prior. ``Y`` ``[H, n, Dv]``: the
    full-cache outputs when the reference pass already computed them (:mod:`.stats`).

    ``fixed`` ``[H, t]`` bool with ``fixed_values`` ``[H, t, Dv]``: valid slots whose values are
    given; only the others are fitted, to what the fixed ones leave:
    C_F = argmin ||P_F C - (Y - P_U fixed_values_U)||_F^2 + lambda ||C||_F^2 (P over every slot).

    ``logits``: :func:`compact_logits` ``(Q, C_k, scaling, config.block_rows)`` (as for :func:`fit_beta`).

    ``rest = (rest_lse [H, n], rest_out [H, n, Dv])``: keys outside ``K`` that every row also sees
    unchanged (the other chunks of a chunk-separable fit, :mod:`.chunks`), given by each row's
    log-sum-exp over them and its output over them alone. They act as one more fixed slot per row:
    P_hat is the softmax over ``[C_k + beta | rest_lse]`` and the rest's share times ``rest_out`` is
    taken from Y, C = argmin ||P_C C - (Y - p_rest rest_out)||_F^2 + lambda ||C||_F^2 (with ``Y`` the
    output over ``K`` and the rest together). ``rest_lse = -inf`` is a row with no rest.
    """
    check_qk(Q, K)
    check_values(V, K)
    scaling = check_scaling(scaling)
    H, T, D = K.shape
    _check_compact(C_k, "C_k", H, D, K.device)
    t = C_k.shape[1]
    check_float(beta, "beta", 2)
    if tuple(beta.shape) != (H, t):
        raise ValueError(f"beta must have shape {(H, t)}, got {tuple(beta.shape)}")
    valid = check_valid(valid, H, t, K.device)
    if not isinstance(config, FitConfig):
        raise TypeError(f"config must be a FitConfig, got {type(config).__name__}")
    lam = config.ridge_v if ridge is None else ridge
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not (math.isfinite(lam) and lam >= 0):
        raise ValueError(f"ridge must be a finite float >= 0, got {lam!r}")
    if (config.value_prior == "anchor") != (prior is not None):
        raise ValueError("pass prior (values at the anchors) exactly when config.value_prior == 'anchor'")
    if prior is not None:
        check_float(prior, "prior", 3)
        if tuple(prior.shape) != (H, t, V.shape[-1]):
            raise ValueError(f"prior must have shape {(H, t, V.shape[-1])}, got {tuple(prior.shape)}")
    if Y is not None:
        check_float(Y, "Y", 3)
        if tuple(Y.shape) != (*Q.shape[:2], V.shape[-1]):
            raise ValueError(f"Y must have shape {(*Q.shape[:2], V.shape[-1])} (rows of Q x value width), got {tuple(Y.shape)}")
    if (fixed is None) != (fixed_values is None):
        raise ValueError("pass fixed and fixed_values together")
    if rest is not None:
        if Y is None:
            raise ValueError("rest needs Y, the output over K and the rest together")
        if not isinstance(rest, tuple) or len(rest) != 2:
            raise TypeError("rest must be a (rest_lse, rest_out) pair")
        if not (isinstance(rest[0], torch.Tensor) and rest[0].is_floating_point() and rest[0].ndim == 2):
            raise TypeError("rest_lse must be a 2-D floating tensor")
        if bool(torch.isnan(rest[0]).any() or torch.isposinf(rest[0]).any()):
            raise ValueError("rest_lse contains NaN or +inf (-inf, a row with no rest, is allowed)")
        check_float(rest[1], "rest_out", 3)
        if tuple(rest[0].shape) != tuple(Q.shape[:2]) or tuple(rest[1].shape) != tuple(Y.shape):
            raise ValueError(f"rest must have shapes {tuple(Q.shape[:2])} and {tuple(Y.shape)}, got "
                             f"{tuple(rest[0].shape)} and {tuple(rest[1].shape)}")
    free = None
    if fixed is not None:
        check_float(fixed_values, "fixed_values", 3)
        if tuple(fixed_values.shape) != (H, t, V.shape[-1]):
            raise ValueError(f"fixed_values must have shape {(H, t, V.shape[-1])}, got {tuple(fixed_values.shape)}")
        free = _FreeSlots.of(valid, fixed)
    cd = compute_dtype(Q, K, V, C_k, beta)
    if logits is not None:
        _check_logits(logits, Q, C_k, config.block_rows, cd)
    Kt, Vc = K.to(cd).transpose(1, 2), V.to(cd)
    Ct, bc = C_k.to(cd).transpose(1, 2), beta.to(cd)
    hidden = hidden_slots(valid)
    gd = _gram_dtype(config, cd)
    t_s = t if free is None else free.idx.shape[1]                        # slots solved for
    G = GramSum(H, t_s, gd, K.device)                                  # P^T P, summed in gd
    R = torch.zeros(H, t_s, V.shape[-1], dtype=gd, device=K.device)
    if free is not None:
        C_fixed = fixed_values.to(cd).masked_fill(~free.fixed[..., None], 0.0)
    for bi, (lo, hi) in enumerate(row_blocks(Q.shape[1], config.block_rows)):
        Qb = Q[:, lo:hi].to(cd) * scaling
        Yb = torch.softmax(Qb @ Kt, dim=-1) @ Vc if Y is None else Y[:, lo:hi]
        if rest is None:
            P = _compact_probs(Qb, Ct, bc, hidden, None if logits is None else logits[bi])
        else:
            P, p_rest = _probs_with_rest(Qb, Ct, bc, hidden, None if logits is None else logits[bi],
                                         rest[0][:, lo:hi].to(cd))
            Yb = Yb.to(cd) - p_rest[..., None] * rest[1][:, lo:hi].to(cd)   # what the rest leaves
        if free is not None:
            Yb = Yb.to(cd) - P @ C_fixed                                 # what the fixed slots leave
            P = free.columns(P)
        P, Yb = P.to(gd), Yb.to(gd)
        G.add(P)
        R.baddbmm_(P.transpose(1, 2), Yb)
    G, R = G.total().double(), R.double()
    solve_valid = valid if free is None else free.valid
    scale = _mean_diag(G, solve_valid) if config.ridge_relative else torch.ones(H, dtype=torch.float64, device=K.device)
    if prior is not None:
        R = R + (lam * scale)[:, None, None] * (prior if free is None else free.rows(prior)).double()
    C_v, jitter = _masked_spd_solve(G, R, solve_valid, lam * scale)
    if bool((jitter > 0).any()):
        logger.warning(
            "fit_values: P_hat^T P_hat + ridge was singular for %d head(s); added jitter (max %.3g)",
            int((jitter > 0).sum()), float(jitter.max()),
        )
    if free is not None:
        C_v = free.scatter(C_v, fixed_values.double())
    return C_v.to(K.dtype)


# --------------------------------------------------------------------------------------
# diagnostics (paper App. "Key-Merging Coefficient")
# --------------------------------------------------------------------------------------


def attention_mass_error(
    Q: torch.Tensor,
    K: torch.Tensor,
    C_k: torch.Tensor,
    w: torch.Tensor,
    scaling: float,
    valid: torch.Tensor | None = None,
    block_rows: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Relative mass error and dead-anchor fraction per head, both ``[H]`` float32.

    E_mass = ||Z_c - Z_f|| / ||Z_f|| with Z_f = Phi_K 1 and Z_c = Phi_C w* (the stabilised
    Phi of paper Eq. (mass_fit)), as in paper App. "Key-Merging Coefficient". The dead
    fraction is the share of valid slots with w <= 0.
    """
    check_qk(Q, K)
    scaling = check_scaling(scaling)
    H, T, D = K.shape
    _check_compact(C_k, "C_k", H, D, K.device)
    t = C_k.shape[1]
    valid = check_valid(valid, H, t, K.device)
    check_float(w, "w", 2)
    if tuple(w.shape) != (H, t):
        raise ValueError(f"w must have shape {(H, t)}, got {tuple(w.shape)}")
    check_positive_int(block_rows, "block_rows")
    cd = compute_dtype(Q, K, C_k)
    Kt, Ct = K.to(cd).transpose(1, 2), C_k.to(cd).transpose(1, 2)
    wv = (w.double() * valid)[..., None]
    err2 = torch.zeros(H, dtype=torch.float64, device=K.device)
    ref2 = torch.zeros(H, dtype=torch.float64, device=K.device)
    for lo, hi in row_blocks(Q.shape[1], block_rows):
        Qb = Q[:, lo:hi].to(cd) * scaling
        Lk = Qb @ Kt
        z = Lk.amax(-1, keepdim=True)
        zf = torch.exp(Lk - z).sum(-1).double()
        zc = (torch.exp(Qb @ Ct - z).double() @ wv)[..., 0]
        err2 = err2 + ((zc - zf) ** 2).sum(-1)
        ref2 = ref2 + (zf * zf).sum(-1)
    rel = (err2 / ref2).sqrt()
    dead = ((w <= 0) & valid).sum(-1).double() / valid.sum(-1).clamp_min(1).double()
    return rel.float(), dead.float()


__all__ = [
    "MASS_SOLVERS",
    "FitConfig",
    "spd_solve",
    "GramSum",
    "compact_logits",
    "fit_beta",
    "fit_values",
    "full_attention",
    "attention_lse",
    "compact_attention",
    "attention_mass_error",
]
