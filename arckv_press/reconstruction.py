"""Small pure helpers for the cache-reconstruction fidelity study (``scripts/reconstruction.py``).

The study reproduces paper Table (motivation_reconstruction) (Sec. "Cache Reconstruction
Outperforms Token Eviction in Fidelity", App. (background_operators)) and the key-merging
coefficient ablation of App. "Key-Merging Coefficient" (Table (key_merging_coefficient_ablation)).
Model plumbing (prefill, repeat-prefill) and the compaction steps (HA selection, key merging,
beta and C_v fitting) come from the package; this module only adds what the study needs beyond
them:

- the diagnostic *value merging* of the key/value-merging row: mass-weighted value centroids of
  the merge groups with the same interpolation as paper Eq. (key_merge)
  (:func:`log_key_mass`, :func:`group_centroids`, :func:`interpolate_slots`);
- output-fidelity metrics per KV head (:func:`output_fidelity`);
- bookkeeping: disjoint article windows, layer subsets, grouped GQA rows, mean +- SD, markdown.

Shapes follow :mod:`arckv_press.compaction`: K, V ``[H, T, D]``, Q ``[H, n, D]``, padded slots
``[H, t]`` with a bool ``valid`` mask (padded slots hold index 0 and are ignored).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from arckv_press.compaction.reference import grouped_rows
from arckv_press.compaction.checks import (
    check_float,
    check_positive_int,
    check_qk,
    check_scaling,
    check_tensor,
    check_valid,
    compute_dtype,
)

__all__ = [
    "SOURCES",
    "evenly_spaced",
    "parse_layers",
    "layer_subset",
    "disjoint_windows",
    "grouped_rows",
    "gather_slots",
    "log_key_mass",
    "group_centroids",
    "interpolate_slots",
    "output_fidelity",
    "mean_sd",
    "format_pm",
    "markdown_table",
    "join_squad_paragraphs",
    "join_hotpot_paragraphs",
    "load_source_text",
]

SOURCES = {
    "pg": "ruler/pg_essays.txt",
    "squad": "ruler/squad/squad_v2_dev_cs224n_dev_half.json",
    "hotpotqa": "ruler/hotpotqa/hotpotqa_dev_distractor_sample500.json",
}

# --------------------------------------------------------------------------------------
# bookkeeping
# --------------------------------------------------------------------------------------


def evenly_spaced(n: int, k: int) -> list[int]:
    """``k`` distinct indices of ``range(n)`` spread evenly, first and last included (k >= 2).

    Index i is round(i * (n - 1) / (k - 1)) (round half to even); ``k >= n`` gives all of them,
    ``k == 1`` gives [0].
    """
    check_positive_int(n, "n")
    check_positive_int(k, "k")
    if k >= n:
        return list(range(n))
    if k == 1:
        return [0]
    return [round(i * (n - 1) / (k - 1)) for i in range(k)]


def parse_layers(spec: str | None, num_layers: int) -> list[int]:
    """Layer subset from a CLI spec: ``None``/``"all"``, ``"0,5,10"``, ``"0-3,8"`` or ``"even:6"``.

    ``even:k`` is :func:`evenly_spaced` over the model's layers. Returns sorted unique indices;
    an index outside ``[0, num_layers)`` raises ``ValueError``.
    """
    check_positive_int(num_layers, "num_layers")
    if spec is None or spec.strip().lower() == "all":
        return list(range(num_layers))
    spec = spec.strip()
    if spec.startswith("even:"):
        try:
            k = int(spec[5:])
        except ValueError:
            raise ValueError(f"--layers {spec!r}: expected even:<count>") from None
        if k < 1:
            raise ValueError(f"--layers {spec!r}: the count must be >= 1")
        return evenly_spaced(num_layers, k)
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if lo > hi:
                    raise ValueError
                out.update(range(lo, hi + 1))
            else:
                out.add(int(part))
        except ValueError:
            raise ValueError(f"--layers {spec!r}: cannot parse {part!r} (use e.g. 0,5,10 or 0-3 or even:6)") from None
    bad = [i for i in out if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"--layers {spec!r}: layer(s) {sorted(bad)} outside [0, {num_layers})")
    return sorted(out)


def layer_subset(spec: str | None, layers: Sequence[int]) -> list[int]:
    """A subset of the studied ``layers`` (sorted): ``None``/``"all"`` keeps them all, ``"even:k"``
    takes k evenly spaced entries of the list (:func:`evenly_spaced` over positions), and an
    explicit list (``"0,5"``, ``"0-3"``) names layer ids that must all be in ``layers``."""
    layers = sorted(layers)
    if not layers:
        raise ValueError("layers is empty")
    if spec is None or spec.strip().lower() == "all":
        return layers
    if spec.strip().startswith("even:"):
        return [layers[i] for i in parse_layers(spec, len(layers))]
    chosen = parse_layers(spec, max(layers) + 1)
    missing = [i for i in chosen if i not in layers]
    if missing:
        raise ValueError(f"layer subset {spec!r}: layer(s) {missing} are not among the studied layers {layers}")
    return chosen


def disjoint_windows(n_total: int, length: int, count: int, seed: int = 0) -> list[int]:
    """Start offsets of ``count`` disjoint windows of ``length`` tokens in a stream of ``n_total``.

    The stream is cut into floor(n_total / length) consecutive windows; ``count`` of them are
    drawn without replacement by a permutation seeded with ``seed`` and returned ascending.
    """
    check_positive_int(n_total, "n_total")
    check_positive_int(length, "length")
    check_positive_int(count, "count")
    available = n_total // length
    if count > available:
        raise ValueError(
            f"the text has {n_total} tokens: only {available} disjoint windows of {length} tokens, {count} requested"
        )
    g = torch.Generator(device="cpu").manual_seed(seed)
    chosen = torch.randperm(available, generator=g)[:count]
    return sorted(int(i) * length for i in chosen)


def gather_slots(X: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Rows ``X[h, idx[h, r]]`` as ``[H, t, D]``; padded slots (``valid`` False) are zero."""
    check_tensor(X, "X", 3)
    check_tensor(idx, "idx", 2)
    H, T, D = X.shape
    valid = check_valid(valid, H, idx.shape[1], X.device)
    if idx.shape[0] != H:
        raise ValueError(f"idx has {idx.shape[0]} heads but X has {H}")
    safe = torch.where(valid, idx.long(), torch.zeros_like(idx, dtype=torch.long))
    if safe.numel() and (int(safe.min()) < 0 or int(safe.max()) >= T):
        raise ValueError(f"idx must lie in [0, T={T}) on valid slots")
    out = torch.gather(X, 1, safe[..., None].expand(H, safe.shape[1], D))
    return out.masked_fill(~valid[..., None], 0.0)


