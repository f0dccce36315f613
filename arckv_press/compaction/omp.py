"""Attention Matching baselines (Zweiger et al. 2026, "Fast KV compaction"), batched over KV heads.

Attention Matching (AM) compacts one head's cache ``(K, V)`` to ``(C_k, beta, C_v)`` with
``C_k = K_S`` (real keys, unmerged). It fits the attention *mass* of every reference query
(paper App. "Attention Mass and Compact Value Fitting", Eq. (mass_fit)) and then the values
(Eq. (value_lstsq) with ridge 0). Per head::

    E      = exp(scaling * Q K^T - rowmax)          [n, T]  (rowmax per query over all T keys)
    target = E 1                                    [n]     (mass of each query)
    w      = argmin_w ||E_S w - target||, clamped   beta = log w
    C_v    = argmin_C ||softmax(scaling Q C_k^T + beta) C - softmax(scaling Q K^T) V||

Variants (``am_compact(variant=...)``):

- ``"omp"`` (:data:`AM_OMP`): orthogonal matching pursuit over the columns of ``E`` with AM's
  default progressive schedule: one key per step and a refit every step up to 300 keys, two keys
  per step / refit every 2nd step up to 1,500 keys, then four keys per step / refit every 2nd step.
- ``"omp-fast"`` (:data:`AM_OMP_FAST`): four keys per step, refit every 2nd step, throughout.
- ``"ha"`` (:data:`AM_HA`): the ``t`` keys with the highest RMS (over queries) softmax weight;
  ``w`` by least squares clamped to ``[e^-3, e^3]`` plus two projected-gradient steps.

OMP step (per head, all heads in one set of tensor ops; :func:`omp_on_mass`): with selected set
``S`` and residual ``r = target - E_S w``, add the ``k_choice`` unselected, non-excluded keys with
the largest correlation ``E^T r`` (ties -> lowest index), then re-solve ``w`` (unconstrained least
squares, clamped to ``[1e-12, e^7]``) when AM would (``step % nnls_interval == 0`` or right after a
drop); otherwise the new keys get ``w = 1e-12`` (AM's ``_solve_nnls`` extends the previous solution
with its lower bound, so they leave the residual unchanged). On reaching the budget: a full solve;
keys with ``beta < -7`` are dropped, permanently excluded, and the freed slots are refilled by
resuming the selection (at most 3 drop rounds, AM's ``drop_key_beta_cutoff=-7`` of its best configs).

How it is made fast (and what differs from AM's public code, which loops over heads and calls
``torch.linalg.lstsq`` on ``E_S`` at every refit):

- All heads advance together; each head runs AM's per-head state machine (its own step counter,
  schedule phase and drop rounds), finished heads are masked out.
- Least squares by normal equations with an *incrementally appended* Cholesky factor ``L`` in
  float64 (``L L^T = E_S^T E_S``) and ``y = L^{-1} E_S^T target`` kept up to date: the keys of one
  step are appended with one triangular solve (``O(|S|^2)``, k right-hand sides) and a refit is
  one back substitution (AM: a QR of ``[n, |S|]``, ``O(n |S|^2)``, per refit). The minimiser is
  the same (unconstrained least squares, then the clamp). The Gram entries are float64 products
  of the float32 ``E`` values, so the solve is at least as accurate as AM's float32 QR up to
  condition numbers ~1e9. When a new column is numerically in the span of the selected ones
  (Schur complement ``<= jitter * ||e_j||^2``, e.g. a duplicate key) its Schur complement is
  raised to that floor, i.e. a ridge of that size on that single coordinate.
  ``torch.linalg.solve`` is never used (it can hang on this CPU build). Slot buffers grow by
  doubling so every solve runs on whole contiguous tensors (strided slices make torch copy).
- Drop rounds rebuild the factor with ``cholesky_ex`` on the kept set (jitter escalated on failure).
- Ties are broken by the lowest key index (AM uses ``torch.topk``, whose tie order is unspecified).
- AM leaves the loop after its third drop round without a final solve (lazily added keys may keep
  ``w = 1e-12``); here every head always ends with a full solve. Drops are capped at the number of
  keys still available, so every head returns exactly its budget (AM would return fewer keys).
- The HA power iteration (step size of the projected gradient) starts from the all-ones vector
  instead of a random one (deterministic; ``E`` is positive so this is the Perron direction's basin).
- Logits are ``scaling * Q K^T`` computed in float32 from up-cast inputs (AM: matmul in the model
  dtype, scale ``1/sqrt(d)``).
- ``C_v`` comes from :func:`arckv_press.compaction.fit.fit_values` with ridge 0 (float64 normal
  equations + Cholesky, a tiny jitter only if the factorisation fails; AM: float32
  ``torch.linalg.lstsq``), shared with ARC-KV so both methods fit values identically.

Memory (the method's own, no blocking over queries): ``E`` is ``[H, n, T]`` float32
(``4 H n T`` bytes, 50 MB for H=3, n=T=2048); OMP adds the selected columns ``[H, t_max, n]`` and
the Cholesky factor ``[H, t_max, t_max]`` in float64; HA needs a second ``[H, n, T]`` for the
softmax weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .checks import check_float, check_qk, check_scaling, check_values
from .fit import FitConfig, fit_values

__all__ = [
    "AM_PROGRESSIVE_SCHEDULE",
    "OMPOverflowError",
    "OMPConfig",
    "HAConfig",
    "AM_OMP",
    "AM_OMP_FAST",
    "AM_HA",
    "attention_mass",
    "omp_on_mass",
    "omp_select",
    "ha_select",
    "am_compact",
]

# (max_keys, k_choice, nnls_interval): use this entry while fewer than max_keys keys are selected.
ScheduleEntry = tuple[int | None, int, int]
AM_PROGRESSIVE_SCHEDULE: tuple[ScheduleEntry, ...] = ((300, 1, 1), (1500, 2, 2), (None, 4, 2))

_F64 = torch.float64


class OMPOverflowError(RuntimeError):
    """OMP's mass weights (Eq. (mass_fit) on the selected keys) overflowed: a head's least squares is
    near-singular, as when it asks for about as many keys as there are reference rows."""


@dataclass(frozen=True)
class OMPConfig:
    """OMP hyper-parameters (names follow AM's ``OMPCompaction``).

    ``schedule`` (if given) overrides ``k_choice``/``nnls_interval`` by the current number of
    selected keys. ``w_min``/``w_max`` clamp the mass weights (AM: ``nnls_lower_bound`` default
    1e-12, ``nnls_upper_bound`` e^7); ``w_min`` is also the weight of keys added between refits.
    ``drop_beta_cutoff=None`` disables drop-and-refill.
    """

    k_choice: int = 1
    nnls_interval: int = 1
    schedule: tuple[ScheduleEntry, ...] | None = None
    w_min: float = 1e-12
    w_max: float = math.exp(7.0)
    drop_beta_cutoff: float | None = -7.0
    max_drop_rounds: int = 3
    jitter: float = 1e-10

    def __post_init__(self) -> None:
        entries = [(None, self.k_choice, self.nnls_interval)] if self.schedule is None else list(self.schedule)
        if not entries:
            raise ValueError("OMPConfig.schedule must not be empty (use None for a fixed k_choice)")
        for i, (max_keys, k, interval) in enumerate(entries):
            if max_keys is None and i != len(entries) - 1:
                raise ValueError(f"OMPConfig.schedule: only the last entry may have max_keys None, got {self.schedule}")
            if max_keys is not None and (not isinstance(max_keys, int) or max_keys < 1):
                raise ValueError(f"OMPConfig.schedule: max_keys must be a positive int or None, got {max_keys!r}")
            if not isinstance(k, int) or k < 1 or not isinstance(interval, int) or interval < 1:
                raise ValueError(f"OMPConfig: k_choice and nnls_interval must be ints >= 1, got {k!r}, {interval!r}")
        if not 0.0 < self.w_min < self.w_max < math.inf:
            raise ValueError(f"OMPConfig: need 0 < w_min < w_max < inf, got {self.w_min}, {self.w_max}")
        if self.drop_beta_cutoff is not None and not math.isfinite(self.drop_beta_cutoff):
            raise ValueError(f"OMPConfig.drop_beta_cutoff must be finite or None, got {self.drop_beta_cutoff}")
        if not isinstance(self.max_drop_rounds, int) or self.max_drop_rounds < 0:
            raise ValueError(f"OMPConfig.max_drop_rounds must be an int >= 0, got {self.max_drop_rounds!r}")
        if not 0.0 < self.jitter < 1.0:
            raise ValueError(f"OMPConfig.jitter must lie in (0, 1), got {self.jitter}")

    @classmethod
    def am_omp(cls) -> "OMPConfig":
        """AM's ``omp_..._drop-7_lsq_progressive``: default progressive schedule, drop below beta -7."""
        return cls(schedule=AM_PROGRESSIVE_SCHEDULE)

    @classmethod
    def am_omp_fast(cls) -> "OMPConfig":
        """AM's ``omp_..._drop-7_lsq_k4int2`` ("OMP-fast"): 4 keys per step, refit every 2nd step."""
        return cls(k_choice=4, nnls_interval=2)

    def step_params(self, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_choice, nnls_interval)`` per head for the current selected counts ``[A]`` (AM's
        ``_get_schedule_params``: first entry with ``count < max_keys``)."""
        if self.schedule is None:
            return torch.full_like(count, self.k_choice), torch.full_like(count, self.nnls_interval)
        k = torch.full_like(count, self.schedule[-1][1])
        interval = torch.full_like(count, self.schedule[-1][2])
        for max_keys, k_e, int_e in reversed(self.schedule[:-1]):
            below = count < max_keys
            k = torch.where(below, k_e, k)
            interval = torch.where(below, int_e, interval)
        return k, interval


@dataclass(frozen=True)
class HAConfig:
    """Highest-attention keys (AM's ``highest_attn_keys_rms_nnls2_-3_3_lsq``): RMS score, least
    squares clamped to ``[e^beta_min, e^beta_max]`` plus ``pg_steps`` projected-gradient steps."""

    pg_steps: int = 2
    beta_min: float = -3.0
    beta_max: float = 3.0
    power_iters: int = 3

    def __post_init__(self) -> None:
        if not isinstance(self.pg_steps, int) or self.pg_steps < 0:
            raise ValueError(f"HAConfig.pg_steps must be an int >= 0, got {self.pg_steps!r}")
        if not isinstance(self.power_iters, int) or self.power_iters < 1:
            raise ValueError(f"HAConfig.power_iters must be an int >= 1, got {self.power_iters!r}")
        if not -math.inf < self.beta_min < self.beta_max < math.inf:
            raise ValueError(f"HAConfig: need finite beta_min < beta_max, got {self.beta_min}, {self.beta_max}")


AM_OMP = OMPConfig.am_omp()
AM_OMP_FAST = OMPConfig.am_omp_fast()
AM_HA = HAConfig()
_VARIANTS = {"omp": AM_OMP, "omp-fast": AM_OMP_FAST, "ha": AM_HA}


# ----------------------------------------------------------------------------------------------
# input checks


def _check_budgets(budgets: object, H: int, T: int, device: torch.device) -> torch.Tensor:
    """Budgets as a LongTensor ``[H]`` with ``1 <= t_h <= T``; an int means the same for every head."""
    if isinstance(budgets, bool):
        raise TypeError("budgets must be an int or an integer tensor [H], got bool")
    if isinstance(budgets, int):
        budgets = torch.full((H,), budgets, dtype=torch.long)
    if not isinstance(budgets, torch.Tensor):
        raise TypeError(f"budgets must be an int or an integer tensor [H], got {type(budgets).__name__}")
    if budgets.dtype.is_floating_point or budgets.dtype.is_complex or budgets.dtype == torch.bool:
        raise TypeError(f"budgets must be an integer tensor, got {budgets.dtype}")
    if budgets.shape != (H,):
        raise ValueError(f"budgets must have shape [{H}] (one per KV head), got {tuple(budgets.shape)}")
    budgets = budgets.to(device=device, dtype=torch.long)
    bad = (budgets < 1) | (budgets > T)
    if bad.any():
        h = int(bad.nonzero()[0, 0])
        raise ValueError(f"budgets must lie in [1, T={T}], got {int(budgets[h])} at head {h}")
    return budgets


# ----------------------------------------------------------------------------------------------
# shared linear algebra


def attention_mass(
    Q: torch.Tensor, K: torch.Tensor, scaling: float, row_max: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``E = exp(scaling Q K^T - rowmax)`` ``[H, n, T]`` and ``target = E 1`` ``[H, n]`` (float64).

    Paper Eq. (mass_fit): ``Phi_K`` with ``z^fit`` the per-query maximum over ``K``, or the given
    ``row_max [H, n]`` (at least that maximum: ``K`` is then one chunk of a document and ``row_max``
    the document's, so ``target`` is the chunk's share of each row's mass). ``E`` is float32
    (float64 if ``Q``/``K`` are float64).
    """
    dtype = _F64 if _F64 in (Q.dtype, K.dtype) else torch.float32
    logits = torch.bmm(Q.to(dtype), K.to(dtype).transpose(1, 2)).mul_(scaling)
    z = logits.amax(dim=2, keepdim=True) if row_max is None else row_max.to(dtype)[:, :, None]
    E = logits.sub_(z).exp_()
    return E, E.sum(dim=2, dtype=_F64)


def _cholesky_jitter(G: torch.Tensor, what: str) -> torch.Tensor:
    """Cholesky factor of SPD ``G [B, m, m]``; heads that fail get an escalating relative ridge."""
    L, info = torch.linalg.cholesky_ex(G)
    if not bool((info != 0).any()):
        return L
    scale = G.diagonal(dim1=1, dim2=2).abs().mean(dim=1).clamp_min(1e-300)
    eye = torch.eye(G.shape[1], dtype=G.dtype, device=G.device)
    for rel in (1e-12, 1e-10, 1e-8, 1e-6, 1e-4):
        fail = info != 0
        L_try, info_try = torch.linalg.cholesky_ex(G[fail] + (rel * scale[fail])[:, None, None] * eye)
        L[fail], info[fail] = L_try, info_try
        if not bool((info != 0).any()):
            return L
    raise RuntimeError(f"{what}: Cholesky failed for heads {(info != 0).nonzero().flatten().tolist()} even with jitter")


def _sorted_by_position(idx: torch.Tensor, valid: torch.Tensor, T: int, *others: torch.Tensor):
    """Reorder each head's valid slots by key position (padding last, index 0)."""
    order = torch.argsort(torch.where(valid, idx, T), dim=1, stable=True)
    idx = torch.where(valid, idx.gather(1, order), 0)
    return (idx, *(x.gather(1, order) for x in others))


# ----------------------------------------------------------------------------------------------
# OMP


def _floored_cholesky(S: torch.Tensor, norms: torch.Tensor, jitter: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Cholesky of the small Schur complements ``S [A, k, k]`` (k = keys per step, a loop over k) with
    each pivot floored at ``jitter * norms`` (1 for an all-zero column). Returns the factor and
    the amount added to each pivot (the per-coordinate ridge)."""
    k = S.shape[1]
    Lk = torch.zeros_like(S)
    added = torch.zeros_like(norms)
    floor = torch.where(norms > 0, jitter * norms, torch.ones_like(norms))
    for j in range(k):
        v = S[:, j, j] - Lk[:, j, :j].square().sum(dim=1)
        added[:, j] = (floor[:, j] - v).clamp_min(0)
        d = torch.maximum(v, floor[:, j]).sqrt()
        Lk[:, j, j] = d
        Lk[:, j + 1 :, j] = (S[:, j + 1 :, j] - (Lk[:, j + 1 :, :j] @ Lk[:, j, :j, None])[:, :, 0]) / d[:, None]
    return Lk, added


class _OMPState:
    """Per-head OMP state for all heads of a layer; every method takes the heads it acts on.

    Slot buffers have a capacity ``cap`` (grown by doubling up to ``t_max``) so the linear algebra
    always runs on whole contiguous tensors. Invariants: slots ``>= count[h]`` hold index 0, zero
    rows/b/y/w/delta and an identity block in ``L``; on the filled slots
    ``L L^T = rows rows^T + diag(delta)`` and ``L y = b = rows target``.
    """

    def __init__(self, E: torch.Tensor, target: torch.Tensor, budgets: torch.Tensor, cfg: OMPConfig):
        H, n, T = E.shape
        dev = E.device
        self.E, self.target, self.budgets, self.cfg = E, target, budgets, cfg
        self.H, self.n, self.T, self.t_max = H, n, T, int(budgets.max())
        self.count = torch.zeros(H, dtype=torch.long, device=dev)
        self.taken = torch.zeros(H, T, dtype=torch.bool, device=dev)  # selected or excluded
        self.r = target.clone()
        self.steps = torch.zeros(H, dtype=torch.long, device=dev)  # AM's `iteration`
        self.fresh = torch.ones(H, dtype=torch.bool, device=dev)  # AM's `prev_B is None`
        self.rounds = torch.zeros(H, dtype=torch.long, device=dev)
        self.done = torch.zeros(H, dtype=torch.bool, device=dev)
        self.cap = 0
        self._grow(min(self.t_max, 64))

    def _grow(self, cap: int) -> None:
        """Reallocate the slot buffers with capacity ``cap`` (keeping their content)."""
        H, n, dev, old = self.H, self.n, self.E.device, self.cap
        new = {
            "idx": torch.zeros(H, cap, dtype=torch.long, device=dev),
            "rows": torch.zeros(H, cap, n, dtype=_F64, device=dev),  # selected columns of E
            "b": torch.zeros(H, cap, dtype=_F64, device=dev),  # rows @ target
            "y": torch.zeros(H, cap, dtype=_F64, device=dev),  # L^{-1} b
            "w": torch.zeros(H, cap, dtype=_F64, device=dev),
            "delta": torch.zeros(H, cap, dtype=_F64, device=dev),  # jitter added per slot
            "L": torch.eye(cap, dtype=_F64, device=dev).repeat(H, 1, 1),
        }
        for name, x in new.items():
            if old and name == "L":
                x[:, :old, :old] = self.L
            elif old:
                x[:, :old] = getattr(self, name)
            setattr(self, name, x)
        self.cap = cap
        self.slot = torch.arange(cap, device=dev)

    def _sub(self, x: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        return x if heads.numel() == self.H else x[heads]  # a view (no copy) when all heads act

    # -- one selection step -------------------------------------------------------------------

    def select_step(self, heads: torch.Tensor, active: torch.Tensor) -> None:
        """One OMP step for ``heads[active]``; the inactive ones ride along unchanged (running a
        few idle heads is cheaper than copying ``E`` for the active ones)."""
        count0 = self.count[heads]
        k, interval = self.cfg.step_params(count0)
        k = torch.where(active, torch.minimum(k, self.budgets[heads] - count0), 0)
        picks = self.best_keys(heads, int(k.max()))
        self.append(heads, picks, k)
        solve = active & (self.fresh[heads] | (self.steps[heads] % interval == 0))
        self.refit(heads, solve, count0)
        stepped = heads[active]
        self.fresh[stepped] = False
        self.steps[stepped] += 1

    def best_keys(self, heads: torch.Tensor, k: int) -> torch.Tensor:
        """``[A, k]`` untaken keys with the largest ``E^T r`` (in order; ties -> lowest index)."""
        r = self.r[heads].to(self.E.dtype)
        corr = torch.bmm(r[:, None, :], self._sub(self.E, heads))[:, 0]
        corr = corr.masked_fill(self._sub(self.taken, heads), -math.inf)
        picks = torch.empty(heads.numel(), k, dtype=torch.long, device=corr.device)
        for j in range(k):  # k is small: repeated first-occurrence argmax = lowest-index tie rule
            picks[:, j] = corr.argmax(dim=1)
            corr.scatter_(1, picks[:, j : j + 1], -math.inf)
        return picks

    def append(self, heads: torch.Tensor, picks: torch.Tensor, k: torch.Tensor) -> None:
        """Append keys ``picks[a, :k[a]]`` as the next slots of head ``heads[a]``: one block
        triangular solve extends the factor ``L`` and ``y``."""
        s = self.count[heads]
        if int((s + k).max()) > self.cap:
            self._grow(min(self.t_max, max(2 * self.cap, int((s + k).max()))))
        kmax = picks.shape[1]
        j = torch.arange(kmax, device=picks.device)
        act = j[None, :] < k[:, None]  # [A, kmax]
        cols = self.E[heads[:, None], :, picks].to(_F64) * act[:, :, None]  # [A, kmax, n]
        g = torch.bmm(self._sub(self.rows, heads), cols.mT)  # [A, cap, kmax], zero at slots >= s
        l = torch.linalg.solve_triangular(self._sub(self.L, heads), g, upper=False)
        both = act[:, :, None] & act[:, None, :]
        eye = torch.eye(kmax, dtype=_F64, device=g.device)
        S = torch.where(both, cols @ cols.mT - l.mT @ l, eye)
        L22, added = _floored_cholesky(S, torch.where(act, cols.square().sum(dim=2), 1.0), self.cfg.jitter)
        b_new = (cols @ self.target[heads][:, :, None])[:, :, 0]
        rhs = b_new - (l * self._sub(self.y, heads)[:, :, None]).sum(dim=1)
        y_new = torch.linalg.solve_triangular(L22, rhs[:, :, None], upper=False)[:, :, 0]

        a, jj = act.nonzero(as_tuple=True)  # active (head, new key) pairs
        h, p = heads[a], s[a] + jj
        self.L[h, p] = l[a, :, jj]
        a3, j3, i3 = (both & (j[None, None, :] <= j[None, :, None])).nonzero(as_tuple=True)
        self.L[heads[a3], s[a3] + j3, s[a3] + i3] = L22[a3, j3, i3]
        self.rows[h, p] = cols[a, jj]
        self.b[h, p], self.y[h, p], self.delta[h, p] = b_new[a, jj], y_new[a, jj], added[a, jj]
        self.idx[h, p] = picks[a, jj]
        self.taken[h, picks[a, jj]] = True
        self.count[heads] += k

    def refit(self, heads: torch.Tensor, solve: torch.Tensor, count0: torch.Tensor) -> None:
        """Re-solve ``w`` for heads with ``solve``; others keep ``w`` and give slots ``>= count0``
        the weight ``w_min``. Then update the residual."""
        count = self.count[heads]
        L, y = self._sub(self.L, heads), self._sub(self.y, heads)
        w_ls = torch.linalg.solve_triangular(L.mT, y[:, :, None], upper=True)[:, :, 0]
        if not bool(torch.isfinite(w_ls).all()):
            raise OMPOverflowError("OMP: the mass weights overflowed (near-singular least squares); keep fewer keys")
        filled = self.slot < count[:, None]
        w_fit = torch.where(filled, w_ls.clamp(self.cfg.w_min, self.cfg.w_max), 0.0)
        w_lazy = torch.where(self.slot < count0[:, None], self.w[heads], torch.where(filled, self.cfg.w_min, 0.0))
        self.w[heads] = torch.where(solve[:, None], w_fit, w_lazy)
        approx = torch.bmm(self._sub(self.w, heads)[:, None, :], self._sub(self.rows, heads))[:, 0]
        self.r[heads] = self.target[heads] - approx

    # -- budget reached: final solve, drop-and-refill ------------------------------------------

    def refine(self, heads: torch.Tensor) -> None:
        self.refit(heads, torch.ones_like(heads, dtype=torch.bool), self.count[heads])
        cutoff = self.cfg.drop_beta_cutoff
        if cutoff is None:
            self.done[heads] = True
            return
        filled = self.slot < self.count[heads, None]
        can = self.rounds[heads] < self.cfg.max_drop_rounds
        low = filled & (torch.log(self.w[heads]) < cutoff) & can[:, None]
        available = self.T - self.taken[heads].sum(dim=1)
        n_drop = torch.minimum(low.sum(dim=1), available)
        go = n_drop > 0
        self.done[heads[~go]] = True
        if bool(go.any()):
            self.drop(heads[go], low[go], n_drop[go])

    def drop(self, heads: torch.Tensor, low: torch.Tensor, n_drop: torch.Tensor) -> None:
        """Drop the ``n_drop`` lowest-weight flagged keys of each head (they stay excluded), then
        refactor the kept set and re-solve (AM re-solves the reduced set before refilling)."""
        w = self.w[heads]
        order = torch.argsort(torch.where(low, w, math.inf), dim=1, stable=True)
        rank = torch.empty_like(order).scatter_(1, order, self.slot.expand_as(order))
        gone = low & (rank < n_drop[:, None])
        perm = torch.argsort(gone.to(torch.int8), dim=1, stable=True)  # kept slots first, in order
        self.count[heads] -= n_drop
        keep = self.slot < self.count[heads, None]
        for name in ("idx", "b", "delta", "w"):
            x = getattr(self, name)
            x[heads] = torch.where(keep, x[heads].gather(1, perm), 0)
        rows = self.rows[heads].gather(1, perm[:, :, None].expand(-1, -1, self.n)) * keep[:, :, None]
        self.rows[heads] = rows
        G = rows @ rows.mT + torch.diag_embed(self.delta[heads] + (~keep).to(_F64))
        L = _cholesky_jitter(G, "OMP drop-and-refill")
        self.L[heads] = L
        self.y[heads] = torch.linalg.solve_triangular(L, self.b[heads][:, :, None], upper=False)[:, :, 0]
        self.refit(heads, torch.ones_like(heads, dtype=torch.bool), self.count[heads])
        self.fresh[heads] = True
        self.steps[heads] += 1
        self.rounds[heads] += 1


def omp_on_mass(
    E: torch.Tensor,
    target: torch.Tensor,
    budgets: torch.Tensor | int,
    config: OMPConfig = AM_OMP,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """OMP core on a mass matrix: ``min ||E_S w - target||`` over ``|S| = t_h`` columns, per head.

    Args:
        E: ``[H, n, T]`` float32/float64 columns (one per key), e.g. from :func:`attention_mass`.
        target: ``[H, n]`` vector to fit (AM: ``E 1``).
        budgets: LongTensor ``[H]`` (or an int for all heads), ``1 <= t_h <= min(T, n)`` (more keys
            than rows leaves the least squares underdetermined: ``ValueError``).
        config: :class:`OMPConfig`.

    Returns:
        ``idx [H, t_max]`` in selection order (drops compacted out), ``valid [H, t_max]`` (prefix
        of length ``t_h``), ``w [H, t_max]`` float64 final weights (0 on padding). Paper Eq.
        (mass_fit) with AM's bounds instead of ``max(., 0)``.
    """
    if not isinstance(config, OMPConfig):
        raise TypeError(f"config must be an OMPConfig, got {type(config).__name__}")
    check_float(E, "E", 3)
    check_float(target, "target", 2)
    H, n, T = E.shape
    if target.shape != (H, n):
        raise ValueError(f"target must have shape [{H}, {n}] to match E {tuple(E.shape)}, got {tuple(target.shape)}")
    budgets = _check_budgets(budgets, H, T, E.device)
    return _omp_core(E, target, budgets, config)


def _omp_core(
    E: torch.Tensor, target: torch.Tensor, budgets: torch.Tensor, config: OMPConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`omp_on_mass` on checked inputs."""
    H, n, _ = E.shape
    t_max = int(budgets.max())
    if t_max > n:
        raise ValueError(
            f"OMP needs at least as many reference query rows as kept keys, got a budget of {t_max} keys for "
            f"n={n} rows: the mass least squares is then underdetermined (its residual is already zero) and the "
            "incremental Cholesky breaks down. Give more reference queries or keep fewer keys."
        )
    state = _OMPState(E, target.to(_F64), budgets, config)
    all_heads = torch.arange(H, device=E.device)
    while not bool(state.done.all()):
        selecting = ~state.done & (state.count < budgets)
        n_sel = int(selecting.sum())
        if 3 * n_sel >= H:  # whole batch (no copies), idle heads masked
            state.select_step(all_heads, selecting)
        elif n_sel:
            state.select_step(selecting.nonzero().flatten(), torch.ones(n_sel, dtype=torch.bool, device=E.device))
        full = ~state.done & (state.count == budgets)
        if bool(full.any()):
            state.refine(full.nonzero().flatten())
    t_max = state.t_max
    valid = state.slot[:t_max] < state.count[:, None]
    return state.idx[:, :t_max], valid, state.w[:, :t_max]


def omp_select(
    Q: torch.Tensor,
    K: torch.Tensor,
    budgets: torch.Tensor | int,
    scaling: float,
    config: OMPConfig = AM_OMP,
    row_max: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AM's OMP key selection for one layer (paper App. "Attention Matching Pipeline Profile").

    Shapes: ``Q [H, n, D]``, ``K [H, T, D]``, ``budgets [H]``; ``row_max [H, n]`` (optional): each
    row's maximum logit over a document of which ``K`` is one chunk, so the search fits the chunk's
    own mass (:func:`attention_mass`; ``None``: the maximum over ``K``). Returns ``idx [H, t_max]``
    (valid slots first, sorted by key position; padding index 0), ``valid [H, t_max]`` and the mass
    weights ``w [H, t_max]`` float64 (``beta = log w``; 0 on padding).
    """
    if not isinstance(config, OMPConfig):
        raise TypeError(f"config must be an OMPConfig, got {type(config).__name__}")
    check_qk(Q, K)
    scaling = check_scaling(scaling)
    budgets = _check_budgets(budgets, K.shape[0], K.shape[1], K.device)
    if row_max is not None:
        check_float(row_max, "row_max", 2)
        if tuple(row_max.shape) != tuple(Q.shape[:2]):
            raise ValueError(f"row_max must have shape {tuple(Q.shape[:2])} (heads x rows), got {tuple(row_max.shape)}")
    return _omp_select(Q, K, budgets, scaling, config, row_max)


def _omp_select(
    Q: torch.Tensor, K: torch.Tensor, budgets: torch.Tensor, scaling: float, config: OMPConfig,
    row_max: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    E, target = attention_mass(Q, K, scaling, row_max)
    idx, valid, w = _omp_core(E, target, budgets, config)
    del E
    idx, w = _sorted_by_position(idx, valid, K.shape[1], w)
    return idx, valid, w


# ----------------------------------------------------------------------------------------------
# highest-attention keys


def _pg_mass_weights(
    E: torch.Tensor, target: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor, cfg: HAConfig
) -> torch.Tensor:
    """AM's ``_nnls_pg`` batched: least squares clamped to the box, then projected gradient with
    step ``1 / ||E_S||_2^2`` (power iteration from the all-ones vector). Returns ``w`` (0 on padding)."""
    H, n, _ = E.shape
    lo, hi = math.exp(cfg.beta_min), math.exp(cfg.beta_max)
    cols = E.gather(2, idx[:, None, :].expand(H, n, -1)).to(_F64) * valid[:, None, :]
    G = cols.transpose(1, 2) @ cols
    c = (cols.transpose(1, 2) @ target[:, :, None])[:, :, 0]
    L = _cholesky_jitter(G + torch.diag_embed((~valid).to(_F64)), "am-ha mass fit")
    w = torch.where(valid, torch.cholesky_solve(c[:, :, None], L)[:, :, 0].clamp(lo, hi), 0.0)
    u = valid.to(_F64)
    for _ in range(cfg.power_iters):  # u <- M^T M u / ||.||, as AM's two half steps
        u = (G @ u[:, :, None])[:, :, 0]
        u = u / u.norm(dim=1, keepdim=True).clamp_min(1e-300)
    lipschitz = (u * (G @ u[:, :, None])[:, :, 0]).sum(dim=1).clamp_min(1e-6)
    for _ in range(cfg.pg_steps):
        grad = (G @ w[:, :, None])[:, :, 0] - c
        w = torch.where(valid, (w - grad / lipschitz[:, None]).clamp(lo, hi), 0.0)
    return w


def ha_select(
    Q: torch.Tensor,
    K: torch.Tensor,
    budgets: torch.Tensor | int,
    scaling: float,
    config: HAConfig = AM_HA,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AM's highest-attention keys: top-``t_h`` keys by ``sqrt(mean_i softmax_i(j)^2)`` (ties ->
    lowest index) and their mass weights. Same outputs as :func:`omp_select`."""
    if not isinstance(config, HAConfig):
        raise TypeError(f"config must be an HAConfig, got {type(config).__name__}")
    check_qk(Q, K)
    scaling = check_scaling(scaling)
    budgets = _check_budgets(budgets, K.shape[0], K.shape[1], K.device)
    return _ha_select(Q, K, budgets, scaling, config)


def _ha_select(
    Q: torch.Tensor, K: torch.Tensor, budgets: torch.Tensor, scaling: float, config: HAConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T = K.shape[1]
    E, target = attention_mass(Q, K, scaling)
    probs = E / target.to(E.dtype)[:, :, None]
    score = probs.square_().mean(dim=1).sqrt_()
    del probs
    t_max = int(budgets.max())
    order = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :t_max]
    valid = torch.arange(t_max, device=K.device)[None, :] < budgets[:, None]
    (idx,) = _sorted_by_position(order, valid, T)
    w = _pg_mass_weights(E, target, idx, valid, config)
    return idx, valid, w


# ----------------------------------------------------------------------------------------------
# full compaction


def am_compact(
    Q: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    budgets: torch.Tensor | int,
    scaling: float,
    variant: str = "omp",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention Matching compaction of one layer: select keys, fit ``beta`` and ``C_v``
    (``C_v`` by :func:`~arckv_press.compaction.fit.fit_values` with ridge 0, paper Eq. (value_lstsq)).

    Args:
        Q: ``[H, n, D]`` reference queries; K: ``[H, T, D]``; V: ``[H, T, Dv]``.
        budgets: LongTensor ``[H]`` (or int), ``1 <= t_h <= T``; for the OMP variants also ``t_h <= n``.
        scaling: softmax scale.
        variant: ``"omp"`` (:data:`AM_OMP`), ``"omp-fast"`` (:data:`AM_OMP_FAST`) or ``"ha"``.

    Returns:
        ``C_k [H, t_max, D]`` (= ``K_S``, K's dtype), ``beta [H, t_max]`` float32 (``log w``; 0 on
        padding), ``C_v [H, t_max, Dv]`` (K's dtype), ``idx [H, t_max]``, ``valid [H, t_max]``.
        Padded slots hold index 0 and zero keys/values.
    """
    if variant not in _VARIANTS:
        raise ValueError(f"variant must be one of {sorted(_VARIANTS)}, got {variant!r}")
    check_qk(Q, K)
    check_values(V, K)
    scaling = check_scaling(scaling)
    budgets = _check_budgets(budgets, K.shape[0], K.shape[1], K.device)
    if variant == "ha":
        idx, valid, w = _ha_select(Q, K, budgets, scaling, AM_HA)
    else:
        idx, valid, w = _omp_select(Q, K, budgets, scaling, _VARIANTS[variant])
    beta = torch.where(valid, torch.log(torch.where(valid, w, 1.0)), 0.0).float()
    C_k = K.gather(1, idx[:, :, None].expand(-1, -1, K.shape[2])) * valid[:, :, None]
    # float64 products, as the public AM code computes its least squares
    C_v = fit_values(Q, K, V, C_k, beta, scaling, valid=valid, config=FitConfig(gram_dtype="float64"), ridge=0.0)
    return C_k, beta, C_v, idx, valid
