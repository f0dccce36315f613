"""Pure tensor functions implementing the steps of ARC-KV and its baselines.

No model objects live here: every function takes and returns tensors batched over the KV
heads of one layer (leading axis ``H``), so a layer is compacted without a Python loop over
heads or positions.

Shapes and conventions shared by every module:

- ``K``, ``V``: ``[H, T, D]`` keys (post-RoPE) and values of the context for one layer.
- ``Q``: ``[H, n, D]`` reference queries (post-RoPE). Under GQA the rows of KV head ``h``
  stack the queries of all query heads mapped to it.
- ``scaling``: the model's softmax scale (usually ``D ** -0.5``). The paper omits it; here a
  logit is always ``scaling * q @ k``.
- Variable budgets per head are carried as padded tensors plus a boolean ``valid`` mask of
  shape ``[H, t_max]``; padded anchor slots hold index 0 and are ignored.
- All solves run in float32 or float64 whatever the input dtype; results are returned in the
  dtype of ``K``. Ties are broken by the lowest index.

Modules: ``reference`` (query budget, subsampling), ``select`` (HA, VI, pooling, top-t,
budgets, chunked top-t), ``merge`` (response profiles, assignment, centroids), ``fit``
(beta and C_v), ``omp`` (Attention Matching baselines).
"""
