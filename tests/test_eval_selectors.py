"""scripts/eval_selectors.py: one layer's rows against independent recomputation."""

import torch

from arckv_press.compaction.omp import AM_OMP_FAST, omp_select
from arckv_press.compaction.select import ha_scores, per_head_budgets, topk_anchors
from arckv_press.indexer.budget import fit_holdout_split, heldout_error
from arckv_press.indexer.model import IndexerConfig, ValueAwareIndexer
from arckv_press.indexer.train import ReferencePool
from conftest import load_script


def _pool(seed=0, H=2, G=2, n_ref=40, T=60, D=8, d_x=16):
    g = torch.Generator().manual_seed(seed)
    return ReferencePool(X=torch.randn(n_ref, d_x, generator=g), Q=2.0 * torch.randn(H, G * n_ref, D, generator=g),
                         K=torch.randn(H, T, D, generator=g), V=torch.randn(H, T, D, generator=g), scaling=D**-0.5)


def _rows(pool, ratios):
    mod = load_script("eval_selectors")
    cfg = IndexerConfig(num_layers=1, num_kv_heads=2, head_dim=8, d_x=16, n_index_heads=2, d_index=4, d_value_attn=4)
    idx = ValueAwareIndexer(cfg, seed=0)
    return list(mod.evaluate_layer(pool, 0, idx, idx, None, ratios, 0.25, 3, True))


def test_ha_and_omp_rows_match_recomputation():
    pool = _pool()
    rows = _rows(pool, (0.2, 0.1))
    fit, hold = fit_holdout_split(pool, 0.25, 3)
    Qf, Qh = pool.Q[:, fit], pool.Q[:, hold]
    for rho in (0.2, 0.1):
        budgets = per_head_budgets(pool.T, rho, None, 1, 2)[0]
        by_sel = {(r["selector"], r["pooling"]): r for r in rows if r["ratio"] == rho and r["budgets"] == "uniform"}
        assert set(by_sel) == {("indexer", p) for p in ("rms", "mean", "max")} | {("ha", p) for p in ("rms", "mean", "max")} \
            | {("vi", p) for p in ("rms", "mean", "max")} | {("indexer-init", "rms"), ("omp-fast", "-")}
        i, v = topk_anchors(ha_scores(Qf, pool.K, pool.scaling, pooling="rms"), budgets)
        ref = heldout_error(Qf, Qh, pool.K, pool.V, pool.scaling, i, v)
        torch.testing.assert_close(by_sel[("ha", "rms")]["err"], ref)
        i, v, _ = omp_select(Qf, pool.K, budgets, pool.scaling, AM_OMP_FAST)
        torch.testing.assert_close(by_sel[("omp-fast", "-")]["err"], heldout_error(Qf, Qh, pool.K, pool.V, pool.scaling, i, v))
        assert abs(by_sel[("ha", "rms")]["kept"] - int(budgets.sum()) / (2 * pool.T)) < 1e-9


def test_omp_is_skipped_with_a_message_when_keys_outnumber_fit_rows(capsys):
    pool = _pool(n_ref=8, T=200)             # 6 fit positions x 2 query heads = 12 fit rows; keep 20% = 40 keys
    rows = _rows(pool, (0.2, 0.02))          # keep 2% = 4 keys: OMP runs
    omp = [r["ratio"] for r in rows if r["selector"] == "omp-fast"]
    assert omp == [0.02]
    assert "omp-fast skipped at rho 0.2, T 200: 40 kept keys > 12 fit rows" in capsys.readouterr().out


class _WordTokenizer:
    """One token per whitespace-separated word (enough for build_contexts' counting)."""

    def encode(self, text, add_special_tokens=False):
        return text.split()


def test_dev_tokens_repack_the_same_held_out_articles_at_other_lengths():
    from arckv_press.indexer.data import ContextSpec, build_contexts

    mod = load_script("eval_selectors")
    articles = [(f"article {a}", [" ".join(f"w{a}_{p}_{i}" for i in range(40 + 7 * ((a + p) % 5))) for p in range(30)])
                for a in range(20)]
    training = {"context_spec": {"min_tokens": 120, "max_tokens": 180, "dev_fraction": 0.1, "seed": 3}}
    short = mod.dev_context_spec(training)
    assert short == ContextSpec(120, 180, 0.1, 3)
    long = mod.dev_context_spec(training, [500, 900])
    assert long == ContextSpec(500, 900, 0.1, 3)
    train_s, dev_s = build_contexts(articles, _WordTokenizer(), short)
    train_l, dev_l = build_contexts(articles, _WordTokenizer(), long)
    titles = lambda cs: {t for c in cs for t in c.articles}  # noqa: E731
    assert titles(dev_l) == titles(dev_s) and titles(dev_l).isdisjoint(titles(train_s))
    assert dev_l and all(500 <= c.n_tokens <= 900 for c in dev_l)
    assert max(c.n_tokens for c in dev_s) <= 180
    # a checkpoint without a stored spec falls back to the 1,200-1,800-token contexts of the first release
    assert mod.dev_context_spec({}) == ContextSpec(1200, 1800)


def test_per_head_budget_rows_use_the_weights_budgets():
    """With budget weights, the indexer and HA (RMS pooling) also get a ``per-head`` row whose
    anchors follow the weighted budgets t(l, h) (Eq. per_head_budget), recomputed here."""
    mod = load_script("eval_selectors")
    pool = _pool(seed=2)
    cfg = IndexerConfig(num_layers=1, num_kv_heads=2, head_dim=8, d_x=16, n_index_heads=2, d_index=4, d_value_attn=4)
    idx = ValueAwareIndexer(cfg, seed=0)
    weights = torch.tensor([[3.0, 1.0]])
    weights_layer = lambda T, rho: per_head_budgets(T, rho, weights, 1, 2)[0]  # noqa: E731
    rows = list(mod.evaluate_layer(pool, 0, idx, idx, weights_layer, (0.2, 0.1), 0.25, 3, False))
    fit, hold = fit_holdout_split(pool, 0.25, 3)
    for rho in (0.2, 0.1):
        per_head = {r["selector"]: r for r in rows if r["ratio"] == rho and r["budgets"] == "per-head"}
        assert set(per_head) == {"indexer", "ha"} and all(r["pooling"] == "rms" for r in per_head.values())
        budgets = weights_layer(pool.T, rho)
        assert budgets[0] > budgets[1]  # the weights really shift the budget
        i, v = topk_anchors(ha_scores(pool.Q[:, fit], pool.K, pool.scaling, pooling="rms"), budgets)
        ref = heldout_error(pool.Q[:, fit], pool.Q[:, hold], pool.K, pool.V, pool.scaling, i, v)
        torch.testing.assert_close(per_head["ha"]["err"], ref)
        assert per_head["ha"]["kept"] == float(budgets.sum()) / (2 * pool.T)
        uniform = next(r for r in rows if r["ratio"] == rho and r["selector"] == "ha" and r["pooling"] == "rms"
                       and r["budgets"] == "uniform")
        assert not torch.equal(uniform["err"], per_head["ha"]["err"])
