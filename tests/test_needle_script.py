"""scripts/needle.py: rows of another indexer checkpoint or other compaction defaults are neither
resumed nor drawn."""

from __future__ import annotations

import pytest
from conftest import load_script

from arckv_press.config import CompactionConfig, config_id
from arckv_press.models import DEFAULT_MODEL_ID
from arckv_press.registry import indexer_id, method_config_id
from arckv_press.runinfo import CurrentIds


def test_needle_rows_of_another_indexer_checkpoint_or_config_are_left_out(tmp_path, capsys):
    needle = load_script("needle")
    shipped = indexer_id("arckv", DEFAULT_MODEL_ID)
    assert shipped  # the default model ships a checkpoint
    cfg, cfg_ha = method_config_id("arckv", 0.1), method_config_id("arckv-ha", 0.1)
    assert cfg == config_id(CompactionConfig(method="arckv")) and cfg_ha == config_id(CompactionConfig(method="arckv-ha"))
    ids = CurrentIds(DEFAULT_MODEL_ID)
    assert {m: ids(m, 0.1) for m in ("arckv", "arckv-ha", "snapkv", "none")} == {
        "arckv": {"indexer": shipped, "config_id": cfg}, "arckv-ha": {"indexer": "", "config_id": cfg_ha},
        "snapkv": {"indexer": "", "config_id": ""}, "none": {"indexer": "", "config_id": ""}}
    # the lambda_m schedule: keep 2% has its own id, so its rows never count as keep 10%'s defaults
    assert ids("arckv-ha", 0.02)["config_id"] == method_config_id("arckv-ha", 0.02) != cfg_ha

    def row(method, indexer, config, correct, depth="0"):
        return {"method": method, "ratio": "0.1", "length": "1000", "depth": depth, "seed": "0", "context_tokens": "990",
                "needle": "1234567", "answer": "x", "correct": correct, "compaction_s": "1.0", "answer_s": "1.0",
                "cache_bytes": "10", "masked": "0", "indexer": indexer, "config_id": config, "model": DEFAULT_MODEL_ID,
                "command": "c", "date": "2026-01-01T00:00:00Z", "package_version": "0", "machine": "m"}

    rows = [row("arckv", "0123456789ab", cfg, 0), row("arckv", shipped, cfg, 1, "0.5"),
            row("arckv-ha", "", "0123456789ab", 0), row("arckv-ha", "", cfg_ha, 1, "0.5"),
            row("snapkv", "", "", 0), row("none", "", "", 1)]
    kept = needle.current_rows(rows, DEFAULT_MODEL_ID)
    assert [(r["method"], r["indexer"], r["config_id"]) for r in kept] == [
        ("arckv", shipped, cfg), ("arckv-ha", "", cfg_ha), ("snapkv", "", ""), ("none", "", "")]
    assert "2 rows made with another indexer checkpoint or other compaction defaults are left out" in capsys.readouterr().out
    path = tmp_path / "needle.csv"
    needle.append_rows(path, rows, needle.FIELDS)
    needle.summary(path)  # arckv / arckv-ha: the current single row (correct), not the old one
    out = capsys.readouterr().out
    for method in ("arckv", "arckv-ha"):  # rows without a framing column are RULER-framed
        line = next(line for line in out.splitlines() if line.split()[:2] == ["ruler", method])
        assert line.split()[4:6] == ["1", "1.00"]

    # another model's rows, written last, stay out of the default model's summary, figures and depth
    # tables, and get figures of their own
    gemma = "google/gemma-3-270m"
    needle.append_rows(path, [{**row("snapkv", "", "", 1), "model": gemma}, {**row("none", "", "", 0), "model": gemma}],
                       needle.FIELDS)
    needle.summary(path)
    line = next(line for line in capsys.readouterr().out.splitlines() if line.split()[:2] == ["ruler", "snapkv"])
    assert line.split()[4:6] == ["1", "0.00"]  # the default model's one case (missed), not Gemma 3's
    needle.write_depth_tables(path, tmp_path / "depths.md")
    text = (tmp_path / "depths.md").read_text()
    assert DEFAULT_MODEL_ID in text and gemma not in text and "| `snapkv` | 1K | 0/1 |" in text
    assert [p.name for p in needle.plot(path, tmp_path, model=gemma)] == ["needle_gemma-3-270m_rho0.1.png"]
    assert [p.name for p in needle.plot(path, tmp_path)] == ["needle_rho0.1.png"]


