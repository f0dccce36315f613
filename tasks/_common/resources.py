"""Shared helpers of the task families: local data locations and tokenizer loading.

Data locations (one environment variable per family; see ``tasks/README.md``):

- ``ARCKV_QUALITY_PATH``: an L-Eval-format QuALITY ``.jsonl`` file;
- ``ARCKV_RULER_DATA``: a folder with ``PaulGrahamEssays.json`` (or ``pg_essays.txt``),
  ``squad/*.json`` and ``hotpotqa/*.json``;
- ``ARCKV_LONGBENCH_DIR``: a folder with ``data/<task>.jsonl`` and ``config/*.json``.

When a variable is unset and the package runs from a source checkout (``tasks/`` next to
``pyproject.toml``), ``<repo>/../shared/data/<family>`` is used if it exists; otherwise the task
falls back to the Hugging Face Hub. An installed package never looks outside its own folder. A variable that is set but points nowhere is an error (never a
silent fallback).

Tokenizer (RULER sizing, LongBench truncation): the name in the lm-eval metadata key
``tokenizer`` or else ``pretrained`` (lm-eval merges ``--model_args`` into the metadata; a model
name of ``arckv_press.models.MODELS`` such as ``gemma3-270m`` loads that model's tokenizer), or the
project's default model (SmolLM2-135M-Instruct, through ``arckv_press.models.load_model``) when
neither is given.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from arckv_press.tasks import TASKS_DIR

#: the source checkout holding ``tasks/``, or ``None`` for an installed package
REPO_ROOT = TASKS_DIR.parent if (TASKS_DIR.parent / "pyproject.toml").is_file() else None
#: the development data folder of a checkout (``None`` when installed)
SHARED_DATA_DIR = None if REPO_ROOT is None else REPO_ROOT.parent / "shared" / "data"

QUALITY_ENV = "ARCKV_QUALITY_PATH"
RULER_ENV = "ARCKV_RULER_DATA"
LONGBENCH_ENV = "ARCKV_LONGBENCH_DIR"

__all__ = [
    "LONGBENCH_ENV",
    "QUALITY_ENV",
    "RULER_ENV",
    "REPO_ROOT",
    "SHARED_DATA_DIR",
    "TASKS_DIR",
    "load_tokenizer",
    "resolve_local_path",
    "tokenizer_name_from_metadata",
]



def resolve_local_path(env_var: str, default_relative: str, must_be_dir: bool) -> Path | None:
    """Local data path for a family, or ``None`` (meaning: use the Hugging Face Hub).

    Order: ``$env_var`` (must exist, else ``FileNotFoundError``), then, in a source checkout,
    ``SHARED_DATA_DIR / default_relative`` if it exists, then ``None``.
    """
    value = os.environ.get(env_var)
    if value:
        path = Path(value).expanduser().resolve()
        ok = path.is_dir() if must_be_dir else path.is_file()
        if not ok:
            kind = "folder" if must_be_dir else "file"
            raise FileNotFoundError(f"${env_var} = {value!r} is not an existing {kind}")
        return path
    if SHARED_DATA_DIR is None:
        return None
    default = SHARED_DATA_DIR / default_relative
    ok = default.is_dir() if must_be_dir else default.is_file()
    return default if ok else None


def tokenizer_name_from_metadata(metadata: dict[str, Any]) -> str | None:
    """``metadata['tokenizer']`` or ``metadata['pretrained']`` (non-empty strings), else ``None``."""
    for key in ("tokenizer", "pretrained"):
        value = metadata.get(key)
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise TypeError(f"metadata[{key!r}] must be a model name or path string, got {value!r}")
        return value
    return None


def load_tokenizer(metadata: dict[str, Any]) -> Any:
    """Tokenizer used to measure lengths: see the module docstring for how it is chosen."""
    name = tokenizer_name_from_metadata(metadata)
    trust = metadata.get("trust_remote_code", False)
    if isinstance(trust, str):
        trust = trust.strip().lower() in ("1", "true", "yes")
    return _load_tokenizer_cached(name, bool(trust))


@lru_cache(maxsize=4)
def _load_tokenizer_cached(name: str | None, trust_remote_code: bool) -> Any:
    default_id = None
    try:
        from arckv_press import models as arckv_models
    except ImportError:
        arckv_models = None
    if arckv_models is not None:
        default_id = getattr(arckv_models, "DEFAULT_MODEL_ID", None)

    named = getattr(arckv_models, "registered_model", None) if arckv_models is not None else None
    if name is not None and named is not None and named(name) is not None:  # a named model (gemma3-270m)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(arckv_models.model_folder(name)), local_files_only=True)
    if name is None or name == default_id or _is_gguf_source(name):
        if arckv_models is None:
            raise ImportError(
                "the default tokenizer comes from arckv_press.models.load_model, which cannot be "
                "imported; install arckv-press or pass a tokenizer with "
                "--model_args pretrained=<hf id> or --metadata '{\"tokenizer\": \"<hf id>\"}'"
            )
        # load_model returns (model, tokenizer); only the tokenizer is kept.
        _model, tokenizer = arckv_models.load_model(name if name != default_id else None)
        del _model
        return tokenizer

    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)


def _is_gguf_source(name: str) -> bool:
    path = Path(name).expanduser()
    if path.is_file():
        return path.suffix == ".gguf"
    return path.is_dir() and not (path / "tokenizer_config.json").exists() and any(path.glob("*.gguf"))
