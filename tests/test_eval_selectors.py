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
