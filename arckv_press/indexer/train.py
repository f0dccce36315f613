"""Training math of the value-aware indexer (paper Sec. 3.5 "Training the Reusable
Value-Aware Indexer", App. "Indexer Training: Additional Derivations" and "Indexer Training
Details").

Pure tensor code: no model forward. Supervision comes from precomputed
:class:`ReferencePool` s (one context, one layer), produced by the capture step.

One layer is trained at a time (the paper shards training by layer): :func:`train_layer`
copies that layer's parameter slices out of the stacked :class:`ValueAwareIndexer`, optimises
the copies (so AdamW's weight decay never touches other layers) and writes them back after
every epoch.

Schedule (paper App. "Indexer Training Details"): a KL-only warm-up stage
(``lambda_out, lambda_KL = 0, 1``, peak lr 1e-4) then a joint stage
(``2 L_out^STE + L_KL``, peak lr 3e-5); AdamW (0.9, 0.999), weight decay 0.01, gradient-norm
clipping 1.0; per stage a linear warm-up over 3% of the steps then cosine decay to 10% of the
peak. Every episode (one pool, one step) samples a retention ratio from
``(0.2, 0.1, 0.05, 0.02, 0.01)`` and a disjoint score/fit/holdout split of the reference
positions (resampled every epoch); the gate temperature ``gamma`` anneals linearly from 1.0 to
0.1 over the joint stage.

Not fixed by the paper (our choices): the split fractions ``(0.5, 0.25, 0.25)`` of reference
positions; one episode per pool per epoch; the compact-value ridge of the soft branch (the
relative ``ridge_v`` of ``FitConfig`` as in the hard fit, its scale being the mean diagonal over
the ``2t`` candidates, treated as a constant); the population standard deviation in the gate
scale; a fresh AdamW per stage; the STE written as ``sg(L_h) + (L_s - sg(L_s))`` so that its
forward value is exactly ``L_h``. As in the paper, only the ``min(T, 2t)`` candidates receive
gradient from the output loss; the KL term reaches every position.
"""

from __future__ import annotations

import copy
import hashlib
import math
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from arckv_press.compaction.checks import check_ratio
from arckv_press.compaction.fit import FitConfig, compact_attention, fit_beta, fit_values, full_attention
from arckv_press.compaction.reference import split_episode

from .model import POOLINGS, ValueAwareIndexer, layer_logits_and_row_weights, vi_base

__all__ = [
    "ReferencePool",
    "TrainConfig",
    "TrainResult",
    "HardBranch",
    "budget_for_ratio",
    "pooled_scores",
    "relative_output_error",
    "kl_loss",
    "hard_branch_loss",
    "soft_branch_loss",
    "split_positions",
    "ridge_solve",
    "ste_loss",
    "lr_factor",
    "train_layer",
]


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------


