"""How a question about a document is put to a model: the one definition of the question framing.

Two framings, chosen by the tokenizer (or by ``use_chat_template``):

- **chat** (the tokenizer has a chat template, e.g. SmolLM2-135M-Instruct): kvpress's pipeline
  framing, unchanged: ``question + suffix + answer_prefix``, where ``suffix`` closes the user
  turn and opens the assistant turn (:func:`arckv_press.capture.framing_for`); the three parts
  are encoded one by one, as the package always did.
- **completion** (no chat template: a base model such as Gemma 3 270M): a plain completion a base
  model continues with the answer::

      <document>

      Question: <question>
      Answer: <answer_prefix>

  (:data:`QUESTION_TEMPLATE`; an answer prefix that itself starts with ``Answer:`` replaces the
  cue instead of repeating it). kvpress's own framing for such models (the question, a newline,
  the answer prefix) is not one a base model answers.

The document side is :func:`arckv_press.capture.framing_for`'s prefix (the chat template up to the
user message, or the BOS token) in both framings; the repeat-prefill of ARC-KV / Attention
Matching keeps its own framing (it follows the document as kvpress's KVzip does).

For kvpress's ``pipeline("kv-press-text-generation")``, which appends ``"\\n" + answer_prefix``
after the question of a model without a chat template, :func:`pipeline_question` gives the
``question`` / ``answer_prefix`` arguments whose concatenation is the completion framing (and the
arguments unchanged for a chat model)::

    pipe(context, **pipeline_question(tokenizer, question, answer_prefix), press=press)
"""

from __future__ import annotations

from arckv_press.capture import framing_for

__all__ = ["QUESTION_TEMPLATE", "ANSWER_CUE", "uses_chat_template", "completion_text", "question_ids",
           "pipeline_question"]

#: The completion framing of a question after the document (base models).
QUESTION_TEMPLATE = "\n\nQuestion: {question}\nAnswer:"
ANSWER_CUE = "Answer:"
_PIPELINE_SUFFIX = "\n"  # what kvpress 0.5.5's pipeline puts between question and answer prefix without a chat template


def uses_chat_template(tokenizer, use_chat_template: bool | None = None) -> bool:
    """Whether questions get the chat framing: ``use_chat_template`` when given, else whether the
    tokenizer has a chat template (kvpress's rule). ``True`` without a template is an error."""
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if use_chat_template is None:
        return has_template
    if not isinstance(use_chat_template, bool):
        raise TypeError(f"use_chat_template must be True, False or None, got {use_chat_template!r}")
    if use_chat_template and not has_template:
        raise ValueError(f"use_chat_template=True but the tokenizer {type(tokenizer).__name__} "
                         f"({getattr(tokenizer, 'name_or_path', '')!r}) has no chat template; pass None or False "
                         "(the completion framing 'Question: ... Answer:')")
    return use_chat_template


def _check_text(name: str, value) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    return value


def completion_text(question: str, answer_prefix: str = "") -> str:
    """The text after the document in the completion framing: ``"\\n\\nQuestion: <question>\\nAnswer:"``
    then ``" " + answer_prefix`` (an ``answer_prefix`` starting with ``Answer:`` replaces the cue)."""
    _check_text("question", question)
    _check_text("answer_prefix", answer_prefix)
    text = QUESTION_TEMPLATE.format(question=question.strip())
    prefix = answer_prefix.strip()
    if prefix.startswith(ANSWER_CUE):
        return text[: -len(ANSWER_CUE)] + prefix
    return text + (" " + prefix if prefix else "")


def question_ids(tokenizer, question: str, answer_prefix: str = "", use_chat_template: bool | None = None) -> list[int]:
    """Token ids put after the document to ask ``question`` (module docstring): the chat framing
    ``encode(question) + suffix + encode(answer_prefix)`` with a chat template, else the
    completion framing :func:`completion_text` encoded as one text."""
    _check_text("question", question)
    _check_text("answer_prefix", answer_prefix)
    if uses_chat_template(tokenizer, use_chat_template):
        framing = framing_for(tokenizer, True)
        ids = tokenizer.encode(question, add_special_tokens=False) + framing.suffix_ids
        return ids + (tokenizer.encode(answer_prefix, add_special_tokens=False) if answer_prefix else [])
    return list(tokenizer.encode(completion_text(question, answer_prefix), add_special_tokens=False))


def pipeline_question(tokenizer, question: str, answer_prefix: str = "") -> dict[str, str]:
    """``{"question": ..., "answer_prefix": ...}`` for kvpress's pipeline so that it asks
    ``question`` in this module's framing: unchanged for a chat model; for a model without a chat
    template, the pipeline's ``question + "\\n" + answer_prefix`` is then exactly
    :func:`completion_text` (kvpress 0.5.5's separator)."""
    _check_text("question", question)
    _check_text("answer_prefix", answer_prefix)
    if uses_chat_template(tokenizer):
        return {"question": question, "answer_prefix": answer_prefix}
    text = completion_text(question, answer_prefix)
    head, sep, tail = text.rpartition(_PIPELINE_SUFFIX)
    return {"question": head, "answer_prefix": tail}
