"""Tests of the ``hf-arckv`` lm-eval model (``arckv_press/lm_eval``).

Fast tests: the document span mapping against a brute-force reference, the marker strings, the
records path, the start-up hook (in a subprocess: a ``.pth`` file in a site dir registers
``hf-arckv`` lazily, imports nothing heavy and adds the package's tasks to lm-eval's TaskManager
without replacing any of lm-eval's own).
The wheel itself is tested in ``tests/test_package.py``.

Model tests (``-m model``; the default SmolLM2 model, float32, CPU), all on tiny inputs:

- one stock ``lm_eval`` CLI run in a subprocess (registration through the ``.pth`` hook) with
  ``--model hf-arckv`` (``arckv-ha``, ratio 0.5) on 2-3 documents of each task family (QuALITY from
  a shortened copy of the local L-Eval file, RULER ``arckv_niah_single_1`` at 256 tokens (128 of them reserved for the answer), LongBench
  ``arckv_longbench_multifieldqa_zh`` at a 160-token budget, 4 generated tokens), checking results and per-document records;
- in-process ``simple_evaluate`` runs of ``hf``, ``hf-arckv`` (``arckv-ha``, ratio 1.0) and
  ``hf-arckv`` (``snapkv``, ratio 0.5) on the same requests: ratio 1.0 reproduces ``hf``'s
  log-likelihoods (float32, 1e-3) and generations, and every document is compacted once.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import short_quality_file

from arckv_press.lm_eval import _build, _pth_hook

REPO = Path(__file__).resolve().parents[1]
TASKS_DIR = REPO / "tasks"
SHARED_DATA = REPO.parent / "shared" / "data"

TASKS = ["quality", "arckv_niah_single_1", "arckv_longbench_multifieldqa_zh"]
SNAPKV_TASKS = ["quality", "arckv_niah_single_1"]  # one log-likelihood and one generation family
METADATA = {"max_seq_lengths": [256], "num_samples": 2, "seed": 42, "max_length": 160}
LIMIT = 3
GEN_KWARGS = "max_gen_toks=4"
# documents per task with LIMIT=3: quality: 3 questions of 2 articles; niah: 2 samples; longbench: 3
EXPECTED_DOCS = {"quality": 2, "arckv_niah_single_1": 2, "arckv_longbench_multifieldqa_zh": 3}
EXPECTED_REQUESTS = {"quality": 12, "arckv_niah_single_1": 2, "arckv_longbench_multifieldqa_zh": 3}


# --------------------------------------------------------------------------- pure helpers


def _load_model_module():
    from arckv_press.lm_eval import model

    return model


def test_markers_match_task_definitions():
    from arckv_press.tasks._common import doc_markers as markers

    mod = _load_model_module()
    assert (mod.DOC_START, mod.DOC_END) == (markers.DOC_START, markers.DOC_END)
    text = markers.wrap_document("Read this.\n\n", "a <document>\n quoted \n</document>\n inside", "\n\nQ: why?")
    assert mod.locate_document(text) == markers.locate_document(text)
    assert mod.locate_document("no markers here") is None
    assert mod.locate_document("x\n</document>\n y <document>\n") is None  # end before start


def _brute_span(offsets, start, end):
    """Reference: tokens overlapping [start, end) (a zero-width span maps to the insertion point)."""
    inside = [i for i, (s, e) in enumerate(offsets) if s < end and e > start]
    if inside:
        return min(inside), max(inside) + 1
    first_after = next((i for i, (s, e) in enumerate(offsets) if e > start), len(offsets))
    return first_after, first_after


def test_document_token_span_matches_brute_force():
    mod = _load_model_module()
    rng = random.Random(0)
    for _ in range(500):
        n_chars = rng.randint(1, 60)
        cuts = sorted(rng.sample(range(1, n_chars), k=rng.randint(0, min(20, n_chars - 1)))) if n_chars > 1 else []
        bounds = [0, *cuts, n_chars]
        offsets = [(a, b) for a, b in zip(bounds, bounds[1:])]
        if rng.random() < 0.5:
            offsets = [(0, 0)] + offsets  # a BOS token outside the text
        start = rng.randint(1, n_chars)
        end = rng.randint(start, n_chars)
        got = mod.document_token_span(offsets, start, end)
        assert got == _brute_span(offsets, start, end), (offsets, start, end)


def test_document_token_span_straddling_tokens_belong_to_the_document():
    mod = _load_model_module()
    # "ab|cd|ef": document = chars [3, 5) = "de" -> tokens 1 ("cd") and 2 ("ef") both overlap it
    assert mod.document_token_span([(0, 2), (2, 4), (4, 6)], 3, 5) == (1, 3)
    assert mod.document_token_span([(0, 2), (2, 4), (4, 6)], 2, 4) == (1, 2)
    with pytest.raises(ValueError, match="bad character span"):
        mod.document_token_span([(0, 1)], 3, 2)


def test_align_finds_the_plain_tokens_inside_special_tokens():
    mod = _load_model_module()
    assert mod._align([1, 5, 6, 7], [5, 6, 7]) == 1
    assert mod._align([5, 6, 7, 2], [5, 6, 7]) == 0
    assert mod._align([5, 6], [5, 6, 7]) is None
    assert mod._align([1, 5, 9], [5, 6]) is None


def test_records_path_and_cli_output_path():
    mod = _load_model_module()
    p = mod.records_path("out/dir", "HuggingFaceTB/SmolLM2-135M-Instruct", "arckv-ha", 0.1)
    assert p == Path("out/dir/arckv_compaction_HuggingFaceTB__SmolLM2-135M-Instruct_arckv-ha_0.1.jsonl")
    assert mod.records_path("out/res.json", "m", "snapkv", 0.25, rank=1, world_size=2) == Path(
        "out/arckv_compaction_m_snapkv_0.25_rank1.jsonl"
    )
    assert mod._cli_output_path(["--model", "hf-arckv", "--output_path", "a/b"]) == "a/b"
    assert mod._cli_output_path(["-o", "c"]) == "c"
    assert mod._cli_output_path(["--output_path=d", "--tasks", "x"]) == "d"
    assert mod._cli_output_path(["--tasks", "x"]) is None


def test_task_manager_adds_the_package_tasks_and_replaces_none(tmp_path):
    """A default TaskManager (what the plain ``lm_eval`` CLI builds) sees every task of ours under
    its own name, and lm-eval's built-ins stay its own: ``ruler`` and ``longbench`` are lm-eval's,
    ``arckv_ruler`` and ``arckv_longbench`` ours, and no name of ours exists among the built-ins.
    Our folder is a copy of ``tasks/`` with one extra YAML that takes lm-eval's ``niah_single_1``:
    the built-in wins (the one override lm-eval logs), every other name of ours is ours."""
    import shutil

    folder = tmp_path / "tasks"
    shutil.copytree(TASKS_DIR, folder, ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "clash.yaml").write_text("task: niah_single_1\ndataset_path: x\noutput_type: generate_until\n")
    code = f"""