# --------------------------------------------------------------------------------------
# value merging (diagnostic row of paper Table (motivation_reconstruction))
# --------------------------------------------------------------------------------------


def log_key_mass(Q: torch.Tensor, K: torch.Tensor, scaling: float, block: int = 4096) -> torch.Tensor:
    """log phi_j ``[H, T]`` up to the constant -z_merge (paper Eq. (mass_centroid)).

    phi_j = mean_i exp(scaling q_i . k_j - z_merge), so log phi_j + z_merge =
    logsumexp_i(scaling q_i . k_j) - log n. The constant cancels in every centroid weight
    (phi_j / sum_{G_r} phi), exactly as in :func:`arckv_press.compaction.merge.merge_keys`.
    Float32 (float64 for float64 inputs), blockwise over positions.
    """
    check_qk(Q, K)
    scaling = check_scaling(scaling)
    check_positive_int(block, "block")
    cd = compute_dtype(Q, K)
    Qs = Q.to(cd) * scaling
    parts = [
        torch.logsumexp(Qs @ K[:, a : a + block].to(cd).transpose(1, 2), dim=1)
        for a in range(0, K.shape[1], block)
    ]
    return torch.cat(parts, dim=1) - math.log(Q.shape[1])


def group_centroids(
    X: torch.Tensor, assignment: torch.Tensor, log_phi: torch.Tensor, num_slots: int
) -> torch.Tensor:
    """Mass-weighted group centroids ``[H, t, D]`` (paper Eq. (mass_centroid) applied to X).

    nu_r = sum_{j: kappa(j)=r} phi_j x_j / sum_{j: kappa(j)=r} phi_j with kappa = ``assignment``
    ``[H, T]`` and phi = exp(``log_phi``). The weights are exp(log phi_j - max_{G_r} log phi)
    (<= 1, exactly 1 at the heaviest member), so a group whose phi would all underflow still gets
    its centroid. Empty groups get zero rows. With X = K this is the mu_r of
    :func:`~arckv_press.compaction.merge.merge_keys`; with X = V the value centroid used by the
    diagnostic value merging. Computed in float32 (float64 for float64 inputs), returned in the
    dtype of X.
    """
    check_float(X, "X", 3)
    check_tensor(assignment, "assignment", 2)
    check_float(log_phi, "log_phi", 2)
    check_positive_int(num_slots, "num_slots")
    H, T, D = X.shape
    if tuple(assignment.shape) != (H, T) or tuple(log_phi.shape) != (H, T):
        raise ValueError(
            f"assignment {tuple(assignment.shape)} and log_phi {tuple(log_phi.shape)} must both be [H={H}, T={T}]"
        )
    if assignment.dtype.is_floating_point or assignment.dtype == torch.bool:
        raise TypeError(f"assignment must be an integer tensor, got {assignment.dtype}")
    if int(assignment.min()) < 0 or int(assignment.max()) >= num_slots:
        raise ValueError(f"assignment must lie in [0, num_slots={num_slots})")
    cd = compute_dtype(X, log_phi)
    a, lp = assignment.long(), log_phi.to(cd)
    gmax = torch.full((H, num_slots), -torch.inf, dtype=cd, device=X.device)
    gmax = gmax.scatter_reduce(1, a, lp, reduce="amax", include_self=True)
    weight = torch.exp(lp - torch.gather(gmax, 1, a))                          # [H, T]
    flat = (a + num_slots * torch.arange(H, device=X.device)[:, None]).reshape(-1)
    num = torch.zeros(H * num_slots, D, dtype=cd, device=X.device)
    num.index_add_(0, flat, (weight[..., None] * X.to(cd)).reshape(-1, D))
    den = torch.zeros(H * num_slots, dtype=cd, device=X.device).index_add_(0, flat, weight.reshape(-1))
    den = den.view(H, num_slots, 1)
    out = torch.where(den > 0, num.view(H, num_slots, D) / den.clamp_min(torch.finfo(cd).tiny), 0.0)
    return out.to(X.dtype)


