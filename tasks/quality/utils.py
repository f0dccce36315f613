"""lm-eval glue for QuALITY (Pang et al., 2022) in the L-Eval format (An et al., 2023).

An L-Eval record is one article: ``input`` (article text), ``instructions`` (questions, each with
four options ``(A)``..``(D)``) and ``outputs`` (the gold option as text, e.g. ``"(B) ..."``). Each
question becomes one lm-eval document; the documents of one article are consecutive (the
``hf-arckv`` model compacts each article once).

Data: ``$ARCKV_QUALITY_PATH`` (a .jsonl file), else ``<repo>/../shared/data/quality/
leval_quality.jsonl``, else L-Eval's QuALITY file on the Hugging Face Hub (``HUB_DATA_FILES``).

Tasks: ``quality`` scores the four option texts by log-likelihood (acc, acc_norm);
``quality_gen`` asks for the option letter and scores an exact letter match.
"""

from __future__ import annotations

import re
from typing import Any

from arckv_press.tasks._common import doc_markers as markers
from arckv_press.tasks._common import records as data_files
from arckv_press.tasks._common import resources

HUB_DATA_FILES = "hf://datasets/L4NLP/LEval/LEval/Exam/quality.jsonl"
LETTERS = ("A", "B", "C", "D")
INSTRUCTION = "Read the following article and answer the multiple-choice question about it.\n\n"
GEN_INSTRUCTION = "Answer with the letter of the correct option (A, B, C or D) only.\n"

_OPTION_SPLIT = re.compile(r"\n\s*\(([A-D])\)\s*")
_GOLD = re.compile(r"\s*\(([A-D])\)\s*(.*)", re.S)
_PRED_LETTER = re.compile(r"\s*\(?([A-D])(?![A-Za-z])")

__all__ = [
    "doc_to_choice",
    "doc_to_text",
    "doc_to_text_gen",
    "load_quality",
    "parse_leval_records",
    "parse_question",
    "process_results_gen",
]


def parse_question(text: str) -> tuple[str, list[str]]:
    """``(stem, [option A, B, C, D])`` of an L-Eval QuALITY instruction.

    Raises:
        ValueError: the options are not exactly ``(A)``, ``(B)``, ``(C)``, ``(D)`` in order, each on
            its own line.
    """
    parts = _OPTION_SPLIT.split(text)
    letters = parts[1::2]
    if tuple(letters) != LETTERS:
        raise ValueError(f"QuALITY question must list options (A)..(D) on their own lines, found {letters}: {text[:200]!r}")
    stem = parts[0].strip()
    options = [p.strip() for p in parts[2::2]]
    if not stem or any(not o for o in options):
        raise ValueError(f"QuALITY question has an empty stem or option: {text[:200]!r}")
    return stem, options


def gold_index(output: str, options: list[str]) -> int:
    """Index of the gold option given L-Eval's ``"(B) option text"`` answer.

    The letter decides; the text must agree with that option (whitespace-normalised).
    """
    m = _GOLD.match(output)
    if m is None:
        raise ValueError(f"QuALITY gold answer does not start with an option letter: {output[:100]!r}")
    index = LETTERS.index(m.group(1))
    given, expected = " ".join(m.group(2).split()), " ".join(options[index].split())
    if given and given != expected:
        raise ValueError(
            f"QuALITY gold answer {output[:80]!r} does not match option {m.group(1)} {options[index][:80]!r}"
        )
    return index


#: the fields of an L-Eval record this loader reads, with their types
RECORD_FIELDS = {"input": str, "instructions": [str], "outputs": [str]}


def parse_leval_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One document per question, article by article, questions in file order.

    A record without a field of :data:`RECORD_FIELDS` (or of another type), or with a question or
    answer that does not parse, is a :class:`~arckv_press.tasks._common.records.DataFileError`
    naming the record's file and line (records read by
    :func:`~arckv_press.tasks._common.records.read_jsonl`; else its index) and the field."""
    docs = []
    for article_id, record in enumerate(records):
        where = data_files.where_of(record, f"QuALITY record {article_id}")
        data_files.check_fields(record, RECORD_FIELDS, where)
        instructions, outputs = record["instructions"], record["outputs"]
        if len(instructions) != len(outputs):
            raise data_files.DataFileError(
                f"{where}: QuALITY article {article_id}: {len(instructions)} instructions but {len(outputs)} outputs"
            )
        article = record["input"].strip()
        for question_id, (instruction, output) in enumerate(zip(instructions, outputs)):
            try:
                stem, options = parse_question(instruction)
            except ValueError as err:
                raise data_files.DataFileError(f"{where}: field 'instructions'[{question_id}]: {err}") from None
            try:
                gold = gold_index(output, options)
            except ValueError as err:
                raise data_files.DataFileError(f"{where}: field 'outputs'[{question_id}]: {err}") from None
            docs.append({
                "doc_id": f"quality-a{article_id}-q{question_id}",
                "article_id": article_id,
                "question_id": question_id,
                "article": article,
                "question": stem,
                "options": options,
                "gold": gold,
                "gold_letter": LETTERS[gold],
            })
    return docs


def _read_records() -> list[dict[str, Any]]:
    path = resources.resolve_local_path(resources.QUALITY_ENV, "quality/leval_quality.jsonl", must_be_dir=False)
    if path is not None:
        return data_files.read_jsonl(path)
    try:  # pragma: no cover - needs network
        import datasets

        return list(datasets.load_dataset("json", data_files=HUB_DATA_FILES, split="train"))
    except Exception as e:  # noqa: BLE001  # pragma: no cover
        raise FileNotFoundError(
            f"QuALITY: no local file and loading {HUB_DATA_FILES} failed ({e}); "
            f"set ${resources.QUALITY_ENV} to an L-Eval quality.jsonl"
        ) from e


def load_quality(**kwargs: Any) -> dict[str, Any]:
    """lm-eval ``custom_dataset``: the QuALITY questions as documents (split ``test``)."""
    import datasets

    docs = parse_leval_records(_read_records())
    if not docs:
        raise ValueError("QuALITY: no questions in the data")
    return {"test": datasets.Dataset.from_list(docs)}


def _question_block(doc: dict[str, Any]) -> str:
    options = "\n".join(f"({letter}) {text}" for letter, text in zip(LETTERS, doc["options"]))
    return f"\n\nQuestion: {doc['question']}\n{options}\n"


def doc_to_text(doc: dict[str, Any]) -> str:
    """Instruction, the article between the document markers, the question and options, ``Answer:``."""
    return markers.wrap_document(INSTRUCTION, doc["article"], _question_block(doc) + "Answer:")


def doc_to_text_gen(doc: dict[str, Any]) -> str:
    """As :func:`doc_to_text`, asking for the option letter only."""
    return markers.wrap_document(INSTRUCTION, doc["article"], _question_block(doc) + GEN_INSTRUCTION + "Answer:")


def doc_to_choice(doc: dict[str, Any]) -> list[str]:
    return list(doc["options"])


def predicted_letter(generation: str) -> str | None:
    """Option letter at the start of a generation (``"B"``, ``" (B) ..."``, ``"B."``), else None."""
    m = _PRED_LETTER.match(generation)
    return m.group(1) if m else None


def process_results_gen(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    return {"exact_match": 1.0 if predicted_letter(results[0]) == doc["gold_letter"] else 0.0}
