"""The ``arckv`` command line: ``compact`` then ``ask`` on a tiny local model, against the API."""

from __future__ import annotations

import pytest
import torch

from arckv_press import cli
from arckv_press.api import compact
from arckv_press.attention import enable_compact_attention
from arckv_press.generation import answer
from arckv_press.models import load_model
from conftest import build_tiny_tokenizer, make_text


def _tiny_folder(tiny_model, path, seed, num_layers=2):
    model = tiny_model("llama", num_layers=num_layers, seed=seed)
    model.config.eos_token_id = 2
    model.save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return path


def test_compact_then_ask_answers_as_the_api(tiny_model, tmp_path, capsys):
    """``arckv compact`` saves the compact cache of a text file; ``arckv ask`` answers from it alone
    (the text is gone) exactly as ``compact()`` + ``answer()`` do in one process."""
    folder = _tiny_folder(tiny_model, tmp_path / "model", seed=0)
    doc = tmp_path / "doc.txt"
    doc.write_text(make_text(400, seed=4), encoding="utf-8")
    out = tmp_path / "doc.arckv"
    common = ["--model", str(folder), "--dtype", "float32"]
    assert cli.main([*common, "compact", str(doc), "--method", "arckv-ha", "--ratio", "0.5", "-o", str(out)]) == 0
    assert "realised ratio" in capsys.readouterr().out and out.exists()

    text = doc.read_text(encoding="utf-8")
    doc.unlink()
    questions = ["What is it about?", "Who wrote it?"]
    assert cli.main([*common, "ask", str(out), *questions, "--max-new-tokens", "6"]) == 0
    printed = capsys.readouterr().out

    model, tok = load_model(str(folder), dtype="float32")
    with torch.inference_mode():
        cache = compact(model, tok, text, method="arckv-ha", ratio=0.5)
    enable_compact_attention(model)
    for q in questions:
        assert f"Q: {q}\nA: {answer(model, tok, cache, q, 6)}\n" in printed


def test_compact_options_reach_the_compaction_and_its_saved_record(tiny_model, tmp_path, capsys):
    """``--min-head-fraction`` / ``--lambda-m`` / ``--anchor-search`` change the compaction (uniform
    budgets at 1.0, as ``compact()`` gives them) and the saved cache records the options' ``config_id``."""
    from arckv_press.config import CompactionConfig, config_id
    from arckv_press.cache import CompactCache

    folder = _tiny_folder(tiny_model, tmp_path / "model", seed=0)
    doc = tmp_path / "doc.txt"
    doc.write_text(make_text(300, seed=5), encoding="utf-8")
    common = ["--model", str(folder), "--dtype", "float32", "compact", str(doc), "--method", "arckv-ha", "--ratio", "0.2"]
    model, tok = load_model(str(folder), dtype="float32")
    saved = {}
    for name, extra, options in (("default", [], {}),
                                 ("uniform", ["--min-head-fraction", "1", "--lambda-m", "0.5", "--anchor-search", "omp-fast"],
                                  {"min_head_fraction": 1.0, "lambda_m": 0.5, "anchor_search": "omp-fast"})):
        out = tmp_path / f"{name}.arckv"
        assert cli.main([*common, *extra, "-o", str(out)]) == 0
        capsys.readouterr()
        saved[name] = CompactCache.load(out, model)
        want = config_id(CompactionConfig(method="arckv-ha", ratio=0.2, **options))
        assert saved[name].metadata.extra["config_id"] == want
        with torch.inference_mode():
            ref = compact(model, tok, doc.read_text(encoding="utf-8"), method="arckv-ha", ratio=0.2, **options)
        for got, exp in zip(saved[name].compact_layers, ref.compact_layers):
            assert torch.equal(got.lengths, exp.lengths) and torch.allclose(got.beta, exp.beta)
    assert saved["uniform"].metadata.extra["config_id"] != saved["default"].metadata.extra["config_id"]
    lengths = torch.stack([layer.lengths for layer in saved["uniform"].compact_layers])
    assert torch.equal(lengths, torch.full_like(lengths, int(lengths.max())))  # uniform budgets