def test_indexer_flag_reaches_the_press_and_the_row_ids(tmp_path, monkeypatch):
    """``--indexer DIR``: the methods that use the learned indexer get that checkpoint (its id in
    the rows and in the resume key), the others are unaffected."""
    import torch

    from arckv_press.indexer.checkpoint import checkpoint_id, save_indexer
    from arckv_press.indexer.model import IndexerConfig, ValueAwareIndexer

    needle = load_script("needle")
    ck = tmp_path / "ck"
    save_indexer(ValueAwareIndexer(IndexerConfig(num_layers=1, num_kv_heads=1, head_dim=4, d_x=4)), ck,
                 model_id=DEFAULT_MODEL_ID, config_hash="x")
    ids = CurrentIds(DEFAULT_MODEL_ID, None, str(ck))
    assert ids("arckv", 0.1)["indexer"] == checkpoint_id(ck) != indexer_id("arckv", DEFAULT_MODEL_ID)
    assert ids("arckv-ha", 0.1)["indexer"] == "" and ids("arckv-ha", 0.1) == CurrentIds(DEFAULT_MODEL_ID)("arckv-ha", 0.1)
    made = []
    monkeypatch.setattr("arckv_press.registry.make_press", lambda name, ratio, **kw: made.append((name, kw)))
    for name in ("arckv", "arckv-ha"):
        try:
            needle.run_case(None, torch.nn.Module(), "tok", name, 0.1, "ctx", None, str(ck))
        except Exception:
            pass  # the fake pipeline fails after the press is built
    assert made == [("arckv", {"tokenizer": "tok", "indexer": str(ck)}), ("arckv-ha", {"tokenizer": "tok"})]


def test_press_options_reach_our_presses_and_their_ids(monkeypatch):
    """``--option`` goes to the ARC-KV / AM presses only, and their rows get that option's config id."""
    import torch

    from arckv_press.registry import result_ids

    needle = load_script("needle")
    opts = {"fit": {"scope": "all"}}
    ids = CurrentIds(DEFAULT_MODEL_ID, opts)
    as_press = {"config_options": {"fit": {"scope": "all"}}}  # fit is no ARCKVPress argument
    assert ids("arckv-ha", 0.1) == result_ids("arckv-ha", DEFAULT_MODEL_ID, 0.1, **as_press) != result_ids("arckv-ha", DEFAULT_MODEL_ID, 0.1)
    assert ids("snapkv", 0.1) == result_ids("snapkv", DEFAULT_MODEL_ID, 0.1)
    made = []
    monkeypatch.setattr("arckv_press.registry.make_press", lambda name, ratio, **kw: made.append((name, kw)))
    for name in ("arckv-ha", "snapkv"):
        try:
            needle.run_case(None, torch.nn.Module(), "tok", name, 0.1, "ctx", None, None, opts)
        except Exception:
            pass  # the fake pipeline fails after the press is built
    assert made == [("arckv-ha", {"tokenizer": "tok", **as_press}), ("snapkv", {})]


def test_default_grid_is_the_issues_grid(tmp_path, monkeypatch):
    """Without arguments: every default method x keep 20/10/5% x 1K/2K/4K/8K x five depths, plus the
    full cache once per (length, depth, seed)."""
    needle = load_script("needle")
    seen = []
    monkeypatch.setattr(needle, "run", lambda args, meta: seen.append(args))
    assert needle.main(["--out", str(tmp_path / "n.csv")]) == 0
    args = seen[0]
    assert (args.ratios, args.lengths, args.depths, args.seeds) == ([0.2, 0.1, 0.05], [1000, 2000, 4000, 8000],
                                                                     [0.0, 0.25, 0.5, 0.75, 1.0], [0])
    assert set(needle.DEFAULT_METHODS) >= {"arckv", "arckv-ha", "arckv-vi", "am-omp", "am-omp-fast", "kvzip", "snapkv"}
    cases = needle.build_cases(args)
    assert len(cases) == len(set(cases)) == 4 * 5 * (1 + 3 * len(needle.DEFAULT_METHODS))
    assert sum(c[0] == "none" for c in cases) == 20


