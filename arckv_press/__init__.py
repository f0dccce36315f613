"""arckv-press: reconstruction-based KV-cache compaction (ARC-KV) for Hugging Face decoders.

Layers of the package (see ARCHITECTURE.md):

- ``arckv_press.compaction``: pure tensor math, one module per step of the method
  (reference queries, anchor selection, key merging, beta/C_v fitting, OMP baselines).
- ``arckv_press.indexer``: the learned value-aware indexer, its training and checkpoints.
- ``arckv_press.cache`` / ``arckv_press.attention``: the packed ``CompactCache`` and the
  attention function that adds the fitted bias ``beta``.
- ``arckv_press.capture``: prefill and repeat-prefill with hooks (model plumbing).
- ``arckv_press.api``: ``compact(...)`` and the method registry.
- ``arckv_press.presses``: kvpress adapters (``ARCKVPress``, ``AttentionMatchingPress``).
- ``arckv_press.models``: loading the embedded default model (SmolLM2-135M-Instruct) or any HF model.

Conventions: ``ratio`` is the kept fraction rho = t/T; kvpress's ``compression_ratio`` is
``1 - ratio`` and appears only at the kvpress boundary.

Public names are exported lazily (module ``__getattr__``, PEP 562): ``import arckv_press`` imports
neither torch nor transformers, so the lm-eval start-up hook stays cheap.

    from arckv_press import ARCKVPress, AttentionMatchingPress, CompactCache, compact, load_model
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {
    "ARCKVPress": "arckv_press.presses",
    "AttentionMatchingPress": "arckv_press.presses",
    "CompactCache": "arckv_press.cache",
    "CompactionConfig": "arckv_press.config",
    "compact": "arckv_press.api",
    "compact_prefilled": "arckv_press.api",
    "load_model": "arckv_press.models",
}

__all__ = ["ARCKVPress", "AttentionMatchingPress", "CompactCache", "CompactionConfig", "__version__", "compact",
           "compact_prefilled", "load_model"]

if TYPE_CHECKING:  # static analysers see the real objects
    from arckv_press.config import CompactionConfig
    from arckv_press.api import compact, compact_prefilled
    from arckv_press.cache import CompactCache
    from arckv_press.models import load_model
    from arckv_press.presses import ARCKVPress, AttentionMatchingPress


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'arckv_press' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
