"""The attention function that reads a compact cache and adds the fitted bias.

For every query head of a GQA group it computes exactly (paper Eq. (compact_attention) with the
uncompressed block of Eq. (concatenated_attention_preservation))::

    softmax(scaling * q [C_k; K_new]^T + [beta; 0] + causal) [C_v; V_new]

The function is registered in transformers' ``AttentionInterface`` under ``arckv_sdpa`` /
``arckv_eager`` (registration happens on first use, never at import). It recognises a compact
layer by the marker channel of the keys :meth:`arckv_press.cache.CompactLayer.update` returns
(``D + 1`` channels, the compacted block attached as ``keys.arckv_block``) and otherwise delegates
unchanged to the base implementation, so a model switched with :func:`enable_compact_attention`
behaves exactly as before on ordinary caches.

The compacted block is the same for every sequence of a batch (one context, many questions), so
its logits come from one batched matmul per KV head over all queries of the batch and it is never
copied per sequence; the ordinary rows are attended per sequence; one softmax runs over both.

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
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over a compacted block plus ordinary rows (paper Eq. (compact_attention)).

    The parameters follow transformers' attention functions (``dropout`` before ``scaling``), so
    wrappers that pass ``dropout`` positionally (kvpress patches every registered attention
    function that way when it is imported) reach the right parameter.

    Shapes: query ``[B, Hq, n, D]``; key ``[B, Hkv, A, D + 1]`` (ordinary rows and a marker
    channel) carrying ``key.arckv_block = (C_k [Hkv, t, D], beta [Hkv, t], C_v [Hkv, t, D])``
    shared by the batch; value ``[B, Hkv, A, D]``. Returns ``[B, n, Hq, D]`` as transformers'
    attention functions do. Logits, softmax and the weighted sums run in float32 and are cast back
    to the query dtype.
    """
    block = getattr(key, "arckv_block", None)
    if block is None:
        raise ValueError(
            "compact attention got keys without their compacted block (the model changed the key states "
            "between the cache update and attention, which arckv-press does not support)"
        )
    ck, beta, cv = block
    B, Hq, n, D = query.shape
    Hkv, A, t = key.shape[1], key.shape[2], ck.shape[1]
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads are not a multiple of {Hkv} KV heads")
    if A < n:
        raise ValueError(f"compact attention got {n} queries but only {A} ordinary rows")
    G = Hq // Hkv
    scaling = D**-0.5 if scaling is None else scaling
    q = query.float().reshape(B, Hkv, G * n, D)  # query head h * G + g reads KV head h

    # compacted block, one matmul per KV head over every query of the batch: [Hkv, B G n, t]
    qc = q.transpose(0, 1).reshape(Hkv, B * G * n, D)
    logits_c = torch.baddbmm(beta.float()[:, None, :], qc, ck.float().transpose(1, 2), alpha=scaling)
    logits_c = logits_c.view(Hkv, B, G * n, t).transpose(0, 1)  # [B, Hkv, G n, t]

    # ordinary rows, per sequence, with causal / padding masking: [B, Hkv, G, n, A]
    logits_n = torch.matmul(q, key[..., :D].float().transpose(-1, -2)).mul_(scaling).view(B, Hkv, G, n, A)
    if attention_mask is not None:
        m = attention_mask[..., -A:]  # [B, 1 or Hq, n, A]
        m = m.expand(B, Hq, n, A).reshape(B, Hkv, G, n, A)
        if m.dtype == torch.bool:
            logits_n.masked_fill_(~m, float("-inf"))
        else:
            logits_n.add_(m.float())
    elif n > 1:
        i = torch.arange(n, device=query.device)[:, None]
        j = torch.arange(A, device=query.device)[None, :]
        logits_n.masked_fill_(j > i + (A - n), float("-inf"))

    # one softmax over both parts (every query sees the compacted block: at least one finite logit)
    probs = torch.softmax(torch.cat([logits_c, logits_n.view(B, Hkv, G * n, A)], dim=-1), dim=-1)
    if dropout > 0.0 and module is not None and module.training:
        probs = torch.nn.functional.dropout(probs, p=dropout)
    p_c, p_n = probs[..., :t], probs[..., t:]
    out_c = torch.bmm(p_c.transpose(0, 1).reshape(Hkv, B * G * n, t), cv.float())
    out = out_c.view(Hkv, B, G * n, D).transpose(0, 1) + torch.matmul(p_n, value.float())
    return out.reshape(B, Hq, n, D).to(query.dtype).transpose(1, 2).contiguous(), None


def _make_dispatch(base: str):
    def arckv_attention(module, query, key, value, attention_mask, *args, **kwargs):
        if key.shape[-1] == query.shape[-1] + 1:
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
