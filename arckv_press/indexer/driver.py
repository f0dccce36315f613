"""Training the value-aware indexer of a base model end to end: contexts -> cached reference
pools -> layer-sharded training -> merged checkpoint with per-head budget weights (paper
Sec. 3.5 and App. "Indexer Training Details"). ``scripts/train_indexer.py`` and the package CLI
call :func:`main`.

Steps (each resumable; every layer--KV-head pair is independent, so layers can be trained on
different machines with any job launcher and merged at the end)::

    # 1. reference pools (once; split over processes with --pool-shard i/n)
    python scripts/train_indexer.py --pools-only --pool-shard 0/2 &
    python scripts/train_indexer.py --pools-only --pool-shard 1/2 &
    # 2. layer shards (one process per shard; one thread per process: see below)
    python scripts/train_indexer.py --layers 0-14 &
    python scripts/train_indexer.py --layers 15-29 &
    # 3. merge into arckv_press/indexer/weights/<org>--<name>/ (or --out DIR)
    python scripts/train_indexer.py --merge

Shard directory (``--shard-dir``, default ``<cache>/indexer-shards/<model dir>``): per layer
``layer_XX.state.safetensors`` (resume state after every epoch: parameters, AdamW and scheduler
state, metrics; safetensors with the plain fields as JSON in its header, never a pickle, so a
crafted file cannot run code: :func:`arckv_press.indexer.checkpoint.read_resume_state`) and, when the layer is done, ``layer_XX.safetensors`` (the layer's parameters, its
held-out error curves ``error_curves [H, F]`` for the budget weights, and metadata). Every file
carries a *run fingerprint* (hash of the pool files, indexer config, training config and curve
settings); resuming or merging with other settings is refused instead of mixing runs.

Threads: ``torch.set_num_threads(1)`` per training process (``--threads``). The per-step
tensors are small (``[3, n, T]`` with ``n`` ~ 10^3); intra-op threading of such ops costs more
in synchronisation than it gains. Use one process per core instead (two layer shards on two
cores).

Default hyperparameters (``TrainConfig`` fields overridable on the command line). The paper's
schedule shape is kept: a KL-only warm-up stage, then the joint stage ``2 L_out^STE + L_KL``;
AdamW (0.9, 0.999), weight decay 0.01, clipping 1.0, 3% linear warm-up and cosine decay to 10%
of the peak per stage, gate temperature annealed 1.0 -> 0.1, one episode per pool per epoch,
ratios (0.2, 0.1, 0.05, 0.02, 0.01). What differs, and why: the paper runs 10 + 5 epochs over
600 articles (about 9,000 steps per layer); a CPU run of this package affords a few hundred
steps per layer, at which the paper's peak learning rates (1e-4 / 3e-5) barely move the
parameters. The learning rates in ``DEFAULTS`` were picked by a quick check on the development
split (``scripts/eval_selectors.py``-style held-out error on the 4 dev contexts, layer 15 of
SmolLM2-135M-Instruct, lr pairs (1e-4, 3e-5), (3e-3, 1e-3), (1e-2, 3e-3)); the epoch counts by
the wall-time budget. Numbers in the docstring of ``scripts/train_indexer.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from arckv_press.compaction.fit import FitConfig

from .budget import DEFAULT_FRACTIONS, DEFAULT_RATIOS, budget_weights_from_curves, error_curves
from .checkpoint import WEIGHTS_DIR, model_dir_name, read_resume_state, save_indexer, save_resume_state
from .data import (
    SQUAD_TRAIN_FILE,
    ContextSpec,
    PoolSettings,
    TrainingContext,
    build_contexts,
    build_pools,
    contexts_summary,
    default_data_dir,
    default_pool_dir,
    load_layer_pools,
    load_squad_articles,
)
from .model import PARAM_NAMES, IndexerConfig, ValueAwareIndexer
from .train import ReferencePool, TrainConfig, train_layer

__all__ = [
    "DEFAULTS",
    "RunSettings",
    "run_fingerprint",
    "layer_shard_path",
    "layer_state_path",
    "train_shard",
    "read_shard",
    "load_shard_layers",
    "shard_config",
    "merge_shards",
    "default_shard_dir",
    "parse_layers",
    "build_parser",
    "main",
]

#: Default hyper-parameters of a CPU run (see module docstring).
DEFAULTS: dict[str, Any] = dict(
    kl_epochs=6,
    joint_epochs=3,
    lr_kl=1e-2,
    lr_joint=3e-3,
    kl_max_rows=128,
    episode_fractions=(0.3, 0.4, 0.3),
)


@dataclass
class RunSettings:
    """Everything that determines a training run besides the base model and the pool files.

    Attributes:
        train: :class:`TrainConfig` passed to :func:`train_layer`.
        indexer: :class:`IndexerConfig` overrides (``n_index_heads``, ``d_index``, ...).
        residual: ``None`` (the paper's indexer), ``"ha"`` or ``"vi"``: train the residual form
            (``IndexerConfig.base_logit_scale`` = the model's softmax scale, head weights
            initialised at 0 so training starts from HA's, or with ``"vi"``
            (``base_value_influence``) VI's, scores; not the paper's indexer).
        init_seed: seed of the indexer initialisation (the same full-model init in every shard).
        curve_pools: training pools used for the error curves of the budget weights.
        curve_fractions: kept fractions of the error curves (:mod:`.budget`).
        curve_holdout: holdout fraction of reference positions for the error curves.
        weight_ratios: ratios the budget weights are averaged over.
    """

    train: TrainConfig = field(default_factory=lambda: TrainConfig(**DEFAULTS))
    indexer: dict[str, Any] = field(default_factory=dict)
    residual: str | None = None
    init_seed: int = 0
    curve_pools: int = 4
    curve_fractions: tuple[float, ...] = DEFAULT_FRACTIONS
    curve_holdout: float = 0.25
    weight_ratios: tuple[float, ...] = DEFAULT_RATIOS

    def indexer_config(self, model: Any) -> IndexerConfig:
        overrides = dict(self.indexer)
        if self.residual not in (None, "ha", "vi"):
            raise ValueError(f"RunSettings.residual must be None, 'ha' or 'vi', got {self.residual!r}")
        if self.residual:
            from arckv_press.models import describe_attention_layout

            overrides.update(base_logit_scale=describe_attention_layout(model).scaling,
                             init_std_x=0.0, init_bias_x=0.0)
            if self.residual == "vi":
                overrides.update(base_value_influence=True)
        return IndexerConfig.from_model_config(model.config, **overrides)


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o)))


def run_fingerprint(model: Any, pool_paths: Sequence[str | Path], settings: RunSettings) -> str:
    """Hash of (base model, pool files, indexer config, training config, curve settings)."""
    from arckv_press.models import config_hash, model_id

    blob = json.dumps({
        "model": [model_id(model), config_hash(model.config)],
        "pools": [Path(p).name for p in pool_paths],
        "indexer": settings.indexer_config(model).to_dict(),
        "train": _jsonable(asdict(settings.train)),
        "init_seed": settings.init_seed,
        "curves": [settings.curve_pools, list(settings.curve_fractions), settings.curve_holdout],
    }, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def layer_shard_path(shard_dir: str | Path, layer: int) -> Path:
    return Path(shard_dir) / f"layer_{layer:02d}.safetensors"


def layer_state_path(shard_dir: str | Path, layer: int) -> Path:
    return Path(shard_dir) / f"layer_{layer:02d}.state.safetensors"


def _legacy_state_path(shard_dir: str | Path, layer: int) -> Path:
    """The pickle resume state of earlier versions: refused, never opened."""
    return Path(shard_dir) / f"layer_{layer:02d}.state.pt"


def default_shard_dir(model: Any, cache_dir: str | Path | None = None) -> Path:
    from arckv_press.models import default_cache_dir, model_id

    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / "indexer-shards" / model_dir_name(model_id(model))


def read_shard(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, metadata)`` of a finished layer shard."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("arckv_shard", "{}"))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except SafetensorError as err:
        raise ValueError(f"{path} is not a readable safetensors layer shard ({err})") from err
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: the layer shard's metadata is not JSON ({err})") from err
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: the layer shard's metadata is not a JSON object")
    return tensors, meta


def _shard_paths(shard_dir: str | Path) -> list[Path]:
    paths = sorted(Path(shard_dir).glob("layer_*.safetensors"))
    if not paths:
        raise ValueError(f"no finished layer shard (layer_NN.safetensors) in {shard_dir}")
    return paths


def shard_config(shard_dir: str | Path) -> IndexerConfig:
    """The :class:`IndexerConfig` the finished layer shards in ``shard_dir`` were trained with
    (they must all agree)."""
    paths = _shard_paths(shard_dir)
    configs = {path.name: IndexerConfig.from_dict(read_shard(path)[1]["indexer_config"]) for path in paths}
    first = configs[paths[0].name]
    odd = [name for name, cfg in configs.items() if cfg != first]
    if odd:
        raise ValueError(f"layer shards in {shard_dir} were trained with different indexer configs: {odd} vs {paths[0].name}")
    return first


def load_shard_layers(indexer: ValueAwareIndexer, shard_dir: str | Path) -> list[int]:
    """Copy the parameters of every finished layer shard in ``shard_dir`` into ``indexer`` (the
    other layers stay as they are; used to evaluate a ``--layers`` training run inside a full
    checkpoint). Every shard must have ``indexer``'s config (checked before anything is copied).
    Returns the layers replaced, sorted."""
    shards = [read_shard(path) for path in _shard_paths(shard_dir)]
    for _, meta in shards:
        cfg = IndexerConfig.from_dict(meta["indexer_config"])
        if cfg != indexer.config:
            raise ValueError(f"the shards in {shard_dir} have indexer config {cfg.to_dict()}, the indexer has "
                             f"{indexer.config.to_dict()}; build a ValueAwareIndexer(shard_config(dir)) for them")
    for tensors, meta in shards:
        indexer.set_layer_params(int(meta["layer"]), {k: tensors[k] for k in PARAM_NAMES})
    return [int(meta["layer"]) for _, meta in shards]


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _checked_resume(saved: dict[str, Any], path: Path, indexer: ValueAwareIndexer, layer: int
                    ) -> tuple[dict[str, Any], float]:
    """``(train_layer resume state, seconds trained before)`` of a read resume file, its fields
    and parameter shapes checked (a ``ValueError`` naming the file and the field otherwise)."""
    state, elapsed = saved.get("state"), saved.get("elapsed", 0.0)
    if not isinstance(state, dict) or isinstance(elapsed, bool) or not isinstance(elapsed, (int, float)):
        raise ValueError(f"{path}: a resume file holds {{'state': dict, 'elapsed': seconds}}, got keys {sorted(saved)}")
    fields = {"layer": int, "seed": int, "n_pools": int, "stage": int, "epoch": int, "params": dict, "metrics": list}
    for name, kind in fields.items():
        if isinstance(state.get(name), bool) or not isinstance(state.get(name), kind):
            raise ValueError(f"{path}: resume state field {name!r} must be a {kind.__name__}, "
                             f"got {type(state.get(name)).__name__}")
    expected = indexer.layer_params(layer)
    for name, value in expected.items():
        got = state["params"].get(name)
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(value.shape):
            raise ValueError(f"{path}: resume state parameter {name!r} must be a tensor of shape "
                             f"{tuple(value.shape)}, got {getattr(got, 'shape', type(got).__name__)}")
    return state, float(elapsed)


def train_shard(model: Any, pool_paths: Sequence[str | Path], shard_dir: str | Path,
                settings: RunSettings = RunSettings(), layers: Sequence[int] | None = None,
                progress: bool = True, max_epochs: int | None = None) -> list[int]:
    """Train the indexer layers ``layers`` (default: all) on the cached pools and write one
    finished shard per layer (module docstring). Finished layers are skipped; a layer with a
    resume state continues from its last completed epoch. ``max_epochs`` stops each layer after
    that many epochs in this call (time-sliced jobs; the layer stays unfinished with its resume
    state). Returns the layers finished now."""
    from safetensors.torch import save_file

    from arckv_press.models import describe_attention_layout

    cfg = settings.indexer_config(model)
    full = list(describe_attention_layout(model).full_attention_layers)
    layers = list(full if layers is None else layers)
    bad = [l for l in layers if l not in full]
    if bad:
        raise ValueError(f"layers {bad} are not full-attention layers of the model (have {full})")
    if not pool_paths:
        raise ValueError("train_shard needs at least one pool file")
    fp = run_fingerprint(model, pool_paths, settings)
    shard_dir = Path(shard_dir)
    shard_dir.mkdir(parents=True, exist_ok=True)
    done_now = []
    for layer in layers:
        out = layer_shard_path(shard_dir, layer)
        if out.is_file():
            meta = read_shard(out)[1]
            if meta.get("fingerprint") != fp:
                raise ValueError(f"{out} belongs to another run (fingerprint {meta.get('fingerprint')} "
                                 f"!= {fp}); use another --shard-dir or delete it")
            _log(f"layer {layer}: done already ({out.name})")
            continue
        t0 = time.perf_counter()
        pools = load_layer_pools(pool_paths, layer)
        indexer = ValueAwareIndexer(cfg, seed=settings.init_seed)
        state_file = layer_state_path(shard_dir, layer)
        legacy = _legacy_state_path(shard_dir, layer)
        if legacy.exists():
            raise ValueError(f"{legacy} is a resume state in the pickle format of earlier versions, which "
                             "arckv-press no longer reads (unpickling a file can run code); delete it to train "
                             f"layer {layer} from its start")
        resume, prior = None, 0.0
        if state_file.is_file():
            saved = read_resume_state(state_file, fp)  # the fingerprint is checked before any tensor is read
            resume, prior = _checked_resume(saved, state_file, indexer, layer)
            _log(f"layer {layer}: resuming at stage {resume['stage']} epoch {resume['epoch']}")

        def on_epoch_end(state: dict[str, Any], layer: int = layer, state_file: Path = state_file) -> None:
            save_resume_state(state_file, {"state": state, "elapsed": prior + time.perf_counter() - t0}, fp)
            m = state["metrics"][-1]
            _log(f"layer {layer} {m['stage']} epoch {m['epoch']}: " + ", ".join(
                f"{k}={v:.4g}" for k, v in m.items() if isinstance(v, float)))

        result = train_layer(indexer, layer, pools, settings.train, progress=progress,
                             resume_state=resume, on_epoch_end=on_epoch_end, max_epochs=max_epochs)
        if not result.finished:
            _log(f"layer {layer}: stopped after {max_epochs} epoch(s); resume state in {state_file.name}")
            continue
        t_curves = time.perf_counter()
        t_train = prior + t_curves - t0
        curve_pools = pools[: settings.curve_pools]

        def score_fn(pool: ReferencePool, rows: torch.Tensor) -> torch.Tensor:
            return indexer.scores(layer, pool.X_rows(rows), pool.Q[:, rows], pool.K, pool.V,
                                  pooling=settings.train.pooling)

        curves = error_curves(score_fn, curve_pools, settings.curve_fractions, settings.curve_holdout,
                              seed=settings.train.seed)
        tensors = {k: v.detach().contiguous().clone() for k, v in indexer.layer_params(layer).items()}
        tensors["error_curves"] = curves.float().contiguous()
        meta = {"fingerprint": fp, "layer": layer, "metrics": result.metrics, "n_pools": len(pools),
                "train_seconds": t_train, "curve_seconds": time.perf_counter() - t_curves,
                "indexer_config": cfg.to_dict(), "threads": torch.get_num_threads()}
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        save_file(tensors, str(tmp), metadata={"arckv_shard": json.dumps(_jsonable(meta))})
        os.replace(tmp, out)
        state_file.unlink(missing_ok=True)
        _log(f"layer {layer}: finished in {t_train:.0f} s (+{meta['curve_seconds']:.0f} s error curves); "
             f"curves@{list(settings.curve_fractions)} mean over heads "
             f"{[round(float(x), 4) for x in curves.mean(0)]}")
        done_now.append(layer)
    return done_now


def merge_shards(model: Any, pool_paths: Sequence[str | Path], shard_dir: str | Path, out: str | Path,
                 settings: RunSettings = RunSettings(), training: dict[str, Any] | None = None) -> Path:
    """Join the layer shards into one checkpoint at ``out`` with per-head budget weights
    (:func:`arckv_press.indexer.budget.budget_weights_from_curves`) and metadata.

    On a hybrid model (sliding-window layers, which are never compacted) only the full-attention
    layers have shards; the other layers keep their initial parameters and budget weight 0 (the
    compaction reads only the compacted layers' weights, normalised among them)."""
    from arckv_press.models import config_hash, describe_attention_layout, model_id

    cfg = settings.indexer_config(model)
    fp = run_fingerprint(model, pool_paths, settings)
    layers = list(describe_attention_layout(model).full_attention_layers)
    missing = [l for l in layers if not layer_shard_path(shard_dir, l).is_file()]
    if missing:
        raise ValueError(f"cannot merge: no finished shard for layers {missing} in {shard_dir}")
    indexer = ValueAwareIndexer(cfg, seed=settings.init_seed)
    curves, per_layer = [], []
    for layer in layers:
        tensors, meta = read_shard(layer_shard_path(shard_dir, layer))
        if meta.get("fingerprint") != fp:
            raise ValueError(f"shard of layer {layer} has fingerprint {meta.get('fingerprint')}, this "
                             f"run has {fp}: the shards come from different settings or pools")
        indexer.set_layer_params(layer, {k: tensors[k] for k in PARAM_NAMES})
        curves.append(tensors["error_curves"])
        last = {m["stage"]: m for m in meta["metrics"]}
        per_layer.append({"layer": layer, "train_seconds": round(meta["train_seconds"], 1),
                          "final": {k: {kk: round(vv, 5) for kk, vv in v.items() if isinstance(vv, float)}
                                    for k, v in last.items()}})
    curves_t = torch.stack(curves)  # [L_compacted, H, F]
    compacted = budget_weights_from_curves(curves_t, settings.curve_fractions, settings.weight_ratios)
    weights = torch.zeros(cfg.num_layers, compacted.shape[1], dtype=compacted.dtype)
    weights[layers] = compacted
    summary = dict(training or {})
    summary.update({
        "run_fingerprint": fp,
        "train_config": _jsonable(asdict(settings.train)),
        "init_seed": settings.init_seed,
        "budget_weights": {"procedure": "arckv_press.indexer.budget (water-filling of held-out error "
                                        "curves, mean over ratios)",
                           "fractions": list(settings.curve_fractions),
                           "ratios": list(settings.weight_ratios), "curve_pools": settings.curve_pools,
                           "holdout_fraction": settings.curve_holdout,
                           "error_curves_mean_over_pairs": [round(float(x), 5)
                                                            for x in curves_t.mean((0, 1))]},
        "train_seconds_total": round(sum(p["train_seconds"] for p in per_layer), 1),
        "layers": per_layer,
    })
    return save_indexer(indexer, out, model_id(model), config_hash(model.config), weights, summary)


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def parse_layers(spec: str | None, num_layers: int) -> list[int] | None:
    """``"0-14"``, ``"3,5,7"``, ``"all"`` or None -> layer list (None = all)."""
    if spec is None or spec == "all":
        return None
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if "-" in part:
            a, b = (int(x) for x in part.split("-", 1))
            out.extend(range(a, b + 1))
        elif part:
            out.append(int(part))
    bad = [l for l in out if not 0 <= l < num_layers]
    if bad or not out:
        raise ValueError(f"--layers {spec!r}: layers must be in [0, {num_layers}), got {out}")
    return sorted(dict.fromkeys(out))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Train the ARC-KV value-aware indexer of a base model "
                                            "(pools, layer shards, merge).")
    p.add_argument("--model", default=None, help="base model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto",
                   help="model dtype for the pools (default auto, as inference: bfloat16 on CUDA, float32 on CPU)")
    g = p.add_argument_group("data")
    g.add_argument("--data-dir", default=None, help="shared data folder (default $ARCKV_DATA_DIR or <repo>/../shared/data)")
    g.add_argument("--train-file", default=SQUAD_TRAIN_FILE, help="SQuAD JSON relative to --data-dir")
    g.add_argument("--min-tokens", type=int, default=1200)
    g.add_argument("--max-tokens", type=int, default=1800)
    g.add_argument("--dev-fraction", type=float, default=0.1)
    g.add_argument("--data-seed", type=int, default=0)
    g.add_argument("--max-contexts", type=int, default=None,
                   help="training contexts used (first N of the split; default all)")
    g.add_argument("--query-budget", type=int, default=1024)
    g.add_argument("--pool-seed", type=int, default=0)
    g.add_argument("--repeat-chunk", type=int, default=2048)
    g.add_argument("--cache-dir", default=None, help="root of pools and shards (default $ARCKV_CACHE_DIR or ~/.cache/arckv-press)")
    g.add_argument("--pool-dir", default=None)
    g.add_argument("--pools-only", action="store_true", help="only build the reference pools (train + dev)")
    g.add_argument("--pool-shard", default="0/1", help="i/n: build pools of contexts i, i+n, ...")
    t = p.add_argument_group("training")
    t.add_argument("--layers", default=None, help="layers to train, e.g. 0-14 or 3,7 (default all)")
    t.add_argument("--shard-dir", default=None)
    t.add_argument("--merge", action="store_true", help="join the finished layer shards into a checkpoint")
    t.add_argument("--out", default=None, help="checkpoint dir (default: the shipped weights dir of the model)")
    t.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: see module docstring)")
    for name, default in DEFAULTS.items():
        if name == "episode_fractions":
            t.add_argument("--episode-fractions", type=float, nargs=3, default=list(default))
        else:
            t.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    t.add_argument("--lambda-out", type=float, default=2.0)
    t.add_argument("--lambda-kl", type=float, default=1.0)
    t.add_argument("--ratios", type=float, nargs="+", default=list(DEFAULT_RATIOS))
    t.add_argument("--pooling", default="rms")
    t.add_argument("--ridge-v", type=float, default=None,
                   help="relative C_v ridge of the training episodes, hard fit and soft solve (default: FitConfig's "
                        "1e-3, as at inference); episodes fit C_v on a few hundred rows, inference on thousands")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--n-index-heads", type=int, default=None)
    t.add_argument("--d-index", type=int, default=None)
    t.add_argument("--d-value-attn", type=int, default=None)
    t.add_argument("--residual", nargs="?", const="ha", choices=("ha", "vi"), default=None,
                   help="residual indexer (not the paper's; the shipped form for the default model): the head weights start "
                        "at 0 and the logit adds the model's own attention logit (ha, the default), so training starts "
                        "from HA's scores, or VI's log-influence with VI's row weights (vi), so it starts from VI's")
    t.add_argument("--curve-pools", type=int, default=4)
    t.add_argument("--no-progress", action="store_true")
    return p


