"""The learned value-aware indexer of ARC-KV (paper Sec. 3.3 "Value-Aware Indexer",
Sec. 3.5 "Training the Reusable Value-Aware Indexer", App. A).

- :mod:`.model`: :class:`IndexerConfig` and :class:`ValueAwareIndexer` (parameters stacked
  over all layer--KV-head pairs; batched logits and blockwise pooled scores).
- :mod:`.checkpoint`: safetensors + JSON checkpoints tied to one base model.
- :mod:`.train`: training math (KL warm-up, hard/soft/STE reconstruction losses) and
  :func:`train_layer` on precomputed :class:`ReferencePool` s.
"""

from .checkpoint import (
    IndexerMetadata,
    default_indexer_path,
    load_indexer,
    read_metadata,
    save_indexer,
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
]
