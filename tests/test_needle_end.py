"""A fact planted near the end of a document, on the default model (the needle-at-depth-90% defect).

The copy of the repeat-prefill reads every document position from a whole document away; a
question reads the end of the document from nearby. Heads that read only nearby text attend to the
copy itself, so without the tail rows (``CompactionConfig.tail_rows``) they never see the end of
the document in the reference pass, keep too few of a fact's positions there, and the compact
cache answers with a wrong number. Checked against the uncompressed model on one development case
(never on the reported grid's seeds): the full cache's answer, and the document positions its
answer reads in each head.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

from arckv_press.haystack import default_articles_path

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def end_case(default_model_fp32):
    """Development case seed 4, 1,500 tokens, depth 90% (pipeline framing of ``scripts/needle.py``):
    the needle, context, ids, prefix length, the value's document positions, and per compacted layer
    and KV head the attention mass that the full cache's answer tokens put on them (the maximum over
    the query heads of the group and the answer's tokens)."""
    if default_articles_path() is None:
        pytest.skip("../shared/data/quality/leval_quality.jsonl is missing")
    from arckv_press.bench.needle_stages import _case
    from arckv_press.cache import new_cache
    from arckv_press.capture import CapturedQueries, QueryCapture, decoder_layers, prefill
    from arckv_press.framing import question_ids
    from arckv_press.generation import answer

    model, tok = default_model_fp32
    needle, context, ids, P, positions = _case(tok, types.SimpleNamespace(articles=None, length=1500), 4, 0.9)
    assert len(positions) == len(needle.value)  # one token per digit, near the end
    L = len(decoder_layers(model))
    with torch.inference_mode():
        full = prefill(model, ids, new_cache(model))
        text = answer(model, tok, copy.deepcopy(full), needle.question, 12, needle.prefix(), context_length=ids.shape[1])
        qids = torch.tensor([question_ids(tok, needle.question, needle.prefix() + " " + needle.value)])
        store = CapturedQueries()
        with QueryCapture(model, list(range(L)), store) as cap:
            cap.rows = torch.arange(qids.shape[1])
            model.model(input_ids=qids, past_key_values=copy.deepcopy(full),
                        position_ids=torch.arange(ids.shape[1], ids.shape[1] + qids.shape[1])[None])
    reads = {}
    n = len(positions) + 1  # the answer prefix's last token and the answer's digits
    for i in range(L):
        Q = torch.cat(store.q[i], 1)[:, -n:].float()
        K = full.layers[i].keys[0].float()
        G = Q.shape[0] // K.shape[0]
        p = torch.softmax(float(decoder_layers(model)[i].self_attn.scaling) * Q.reshape(K.shape[0], G * n, -1)
                          @ K.transpose(1, 2), -1)[..., P:]
        reads[i] = p[..., positions].sum(-1).amax(-1)  # [H]
    return needle, context, ids, P, positions, text, reads


def test_a_fact_near_the_end_is_kept_and_answered(default_model_fp32, end_case):
    """The full cache answers the planted number; at keep 10% the default compaction (tail rows)
    answers it too, and in the heads whose answer reads the number (more than half of their
    attention on its positions) it keeps more of the number's positions as anchors than the same
    compaction without tail rows, which loses the answer: the loss is in selection."""
    from arckv_press.api import compact
    from arckv_press.bench.needle_stages import needle_kept
    from arckv_press.generation import answer

    model, tok = default_model_fp32
    needle, context, ids, P, positions, full_text, reads = end_case
    assert needle.value in full_text
    kept, found = {}, {}
    for tail in (None, 0):
        with torch.inference_mode():
            cache = compact(model, tok, context, method="arckv", ratio=0.1, tail_rows=tail)
            text = answer(model, tok, cache, needle.question, 12, needle.prefix(), context_length=ids.shape[1])
        found[tail] = needle.value in text
        kept[tail] = needle_kept(cache.kept_positions, positions)
        assert cache.metadata.extra["config_id"] and cache.report.original_length == ids.shape[1] - P
    reading = [(i, h) for i, per_head in reads.items() for h in range(per_head.numel()) if per_head[h] > 0.5]
    assert len(reading) >= 5
    with_tail = sum(kept[None][i][h] for i, h in reading)
    without = sum(kept[0][i][h] for i, h in reading)
    assert found[None] and not found[0], (found, with_tail, without)
    assert with_tail > without + len(positions), (with_tail, without)