@dataclass
class ReferencePool:
    """Repeat-prefill supervision of ONE context at ONE layer (paper Sec. 3.2 "Reference-query
    pool", App. "Method Overview and Reference-Query Construction").

    Attributes:
        X: ``[n_ref, d_x]`` pre-query-projection activations ``x_r`` at the ``n_ref`` repeated
            positions (shared by the query heads at a position).
        Q: ``[H, G * n_ref, D]`` post-RoPE queries. The rows of KV head ``h`` stack its ``G``
            query heads **g-major**: row ``g * n_ref + r`` is query head ``h * G + g`` at
            reference position ``r`` (the layout of ``q.view(H, G, n_ref, D).flatten(1, 2)``
            for HF queries ``[H_Q, n_ref, D]``). Row ``i`` uses activation ``X[i % n_ref]``.
        K, V: ``[H, T, D]`` post-RoPE keys and values of the original-context prefill.
        scaling: softmax scale of the base model's attention (logit = ``scaling * q . k``).

    Episode splits act on reference positions ``r`` (all ``G`` rows of a position go to the
    same subset), so fitting and holdout never share a position.
    """

    X: Tensor
    Q: Tensor
    K: Tensor
    V: Tensor
    scaling: float

    def __post_init__(self) -> None:
        for name, ndim in (("X", 2), ("Q", 3), ("K", 3), ("V", 3)):
            t = getattr(self, name)
            if not isinstance(t, Tensor):
                raise TypeError(f"ReferencePool.{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.ndim != ndim:
                raise ValueError(f"ReferencePool.{name} must have {ndim} dims, got {tuple(t.shape)}")
            if not t.is_floating_point():
                raise TypeError(f"ReferencePool.{name} must be floating point, got {t.dtype}")
            if not torch.isfinite(t).all():
                raise ValueError(f"ReferencePool.{name} contains NaN or inf")
        H, T, D = self.K.shape
        if T < 1 or self.V.shape != self.K.shape:
            raise ValueError(f"ReferencePool: K {tuple(self.K.shape)} and V {tuple(self.V.shape)} "
                             "must both be [H, T>=1, D]")
        n_ref = self.X.shape[0]
        if n_ref < 1:
            raise ValueError("ReferencePool.X must hold at least one reference position")
        if self.Q.shape[0] != H or self.Q.shape[2] != D or self.Q.shape[1] % n_ref != 0:
            raise ValueError(f"ReferencePool.Q must be [H={H}, G*n_ref, D={D}] with n_ref={n_ref}, "
                             f"got {tuple(self.Q.shape)}")
        if isinstance(self.scaling, bool) or not isinstance(self.scaling, (int, float)) or not (
            math.isfinite(self.scaling) and self.scaling > 0
        ):
            raise ValueError(f"ReferencePool.scaling must be a positive float, got {self.scaling!r}")

    @property
    def n_ref(self) -> int:
        return self.X.shape[0]

    @property
    def group_size(self) -> int:
        """``G``: query heads per KV head."""
        return self.Q.shape[1] // self.X.shape[0]

    @property
    def T(self) -> int:
        return self.K.shape[1]

    def rows(self, positions: Tensor) -> Tensor:
        """Row indices of ``Q`` for reference ``positions`` (all ``G`` query heads, g-major)."""
        g = torch.arange(self.group_size, device=positions.device)
        return (g[:, None] * self.n_ref + positions[None, :]).reshape(-1)

    def X_rows(self, rows: Tensor) -> Tensor:
        """Activations aligned with ``Q[:, rows]``."""
        return self.X[rows % self.n_ref]


# ----------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------


@dataclass
class TrainConfig:
    """Indexer training hyper-parameters (defaults: paper App. "Indexer Training Details").

    Attributes:
        kl_epochs: epochs of the KL-only warm-up (10).
        joint_epochs: epochs of the joint stage (5).
        lr_kl, lr_joint: peak learning rates (1e-4, 3e-5).
        betas, weight_decay, grad_clip: AdamW (0.9, 0.999), 0.01; global grad-norm clip 1.0.
        warmup_frac, final_lr_frac: linear warm-up over 3% of a stage's steps, then cosine
            decay to 10% of the peak.
        lambda_out, lambda_kl: joint-stage weights of Eq. (training_objective) (2, 1).
        ratios: retention ratios rho, one sampled per episode.
        gamma_start, gamma_end: gate temperature of Eq. (soft_candidate_gate), annealed
            linearly over the joint stage (1.0 -> 0.1).
        episode_fractions: fractions of reference positions for D_score, D_fit, D_holdout
            (not given in the paper; the default of ``reference.split_episode``).
        fit_config: ``FitConfig`` of ``fit_beta`` / ``fit_values`` (None: its defaults). Its
            compact-value ridge (``ridge_v``, ``ridge_relative``) is also used by the
            differentiable solve of the soft branch.
        pooling: row pooling of Eq. (indexer_pooling) used for training scores.
        kl_max_rows: if set, the KL term of an episode uses a random subset of this many
            rows of D_ref (memory bound for long pools; the paper uses all rows).
        seed: base seed; every random choice derives from (seed, stage, epoch, pool).
    """

    kl_epochs: int = 10
    joint_epochs: int = 5
    lr_kl: float = 1e-4
    lr_joint: float = 3e-5
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    warmup_frac: float = 0.03
    final_lr_frac: float = 0.1
    lambda_out: float = 2.0
    lambda_kl: float = 1.0
    ratios: tuple[float, ...] = (0.2, 0.1, 0.05, 0.02, 0.01)
    gamma_start: float = 1.0
    gamma_end: float = 0.1
    episode_fractions: tuple[float, float, float] = (0.5, 0.25, 0.25)
    fit_config: FitConfig | None = None
    pooling: str = "rms"
    kl_max_rows: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("kl_epochs", "joint_epochs", "seed"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"TrainConfig.{name} must be a nonnegative int, got {v!r}")
        for name in ("lr_kl", "lr_joint", "gamma_start", "gamma_end"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"TrainConfig.{name} must be positive, got {v!r}")
        for name in ("weight_decay", "lambda_out", "lambda_kl"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"TrainConfig.{name} must be nonnegative, got {v!r}")
        if not (math.isfinite(self.grad_clip) and self.grad_clip > 0):
            raise ValueError(f"TrainConfig.grad_clip must be positive, got {self.grad_clip!r}")
        if not 0 <= self.warmup_frac < 1:
            raise ValueError(f"TrainConfig.warmup_frac must be in [0, 1), got {self.warmup_frac!r}")
        if not 0 <= self.final_lr_frac <= 1:
            raise ValueError(f"TrainConfig.final_lr_frac must be in [0, 1], got {self.final_lr_frac!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"TrainConfig.betas must be two values in [0, 1), got {self.betas!r}")
        if not self.ratios or not all(0 < r <= 1 for r in self.ratios):
            raise ValueError(f"TrainConfig.ratios must be non-empty values in (0, 1], got {self.ratios!r}")
        fr = self.episode_fractions
        if len(fr) != 3 or not all(f > 0 for f in fr) or sum(fr) > 1 + 1e-9:
            raise ValueError("TrainConfig.episode_fractions must be three positive fractions "
                             f"(score, fit, holdout) summing to <= 1, got {fr!r}")
        if self.fit_config is not None and not isinstance(self.fit_config, FitConfig):
            raise TypeError(f"TrainConfig.fit_config must be a FitConfig or None, got "
                            f"{type(self.fit_config).__name__}")
        if self.joint_epochs > 0 and self.lambda_out == 0 and self.lambda_kl == 0:
            raise ValueError("TrainConfig: lambda_out and lambda_kl are both 0, the joint stage "
                             "would have no loss")
        if self.pooling not in POOLINGS:
            raise ValueError(f"TrainConfig.pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if self.kl_max_rows is not None and (
            not isinstance(self.kl_max_rows, int) or self.kl_max_rows < 1
        ):
            raise ValueError(f"TrainConfig.kl_max_rows must be a positive int or None, got {self.kl_max_rows!r}")


@dataclass
class TrainResult:
    """Output of :func:`train_layer`.

    Attributes:
        metrics: one dict per completed epoch (stage, epoch, mean losses, last lr, gamma).
        state: resume state after the last completed epoch (pass as ``resume_state``).
        finished: whether both stages are complete.
    """

    metrics: list[dict[str, Any]] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)
    finished: bool = False


# ----------------------------------------------------------------------------------------------
# Losses
# ----------------------------------------------------------------------------------------------


def budget_for_ratio(ratio: float, T: int) -> int:
    """Training budget ``t = max(1, ceil(rho * T))`` (paper Sec. 3.5). A 1e-9 tolerance keeps
    float products such as ``0.1 * 30`` from rounding up."""
    check_ratio(ratio)
    if T < 1:
        raise ValueError(f"T must be positive, got {T}")
    return max(1, math.ceil(ratio * T - 1e-9))


def pooled_scores(I: Tensor, pooling: str = "rms", row_weights: Tensor | None = None) -> Tensor:
    """Differentiable context-level scores ``s [H, T]`` from logits ``I [H, n, T]``
    (paper Eq. (indexer_pooling): ``pi = softmax_j(I)``, then rms/mean/max over rows).
    ``row_weights [H, n]`` (the VI residual base) multiply each row's ``pi`` first."""
    pi = torch.softmax(I, dim=-1)
    if row_weights is not None:
        pi = pi * row_weights[..., None]
    if pooling == "rms":
        return pi.pow(2).mean(dim=1).sqrt()
    if pooling == "mean":
        return pi.mean(dim=1)
    if pooling == "max":
        return pi.amax(dim=1)
    raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")


def relative_output_error(y_hat: Tensor, y: Tensor) -> Tensor:
    """Mean over heads and rows of ``||y_hat - y||^2 / ||y||^2`` (paper Eq. (output_loss))."""
    num = (y_hat - y).pow(2).sum(-1)
    den = y.pow(2).sum(-1).clamp_min(torch.finfo(y.dtype).tiny)
    return (num / den).mean()


def kl_loss(I: Tensor, Q: Tensor, K: Tensor, scaling: float, target_logits: Tensor | None = None) -> Tensor:
    """``L_KL`` of paper Eq. (indexer_kl): mean over heads and rows of
    ``KL(p(q) || softmax(I))`` with ``p(q) = softmax(scaling * q K^T)``.

    ``I [H, n, T]`` indexer logits aligned with ``Q [H, n, D]``; ``K [H, T, D]``.
    ``target_logits [H, n, T]`` replace the attention logits as the target (the VI residual
    base anchors the learned correction to VI's row distribution, as the HA residual's target
    is the attention it starts from).
    """
    if I.shape != (Q.shape[0], Q.shape[1], K.shape[1]):
        raise ValueError(f"kl_loss: I {tuple(I.shape)} must be [H, n, T] = "
                         f"[{Q.shape[0]}, {Q.shape[1]}, {K.shape[1]}]")
    with torch.no_grad():
        if target_logits is None:
            target_logits = scaling * (Q.to(I.dtype) @ K.to(I.dtype).transpose(1, 2))
        elif target_logits.shape != I.shape:
            raise ValueError(f"kl_loss: target_logits {tuple(target_logits.shape)} must match I {tuple(I.shape)}")
        log_p = torch.log_softmax(target_logits.to(I.dtype), dim=-1)
    log_q = torch.log_softmax(I, dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean()


@dataclass
class HardBranch:
    """Result of :func:`hard_branch_loss` (no gradient).

    Attributes:
        loss: scalar ``L_out^h``.
        t: anchor budget.
        order: ``[H, T]`` positions sorted by descending score (ties: lowest index first);
            ``order[:, :t]`` are the anchors ``S`` in that order.
        beta: ``[H, t]`` fitted bias ``beta^h`` aligned with ``order[:, :t]``.
    """

    loss: Tensor
    t: int
    order: Tensor
    beta: Tensor


def _descending_order(scores: Tensor) -> Tensor:
    return torch.sort(scores.detach(), dim=-1, descending=True, stable=True).indices


def _gather_rows(A: Tensor, idx: Tensor) -> Tensor:
    """``A [H, T, D]``, ``idx [H, m]`` -> ``[H, m, D]``."""
    return torch.gather(A, 1, idx[..., None].expand(-1, -1, A.shape[-1]))


@torch.no_grad()
def hard_branch_loss(scores: Tensor, Q_fit: Tensor, Q_hold: Tensor, K: Tensor, V: Tensor,
                     scaling: float, ratio: float, fit_config: FitConfig | None = None,
                     Y_hold: Tensor | None = None) -> HardBranch:
    """Hard-selection branch ``L_out^h`` (paper Sec. 3.5, Eq. (output_loss)), no gradient.

    ``t = max(1, ceil(rho T))``; ``S`` = top-``t`` of ``scores [H, T]`` (pooled over
    D_score); ``C_k = K_S``; ``beta`` from ``fit_beta`` (Eq. (mass_fit)) and ``C_v`` from
    ``fit_values`` (Eq. (value_lstsq)) on ``Q_fit``; the relative squared error of the
    compact attention output against full attention on ``Q_hold``. ``Y_hold`` optionally
    passes the precomputed full-attention outputs on ``Q_hold``.
    """
    T = K.shape[1]
    if scores.shape != (K.shape[0], T):
        raise ValueError(f"scores {tuple(scores.shape)} must be [H, T] = [{K.shape[0]}, {T}]")
    t = budget_for_ratio(ratio, T)
    order = _descending_order(scores)
    C_k = _gather_rows(K, order[:, :t])
    fit_config = fit_config or FitConfig()
    beta, _ = fit_beta(Q_fit, K, C_k, scaling, config=fit_config)
    C_v = fit_values(Q_fit, K, V, C_k, beta, scaling, config=fit_config)
    y_hat = compact_attention(Q_hold, C_k, beta, C_v, scaling)
    y = full_attention(Q_hold, K, V, scaling) if Y_hold is None else Y_hold
    loss = relative_output_error(y_hat.to(torch.float64), y.to(torch.float64))
    return HardBranch(loss=loss.to(torch.float32), t=t, order=order, beta=beta)


def ridge_solve(P: Tensor, Y: Tensor, ridge: float, relative: bool = True) -> Tensor:
    """Differentiable ridge regression ``argmin_C ||P C - Y||^2 + lam ||C||^2`` per head
    (paper Eq. (value_lstsq)) via Cholesky of ``P^T P + lam I``; autograd flows through
    ``cholesky_ex`` and ``cholesky_solve``. ``P [H, n, m]``, ``Y [H, n, D]`` -> ``[H, m, D]``.

    As in ``fit_values``: ``lam = ridge * mean(diag(P^T P))`` per head when ``relative`` (the
    scale is treated as a constant, i.e. detached), else ``lam = ridge``. A failed
    factorisation (rank-deficient system) retries with a jitter of 1e-14 x the mean diagonal,
    growing 10x per try.
    """
    G = P.transpose(1, 2) @ P
    rhs = P.transpose(1, 2) @ Y
    eye = torch.eye(G.shape[-1], dtype=G.dtype, device=G.device)
    mean_diag = G.detach().diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(torch.finfo(G.dtype).tiny)
    lam = ridge * (mean_diag if relative else torch.ones_like(mean_diag))
    rel = 0.0
    for _ in range(14):
        L, info = torch.linalg.cholesky_ex(G + (lam + rel * mean_diag)[:, None, None] * eye)
        if not bool(info.any()):
            return torch.cholesky_solve(rhs, L)
        rel = 1e-14 if rel == 0.0 else 10 * rel
    raise ValueError(f"ridge_solve: normal equations not positive definite even with relative "
                     f"jitter {rel:.3g} (ridge {ridge})")


def soft_branch_loss(scores: Tensor, Q_fit: Tensor, Q_hold: Tensor, K: Tensor, V: Tensor,
                     scaling: float, hard: HardBranch, gamma: float,
                     fit_config: FitConfig | None = None, Y_fit: Tensor | None = None,
                     Y_hold: Tensor | None = None) -> Tensor:
    """Soft surrogate ``L_out^s`` (paper Eqs. (soft_candidate_gate), (soft_attention_output)).

    Candidates ``C`` = top-``min(T, 2t)`` of ``scores`` (same order as the hard branch, so
    ``S`` is their first ``t``); gates ``g_j = sigmoid((s_j - sg(s_(t))) / (gamma sg(std(s))))``;
    bias ``b^s`` = ``beta^h`` on anchors, 0 on the other candidates, plus ``log g``; ``C_v^s`` by
    a differentiable ridge solve on ``Q_fit`` (:func:`ridge_solve` with the ridge of
    ``fit_config``); relative squared error on ``Q_hold``.
    Gradients reach ``scores`` only through the gates (``C``, the threshold and the std are
    constants). Computed in float64; returns a float32 scalar.
    """
    if not (math.isfinite(gamma) and gamma > 0):
        raise ValueError(f"gamma must be positive, got {gamma!r}")
    T, t = K.shape[1], hard.t
    if scores.shape != (K.shape[0], T) or hard.order.shape != (K.shape[0], T):
        raise ValueError(f"scores {tuple(scores.shape)} and hard.order {tuple(hard.order.shape)} "
                         f"must both be [H, T] = [{K.shape[0]}, {T}]")
    m = min(T, 2 * t)
    dt = torch.float64
    cand = hard.order[:, :m]  # [H, m]
    s = scores.to(dt)
    s_c = torch.gather(s, 1, cand)
    tau = s_c[:, t - 1:t].detach()  # s_(t): the t-th largest score
    sigma = s.detach().std(dim=-1, correction=0, keepdim=True).clamp_min(torch.finfo(dt).tiny)
    log_g = F.logsigmoid((s_c - tau) / (gamma * sigma))  # [H, m]
    b = torch.zeros_like(s_c)
    b[:, :t] = hard.beta.to(dt)
    bias = (b + log_g)[:, None, :]  # [H, 1, m]
    C_k = _gather_rows(K.to(dt), cand)
    Kd, Vd = K.to(dt), V.to(dt)
    with torch.no_grad():
        Y_fit = full_attention(Q_fit.to(dt), Kd, Vd, scaling) if Y_fit is None else Y_fit.to(dt)
        Y_hold = full_attention(Q_hold.to(dt), Kd, Vd, scaling) if Y_hold is None else Y_hold.to(dt)
    P_fit = torch.softmax(scaling * (Q_fit.to(dt) @ C_k.transpose(1, 2)) + bias, dim=-1)
    fit_config = fit_config or FitConfig()
    C_v = ridge_solve(P_fit, Y_fit, fit_config.ridge_v, fit_config.ridge_relative)
    P_hold = torch.softmax(scaling * (Q_hold.to(dt) @ C_k.transpose(1, 2)) + bias, dim=-1)
    return relative_output_error(P_hold @ C_v, Y_hold).to(torch.float32)


def ste_loss(hard_loss: Tensor, soft_loss: Tensor) -> Tensor:
    """``L_out^STE = sg(L_h) + L_s - sg(L_s)`` (paper Eq. (output_ste)): the value of the hard
    branch with the gradient of the soft surrogate."""
    return hard_loss.detach() + (soft_loss - soft_loss.detach())  # forward value exactly L_h


# ----------------------------------------------------------------------------------------------
# Training loop
# ----------------------------------------------------------------------------------------------


def lr_factor(step: int, total: int, warmup_frac: float, final_frac: float) -> float:
    """Learning-rate multiplier: linear warm-up over ``ceil(warmup_frac * total)`` steps, then
    cosine decay from 1 to ``final_frac`` at the last step."""
    warm = math.ceil(warmup_frac * total)
    if step < warm:
        return (step + 1) / warm
    span = max(1, total - 1 - warm)
    progress = min(1.0, (step - warm) / span)
    return final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * progress))


