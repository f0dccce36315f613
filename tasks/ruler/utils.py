"""lm-eval glue for the 13 RULER tasks generated offline by ``generate.py``.

Metadata (``--metadata '{...}'`` or TaskManager(metadata=...); lm-eval also merges ``--model_args``):

- ``max_seq_lengths`` (list of ints, default ``[4096]``, lm-eval's RULER convention): one set of
  samples per length; a sample's prompt + answer prefix + generated tokens fit the length;
- ``num_samples`` (default 20): samples per task and length;
- ``seed`` (default 42): base seed of the generator;
- ``tokenizer`` / ``pretrained``: tokenizer that measures lengths (default: the project's model).

Data: ``$ARCKV_RULER_DATA``, else ``<repo>/../shared/data/ruler``, else the Hugging Face Hub.

Metrics: ``score`` (RULER's string_match_all, or string_match_part for qa_1/qa_2, in [0, 1]) over
all samples, plus one metric per standard length (``"4096"`` ...) that averages only the samples of
that length (``-1`` when there are none, lm-eval's RULER convention).
"""

from __future__ import annotations

from typing import Any

from arckv_press.tasks._common import resources
from arckv_press.tasks.ruler import generate

DEFAULT_SEQ_LENGTHS = (4096,)
DEFAULT_NUM_SAMPLES = 20
DEFAULT_SEED = 42
STANDARD_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)

__all__ = ["aggregate_length", "doc_to_target", "load_ruler", "process_results"]


def _int(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"RULER metadata {name} must be an int >= {minimum}, got {value!r}")
    return value


def _lengths(value: Any) -> list[int]:
    if isinstance(value, (int, str)) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"RULER metadata max_seq_lengths must be a non-empty list of ints, got {value!r}")
    lengths = [_int(v, "max_seq_lengths", 1) for v in value]
    if len(set(lengths)) != len(lengths):
        raise ValueError(f"RULER metadata max_seq_lengths has duplicates: {lengths}")
    return lengths


def load_ruler(**kwargs: Any) -> dict[str, Any]:
    """lm-eval ``custom_dataset``: generate one RULER task (``dataset_kwargs.ruler_task``)."""
    import datasets

    task = kwargs.get("ruler_task")
    if task not in generate.TASKS:
        raise ValueError(f"dataset_kwargs.ruler_task must be one of {sorted(generate.TASKS)}, got {task!r}")
    lengths = _lengths(kwargs.get("max_seq_lengths", list(DEFAULT_SEQ_LENGTHS)))
    num_samples = _int(kwargs.get("num_samples", DEFAULT_NUM_SAMPLES), "num_samples", 1)
    seed = _int(kwargs.get("seed", DEFAULT_SEED), "seed", 0)
    tokenizer = resources.load_tokenizer(kwargs)
    root = resources.resolve_local_path(resources.RULER_ENV, "ruler", must_be_dir=True)
    data = generate.load_ruler_data(root)
    docs = [
        sample.to_doc()
        for length in lengths
        for sample in generate.generate_task(task, tokenizer, length, num_samples, seed=seed, data=data)
    ]
    return {"test": datasets.Dataset.from_list(docs)}


def doc_to_target(doc: dict[str, Any]) -> str:
    return ", ".join(doc["outputs"])


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """RULER score of one generation, also filed under its length (others get -1)."""
    spec = generate.TASKS[doc["task"]]
    prediction = generate.postprocess_prediction(results[0])
    match = generate.string_match_part if spec.metric == "part" else generate.string_match_all
    score = match(prediction, doc["outputs"])
    out = {"score": score}
    for length in STANDARD_LENGTHS:
        out[str(length)] = score if doc["max_length"] == length else -1.0
    return out


def aggregate_length(items: list[float]) -> float:
    """Mean of the scores of one length (entries of other lengths are -1); -1 if none."""
    kept = [x for x in items if x != -1]
    return sum(kept) / len(kept) if kept else -1.0
