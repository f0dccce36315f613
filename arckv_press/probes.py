"""Two probes that pull in opposite directions, used to judge compaction methods end to end.

- **Needle retrieval**: a planted ``(city, 7-digit number)`` sentence in an essay haystack, asked
  with RULER's template and answer prefix; scored by exact retrieval of the number.
- **Continuation damage**: the NLL of a document's own next tokens after its compacted first part,
  as ``(NLL_method - NLL_full) / (NLL_no_context - NLL_full)``: 0 = as good as the full cache,
  1 = as bad as no context. It does not depend on the model's question-answering skill.

Every method runs through the same route (:func:`arckv_press.registry.prefill_with_press`, as
kvpress's pipeline prefills), so kvpress presses and ours are compared on equal terms.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from arckv_press.capture import framing_for
from arckv_press.generation import answer
from arckv_press.haystack import make_needle, needle_context

__all__ = ["NEEDLE_INSTRUCTION", "needle_probe", "continuation_nll", "continuation_probe", "split_documents", "ProbeResult"]

NEEDLE_INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n"
)


@dataclass
class ProbeResult:
    value: float  # needles found / total, or mean damage
    count: int
    seconds: float  # compaction (prefill with press) seconds, summed


def _context_ids(tokenizer, text: str) -> torch.Tensor:
    framing = framing_for(tokenizer)
    return torch.tensor([framing.prefix_ids + tokenizer.encode(text, add_special_tokens=False)])


def needle_probe(model, tokenizer, press_factory, haystack: str, n_tokens: int, depths, seeds) -> tuple[ProbeResult, list[dict]]:
    """Found/total over ``depths x seeds`` needles; ``press_factory()`` gives a fresh press or None."""
    from arckv_press.registry import prefill_with_press

    found, seconds, rows = 0, 0.0, []
    for depth in depths:
        for seed in seeds:
            needle = make_needle(seed)
            ids = _context_ids(tokenizer, NEEDLE_INSTRUCTION + needle_context(tokenizer, haystack, n_tokens, depth, needle))
            t0 = time.perf_counter()
            cache = prefill_with_press(model, press_factory(), ids)
            seconds += time.perf_counter() - t0
            text = answer(model, tokenizer, cache, needle.question, 12, needle.prefix(), context_length=ids.shape[1])
            ok = needle.value in text
            found += ok
            rows.append({"depth": depth, "seed": seed, "answer": text.strip(), "correct": int(ok)})
    total = len(depths) * len(seeds)
    return ProbeResult(found / total, total, seconds), rows


@torch.inference_mode()
def continuation_nll(model, cache, continuation_ids: torch.Tensor, context_length: int) -> float:
    """Mean NLL (nats/token) of ``continuation_ids[1:]`` fed after ``cache`` (teacher forcing)."""
    ids = continuation_ids.to(model.device)
    pos = torch.arange(context_length, context_length + ids.shape[1], device=model.device)[None]
    logits = model(input_ids=ids, past_key_values=cache, position_ids=pos).logits[0, :-1].float()
    return float(torch.nn.functional.cross_entropy(logits, ids[0, 1:]))


def split_documents(tokenizer, text: str, n_docs: int, doc_tokens: int, cont_tokens: int) -> list[tuple[str, list[int]]]:
    """Disjoint ``(document text, continuation ids)`` pairs cut from ``text`` in order."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    step = doc_tokens + cont_tokens
    if len(ids) < n_docs * step:
        raise ValueError(f"text has {len(ids)} tokens, {n_docs * step} needed for {n_docs} documents")
    out = []
    for i in range(n_docs):
        chunk = ids[i * step : (i + 1) * step]
        out.append((tokenizer.decode(chunk[:doc_tokens]), chunk[doc_tokens:]))
    return out


def continuation_probe(model, tokenizer, press_factory, documents, references: dict | None = None) -> tuple[ProbeResult, list[dict]]:
    """Mean damage ratio over ``documents``; ``references`` caches (NLL_full, NLL_none) per document."""
    from arckv_press.registry import prefill_with_press

    references = {} if references is None else references
    damages, seconds, rows = [], 0.0, []
    prefix = torch.tensor([framing_for(tokenizer).prefix_ids])
    for i, (doc, cont) in enumerate(documents):
        ids = _context_ids(tokenizer, doc)
        cont_ids = torch.tensor([cont])
        if i not in references:
            full = continuation_nll(model, prefill_with_press(model, None, ids), cont_ids, ids.shape[1])
            none = continuation_nll(model, prefill_with_press(model, None, prefix), cont_ids, prefix.shape[1])
            references[i] = (full, none)
        full, none = references[i]
        t0 = time.perf_counter()
        cache = prefill_with_press(model, press_factory(), ids)
        seconds += time.perf_counter() - t0
        nll = continuation_nll(model, cache, cont_ids, ids.shape[1])
        damage = (nll - full) / (none - full) if none - full > 1e-6 else math.nan
        damages.append(damage)
        rows.append({"doc": i, "nll": nll, "nll_full": full, "nll_none": none, "damage": damage})
    finite = [d for d in damages if not math.isnan(d)]
    return ProbeResult(sum(finite) / max(1, len(finite)), len(finite), seconds), rows