def test_tiny_run_resumes_is_deterministic_and_draws_one_panel_per_method(tiny_model, tmp_path, monkeypatch, capsys):
    """A real run on a tiny model: one row per case, a rerun finds every case done, a second run
    with the same seed gives the same answers, and each kept fraction's figure has the full-cache
    panel plus one panel per method."""
    import matplotlib.figure

    from conftest import build_tiny_tokenizer, make_text

    needle = load_script("needle")
    model = tiny_model("llama", num_layers=2, seed=0)
    model.config.eos_token_id = 2
    model.save_pretrained(tmp_path / "model")
    build_tiny_tokenizer().save_pretrained(tmp_path / "model")
    (tmp_path / "hay.txt").write_text(make_text(3000, seed=3), encoding="utf-8")
    titles = {}
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, path, **kw: titles.__setitem__(path.name, [a.get_title().split("\n")[0]
                                                                              for a in fig.axes if a.get_title()]))
    common = ["--model", str(tmp_path / "model"), "--haystack", str(tmp_path / "hay.txt"), "--lengths", "300",
              "--depths", "0", "1", "--ratios", "0.5", "0.25", "--methods", "arckv-ha", "snapkv", "--threads", "1"]
    first, second = tmp_path / "a" / "needle.csv", tmp_path / "b" / "needle.csv"
    first.parent.mkdir(), second.parent.mkdir()
    assert needle.main([*common, "--out", str(first)]) == 0
    rows = needle.read_rows(first)
    assert sorted((r["method"], r["ratio"], r["depth"]) for r in rows) == sorted(
        [("none", "1", d) for d in ("0", "1")] + [(m, r, d) for m in ("arckv-ha", "snapkv") for r in ("0.5", "0.25")
                                                  for d in ("0", "1")])
    assert all(r["needle"] == rows[0]["needle"] and r["correct"] in ("0", "1") for r in rows)
    by_method = {(r["method"], r["ratio"]): int(r["cache_bytes"]) for r in rows if r["depth"] == "0"}
    assert by_method[("arckv-ha", "0.25")] < by_method[("arckv-ha", "0.5")] < by_method[("none", "1")]
    # the model is not the default one: its figures carry its short name (here the folder's, "model")
    assert titles == {"needle_model_rho0.5.png": ["full cache", "arckv-ha", "snapkv"],
                      "needle_model_rho0.25.png": ["full cache", "arckv-ha", "snapkv"]}
    capsys.readouterr()
    assert needle.main([*common, "--out", str(first)]) == 0
    assert "0 cases to run, 10 already in" in capsys.readouterr().out and len(needle.read_rows(first)) == 10
    assert needle.main([*common, "--out", str(second)]) == 0
    again = needle.read_rows(second)
    assert [(r["method"], r["ratio"], r["depth"], r["answer"], r["cache_bytes"]) for r in again] == [
        (r["method"], r["ratio"], r["depth"], r["answer"], r["cache_bytes"]) for r in rows]


