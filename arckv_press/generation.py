"""Greedy answering from a (compact or ordinary) prefilled cache, leaving the cache reusable.

The question is framed as kvpress's pipeline frames it (``question + suffix``) and continues at
the positions after the context (the cache's reported sequence length). After answering, the
tokens appended for this question are removed again, so one compacted context serves many
questions.
"""

from __future__ import annotations

import torch

from arckv_press.capture import framing_for

__all__ = ["answer", "question_ids"]


def question_ids(tokenizer, question: str, answer_prefix: str = "", use_chat_template: bool | None = None) -> torch.Tensor:
    """``[1, n]`` ids of ``question + suffix + answer_prefix`` (kvpress pipeline framing)."""
    framing = framing_for(tokenizer, use_chat_template)
    ids = tokenizer.encode(question, add_special_tokens=False) + framing.suffix_ids
    ids += tokenizer.encode(answer_prefix, add_special_tokens=False) if answer_prefix else []
    return torch.tensor([ids], dtype=torch.long)


def _appended_state(cache) -> list[int]:
    return [layer.get_seq_length() for layer in cache.layers]


def _trim(cache, lengths: list[int]) -> None:
    for layer, n in zip(cache.layers, lengths):
        layer.keys = layer.keys[:, :, :n]
        layer.values = layer.values[:, :, :n]


@torch.inference_mode()
def answer(
    model,
    tokenizer,
    cache,
    question: str,
    max_new_tokens: int = 32,
    answer_prefix: str = "",
    use_chat_template: bool | None = None,
    context_length: int | None = None,
) -> str:
    """Greedy answer to ``question`` from ``cache``; the cache is restored afterwards.

    ``context_length``: the original context length (positions continue after it). Needed for
    kvpress's evicting presses, whose caches are shorter than the context; a compact cache and a
    full cache report it themselves.
    """
    ids = question_ids(tokenizer, question, answer_prefix, use_chat_template).to(model.device)
    state = _appended_state(cache)
    start = cache.get_seq_length() if context_length is None else context_length
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    out: list[int] = []
    try:
        pos = torch.arange(start, start + ids.shape[1], device=model.device)[None]
        logits = model(input_ids=ids, past_key_values=cache, position_ids=pos, logits_to_keep=1).logits
        for _ in range(max_new_tokens):
            nxt = int(logits[0, -1].argmax())
            if nxt in eos:
                break
            out.append(nxt)
            pos = pos[:, -1:] + 1
            logits = model(
                input_ids=torch.tensor([[nxt]], device=model.device), past_key_values=cache, position_ids=pos
            ).logits
    finally:
        _trim(cache, state)
    return tokenizer.decode(out, skip_special_tokens=True)
