"""Run the lm-eval benchmarks (RULER, QuALITY, LongBench) for methods x kept fractions, resumably.

One lm-eval run per (benchmark, method, ratio), in process with the ``hf-arckv`` model (the
model is loaded once and shared by all runs), plus the full cache (method ``none``, ratio 1)
and the no-context baseline (``drop_document=True``). Each run writes

    <out>/<benchmark>/<method>_<ratio>/results.json        lm-eval's results (no samples)
    <out>/<benchmark>/<method>_<ratio>/sample_scores.json  each sample's metric values (intervals)
    <out>/<benchmark>/<method>_<ratio>/arckv_compaction.jsonl   one record per document
    <out>/<benchmark>/<method>_<ratio>/requests_rank0.db    lm-eval's request cache (resume)

A run whose ``results.json`` exists is skipped; an interrupted run resumes from its request
cache (answered requests are not recomputed) and appends to its compaction records (a document
compacted twice counts once, with its last record, in ``make_leaderboard.py``). Runs record the learned indexer
checkpoint's id (``arckv``; ``arckv_run.indexer``, and ``indexer`` in each record) and the id of
the compaction options (ARC-KV and AM; ``config_id``, :func:`arckv_press.config.config_id`); when
another checkpoint is shipped or a default changes, such a folder moves to
``archive/<out>_indexer_<old id>/`` or ``archive/<out>_config_<old id>/`` and the run starts afresh.
``scripts/make_leaderboard.py`` reads every ``<out>`` that ``leaderboards/sources.toml`` declares
(``[[runs]]``) into the leaderboard.

    python scripts/run_evals.py --benchmarks ruler --limit 2                   # every method, 5 ratios
    python scripts/run_evals.py --benchmarks ruler quality --methods arckv snapkv --ratios 0.1
    python scripts/run_evals.py --list                                         # the plan and what is done
    python scripts/run_evals.py --model gemma3-270m --benchmarks ruler         # -> leaderboards/runs/lm_eval_gemma3-270m
    python scripts/run_evals.py --rescore     # per-sample scores of older runs, from their request caches
    python scripts/run_evals.py --benchmarks ruler --methods arckv-ha --ratios 0.1 \
        --option merge_rows=256 --out leaderboards/studies/lm_eval_merge256           # a compaction option

``--option KEY=VALUE`` sets a :class:`~arckv_press.config.CompactionConfig` field of the ARC-KV and
Attention Matching methods (as in the other scripts; it becomes ``press_KEY=VALUE`` in
``--model_args``); such runs go to their own ``--out``: a folder holding a run of the default
options is refused, never moved away.

Sizes (defaults sized for a 2-core CPU, all recorded in ``results.json``): RULER at
``--ruler-length`` tokens (default 2048) with ``--limit`` samples per task; QuALITY: the first
``--limit`` questions of the local subset; LongBench: the tasks whose data is in
``../shared/data/longbench`` (``--longbench-tasks``), prompts truncated to ``--longbench-length``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from arckv_press.bench import ROOT
from arckv_press.methods import METHOD_NAMES
from arckv_press.runinfo import add_option_argument
from arckv_press.tasks.longbench.metrics import DATASET2METRIC
from arckv_press.tasks._common.records import read_jsonl
from arckv_press.tasks.names import RULER_GROUP, current_task_name, longbench_task

DEFAULT_OUT = ROOT / "leaderboards" / "runs" / "lm_eval"
TASKS_DIR = Path(importlib.util.find_spec("arckv_press.tasks").submodule_search_locations[0])  # shipped tasks
DEFAULT_METHODS = tuple(m for m in METHOD_NAMES if m != "none")  # every method; the full cache is a baseline run
DEFAULT_RATIOS = (0.2, 0.1, 0.05, 0.02, 0.01)
BENCHMARKS = ("ruler", "quality", "longbench")


@dataclass(frozen=True)
class Run:
    """One lm-eval run: a benchmark with one method at one kept fraction."""

    benchmark: str
    method: str  # a registry name, or "no-context"
    ratio: float

    @property
    def name(self) -> str:
        return f"{self.method}_{self.ratio:g}"

    def folder(self, out: Path) -> Path:
        return out / self.benchmark / self.name


def plan(benchmarks, methods, ratios, baselines: bool = True) -> list[Run]:
    """Baselines first (full cache, no context), then methods from the mildest ratio down."""
    runs = []
    for bench in benchmarks:
        if baselines:
            runs += [Run(bench, "none", 1.0), Run(bench, "no-context", 1.0)]
        runs += [Run(bench, m, r) for r in sorted(ratios, reverse=True) for m in methods if m != "none"]
    return runs


ID_KEYS = ("indexer", "config_id")  # what a stored run must match (arckv_press.registry.result_ids)


def folder_ids(folder: Path) -> dict[str, str] | None:
    """Indexer checkpoint id and compaction config id a run folder was made with (``results.json``,
    else its first compaction record; ``""`` where it names none), ``None`` for a folder with neither."""
    results = folder / "results.json"
    if results.exists():
        stored = json.loads(results.read_text(encoding="utf-8")).get("arckv_run", {})
        return {key: str(stored.get(key) or "") for key in ID_KEYS}
    records = folder / "arckv_compaction.jsonl"
    if records.exists():
        for stored in read_jsonl(records)[:1]:
            return {key: str(stored.get(key) or "") for key in ID_KEYS}
    return None


def default_out(model: str | None) -> Path:
    """The run folder of a model: :data:`DEFAULT_OUT` for the default model, ``lm_eval_<name>``
    beside it for another (runs of two models never share a folder)."""
    from arckv_press.models import DEFAULT_MODEL, registered_model

    spec = registered_model(model) if model is not None else None
    if model is None or (spec is not None and spec.name == DEFAULT_MODEL):
        return DEFAULT_OUT
    name = spec.name if spec is not None else "".join(c if c.isalnum() or c in "-._" else "_" for c in str(model))
    return DEFAULT_OUT.with_name(f"lm_eval_{name.strip('_.')}")


def check_model(run: Run, out: Path, model_id: str) -> None:
    """Refuse a finished run of another model in the run folder (its results would count as this
    model's)."""
    path = run.folder(out) / "results.json"
    if not path.exists():
        return
    stored = json.loads(path.read_text(encoding="utf-8")).get("model_name")
    if stored and stored != model_id and not (Path(str(stored)).exists() and Path(model_id).exists()
                                              and Path(str(stored)).resolve() == Path(model_id).resolve()):
        raise SystemExit(f"{path.parent} holds a run of {stored}, not {model_id}: write this model's runs to another --out")


def finished(folder: Path, ids: dict[str, str]) -> bool:
    """Whether ``folder`` holds a finished run made with the indexer checkpoint and compaction
    options ``ids``."""
    return (folder / "results.json").exists() and folder_ids(folder) == ids


def check_sizes(run: Run, args) -> None:
    """Refuse a run folder made with other sizes (``--limit``, ``--ruler-length``, LongBench length):
    its ``results.json`` would count as finished and its scores be read as these sizes'."""
    path = run.folder(args.out) / "results.json"
    if not path.exists():
        return
    config = json.loads(path.read_text(encoding="utf-8")).get("config") or {}
    _, metadata, limit = task_setup(run, args)
    stored = {"limit": config.get("limit"), "metadata": config.get("metadata")}
    wanted = json.loads(json.dumps({"limit": limit, "metadata": metadata}))
    if stored != wanted:
        raise SystemExit(f"{path.parent} holds a run with {stored}, not {wanted}: write these sizes to another --out")


def retire_stale(run: Run, out: Path, ids: dict[str, str]) -> bool:
    """Move a run folder made with another indexer checkpoint than ``ids`` to
    ``archive/<out>_indexer_<old id>/<benchmark>/<name>`` (next to ``<out>``), or with other
    compaction options (a changed default) to ``archive/<out>_config_<old id>/...`` (its request cache would replay the old answers);
    returns whether the run is finished with the current ones."""
    folder = run.folder(out)
    stored = folder_ids(folder)
    if stored is not None and stored != ids:
        key = "indexer" if stored["indexer"] != ids["indexer"] else "config_id"
        tag = key.removesuffix("_id")
        dest = out.parent / "archive" / f"{out.name}_{tag}_{stored[key] or 'unknown'}" / run.benchmark / run.name
        if dest.exists():
            raise SystemExit(f"{folder} was made with {tag} {stored[key] or '(unknown)'}, and {dest} exists: move one away")
        dest.parent.mkdir(parents=True, exist_ok=True)
        folder.rename(dest)
        print(f"moved {folder} ({tag} {stored[key] or 'unknown'}, now {ids[key] or 'none'}) to {dest}", flush=True)
    return finished(folder, ids)


def task_setup(run: Run, args) -> tuple[list[str], dict, int | None]:
    """``(lm-eval task names, metadata, limit)`` of a run (the package's names, :mod:`arckv_press.tasks.names`)."""
    if run.benchmark == "ruler":
        return [RULER_GROUP], {"max_seq_lengths": [args.ruler_length], "num_samples": args.limit, "seed": 42}, None
    if run.benchmark == "quality":
        return ["quality"], {}, args.limit
    tasks = [longbench_task(t) for t in args.longbench_tasks]
    return tasks, {"max_length": args.longbench_length}, args.limit


def run_options(run: Run, options: dict | None) -> dict:
    """The ``--option`` fields that apply to ``run``: all of them for ARC-KV and Attention Matching,
    none for kvpress presses and the baselines (as :func:`arckv_press.registry.press_options`)."""
    from arckv_press.methods import METHODS

    spec = METHODS.get(run.method)
    return dict(options or {}) if spec is not None and spec.ours else {}


def model_args_string(run: Run, model_path: str | None, dtype: str, options: dict | None = None) -> str:
    """The ``--model_args`` an equivalent ``lm_eval --model hf-arckv`` command would take
    (``model_path`` None: the embedded default model, which ``hf-arckv`` loads without ``pretrained``;
    ``options``: the ``--option`` fields, as ``press_KEY=VALUE``)."""
    model = f"pretrained={model_path}," if model_path else ""
    if run.method == "no-context":
        return f"{model}press=none,ratio=1.0,drop_document=True,dtype={dtype}"
    extra = "".join(f",press_{k}={v}" for k, v in run_options(run, options).items())
    return f"{model}press={run.method},ratio={run.ratio:g},dtype={dtype}{extra}"


def equivalent_command(run: Run, args, model_path: str | None) -> str:
    tasks, metadata, limit = task_setup(run, args)
    model_args = model_args_string(run, model_path, args.dtype, getattr(args, "options", None))
    cmd = (f"lm_eval --model hf-arckv --model_args {model_args} "
           f"--tasks {','.join(tasks)} --device cpu --metadata '{json.dumps(metadata)}'")
    return cmd + (f" --limit {limit}" if limit else "")


def execute(run: Run, args, model, tokenizer, model_path: str | None, ids: dict[str, str] | None = None) -> dict:
    """Run one (benchmark, method, ratio) and write its ``results.json``."""
    from arckv_press.lm_eval.model import HFArcKV
    from arckv_press.models import model_id
    from arckv_press.runinfo import machine_info

    folder = run.folder(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    options = getattr(args, "options", None)
    tasks, metadata, limit = task_setup(run, args)
    drop = run.method == "no-context"
    lm = HFArcKV(
        pretrained=model, tokenizer=tokenizer, press="none" if drop else run.method, ratio=run.ratio,
        drop_document=drop, records=str(folder / "arckv_compaction.jsonl"), append_records=True, batch_size=1,
        max_length=args.max_length,
        **{f"press_{k}": v for k, v in run_options(run, options).items()},
    )
    t0 = time.perf_counter()
    results = evaluate(lm, folder, tasks, limit, metadata)
    seconds = time.perf_counter() - t0
    write_sample_scores(folder / "sample_scores.json", results.get("samples") or {})
    keep = ("results", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better", "n-samples")
    data = {k: results[k] for k in keep if k in results}
    data["config"] = {"model": "hf-arckv", "model_args": model_args_string(run, model_path, args.dtype, options),
                      "limit": limit, "metadata": metadata}
    data["date"] = time.time()
    data["model_name"] = model_id(model)  # the HF id, not a machine's local folder
    data["arckv_run"] = {
        "benchmark": run.benchmark, "method": run.method, "ratio": run.ratio, "seconds": seconds,
        "command": equivalent_command(run, args, model_path), "machine": machine_info(),
        **{key: (ids or {}).get(key, "") for key in ID_KEYS},
    }
    tmp = folder / "results.json.tmp"
    tmp.write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")
    tmp.replace(folder / "results.json")
    return data


def evaluate(lm, folder: Path, tasks: list[str], limit: int | None, metadata: dict) -> dict:
    """lm-eval on ``tasks`` with the settings of every run (seeds, no bootstrap, samples logged),
    answers cached in ``folder``'s request cache; a run and its rescore share them."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata=dict(metadata))
    return lm_eval.simple_evaluate(
        model=lm, tasks=tasks, limit=limit, task_manager=manager, metadata=dict(metadata),
        use_cache=str(folder / "requests"), bootstrap_iters=0, log_samples=True,
        random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0,
    )


def cached_answers():
    """An lm-eval model with no answers of its own: under ``use_cache`` every request must come from
    a run's request cache, and one that does not is refused (``LookupError``), never answered."""
    from lm_eval.api.model import LM

    class CachedAnswers(LM):
        def _refuse(self, requests):
            raise LookupError(f"{len(requests)} requests are not in the run's request cache (its prompts changed "
                              f"since the run); they are not answered anew")

        loglikelihood = loglikelihood_rolling = generate_until = _refuse

    return CachedAnswers()


def write_sample_scores(path: Path, samples: dict) -> None:
    """Per-sample metric values of every task, ``{task: {doc_id: {metric: value}}}``, so that the
    leaderboard can give intervals and paired comparisons over examples; prompts and responses are
    not kept."""
    out = {task: {str(s.get("doc_id")): {k: float(v) for k, v in s.items()
                                          if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "doc_id"}
                  for s in items}
           for task, items in sorted(samples.items())}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(out, sort_keys=True), encoding="utf-8")
    tmp.replace(path)


def stored_tasks(data: dict) -> list[str]:
    """The task names a finished run was started with, as its ``results.json`` stores them: the
    top-level groups (``arckv_ruler``), else every task it scored (``quality``, the
    ``arckv_longbench_*`` tasks); a run from before the ``arckv_`` names stores ``ruler`` and
    ``longbench_*`` (:func:`arckv_press.tasks.names.current_task_name` maps them)."""
    groups = data.get("group_subtasks") or {}
    if groups:
        return [g for g in groups if not any(g in subs for subs in groups.values())]
    return sorted(data.get("results") or {})


def stored_metrics(results: dict) -> dict[tuple[str, str], float]:
    """Every numeric metric of lm-eval's ``results`` by ``(task, metric)``, standard errors left out."""
    return {(task, key): float(v) for task, values in results.items() for key, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and "stderr" not in key}


def rescore(folder: Path) -> None:
    """Write ``sample_scores.json`` for a finished run made before runs kept it, from the run's own
    request cache: lm-eval rebuilds the same prompts (the ``limit`` and ``metadata`` its
    ``results.json`` stored) and takes every answer from the cache; a request the cache does not
    hold is refused, never answered anew (:func:`cached_answers`). The rescored metrics must equal
    the stored ones, else nothing is written (the prompts or the scoring changed since the run).
    A run stored under the tasks' former names (``ruler``, ``niah_single_1``, ``longbench_*``) is
    evaluated under today's (:func:`arckv_press.tasks.names.current_task_name`) and its
    ``sample_scores.json`` keeps the names of its ``results.json``.
    """
    try:
        data = json.loads((folder / "results.json").read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{folder / 'results.json'} is not valid JSON ({e}); nothing written") from None
    if not isinstance(data, dict) or not isinstance(data.get("results"), dict):
        raise ValueError(f"{folder / 'results.json'} holds no lm-eval results; nothing written")
    config = data.get("config") or {}
    if not (folder / "requests_rank0.db").exists():
        raise ValueError(f"{folder} has no request cache (requests_rank0.db) to rescore from")
    try:
        results = evaluate(cached_answers(), folder, [current_task_name(t) for t in stored_tasks(data)],
                           config.get("limit"), config.get("metadata") or {})
    except LookupError as e:
        raise ValueError(f"{folder}: {e}") from None
    as_stored = {current_task_name(t): t for t in data["results"]}  # today's name -> the stored one

    def stored_names(by_task: dict) -> dict:
        return {as_stored.get(task, task): value for task, value in by_task.items()}

    stored, new = stored_metrics(data["results"]), stored_metrics(stored_names(results["results"]))
    differ = sorted(k for k in stored if k not in new or not math.isclose(new[k], stored[k], rel_tol=1e-9, abs_tol=1e-12))
    if differ:
        task, metric = differ[0]
        raise ValueError(f"{folder}: rescoring the cached answers gives {task} {metric} = {new.get((task, metric))}, "
                         f"not the stored {stored[(task, metric)]} ({len(differ)} metrics differ); nothing written")
    write_sample_scores(folder / "sample_scores.json", stored_names(results.get("samples") or {}))


def summary_line(data: dict) -> str:
    parts = []
    for task, values in sorted(data["results"].items()):
        score = next((v for k, v in values.items() if "stderr" not in k and isinstance(v, (int, float))
                      and k.split(",")[0] in ("score", "acc", "exact_match", "qa_f1_score", "rouge_score",
                                               "classification_score", "retrieval_score", "count_score",
                                               "code_sim_score", "rouge_zh_score", "qa_f1_zh_score")), None)
        if score is not None:
            parts.append(f"{task}={score:.3f}")
    return " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    from arckv_press.models import model_help

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--benchmarks", nargs="+", choices=BENCHMARKS, default=list(BENCHMARKS))
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS))
    p.add_argument("--ratios", nargs="+", type=float, default=list(DEFAULT_RATIOS))
    p.add_argument("--no-baselines", dest="baselines", action="store_false", help="skip full cache and no context")
    p.add_argument("--limit", type=int, default=2, help="RULER samples per task; QuALITY/LongBench questions per task")
    p.add_argument("--ruler-length", type=int, default=2048)
    p.add_argument("--longbench-tasks", nargs="+", default=["passage_retrieval_zh", "multifieldqa_zh"],
                   choices=sorted(DATASET2METRIC), metavar="DATASET", help="LongBench v1 datasets")
    p.add_argument("--longbench-length", type=int, default=3500)
    p.add_argument("--max-length", type=int, default=8192, help="model context window given to lm-eval")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--model", default=None,
                   help=model_help() + "; another model than the default writes to leaderboards/runs/lm_eval_<name> "
                        "unless --out is given")
    p.add_argument("--out", type=Path, default=None, help=f"run folder (default {DEFAULT_OUT} for the default model)")
    p.add_argument("--list", action="store_true", help="print the plan and which runs are done, run nothing")
    p.add_argument("--rescore", action="store_true",
                   help="write sample_scores.json for finished runs of the plan that lack it, from each run's own "
                        "request cache (no model is loaded; nothing is answered anew or moved)")
    add_option_argument(p)
    args = p.parse_args(argv)
    args.out = args.out if args.out is not None else default_out(args.model)

    from arckv_press.methods import METHODS

    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        p.error(f"unknown methods {unknown}; valid: {sorted(METHODS)}")
    bad = [r for r in args.ratios if not 0.0 < r < 1.0]
    if bad:
        p.error(f"ratios are kept fractions in (0, 1), got {bad}")
    from arckv_press.runinfo import CurrentIds

    runs = plan(args.benchmarks, args.methods, args.ratios, args.baselines)
    if args.rescore:
        return rescore_runs(runs, args.out)
    from arckv_press.models import named_model_id

    mid = named_model_id(args.model)
    current, default = CurrentIds(mid, args.options), CurrentIds(mid)
    blank = dict.fromkeys(ID_KEYS, "")
    ids = {r: current(r.method, r.ratio) if r.method in METHODS else blank for r in runs}
    for r in runs if args.options else []:  # an option run never retires (moves away) a default run
        if r.method in METHODS and folder_ids(r.folder(args.out)) == default(r.method, r.ratio) != ids[r]:
            p.error(f"{r.folder(args.out)} holds a run of the default compaction options: "
                    f"write runs with --option {args.options} to another --out")
    if args.list:  # report only: nothing is moved
        todo = [r for r in runs if not finished(r.folder(args.out), ids[r])]
    else:
        for r in runs:
            check_sizes(r, args)
            check_model(r, args.out, mid)
        todo = [r for r in runs if not retire_stale(r, args.out, ids[r])]
    print(f"{len(runs)} runs planned, {len(runs) - len(todo)} done, {len(todo)} to run", flush=True)
    if args.list:
        for r in runs:
            print(("done " if r not in todo else "todo ") + f"{r.benchmark:10s} {r.name}")
        return 0
    if not todo:
        return 0

    import torch

    from arckv_press.lm_eval.model import default_model_path
    from arckv_press.models import load_model, registered_model

    if args.threads:
        torch.set_num_threads(args.threads)
    named = args.model is None or registered_model(args.model) is not None
    model, tokenizer = load_model(default_model_path(args.model) if named else args.model, dtype=getattr(torch, args.dtype))
    for i, run in enumerate(todo, 1):
        print(f"[{i}/{len(todo)}] {run.benchmark} {run.name}", flush=True)
        data = execute(run, args, model, tokenizer, args.model, ids[run])
        print(f"    {data['arckv_run']['seconds']:.0f}s  {summary_line(data)}", flush=True)
    return 0


def rescore_runs(runs: list[Run], out: Path) -> int:
    """``--rescore``: :func:`rescore` every finished run of ``runs`` under ``out`` that has no
    ``sample_scores.json``; a run that cannot be rescored is reported and left as it is."""
    from tqdm import tqdm

    folders = [r.folder(out) for r in runs]
    todo = [f for f in folders if (f / "results.json").exists() and not (f / "sample_scores.json").exists()]
    print(f"{len(todo)} finished runs without per-sample scores", flush=True)
    failed = []
    for folder in tqdm(todo, desc="rescore", unit="run"):
        try:
            rescore(folder)
        except ValueError as e:
            failed.append(str(e))
    for message in failed:
        print(message, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
