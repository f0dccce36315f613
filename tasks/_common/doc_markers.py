"""Document delimiters shared by every task prompt (contract with the ``hf-arckv`` lm-eval model).

Every task in ``tasks/`` builds its prompt as

    <instruction> + DOC_START + <document> + DOC_END + <question / choices>

The markers are plain text, so the same YAML runs unchanged with ``--model hf`` (the model simply
reads them) and with ``--model hf-arckv``, which compacts exactly the span between the markers
(located through the tokenizer's offsets). The instruction before the document and the question
after it are never compacted.

Locating rule (see :func:`locate_document`): the document starts right after the FIRST
``DOC_START`` and ends right before the LAST ``DOC_END``. Task builders guarantee that the
instruction and the question contain neither marker tag (:func:`wrap_document` raises otherwise),
so the rule stays unambiguous even if a document itself quotes ``<document>``.

This module has no dependencies so that it can be loaded by file path (lm-eval loads task helpers
that way) or imported by the model code.
"""

from __future__ import annotations

DOC_START = "<document>\n"
DOC_END = "\n</document>\n"

# The bare tags, without their newlines; the instruction/question must not contain them.
_START_TAG = DOC_START.strip()
_END_TAG = DOC_END.strip()

__all__ = ["DOC_END", "DOC_START", "locate_document", "split_document", "wrap_document"]


def wrap_document(prefix: str, document: str, suffix: str) -> str:
    """``prefix + DOC_START + document + DOC_END + suffix``.

    ``DOC_END`` already ends with a newline, so one leading ``"\\n"`` of ``suffix`` is dropped
    (templates usually write ``"{context}\\n\\nQuestion: ..."``; the result then reads
    ``"...\\n</document>\\n\\nQuestion: ..."``). Nothing else is changed.

    Raises:
        TypeError: an argument is not a string.
        ValueError: ``prefix`` or ``suffix`` contains a marker tag (would break the locating rule).
    """
    for name, value in (("prefix", prefix), ("document", document), ("suffix", suffix)):
        if not isinstance(value, str):
            raise TypeError(f"wrap_document: {name} must be a str, got {type(value).__name__}")
    for name, value in (("prefix", prefix), ("suffix", suffix)):
        for tag in (_START_TAG, _END_TAG):
            if tag in value:
                raise ValueError(
                    f"wrap_document: the {name} (instruction/question outside the document) contains "
                    f"the marker tag {tag!r}; only the document may sit between the markers"
                )
    if suffix.startswith("\n"):
        suffix = suffix[1:]
    return prefix + DOC_START + document + DOC_END + suffix


def locate_document(text: str) -> tuple[int, int]:
    """Character span ``(start, end)`` of the document inside a prompt built by :func:`wrap_document`.

    ``text[start:end]`` is the document: it starts after the first ``DOC_START`` and ends before
    the last ``DOC_END``.

    Raises:
        ValueError: a marker is missing or the end marker comes before the start marker.
    """
    if not isinstance(text, str):
        raise TypeError(f"locate_document: text must be a str, got {type(text).__name__}")
    first = text.find(DOC_START)
    last = text.rfind(DOC_END)
    if first < 0:
        raise ValueError(f"locate_document: no DOC_START marker {DOC_START!r} in the prompt")
    if last < 0:
        raise ValueError(f"locate_document: no DOC_END marker {DOC_END!r} in the prompt")
    start = first + len(DOC_START)
    if last < start:
        raise ValueError(
            f"locate_document: DOC_END at char {last} comes before the document start at char {start}"
        )
    return start, last


def split_document(text: str) -> tuple[str, str, str]:
    """``(before, document, after)`` of a prompt; ``before``/``after`` keep their markers.

    ``before + document + after == text``.
    """
    start, end = locate_document(text)
    return text[:start], text[start:end], text[end:]