import logging
from pathlib import Path
import arckv_press.lm_eval.plugin as plugin  # what the start-up hook does when lm-eval imports its TaskManager
import lm_eval.tasks
from lm_eval.tasks import TaskManager
from lm_eval.tasks._index import TaskIndex
ours = Path({str(folder)!r})
plugin.tasks_dir = lambda: str(ours)
builtin = Path(lm_eval.tasks.__file__).parent
overrides = []
class Catch(logging.Handler):
    def emit(self, record):
        if "overrides existing task" in record.getMessage():
            overrides.append(record.getMessage())
logging.getLogger("lm_eval.tasks._index").addHandler(Catch())
tm = TaskManager()
assert tm.include_path is None  # the caller's value
assert len(overrides) == 1 and overrides[0].startswith("Task 'niah_single_1' from " + str(builtin)), overrides
for name in ("ruler", "niah_single_1", "longbench", "longbench_qasper"):
    assert Path(tm.task_index[name].yaml_path).is_relative_to(builtin), name
mine = TaskIndex.build([ours])
assert {{"arckv_ruler", "arckv_niah_single_1", "arckv_longbench", "quality"}} <= set(mine)
for name, entry in mine.items():
    if entry.yaml_path is not None and name != "niah_single_1":  # tags have no file
        assert Path(tm.task_index[name].yaml_path).is_relative_to(ours), name
