"""The attention function that reads a compact cache and adds the fitted bias.

For every query head of a GQA group it computes exactly (paper Eq. (compact_attention) with the
uncompressed block of Eq. (concatenated_attention_preservation))::

    softmax(scaling * q [C_k; K_new]^T + [beta; 0] + causal) [C_v; V_new]

The function is registered in transformers' ``AttentionInterface`` under ``arckv_sdpa`` /
``arckv_eager`` (registration happens on first use, never at import). It recognises a compact
layer by the two extra key channels written by :meth:`arckv_press.cache.CompactLayer.update`
(bias, compact flag) and otherwise delegates unchanged to the base implementation, so a model
switched with :func:`enable_compact_attention` behaves exactly as before on ordinary caches.

Masks: transformers builds one mask per forward from a single layer's reported length. Compact
layers report ``span + A`` positions but hold ``t_max + A`` rows, so this function never uses the
mask's columns for the compacted block (always visible, padding carried by a ``-inf`` bias) and
takes only the mask's last ``A`` columns for the ordinary rows (the appended tokens are last in
both layouts). With no mask it applies a bottom-right aligned causal mask on the ordinary rows.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

__all__ = ["compact_attention_forward", "enable_compact_attention", "disable_compact_attention", "compact_attention"]

_PREFIX = "arckv_"
_BASES = ("sdpa", "eager")


def compact_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over a compact working copy (keys carry bias and compact-flag channels).

    Shapes: query ``[B, Hq, n, D]``, key ``[B, Hkv, L, D + 2]``, value ``[B, Hkv, L, D]``. Returns
    ``[B, n, Hq, D]`` as transformers' attention functions do. Logits, softmax and the weighted sum
    run in float32 and are cast back to the query dtype.
    """
    B, Hq, n, D = query.shape
    Hkv, L = key.shape[1], key.shape[2]
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads are not a multiple of {Hkv} KV heads")
    G = Hq // Hkv
    scaling = D**-0.5 if scaling is None else scaling
    k, bias, flag = key[..., :D].float(), key[..., D].float(), key[..., D + 1]
    n_new = int((flag[0, 0] == 0).sum())  # ordinary rows (same for every head)
    if n_new < n:
        raise ValueError(f"compact attention got {n} queries but only {n_new} ordinary rows")

    # Additive float32 mask [B, Hq, n, L]: beta on every row (-inf pads short heads; 0 on ordinary
    # rows), plus causal/padding on the ordinary rows. Then torch's SDPA kernel (the same kernel the
    # model's own path uses, so an uncompacted cache reproduces it to float rounding).
    mask = bias[:, :, None, None, :].expand(B, Hkv, G, n, L).reshape(B, Hq, n, L).clone()
    new_part = mask[..., L - n_new :]
    if attention_mask is not None:
        m = attention_mask[..., -n_new:]  # [B, 1, n, n_new]
        if m.dtype == torch.bool:
            new_part.masked_fill_(~m, float("-inf"))
        else:
            new_part.add_(m.float())
    elif n > 1:
        i = torch.arange(n, device=query.device)[:, None]
        j = torch.arange(n_new, device=query.device)[None, :]
        new_part.masked_fill_(j > i + (n_new - n), float("-inf"))
    training = dropout > 0.0 and module is not None and module.training
    out = torch.nn.functional.scaled_dot_product_attention(
        query.float(), k, value.float(), attn_mask=mask, dropout_p=dropout if training else 0.0, scale=scaling,
        enable_gqa=True,
    ).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def _make_dispatch(base: str):
    def arckv_attention(module, query, key, value, attention_mask, *args, **kwargs):
        if key.shape[-1] == query.shape[-1] + 2:
            return compact_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
        # Look up the library-wide instance (not the class mapping) so that functions other
        # libraries registered on it (e.g. kvpress's masked-key patch) keep working. eager lives in
        # each modeling file; sdpa's kernel computes the same with eager's additive mask.
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        fn = ALL_ATTENTION_FUNCTIONS[base] if base in ALL_ATTENTION_FUNCTIONS else ALL_ATTENTION_FUNCTIONS["sdpa"]
        return fn(module, query, key, value, attention_mask, *args, **kwargs)

    arckv_attention.__name__ = f"arckv_{base}_attention"
    return arckv_attention


def _register() -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    for base in _BASES:
        name = _PREFIX + base
        if name not in AttentionInterface._global_mapping:
            AttentionInterface.register(name, _make_dispatch(base))
        if name not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[base])


def _text_config(model):
    return model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config


def enable_compact_attention(model) -> str:
    """Switch ``model`` to the ARC-KV attention (delegating to its current one on ordinary caches).

    Returns the previous implementation name (for :func:`disable_compact_attention`). Idempotent.
    """
    _register()
    current = model.config._attn_implementation
    if current.startswith(_PREFIX):
        return current[len(_PREFIX) :]
    base = current if current in _BASES else "sdpa"
    model.set_attn_implementation(_PREFIX + base)
    if not _text_config(model)._attn_implementation.startswith(_PREFIX):
        raise ValueError(f"{type(model).__name__} does not let arckv-press set its attention implementation")
    return current


def disable_compact_attention(model, previous: str | None = None) -> None:
    """Restore the attention implementation that was active before :func:`enable_compact_attention`."""
    current = model.config._attn_implementation
    if current.startswith(_PREFIX):
        model.set_attn_implementation(previous or current[len(_PREFIX) :])


@contextlib.contextmanager
def compact_attention(model) -> Iterator[None]:
    """Context manager: ARC-KV attention on inside, the previous implementation restored on exit."""
    previous = enable_compact_attention(model)
    try:
        yield
    finally:
        disable_compact_attention(model, previous)