def test_a_run_with_options_draws_and_summarises_its_own_rows_beside_the_defaults(tmp_path, monkeypatch, capsys):
    """``--option``: the figures and the summary show the rows of that option's config id (not the
    defaults', and no crash when only option rows are stored), and figures are named after the CSV,
    so an option run never overwrites the default grid's figures."""
    import matplotlib.figure

    needle = load_script("needle")
    opts = {"merge_rows": 256}
    cfg_ha, cfg_opt = method_config_id("arckv-ha", 0.1), CurrentIds(DEFAULT_MODEL_ID, opts)("arckv-ha", 0.1)["config_id"]
    assert cfg_opt != cfg_ha

    def row(config, correct, depth):
        return {"method": "arckv-ha", "ratio": "0.1", "length": "1000", "depth": depth, "seed": "0",
                "context_tokens": "990", "needle": "1234567", "answer": "x", "correct": correct, "compaction_s": "1.0",
                "answer_s": "1.0", "cache_bytes": "10", "masked": "0", "indexer": "", "config_id": config,
                "model": DEFAULT_MODEL_ID, "command": "c", "date": "2026-01-01T00:00:00Z", "package_version": "0",
                "machine": "m"}

    drawn = {}
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, path, **kw: drawn.__setitem__(path.name, [t.get_text() for a in fig.axes
                                                                              for t in a.texts]))
    only_option = tmp_path / "needle_options.csv"
    needle.append_rows(only_option, [row(cfg_opt, 1, "0"), row(cfg_opt, 0, "1")], needle.FIELDS)
    assert needle.plot(only_option, tmp_path) == []          # no default rows: nothing drawn, no error
    assert "nothing to plot" in capsys.readouterr().out
    assert [p.name for p in needle.plot(only_option, tmp_path, opts)] == ["needle_options_rho0.1.png"]
    assert drawn == {"needle_options_rho0.1.png": ["1", "0"]}   # depth 0 found, depth 1 missed
    mixed = tmp_path / "needle.csv"
    needle.append_rows(mixed, [row(cfg_ha, 0, "0"), row(cfg_ha, 0, "1"), row(cfg_opt, 1, "0"), row(cfg_opt, 1, "1")],
                       needle.FIELDS)
    capsys.readouterr()
    needle.summary(mixed, opts)
    line = next(line for line in capsys.readouterr().out.splitlines() if line.split()[:2] == ["ruler", "arckv-ha"])
    assert line.split()[4:6] == ["2", "1.00"]                  # the two option rows, both correct
    needle.summary(mixed)
    line = next(line for line in capsys.readouterr().out.splitlines() if line.split()[:2] == ["ruler", "arckv-ha"])
    assert line.split()[4:6] == ["2", "0.00"]                  # the two default rows


def test_needle_framings_keep_rulers_text_and_give_the_pipeline_its_own():
    """The RULER framing's needle, question and answer prefix are the strings its stored rows were made
    with; the pipeline framing plants an access code, asks a plain question and answers after
    "Answer:"; both are deterministic per seed."""
    import pytest

    from arckv_press.haystack import Needle, article_for_seed, load_articles, make_needle

    ruler = make_needle(3)
    assert ruler == make_needle(3, "ruler") and ruler.framing == "ruler"
    assert ruler.sentence == f" The special magic number for {ruler.key} is {ruler.value}. "
    assert ruler.question == f"What is the special magic number for {ruler.key} mentioned in the provided text?"
    assert ruler.prefix() == f"The special magic number for {ruler.key} mentioned in the provided text is"
    pipe = make_needle(3, "pipeline")
    assert pipe == make_needle(3, "pipeline") and pipe.value == ruler.value  # same seed, same number
    assert pipe.sentence == f" The access code for the {pipe.key} is {pipe.value}."
    assert pipe.question == f"\n\nWhat is the access code for the {pipe.key}? Answer with the number only."
    assert pipe.prefix() == "Answer:"
    with pytest.raises(ValueError, match="framing"):
        Needle("x", "1", "chat")
    assert article_for_seed(["a", "b", "c"], 4) == "b"


