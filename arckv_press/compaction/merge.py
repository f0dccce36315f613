"""Convex-hull-constrained key merging (paper Sec. 3.4).

Every cache position is assigned to the anchor whose normalised attention-response profile
is most similar (paper Eqs. (response_profile), (anchor_assignment)); each group is merged
into one compact key that interpolates between the anchor and the group's mass-weighted
centroid (paper Eqs. (mass_centroid), (key_merge)).

Numerics. The paper writes u_j and phi_j with one shared shift z_merge = max_{i,j} l_ij
(per KV head here: each head is its own problem). That shift cancels exactly in both places
that use it: u_j is normalised per key, and phi_j enters mu_r only through the ratios
phi_j / sum_{G_r} phi. We therefore never form exp(l - z_merge), which underflows to an
all-zero profile for keys far below the head's maximum logit. Instead

- u_j = exp(l_:j - m_j) / ||exp(l_:j - m_j)|| with the per-key max m_j = max_i l_ij
  (identical to paper Eq. (response_profile), but its largest entry is 1, never 0/0);
- log phi_j = m_j + log mean_i exp(l_ij - m_j) (paper Eq. (mass_centroid) up to the constant
  -z_merge), and the centroid weights are exp(log phi_j - max_{j' in G_r} log phi_j'), so
  every group has a weight of exactly 1 at its heaviest key and mu_r is always defined.

Memory per call: ``[H, t, n]`` anchor profiles plus one ``[H, block, n]`` logits block and
one ``[H, block, t]`` similarity block; positions are processed in blocks of ``block``.
"""

from __future__ import annotations

import torch

from .checks import (
    check_positive_int,
    check_qk,
    check_scaling,
    check_tensor,
    check_valid,
    compute_dtype,
    hidden_slots,
)

_TIE_ULPS = 8  # similarities within this many ulps of the row max count as ties


def check_anchors(anchors: torch.Tensor, valid: torch.Tensor, T: int) -> torch.Tensor:
    """Validate padded anchors ``[H, t]`` against ``valid``; return ``valid`` (bool).

    Valid anchors must lie in [0, T) and be distinct within a head; every head needs at least
    one valid anchor. Padded slots are ignored (their index is not checked).
    """
    check_tensor(anchors, "anchors", 2)
    if anchors.dtype.is_floating_point or anchors.dtype == torch.bool:
        raise TypeError(f"anchors must be an integer tensor, got {anchors.dtype}")
    H, t = anchors.shape
    valid = check_valid(valid, H, t, anchors.device)
    if t < 1:
        raise ValueError("anchors must have at least one slot")
    empty = ~valid.any(-1)
    if bool(empty.any()):
        raise ValueError(f"head {int(empty.nonzero()[0])} has no valid anchor")
    bad = valid & ((anchors < 0) | (anchors >= T))
    if bool(bad.any()):
        h, r = bad.nonzero()[0].tolist()
        raise ValueError(f"anchor index {int(anchors[h, r])} at head {h} slot {r} is outside [0, T={T})")
    keyed = torch.where(valid, anchors.long(), -1 - torch.arange(t, device=anchors.device).expand(H, t))
    srt = torch.sort(keyed, dim=-1).values
    dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
    if bool(dup.any()):
        h, r = dup.nonzero()[0].tolist()
        raise ValueError(f"head {h} has duplicate anchor position {int(srt[h, r])}")
    return valid


def check_anchor_inputs(
    Q: torch.Tensor, K: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor | None, scaling: float, block: int
) -> tuple[float, torch.Tensor]:
    """Validate ``Q [H, n, D]``, ``K [H, T, D]``, padded ``anchors [H, t]`` and a block size, as
    every function that reads all keys against the anchors of a layer needs; returns the checked
    ``scaling`` and the bool ``valid`` mask (:func:`check_anchors`)."""
    check_qk(Q, K)
    scaling = check_scaling(scaling)
    check_positive_int(block, "block")
    valid = check_anchors(anchors, valid, K.shape[1])
    if anchors.shape[0] != K.shape[0]:
        raise ValueError(f"anchors has {anchors.shape[0]} heads but K has {K.shape[0]}")
    return scaling, valid