print("ok")
"""
    assert _run_python(code, timeout=900).split()[-1] == "ok"


def test_a_folder_the_caller_passes_wins_over_ours(tmp_path):
    """Our folder is indexed before every other (built-ins, then the caller's folders, in lm-eval's
    order), so a task of the same name elsewhere always wins over ours: checked with a folder of
    ours that holds a copy of lm-eval's ``niah_single_1`` name, against lm-eval's RULER folder."""
    (tmp_path / "clash.yaml").write_text("task: niah_single_1\ndataset_path: x\noutput_type: generate_until\n")
    (tmp_path / "mine.yaml").write_text("task: arckv_probe\ndataset_path: x\noutput_type: generate_until\n")
    code = f"""
from pathlib import Path
import arckv_press.lm_eval.plugin as plugin
import lm_eval.tasks
from lm_eval.tasks import TaskManager
plugin.tasks_dir = lambda: {str(tmp_path)!r}
ruler = str(Path(lm_eval.tasks.__file__).parent / "ruler")
tm = TaskManager(include_defaults=False, include_path=ruler)
assert tm.include_path == ruler
assert str(tm.task_index["niah_single_1"].yaml_path).startswith(ruler)
assert str(tm.task_index["arckv_probe"].yaml_path).startswith({str(tmp_path)!r})
tm = TaskManager(include_defaults=False, include_path=[{str(tmp_path)!r}])  # given: indexed once, as given
assert str(tm.task_index["niah_single_1"].yaml_path).startswith({str(tmp_path)!r})
print("ok")
"""
    assert _run_python(code, timeout=600).split()[-1] == "ok"


def test_index_paths_put_ours_below_everything_else():
    from arckv_press.lm_eval.plugin import index_paths

    assert index_paths(None, True, "/o", "/b") == (["/o", "/b"], False)
    assert index_paths("/u", True, "/o", "/b") == (["/o", "/b", "/u"], False)
    assert index_paths(["/u", "/v"], True, "/o", "/b") == (["/o", "/b", "/u", "/v"], False)
    assert index_paths(["/u"], False, "/o", "/b") == (["/o", "/u"], False)
    assert index_paths(None, False, "/o", "/b") == (["/o"], False)
    assert index_paths(["/u", "/o/"], True, "/o", "/b") == (["/u", "/o/"], True)  # ours given: as given


def test_unknown_press_and_bad_ratio_fail_before_loading_a_model():
    mod = _load_model_module()
    with pytest.raises(ValueError, match="unknown press 'nope'"):
        mod.HFArcKV(press="nope")
    with pytest.raises(ValueError, match="kept fraction"):
        mod.HFArcKV(press="snapkv", ratio=0.0)
    with pytest.raises(ValueError, match="max_cached_docs"):
        mod.HFArcKV(press="snapkv", ratio=0.5, max_cached_docs=0)


# --------------------------------------------------------------------------- start-up hook


def _run_python(code: str, env: dict | None = None, timeout: float = 120) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=str(REPO),
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_pth_hook_registers_lazily_and_imports_nothing_heavy(tmp_path):
    _build.write_hook_files(tmp_path)
    assert (tmp_path / _build.PTH_NAME).read_text() == f"import {_build.HOOK_MODULE}\n"
    assert (tmp_path / f"{_build.HOOK_MODULE}.py").read_text() == Path(_pth_hook.__file__).read_text()
    code = f"""
import site, sys
# an installed copy of the hook may already have run at start-up: undo it so this test sees one run
sys.modules.pop({_build.HOOK_MODULE!r}, None)
sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "LmEvalImportHook"]
before = set(sys.modules)
site.addsitedir({str(tmp_path)!r})
new = sorted(set(sys.modules) - before)
assert new == [{_build.HOOK_MODULE!r}], new
assert any(type(f).__name__ == "LmEvalImportHook" for f in sys.meta_path)
import lm_eval.api.registry as r
print(r.model_registry._objs["hf-arckv"])
print("hf" in r.model_registry, "torch" in sys.modules)
hook = next(f for f in sys.meta_path if type(f).__name__ == "LmEvalImportHook")
assert hook.pending == {{"lm_eval.tasks.manager"}}, hook.pending  # still waiting for the task manager
import lm_eval.tasks
assert not any(type(f).__name__ == "LmEvalImportHook" for f in sys.meta_path)  # one-shot
print(lm_eval.tasks.TaskManager.__init__._arckv_tasks)
"""
    out = _run_python(code).split()
    assert out == ["arckv_press.lm_eval.model:HFArcKV", "True", "False", "True"]
    # opt-out
    out = _run_python(
        f"import site, sys; sys.modules.pop({_build.HOOK_MODULE!r}, None); "
        "sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != 'LmEvalImportHook']; "
        f"site.addsitedir({str(tmp_path)!r}); import lm_eval.api.registry as r; "
        "print('hf-arckv' in r.model_registry)",
        env={"ARCKV_LM_EVAL_NO_HOOK": "1"},
    )
    assert out.split() == ["False"]


def test_importing_the_package_is_light_and_registers():
    code = """
