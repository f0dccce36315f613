"""The question framing (arckv_press.framing): kvpress's for chat models, unchanged; a plain
completion for base models; and kvpress's pipeline fed through ``pipeline_question`` builds the
same token ids as the package's own ``encode_document`` + ``question_ids``."""

from __future__ import annotations

import pytest
import torch

from arckv_press.capture import encode_document, framing_for
from arckv_press.framing import QUESTION_TEMPLATE, completion_text, pipeline_question, question_ids, uses_chat_template
from conftest import build_tiny_tokenizer, make_text

QUESTION = "What is the special magic number for Quito mentioned in the provided text?"
PREFIX = "The special magic number for Quito mentioned in the provided text is"


def test_completion_text():
    assert QUESTION_TEMPLATE == "\n\nQuestion: {question}\nAnswer:"
    assert completion_text("Who?") == "\n\nQuestion: Who?\nAnswer:"
    assert completion_text("  Who?\n", " It was") == "\n\nQuestion: Who?\nAnswer: It was"
    # a prefix that is itself the answer cue replaces it instead of repeating it
    assert completion_text("Who?", "Answer:") == "\n\nQuestion: Who?\nAnswer:"
    assert completion_text("Who?", "Answer: It") == "\n\nQuestion: Who?\nAnswer: It"
    with pytest.raises(TypeError, match="question must be a str"):
        completion_text(None)
    with pytest.raises(TypeError, match="answer_prefix must be a str"):
        completion_text("q", 3)


def test_which_framing():
    chat, base = build_tiny_tokenizer(True), build_tiny_tokenizer(False)
    assert uses_chat_template(chat) and not uses_chat_template(base)
    assert not uses_chat_template(chat, False)
    with pytest.raises(ValueError, match="has no chat template"):
        uses_chat_template(base, True)
    with pytest.raises(TypeError, match="True, False or None"):
        uses_chat_template(chat, "yes")


def _old_question_ids(tokenizer, question, answer_prefix=""):
    """The package's question ids before the completion framing existed (generation.py): kept
    verbatim as the reference of the chat framing."""
    framing = framing_for(tokenizer, None)
    ids = tokenizer.encode(question, add_special_tokens=False) + framing.suffix_ids
    ids += tokenizer.encode(answer_prefix, add_special_tokens=False) if answer_prefix else []
    return ids


def test_chat_framing_is_unchanged_and_base_framing_is_a_completion():
    chat, base = build_tiny_tokenizer(True), build_tiny_tokenizer(False)
    for prefix in ("", PREFIX):
        assert question_ids(chat, QUESTION, prefix) == _old_question_ids(chat, QUESTION, prefix)
    got = question_ids(base, QUESTION, PREFIX)
    assert base.decode(got) == f"\n\nQuestion: {QUESTION}\nAnswer: {PREFIX}"
    assert got != _old_question_ids(base, QUESTION, PREFIX)  # kvpress's "question\nprefix" is not used


def _pipeline_ids(tokenizer, context, question, answer_prefix):
    """What kvpress's pipeline feeds the model (its own preprocess), for these arguments."""
    from kvpress import KVPressTextGenerationPipeline

    pipe = KVPressTextGenerationPipeline.__new__(KVPressTextGenerationPipeline)
    pipe.tokenizer = tokenizer
    out = pipe.preprocess(context, [question], answer_prefix, max_context_length=10**9)
    return out["context_ids"][0].tolist(), out["questions_ids"][0][0].tolist()


@pytest.mark.parametrize("chat_template", [True, False])
def test_pipeline_question_makes_the_pipeline_frame_as_the_package(chat_template):
    tok = build_tiny_tokenizer(chat_template)
    context = make_text(300, seed=4)
    args = pipeline_question(tok, QUESTION, PREFIX)
    if chat_template:
        assert args == {"question": QUESTION, "answer_prefix": PREFIX}
    ctx, q = _pipeline_ids(tok, context, **args)
    ids, _ = encode_document(tok, context)
    assert ctx == ids[0].tolist()
    assert q == question_ids(tok, QUESTION, PREFIX)


@pytest.mark.model
def test_smollm2_prompt_ids_are_unchanged():
    """SmolLM2 (chat model): its published figures were made with the chat framing; the question
    ids equal the former implementation's and kvpress's pipeline's, the document ids too."""
    from transformers import AutoTokenizer

    from arckv_press.models import model_folder

    tok = AutoTokenizer.from_pretrained(str(model_folder("smollm2-135m")), local_files_only=True)
    assert uses_chat_template(tok)
    for prefix in ("", PREFIX, "Answer:"):
        assert question_ids(tok, QUESTION, prefix) == _old_question_ids(tok, QUESTION, prefix)
        assert pipeline_question(tok, QUESTION, prefix) == {"question": QUESTION, "answer_prefix": prefix}
    context = "The special magic number for Quito is 4815162. " + make_text(400, seed=1)
    ctx, q = _pipeline_ids(tok, context, QUESTION, PREFIX)
    assert ctx == encode_document(tok, context)[0][0].tolist()
    assert q == question_ids(tok, QUESTION, PREFIX)
    suffix = tok.encode("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert question_ids(tok, QUESTION) == tok.encode(QUESTION, add_special_tokens=False) + suffix


def test_generation_question_ids_is_the_framing():
    from arckv_press.generation import question_ids as generation_question_ids

    for tok in (build_tiny_tokenizer(True), build_tiny_tokenizer(False)):
        got = generation_question_ids(tok, QUESTION, PREFIX)
        assert got.dtype == torch.long and got.shape == (1, len(question_ids(tok, QUESTION, PREFIX)))
        assert got[0].tolist() == question_ids(tok, QUESTION, PREFIX)
