"""Input checks and small helpers shared by the compaction steps (one definition each).

Every public tensor function of ``arckv_press.compaction`` validates its inputs with these, so a bad
shape, dtype, device or a NaN gives the same clear error everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

__all__ = ["all_finite", "check_float", "check_positive_int", "check_qk", "check_ratio", "check_scaling", "check_tensor",
           "check_valid", "check_values", "compute_dtype", "hidden_slots", "row_blocks"]


def check_tensor(x: torch.Tensor, name: str, ndim: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(x.shape)}")


def check_float(x: torch.Tensor, name: str, ndim: int) -> None:
    check_tensor(x, name, ndim)
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got dtype {x.dtype}")
    if not all_finite(x):
        raise ValueError(f"{name} contains NaN or inf")


def hidden_slots(valid: torch.Tensor) -> torch.Tensor | None:
    """``~valid [H, 1, t]`` for masking ``[H, rows, t]`` blocks, or None when every slot is valid (no
    masking pass)."""
    return None if bool(valid.all()) else ~valid[:, None, :]


def all_finite(x: torch.Tensor) -> bool:
    """No NaN or inf in ``x``. A NaN or inf entry makes the sum NaN or inf, so a finite sum (one
    vectorised reduction) proves it; a sum that is not finite may also have overflowed, and then the
    minimum and maximum decide (NaN propagates through both)."""
    if x.numel() == 0:
        return True
    if bool(torch.isfinite(x.sum())):
        return True
    lo, hi = torch.aminmax(x)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def check_scaling(scaling: float) -> float:
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)):
        raise TypeError(f"scaling must be a python float, got {type(scaling).__name__}")
    if not math.isfinite(scaling) or scaling <= 0:
        raise ValueError(f"scaling must be finite and > 0, got {scaling}")
    return float(scaling)


def check_nonnegative(value: float, name: str) -> float:
    """A finite number >= 0 (bools refused), else ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return value


def check_positive_int(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def check_qk(Q: torch.Tensor, K: torch.Tensor) -> None:
    """Q ``[H, n, D]`` and K ``[H, T, D]`` with matching heads, head dim and device."""
    check_float(Q, "Q", 3)
    check_float(K, "K", 3)
    if Q.shape[0] != K.shape[0] or Q.shape[2] != K.shape[2]:
        raise ValueError(f"Q {tuple(Q.shape)} and K {tuple(K.shape)} must share H and D")
    if Q.shape[1] < 1 or K.shape[1] < 1:
        raise ValueError(f"need at least one query row and one key, got Q {tuple(Q.shape)}, K {tuple(K.shape)}")
    if Q.device != K.device:
        raise ValueError(f"Q on {Q.device} but K on {K.device}")


def check_values(V: torch.Tensor, K: torch.Tensor, name: str = "V") -> None:
    check_float(V, name, 3)
    if V.shape[:2] != K.shape[:2]:
        raise ValueError(f"{name} {tuple(V.shape)} must match K {tuple(K.shape)} on [H, T]")
    if V.device != K.device:
        raise ValueError(f"{name} on {V.device} but K on {K.device}")


def check_valid(valid: torch.Tensor | None, H: int, t: int, device: torch.device) -> torch.Tensor:
    """Return a bool ``[H, t]`` mask (all True when ``valid`` is None)."""
    if valid is None:
        return torch.ones(H, t, dtype=torch.bool, device=device)
    check_tensor(valid, "valid", 2)
    if valid.dtype != torch.bool:
        raise TypeError(f"valid must be a bool tensor, got {valid.dtype}")
    if tuple(valid.shape) != (H, t):
        raise ValueError(f"valid must have shape {(H, t)}, got {tuple(valid.shape)}")
    if valid.device != device:
        raise ValueError(f"valid on {valid.device} but expected {device}")
    return valid


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (bf16/fp16 are upcast)."""
    return torch.float64 if any(x.dtype == torch.float64 for x in tensors) else torch.float32


def row_blocks(n: int, block_rows: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n, block_rows):
        yield start, min(start + block_rows, n)


def check_ratio(ratio: float, name: str = "ratio") -> float:
    """The kept fraction rho = t/T (the paper's convention) as a float in (0, 1]; the one place it is
    validated (kvpress's ``compression_ratio = 1 - ratio`` is converted before this)."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(ratio).__name__} {ratio!r}")
    if not (math.isfinite(ratio) and 0.0 < ratio <= 1.0):
        raise ValueError(f"{name} is the kept fraction and must be in (0, 1], got {ratio!r}")
    return float(ratio)
