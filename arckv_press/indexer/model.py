"""The value-aware indexer (paper Sec. 3.3 "Value-Aware Indexer", label sec:key_indexer, and
App. "Value-Aware Indexer Architecture").

For every layer--KV-head pair the indexer holds an independent parameter set (paper
Eqs. (indexer_parameters) and (value_indexer_parameters)); here the sets are stacked on a
leading pair axis ``P = num_layers * num_kv_heads`` with pair index ``p = layer * H + h``, so
all KV heads of one layer are evaluated in one batched pass.

For a reference row ``i`` (activation ``x_i``, post-RoPE query ``q_i``) and cache position ``j``
(post-RoPE key ``k_j``, value ``v_j``):

- value context, Eq. (value_context)::

      A^V_ij = softmax_j( s_A * (U_q q_i) . (U_k k_j) ),     c_i = sum_j A^V_ij U_v v_j

- projections, Eq. (indexer_projection), with ``N(z) = z / sqrt(||z||^2 / d_I + 1e-6)`` applied
  to every width-``d_I`` block ``a``::

      qbar_ia = N((L_q q_i + L_c c_i)_a),  kbar_ja = N((L_k k_j + L_v v_j)_a),  w_ia = (L_x x_i + b_x)_a

- logit, Eq. (pairwise_index_score)::

      I_ij = sum_a w_ia LeakyReLU_0.1( qbar_ia . kbar_ja / sqrt(d_I) )

- context-level score, Eq. (indexer_pooling): ``pi_ij = softmax_j(I_ij)`` pooled over rows
  (``rms`` in the paper; ``mean`` and ``max`` are offered for ablations).

Implementation choices not fixed by the paper (documented deviations):

- ``s_A`` (``IndexerConfig.value_attn_scale``): the paper writes the value-attention logit
  without a scale; we default to ``d_A ** -0.5`` (standard dot-product scaling) because with
  ``U_*`` initialised at std ``d ** -0.5`` the unscaled logits of real post-RoPE queries
  (norms ~10-30) saturate the softmax. Set ``value_attn_scale=1.0`` for the literal formula.
- Initialisation of ``L_q``, ``L_k``, ``L_x``, ``b_x`` (the paper only fixes ``L_c = L_v = 0`` and
  ``U_*`` std ``d ** -0.5``): ``L_q`` and ``L_k`` start as the *same* Gaussian matrix with std
  ``d ** -0.5`` (a random subspace projection), so every index head initially scores the cosine
  of ``q`` and ``k`` in a random ``d_I``-dimensional subspace, a rough proxy of the attention
  logit; ``L_x`` ~ N(0, ``init_std_x``^2) (small) and ``b_x = init_bias_x`` (1.0), so the initial
  head weights are ~1 and do not depend on ``x``. The copies are not tied during training.

Optional residual form (``IndexerConfig.base_logit_scale``; not in the paper; the form of the
checkpoint shipped for the default model, ``docs/indexer.md``): the logit becomes ``I_ij + s_0 * q_i . k_j``, the base model's own attention logit
plus the learned score. With ``init_std_x = init_bias_x = 0`` every head weight ``w_ia`` starts at
0, so ``softmax_j(I_ij)`` is the model's attention and the pooled scores are exactly the
training-free HA scores (tested); training then learns a value-aware correction of HA instead of
a low-rank imitation of the attention it can compute exactly.

With ``IndexerConfig.base_value_influence`` the base is VI instead of HA (also not in the paper):
the logit adds ``log Dn_ij`` and every row's distribution is weighted by ``r_i = sum_j Dn_ij``
before pooling, where ``Dn_ij = D_ij / sqrt(||O_i||^2 + eps)`` is VI's normalised leave-one-out
influence (``compaction.select.value_influence``). At zero head weights ``r_i softmax_j(log
Dn_ij) = Dn_ij``, so the pooled scores are exactly the training-free VI scores (tested), and
training learns a correction of VI, the training-free selector with the least error at small
kept fractions on the default model.

Because ``L_c = L_v = 0`` at initialisation, ``c_i`` does not enter ``qbar`` and ``v_j`` does not
enter ``kbar``: a query--key-only parameter set reproduces its logits exactly whatever ``U_*``
are (the property stated in the paper), tested in ``tests/test_indexer.py``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from arckv_press.compaction.checks import check_float
from arckv_press.compaction.select import value_influence

__all__ = [
    "IndexerConfig",
    "ValueAwareIndexer",
    "PARAM_NAMES",
    "POOLINGS",
    "rms_normalize",
    "value_keys",
    "value_context",
    "query_features",
    "key_features",
    "row_weights",
    "pair_logits",
    "layer_logits",
    "layer_logits_and_row_weights",
    "vi_base",
    "ha_logits",
    "add_base_logits",
]

#: Names of the per-pair parameter tensors (paper Eqs. (indexer_parameters), (value_indexer_parameters)).
PARAM_NAMES = ("L_q", "L_k", "L_x", "b_x", "U_q", "U_k", "U_v", "L_c", "L_v")
#: Row poolings accepted by :meth:`ValueAwareIndexer.scores` (paper Eq. (indexer_pooling) is ``rms``).
POOLINGS = ("rms", "mean", "max")


@dataclass(frozen=True)
class IndexerConfig:
    """Shape of a value-aware indexer for one base model.

    Attributes:
        num_layers: number of decoder layers of the base model (all get an indexer).
        num_kv_heads: KV heads per layer (``H``); pairs ``P = num_layers * num_kv_heads``.
        head_dim: key/value/query head width ``d``.
        d_x: width of the pre-query-projection activation ``x`` (the model's hidden size).
        n_index_heads: number of index heads ``H_I``.
        d_index: width ``d_I`` of each index head.
        d_value_attn: width ``d_A`` of the auxiliary value-attention head.
        leaky_slope: negative slope of the LeakyReLU in Eq. (pairwise_index_score) (0.1).
        rms_eps: epsilon of the parameter-free RMS normalisation ``N`` (1e-6).
        value_attn_scale: logit scale ``s_A`` of the value attention; ``None`` means
            ``d_value_attn ** -0.5`` (see module docstring: not in the paper).
        init_std_x: std of the initial ``L_x`` entries.
        init_bias_x: initial value of every ``b_x`` entry.
        base_logit_scale: if set, the residual form of the module docstring: the logit adds
            ``base_logit_scale * q . k``, the base model's attention logit (pass the model's
            softmax scale, ``AttentionLayout.scaling``). ``None`` (default): the paper's indexer.
        base_value_influence: with ``base_logit_scale``, the residual base is VI instead of HA
            (module docstring): logits add ``log Dn_ij`` and rows are weighted by ``sum_j Dn_ij``.

    The defaults ``H_I = 4, d_I = d_A = 16`` give 18,692 parameters per pair for the default
    model SmolLM2-135M (``d = 64``, ``d_x = 576``, 30 x 3 pairs): 1.68M parameters, 1.25% of
    its 134.5M (the paper's indexers are 0.57-2.13% of their backbones with
    ``H_I = 8, d_I = d_A = 128``).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    d_x: int
    n_index_heads: int = 4
    d_index: int = 16
    d_value_attn: int = 16
    leaky_slope: float = 0.1
    rms_eps: float = 1e-6
    value_attn_scale: float | None = None
    init_std_x: float = 0.02
    init_bias_x: float = 1.0
    base_logit_scale: float | None = None
    base_value_influence: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "d_x", "n_index_heads",
                     "d_index", "d_value_attn"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"IndexerConfig.{name} must be a positive int, got {value!r}")
        for name in ("leaky_slope", "init_std_x", "init_bias_x"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ValueError(f"IndexerConfig.{name} must be finite, got {value!r}")
        if not (self.rms_eps > 0 and math.isfinite(self.rms_eps)):
            raise ValueError(f"IndexerConfig.rms_eps must be positive, got {self.rms_eps!r}")
        if self.base_logit_scale is not None and not (
            self.base_logit_scale > 0 and math.isfinite(self.base_logit_scale)
        ):
            raise ValueError(
                f"IndexerConfig.base_logit_scale must be positive or None, got {self.base_logit_scale!r}"
            )
        if self.base_value_influence and self.base_logit_scale is None:
            raise ValueError("IndexerConfig.base_value_influence needs base_logit_scale (the model's softmax "
                             "scale): VI's influence is computed from the model's attention logits")
        if self.value_attn_scale is not None and not (
            self.value_attn_scale > 0 and math.isfinite(self.value_attn_scale)
        ):
            raise ValueError(
                f"IndexerConfig.value_attn_scale must be positive or None, got {self.value_attn_scale!r}"
            )

    @property
    def num_pairs(self) -> int:
        return self.num_layers * self.num_kv_heads

    @property
    def attn_scale(self) -> float:
        """Value-attention logit scale ``s_A`` actually used."""
        return self.d_value_attn ** -0.5 if self.value_attn_scale is None else self.value_attn_scale

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the stacked parameters ``[P, ...]`` (paper Eqs. (indexer_parameters),
        (value_indexer_parameters))."""
        P, d, d_x = self.num_pairs, self.head_dim, self.d_x
        HI, dI, dA = self.n_index_heads, self.d_index, self.d_value_attn
        return {
            "L_q": (P, HI * dI, d),
            "L_k": (P, HI * dI, d),
            "L_x": (P, HI, d_x),
            "b_x": (P, HI),
            "U_q": (P, dA, d),
            "U_k": (P, dA, d),
            "U_v": (P, dA, d),
            "L_c": (P, HI * dI, dA),
            "L_v": (P, HI * dI, d),
        }

    def params_per_pair(self) -> int:
        return sum(math.prod(s[1:]) for s in self.param_shapes().values())

    def num_parameters(self) -> int:
        return self.num_pairs * self.params_per_pair()

    def to_dict(self) -> dict[str, Any]:
        """Fields as a dict; ``base_logit_scale`` and ``base_value_influence`` only when set, so
        earlier indexers keep the dict (and the run fingerprints and checkpoint metadata built
        from it) they had before these forms existed."""
        out = asdict(self)
        if out["base_logit_scale"] is None:
            del out["base_logit_scale"]
        if not out["base_value_influence"]:
            del out["base_value_influence"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "IndexerConfig":
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown IndexerConfig fields {sorted(unknown)}")
        return cls(**data)

    @classmethod
    def from_model_config(cls, model_config: Any, **overrides: Any) -> "IndexerConfig":
        """Build the config from a Hugging Face ``PretrainedConfig`` (``num_hidden_layers``,
        ``num_key_value_heads``, ``head_dim`` or ``hidden_size // num_attention_heads``,
        ``hidden_size``); keyword overrides set the indexer sizes."""
        cfg = getattr(model_config, "text_config", None) or model_config
        n_heads = int(cfg.num_attention_heads)
        n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
        return cls(
            num_layers=int(cfg.num_hidden_layers),
            num_kv_heads=n_kv,
            head_dim=int(head_dim),
            d_x=int(cfg.hidden_size),
            **overrides,
        )


# ----------------------------------------------------------------------------------------------
# Pure functions on one layer's parameters: ``p[name]`` has shape ``[H, ...]`` (H KV heads).
# ----------------------------------------------------------------------------------------------


def rms_normalize(z: Tensor, eps: float = 1e-6) -> Tensor:
    """Parameter-free RMS normalisation ``N(z) = z / sqrt(||z||^2 / d_I + eps)`` over the last
    axis (paper Eq. (indexer_projection))."""
    return z * torch.rsqrt(z.pow(2).mean(dim=-1, keepdim=True) + eps)


def value_keys(p: dict[str, Tensor], K: Tensor, V: Tensor) -> tuple[Tensor, Tensor]:
    """``(U_k k_j, U_v v_j)`` of paper Eq. (value_context), each ``[H, T, d_A]``."""
    return torch.einsum("had,htd->hta", p["U_k"], K), torch.einsum("had,htd->hta", p["U_v"], V)


def value_context(p: dict[str, Tensor], Q: Tensor, K: Tensor, V: Tensor, scale: float,
                  block_T: int | None = None, kv: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Value context ``c_i`` of paper Eq. (value_context), ``[H, n, d_A]``.

    Blocks over cache positions with an online softmax (running max and denominator), so
    memory is ``O(n * block_T)`` whatever ``T``; with one block (``block_T >= T``) a plain softmax.
    ``kv`` optionally passes precomputed :func:`value_keys`.
    """
    qa = torch.einsum("had,hnd->hna", p["U_q"], Q) * scale  # [H, n, dA]
    ka_all, va_all = value_keys(p, K, V) if kv is None else kv
    T = K.shape[1]
    block_T = T if block_T is None else block_T
    if block_T >= T:  # one block: the fused softmax (equal to the online one up to rounding)
        return torch.softmax(qa @ ka_all.transpose(1, 2), dim=-1) @ va_all
    m = l = acc = None
    for j0 in range(0, T, block_T):
        ka, va = ka_all[:, j0:j0 + block_T], va_all[:, j0:j0 + block_T]  # [H, b, dA]
        a = qa @ ka.transpose(1, 2)  # [H, n, b]
        a_max = a.amax(dim=-1)
        if m is None:
            m = a_max
            e = torch.exp(a - m[..., None])
            l, acc = e.sum(-1), e @ va
        else:
            m_new = torch.maximum(m, a_max)
            corr = torch.exp(m - m_new)
            e = torch.exp(a - m_new[..., None])
            l = l * corr + e.sum(-1)
            acc = acc * corr[..., None] + e @ va
            m = m_new
    return acc / l[..., None]


def query_features(p: dict[str, Tensor], Q: Tensor, c: Tensor, cfg: IndexerConfig) -> Tensor:
    """``qbar`` of paper Eq. (indexer_projection): ``[H, n, H_I, d_I]``."""
    z = torch.einsum("hed,hnd->hne", p["L_q"], Q) + torch.einsum("hea,hna->hne", p["L_c"], c)
    z = z.unflatten(-1, (cfg.n_index_heads, cfg.d_index))
    return rms_normalize(z, cfg.rms_eps)


def key_features(p: dict[str, Tensor], K: Tensor, V: Tensor, cfg: IndexerConfig) -> Tensor:
    """``kbar`` of paper Eq. (indexer_projection): ``[H, T, H_I, d_I]``."""
    z = torch.einsum("hed,htd->hte", p["L_k"], K) + torch.einsum("hed,htd->hte", p["L_v"], V)
    z = z.unflatten(-1, (cfg.n_index_heads, cfg.d_index))
    return rms_normalize(z, cfg.rms_eps)


def row_weights(p: dict[str, Tensor], X: Tensor) -> Tensor:
    """Index-head weights ``w_i = L_x x_i + b_x`` of paper Eq. (indexer_projection): ``[H, n, H_I]``."""
    return torch.einsum("hax,nx->hna", p["L_x"], X) + p["b_x"][:, None, :]


def pair_logits(qbar: Tensor, kbar: Tensor, w: Tensor, slope: float = 0.1) -> Tensor:
    """Indexer logits of paper Eq. (pairwise_index_score): ``[H, n, T]``.

    ``qbar [H, n, H_I, d_I]``, ``kbar [H, T, H_I, d_I]``, ``w [H, n, H_I]``. With autograd: one
    batched matmul over (KV head, index head), then the weighted sum over index heads as ``H_I``
    multiply-adds on ``[H, n, T]``. Without (anchor selection): one index head at a time, each
    ``[H, n, T]`` score matrix made, rectified and added in place, so the ``[H, H_I, n, T]`` scores
    of the batched form are never held (the same sums in the same order).
    """
    q = qbar * qbar.shape[-1] ** -0.5
    grad = torch.is_grad_enabled() and (q.requires_grad or kbar.requires_grad or w.requires_grad)
    if grad:
        s = F.leaky_relu(q.permute(0, 2, 1, 3) @ kbar.permute(0, 2, 3, 1), negative_slope=slope)  # [H, H_I, n, T]
        out = s[:, 0] * w[:, :, 0, None]
        for a in range(1, s.shape[1]):
            out = out.addcmul(s[:, a], w[:, :, a, None])
        return out
    out = None
    for a in range(q.shape[2]):
        s_a = F.leaky_relu_(q[:, :, a] @ kbar[:, :, a].transpose(1, 2), negative_slope=slope)  # [H, n, T]
        out = s_a.mul_(w[:, :, a, None]) if out is None else out.addcmul_(s_a, w[:, :, a, None])
    return out


VI_EPS = 1e-6  # eps of ||O_i||^2 in VI's normalisation, as compaction.select.vi_scores


def ha_logits(Q: Tensor, K: Tensor, scale: float) -> Tensor:
    """The attention logits ``scale * Q K^T`` ``[H, n, T]``: the HA residual form's base, and the HA
    control variate of :meth:`ValueAwareIndexer.scores` (``base=True``)."""
    return (Q * scale) @ K.transpose(1, 2)


def add_base_logits(I: Tensor, Q: Tensor, K: Tensor, cfg: IndexerConfig) -> Tensor:
    """``I + s_0 * Q K^T`` for the HA residual form (``cfg.base_logit_scale``), else ``I``."""
    if cfg.base_logit_scale is None:
        return I
    return I + ha_logits(Q, K, cfg.base_logit_scale)


def vi_base(Q: Tensor, K: Tensor, V: Tensor, cfg: IndexerConfig) -> tuple[Tensor, Tensor]:
    """The VI residual base (``cfg.base_value_influence``) of rows ``Q [H, n, D]`` over the whole
    context ``K, V [H, T, D]``: ``(log Dn [H, n, T], r [H, n])`` with ``Dn`` VI's normalised
    influence (paper Eq. (background_value_selectors)) and ``r_i = sum_j Dn_ij``. Data only (no
    parameters): computed without autograd. Entries of ``Dn`` that underflow to 0 get the
    log of the dtype's smallest normal number, so their softmax weight is ~0, as in VI."""
    with torch.no_grad():
        Dn = value_influence((Q * cfg.base_logit_scale) @ K.transpose(1, 2), V, VI_EPS)
        return torch.log(Dn.clamp_min(torch.finfo(Dn.dtype).tiny)), Dn.sum(-1)


def layer_logits_and_row_weights(p: dict[str, Tensor], cfg: IndexerConfig, X: Tensor, Q: Tensor,
                                 K: Tensor, V: Tensor) -> tuple[Tensor, Tensor | None]:
    """Dense indexer logits ``I [H, n, T]`` for one layer's parameters ``p`` (differentiable),
    and the row weights ``r [H, n]`` the pooling multiplies ``softmax_j(I)`` by (VI base), or
    ``None`` (every other form: rows weigh alike)."""
    c = value_context(p, Q, K, V, cfg.attn_scale)
    I = pair_logits(query_features(p, Q, c, cfg), key_features(p, K, V, cfg),
                    row_weights(p, X), cfg.leaky_slope)
    if cfg.base_value_influence:
        log_dn, r = vi_base(Q, K, V, cfg)
        return I + log_dn, r
    return add_base_logits(I, Q, K, cfg), None


def layer_logits(p: dict[str, Tensor], cfg: IndexerConfig, X: Tensor, Q: Tensor, K: Tensor,
                 V: Tensor) -> Tensor:
    """Dense indexer logits ``I [H, n, T]`` for one layer's parameters ``p`` (differentiable)."""
    return layer_logits_and_row_weights(p, cfg, X, Q, K, V)[0]


# ----------------------------------------------------------------------------------------------
# Module with the stacked parameters.
# ----------------------------------------------------------------------------------------------


def _check_block(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class ValueAwareIndexer(nn.Module):
    """Value-aware indexer for every layer--KV-head pair of one base model.

    Parameters (stacked over pairs ``p = layer * num_kv_heads + h``): ``L_q, L_k
    [P, H_I*d_I, d]``, ``L_x [P, H_I, d_x]``, ``b_x [P, H_I]``, ``U_q, U_k, U_v [P, d_A, d]``,
    ``L_c [P, H_I*d_I, d_A]``, ``L_v [P, H_I*d_I, d]``. Initialisation: see the module docstring.
    Inputs of any float dtype are cast to the parameter dtype; outputs have the parameter dtype.
    """

    def __init__(self, config: IndexerConfig, seed: int = 0) -> None:
        super().__init__()
        if not isinstance(config, IndexerConfig):
            raise TypeError(f"config must be an IndexerConfig, got {type(config).__name__}")
        self.config = config
        for name, shape in config.param_shapes().items():
            self.register_parameter(name, nn.Parameter(torch.zeros(shape)))
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Initialise deterministically from ``seed`` (paper App. "Value-Aware Indexer
        Architecture": ``L_c = L_v = 0``, ``U_*`` std ``d ** -0.5``; rest: module docstring)."""
        cfg = self.config
        gen = torch.Generator().manual_seed(seed)
        std_d = cfg.head_dim ** -0.5

        def normal(shape: tuple[int, ...], std: float) -> Tensor:
            return torch.randn(shape, generator=gen, dtype=torch.float32) * std

        shapes = cfg.param_shapes()
        proj = normal(shapes["L_q"], std_d)
        self.L_q.copy_(proj)
        self.L_k.copy_(proj)
        self.L_x.copy_(normal(shapes["L_x"], cfg.init_std_x))
        self.b_x.fill_(cfg.init_bias_x)
        for name in ("U_q", "U_k", "U_v"):
            getattr(self, name).copy_(normal(shapes[name], std_d))
        self.L_c.zero_()
        self.L_v.zero_()

    # -- parameter access ------------------------------------------------------------------

    def _check_layer(self, layer: Any) -> None:
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise TypeError(f"layer must be an int, got {type(layer).__name__}")
        if not 0 <= layer < self.config.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.config.num_layers})")

    def layer_params(self, layer: int) -> dict[str, Tensor]:
        """Views ``[H, ...]`` of the parameters of every KV head of ``layer``."""
        self._check_layer(layer)
        H = self.config.num_kv_heads
        return {name: getattr(self, name)[layer * H:(layer + 1) * H] for name in PARAM_NAMES}

    @torch.no_grad()
    def set_layer_params(self, layer: int, params: dict[str, Tensor]) -> None:
        """Copy per-layer tensors ``[H, ...]`` (e.g. trained copies) into the stacked parameters."""
        for name, view in self.layer_params(layer).items():
            if name not in params:
                raise ValueError(f"set_layer_params: missing parameter {name!r}")
            if tuple(params[name].shape) != tuple(view.shape):
                raise ValueError(f"set_layer_params: {name} has shape {tuple(params[name].shape)}, "
                                 f"expected {tuple(view.shape)} (layer {layer})")
            view.copy_(params[name])

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # -- evaluation -----------------------------------------------------------------------

    def _prepare(self, layer: int, X: Tensor, Q: Tensor, K: Tensor, V: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        self._check_layer(layer)
        cfg = self.config
        for name, t in (("X", X), ("Q", Q), ("K", K), ("V", V)):
            check_float(t, name, 2 if name == "X" else 3)
        H, D = cfg.num_kv_heads, cfg.head_dim
        if Q.shape[0] != H or Q.shape[2] != D:
            raise ValueError(f"Q must be [H={H}, n, D={D}], got {tuple(Q.shape)} (layer {layer})")
        if K.shape[0] != H or K.shape[2] != D or K.shape[1] < 1:
            raise ValueError(f"K must be [H={H}, T>=1, D={D}], got {tuple(K.shape)} (layer {layer})")
        if V.shape != K.shape:
            raise ValueError(f"V shape {tuple(V.shape)} must equal K shape {tuple(K.shape)} (layer {layer})")
        if X.shape != (Q.shape[1], cfg.d_x):
            raise ValueError(f"X must be [n_rows={Q.shape[1]}, d_x={cfg.d_x}] aligned with the rows "
                             f"of Q, got {tuple(X.shape)} (layer {layer})")
        dtype = self.L_q.dtype
        return X.to(dtype), Q.to(dtype), K.to(dtype), V.to(dtype)

    def logits(self, layer: int, X: Tensor, Q: Tensor, K: Tensor, V: Tensor) -> Tensor:
        """Indexer logits ``I [H, n, T]`` (paper Eq. (pairwise_index_score)) for all KV heads of
        ``layer`` in one batched pass.

        Args:
            layer: decoder layer index.
            X: ``[n, d_x]`` pre-query-projection activations, row ``i`` aligned with row ``i``
                of ``Q[h]`` for every head (under GQA repeat ``x_r`` for each query head).
            Q: ``[H, n, D]`` post-RoPE reference queries.
            K, V: ``[H, T, D]`` post-RoPE keys and values of the cache.
        """
        X, Q, K, V = self._prepare(layer, X, Q, K, V)
        return layer_logits(self.layer_params(layer), self.config, X, Q, K, V)

    @torch.no_grad()
    def scores(self, layer: int, X: Tensor, Q: Tensor, K: Tensor, V: Tensor, pooling: str = "rms",
               block_rows: int = 32, block_T: int = 32768, base: bool = False,
               base_scale: float | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Context-level scores ``s [H, T]`` (paper Eq. (indexer_pooling)), computed blockwise.

        Rows are processed ``block_rows`` at a time and positions ``block_T`` at a time: the
        value context uses an online softmax over position blocks, then the row-wise softmax
        of ``I`` uses a first pass for the log-partition and a second pass to accumulate the
        pooled statistic, so no ``[n, T]`` tensor is ever formed (peak intermediate
        ``[H, H_I, block_rows, block_T]``). When ``block_T >= T`` (the default up to 32K
        positions) the logits are computed once.
        The VI base (``base_value_influence``) needs each row's attention output over the whole
        context, so it holds ``[H, block_rows, T]`` per row block, as ``vi_scores`` does.
        Runs without autograd (inference); training pools differentiable logits instead.
        Same arguments as :meth:`logits`; ``pooling`` in ``rms | mean | max``.

        ``base=True`` also returns a base selector's scores pooled over the same rows,
        ``(s, s_base)``, the control variate of :func:`arckv_press.compaction.select.corrected_scores`:
        the residual form's own base (HA's ``softmax_j(s_0 q_i . k_j)``, or VI's ``Dn_ij``), or for the
        paper's form HA at ``base_scale`` (the model's softmax scale; required there, and for a
        residual form it must be ``s_0``).
        """
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        _check_block("block_rows", block_rows)
        _check_block("block_T", block_T)
        cfg = self.config
        if base_scale is not None and not (base_scale > 0 and math.isfinite(base_scale)):
            raise ValueError(f"base_scale must be positive, got {base_scale!r}")
        if base and cfg.base_logit_scale is None and base_scale is None:
            raise ValueError("scores(base=True) of the paper's indexer needs base_scale (the model's softmax scale): "
                             "it has no base selector of its own")
        if cfg.base_logit_scale is not None and base_scale is not None and not math.isclose(
                base_scale, cfg.base_logit_scale, rel_tol=1e-6):
            raise ValueError(f"base_scale {base_scale} is not this residual indexer's base_logit_scale "
                             f"{cfg.base_logit_scale}: the control variate would pool another base")
        scale0 = cfg.base_logit_scale if cfg.base_logit_scale is not None else (base_scale if base else None)
        X, Q, K, V = self._prepare(layer, X, Q, K, V)
        p = self.layer_params(layer)
        n, T = Q.shape[1], K.shape[1]
        if n < 1:
            raise ValueError(f"scores needs at least one reference row, got Q {tuple(Q.shape)}")
        kbar = key_features(p, K, V, cfg)  # [H, T, H_I, d_I]: O(T) like K itself
        # stored as [H, H_I, d_I, T], the layout pair_logits multiplies by (no copy per row block)
        kbar = kbar.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        kv = value_keys(p, K, V)  # 2 x [H, T, d_A]
        accs = [torch.zeros(Q.shape[0], T, dtype=Q.dtype, device=Q.device) for _ in range(2 if base else 1)]
        t_blocks = [(j0, min(T, j0 + block_T)) for j0 in range(0, T, block_T)]
        for r0 in range(0, n, block_rows):
            Qb, Xb = Q[:, r0:r0 + block_rows], X[r0:r0 + block_rows]
            c = value_context(p, Qb, K, V, cfg.attn_scale, block_T, kv=kv)
            qbar, w = query_features(p, Qb, c, cfg), row_weights(p, Xb)
            log_dn, r = vi_base(Qb, K, V, cfg) if cfg.base_value_influence else (None, None)

            def block_logits(j0: int, j1: int) -> list[Tensor]:
                """The logits of every pooled distribution at positions j0..j1: the indexer's, then the base's."""
                if log_dn is not None:
                    b = log_dn[:, :, j0:j1]
                elif scale0 is not None:
                    b = ha_logits(Qb, K[:, j0:j1], scale0)
                else:
                    b = None
                I = pair_logits(qbar, kbar[:, j0:j1], w, cfg.leaky_slope)
                if b is not None and cfg.base_logit_scale is not None:  # the residual forms add their base
                    I.add_(b)
                return [I, b] if base else [I]

            if len(t_blocks) == 1:
                blocks = [[torch.softmax(z, dim=-1) for z in block_logits(0, T)]]
            else:
                stats = None  # online log-sum-exp over position blocks, per pooled distribution
                for j0, j1 in t_blocks:
                    zs = block_logits(j0, j1)
                    maxes = [z.amax(-1) for z in zs]
                    if stats is None:
                        stats = [(m, torch.exp(z - m[..., None]).sum(-1)) for z, m in zip(zs, maxes)]
                    else:
                        new = []
                        for (m, s), z, b_max in zip(stats, zs, maxes):
                            m_new = torch.maximum(m, b_max)
                            new.append((m_new, s * torch.exp(m - m_new) + torch.exp(z - m_new[..., None]).sum(-1)))
                        stats = new
                lses = [(m + torch.log(s))[..., None] for m, s in stats]
                blocks = ([torch.exp(z - lse) for z, lse in zip(block_logits(j0, j1), lses)] for j0, j1 in t_blocks)
            for (j0, j1), probs in zip(t_blocks, blocks):
                for acc, pi in zip(accs, probs):
                    if r is not None:
                        pi = pi.mul_(r[..., None])
                    if pooling == "rms":
                        acc[:, j0:j1] += pi.square_().sum(1)
                    elif pooling == "mean":
                        acc[:, j0:j1] += pi.sum(1)
                    else:
                        acc[:, j0:j1] = torch.maximum(acc[:, j0:j1], pi.amax(1))
        out = [(acc / n).sqrt() if pooling == "rms" else acc / n if pooling == "mean" else acc for acc in accs]
        return (out[0], out[1]) if base else out[0]

    def extra_repr(self) -> str:
        c = self.config
        return (f"pairs={c.num_pairs} (layers={c.num_layers} x kv_heads={c.num_kv_heads}), "
                f"H_I={c.n_index_heads}, d_I={c.d_index}, d_A={c.d_value_attn}, "
                f"params={self.num_parameters():,}")
