"""Two probes that pull in opposite directions, used to judge compaction methods end to end.

- **Needle retrieval**: a planted ``(city, 7-digit number)`` sentence in an essay haystack, asked
  with RULER's template and answer prefix in the model's framing (:mod:`arckv_press.framing`: a
  completion ``Question: ... Answer:`` for a base model); scored by exact retrieval of the number.
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
from arckv_press.haystack import RULER_INSTRUCTION, make_needle, needle_context

__all__ = [
    "needle_probe", "continuation_nll", "continuation_probe", "continuation_damage",
    "reference_nlls", "split_documents", "ProbeResult",
]



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
            ids = _context_ids(tokenizer, RULER_INSTRUCTION + needle_context(tokenizer, haystack, n_tokens, depth, needle))
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


def split_documents(tokenizer, text: str, n_docs: int, doc_tokens: int, cont_tokens: int,
                    skip_tokens: int = 0) -> list[tuple[str, list[int]]]:
    """Disjoint ``(document text, continuation ids)`` pairs cut from ``text`` in order, after its
    first ``skip_tokens`` tokens."""
    if skip_tokens < 0:
        raise ValueError(f"skip_tokens must be >= 0, got {skip_tokens}")
    ids = tokenizer.encode(text, add_special_tokens=False)[skip_tokens:]
    step = doc_tokens + cont_tokens
    if len(ids) < n_docs * step:
        raise ValueError(f"text has {len(ids)} tokens, {n_docs * step} needed for {n_docs} documents")
    out = []
    for i in range(n_docs):
        chunk = ids[i * step : (i + 1) * step]
        out.append((tokenizer.decode(chunk[:doc_tokens]), chunk[doc_tokens:]))
    return out


def reference_nlls(model, tokenizer, document: str, continuation: list[int]) -> tuple[float, float]:
    """``(NLL_full, NLL_no_context)`` of ``continuation`` after the full document / the bare framing."""
    from arckv_press.registry import prefill_with_press

    ids = _context_ids(tokenizer, document)
    prefix = torch.tensor([framing_for(tokenizer).prefix_ids])
    cont_ids = torch.tensor([continuation])
    full = continuation_nll(model, prefill_with_press(model, None, ids), cont_ids, ids.shape[1])
    none = continuation_nll(model, prefill_with_press(model, None, prefix), cont_ids, prefix.shape[1])
    return full, none


def continuation_damage(model, tokenizer, press, document: str, continuation: list[int],
                        reference: tuple[float, float]) -> dict:
    """Damage ratio of one document compacted by ``press`` (None = full cache).

    ``reference`` is :func:`reference_nlls` of the document. Returns ``nll``, ``damage``
    (``(nll - full) / (none - full)``, NaN when the document does not help its continuation),
    ``seconds`` (prefill with the press), ``cache_bytes`` (bytes the whole cache really holds, the
    sliding windows of a hybrid model included) and ``compacted_bytes`` (those of its global,
    compacted layers).
    """
    from arckv_press.cache import cache_nbytes
    from arckv_press.models import describe_attention_layout
    from arckv_press.registry import prefill_with_press

    ids = _context_ids(tokenizer, document)
    t0 = time.perf_counter()
    cache = prefill_with_press(model, press, ids)
    seconds = time.perf_counter() - t0
    nbytes = cache_nbytes(cache)  # before the continuation is appended
    compacted = cache_nbytes(cache, describe_attention_layout(model).full_attention_layers)
    nll = continuation_nll(model, cache, torch.tensor([continuation]), ids.shape[1])
    full, none = reference
    damage = (nll - full) / (none - full) if none - full > 1e-6 else math.nan
    return {"nll": nll, "damage": damage, "seconds": seconds, "cache_bytes": nbytes, "compacted_bytes": compacted}


def continuation_probe(model, tokenizer, press_factory, documents, references: dict | None = None) -> tuple[ProbeResult, list[dict]]:
    """Mean damage ratio over ``documents``; ``references`` caches (NLL_full, NLL_none) per document."""
    references = {} if references is None else references
    damages, seconds, rows = [], 0.0, []
    for i, (doc, cont) in enumerate(documents):
        if i not in references:
            references[i] = reference_nlls(model, tokenizer, doc, cont)
        full, none = references[i]
        res = continuation_damage(model, tokenizer, press_factory(), doc, cont, references[i])
        seconds += res["seconds"]
        damages.append(res["damage"])
        rows.append({"doc": i, "nll": res["nll"], "nll_full": full, "nll_none": none, "damage": res["damage"]})
    finite = [d for d in damages if not math.isnan(d)]
    return ProbeResult(sum(finite) / max(1, len(finite)), len(finite), seconds), rows
