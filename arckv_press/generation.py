"""Greedy answering from a (compact or ordinary) prefilled cache, leaving the cache reusable.

The question is framed by :mod:`arckv_press.framing`: as kvpress's pipeline frames it
(``question + suffix``) for a chat model, as a plain completion (``"\n\nQuestion: ...\nAnswer:"``)
for a base model without a chat template; it continues at the positions after the context (the
cache's reported sequence length). After answering, the
tokens appended for this question are removed again, so one compacted context serves many
questions. :func:`answer_many` decodes several questions as one batch: with a compact cache the
compacted block is shared by the batch (never copied per question; timings in
``docs/results.md``, "Many questions").
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from arckv_press import framing
from arckv_press.cache import cache_snapshot, restore_cache

__all__ = ["answer", "answer_many", "question_ids", "greedy_decode", "eos_ids"]


def question_ids(tokenizer, question: str, answer_prefix: str = "", use_chat_template: bool | None = None) -> torch.Tensor:
    """``[1, n]`` ids put after the context to ask ``question`` (:func:`arckv_press.framing.question_ids`:
    ``question + suffix + answer_prefix`` with a chat template, else the completion framing)."""
    return torch.tensor([framing.question_ids(tokenizer, question, answer_prefix, use_chat_template)], dtype=torch.long)


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
    return _greedy(model, tokenizer, cache, [question], max_new_tokens, [answer_prefix], use_chat_template,
                   context_length)[0]


@torch.inference_mode()
def answer_many(
    model,
    tokenizer,
    cache,
    questions: list[str],
    max_new_tokens: int = 32,
    answer_prefix: str | list[str] = "",
    use_chat_template: bool | None = None,
    context_length: int | None = None,
    batch_size: int = 16,
    progress: bool = False,
) -> list[str]:
    """Greedy answers to ``questions`` from one prefilled ``cache``, ``batch_size`` at a time
    (``progress``: a tqdm bar over the questions).

    Each answer equals :func:`answer` for that question alone (up to float rounding): questions
    are left-padded after the context, pads are masked, and every question continues at its own
    positions after the context. ``answer_prefix`` is one prefix for all questions or one per
    question. The cache is restored (batch 1, no appended tokens) afterwards.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    prefixes = [answer_prefix] * len(questions) if isinstance(answer_prefix, str) else list(answer_prefix)
    if len(prefixes) != len(questions):
        raise ValueError(f"got {len(prefixes)} answer prefixes for {len(questions)} questions")
    answers: list[str] = []
    with tqdm(total=len(questions), desc="questions", unit="q", disable=not progress) as bar:
        for i in range(0, len(questions), batch_size):
            answers += _greedy(model, tokenizer, cache, questions[i : i + batch_size], max_new_tokens,
                               prefixes[i : i + batch_size], use_chat_template, context_length)
            bar.update(len(questions[i : i + batch_size]))
    return answers


def _greedy(model, tokenizer, cache, questions, max_new_tokens, prefixes, use_chat_template,
            context_length) -> list[str]:
    """Greedy answers to ``B >= 1`` questions decoded together; the cache is restored afterwards.

    Questions of different lengths are left-padded after the context and the pads masked; with
    one question (or equal lengths) no mask is passed, as for an ordinary forward.
    """
    device = model.device
    rows = [question_ids(tokenizer, q, a, use_chat_template)[0] for q, a in zip(questions, prefixes)]
    B, L = len(rows), max(len(r) for r in rows)
    lengths = torch.tensor([len(r) for r in rows], device=device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else int(rows[0][-1])
    ids = torch.full((B, L), pad_id, dtype=torch.long, device=device)
    for b, r in enumerate(rows):
        ids[b, L - len(r) :] = r.to(device)
    offset = torch.arange(L, device=device)[None, :] - (L - lengths)[:, None]  # < 0 on the left pads
    cached = cache.get_seq_length()
    start = cached if context_length is None else context_length
    mask = None
    if bool((offset < 0).any()):
        mask = torch.cat([torch.ones(B, cached, dtype=torch.long, device=device), (offset >= 0).long()], dim=1)
    pos = start + offset.clamp(min=0)
    out = greedy_decode(model, cache, ids, pos, max_new_tokens, attention_mask=mask)
    return [tokenizer.decode(o, skip_special_tokens=True) for o in out]


def eos_ids(model) -> set[int]:
    """The model's end-of-sequence token ids (``generation_config.eos_token_id``: one, a list or none)."""
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos]))


def greedy_decode(model, cache, ids: torch.Tensor, positions: torch.Tensor, max_new_tokens: int,
                  attention_mask: torch.Tensor | None = None, stop=None, state=None) -> list[list[int]]:
    """The one greedy decoder: feed ``ids [B, L]`` at ``positions [B, L]`` after ``cache`` and
    decode up to ``max_new_tokens`` tokens per row, the argmax each step. A row ends at an EOS
    token (not returned) or when ``stop(tokens)`` (optional) is true of its tokens so far.
    ``attention_mask [B, cached + L]`` masks left pads (grown by one column per step). With
    ``B > 1`` the cache is expanded to the batch for the decode. The cache is restored afterwards
    to ``state`` (a :func:`~arckv_press.cache.cache_snapshot`; default: taken on entry)."""
    if max_new_tokens < 1:
        return [[] for _ in range(ids.shape[0])]
    B = ids.shape[0]
    eos = eos_ids(model)
    out: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    state = cache_snapshot(cache) if state is None else state
    if B > 1:
        cache.batch_repeat_interleave(B)
    try:
        logits = model(input_ids=ids, past_key_values=cache, position_ids=positions, attention_mask=attention_mask,
                       use_cache=True, logits_to_keep=1).logits
        pos = positions[:, -1:]
        for step in range(max_new_tokens):
            nxt = logits[:, -1].argmax(-1)
            for b, tok in enumerate(nxt.tolist()):
                if not done[b]:
                    done[b] = tok in eos
                    if not done[b]:
                        out[b].append(tok)
                        done[b] = stop is not None and bool(stop(out[b]))
            if all(done) or step + 1 == max_new_tokens:
                break
            pos = pos + 1
            if attention_mask is not None:
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones(B, 1)], dim=1)
            logits = model(input_ids=nxt[:, None], past_key_values=cache, position_ids=pos,
                           attention_mask=attention_mask, use_cache=True).logits
    finally:
        restore_cache(cache, state)
    return out
