"""Tests of the indexer's training data (``arckv_press.indexer.data``) and of the training driver
(``arckv_press.indexer.driver``: pools -> layer shards -> merge) on a tiny random model."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from arckv_press.indexer import data as D
from arckv_press.indexer.checkpoint import load_indexer
from arckv_press.indexer.model import PARAM_NAMES, ValueAwareIndexer
from arckv_press.models import config_hash, model_id
from conftest import make_text  # noqa: E402

DATA_DIR = D.default_data_dir()
HAVE_DATA = (DATA_DIR / D.SQUAD_TRAIN_FILE).is_file()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class WordTokenizer:
    """Whitespace 'tokenizer' (one token per word, one per blank-line separator): a fast
    stand-in for context packing on the real corpus."""

    def encode(self, text, add_special_tokens=False):
        return [0] * (len(text.split()) + text.count("\n\n"))


def _fake_articles(n_articles=5, n_paragraphs=6, seed=0):
    rng = random.Random(seed)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    return [(f"Article {a}", [" ".join(rng.choice(words) for _ in range(rng.randint(8, 20))) + f" a{a}p{p}."
                              for p in range(n_paragraphs)]) for a in range(n_articles)]


def _write_squad(path: Path, articles) -> Path:
    obj = {"version": "v2.0", "data": [{"title": t, "paragraphs": [{"context": p, "qas": []} for p in ps]}
                                       for t, ps in articles]}
    path.write_text(json.dumps(obj))
    return path


# ----------------------------------------------------------------------------------------------
# contexts
# ----------------------------------------------------------------------------------------------


def test_contexts_are_deterministic_packed_and_split_by_article():
    arts = _fake_articles(n_articles=10, n_paragraphs=8)
    tok = WordTokenizer()
    spec = D.ContextSpec(min_tokens=40, max_tokens=70, dev_fraction=0.2, seed=3)
    train, dev = D.build_contexts(arts, tok, spec)
    again = D.build_contexts(arts, tok, spec)
    assert (train, dev) == again
    other = D.build_contexts(arts, tok, D.ContextSpec(40, 70, 0.2, seed=4))
    assert [c.text for c in other[0]] != [c.text for c in train]
    assert len(train) >= 5 and len(dev) >= 1
    for c in train + dev:
        # word tokenizer: the packed estimate is exact
        assert 40 <= c.n_tokens <= 70 and c.n_tokens == len(tok.encode(c.text))
        assert c.split in ("train", "dev") and len(c.id) == 16
    train_articles = {a for c in train for a in c.articles}
    dev_articles = {a for c in dev for a in c.articles}
    assert len(dev_articles) == 2 and not train_articles & dev_articles
    # every paragraph of a context comes from its articles, in file order within an article
    by_title = dict(arts)
    for c in train + dev:
        paras = c.text.split("\n\n")
        assert all(any(p in by_title[a] for a in c.articles) for p in paras)
    with pytest.raises(ValueError, match="min_tokens"):
        D.ContextSpec(min_tokens=10, max_tokens=5)


def _evaluation_texts() -> dict[str, str]:
    """The text each evaluation file contributes (parsed, so JSON escapes do not hide overlaps)."""
    out = {}
    for rel in D.EVALUATION_FILES:
        path = DATA_DIR / rel
        if not path.is_file():
            continue
        if rel.endswith(".txt"):
            out[rel] = path.read_text(encoding="utf-8")
        elif "squad" in rel:
            out[rel] = "\n".join(p for _, ps in D.load_squad_articles(path) for p in ps)
        elif "hotpotqa" in rel:
            recs = json.loads(path.read_text(encoding="utf-8"))
            out[rel] = "\n".join("".join(s) for r in recs for _, s in r["context"])
        elif rel.endswith(".json"):
            out[rel] = json.loads(path.read_text(encoding="utf-8"))["text"]
        else:  # jsonl (QuALITY: input, LongBench: context)
            rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
            out[rel] = "\n".join(str(r.get("input", "")) + str(r.get("context", "")) for r in rows)
    return out


def _snippets(texts, length=80):
    return [t[len(t) // 2 - length // 2: len(t) // 2 + length // 2] for t in texts if len(t) > length]


@pytest.mark.skipif(not HAVE_DATA, reason="shared data folder not available")
def test_training_text_is_disjoint_from_every_evaluation_file():
    articles = D.load_squad_articles(DATA_DIR / D.SQUAD_TRAIN_FILE)
    assert len(articles) == 20 and sum(len(p) for _, p in articles) == 570
    train, dev = D.build_contexts(articles, WordTokenizer(), D.ContextSpec(800, 1200))
    paragraphs = [p for c in train + dev for p in c.text.split("\n\n")]
    evals = _evaluation_texts()
    assert D.SQUAD_EVAL_FILE in evals and len(evals) >= 4
    snippets = _snippets(paragraphs)
    assert len(snippets) > 400
    for rel, text in evals.items():
        hits = [s for s in snippets if s in text]
        assert not hits, f"{len(hits)} training snippets occur in {rel}, e.g. {hits[0]!r}"
    # the check can fail: paragraphs of the evaluation half are found
    dev_half = [p for _, ps in D.load_squad_articles(DATA_DIR / D.SQUAD_EVAL_FILE) for p in ps]
    assert sum(s in evals[D.SQUAD_EVAL_FILE] for s in _snippets(dev_half[:20])) == 20


# ----------------------------------------------------------------------------------------------
# reference pools
# ----------------------------------------------------------------------------------------------


def _tiny(tiny_model, tiny_tokenizer):
    model = tiny_model("llama", num_layers=2, seed=0)
    return model, tiny_tokenizer()


def _char_contexts(n=3, seed=0):
    arts = _fake_articles(n_articles=n + 2, n_paragraphs=3, seed=seed)
    return D.build_contexts(arts, _CharTok(), D.ContextSpec(120, 220, 0.2, seed))


class _CharTok:
    def encode(self, text, add_special_tokens=False):
        return list(text)


def test_pool_round_trip_and_resumable_cache(tiny_model, tiny_tokenizer, tmp_path, monkeypatch):
    from arckv_press.capture import encode_document

    model, tok = _tiny(tiny_model, tiny_tokenizer)
    train, _ = _char_contexts()
    settings = D.PoolSettings(query_budget=24, seed=1)
    paths = D.build_pools(model, tok, train[:2], tmp_path, settings, progress=False)
    assert [p.parent for p in paths] == [tmp_path] * 2 and all(p.is_file() for p in paths)
    meta = D.read_pool_metadata(paths[0])
    assert meta["model_id"] == model_id(model) and meta["config_hash"] == config_hash(model.config)
    assert json.loads(meta["layers"]) == [0, 1] and meta["n_ref"] == str(24 // 2)

    # independent reference for K, V: a plain prefill of the same ids
    ids, prefix = encode_document(tok, train[0].text)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model.model(input_ids=ids, past_key_values=cache, use_cache=True)
    for layer in (0, 1):
        pool = D.load_pool(paths[0], layer)
        T = ids.shape[1] - prefix
        assert pool.K.shape == (2, T, 16) and pool.Q.shape == (2, 2 * 12, 16) and pool.X.shape == (12, 64)
        torch.testing.assert_close(pool.K, cache.layers[layer].keys[0, :, prefix:])
        torch.testing.assert_close(pool.V, cache.layers[layer].values[0, :, prefix:])
        assert pool.scaling == pytest.approx(16 ** -0.5)
        # Q rows are post-RoPE queries of the 2 query heads of each KV head (g-major): the
        # capture's own q_proj(X) before RoPE has the same per-row norms (RoPE is a rotation)
        attn = model.model.layers[layer].self_attn
        q = attn.q_proj(pool.X).view(12, 4, 16).transpose(0, 1)  # [H_q, n, D]
        torch.testing.assert_close(pool.Q.reshape(4, 12, 16).norm(dim=-1), q.norm(dim=-1), rtol=1e-4, atol=1e-5)
    assert D.load_pool(paths[0], 1, dtype=torch.float64).K.dtype == torch.float64
    with pytest.raises(ValueError, match="no layer 5"):
        D.load_pool(paths[0], 5)

    # second call: cached files are reused, nothing is recomputed
    def boom(*a, **k):
        raise AssertionError("compute_pool called for a cached context")

    mtimes = [p.stat().st_mtime_ns for p in paths]
    monkeypatch.setattr(D, "compute_pool", boom)
    assert D.build_pools(model, tok, train[:2], tmp_path, settings, progress=False) == paths
    assert [p.stat().st_mtime_ns for p in paths] == mtimes
    monkeypatch.undo()
    # other settings -> other files; sharded builds cover exactly the contexts of their shard
    other = D.pool_path(tmp_path, model, train[0].text, D.PoolSettings(query_budget=24, seed=2))
    assert other not in paths
    shard_dir = tmp_path / "sharded"
    D.build_pools(model, tok, train[:3], shard_dir, settings, shard=(1, 2), progress=False)
    assert sorted(p.name for p in shard_dir.iterdir()) == [paths[1].name]


# ----------------------------------------------------------------------------------------------
# training driver: pools -> shards -> merge
# ----------------------------------------------------------------------------------------------


def _args(tmp_path, *extra):
    return ["--data-dir", str(tmp_path), "--train-file", "squad.json", "--min-tokens", "120",
            "--max-tokens", "220", "--dev-fraction", "0.2", "--max-contexts", "3", "--query-budget", "24",
            "--cache-dir", str(tmp_path / "cache"), "--kl-epochs", "1", "--joint-epochs", "1",
            "--kl-max-rows", "8", "--curve-pools", "2", "--n-index-heads", "2", "--d-index", "4",
            "--d-value-attn", "4", "--no-progress", *extra]


def test_train_script_smoke_shards_resume_and_merge(tiny_model, tiny_tokenizer, tmp_path, capsys):
    from arckv_press.indexer import driver

    model, tok = _tiny(tiny_model, tiny_tokenizer)
    _write_squad(tmp_path / "squad.json", _fake_articles(n_articles=8, n_paragraphs=4, seed=1))
    assert driver.main(_args(tmp_path, "--pools-only"), model, tok) == 0
    shard_dir = driver.default_shard_dir(model, tmp_path / "cache")
    with pytest.raises(ValueError, match="no finished shard for layers \\[0, 1\\]"):
        driver.main(_args(tmp_path, "--merge", "--out", str(tmp_path / "ck")), model, tok)
    assert driver.main(_args(tmp_path, "--layers", "0"), model, tok) == 0
    assert driver.layer_shard_path(shard_dir, 0).is_file() and not driver.layer_shard_path(shard_dir, 1).exists()

    # layer 1 in two time slices (resume) == layer 1 in one go (another shard dir)
    args = driver.build_parser().parse_args(_args(tmp_path))
    settings = driver.settings_from_args(args)
    train_ctx, _, _ = driver._contexts(args, tok)
    pool_paths = [D.pool_path(D.default_pool_dir(model, tmp_path / "cache"), model, c.text,
                              D.PoolSettings(24)) for c in train_ctx]
    from arckv_press.models import model_id

    assert D.default_pool_dir(model_id(model), tmp_path / "cache") == D.default_pool_dir(model, tmp_path / "cache")
    assert driver.train_shard(model, pool_paths, shard_dir, settings, [1], False, max_epochs=1) == []
    assert driver.layer_state_path(shard_dir, 1).is_file()
    assert driver.train_shard(model, pool_paths, shard_dir, settings, [1], False) == [1]
    assert not driver.layer_state_path(shard_dir, 1).exists()
    driver.train_shard(model, pool_paths, tmp_path / "one_go", settings, [1], False)
    a, meta_a = driver.read_shard(driver.layer_shard_path(shard_dir, 1))
    b, meta_b = driver.read_shard(driver.layer_shard_path(tmp_path / "one_go", 1))
    assert all(torch.equal(a[k], b[k]) for k in a) and meta_a["metrics"] == meta_b["metrics"]
    assert [m["stage"] for m in meta_a["metrics"]] == ["kl", "joint"]
    assert a["error_curves"].shape == (2, len(settings.curve_fractions))

    out = tmp_path / "ck"
    assert driver.main(_args(tmp_path, "--merge", "--out", str(out)), model, tok) == 0
    indexer, meta, bw = load_indexer(out, model_id=model_id(model), config_hash=config_hash(model.config))
    assert bw.shape == (2, 2) and bw.sum().item() == pytest.approx(1.0) and (bw > 0).all()
    for k in PARAM_NAMES:
        torch.testing.assert_close(indexer.layer_params(1)[k], a[k])
    assert (indexer.config.n_index_heads, indexer.config.d_index) == (2, 4)
    # load_shard_layers: the layers of a shard dir replace a checkpoint's, the others stay
    fresh = ValueAwareIndexer(indexer.config, seed=7)
    before = {k: v.clone() for k, v in fresh.layer_params(0).items()}
    assert driver.load_shard_layers(fresh, tmp_path / "one_go") == [1]
    for k in PARAM_NAMES:
        torch.testing.assert_close(fresh.layer_params(1)[k], b[k])
        assert torch.equal(fresh.layer_params(0)[k], before[k])
    with pytest.raises(ValueError, match="no finished layer shard"):
        driver.load_shard_layers(fresh, tmp_path)
    # shards of another indexer size: their config is read back, and they never go into this indexer
    assert driver.shard_config(tmp_path / "one_go") == indexer.config
    wider = ValueAwareIndexer(replace(indexer.config, n_index_heads=3), seed=7)
    with pytest.raises(ValueError, match="have indexer config"):
        driver.load_shard_layers(wider, tmp_path / "one_go")
    tr = meta.training
    assert tr["source_file"] == "squad.json" and tr["train_contexts"]["contexts"] == 3
    assert tr["epochs"] == {"kl": 1, "joint": 1} and tr["run_fingerprint"] and meta.package_version
    assert tr["train_contexts"]["tokens"] == sum(c.n_tokens for c in train_ctx)

    # a shard from other settings is refused, never mixed
    with pytest.raises(ValueError, match="another run"):
        driver.main(_args(tmp_path, "--layers", "0", "--lr-kl", "0.5"), model, tok)
    with pytest.raises(ValueError, match="different settings"):
        driver.main(_args(tmp_path, "--merge", "--out", str(out), "--lr-kl", "0.5"), model, tok)


def test_ridge_v_flag_sets_the_training_fit_and_the_run_fingerprint(tiny_model, tmp_path):
    from arckv_press.compaction.fit import FitConfig
    from arckv_press.indexer import driver

    default = driver.settings_from_args(driver.build_parser().parse_args(_args(tmp_path)))
    ridged = driver.settings_from_args(driver.build_parser().parse_args(_args(tmp_path, "--ridge-v", "0.1")))
    assert default.train.fit_config is None
    assert ridged.train.fit_config == FitConfig(ridge_v=0.1)
    model, pools = tiny_model("llama", num_layers=2, seed=0), [tmp_path / "a.safetensors"]
    assert driver.run_fingerprint(model, pools, default) != driver.run_fingerprint(model, pools, ridged)
    with pytest.raises(ValueError, match="ridge_v"):
        driver.settings_from_args(driver.build_parser().parse_args(_args(tmp_path, "--ridge-v", "-1")))


@pytest.mark.parametrize("base", ["ha", "vi"])
def test_residual_flag_trains_and_merges_a_residual_checkpoint(tiny_model, tiny_tokenizer, tmp_path, base):
    """``--residual [ha|vi]``: its own run fingerprint (never mixed with the paper's indexer's
    shards), and the merged checkpoint adds the model's attention logit with the model's own
    softmax scale (HA base) or VI's log-influence (VI base)."""
    from arckv_press.indexer import driver
    from arckv_press.models import describe_attention_layout, model_id

    model, tok = _tiny(tiny_model, tiny_tokenizer)
    _write_squad(tmp_path / "squad.json", _fake_articles(n_articles=8, n_paragraphs=4, seed=1))
    resid = (*_args(tmp_path, "--kl-epochs", "0"), "--residual", *([] if base == "ha" else [base]))
    plain = driver.settings_from_args(driver.build_parser().parse_args(_args(tmp_path, "--kl-epochs", "0")))
    settings = driver.settings_from_args(driver.build_parser().parse_args(resid))
    other = driver.settings_from_args(driver.build_parser().parse_args(
        (*_args(tmp_path, "--kl-epochs", "0"), "--residual", "vi" if base == "ha" else "ha")))
    assert settings.residual == base
    pools = [tmp_path / "a.safetensors"]
    prints = {driver.run_fingerprint(model, pools, x) for x in (plain, settings, other)}
    assert len(prints) == 3
    assert driver.main([*resid, "--layers", "0-1"], model, tok) == 0
    out = tmp_path / "ck"
    assert driver.main([*resid, "--merge", "--out", str(out)], model, tok) == 0
    indexer, meta, _ = load_indexer(out, model_id=model_id(model), config_hash=config_hash(model.config))
    assert indexer.config.base_logit_scale == describe_attention_layout(model).scaling
    assert indexer.config.base_value_influence == (base == "vi")
    assert meta.training["epochs"] == {"kl": 0, "joint": 1}
    # training moved the head weights away from zero (the learned correction of the base is live)
    assert torch.count_nonzero(indexer.L_x) > 0