def test_articles_file_errors_name_the_file_and_line(tmp_path):
    import pytest

    from arckv_press.haystack import load_articles

    path = tmp_path / "a.jsonl"
    path.write_text('{"input": "first article"}\n\n{"input": "second"}\n', encoding="utf-8")
    assert load_articles(path) == ["first article", "second"]
    path.write_text('{"input": "first"}\n{"input": \n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"a\.jsonl, line 2: not JSON"):
        load_articles(path)
    path.write_text('{"input": "first"}\n{"text": "x"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 2: no 'input' article text"):
        load_articles(path)
    with pytest.raises(FileNotFoundError):
        load_articles(tmp_path / "missing.jsonl")


def test_old_needle_csv_gains_the_framing_column_unchanged_otherwise(tmp_path):
    import csv

    needle = load_script("needle")
    path = tmp_path / "needle.csv"
    old_fields = [f for f in needle.FIELDS if f != "framing"]
    rows = [{f: f"{f}{i}" for f in old_fields} for i in range(3)]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=old_fields)
        w.writeheader()
        w.writerows(rows)
    needle.migrate_csv(path)
    got = needle.read_rows(path)
    assert list(got[0]) == needle.FIELDS
    assert got == [{**r, "framing": "ruler"} for r in rows]
    before = path.read_bytes()
    needle.migrate_csv(path)  # already migrated: left alone
    assert path.read_bytes() == before
    assert list(tmp_path.iterdir()) == [path]  # no partial left behind


def test_depth_table_counts_every_case_of_each_depth():
    """Each cell is found / cases over the seeds of one length and depth, with one more row over every
    length (brute-force counts), the full cache comes first, other kept fractions and framings are
    left out, and a loss at one depth shows in its own column."""
    import random

    needle = load_script("needle")
    rng = random.Random(0)
    rows = []
    for method, ratio in (("none", "1"), ("arckv", "0.1"), ("snapkv", "0.1"), ("arckv", "0.2")):
        for depth in ("0.1", "0.9"):
            for length in ("1000", "1500"):
                for seed in "012":
                    for framing in ("pipeline", "ruler"):
                        correct = int(rng.random() < 0.6) if not (method == "arckv" and depth == "0.9") else 0
                        rows.append({"method": method, "ratio": ratio, "depth": depth, "length": length, "seed": seed,
                                     "framing": framing, "correct": str(correct)})
    rows.append({"method": "snapkv", "ratio": "0.1", "depth": "0.1", "length": "4000", "seed": "0",
                 "framing": "pipeline", "correct": "1"})  # one length with one depth only
    table = needle.depth_table(rows, 0.1, "pipeline")
    lines = table.splitlines()
    assert lines[0] == "| method | length | 10% | 90% | all |"
    body = [line.split(" | ") for line in lines[2:] if line.startswith("| ")]
    assert [(b[0][2:], b[1]) for b in body] == [
        (name, n) for name in ("full cache", "`arckv`") for n in ("1K", "1.5K", "all")] + [
        ("`snapkv`", n) for n in ("1K", "1.5K", "4K", "all")]

    def count(method, ratio, depth, length):
        sel = [int(r["correct"]) for r in rows if r["method"] == method and r["ratio"] == ratio
               and r["framing"] == "pipeline" and (depth is None or r["depth"] == depth)
               and (length is None or r["length"] == length)]
        return f"{sum(sel)}/{len(sel)}" if sel else "-"

    for b in body:
        method = {"full cache": "none", "`arckv`": "arckv", "`snapkv`": "snapkv"}[b[0][2:]]
        ratio = "1" if method == "none" else "0.1"
        length = {"1K": "1000", "1.5K": "1500", "4K": "4000", "all": None}[b[1]]
        assert b[2:5] == [count(method, ratio, "0.1", length), count(method, ratio, "0.9", length),
                          count(method, ratio, None, length) + " |"]
    assert body[3][:2] == ["| `arckv`", "1K"] and body[3][3] == "0/3"  # the loss shows at 90%, at each length


def test_pipeline_framing_asks_a_base_model_as_a_completion(tiny_model, tiny_tokenizer):
    """The needle grid's pipeline cases pass the question through ``framing.pipeline_question``: a
    model without a chat template gets the package's completion framing, a chat model the question
    unchanged."""
    from arckv_press.framing import completion_text, pipeline_question
    from arckv_press.haystack import make_needle

    needle = load_script("needle")
    case = make_needle(0, "pipeline")
    for chat in (True, False):
        tok, seen = tiny_tokenizer(chat_template=chat), {}

        def pipe(context, **kwargs):
            seen.update(kwargs)
            raise RuntimeError("stop after the call")

        with pytest.raises(RuntimeError, match="stop after the call"):
            needle.run_case(pipe, tiny_model("llama"), tok, "none", 1.0, "ctx", case)
        want = pipeline_question(tok, case.question, case.prefix())
        assert {k: seen[k] for k in ("question", "answer_prefix")} == want
        if chat:
            assert want == {"question": case.question, "answer_prefix": case.prefix()}
        else:
            assert seen["question"] + "\n" + seen["answer_prefix"] == completion_text(case.question, case.prefix())