def test_ask_refuses_a_cache_built_for_another_model(tiny_model, tmp_path, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text(make_text(400, seed=1), encoding="utf-8")
    out = tmp_path / "doc.arckv"
    first = _tiny_folder(tiny_model, tmp_path / "a", seed=0)
    other = _tiny_folder(tiny_model, tmp_path / "b", seed=0, num_layers=3)
    assert cli.main(["--model", str(first), "--dtype", "float32", "compact", str(doc), "--method", "arckv-ha",
                     "--ratio", "0.5", "-o", str(out)]) == 0
    capsys.readouterr()
    assert cli.main(["--model", str(other), "--dtype", "float32", "ask", str(out), "q"]) == 2
    assert "was built for model" in capsys.readouterr().err
    retrained = _tiny_folder(tiny_model, tmp_path / "c", seed=1)  # same architecture, other weights
    assert cli.main(["--model", str(retrained), "--dtype", "float32", "ask", str(out), "q"]) == 2
    assert "with other weights" in capsys.readouterr().err


def test_bad_ratio_is_a_clear_error(tiny_model, tmp_path, capsys):
    folder = _tiny_folder(tiny_model, tmp_path / "model", seed=0)
    doc = tmp_path / "doc.txt"
    doc.write_text(make_text(400), encoding="utf-8")
    assert cli.main(["--model", str(folder), "compact", str(doc), "--method", "arckv-ha", "--ratio", "1.5"]) == 2
    assert "ratio" in capsys.readouterr().err


def test_compact_help_states_the_configs_defaults():
    """The help text of ``arckv compact`` quotes :class:`CompactionConfig`'s defaults (not copies)."""
    from arckv_press.config import CompactionConfig

    sub = next(a for a in cli.build_parser()._actions if a.dest == "command").choices["compact"]
    helps = {a.dest: a.help for a in sub._actions}
    defaults = CompactionConfig()
    own = "; models with their own schedule: google/gemma-3-270m)"
    assert defaults.lambda_m is None and f"(default: 0.25 at every kept fraction{own}" in helps["lambda_m"]
    assert defaults.anchor_search is None
    assert f"(default: by kept fraction, scores at ratio >= 0.05, omp below{own}" in helps["anchor_search"]
    assert f"(default {defaults.min_head_fraction};" in helps["min_head_fraction"]
    assert defaults.tail_rows is None  # consecutive steps with the same value are one run
    assert f"default: by kept fraction, 512 at ratio >= 0.1, 0 below{own[:-1]}; arckv-vi: 0)" in helps["tail_rows"]
    parser = cli.build_parser()
    assert parser.parse_args(["compact", "doc.txt", "--tail-rows", "0"]).tail_rows == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["compact", "doc.txt", "--tail-rows", "-1"])


def test_demo_runs_every_method_and_reports_real_cache_sizes(tiny_model, tmp_path, capsys):
    """``arckv demo`` (the README's main job) on a tiny model: one row per method, in order; ``arckv``
    without a shipped indexer is skipped with the reason; compacted caches hold fewer bytes than the
    full one, and kvpress's SnapKV (which evicts) too."""
    folder = _tiny_folder(tiny_model, tmp_path / "model", seed=0)
    haystack = tmp_path / "hay.txt"
    haystack.write_text(make_text(3000, seed=2), encoding="utf-8")
    methods = ["none", "arckv", "arckv-ha", "am-omp-fast", "snapkv", "no-such-method"]
    assert cli.main(["--model", str(folder), "--dtype", "float32", "demo", "--tokens", "300", "--ratio", "0.25",
                     "--haystack", str(haystack), "--max-new-tokens", "3", "--methods", *methods]) == 0
    out = capsys.readouterr().out
    assert "question:" in out and "context " in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0] in methods}
    assert list(rows) == methods
    assert "skipped:" in rows["arckv"] and "indexer" in " ".join(rows["arckv"])
    assert "skipped:" in rows["no-such-method"] and "unknown method" in " ".join(rows["no-such-method"])
    assert rows["none"][1] == "1.00" and rows["arckv-ha"][1] == "0.25"
    full = float(rows["none"][2])
    for name in ("arckv-ha", "am-omp-fast", "snapkv"):
        assert 0 < float(rows[name][2]) < 0.5 * full, (name, rows[name])


def test_train_indexer_subcommand_is_the_training_script(monkeypatch, capsys):
    """``arckv train-indexer ARGS`` hands ARGS unchanged to the training driver that
    ``scripts/train_indexer.py`` runs, whose own parser (--layers, --merge, ...) answers --help."""
    import pytest

    from arckv_press.indexer import driver

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train-indexer", "--help"])
    assert exit_info.value.code == 0
    usage = capsys.readouterr().out
    assert "--layers" in usage and "--merge" in usage and "--residual" in usage
    seen = []
    monkeypatch.setattr(driver, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["train-indexer", "--layers", "0,1", "--threads", "1"]) == 0
    assert seen == [["--layers", "0,1", "--threads", "1"]]
