"""``hf-arckv``: lm-eval's ``HFLM`` with the document of every prompt compacted once and reused.

Every task prompt in ``tasks/`` reads ``instruction + DOC_START + document + DOC_END + question``
(``tasks/_common/doc_markers.py``). For a request, :class:`HFArcKV`

1. tokenizes the prompt exactly as ``HFLM`` does (``tok_encode`` of the context for
   ``loglikelihood``, ``tok_batch_encode`` for ``generate_until``, the same left truncation) and
   maps the document's character span (:func:`locate_document`) to a token span through the fast
   tokenizer's offset mapping of that same tokenization (:func:`document_token_span`);
2. prefills ``tokens[:doc_end]`` once per unique document (key: those token ids and the document
   start) with the chosen press, keeping the cache in a small LRU;
3. evaluates the rest of the prompt (``DOC_END``, question, answer choice or generated tokens)
   against that cache at the original positions ``doc_end, doc_end + 1, ...``, then trims the cache
   back to its state after compaction, so every question and every answer choice of a document
   reuses the same compaction.

What is compacted:

- our presses (``arckv``, ``arckv-ha``, ``arckv-vi``, ``am-omp``, ``am-omp-fast``, ``am-ha``):
  exactly the document tokens. Everything before the document (chat template, instruction,
  ``DOC_START``) is kept verbatim as uncompressed rows (``compact_prefilled`` with
  ``prefix_len = doc_start``); the compacted layers hold ``(C_k, beta, C_v)`` (paper Eq.
  (compact_attention)) and appended tokens attend to them with the fitted bias;
- kvpress presses (``snapkv``, ``kvzip``, ``expected_attention``, ``knorm``, ``streaming_llm``):
  the whole prefill ``tokens[:doc_end]`` including the instruction before the document, as
  kvpress's own pipeline does with its context (these presses compress whatever is prefilled
  inside their context manager);
- ``none``: nothing (full cache; still one prefill per document).

``drop_document=True`` is the *no-context* baseline: the text between the markers is removed
from every prompt (the markers, instruction and question stay), so the model answers from its
own knowledge; requests then take the plain ``HFLM`` path and nothing is compacted (``press``
must be ``none``). The leaderboard reads such runs as method ``no-context``.

Requests whose context has no document markers (and ``loglikelihood_rolling``) are evaluated by
the plain ``HFLM`` code with the full model; their count is logged. With ``ratio=1.0`` the scores
equal those of ``--model hf`` up to float rounding (the compact layers then hold every position
with ``beta = 0``).

Batching: requests that hit a document are evaluated one at a time (batch size 1), grouped so
that requests sharing a document are adjacent; ``--batch_size`` still applies to requests
without a document. Generation is greedy only (``do_sample=True`` raises ``ValueError``).

Per-document records: one JSON line per compaction, written to ``records=<path>``, else to
``<output_path>/arckv_compaction_<model>_<press>_<ratio>.jsonl`` when running under the lm-eval
CLI with ``--output_path`` (read from the command line; ``_rank<r>`` is appended under data
parallelism); nothing is written otherwise. Fields:

- ``model``, ``press``, ``method`` (resolved method or kvpress class), ``ratio`` (requested kept
  fraction), ``rank``, ``document_index`` (order of compaction), ``document_sha1`` (of the
  prefilled token ids);
- ``prefix_tokens`` (before the document), ``document_tokens``, ``context_tokens`` (their sum:
  the prefilled length);
- ``compaction_seconds``: wall time of the prefill plus the compaction (``timings``: per stage,
  our presses only);
- ``cache_bytes`` / ``full_cache_bytes``: bytes held by the whole cache after compaction vs an
  uncompressed cache of the same tokens; ``compacted_bytes`` / ``compacted_full_bytes``: the same
  for the compacted span only (our presses: the document in the compacted layers, ``C_k``,
  ``C_v`` and the float32 ``beta``; kvpress presses: the whole prefill);
- ``realised_ratio``: kept entries over original entries of the compacted span (layers x KV
  heads);
- ``indexer``: content id of the learned indexer checkpoint (``press=arckv``;
  :func:`arckv_press.registry.indexer_id`), empty for the other presses;
- ``config_id``: content id of the compaction options (our presses;
  :func:`arckv_press.config.config_id`), empty for kvpress presses and ``ratio=1``;
- ``compacted`` (false for ``none`` and for documents shorter than
  :data:`arckv_press.config.MIN_LENGTH` tokens,
  which keep the full cache; ``note`` says why), ``requests`` and ``tasks``: the requests served
  by the group of requests that triggered the compaction.
"""