def _response_profiles(Qs: torch.Tensor, Kb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised profiles u ``[H, b, n]`` (one row per key) and log phi ``[H, b]`` (up to -z_merge).

    ``Qs`` already carries the softmax scale, so ``Kb @ Qs^T`` are the logits l_ij, transposed: every
    reduction over the rows i runs along the contiguous last axis.
    """
    L = Kb @ Qs.transpose(1, 2)                     # [H, b, n]
    m = L.amax(dim=-1, keepdim=True)                # per-key max over rows
    E = L.sub_(m).exp_()                            # in place: no [H, b, n] temporaries
    log_phi = m.squeeze(-1) + torch.log(E.mean(dim=-1))
    U = E.div_(torch.linalg.vector_norm(E, dim=-1, keepdim=True))   # norm >= 1: max entry is exactly 1
    return U, log_phi


def _assign_and_log_phi(
    Q: torch.Tensor, K: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor, scaling: float, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    H, T, D = K.shape
    t = anchors.shape[1]
    cd = compute_dtype(Q, K)
    Qs = Q.to(cd) * scaling
    Kc = K.to(cd)
    safe = torch.where(valid, anchors.long(), torch.zeros_like(anchors, dtype=torch.long))
    K_S = torch.gather(Kc, 1, safe[..., None].expand(H, t, D))
    U_S, log_phi_S = _response_profiles(Qs, K_S)   # [H, t, n], [H, t]
    U_S = U_S.transpose(1, 2)                        # [H, n, t]
    tie_tol = _TIE_ULPS * torch.finfo(cd).eps
    # only the other positions are compared with the anchors: an anchor is its own group
    slots = torch.arange(t, device=K.device).expand(H, t)
    target = torch.where(valid, safe, torch.full_like(safe, T))  # padded slots -> dummy column
    is_anchor = torch.zeros(H, T + 1, dtype=torch.int8, device=K.device).scatter_(1, target, 1)[:, :T]
    n_other = int((T - is_anchor.sum(-1)).max())
    others = torch.sort(is_anchor, dim=1, stable=True).indices[:, :n_other]  # padded with anchors
    assignment = torch.zeros(H, T + 1, dtype=torch.long, device=K.device)
    log_phi = torch.empty(H, T + 1, dtype=cd, device=K.device)
    hidden = hidden_slots(valid)
    for start in range(0, n_other, block):
        pos = others[:, start:start + block]
        U_b, log_phi_b = _response_profiles(Qs, Kc.gather(1, pos[..., None].expand(-1, -1, D)))
        sim = U_b @ U_S                              # [H, b, t] cosine similarities in [0, 1]
        if hidden is not None:
            sim.masked_fill_(hidden, -1.0)
        best = sim.amax(dim=-1, keepdim=True)
        is_max = sim >= best - tie_tol               # robust ties -> lowest slot r (first True)
        assignment.scatter_(1, pos, is_max.view(torch.uint8).argmax(dim=-1))
        log_phi.scatter_(1, pos, log_phi_b)
    # anchors are assigned to their own slot (paper Eq. (anchor_assignment), kappa(s_r) = r)
    assignment.scatter_(1, target, slots)
    log_phi.scatter_(1, target, log_phi_S)
    return assignment[:, :T].contiguous(), log_phi[:, :T].contiguous()


def assign_to_anchors(
    Q: torch.Tensor,
    K: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor | None,
    scaling: float,
    block: int = 256,
) -> torch.Tensor:
    """Group index kappa(j) in [0, t_max) for every position, ``[H, T]`` long.

    Paper Eqs. (response_profile), (anchor_assignment): each valid anchor s_r is assigned to
    its own slot r; every other position j goes to argmax_r u_j . u_{s_r} over valid r, ties
    (within 8 ulps, so rounding cannot split exact duplicates) resolved by the lowest r.
    z_merge is per head and cancels (see the module docstring). Memory per call is
    O(n t + n block + block t) per head; no ``[H, n, T, t]`` tensor is formed.
    """
    scaling, valid = check_anchor_inputs(Q, K, anchors, valid, scaling, block)
    assignment, _ = _assign_and_log_phi(Q, K, anchors, valid, scaling, block)
    return assignment


def merge_keys(
    Q: torch.Tensor,
    K: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor | None,
    scaling: float,
    lambda_m: float = 0.25,
    block: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merged compact keys ``C_k`` ``[H, t_max, D]`` (dtype of K) and the assignment ``[H, T]``.

    phi_j = mean_i exp(l_ij - z_merge), mu_r = sum_{G_r} phi_j k_j / sum_{G_r} phi_j
    (paper Eq. (mass_centroid)) and c_r = (1 - lambda_m) k_{s_r} + lambda_m mu_r (paper
    Eq. (key_merge)), so c_r lies in conv{k_j : j in G_r}. Groups are accumulated with
    ``index_add_`` over all heads at once; the centroid weights are evaluated in log space
    (module docstring), so a group whose exponentials would all underflow still gets its
    mass-weighted centroid. Padded slots get zero rows.
    """
    scaling, valid = check_anchor_inputs(Q, K, anchors, valid, scaling, block)
    if isinstance(lambda_m, bool) or not isinstance(lambda_m, (int, float)):
        raise TypeError(f"lambda_m must be a float, got {type(lambda_m).__name__}")
    if not (0.0 <= lambda_m <= 1.0):
        raise ValueError(f"lambda_m must be in [0, 1], got {lambda_m}")
    H, T, D = K.shape
    t = anchors.shape[1]
    assignment, log_phi = _assign_and_log_phi(Q, K, anchors, valid, scaling, block)
    cd = log_phi.dtype
    Kc = K.to(cd)
    # centroid weights: exp(log phi_j - max_{G_r} log phi), in (0, 1], max 1 per group
    group_max = torch.full((H, t), -torch.inf, dtype=cd, device=K.device)
    group_max = group_max.scatter_reduce(1, assignment, log_phi, reduce="amax", include_self=True)
    weight = torch.exp(log_phi - torch.gather(group_max, 1, assignment))      # [H, T]
    flat = (assignment + t * torch.arange(H, device=K.device)[:, None]).reshape(-1)
    num = torch.zeros(H * t, D, dtype=cd, device=K.device).index_add_(0, flat, (weight[..., None] * Kc).reshape(-1, D))
    den = torch.zeros(H * t, dtype=cd, device=K.device).index_add_(0, flat, weight.reshape(-1))
    safe = torch.where(valid, anchors.long(), torch.zeros_like(anchors, dtype=torch.long))
    K_S = torch.gather(Kc, 1, safe[..., None].expand(H, t, D))
    den = den.view(H, t, 1)
    mu = torch.where(den > 0, num.view(H, t, D) / den.clamp_min(torch.finfo(cd).tiny), K_S)
    C_k = (1.0 - lambda_m) * K_S + lambda_m * mu
    C_k = C_k.masked_fill(~valid[..., None], 0.0)
    return C_k.to(K.dtype), assignment


__all__ = ["check_anchors", "check_anchor_inputs", "assign_to_anchors", "merge_keys"]
