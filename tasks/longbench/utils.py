"""lm-eval glue for the 21 LongBench v1 tasks (Bai et al., 2024; github.com/THUDM/LongBench).

Data: ``$ARCKV_LONGBENCH_DIR/data/<task>.jsonl`` (official format: ``input``, ``context``,
``answers``, ``all_classes``, ``length``, ``_id``), else ``<repo>/../shared/data/longbench``, else
the Hugging Face Hub (``Xnhyacinth/LongBench``, the parquet mirror lm-eval's own LongBench tasks
use; its question column is ``question``).

Prompt: the official template of ``config/dataset2prompt.json`` (read from the local folder when it
has one, else the copy in the task YAML), split at ``{context}`` so that the context is wrapped in
the document markers. Truncation: the official rule of ``LongBench/pred.py``: when the prompt has
more than ``max_length`` tokens, keep its first ``max_length // 2`` and last ``max_length // 2``
tokens (counted with the tokenizer's special tokens, as ``tokenizer(prompt)`` does). The budget
``max_length`` (lm-eval metadata, default 7500, the official value for 8K-window models) is reduced
by the tokens of the two markers, so the final prompt stays within ``max_length``. The cut is made
at character offsets of the kept tokens (needs a fast tokenizer), which equals the official
``decode(first) + decode(last)`` up to tokenizer detokenisation details.

Scoring: ``metrics.score_prediction`` (official metric, post-processing and max over answers).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from arckv_press.tasks._common import doc_markers as markers
from arckv_press.tasks._common import records as data_files
from arckv_press.tasks._common import resources
from arckv_press.tasks.longbench import metrics

eval_logger = logging.getLogger(__name__)

HUB_PATH = "Xnhyacinth/LongBench"
DEFAULT_MAX_LENGTH = 7500

__all__ = [
    "build_prompt",
    "doc_to_target",
    "load_longbench",
    "middle_truncate",
    "process_results",
    "truncate_parts",
]


# --------------------------------------------------------------------------- truncation


def _encode_with_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    try:
        enc = tokenizer(text, return_offsets_mapping=True)
    except (NotImplementedError, TypeError, ValueError) as e:
        raise TypeError(
            "LongBench middle truncation needs a fast tokenizer (return_offsets_mapping=True); "
            f"{type(tokenizer).__name__} cannot provide character offsets"
        ) from e
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def _cut_span(offsets: list[tuple[int, int]], max_length: int, text_len: int) -> tuple[int, int] | None:
    """Characters ``[a, b)`` removed by the official middle truncation, or None if it fits."""
    n = len(offsets)
    if n <= max_length:
        return None
    half = max_length // 2  # official: int(max_length / 2)
    front = offsets[:half]
    back = offsets[n - half:] if half > 0 else []
    # special tokens have (0, 0) offsets and are skipped on decode: ignore them
    a = max((e for s, e in front if e > s), default=0)
    b = min((s for s, e in back if e > s), default=text_len)
    return a, max(a, b)


def _check_budget(max_length: Any) -> None:
    # >= 2: with max_length // 2 == 0 the official slicing tokens[-0:] would keep everything
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
        raise ValueError(f"max_length must be an int >= 2, got {max_length!r}")


def middle_truncate(text: str, tokenizer: Any, max_length: int) -> str:
    """Official LongBench truncation of a whole prompt: if it has more than ``max_length`` tokens,
    keep the text of its first ``max_length // 2`` and last ``max_length // 2`` tokens."""
    _check_budget(max_length)
    _, offsets = _encode_with_offsets(tokenizer, text)
    span = _cut_span(offsets, max_length, len(text))
    return text if span is None else text[: span[0]] + text[span[1]:]


def truncate_parts(prefix: str, context: str, suffix: str, tokenizer: Any, max_length: int) -> tuple[str, str, str, bool]:
    """:func:`middle_truncate` of ``prefix + context + suffix``, returned per part.

    The removed character span is applied to each part, so the document markers can be put back
    around what is left of the context. Returns ``(prefix, context, suffix, truncated)``.
    """
    _check_budget(max_length)
    text = prefix + context + suffix
    _, offsets = _encode_with_offsets(tokenizer, text)
    span = _cut_span(offsets, max_length, len(text))
    if span is None:
        return prefix, context, suffix, False
    a, b = span
    bounds = (0, len(prefix), len(prefix) + len(context), len(text))
    parts = []
    for lo, hi in zip(bounds, bounds[1:]):
        kept = text[lo: min(hi, a)] if a > lo else ""
        kept += text[max(lo, b): hi] if b < hi else ""
        parts.append(kept)
    return parts[0], parts[1], parts[2], True


def build_prompt(template: str, row: dict[str, Any], tokenizer: Any, max_length: int) -> tuple[str, bool]:
    """Official prompt with the (truncated) context wrapped in the document markers.

    Returns ``(prompt, truncated)``. ``max_length`` is the token budget of the final prompt.
    """
    if template.count("{context}") != 1:
        raise ValueError(f"LongBench template must contain {{context}} exactly once: {template!r}")
    head, tail = template.split("{context}")
    prefix = head.format(input=row["input"])
    suffix = tail.format(input=row["input"])
    marker_tokens = len(tokenizer(markers.DOC_START + markers.DOC_END, add_special_tokens=False)["input_ids"])
    budget = max_length - marker_tokens
    if budget < 2:
        raise ValueError(f"max_length={max_length} leaves no room next to the document markers")
    prefix, context, suffix, truncated = truncate_parts(prefix, row["context"], suffix, tokenizer, budget)
    return markers.wrap_document(prefix, context, suffix), truncated