from __future__ import annotations

import copy
import hashlib
import json
from array import array
import logging
import os
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from arckv_press.cache import cache_nbytes, cache_snapshot, restore_cache
from arckv_press.compaction.checks import check_ratio
from arckv_press.config import MIN_LENGTH
from arckv_press.lm_eval.plugin import MODEL_NAME
from arckv_press.tasks._common import doc_markers as markers
from arckv_press.tasks._common.doc_markers import DOC_END, DOC_START
from arckv_press.generation import greedy_decode

logger = logging.getLogger(__name__)


__all__ = [
    "DOC_END",
    "DOC_START",
    "HFArcKV",
    "default_model_path",
    "document_token_span",
    "locate_document",
    "records_path",
    "strip_document",
]


# --------------------------------------------------------------------------- pure helpers


def locate_document(text: str) -> tuple[int, int] | None:
    """Character span ``(start, end)`` of the document in a prompt (the rule of
    :func:`arckv_press.tasks._common.doc_markers.locate_document`: after the first ``DOC_START``,
    before the last ``DOC_END``), or ``None`` when the prompt has no such span."""
    try:
        return markers.locate_document(text)
    except ValueError:
        return None


def strip_document(text: str) -> str:
    """``text`` with the document between the markers removed (markers kept): the no-context prompt."""
    span = locate_document(text)
    if span is None:
        return text
    return text[: span[0]] + text[span[1] :]


