"""The learned value-aware indexer of ARC-KV (paper Sec. 3.3 "Value-Aware Indexer",
Sec. 3.5 "Training the Reusable Value-Aware Indexer", App. A).

- :mod:`.model`: :class:`IndexerConfig` and :class:`ValueAwareIndexer` (parameters stacked
  over all layer--KV-head pairs; batched logits and blockwise pooled scores).
- :mod:`.checkpoint`: safetensors + JSON checkpoints tied to one base model.
- :mod:`.train`: training math (KL warm-up, hard/soft/STE reconstruction losses) and
  :func:`train_layer` on precomputed :class:`ReferencePool` s.
- :mod:`.data`: training contexts (SQuAD test-half paragraphs, train/dev split by article) and
  reference pools cached on disk.
- :mod:`.budget`: per-head budget weights a(l, h) from held-out error curves (water-filling).
- :mod:`.run`: the end-to-end driver (pools -> layer shards -> merge), ``scripts/train_indexer.py``.

The base-model fingerprint stored in checkpoints is :func:`arckv_press.models.config_hash`.
"""

from .checkpoint import (
    IndexerMetadata,
    checkpoint_id,
    default_indexer_path,
    load_indexer,
    read_metadata,
    save_indexer,
)
from .budget import budget_weights_from_curves, error_curves, heldout_error, water_fill
from .data import (
    ContextSpec,
    PoolSettings,
    TrainingContext,
    build_contexts,
    build_pools,
    load_layer_pools,
    load_pool,
    load_squad_articles,
)
from .model import IndexerConfig, ValueAwareIndexer
from .train import (
    HardBranch,
    ReferencePool,
    TrainConfig,
    TrainResult,
    hard_branch_loss,
    kl_loss,
    soft_branch_loss,
    ste_loss,
    train_layer,
)

__all__ = [
    "IndexerConfig",
    "ValueAwareIndexer",
    "IndexerMetadata",
    "checkpoint_id",
    "default_indexer_path",
    "load_indexer",
    "read_metadata",
    "save_indexer",
    "HardBranch",
    "ReferencePool",
    "TrainConfig",
    "TrainResult",
    "hard_branch_loss",
    "kl_loss",
    "soft_branch_loss",
    "ste_loss",
    "train_layer",
    "budget_weights_from_curves",
    "error_curves",
    "heldout_error",
    "water_fill",
    "ContextSpec",
    "PoolSettings",
    "TrainingContext",
    "build_contexts",
    "build_pools",
    "load_layer_pools",
    "load_pool",
    "load_squad_articles",
]
