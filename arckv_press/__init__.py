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
"""

__version__ = "0.1.0"