def _as_bool(value: Any, name: str) -> bool:
    """A boolean from ``--model_args`` (``True``/``False``/``1``/``0`` strings or a bool)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no", ""):
        return False
    raise ValueError(f"hf-arckv: {name} must be true or false, got {value!r}")


def document_token_span(offsets: list[tuple[int, int]], char_start: int, char_end: int) -> tuple[int, int]:
    """Token span ``[t0, t1)`` of the characters ``[char_start, char_end)``.

    ``offsets[i] = (s_i, e_i)`` are the character offsets of token ``i`` (non-decreasing, as a fast
    tokenizer's offset mapping; special tokens not in the text have ``(0, 0)``). A token that
    straddles a boundary belongs to the document: ``t0`` is the first token ending after
    ``char_start``, ``t1`` is the first token at or after ``t0`` starting at or after
    ``char_end``.
    """
    if not 0 <= char_start <= char_end:
        raise ValueError(f"bad character span ({char_start}, {char_end})")
    n = len(offsets)
    t0 = 0
    while t0 < n and offsets[t0][1] <= char_start:
        t0 += 1
    t1 = t0
    while t1 < n and offsets[t1][0] < char_end:
        t1 += 1
    return t0, t1


def _align(full_ids: list[int], plain_ids: list[int]) -> int | None:
    """Offset ``k`` with ``full_ids[k:k + len(plain_ids)] == plain_ids`` (special tokens around)."""
    extra = len(full_ids) - len(plain_ids)
    for k in range(max(extra, -1) + 1):
        if full_ids[k : k + len(plain_ids)] == plain_ids:
            return k
    return None


def _sanitize(name: str) -> str:
    out = "".join(c if c.isalnum() or c in "-._" else "_" for c in name.replace("/", "__"))
    return out.strip("_") or "model"


def records_path(output_path: str | os.PathLike[str], model: str, press: str, ratio: float, rank: int = 0, world_size: int = 1) -> Path:
    """``<output_path>/arckv_compaction_<model>_<press>_<ratio>[_rank<r>].jsonl``.

    An ``output_path`` ending in ``.json`` / ``.jsonl`` is a file (lm-eval then writes next to
    it), so its parent folder is used.
    """
    folder = Path(output_path)
    if folder.suffix in (".json", ".jsonl"):
        folder = folder.parent
    rank_part = f"_rank{rank}" if world_size > 1 else ""
    return folder / f"arckv_compaction_{_sanitize(model)}_{_sanitize(press)}_{ratio:g}{rank_part}.jsonl"


def _cli_output_path(argv: list[str]) -> str | None:
    """``--output_path``/``-o`` of an lm-eval command line (``None`` when absent)."""
    for i, arg in enumerate(argv):
        if arg in ("--output_path", "-o") and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--output_path="):
            return arg.split("=", 1)[1]
    return None


def default_model_path(name: str | None = None) -> str:
    """Local folder of the embedded default model, or of the named model ``name`` (a name of
    ``arckv_press.models.MODELS``, e.g. ``gemma3-270m``), converted once by ``arckv_press.models``."""
    from arckv_press import models

    return str(models.model_folder(name))


# --------------------------------------------------------------------------- cache state


def _is_model_name(text: str) -> bool:
    from arckv_press.models import registered_model

    return registered_model(text) is not None


def _attention_modules(model) -> list[torch.nn.Module]:
    from arckv_press.capture import decoder_layers

    return [layer.self_attn for layer in decoder_layers(model)]


@dataclass
class _DocEntry:
    """One prefilled (and possibly compacted) document context."""

    key: tuple
    cache: Any
    state: list[tuple]
    length: int  # doc_end: tokens the cache stands for (next position)
    masked_key_indices: list[Any] | None
    record: dict[str, Any]
    tasks: set[str] = field(default_factory=set)
    requests: int = 0


@dataclass
class _DocRequest:
    """A request reduced to token ids with its document span (positions in ``ids``).

    ``key`` identifies the prefilled context: the document start and a sha1 digest of the token
    ids ``ids[:doc_end]``.
    """

    index: int
    ids: list[int]
    doc_start: int
    doc_end: int
    key: tuple = field(init=False)

    def __post_init__(self) -> None:
        digest = hashlib.sha1(array("q", self.ids[: self.doc_end]).tobytes()).hexdigest()
        self.key = (self.doc_start, self.doc_end, digest)


# --------------------------------------------------------------------------- the model


@register_model(MODEL_NAME)
class HFArcKV(HFLM):
    """``HFLM`` whose prompts' documents are compacted once per document (see the module docstring).

    Args (all also accepted as ``--model_args key=value``):
        pretrained: a model name (``smollm2-135m``, ``gemma3-270m``: ``arckv_press.models.MODELS``),
            HF id, local folder or loaded model; ``None`` (default) is the embedded default
            model (SmolLM2-135M-Instruct, the folder converted by ``arckv_press.models``; passing
            that folder as ``--model hf --model_args pretrained=<folder>`` gives the identical
            tokenization).
        press: a method name of :mod:`arckv_press.registry` (``arckv``, ``arckv-ha``, ``arckv-vi``,
            ``am-omp``, ``am-omp-fast``, ``am-ha``, ``snapkv``, ``kvzip``, ``expected_attention``,
            ``knorm``, ``streaming_llm``, ``none``). Default ``arckv`` (the paper's method, learned
            indexer): if no indexer checkpoint is shipped for the model and ``indexer`` is not
            given, construction fails with a ValueError naming the training-free alternatives.
        ratio: kept fraction rho in (0, 1] (kvpress presses get ``compression_ratio = 1 - ratio``).
        lambda_m: key-merging coefficient (ARC-KV presses only; default: the press's).
        indexer: indexer checkpoint path (``press=arckv`` only).
        records: JSON-lines file for the per-document records (default: next to ``--output_path``).
        append_records: append to an existing records file instead of starting it afresh (a run
            resumed from lm-eval's request cache compacts only the documents not answered before;
            readers keep the last record of a document compacted twice). Default False.
        max_cached_docs: size of the LRU of prefilled documents (default 1: requests are grouped
            by document, so one is enough within an lm-eval call).
        drop_document: the no-context baseline (the document text is removed from every prompt;
            needs ``press=none``).
        press_<option>: any other press option, e.g. ``press_window_size=32`` for SnapKV,
            ``press_query_budget=1024`` or ``press_min_head_fraction=0.75`` for ARC-KV; for ARC-KV
            and Attention Matching any :class:`~arckv_press.config.CompactionConfig` field, e.g.
            ``press_merge_rows=256`` (:func:`arckv_press.registry.press_options`).
        Other arguments go to ``HFLM`` (``dtype``, ``device``, ``max_length``, ``batch_size``, ...).
    """

    def __init__(
        self,
        pretrained: Any = None,
        press: str = "arckv",
        ratio: float = 0.1,
        lambda_m: float | None = None,
        indexer: str | None = None,
        records: str | None = None,
        append_records: bool | str = False,
        max_cached_docs: int = 1,
        drop_document: bool | str = False,
        device: str | None = None,
        **kwargs: Any,
    ) -> None:
        from arckv_press.methods import METHODS

        press = str(press)
        if press not in METHODS:
            raise ValueError(f"hf-arckv: unknown press {press!r}; valid presses: {', '.join(METHODS)}")
        check_ratio(ratio)
        if isinstance(max_cached_docs, bool) or not isinstance(max_cached_docs, int) or max_cached_docs < 1:
            raise ValueError(f"hf-arckv: max_cached_docs must be an int >= 1, got {max_cached_docs!r}")
        drop_document = _as_bool(drop_document, "drop_document")
        if drop_document and press != "none":
            raise ValueError(f"hf-arckv: drop_document=True is the no-context baseline and needs press=none, got press={press!r}")
        press_options = {k[len("press_") :]: kwargs.pop(k) for k in list(kwargs) if k.startswith("press_")}
        if lambda_m is not None:
            press_options["lambda_m"] = float(lambda_m)
        if indexer is not None:
            press_options["indexer"] = str(indexer)
        if METHODS[press].ours and press_options:  # CompactionConfig fields the press has no argument for
            from arckv_press.registry import press_options as press_arguments

            press_options = press_arguments(press, press_options)
        if pretrained is None or (isinstance(pretrained, str) and _is_model_name(pretrained)):
            pretrained = default_model_path(pretrained)  # the default model, or a named one (gemma3-270m)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(pretrained=pretrained, device=device, **kwargs)
        if self.backend != "causal":
            raise ValueError("hf-arckv supports decoder-only (causal) models only")
        accelerator = getattr(self, "accelerator", None)
        if accelerator is not None and self._world_size == 1 and accelerator.num_processes > 1:
            # HFLM only splits the data over processes when GPUs are present; do it on CPU too
            self._rank, self._world_size = accelerator.process_index, accelerator.num_processes

        self.press_name = press
        self.drop_document = drop_document
        self.ratio = float(ratio)
        self.family = METHODS[press].family
        self._ours = METHODS[press].ours
        self.max_cached_docs = max_cached_docs
        self._press = self._make_press(press_options)
        self._docs: OrderedDict[tuple, _DocEntry] = OrderedDict()
        self._n_compactions = 0
        self._n_without_document = 0
        self._records_file = self._resolve_records_path(records)
        self._records_started = _as_bool(append_records, "append_records")  # True: never truncate
        self._pending_meta: list[tuple[str | None, Any]] | None = None

    # ------------------------------------------------------------------ setup
    def _make_press(self, options: dict[str, Any]):
        from arckv_press.models import model_id
        from arckv_press.config import config_id
        from arckv_press.registry import indexer_id, make_press

        if self._ours:
            options.setdefault("tokenizer", self.tokenizer)
        if self.press_name == "arckv" and "indexer" not in options and self.ratio < 1.0:
            from arckv_press.indexer.checkpoint import default_indexer_path

            mid = model_id(self.model)
            if default_indexer_path(mid) is None:
                raise ValueError(
                    f"hf-arckv: press=arckv needs the learned value-aware indexer, and none is shipped for "
                    f"{mid!r}. Pass indexer=<checkpoint folder> (train one with scripts/train_indexer.py) or "
                    "use a training-free press: press=arckv-ha or press=arckv-vi"
                )
        press = make_press(self.press_name, self.ratio, **options)
        self._indexer_id = indexer_id(self.press_name, model_id(self.model), options.get("indexer")) if press is not None and self.ratio < 1.0 else ""
        self._config_id = ""
        if press is not None and self._ours:
            config = press.compaction_config()  # validate now, not at the first document
            self._config_id = config_id(config.for_model(model_id(self.model))) if self.ratio < 1.0 else ""
        return press

    def _resolve_records_path(self, records: str | None) -> Path | None:
        from arckv_press.models import model_id

        if records:
            path = Path(records)
            if self.world_size > 1:
                path = path.with_name(f"{path.stem}_rank{self.rank}{path.suffix}")
            return path
        output = None
        if "lm_eval._cli.harness" in sys.modules:  # running under the lm-eval CLI
            output = _cli_output_path(sys.argv[1:])
        if not output:
            return None
        return records_path(output, model_id(self.model), self.press_name, self.ratio, self.rank, self.world_size)

    @property
    def indexer_id(self) -> str:
        """Checkpoint id of the learned indexer the press uses (``""``: none), as in the records."""
        return self._indexer_id

    @property
    def config_id(self) -> str:
        """Content id of the press's compaction options (``""``: none), as in the records."""
        return self._config_id

    @property
    def records_file(self) -> Path | None:
        """Where the per-document records are written (``None``: not written)."""
        return self._records_file

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        info.update({"arckv_press": self.press_name, "arckv_ratio": self.ratio, "arckv_drop_document": self.drop_document, "arckv_records": str(self._records_file or "")})
        return info

    # ------------------------------------------------------------------ document cache
    def _write_record(self, record: dict[str, Any]) -> None:
        if self._records_file is None:
            return
        self._records_file.parent.mkdir(parents=True, exist_ok=True)
        mode = "a" if self._records_started else "w"
        with open(self._records_file, mode, encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        self._records_started = True

    def _full_bytes(self, n_tokens: int, layers: list[int] | None = None) -> int:
        """Bytes of an uncompressed cache of ``n_tokens`` tokens (all layers, or ``layers``)."""
        from arckv_press.models import describe_attention_layout

        layout = describe_attention_layout(self.model)
        itemsize = torch.empty((), dtype=self.model.dtype).element_size()
        per_token = 2 * layout.num_kv_heads * layout.head_dim * itemsize
        chosen = range(layout.num_layers) if layers is None else layers
        total = 0
        for idx in chosen:
            sliding = idx in layout.sliding_layers and layout.sliding_window
            total += per_token * (min(n_tokens, layout.sliding_window) if sliding else n_tokens)
        return total

    def _compact(self, req: _DocRequest) -> _DocEntry:
        """Prefill ``ids[:doc_end]`` with the press (compacting the document) and record it."""
        from arckv_press.api import compact_prefilled
        from arckv_press.cache import new_cache
        from arckv_press.models import describe_attention_layout, model_id

        model = self.model
        ids = torch.tensor([req.ids[: req.doc_end]], dtype=torch.long, device=self.device)
        n_doc = req.doc_end - req.doc_start
        cache = new_cache(model)
        record: dict[str, Any] = {
            "model": model_id(model),
            "press": self.press_name,
            "ratio": self.ratio,
            "document_index": self._n_compactions,
            "document_sha1": req.key[2],
            "prefix_tokens": req.doc_start,
            "document_tokens": n_doc,
            "context_tokens": req.doc_end,
            "rank": self.rank,
            "indexer": self._indexer_id,
            "config_id": self._config_id,
            "compacted": self._press is not None,
            "note": None,
        }
        method = self.press_name
        masked: list[Any] | None = None
        t0 = time.perf_counter()
        with torch.inference_mode():
            self._set_masked_keys(None)
            if self._press is not None and self._ours:
                config = self._press.compaction_config()
                method = config.method
                if n_doc < MIN_LENGTH:
                    record.update(compacted=False, note=f"document of {n_doc} tokens < {MIN_LENGTH}: full cache")
                    model.model(input_ids=ids, past_key_values=cache)
                    result = None
                else:
                    result = compact_prefilled(
                        model, self.tokenizer, cache, ids, req.doc_start, config,
                        use_chat_template=self._press.use_chat_template, indexer=self._press.compaction_indexer(),
                    )
            elif self._press is not None:  # kvpress press: compresses the whole prefill
                method = type(self._press).__name__
                try:
                    with self._press(model):
                        model.model(input_ids=ids, past_key_values=cache)
                except (AssertionError, ValueError, RuntimeError) as exc:
                    raise ValueError(
                        f"hf-arckv: press {self.press_name!r} ({method}) failed on a context of {req.doc_end} tokens "
                        f"({req.doc_start} before the document): {exc}"
                    ) from exc
                result = None
                masked = [getattr(m, "masked_key_indices", None) for m in _attention_modules(model)]
            else:
                model.model(input_ids=ids, past_key_values=cache)
                result = None
        seconds = time.perf_counter() - t0

        layout = describe_attention_layout(model)
        cache_bytes = cache_nbytes(cache)
        full_bytes = self._full_bytes(req.doc_end)
        if result is not None:
            compacted_bytes = result.compact_nbytes()
            compacted_full = self._full_bytes(n_doc, list(layout.full_attention_layers))
            realised = result.realised_ratio()
            record["timings"] = {k: round(v, 6) for k, v in result.report.timings.items()}
        else:
            compacted_bytes, compacted_full = cache_bytes, full_bytes
            realised = self._kept_fraction(cache, req.doc_end, masked)
        record.update(
            method=method,
            compaction_seconds=seconds,
            cache_bytes=cache_bytes,
            full_cache_bytes=full_bytes,
            compacted_bytes=compacted_bytes,
            compacted_full_bytes=compacted_full,
            realised_ratio=realised,
        )
        self._n_compactions += 1
        return _DocEntry(req.key, cache, cache_snapshot(cache), req.doc_end, masked, record)

    @staticmethod
    def _kept_fraction(cache, n_tokens: int, masked: list[Any] | None) -> float:
        """Kept (unmasked) cache rows over ``n_tokens`` rows, over layers and KV heads."""
        kept = total = 0
        for i, layer in enumerate(cache.layers):
            if getattr(layer, "keys", None) is None:
                continue
            B, H, L, _ = layer.keys.shape
            n_masked = 0
            if masked is not None and i < len(masked) and masked[i] is not None:
                n_masked = int(masked[i][0].numel())
            kept += B * H * L - n_masked
            total += B * H * n_tokens
        return kept / total if total else 1.0

    def _set_masked_keys(self, masked: list[Any] | None) -> None:
        """kvpress's head-wise presses (e.g. KVzip) leave ``masked_key_indices`` on the attention
        modules; set those of the cache in use (``None`` clears them)."""
        modules = _attention_modules(self.model)
        if masked is None and not any(getattr(m, "masked_key_indices", None) is not None for m in modules):
            return
        for i, module in enumerate(modules):
            module.masked_key_indices = masked[i] if masked is not None else None

    def _entry_for(self, req: _DocRequest) -> _DocEntry:
        key = req.key
        entry = self._docs.get(key)
        if entry is None:
            entry = self._compact(req)
            self._docs[key] = entry
            while len(self._docs) > self.max_cached_docs:
                self._docs.popitem(last=False)
        else:
            self._docs.move_to_end(key)
        if entry.masked_key_indices is not None or self.family == "kvpress":
            self._set_masked_keys(entry.masked_key_indices)
        return entry

    def _finish(self, entry: _DocEntry) -> None:
        """Write the record of a freshly compacted document after its first group of requests."""
        if entry.record.get("_written"):
            return
        record = dict(entry.record, requests=entry.requests, tasks=sorted(entry.tasks))
        self._write_record(record)
        entry.record["_written"] = True

    def _forward_rest(self, entry: _DocEntry, rest: list[int], keep: int) -> torch.Tensor:
        """Logits ``[keep, V]`` of the last ``keep`` tokens of ``rest`` fed after the document.

        The cache is left with ``rest`` appended; callers restore it.
        """
        ids = torch.tensor([rest], dtype=torch.long, device=self.device)
        pos = torch.arange(entry.length, entry.length + len(rest), device=self.device)[None]
        with torch.autocast(
            device_type=self.device.type, dtype=self.mixed_precision_dtype, enabled=self.mixed_precision_dtype is not None
        ):
            out = self.model(input_ids=ids, past_key_values=entry.cache, position_ids=pos, use_cache=True, logits_to_keep=keep)
        return out.logits[0]

    # ------------------------------------------------------------------ tokenization
    def _span(self, text: str, full_ids: list[int]) -> tuple[int, int] | None:
        """Token span of the document of ``text`` in ``full_ids`` (HFLM's ids of ``text``)."""
        chars = locate_document(text)
        if chars is None or chars[1] <= chars[0]:
            return None
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        plain, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
        k = _align(full_ids, plain)
        if k is None:
            raise ValueError(
                "hf-arckv: the offset tokenization of a prompt differs from HFLM's tokenization "
                f"({len(plain)} vs {len(full_ids)} tokens); cannot locate its document"
            )
        t0, t1 = document_token_span(offsets, *chars)
        return t0 + k, t1 + k

    def _document_as_text(self, text: str, ids: list[int], span: tuple[int, int]) -> tuple[list[int], tuple[int, int]]:
        """``(ids, span)`` with the document encoded as text. HFLM's tokenization of the whole prompt
        reads a special-token string inside the document (``<|im_end|>``, ``<|im_start|>assistant``)
        as the control token itself; such a document's tokens are encoded again from their characters
        as text (:func:`arckv_press.capture.encode_text`), the rest of the prompt (chat template,
        instruction, question) unchanged. A document without such strings keeps HFLM's ids exactly."""
        from arckv_press.capture import encode_text, special_token_ids

        t0, t1 = span
        if not special_token_ids(self.tokenizer) & set(ids[t0:t1]):
            return ids, span
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        k = _align(ids, list(enc["input_ids"]))
        if k is None:
            raise ValueError("hf-arckv: the offset tokenization of a prompt differs from HFLM's tokenization; "
                             "cannot re-encode its document as text")
        offsets = enc["offset_mapping"]
        lo, hi = offsets[t0 - k][0], offsets[t1 - 1 - k][1]  # the characters of the span's tokens
        doc = encode_text(self.tokenizer, text[lo:hi])
        return ids[:t0] + doc + ids[t1:], (t0, t0 + len(doc))

    def _without_documents(self, requests):
        """``requests`` with the document text removed (``drop_document``), else unchanged."""
        if not self.drop_document:
            return requests
        out = []
        for inst in requests:
            args = inst.args
            new = copy.copy(inst)
            new.arguments = (strip_document(args[0]), *args[1:])
            out.append(new)
        return out

    # ------------------------------------------------------------------ loglikelihood
    def loglikelihood(self, requests, disable_tqdm: bool = False):
        requests = self._without_documents(requests)
        self._pending_meta = [(getattr(r, "task_name", None), getattr(r, "doc_id", None)) for r in requests]
        try:
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm)
        finally:
            self._pending_meta = None

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        meta = self._pending_meta if self._pending_meta is not None and len(self._pending_meta) == len(requests) else None
        doc_reqs: list[_DocRequest] = []
        plain: list[int] = []
        conts: dict[int, list[int]] = {}
        for i, (request_str, ctx_enc, cont_enc) in enumerate(requests):
            req = self._doc_request_ll(i, request_str, ctx_enc, cont_enc)
            if req is None:
                plain.append(i)
            else:
                doc_reqs.append(req)
                conts[i] = cont_enc
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        if plain:
            self._note_without_document(len(plain), "loglikelihood")
            sub = super()._loglikelihood_tokens([requests[i] for i in plain], disable_tqdm=disable_tqdm, override_bs=override_bs)
            for i, r in zip(plain, sub):
                results[i] = r
        pbar = tqdm(total=len(doc_reqs), disable=(disable_tqdm or self.rank != 0), desc="hf-arckv loglikelihood")
        for group in self._groups(doc_reqs):
            entry = self._entry_for(group[0])
            for req in group:
                cont = conts[req.index]
                logits = self._score_rest(entry, req, len(cont))
                logprobs = F.log_softmax(logits, dim=-1, dtype=self.softmax_dtype)
                target = torch.tensor(cont, dtype=torch.long, device=logprobs.device)
                greedy = bool((logprobs.argmax(dim=-1) == target).all())
                answer = (float(logprobs.gather(1, target[:, None]).sum()), greedy)
                results[req.index] = answer
                self._count(entry, meta[req.index][0] if meta else None)
                request_str = requests[req.index][0]
                if request_str is not None:
                    self.cache_hook.add_partial("loglikelihood", request_str, answer)
                pbar.update(1)
            self._finish(entry)
        pbar.close()
        return results

    def _doc_request_ll(self, index: int, request_str, ctx_enc: list[int], cont_enc: list[int]) -> _DocRequest | None:
        if request_str is None or not request_str[0]:
            return None
        context = request_str[0]
        stripped = context.rstrip()  # TemplateLM._encode_pair moves trailing whitespace to the continuation
        ctx = list(ctx_enc)
        span = self._span(stripped, ctx)
        if span is None:
            return None
        ctx, span = self._document_as_text(stripped, ctx, span)
        full = ctx + list(cont_enc)
        cut = max(0, len(full) - (self.max_length + 1))  # HFLM's left truncation
        inp = full[cut:][:-1]
        doc_start, doc_end = max(0, span[0] - cut), span[1] - cut
        if doc_end <= doc_start or len(inp) - doc_end < len(cont_enc):
            return None  # the document was truncated away, or the continuation is scored inside it
        return _DocRequest(index, inp, doc_start, doc_end)

    def _score_rest(self, entry: _DocEntry, req: _DocRequest, n_cont: int) -> torch.Tensor:
        rest = req.ids[req.doc_end :]
        try:
            with torch.inference_mode():
                return self._forward_rest(entry, rest, n_cont)
        finally:
            restore_cache(entry.cache, entry.state)

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests, disable_tqdm: bool = False):
        requests = self._without_documents(requests)
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        doc_reqs: list[_DocRequest] = []
        settings: dict[int, tuple[list[str], int]] = {}
        plain: list[int] = []
        for i, instance in enumerate(requests):
            context, gen_kwargs = instance.args
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = kwargs.pop("max_gen_toks")
            req = self._doc_request_gen(i, context, max_gen_toks)
            if req is None:
                plain.append(i)
                continue
            if kwargs.get("do_sample"):
                raise ValueError("hf-arckv generates greedily only; do_sample=True is not supported")
            settings[i] = (until, max_gen_toks)
            doc_reqs.append(req)
        results: list[str | None] = [None] * len(requests)
        if plain:
            self._note_without_document(len(plain), "generate_until")
            sub = super().generate_until([requests[i] for i in plain], disable_tqdm=disable_tqdm)
            for i, r in zip(plain, sub):
                results[i] = r
        pbar = tqdm(total=len(doc_reqs), disable=(disable_tqdm or self.rank != 0), desc="hf-arckv generate_until")
        for group in self._groups(doc_reqs):
            entry = self._entry_for(group[0])
            for req in group:
                until, max_gen_toks = settings[req.index]
                tokens = self._greedy(entry, req, until, max_gen_toks)
                text = self._postprocess(tokens, until)
                results[req.index] = text
                self._count(entry, getattr(requests[req.index], "task_name", None))
                self.cache_hook.add_partial("generate_until", requests[req.index].args, text)
                pbar.update(1)
            self._finish(entry)
        pbar.close()
        return results

    def _doc_request_gen(self, index: int, context: str, max_gen_toks: int) -> _DocRequest | None:
        max_ctx_len = self.max_length - max_gen_toks
        if max_ctx_len <= 0:
            raise ValueError(
                f"requested max tokens to generate ({max_gen_toks}) must be less than the model's maximum "
                f"sequence length ({self.max_length})"
            )
        ids, _ = self.tok_batch_encode([context], truncation=self.truncation)  # as HFLM, before its left cut
        full = ids[0].tolist()
        span = self._span(context, full)
        if span is None:
            return None
        full, span = self._document_as_text(context, full, span)
        cut = max(0, len(full) - max_ctx_len)
        inp = full[cut:]
        doc_start, doc_end = max(0, span[0] - cut), span[1] - cut
        if doc_end <= doc_start or doc_end >= len(inp):
            return None
        return _DocRequest(index, inp, doc_start, doc_end)

    def _greedy(self, entry: _DocEntry, req: _DocRequest, until: list[str], max_gen_toks: int) -> list[int]:
        """Greedy tokens after the document (:func:`~arckv_press.generation.greedy_decode`), ending at
        EOS or once the last 64 tokens decode to text holding a stop sequence of ``until``."""
        stops = [s for s in until if s]
        stop = (lambda out: any(s in self.tokenizer.decode(out[-64:]) for s in stops)) if stops else None
        rest = req.ids[req.doc_end :]
        ids = torch.tensor([rest], dtype=torch.long, device=self.device)
        pos = torch.arange(entry.length, entry.length + len(rest), device=self.device)[None]
        with torch.inference_mode(), torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                                    enabled=self.mixed_precision_dtype is not None):
            return greedy_decode(self.model, entry.cache, ids, pos, max_gen_toks, stop=stop, state=entry.state)[0]

    def _postprocess(self, tokens: list[int], until: list[str]) -> str:
        """HFLM's post-processing of generated tokens (thinking tokens, stop sequences)."""
        if isinstance(self.think_end_token, int):
            hits = [i for i, t in enumerate(tokens) if t == self.think_end_token]
            if hits:
                tokens = tokens[hits[-1] + 1 :]
        text = self.tok_decode(tokens)
        if isinstance(self.think_end_token, int):
            text = text.lstrip()
        return postprocess_generated_text(
            generation=text, stop=until, think_end_token=self.think_end_token if isinstance(self.think_end_token, str) else None
        )

    # ------------------------------------------------------------------ bookkeeping
    @staticmethod
    def _groups(reqs: list[_DocRequest]) -> list[list[_DocRequest]]:
        """Requests grouped by document, groups in order of first appearance (lm-eval's order)."""
        groups: OrderedDict[tuple, list[_DocRequest]] = OrderedDict()
        for req in reqs:
            groups.setdefault(req.key, []).append(req)
        return list(groups.values())

    @staticmethod
    def _count(entry: _DocEntry, task: str | None) -> None:
        entry.requests += 1
        if task:
            entry.tasks.add(str(task))

    def _note_without_document(self, n: int, kind: str) -> None:
        self._n_without_document += n
        logger.warning(
            "hf-arckv: %d %s request(s) have no document markers (or lost their document to truncation); "
            "evaluated with the full model", n, kind,
        )

    @property
    def n_compactions(self) -> int:
        """Documents prefilled (and compacted) so far by this instance."""
        return self._n_compactions

    @property
    def n_without_document(self) -> int:
        """Requests evaluated with the full model because they had no document."""
        return self._n_without_document