def settings_from_args(args: argparse.Namespace) -> RunSettings:
    train = TrainConfig(
        kl_epochs=args.kl_epochs, joint_epochs=args.joint_epochs, lr_kl=args.lr_kl, lr_joint=args.lr_joint,
        kl_max_rows=args.kl_max_rows, episode_fractions=tuple(args.episode_fractions),
        lambda_out=args.lambda_out, lambda_kl=args.lambda_kl, ratios=tuple(args.ratios),
        pooling=args.pooling, seed=args.seed,
        fit_config=None if args.ridge_v is None else FitConfig(ridge_v=args.ridge_v),
    )
    overrides = {k: getattr(args, k) for k in ("n_index_heads", "d_index", "d_value_attn")
                 if getattr(args, k) is not None}
    return RunSettings(train=train, indexer=overrides, residual=args.residual, curve_pools=args.curve_pools,
                       weight_ratios=tuple(args.ratios))


def _contexts(args: argparse.Namespace, tokenizer: Any) -> tuple[list[TrainingContext], list[TrainingContext], Path]:
    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir()
    source = data_dir / args.train_file
    spec = ContextSpec(args.min_tokens, args.max_tokens, args.dev_fraction, args.data_seed)
    train, dev = build_contexts(load_squad_articles(source), tokenizer, spec)
    if args.max_contexts is not None:
        train = train[: args.max_contexts]
    return train, dev, source