def _mix_seed(*parts: int) -> int:
    digest = hashlib.sha256(struct.pack(f"<{len(parts)}q", *parts)).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def split_positions(n_ref: int, fractions: Sequence[float], seed: int, epoch: int,
                    device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """The episode split (``split_episode``) of ``n_ref`` reference positions into ``D_score``,
    ``D_fit`` and ``D_holdout`` on ``device``; an empty part is an error."""
    score, fit, hold = (p.to(device) for p in split_episode(n_ref, tuple(fractions), seed, epoch))
    for name, idx in (("D_score", score), ("D_fit", fit), ("D_holdout", hold)):
        if idx.numel() == 0:
            raise ValueError(f"episode split of n_ref={n_ref} positions left {name} empty; "
                             "use a larger pool or other episode_fractions")
    return score, fit, hold


@dataclass(frozen=True)
class _Stage:
    name: str
    epochs: int
    lr: float
    lambda_out: float
    lambda_kl: float


def _stages(config: TrainConfig) -> list[_Stage]:
    return [
        _Stage("kl", config.kl_epochs, config.lr_kl, 0.0, 1.0),
        _Stage("joint", config.joint_epochs, config.lr_joint, config.lambda_out, config.lambda_kl),
    ]


def _check_pools(indexer: ValueAwareIndexer, layer: int, pools: Sequence[ReferencePool]) -> None:
    if not pools:
        raise ValueError("train_layer needs at least one ReferencePool")
    cfg = indexer.config
    for i, pool in enumerate(pools):
        if not isinstance(pool, ReferencePool):
            raise TypeError(f"pools[{i}] must be a ReferencePool, got {type(pool).__name__}")
        H, _, D = pool.K.shape
        if H != cfg.num_kv_heads or D != cfg.head_dim or pool.X.shape[1] != cfg.d_x:
            raise ValueError(f"pools[{i}] (layer {layer}) has H={H}, D={D}, d_x={pool.X.shape[1]}; "
                             f"the indexer expects H={cfg.num_kv_heads}, D={cfg.head_dim}, d_x={cfg.d_x}")


def _episode_loss(params: dict[str, Tensor], indexer: ValueAwareIndexer, pool: ReferencePool,
                  stage: _Stage, config: TrainConfig, gen: torch.Generator, split_seed: int,
                  global_epoch: int, gamma: float) -> tuple[Tensor, dict[str, float]]:
    cfg = indexer.config
    dtype = params["L_q"].dtype
    device = params["L_q"].device
    Q = pool.Q.to(device, dtype)
    K, V = pool.K.to(device, dtype), pool.V.to(device, dtype)
    n_rows = Q.shape[1]
    all_rows = torch.arange(n_rows, device=device)
    if config.kl_max_rows is not None and config.kl_max_rows < n_rows:
        kl_rows = torch.randperm(n_rows, generator=gen)[: config.kl_max_rows].sort().values.to(device)
    else:
        kl_rows = all_rows
    stats: dict[str, float] = {}
    loss = torch.zeros((), dtype=torch.float32, device=device)
    use_kl, need_out = stage.lambda_kl > 0, stage.lambda_out > 0
    if need_out:
        pos_s, pos_f, pos_h = split_positions(pool.n_ref, config.episode_fractions, split_seed,
                                               global_epoch, device)
        rows_s, rows_f, rows_h = pool.rows(pos_s), pool.rows(pos_f), pool.rows(pos_h)
    # one logits pass over the rows needed: KL rows (D_ref or a subset), then D_score rows
    if use_kl and need_out:
        rows = all_rows if kl_rows is all_rows else torch.cat([kl_rows, rows_s])
    else:
        rows = kl_rows if use_kl else rows_s
    I, r = layer_logits_and_row_weights(params, cfg, pool.X_rows(rows).to(device, dtype), Q[:, rows], K, V)
    n_kl = kl_rows.numel() if use_kl else 0
    if use_kl:
        target = vi_base(Q[:, kl_rows], K, V, cfg)[0] if cfg.base_value_influence else None
        l_kl = kl_loss(I[:, :n_kl], Q[:, kl_rows], K, pool.scaling, target)
        loss = loss + stage.lambda_kl * l_kl
        stats["kl"] = float(l_kl.detach())
    if need_out:
        I_s = I[:, rows_s] if rows is all_rows else I[:, n_kl:]
        r_s = None if r is None else (r[:, rows_s] if rows is all_rows else r[:, n_kl:])
        s = pooled_scores(I_s, config.pooling, r_s)
        ratio = config.ratios[int(torch.randint(len(config.ratios), (1,), generator=gen))]
        Q_f, Q_h = Q[:, rows_f], Q[:, rows_h]
        with torch.no_grad():
            Y_f = full_attention(Q_f.double(), K.double(), V.double(), pool.scaling)
            Y_h = full_attention(Q_h.double(), K.double(), V.double(), pool.scaling)
        hard = hard_branch_loss(s.detach(), Q_f, Q_h, K, V, pool.scaling, ratio,
                                fit_config=config.fit_config, Y_hold=Y_h)
        soft = soft_branch_loss(s, Q_f, Q_h, K, V, pool.scaling, hard, gamma,
                                fit_config=config.fit_config, Y_fit=Y_f, Y_hold=Y_h)
        loss = loss + stage.lambda_out * ste_loss(hard.loss, soft)
        stats.update(out_hard=float(hard.loss), out_soft=float(soft.detach()), ratio=ratio)
    stats["loss"] = float(loss.detach())
    return loss, stats


def train_layer(indexer: ValueAwareIndexer, layer: int, pools: Sequence[ReferencePool],
                config: TrainConfig = TrainConfig(), progress: bool = True,
                resume_state: dict[str, Any] | None = None,
                on_epoch_end: Callable[[dict[str, Any]], None] | None = None,
                max_epochs: int | None = None) -> TrainResult:
    """Train the indexer parameters of ``layer`` on reference pools of that layer.

    Runs the KL warm-up stage then the joint stage (see module docstring). One episode per
    pool per epoch, in a per-epoch shuffled order. All randomness (pool order, ratio, split,
    KL row subset) derives from ``(config.seed, stage, epoch, pool index)``, so a run is
    deterministic and a resumed run reproduces an uninterrupted one exactly.

    Args:
        indexer: the model; its ``layer`` slices are updated in place after every epoch.
        layer: decoder layer to train.
        pools: one :class:`ReferencePool` per training context, all for ``layer``.
        config: hyper-parameters.
        progress: show a tqdm bar.
        resume_state: a ``TrainResult.state`` / ``on_epoch_end`` state to continue from.
        on_epoch_end: called with the resume state after every epoch (e.g. ``torch.save``).
        max_epochs: stop after this many epochs in this call (for time-sliced jobs).

    Returns:
        :class:`TrainResult` with per-epoch metrics and the final resume state.
    """
    from tqdm.auto import tqdm

    _check_pools(indexer, layer, pools)
    if max_epochs is not None and (not isinstance(max_epochs, int) or max_epochs < 1):
        raise ValueError(f"max_epochs must be a positive int or None, got {max_epochs!r}")
    stages = _stages(config)
    n_pools = len(pools)
    params = {k: v.detach().clone().requires_grad_(True) for k, v in indexer.layer_params(layer).items()}
    start_stage, start_epoch, metrics = 0, 0, []
    if resume_state is not None:
        if resume_state.get("layer") != layer or resume_state.get("seed") != config.seed:
            raise ValueError(f"resume_state is for layer {resume_state.get('layer')} seed "
                             f"{resume_state.get('seed')}, not layer {layer} seed {config.seed}")
        if resume_state.get("n_pools") != n_pools:
            raise ValueError(f"resume_state was made with {resume_state.get('n_pools')} pools, "
                             f"got {n_pools}")
        with torch.no_grad():
            for k, v in params.items():
                v.copy_(resume_state["params"][k])
        start_stage, start_epoch = resume_state["stage"], resume_state["epoch"]
        metrics = list(resume_state.get("metrics", []))

    total_left = sum(st.epochs for st in stages[start_stage:]) * n_pools - start_epoch * n_pools
    bar = tqdm(total=total_left, disable=not progress, desc=f"indexer layer {layer}", leave=False)
    epochs_run = 0
    result = TrainResult(metrics=metrics)

    def make_state(stage_idx: int, next_epoch: int, opt: Any, sched: Any) -> dict[str, Any]:
        if next_epoch >= stages[stage_idx].epochs:  # stage done: next one starts fresh
            stage_idx, next_epoch, opt, sched = stage_idx + 1, 0, None, None
        return {
            "layer": layer, "seed": config.seed, "n_pools": n_pools,
            "stage": stage_idx, "epoch": next_epoch,
            "params": {k: v.detach().clone() for k, v in params.items()},
            "optimizer": None if opt is None else copy.deepcopy(opt.state_dict()),
            "scheduler": None if sched is None else copy.deepcopy(sched.state_dict()),
            "rng": {"scheme": "derived from (seed, stage, epoch, pool)", "seed": config.seed},
            "metrics": list(metrics),
        }

    for stage_idx in range(start_stage, len(stages)):
        stage = stages[stage_idx]
        if stage.epochs == 0:
            continue
        total_steps = stage.epochs * n_pools
        opt = torch.optim.AdamW(params.values(), lr=stage.lr, betas=tuple(config.betas),
                                weight_decay=config.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: lr_factor(step, total_steps, config.warmup_frac, config.final_lr_frac))
        first_epoch = 0
        if resume_state is not None and stage_idx == start_stage:
            first_epoch = start_epoch
            if resume_state.get("optimizer") is not None:
                opt.load_state_dict(resume_state["optimizer"])
                sched.load_state_dict(resume_state["scheduler"])
        for epoch in range(first_epoch, stage.epochs):
            global_epoch = sum(st.epochs for st in stages[:stage_idx]) + epoch
            order = torch.randperm(n_pools, generator=torch.Generator().manual_seed(
                _mix_seed(config.seed, stage_idx, epoch, -1)))
            sums: dict[str, float] = {}
            for step_in_epoch, pool_idx in enumerate(order.tolist()):
                step = epoch * n_pools + step_in_epoch
                gamma = config.gamma_start + (config.gamma_end - config.gamma_start) * (
                    step / max(1, total_steps - 1))
                gen = torch.Generator().manual_seed(_mix_seed(config.seed, stage_idx, epoch, pool_idx))
                loss, stats = _episode_loss(params, indexer, pools[pool_idx], stage, config, gen,
                                            _mix_seed(config.seed, pool_idx), global_epoch, gamma)
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"non-finite indexer loss at layer {layer}, stage "
                                             f"{stage.name}, epoch {epoch}, pool {pool_idx}")
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(list(params.values()), config.grad_clip)
                opt.step()
                sched.step()
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + v
                bar.update(1)
                bar.set_postfix({k: f"{v:.4g}" for k, v in stats.items()})
            record = {"stage": stage.name, "epoch": epoch, "lr": opt.param_groups[0]["lr"]}
            if stage.name == "joint":
                record["gamma"] = gamma
            record.update({k: v / n_pools for k, v in sums.items()})
            metrics.append(record)
            indexer.set_layer_params(layer, params)
            result.state = make_state(stage_idx, epoch + 1, opt, sched)
            if on_epoch_end is not None:
                on_epoch_end(result.state)
            epochs_run += 1
            if max_epochs is not None and epochs_run >= max_epochs:
                bar.close()
                result.finished = result.state["stage"] >= len(stages) or all(
                    st.epochs == 0 for st in stages[result.state["stage"]:])
                return result
    bar.close()
    indexer.set_layer_params(layer, params)
    if not result.state:
        result.state = make_state(len(stages) - 1, stages[-1].epochs, None, None)
    result.finished = True
    return result
