"""Saving and loading value-aware indexer checkpoints.

A checkpoint is a directory with two files:

- ``indexer.safetensors``: the stacked parameters (names of
  :data:`arckv_press.indexer.model.PARAM_NAMES`, shapes ``[P, ...]``) and, optionally,
  ``budget_weights [num_layers, num_kv_heads]``: the per-head budget weights ``a_{l,h}`` of
  paper Eq. (per_head_budget).
- ``metadata.json``: :class:`IndexerMetadata` (base model id, base-config hash from
  :func:`arckv_press.models.config_hash`, indexer config, training-data summary, package
  version, creation date, format version).

:func:`load_indexer` refuses a checkpoint trained for another base model: an indexer is tied
to the keys, values and activations of one frozen model (paper Sec. 3.5).
Shipped checkpoints live in ``arckv_press/indexer/weights/<model id with '/' -> '--'>/``.

Training resume states (:func:`save_resume_state` / :func:`read_resume_state`) are safetensors
files too: the tensors (parameters, AdamW moments) as entries, everything else (stage, epoch,
metrics, the optimizer's and scheduler's plain settings) as JSON in the header, with the run
fingerprint beside it. Nothing the package reads is a pickle, so no file can run code when it is
loaded, and the fingerprint is checked from the header before any tensor is read.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from .model import PARAM_NAMES, IndexerConfig, ValueAwareIndexer

__all__ = [
    "FORMAT_VERSION",
    "WEIGHTS_FILE",
    "METADATA_FILE",
    "WEIGHTS_DIR",
    "IndexerMetadata",
    "model_dir_name",
    "save_indexer",
    "load_indexer",
    "read_metadata",
    "default_indexer_path",
    "resolve_indexer",
    "checkpoint_id",
    "RESUME_FORMAT",
    "save_resume_state",
    "read_resume_state",
]

FORMAT_VERSION = 1
WEIGHTS_FILE = "indexer.safetensors"
METADATA_FILE = "metadata.json"
#: Directory of the weights shipped with the package.
WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"


@dataclass
class IndexerMetadata:
    """Metadata stored next to the weights.

    Attributes:
        model_id: Hugging Face id (or path) of the frozen base model the indexer was trained on.
        config_hash: :func:`arckv_press.models.config_hash` of the base model's config (the
            same fingerprint the compact-cache metadata and :mod:`arckv_press.api` use).
        indexer_config: :class:`IndexerConfig` as a dict.
        has_budget_weights: whether ``budget_weights [L, H]`` is stored.
        training: free-form summary of the training data and schedule (JSON-serialisable).
        package_version: ``arckv_press.__version__`` at save time.
        created: ISO-8601 UTC timestamp of the save.
        format_version: checkpoint format version (:data:`FORMAT_VERSION`).
    """

    model_id: str
    config_hash: str
    indexer_config: dict[str, Any]
    has_budget_weights: bool = False
    training: dict[str, Any] = field(default_factory=dict)
    package_version: str = ""
    created: str = ""
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "metadata") -> "IndexerMetadata":
        required = ("model_id", "config_hash", "indexer_config")
        missing = [k for k in required if k not in data]
        if missing:
            raise ValueError(f"{source}: missing metadata fields {missing}")
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


def model_dir_name(model_id: str) -> str:
    """Directory name of a model id: ``'org/name'`` -> ``'org--name'``."""
    if not isinstance(model_id, str) or not model_id:
        raise ValueError(f"model_id must be a non-empty string, got {model_id!r}")
    return model_id.strip("/").replace("/", "--")


def _package_version() -> str:
    try:
        from arckv_press import __version__
    except ImportError:  # pragma: no cover
        return "unknown"
    return __version__


def _check_budget_weights(budget_weights: Tensor, config: IndexerConfig) -> Tensor:
    if not isinstance(budget_weights, Tensor):
        raise TypeError(f"budget_weights must be a torch.Tensor, got {type(budget_weights).__name__}")
    shape = (config.num_layers, config.num_kv_heads)
    if tuple(budget_weights.shape) != shape:
        raise ValueError(f"budget_weights must have shape {shape} [num_layers, num_kv_heads], "
                         f"got {tuple(budget_weights.shape)}")
    bw = budget_weights.detach().to(torch.float32).cpu().contiguous()
    if not torch.isfinite(bw).all() or (bw < 0).any():
        raise ValueError("budget_weights must be finite and nonnegative")
    return bw


def save_indexer(indexer: ValueAwareIndexer, path: str | Path, model_id: str, config_hash: str,
                 budget_weights: Tensor | None = None, training: dict[str, Any] | None = None
                 ) -> Path:
    """Write ``indexer`` (and optional ``budget_weights [L, H]``) to directory ``path``.

    Returns the directory. Existing files of the same names are overwritten.
    """
    if not isinstance(indexer, ValueAwareIndexer):
        raise TypeError(f"indexer must be a ValueAwareIndexer, got {type(indexer).__name__}")
    model_dir_name(model_id)  # validates
    if not isinstance(config_hash, str) or not config_hash:
        raise ValueError(f"config_hash must be a non-empty string, got {config_hash!r}")
    training = dict(training or {})
    json.dumps(training)  # fail early on non-serialisable summaries
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {name: getattr(indexer, name).detach().cpu().contiguous() for name in PARAM_NAMES}
    for name, t in tensors.items():
        if not torch.isfinite(t).all():
            raise ValueError(f"save_indexer: parameter {name} contains NaN or inf")
    if budget_weights is not None:
        tensors["budget_weights"] = _check_budget_weights(budget_weights, indexer.config)
    meta = IndexerMetadata(
        model_id=model_id,
        config_hash=config_hash,
        indexer_config=indexer.config.to_dict(),
        has_budget_weights=budget_weights is not None,
        training=training,
        package_version=_package_version(),
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    )
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "arckv-indexer",
                                                          "format_version": str(FORMAT_VERSION)})
    (path / METADATA_FILE).write_text(meta.to_json() + "\n")
    return path


def read_metadata(path: str | Path) -> IndexerMetadata:
    """Read ``metadata.json`` of a checkpoint directory."""
    path = Path(path)
    meta_file = path / METADATA_FILE
    if not meta_file.is_file():
        raise FileNotFoundError(f"no {METADATA_FILE} in indexer checkpoint {path}")
    try:
        data = json.loads(meta_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{meta_file}: invalid JSON ({err})") from err
    if not isinstance(data, dict):
        raise ValueError(f"{meta_file}: expected a JSON object")
    meta = IndexerMetadata.from_dict(data, source=str(meta_file))
    if meta.format_version > FORMAT_VERSION:
        raise ValueError(f"{meta_file}: format_version {meta.format_version} is newer than the "
                         f"supported {FORMAT_VERSION}; upgrade arckv-press")
    return meta


def load_indexer(path: str | Path, model_id: str | None = None, config_hash: str | None = None,
                 map_location: str | torch.device = "cpu"
                 ) -> tuple[ValueAwareIndexer, IndexerMetadata, Tensor | None]:
    """Load a checkpoint directory, checking it belongs to the requested base model.

    Args:
        path: checkpoint directory (see module docstring).
        model_id: if given, must equal the stored ``model_id``.
        config_hash: if given, must equal the stored ``config_hash``
            (:func:`arckv_press.models.config_hash` of the base model).
        map_location: device for the loaded tensors.

    Returns:
        ``(indexer, metadata, budget_weights)``; ``budget_weights`` is ``[L, H]`` or ``None``.

    Raises:
        ValueError: mismatched model id or config hash (the message names both), or weights
            inconsistent with the stored indexer config.
    """
    path = Path(path)
    meta = read_metadata(path)
    if model_id is not None and model_id != meta.model_id:
        raise ValueError(f"indexer checkpoint {path} was trained for model {meta.model_id!r}, "
                         f"not for the requested model {model_id!r}")
    if config_hash is not None and config_hash != meta.config_hash:
        raise ValueError(f"indexer checkpoint {path} has base-config hash {meta.config_hash!r} "
                         f"(model {meta.model_id!r}) but the requested model has config hash "
                         f"{config_hash!r}{'' if model_id is None else f' (model {model_id!r})'}")
    weights_file = path / WEIGHTS_FILE
    if not weights_file.is_file():
        raise FileNotFoundError(f"no {WEIGHTS_FILE} in indexer checkpoint {path}")
    config = IndexerConfig.from_dict(meta.indexer_config)
    tensors = load_file(str(weights_file), device=str(map_location))
    missing = [n for n in PARAM_NAMES if n not in tensors]
    if missing:
        raise ValueError(f"{weights_file}: missing parameters {missing}")
    indexer = ValueAwareIndexer(config).to(map_location)
    for name, shape in config.param_shapes().items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{weights_file}: parameter {name} has shape {tuple(tensors[name].shape)}, "
                             f"the stored indexer config implies {shape}")
    indexer.load_state_dict({n: tensors[n] for n in PARAM_NAMES})
    budget = tensors.get("budget_weights")
    if meta.has_budget_weights and budget is None:
        raise ValueError(f"{weights_file}: metadata announces budget_weights but none are stored")
    if budget is not None:
        _check_budget_weights(budget, config)
    return indexer, meta, budget


def default_indexer_path(model_id: str) -> Path | None:
    """Directory of the shipped checkpoint for ``model_id``, or ``None`` if none is shipped."""
    path = WEIGHTS_DIR / model_dir_name(model_id)
    if (path / WEIGHTS_FILE).is_file() and (path / METADATA_FILE).is_file():
        return path
    return None


def checkpoint_id(path: str | Path) -> str:
    """Short content id of a checkpoint: 12 hex digits of a SHA-256 over its stored tensors.

    Hashes each tensor's name, dtype, shape and bytes from ``indexer.safetensors`` (not the
    header's free-form metadata, whose key order safetensors does not fix), so equal weights give
    equal ids. Results that depend on the indexer (needle grid, lm-eval compaction records,
    selector evaluations) store it, so a result made with one checkpoint is never taken for
    another's.
    """
    weights_file = Path(path) / WEIGHTS_FILE
    if not weights_file.is_file():
        raise FileNotFoundError(f"no {WEIGHTS_FILE} in indexer checkpoint {path}")
    raw = weights_file.read_bytes()
    try:
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + n])
    except ValueError as err:
        raise ValueError(f"{weights_file}: not a safetensors file ({err})") from err
    header.pop("__metadata__", None)
    data = raw[8 + n :]
    digest = hashlib.sha256()
    for name in sorted(header):
        entry = header[name]
        lo, hi = entry["data_offsets"]
        digest.update(json.dumps([name, entry["dtype"], entry["shape"]]).encode())
        digest.update(data[lo:hi])
    return digest.hexdigest()[:12]


# ----------------------------------------------------------------------------------------------
# Training resume states: safetensors + JSON (no pickle)
# ----------------------------------------------------------------------------------------------

#: ``format`` entry of a resume state's safetensors header.
RESUME_FORMAT = "arckv-indexer-resume"
RESUME_FORMAT_VERSION = 1
_TENSOR, _TUPLE, _DICT = "__tensor__", "__tuple__", "__dict__"


def _encode_state(obj: Any, tensors: dict[str, Tensor], where: str) -> Any:
    """JSON form of ``obj`` (tensors moved into ``tensors``); only plain data is accepted."""
    if isinstance(obj, Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = obj.detach().cpu().contiguous().clone()  # no shared storage in the file
        return {_TENSOR: name}
    if obj is None or isinstance(obj, (bool, int, float, str)):  # NaN / inf: JSON's NaN / Infinity
        return obj
    if isinstance(obj, (list, tuple)):
        items = [_encode_state(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]
        return {_TUPLE: items} if isinstance(obj, tuple) else items
    if isinstance(obj, dict):
        pairs = []
        for k, v in obj.items():
            if isinstance(k, bool) or not isinstance(k, (int, str)):
                raise TypeError(f"resume state: {where} has a key of type {type(k).__name__}; only int and str keys are stored")
            pairs.append([k, _encode_state(v, tensors, f"{where}[{k!r}]")])
        return {_DICT: pairs}
    raise TypeError(f"resume state: {where} is a {type(obj).__name__}; only tensors, numbers, strings, None, "
                    "lists, tuples and dicts are stored")


def _decode_state(obj: Any, tensors: dict[str, Tensor], where: str, source: str) -> Any:
    def bad(what: str) -> ValueError:
        return ValueError(f"{source}: resume state field {where}: {what}")

    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [_decode_state(v, tensors, f"{where}[{i}]", source) for i, v in enumerate(obj)]
    if not isinstance(obj, dict) or len(obj) != 1:
        raise bad(f"expected a value, a list or one of {_TENSOR}/{_TUPLE}/{_DICT}, got {str(obj)[:80]}")
    (kind, value), = obj.items()
    if kind == _TENSOR:
        if not isinstance(value, str) or value not in tensors:
            raise bad(f"names tensor {value!r}, which the file does not hold")
        return tensors[value]
    if kind == _TUPLE and isinstance(value, list):
        return tuple(_decode_state(v, tensors, f"{where}[{i}]", source) for i, v in enumerate(value))
    if kind == _DICT and isinstance(value, list):
        out = {}
        for pair in value:
            if (not isinstance(pair, list) or len(pair) != 2 or isinstance(pair[0], bool)
                    or not isinstance(pair[0], (int, str))):
                raise bad(f"a dict entry must be [int or str key, value], got {str(pair)[:80]}")
            out[pair[0]] = _decode_state(pair[1], tensors, f"{where}[{pair[0]!r}]", source)
        return out
    raise bad(f"unknown entry {kind!r}")


def save_resume_state(path: str | Path, state: dict[str, Any], fingerprint: str) -> Path:
    """Write a training resume state (plain data and tensors only) to the safetensors file
    ``path`` atomically (a temporary file beside it, then a rename), with ``fingerprint`` in the
    header. Raises ``TypeError`` for anything else (say an object that only pickle could store)."""
    from safetensors.torch import save_file

    if not isinstance(state, dict):
        raise TypeError(f"a resume state must be a dict, got {type(state).__name__}")
    if not isinstance(fingerprint, str) or not fingerprint:
        raise ValueError(f"fingerprint must be a non-empty string, got {fingerprint!r}")
    tensors: dict[str, Tensor] = {}
    tree = _encode_state(state, tensors, "state")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata={"format": RESUME_FORMAT, "format_version": str(RESUME_FORMAT_VERSION),
                                           "fingerprint": fingerprint, "state": json.dumps(tree)})
    os.replace(tmp, path)
    return path


def read_resume_state(path: str | Path, fingerprint: str | None = None) -> dict[str, Any]:
    """The resume state saved by :func:`save_resume_state` at ``path``.

    The header is read first: a file that is not a safetensors resume state (a pickle, say), of
    a newer format version or, when ``fingerprint`` is given, of another run is refused with a
    ``ValueError`` naming the file before any tensor is read. Nothing in the file is executed.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != RESUME_FORMAT:
                raise ValueError(f"{path} is not an arckv-press resume state (header format "
                                 f"{meta.get('format')!r}, expected {RESUME_FORMAT!r})")
            version = meta.get("format_version", "")
            if not version.isdigit() or int(version) > RESUME_FORMAT_VERSION:
                raise ValueError(f"{path}: resume state format_version {version!r} is not one this version "
                                 f"reads (up to {RESUME_FORMAT_VERSION}); upgrade arckv-press or delete the file")
            if fingerprint is not None and meta.get("fingerprint") != fingerprint:
                raise ValueError(f"{path} belongs to another run (fingerprint {meta.get('fingerprint')} != "
                                 f"{fingerprint}); use another --shard-dir or delete it")
            try:
                tree = json.loads(meta.get("state", ""))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: the resume state's JSON is damaged ({err})") from err
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except SafetensorError as err:
        raise ValueError(f"{path} is not a readable safetensors resume state ({err})") from err
    state = _decode_state(tree, tensors, "state", str(path))
    if not isinstance(state, dict):
        raise ValueError(f"{path}: the resume state is a {type(state).__name__}, expected a dict")
    return state