# --------------------------------------------------------------------------- data


#: the fields of a LongBench record the prompt and the scoring read, with their types
RECORD_FIELDS = {"input": str, "context": str, "answers": (str, list)}


def _read_config(root: Path | None, name: str) -> dict[str, Any] | None:
    if root is None or not (root / "config" / name).is_file():
        return None
    return data_files.read_json(root / "config" / name, expect=dict)


def _rows(dataset: str, root: Path | None) -> list[dict[str, Any]]:
    local = root / "data" / f"{dataset}.jsonl" if root is not None else None
    if local is not None and local.is_file():
        return data_files.read_jsonl(local)
    try:  # pragma: no cover - needs network
        import datasets

        rows = list(datasets.load_dataset(HUB_PATH, dataset, split="test"))
    except Exception as e:  # noqa: BLE001
        where = f"no local file {local}" if local is not None else "no local LongBench folder"
        raise FileNotFoundError(
            f"LongBench {dataset}: {where} and loading {HUB_PATH}/{dataset} from the Hub failed ({e}). "
            f"Set ${resources.LONGBENCH_ENV} to a folder with data/{dataset}.jsonl."
        ) from e
    for row in rows:  # pragma: no cover
        if "input" not in row and "question" in row:
            row["input"] = row["question"]
    return rows  # pragma: no cover


def _max_length(kwargs: dict[str, Any]) -> int:
    value = kwargs.get("max_length", DEFAULT_MAX_LENGTH)
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"LongBench metadata max_length must be a positive int, got {value!r}")
    return value


def load_longbench(**kwargs: Any) -> dict[str, Any]:
    """lm-eval ``custom_dataset``: one LongBench task with prompts built and truncated.

    Keyword arguments (lm-eval metadata + ``dataset_kwargs`` of the YAML): ``longbench_dataset``
    (task name), ``official_prompt`` and ``official_max_gen_toks`` (copies of the official config,
    checked against the local ``config/`` folder when present), ``max_length`` (prompt budget in
    tokens), ``tokenizer``/``pretrained`` (tokenizer name; default: the project's default model).
    """
    import datasets

    dataset = kwargs.get("longbench_dataset")
    if dataset not in metrics.DATASET2METRIC:
        raise ValueError(f"dataset_kwargs.longbench_dataset must name a LongBench task, got {dataset!r}")
    root = resources.resolve_local_path(resources.LONGBENCH_ENV, "longbench", must_be_dir=True)

    template = kwargs.get("official_prompt")
    local_prompts = _read_config(root, "dataset2prompt.json")
    if local_prompts is not None and dataset in local_prompts:
        if template is not None and local_prompts[dataset] != template:
            eval_logger.warning("LongBench %s: the local config prompt differs from the YAML copy; using the local one", dataset)
        template = local_prompts[dataset]
    if not isinstance(template, str):
        raise ValueError(f"LongBench {dataset}: no prompt template (dataset_kwargs.official_prompt)")

    local_maxlen = _read_config(root, "dataset2maxlen.json")
    yaml_maxlen = kwargs.get("official_max_gen_toks")
    if local_maxlen is not None and dataset in local_maxlen and yaml_maxlen is not None:
        if int(local_maxlen[dataset]) != int(yaml_maxlen):
            raise ValueError(
                f"LongBench {dataset}: the local config/dataset2maxlen.json says {local_maxlen[dataset]} "
                f"generated tokens but the task YAML says {yaml_maxlen}; fix the YAML (generation_kwargs.max_gen_toks)"
            )

    max_length = _max_length(kwargs)
    tokenizer = resources.load_tokenizer(kwargs)
    docs = []
    for i, row in enumerate(_rows(dataset, root)):
        data_files.check_fields(row, RECORD_FIELDS, data_files.where_of(row, f"LongBench {dataset} record {i}"))
        prompt, truncated = build_prompt(template, row, tokenizer, max_length)
        answers = row["answers"]
        if isinstance(answers, str):
            answers = [answers]
        docs.append({
            "dataset": dataset,
            "_id": str(row.get("_id", i)),
            "prompt": prompt,
            "truncated": truncated,
            "answers": [str(a) for a in answers],
            "all_classes": [str(c) for c in (row.get("all_classes") or [])],
            "length": int(row.get("length", 0) or 0),
        })
    if not docs:
        raise ValueError(f"LongBench {dataset}: no records")
    return {"test": datasets.Dataset.from_list(docs)}


# --------------------------------------------------------------------------- lm-eval hooks


def doc_to_target(doc: dict[str, Any]) -> str:
    return doc["answers"][0]


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """Official LongBench score of one generation (in [0, 1])."""
    score = metrics.score_prediction(doc["dataset"], results[0], doc["answers"], doc["all_classes"] or None)
    return {"score": score}