def test_merge_on_a_hybrid_model_ships_its_global_layers(tiny_model, tiny_tokenizer, tmp_path):
    """A hybrid model (Gemma 3: sliding-window layers are never compacted) trains shards of its
    full-attention layers only; the merged checkpoint holds those layers' trained parameters, the
    sliding layers' initial ones with budget weight 0, and ``arckv`` compacts with it."""
    from arckv_press.api import compact
    from arckv_press.indexer import driver
    from arckv_press.models import describe_attention_layout, model_id

    model, tok = tiny_model("gemma3", num_layers=4, seed=0), tiny_tokenizer()
    full = list(describe_attention_layout(model).full_attention_layers)
    assert full == [1, 3]
    _write_squad(tmp_path / "squad.json", _fake_articles(n_articles=8, n_paragraphs=4, seed=1))
    resid = (*_args(tmp_path, "--kl-epochs", "0"), "--residual")
    with pytest.raises(ValueError, match="not full-attention layers"):
        driver.main([*resid, "--layers", "0"], model, tok)
    assert driver.main([*resid, "--layers", "1,3"], model, tok) == 0
    out = tmp_path / "ck"
    assert driver.main([*resid, "--merge", "--out", str(out)], model, tok) == 0
    indexer, _, bw = load_indexer(out, model_id=model_id(model), config_hash=config_hash(model.config))
    shard_dir = driver.default_shard_dir(model, tmp_path / "cache")
    fresh = ValueAwareIndexer(indexer.config, seed=driver.RunSettings().init_seed)
    for layer in range(4):
        want = driver.read_shard(driver.layer_shard_path(shard_dir, layer))[0] if layer in full else fresh.layer_params(layer)
        for k in PARAM_NAMES:
            assert torch.equal(indexer.layer_params(layer)[k], want[k]), (layer, k)
    assert bw[[0, 2]].eq(0).all() and (bw[full] > 0).all() and bw.sum().item() == pytest.approx(1.0)
    with torch.no_grad():
        cache = compact(model, tok, make_text(120, seed=2), "arckv", 0.25, indexer=str(out), query_budget=24)
    assert [layer.layer_idx for layer in cache.compact_layers] == full
