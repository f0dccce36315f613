"""The press factory: ``make_press(name, ratio, **options)`` builds the press of a method
(:mod:`arckv_press.methods`, the one list of methods) at kept fraction ``ratio``
(paper convention rho = t/T, in (0, 1]); kvpress's own presses are used unchanged with
``compression_ratio = 1 - ratio``, on models with sliding-window layers under the convention of
:func:`arckv_press.presses.hybrid_press_class` (the global layers only); ``none`` gives ``None``
(full cache, no press).

Run kvpress presses under ``torch.inference_mode()`` (KVzip's context reconstruction otherwise
builds autograd graphs over the whole context); :func:`prefill_with_press` does so. kvpress's
pipeline runs its forward under ``torch.no_grad()``, which is enough there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from kvpress import BasePress

from arckv_press.cache import make_evictable, new_cache
from arckv_press.methods import method
from arckv_press.presses import hybrid_press_class, kept_to_compression, resolve_kept_ratio

__all__ = ["make_press", "prefill_with_press", "indexer_id", "method_config_id", "result_ids",
           "press_options"]


def indexer_id(name: str, model_id: str, indexer: Any = None) -> str:
    """Content id (:func:`~arckv_press.indexer.checkpoint.checkpoint_id`) of the indexer checkpoint
    method ``name`` uses for ``model_id``: ``indexer`` (a checkpoint path) or the shipped one.

    ``""`` for methods without a learned indexer and when no checkpoint is found; ``"in-memory"``
    for a loaded indexer object. Results store it so that resumed runs never mix checkpoints.
    """
    if not method(name).uses_indexer:
        return ""
    from pathlib import Path

    from arckv_press.indexer.checkpoint import checkpoint_id, default_indexer_path

    if indexer is not None and not isinstance(indexer, (str, Path)):
        return "in-memory"
    path = indexer if indexer is not None else default_indexer_path(model_id)
    return "" if path is None else checkpoint_id(path)


def method_config_id(name: str, ratio: float, *, model_id: str | None = None, **options: Any) -> str:
    """:func:`arckv_press.config.config_id` of method ``name``'s compaction options (press defaults plus
    ``options``) at kept fraction ``ratio``; ``""`` for kvpress presses and ``none``.

    Results store it next to :func:`indexer_id`, so that after a default changes (say
    ``min_head_fraction``) resumed runs redo the affected methods instead of mixing configurations.
    It depends on ``ratio`` and ``model_id`` only where a default does (the ``lambda_m`` /
    ``anchor_search`` schedule of the model, :func:`arckv_press.config.ratio_schedule`; ``None``: the
    default schedule).
    """
    if not method(name).ours:
        return ""
    from arckv_press.config import config_id

    return config_id(make_press(name, ratio, **options).compaction_config().for_model(model_id))


def result_ids(name: str, model_id: str, ratio: float, **options: Any) -> dict[str, str]:
    """``{"indexer": indexer_id(...), "config_id": method_config_id(...)}``: what a stored result of
    method ``name`` (with press ``options``) at kept fraction ``ratio`` must match to count as current."""
    return {"indexer": indexer_id(name, model_id, options.get("indexer")),
            "config_id": method_config_id(name, ratio, model_id=model_id, **options)}


def make_press(name: str, ratio: float, **options: Any) -> BasePress | None:
    """The press of method ``name`` keeping the fraction ``ratio`` in (0, 1] of the context.

    ``options`` go to the press constructor (e.g. ``lambda_m=`` for ARC-KV, ``window_size=`` for
    SnapKV). kvpress presses get ``compression_ratio = 1 - ratio``. ``none`` returns ``None``.
    Raises ValueError for an unknown name (listing the valid ones), a ratio outside (0, 1] or an
    option the press does not have.
    """
    spec = method(name)
    ratio = resolve_kept_ratio(ratio, None)
    cls = spec.press_class()
    if cls is None:  # the full cache
        if options:
            raise ValueError(f"method {name!r} (full cache) takes no options, got {sorted(options)}")
        return None
    own = spec.press_arguments()
    accepted = {f.name for f in dataclasses.fields(cls) if f.init} - {"compression_ratio", "ratio", *own}
    bad = sorted(set(options) - accepted)
    if bad:
        raise ValueError(f"method {name!r} ({cls.__name__}) does not take option(s) {bad}; valid options: {sorted(accepted)}")
    if spec.ours:
        return cls(ratio=ratio, **own, **options)
    # kvpress's press, compressing only the global layers of a model with sliding-window layers
    return hybrid_press_class(cls)(compression_ratio=kept_to_compression(ratio), **options)


def press_options(name: str, config_options: dict[str, Any] | None, indexer: Any = None) -> dict[str, Any]:
    """The press arguments of method ``name`` that set the :class:`~arckv_press.config.CompactionConfig`
    fields ``config_options`` (the scripts' ``--option``): a field the press takes as an argument
    (e.g. ``lambda_m``) is passed as one, the others in its ``config_options``; plus
    ``indexer=indexer`` (a checkpoint path, the scripts' ``--indexer``) for a method that uses the
    learned indexer, when one is given. ``{}`` for methods that are not ours (kvpress presses and
    ``none`` take no compaction options)."""
    spec = method(name)
    out = {"indexer": indexer} if indexer is not None and spec.uses_indexer else {}
    if not spec.ours or not config_options:
        return out
    arguments = {f.name for f in dataclasses.fields(spec.press_class()) if f.init} - {"config_options"}
    direct = {k: v for k, v in config_options.items() if k in arguments}
    rest = {k: v for k, v in config_options.items() if k not in arguments}
    return {**out, **direct, **({"config_options": rest} if rest else {})}


def prefill_with_press(model, press: BasePress | None, context_ids: torch.Tensor, cache=None):
    """Prefill ``context_ids`` into ``cache`` under ``press`` (as kvpress's pipeline does).

    Runs the decoder (no LM head) inside ``with press(model)`` under ``torch.inference_mode()``
    and returns the cache (a new :func:`~arckv_press.cache.new_cache` when none is given; a given
    one is made :func:`~arckv_press.cache.make_evictable` first). ``press=None`` prefills
    the full cache. Ask questions with the returned cache under ``torch.no_grad()`` or
    ``torch.inference_mode()``, with position ids continuing after the *original* context length
    as kvpress's pipeline does (evicting presses shorten the cache, so positions cannot be
    inferred from its length; a compact cache reports the original length).
    """
    cache = new_cache(model) if cache is None else make_evictable(cache, model)
    with torch.inference_mode():
        if press is None:
            model.model(input_ids=context_ids.to(model.device), past_key_values=cache)
        else:
            with press(model):
                model.model(input_ids=context_ids.to(model.device), past_key_values=cache)
    return cache