def interpolate_slots(
    anchor_rows: torch.Tensor, centroids: torch.Tensor, lambda_m: float, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """(1 - lambda_m) * anchor_rows + lambda_m * centroids (paper Eq. (key_merge)), padded slots 0.

    Same arithmetic as :func:`~arckv_press.compaction.merge.merge_keys`, so
    ``interpolate_slots(K_S, mu, lam)`` equals ``merge_keys(..., lambda_m=lam)`` and one merge at
    lambda_m = 1 (which returns mu) serves a whole lambda_m sweep.
    """
    check_float(anchor_rows, "anchor_rows", 3)
    check_float(centroids, "centroids", 3)
    if anchor_rows.shape != centroids.shape:
        raise ValueError(f"anchor_rows {tuple(anchor_rows.shape)} and centroids {tuple(centroids.shape)} differ")
    if isinstance(lambda_m, bool) or not isinstance(lambda_m, (int, float)) or not 0.0 <= lambda_m <= 1.0:
        raise ValueError(f"lambda_m must be a float in [0, 1], got {lambda_m!r}")
    H, t, _ = anchor_rows.shape
    valid = check_valid(valid, H, t, anchor_rows.device)
    cd = compute_dtype(anchor_rows, centroids)
    out = (1.0 - lambda_m) * anchor_rows.to(cd) + lambda_m * centroids.to(cd)
    return out.masked_fill(~valid[..., None], 0.0).to(anchor_rows.dtype)


# --------------------------------------------------------------------------------------
# metrics
# --------------------------------------------------------------------------------------


def output_fidelity(O_hat: torch.Tensor, O: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-head fidelity of a reconstructed attention output, each ``[H]`` float64.

    - ``rel_l2``: ||O_hat - O||_F / ||O||_F over the head's n rows (the study's main metric);
    - ``rel_l2_row``: mean_i ||o^_i - o_i|| / ||o_i|| (per-query form, cf. paper Eq. (output_loss));
    - ``cosine``: mean_i cos(o^_i, o_i).

    Zero norms are guarded with the smallest positive float64 (a zero row of O gives a huge
    relative error rather than NaN; a zero row of O_hat has cosine 0).
    """
    check_float(O_hat, "O_hat", 3)
    check_float(O, "O", 3)
    if O_hat.shape != O.shape:
        raise ValueError(f"O_hat {tuple(O_hat.shape)} and O {tuple(O.shape)} differ")
    if O.shape[1] < 1:
        raise ValueError("need at least one held-out row")
    a, b = O_hat.double(), O.double()
    tiny = torch.finfo(torch.float64).tiny
    diff = a - b
    rel = diff.pow(2).sum((1, 2)).sqrt() / b.pow(2).sum((1, 2)).sqrt().clamp_min(tiny)
    nb, na = b.norm(dim=-1), a.norm(dim=-1)
    rel_row = (diff.norm(dim=-1) / nb.clamp_min(tiny)).mean(-1)
    cos = ((a * b).sum(-1) / (na * nb).clamp_min(tiny)).mean(-1)
    return {"rel_l2": rel, "rel_l2_row": rel_row, "cosine": cos}


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample SD (n - 1; 0 for one value) of a non-empty sequence."""
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("mean_sd of an empty sequence")
    m = sum(xs) / len(xs)
    if len(xs) == 1:
        return m, 0.0
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def format_pm(values: Sequence[float], digits: int = 4) -> str:
    """``"mean±sd"`` with ``digits`` decimals (the paper's table style)."""
    m, s = mean_sd(values)
    return f"{m:.{digits}f}±{s:.{digits}f}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table (every row must have ``len(header)`` cells)."""
    for r in rows:
        if len(r) != len(header):
            raise ValueError(f"row {list(r)} has {len(r)} cells, header has {len(header)}")
    lines = ["| " + " | ".join(str(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# data sources (real contexts from ../shared/data beside the repository)
# --------------------------------------------------------------------------------------


def join_squad_paragraphs(obj: dict) -> str:
    """All ``context`` paragraphs of a SQuAD JSON (``data[].paragraphs[].context``), file order,
    separated by blank lines."""
    try:
        paras = [p["context"].strip() for art in obj["data"] for p in art["paragraphs"]]
    except (KeyError, TypeError) as e:
        raise ValueError(f"not a SQuAD JSON (data[].paragraphs[].context): missing {e}") from None
    return "\n\n".join(p for p in paras if p)


def join_hotpot_paragraphs(records: list) -> str:
    """Distinct HotpotQA context paragraphs (``context = [[title, [sentences]]]``) in file order,
    each as ``title\\nsentences`` (first occurrence of a title kept), separated by blank lines."""
    seen: set[str] = set()
    out: list[str] = []
    try:
        for rec in records:
            for title, sents in rec["context"]:
                if title in seen:
                    continue
                seen.add(title)
                body = "".join(sents).strip()
                if body:
                    out.append(f"{title}\n{body}")
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not a HotpotQA record list (context=[[title, [sentences]]]): {e}") from None
    return "\n\n".join(out)


def load_source_text(source: str, data_dir: str | Path) -> str:
    """The long text of a source in ``SOURCES`` (``pg`` essays, ``squad`` or ``hotpotqa`` paragraphs)."""
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; expected one of {sorted(SOURCES)}")
    path = Path(data_dir) / SOURCES[source]
    if not path.exists():
        raise FileNotFoundError(f"{source} data not found at {path}")
    if source == "pg":
        return path.read_text(encoding="utf-8")
    obj = json.loads(path.read_text(encoding="utf-8"))
    return join_squad_paragraphs(obj) if source == "squad" else join_hotpot_paragraphs(obj)
