"""Training data of the value-aware indexer: contexts and cached reference pools (paper
Sec. 3.5 "Training the Reusable Value-Aware Indexer", App. "Indexer Training Details").

Contexts
--------
The paper trains on 600 articles of 11 long-context datasets. Here the indexer of a small model
is trained on CPU, so we use one small corpus that **no evaluation of this project reads as
evaluation text**: the paragraphs of the SQuAD 2.0 *test half* of the CS224N split
(:data:`SQUAD_TRAIN_FILE`, 20 articles, 570 paragraphs, no answers). RULER's ``qa_1`` asks its
questions on the *dev half* (:data:`SQUAD_EVAL_FILE`); QuALITY, LongBench and the RULER essay /
HotpotQA haystacks use other files (``tests/test_indexer_data.py`` checks that no training
paragraph occurs in any of them). Caveat: RULER's ``read_squad`` (``tasks/ruler/generate.py``)
reads *every* ``squad/*.json`` of its data folder, so when that folder holds the test half too,
test-half paragraphs can appear as far-away *distractor* paragraphs of long ``qa_1`` contexts
(never as gold paragraphs, which only come from answered questions).

:func:`build_contexts` makes the contexts deterministically from a seed:

1. articles are shuffled (``random.Random(seed)``); the first ``round(dev_fraction * n)``
   (at least 1) are the **development** articles, the rest the **training** articles, so the
   two splits share no article (no topic leak into the held-out evaluation);
2. per split, paragraphs are streamed in (shuffled article, file paragraph) order and packed
   into contexts joined by blank lines: each context draws a target length in
   ``[min_tokens, max_tokens]`` and takes paragraphs while the packed length stays
   ``<= max_tokens``, closing as soon as it reaches the target (a paragraph that would overflow
   closes a context of at least ``min_tokens``, else the partial context is dropped; a single
   paragraph longer than ``max_tokens`` is skipped). Lengths are counted with the model's
   tokenizer (paragraph counts plus separators); :attr:`TrainingContext.n_tokens` is the exact
   count of the joined text.

Reference pools
---------------
:func:`compute_pool` runs the package plumbing once per context, exactly as inference does
(:func:`arckv_press.api.compact_prefilled`): ``prefix + document`` prefill
(:func:`arckv_press.capture.prefill`), then the repeat-prefill
(:func:`arckv_press.capture.repeat_prefill`) capturing ``x`` and post-RoPE queries at
``query_budget // G`` document positions drawn like inference
(:func:`arckv_press.compaction.reference.mix_sources` with no context rows), for every
full-attention layer. Keys and values come from the prefill cache (document part only).
Tensors are kept in the model's dtype (what inference sees; the pool key records it).

A pool file is one safetensors file per context,
``<cache>/pools/<model dir>/<key>.safetensors`` (:func:`default_pool_dir`), with tensors
``"{layer}.X" [n_ref, d_x]``, ``"{layer}.Q" [H, G*n_ref, D]`` (g-major rows, the layout of
:class:`~arckv_press.indexer.train.ReferencePool`), ``"{layer}.K"``, ``"{layer}.V" [H, T, D]``
and string metadata (scalings, model id, config hash, settings). The key hashes the context
text, the model (id, :func:`arckv_press.models.config_hash`, dtype) and
:class:`PoolSettings`, so changing any of them makes a new file. Files are written atomically
(temp file + rename) and existing files are skipped: :func:`build_pools` is resumable and can be
split over processes (``shard=(i, n)``). :func:`load_pool` reads one layer lazily (safetensors
``safe_open``), so a layer-sharded trainer never loads the other layers.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

from .train import ReferencePool

__all__ = [
    "SQUAD_TRAIN_FILE",
    "SQUAD_EVAL_FILE",
    "EVALUATION_FILES",
    "POOL_FORMAT",
    "ContextSpec",
    "TrainingContext",
    "PoolSettings",
    "default_data_dir",
    "load_squad_articles",
    "build_contexts",
    "contexts_summary",
    "pool_key",
    "default_pool_dir",
    "pool_path",
    "compute_pool",
    "save_pool",
    "build_pools",
    "read_pool_metadata",
    "load_pool",
    "load_layer_pools",
]

#: Training text (relative to the shared data folder): the SQuAD 2.0 CS224N test half.
SQUAD_TRAIN_FILE = "ruler/squad/squad_v2_dev_cs224n_test_half_noanswers.json"
#: The SQuAD half RULER's qa_1 asks questions on (never used for training).
SQUAD_EVAL_FILE = "ruler/squad/squad_v2_dev_cs224n_dev_half.json"
#: Files read by the project's evaluations (relative to the shared data folder).
EVALUATION_FILES = (
    SQUAD_EVAL_FILE,
    "ruler/hotpotqa/hotpotqa_dev_distractor_sample500.json",
    "ruler/pg_essays.txt",
    "ruler/PaulGrahamEssays.json",
    "quality/leval_quality.jsonl",
    "longbench/data/multifieldqa_zh.jsonl",
    "longbench/data/passage_retrieval_zh.jsonl",
)
#: Version of the pool file layout (part of the pool key).
POOL_FORMAT = 1
DATA_ENV = "ARCKV_DATA_DIR"
_SEPARATOR = "\n\n"


# ----------------------------------------------------------------------------------------------
# Contexts
# ----------------------------------------------------------------------------------------------


def default_data_dir() -> Path:
    """Shared data folder: ``$ARCKV_DATA_DIR``, else ``<repo>/../shared/data`` (the layout of
    this project's checkout)."""
    env = os.environ.get(DATA_ENV)
    if env:
        return Path(env).expanduser()
    return Path(__file__).resolve().parents[3] / "shared" / "data"


@dataclass(frozen=True)
class ContextSpec:
    """How contexts are built (module docstring).

    Attributes:
        min_tokens, max_tokens: context length range in tokens of the model's tokenizer.
        dev_fraction: fraction of articles held out as the development split (at least one).
        seed: seed of the article shuffle and of the target lengths.
    """

    min_tokens: int = 1024
    max_tokens: int = 2048
    dev_fraction: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("min_tokens", "max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ContextSpec.{name} must be a positive int, got {v!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"ContextSpec.min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}")
        if not 0 < self.dev_fraction < 1:
            raise ValueError(f"ContextSpec.dev_fraction must be in (0, 1), got {self.dev_fraction!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"ContextSpec.seed must be a nonnegative int, got {self.seed!r}")


@dataclass(frozen=True)
class TrainingContext:
    """One context: ``text`` (paragraphs joined by blank lines), its split and provenance."""

    id: str
    split: str
    text: str
    n_tokens: int
    articles: tuple[str, ...]
    n_paragraphs: int


def load_squad_articles(path: str | Path) -> list[tuple[str, list[str]]]:
    """``[(title, [paragraph, ...]), ...]`` of a SQuAD JSON in file order (stripped, non-empty)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"SQuAD file not found: {path}")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
        articles = [(str(a["title"]), [p["context"].strip() for p in a["paragraphs"]]) for a in obj["data"]]
    except (KeyError, TypeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a SQuAD JSON (data[].title, data[].paragraphs[].context): {err}") from None
    return [(t, [p for p in ps if p]) for t, ps in articles if any(ps)]


def _count(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def _pack(articles: Sequence[tuple[str, list[str]]], tokenizer: Any, spec: ContextSpec,
          rng: random.Random, split: str) -> list[TrainingContext]:
    sep = _count(tokenizer, _SEPARATOR)
    out: list[TrainingContext] = []
    cur: list[tuple[str, str]] = []
    n = 0
    target = rng.randint(spec.min_tokens, spec.max_tokens)

    def close() -> None:
        nonlocal cur, n, target
        text = _SEPARATOR.join(p for _, p in cur)
        titles = tuple(dict.fromkeys(t for t, _ in cur))
        cid = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
        out.append(TrainingContext(cid, split, text, _count(tokenizer, text), titles, len(cur)))
        cur, n = [], 0
        target = rng.randint(spec.min_tokens, spec.max_tokens)

    for title, paragraphs in articles:
        for para in paragraphs:
            c = _count(tokenizer, para)
            if c > spec.max_tokens:
                continue
            extra = c + (sep if cur else 0)
            if n + extra > spec.max_tokens:
                if n >= spec.min_tokens:
                    close()
                else:
                    cur, n = [], 0
                extra = c
            cur.append((title, para))
            n += extra
            if n >= target:
                close()
    if cur and n >= spec.min_tokens:
        close()
    return out


def build_contexts(articles: Sequence[tuple[str, list[str]]], tokenizer: Any,
                   spec: ContextSpec = ContextSpec()) -> tuple[list[TrainingContext], list[TrainingContext]]:
    """``(train, dev)`` contexts from ``articles`` (:func:`load_squad_articles`); see the module
    docstring. Deterministic in ``spec`` (and the tokenizer)."""
    if not isinstance(spec, ContextSpec):
        raise TypeError(f"spec must be a ContextSpec, got {type(spec).__name__}")
    if len(articles) < 2:
        raise ValueError(f"need at least 2 articles for a train/dev split, got {len(articles)}")
    rng = random.Random(spec.seed)
    order = list(range(len(articles)))
    rng.shuffle(order)
    n_dev = min(len(articles) - 1, max(1, round(spec.dev_fraction * len(articles))))
    dev_articles = [articles[i] for i in order[:n_dev]]
    train_articles = [articles[i] for i in order[n_dev:]]
    train = _pack(train_articles, tokenizer, spec, random.Random(f"{spec.seed}|train"), "train")
    dev = _pack(dev_articles, tokenizer, spec, random.Random(f"{spec.seed}|dev"), "dev")
    return train, dev


def contexts_summary(contexts: Sequence[TrainingContext]) -> dict[str, Any]:
    """Counts for checkpoint metadata: contexts, tokens, articles, paragraphs, length range."""
    lengths = [c.n_tokens for c in contexts]
    return {
        "contexts": len(contexts),
        "tokens": int(sum(lengths)),
        "min_tokens": int(min(lengths)) if lengths else 0,
        "max_tokens": int(max(lengths)) if lengths else 0,
        "articles": len({a for c in contexts for a in c.articles}),
        "paragraphs": int(sum(c.n_paragraphs for c in contexts)),
    }


# ----------------------------------------------------------------------------------------------
# Reference pools
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolSettings:
    """Reference-pool construction (as :class:`arckv_press.config.CompactionConfig`).

    Attributes:
        query_budget: reference rows per KV head; ``query_budget // G`` positions are captured.
        seed: seed of the captured positions.
        repeat_chunk: document tokens repeated per forward of the chunked repeat-prefill.
        use_chat_template: framing (None: the tokenizer's chat template if it has one).
    """

    query_budget: int = 1024
    seed: int = 0
    repeat_chunk: int = 2048
    use_chat_template: bool | None = None

    def __post_init__(self) -> None:
        for name in ("query_budget", "repeat_chunk"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"PoolSettings.{name} must be a positive int, got {v!r}")


def _model_fingerprint(model: Any) -> dict[str, str]:
    from arckv_press.models import config_hash, model_id

    return {"model_id": model_id(model), "config_hash": config_hash(model.config),
            "dtype": str(next(model.parameters()).dtype)}


def pool_key(model: Any, text: str, settings: PoolSettings) -> str:
    """Hash naming the pool file of ``text`` for ``model`` under ``settings``."""
    blob = json.dumps({"format": POOL_FORMAT, "model": _model_fingerprint(model),
                       "settings": asdict(settings), "text": text}, sort_keys=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:24]


def default_pool_dir(model: Any, cache_dir: str | Path | None = None) -> Path:
    """``<cache>/pools/<model dir>`` with ``<cache>`` = ``cache_dir`` or
    :func:`arckv_press.models.default_cache_dir` (``$ARCKV_CACHE_DIR`` or ``~/.cache/arckv-press``).
    ``model``: a model, its config, or its model id (:func:`arckv_press.models.model_id`)."""
    from arckv_press.models import default_cache_dir, model_id

    from .checkpoint import model_dir_name

    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / "pools" / model_dir_name(model if isinstance(model, str) else model_id(model))


def pool_path(pool_dir: str | Path, model: Any, text: str, settings: PoolSettings) -> Path:
    return Path(pool_dir) / f"{pool_key(model, text, settings)}.safetensors"


@torch.no_grad()
def compute_pool(model: Any, tokenizer: Any, text: str, settings: PoolSettings = PoolSettings()
                 ) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Run prefill + repeat-prefill on ``text`` and return ``(tensors, metadata)`` of a pool
    file (module docstring). Every full-attention layer is captured."""
    from arckv_press.cache import new_cache
    from arckv_press.capture import encode_document
    from arckv_press.capture import decoder_layers, framing_for, prefill, repeat_prefill
    from arckv_press.compaction.reference import group_queries_by_kv_head, mix_sources
    from arckv_press.models import describe_attention_layout

    layout = describe_attention_layout(model)
    layers = list(layout.full_attention_layers)
    H, G = layout.num_kv_heads, layout.group_size
    ids, prefix_len = encode_document(tokenizer, text, settings.use_chat_template)
    T = ids.shape[1] - prefix_len
    n_pos = max(1, settings.query_budget // G)
    positions, _ = mix_sources(T, T, 0.0, n_pos, settings.seed)
    cache = new_cache(model)
    with torch.inference_mode():
        prefill(model, ids, cache)
        framing = framing_for(tokenizer, settings.use_chat_template)
        store = repeat_prefill(model, tokenizer, cache, ids[:, prefix_len:], framing.suffix_ids, layers,
                               positions, settings.repeat_chunk)
    blocks = decoder_layers(model)
    tensors: dict[str, Tensor] = {}
    scalings: dict[str, float] = {}
    for layer in layers:
        x, q = store.layer(layer)
        keys, values = cache.layers[layer].keys, cache.layers[layer].values
        tensors[f"{layer}.X"] = x.detach().cpu().contiguous()
        tensors[f"{layer}.Q"] = group_queries_by_kv_head(q[None], H).detach().cpu().contiguous()
        tensors[f"{layer}.K"] = keys[0, :, prefix_len:].detach().cpu().contiguous()
        tensors[f"{layer}.V"] = values[0, :, prefix_len:].detach().cpu().contiguous()
        scalings[str(layer)] = float(blocks[layer].self_attn.scaling)
    meta = {
        "format": str(POOL_FORMAT),
        "layers": json.dumps(layers),
        "scalings": json.dumps(scalings),
        "T": str(T),
        "n_ref": str(int(positions.numel())),
        "group_size": str(G),
        "settings": json.dumps(asdict(settings), sort_keys=True),
        "context_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        **_model_fingerprint(model),
    }
    return tensors, meta


def save_pool(path: str | Path, tensors: dict[str, Tensor], metadata: dict[str, str]) -> Path:
    """Write a pool file atomically (temp file in the same folder, then ``os.replace``)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def build_pools(model: Any, tokenizer: Any, contexts: Sequence[TrainingContext], pool_dir: str | Path,
                settings: PoolSettings = PoolSettings(), shard: tuple[int, int] = (0, 1),
                progress: bool = True) -> list[Path]:
    """Compute and cache the pool of every context (skipping existing files).

    ``shard=(i, n)`` computes only contexts ``i, i+n, i+2n, ...`` (to spread the work over
    processes); the returned list always holds the paths of *all* contexts, in order.
    """
    from tqdm.auto import tqdm

    i, n = shard
    if not (isinstance(n, int) and n >= 1 and isinstance(i, int) and 0 <= i < n):
        raise ValueError(f"shard must be (i, n) with 0 <= i < n, got {shard!r}")
    paths = [pool_path(pool_dir, model, c.text, settings) for c in contexts]
    todo = [k for k in range(i, len(contexts), n) if not paths[k].is_file()]
    for k in tqdm(todo, desc="reference pools", unit="ctx", disable=not progress):
        tensors, meta = compute_pool(model, tokenizer, contexts[k].text, settings)
        meta["context_id"] = contexts[k].id
        save_pool(paths[k], tensors, meta)
    return paths


def read_pool_metadata(path: str | Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def load_pool(path: str | Path, layer: int, dtype: torch.dtype | None = None) -> ReferencePool:
    """The :class:`ReferencePool` of ``layer`` stored in pool file ``path`` (only that layer's
    tensors are read). ``dtype`` optionally casts the tensors (default: as stored)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"reference pool not found: {path} (build it with build_pools)")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        scalings = json.loads(meta.get("scalings", "{}"))
        if str(layer) not in scalings:
            raise ValueError(f"{path}: no layer {layer} (layers {meta.get('layers')})")
        t = {name: f.get_tensor(f"{layer}.{name}") for name in ("X", "Q", "K", "V")}
    if dtype is not None:
        t = {k: v.to(dtype) for k, v in t.items()}
    return ReferencePool(X=t["X"], Q=t["Q"], K=t["K"], V=t["V"], scaling=float(scalings[str(layer)]))


def load_layer_pools(paths: Sequence[str | Path], layer: int, dtype: torch.dtype | None = None
                     ) -> list[ReferencePool]:
    """:func:`load_pool` of ``layer`` for every path."""
    return [load_pool(p, layer, dtype) for p in paths]