def main(argv: Sequence[str] | None = None, model: Any = None, tokenizer: Any = None) -> int:
    """Command line entry point (``scripts/train_indexer.py``). ``model``/``tokenizer`` may be
    passed in directly (tests); otherwise ``--model`` is loaded with ``load_model``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    if model is None:
        from arckv_press.models import load_model

        model, tokenizer = load_model(args.model, dtype=args.dtype)
    from arckv_press.models import model_id

    _log(f"command: {shlex.join([Path(sys.argv[0]).name] + list(argv if argv is not None else sys.argv[1:]))}")
    _log(f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} cores, torch "
         f"{torch.__version__}, {torch.get_num_threads()} thread(s)")
    train_ctx, dev_ctx, source = _contexts(args, tokenizer)
    settings = settings_from_args(args)
    pool_settings = PoolSettings(args.query_budget, args.pool_seed, args.repeat_chunk)
    pool_dir = Path(args.pool_dir) if args.pool_dir else default_pool_dir(model, args.cache_dir)
    shard_dir = Path(args.shard_dir) if args.shard_dir else default_shard_dir(model, args.cache_dir)
    _log(f"data: {source} -> train {contexts_summary(train_ctx)}, dev {contexts_summary(dev_ctx)}; "
         f"pools in {pool_dir}")
    i, n = (int(x) for x in args.pool_shard.split("/"))
    progress = not args.no_progress
    if args.pools_only:
        # development pools first: the held-out evaluation can start before training does
        build_pools(model, tokenizer, dev_ctx + train_ctx, pool_dir, pool_settings, (i, n), progress)
        _log(f"pools done in {time.perf_counter() - t_start:.0f} s")
        return 0
    train_paths = build_pools(model, tokenizer, train_ctx, pool_dir, pool_settings, (0, 1), progress)
    if args.merge:
        out = Path(args.out) if args.out else WEIGHTS_DIR / model_dir_name(model_id(model))
        training = {
            "source_file": str(args.train_file),
            "train_contexts": contexts_summary(train_ctx),
            "dev_contexts_held_out": contexts_summary(dev_ctx),
            "context_spec": asdict(ContextSpec(args.min_tokens, args.max_tokens, args.dev_fraction, args.data_seed)),
            "pool_settings": asdict(pool_settings),
            "epochs": {"kl": settings.train.kl_epochs, "joint": settings.train.joint_epochs},
            "model_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "torch_threads_per_process": args.threads,
            "machine": f"{platform.machine()} {os.cpu_count()} cores",
            "command": "scripts/train_indexer.py " + shlex.join(list(argv if argv is not None else sys.argv[1:])),
        }
        path = merge_shards(model, train_paths, shard_dir, out, settings, training)
        _log(f"merged checkpoint -> {path}")
        return 0
    layers = parse_layers(args.layers, model.config.num_hidden_layers)
    train_shard(model, train_paths, shard_dir, settings, layers, progress)
    _log(f"shard done in {time.perf_counter() - t_start:.0f} s")
    return 0