def resolve_indexer(method: str, indexer, model):
    """``(indexer, budget weights shipped with it)`` for method ``arckv`` (``indexer``: a checkpoint
    path, a loaded indexer, or ``None`` for the one shipped for ``model``), else ``(None, None)``."""
    if method != "arckv":
        return None, None
    if indexer is not None and not isinstance(indexer, (str, Path)):
        _check_indexer_shape(indexer, model)
        return indexer, None
    from arckv_press.models import config_hash, model_id

    mid = model_id(model)
    path = indexer or default_indexer_path(mid)
    if path is None:
        raise ValueError(
            f"no value-aware indexer is shipped for {mid!r}: pass indexer=<checkpoint path> "
            "(train one with scripts/train_indexer.py) or use a training-free method (arckv-ha, arckv-vi)"
        )
    indexer, _meta, budget_weights = load_indexer(path, model_id=mid, config_hash=config_hash(model.config))
    return indexer, budget_weights


def _check_indexer_shape(indexer, model) -> None:
    """A loaded indexer (no checkpoint metadata to compare) must have the model's layer, KV-head and
    width sizes; a mismatch is an error naming both, not a shape failure deep inside its scores."""
    fields = ("num_layers", "num_kv_heads", "head_dim", "d_x")
    have = getattr(indexer, "config", None)
    if not isinstance(have, IndexerConfig):
        raise TypeError(f"indexer must be a checkpoint path or a ValueAwareIndexer, got {type(indexer).__name__}")
    want = IndexerConfig.from_model_config(model.config)
    if any(getattr(have, f) != getattr(want, f) for f in fields):
        raise ValueError(
            "the indexer was built for another model: "
            + ", ".join(f"{f}={getattr(have, f)}" for f in fields)
            + " against the model's "
            + ", ".join(f"{f}={getattr(want, f)}" for f in fields)
        )