import sys
import arckv_press.lm_eval
assert "torch" not in sys.modules and "lm_eval" not in sys.modules, "heavy import"
import lm_eval.api.registry as r
assert r.model_registry._objs["hf-arckv"] == "arckv_press.lm_eval.model:HFArcKV"
assert r.get_model("hf").__name__ == "HFLM"      # lm-eval's own models still resolve
print(r.get_model("hf-arckv").__name__)
"""
    assert _run_python(code).split() == ["HFArcKV"]


# --------------------------------------------------------------------------- model tests


@pytest.fixture(scope="module")
def lm_env(tmp_path_factory):
    for sub in ("ruler", "longbench"):
        if not (SHARED_DATA / sub).is_dir():
            pytest.skip(f"no local {sub} data in {SHARED_DATA}")
    root = tmp_path_factory.mktemp("lm_eval")
    env = {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",  # the machine is shared: one thread per process avoids spin-waiting
        "ARCKV_QUALITY_PATH": str(short_quality_file(root / "quality_short.jsonl")),
        "ARCKV_RULER_DATA": str(SHARED_DATA / "ruler"),
        "ARCKV_LONGBENCH_DIR": str(SHARED_DATA / "longbench"),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield root, env
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def cli_run(lm_env):
    """Start the stock ``lm_eval`` CLI (``hf-arckv`` registered by the .pth hook) in a subprocess."""
    root, env = lm_env
    site_dir = root / "site"
    _build.write_hook_files(site_dir)
    out = root / "cli_out"
    argv = [
        "lm_eval", "--model", "hf-arckv", "--model_args", "press=arckv-ha,ratio=0.5,dtype=float32",
        "--tasks", ",".join(TASKS), "--include_path", str(TASKS_DIR), "--device", "cpu", "--batch_size", "2",
        "--limit", str(LIMIT), "--metadata", json.dumps(METADATA), "--gen_kwargs", GEN_KWARGS,
        "--output_path", str(out),
    ]
    code = (
        f"import site, sys, runpy; site.addsitedir({str(site_dir)!r}); sys.argv = {argv!r}; "
        "runpy.run_module('lm_eval', run_name='__main__')"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=str(REPO), env={**os.environ, **env},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    yield proc, out
    if proc.poll() is None:
        proc.kill()


def _read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _check_records(records: list[dict], press: str, ratio: float, tasks: list[str] = TASKS) -> None:
    """One record per document (compaction once), with every request of the document counted."""
    shas = [r["document_sha1"] for r in records]
    assert len(shas) == len(set(shas)), "a document was compacted twice"
    by_task: dict[str, list[dict]] = {}
    for r in records:
        (task,) = r["tasks"]
        by_task.setdefault(task, []).append(r)
        assert r["press"] == press and r["ratio"] == ratio and r["compacted"] is True
        assert r["indexer"] == ""  # only press=arckv uses (and records) a learned indexer checkpoint
        assert r["document_tokens"] > 0 and r["context_tokens"] == r["prefix_tokens"] + r["document_tokens"]
        assert r["compaction_seconds"] > 0
        assert r["full_cache_bytes"] > 0 and r["compacted_full_bytes"] > 0
    assert {t: len(v) for t, v in by_task.items()} == {t: EXPECTED_DOCS[t] for t in tasks}
    assert {t: sum(r["requests"] for r in v) for t, v in by_task.items()} == {t: EXPECTED_REQUESTS[t] for t in tasks}


@pytest.fixture(scope="module")
def inprocess_runs(lm_env, cli_run):
    """``hf``, ``hf-arckv`` (arckv-ha, ratio 1.0) and ``hf-arckv`` (snapkv, 0.5) via simple_evaluate."""
    import lm_eval
    import torch
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from arckv_press.lm_eval.model import HFArcKV, default_model_path
    from arckv_press.models import load_model

    root, _ = lm_env
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tokenizer = load_model(default_model_path(), dtype=torch.float32)
        manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata=dict(METADATA))

        def run(lm, tasks):
            return lm_eval.simple_evaluate(
                model=lm, tasks=list(tasks), limit=LIMIT, task_manager=manager, log_samples=True,
                gen_kwargs=GEN_KWARGS, metadata=dict(METADATA), bootstrap_iters=0,
            )

        runs = {"hf": run(HFLM(pretrained=model, tokenizer=tokenizer, batch_size=2), TASKS)}  # before any compaction
        lms = {
            "ratio1": HFArcKV(pretrained=model, tokenizer=tokenizer, press="arckv-ha", ratio=1.0, records=str(root / "r1.jsonl")),
            "snapkv": HFArcKV(
                pretrained=model, tokenizer=tokenizer, press="snapkv", ratio=0.5, press_window_size=16,
                records=str(root / "snap.jsonl"),
            ),
        }
        runs["ratio1"] = run(lms["ratio1"], TASKS)
        runs["snapkv"] = run(lms["snapkv"], SNAPKV_TASKS)
    finally:
        torch.set_num_threads(threads)
    return runs, lms


def _responses(results: dict, task: str) -> list:
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [s["resps"] for s in samples]


@pytest.mark.model
def test_ratio_one_reproduces_hf_and_compacts_each_document_once(inprocess_runs):
    runs, lms = inprocess_runs
    hf, r1 = runs["hf"], runs["ratio1"]
    for task in TASKS:
        ref, got = _responses(hf, task), _responses(r1, task)
        assert len(ref) == len(got) > 0
        if task == "quality":  # log-likelihoods of the four options
            for a, b in zip(ref, got):
                for (la, ga), (lb, gb) in zip([x[0] for x in a], [x[0] for x in b]):
                    assert abs(la - lb) < 1e-3 and ga == gb
        else:  # greedy generations
            assert got == ref
        for metric, value in hf["results"][task].items():
            if isinstance(value, float) and "stderr" not in metric:
                assert r1["results"][task][metric] == pytest.approx(value, abs=1e-9), (task, metric)
    for name, press, ratio, tasks in (("ratio1", "arckv-ha", 1.0, TASKS), ("snapkv", "snapkv", 0.5, SNAPKV_TASKS)):
        lm = lms[name]
        records = _read_records(lm.records_file)
        _check_records(records, press, ratio, tasks)
        assert lm.n_compactions == sum(EXPECTED_DOCS[t] for t in tasks) and lm.n_without_document == 0
    for r in _read_records(lms["ratio1"].records_file):  # ratio 1: every position kept, beta = 0
        assert r["realised_ratio"] == 1.0 and r["method"] == "arckv-ha"
    for r in _read_records(lms["snapkv"].records_file):  # SnapKV compresses the whole prefill
        assert r["realised_ratio"] == pytest.approx(0.5, abs=0.02)
        assert r["cache_bytes"] < 0.52 * r["full_cache_bytes"]


@pytest.mark.model
def test_document_span_on_real_prompts(inprocess_runs):
    _, lms = inprocess_runs
    lm = lms["snapkv"]
    doc = "Alpha beta 12345.\n\nGamma delta, epsilon."
    for text in (
        "Instruction.\n\n<document>\n" + doc + "\n</document>\n\nQuestion: what?",
        lm.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Read:\n<document>\n" + doc + "\n</document>\nQ?"}], tokenize=False,
            add_generation_prompt=True,
        ),
    ):
        ids = lm.tok_encode(text)
        t0, t1 = lm._span(text, ids)
        assert lm.tokenizer.decode(ids[t0:t1]) == doc
        assert lm.tokenizer.decode(ids[:t0]).endswith("<document>\n")
        assert lm.tokenizer.decode(ids[t1:]).startswith("\n</document>\n")


@pytest.mark.model
def test_stock_cli_run_with_pth_registration(cli_run, inprocess_runs):
    proc, out = cli_run
    stdout, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, stdout[-4000:]
    (results_file,) = out.rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]
    assert set(TASKS) <= set(results)
    assert 0.0 <= results["quality"]["acc,none"] <= 1.0
    (records_file,) = out.glob("arckv_compaction_HuggingFaceTB__SmolLM2-135M-Instruct_arckv-ha_0.5.jsonl")
    records = _read_records(records_file)
    _check_records(records, "arckv-ha", 0.5)
    for r in records:  # the document is compacted, the instruction before it is kept verbatim
        assert r["method"] == "arckv-ha" and r["prefix_tokens"] > 0
        assert r["realised_ratio"] == pytest.approx(0.5, abs=0.02)
        assert r["compacted_bytes"] < 0.6 * r["compacted_full_bytes"]
        assert r["cache_bytes"] < r["full_cache_bytes"]


@pytest.mark.model
def test_requests_without_document_and_bad_options(inprocess_runs):
    from lm_eval.api.instance import Instance

    from arckv_press.indexer.checkpoint import default_indexer_path
    from arckv_press.lm_eval.model import HFArcKV
    from arckv_press.models import model_id

    _, lms = inprocess_runs
    lm = lms["snapkv"]
    before, compactions = lm.n_without_document, lm.n_compactions
    plain = Instance("loglikelihood", {}, ("No markers here. Answer:", " yes"), 0, ("t", 0, 1))
    ((logprob, _),) = lm.loglikelihood([plain], disable_tqdm=True)
    assert logprob < 0 and lm.n_without_document == before + 1 and lm.n_compactions == compactions
    doc = "Instruction.\n\n<document>\n" + "Some words here. " * 8 + "\n</document>\n\nQ?"
    sampled = Instance("generate_until", {}, (doc, {"until": ["\n"], "do_sample": True, "temperature": 0.7}), 0, ("t", 0, 1))
    with pytest.raises(ValueError, match="greedily"):
        lm.generate_until([sampled], disable_tqdm=True)
    if default_indexer_path(model_id(lm.model)) is None:
        with pytest.raises(ValueError, match="press=arckv-ha"):
            HFArcKV(pretrained=lm.model, tokenizer=lm.tokenizer, press="arckv", ratio=0.5)
    else:  # the records name the shipped checkpoint
        from arckv_press.indexer.checkpoint import checkpoint_id

        arckv = HFArcKV(pretrained=lm.model, tokenizer=lm.tokenizer, press="arckv", ratio=0.5)
        assert arckv.indexer_id == checkpoint_id(default_indexer_path(model_id(lm.model)))
        assert HFArcKV(pretrained=lm.model, tokenizer=lm.tokenizer, press="arckv", ratio=1.0).indexer_id == ""
    assert lm.indexer_id == ""
    from arckv_press.registry import method_config_id

    ha = HFArcKV(pretrained=lm.model, tokenizer=lm.tokenizer, press="arckv-ha", ratio=0.5, lambda_m=0.5)
    assert ha.config_id == method_config_id("arckv-ha", 0.5, lambda_m=0.5) != method_config_id("arckv-ha", 0.5)
    floor = HFArcKV(pretrained=lm.model, tokenizer=lm.tokenizer, press="arckv-ha", ratio=0.5, press_min_head_fraction=0.75)
    assert floor.config_id == method_config_id("arckv-ha", 0.5, min_head_fraction=0.75) != method_config_id("arckv-ha", 0.5)
    merge = HFArcKV(pretrained=lm.model, tokenizer=lm.tokenizer, press="arckv-ha", ratio=0.5, press_merge_rows=256)
    assert merge._press.compaction_config().merge_rows == 256  # a CompactionConfig field with no press argument
    assert merge.config_id == method_config_id("arckv-ha", 0.5, config_options={"merge_rows": 256}) != floor.config_id
    with pytest.raises((TypeError, ValueError), match="no_such_field"):
        HFArcKV(pretrained=lm.model, tokenizer=lm.tokenizer, press="arckv-ha", ratio=0.5, press_no_such_field=1)
    low = HFArcKV(pretrained=lm.model, tokenizer=lm.tokenizer, press="arckv-ha", ratio=0.02)  # the lambda_m schedule
    assert low.config_id == method_config_id("arckv-ha", 0.02) != method_config_id("arckv-ha", 0.5)
    assert HFArcKV(pretrained=lm.model, tokenizer=lm.tokenizer, press="snapkv", ratio=0.5).config_id == ""
    with pytest.raises(ValueError, match="lambda_m"):
        HFArcKV(pretrained=lm.model, tokenizer=lm.tokenizer, press="snapkv", ratio=0.5, lambda_m=0.3)


def test_strip_document_keeps_markers_and_question():
    from arckv_press.lm_eval.model import strip_document

    text = "Read this.\n<document>\nSecret 123.\n</document>\nQuestion: which number?"
    assert strip_document(text) == "Read this.\n<document>\n\n</document>\nQuestion: which number?"
    assert strip_document("no markers") == "no markers"


@pytest.mark.model
def test_drop_document_is_the_no_context_baseline(inprocess_runs):
    """``drop_document=True`` scores exactly the prompt without its document (brute-force forward)."""
    import torch
    from lm_eval.api.instance import Instance

    from arckv_press.lm_eval.model import HFArcKV

    _, lms = inprocess_runs
    base = lms["snapkv"]
    with pytest.raises(ValueError, match="press=none"):
        HFArcKV(pretrained=base.model, tokenizer=base.tokenizer, press="snapkv", ratio=0.5, drop_document=True)
    lm = HFArcKV(pretrained=base.model, tokenizer=base.tokenizer, press="none", ratio=1.0, drop_document="True")
    context = "Instruction.\n\n<document>\nThe vault code is 4711.\n</document>\n\nQuestion: the vault code is"
    inst = Instance("loglikelihood", {}, (context, " 4711"), 0, ("t", 0, 1))
    ((got, _),) = lm.loglikelihood([inst], disable_tqdm=True)
    tok = base.tokenizer
    ctx_ids = tok.encode("Instruction.\n\n<document>\n\n</document>\n\nQuestion: the vault code is", add_special_tokens=False)
    cont_ids = tok.encode(" 4711", add_special_tokens=False)
    with torch.inference_mode():
        logits = base.model(torch.tensor([ctx_ids + cont_ids])).logits[0].float()
    logp = torch.log_softmax(logits[len(ctx_ids) - 1 : -1], dim=-1)
    want = float(logp.gather(1, torch.tensor(cont_ids)[:, None]).sum())
    assert got == pytest.approx(want, abs=1e-3)
    assert lm.n_compactions == 0 and lm.n_without_document == 1
    gen = Instance("generate_until", {}, (context, {"until": ["\n"], "max_gen_toks": 4}), 0, ("t", 0, 1))
    (text,) = lm.generate_until([gen], disable_tqdm=True)
    assert isinstance(text, str) and lm.n_compactions == 0


def test_append_records_keeps_the_records_of_a_resumed_run(tiny_model, tmp_path, monkeypatch):
    """A run resumed from lm-eval's request cache compacts only the documents it had not answered:
    with ``append_records`` the earlier records stay (readers keep a document's last record);
    without it a new run starts the file afresh. run_evals.py always appends (a folder of another
    checkpoint or options is moved away before it would be resumed)."""
    from arckv_press.lm_eval.model import HFArcKV
    from conftest import build_tiny_tokenizer, load_script

    model, tok = tiny_model("llama", num_layers=2), build_tiny_tokenizer()
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps({"document_index": 0, "compaction_seconds": 1.0}) + "\n")
    resumed = HFArcKV(pretrained=model, tokenizer=tok, press="snapkv", ratio=0.5, records=str(path), append_records="True")
    resumed._write_record({"document_index": 1, "compaction_seconds": 2.0})
    resumed._write_record({"document_index": 2, "compaction_seconds": 3.0})
    assert [json.loads(line)["document_index"] for line in path.read_text().splitlines()] == [0, 1, 2]
    fresh = HFArcKV(pretrained=model, tokenizer=tok, press="snapkv", ratio=0.5, records=str(path))
    fresh._write_record({"document_index": 0, "compaction_seconds": 4.0})
    fresh._write_record({"document_index": 1, "compaction_seconds": 5.0})
    assert [json.loads(line)["compaction_seconds"] for line in path.read_text().splitlines()] == [4.0, 5.0]

    re_ = load_script("run_evals")
    made = {}

    class Stop(Exception):
        pass

    def capture(**kwargs):
        made.update(kwargs)
        raise Stop

    monkeypatch.setattr("arckv_press.lm_eval.model.HFArcKV", capture)
    import argparse

    args = argparse.Namespace(out=tmp_path / "runs", limit=1, ruler_length=2048, max_length=8192, dtype="float32")
    with pytest.raises(Stop):
        re_.execute(re_.Run("ruler", "snapkv", 0.5), args, model, tok, None)
    assert made["append_records"] is True and made["records"].endswith("arckv_compaction.jsonl")
