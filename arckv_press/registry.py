"""The method registry: one mapping from method names to press constructors.

``make_press(name, ratio, **options)`` builds the press of a method at kept fraction ``ratio``
(paper convention rho = t/T, in (0, 1]); kvpress's own presses are used unchanged with
``compression_ratio = 1 - ratio``; ``none`` gives ``None`` (full cache, no press).

Run kvpress presses under ``torch.inference_mode()`` (KVzip's context reconstruction otherwise
builds autograd graphs over the whole context); :func:`prefill_with_press` does so. kvpress's
pipeline runs its forward under ``torch.no_grad()``, which is enough there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
from kvpress import (
    BasePress,
    ExpectedAttentionPress,
    KnormPress,
    KVzipPress,
    SnapKVPress,
    StreamingLLMPress,
)
from transformers import DynamicCache

from arckv_press.presses import ARCKVPress, AttentionMatchingPress, kept_to_compression, resolve_kept_ratio

__all__ = ["METHODS", "METHOD_NAMES", "MethodSpec", "make_press", "describe_methods", "prefill_with_press", "indexer_id",
           "method_config_id", "result_ids", "press_options"]


@dataclass(frozen=True)
class MethodSpec:
    """One registry entry: a constructor ``build(ratio, **options)`` and a one-line description."""

    name: str
    description: str
    build: Callable[..., BasePress | None]
    family: str  # "arckv", "am", "kvpress" or "none"
    uses_indexer: bool = False  # results depend on the learned indexer checkpoint

    @property
    def ours(self) -> bool:
        """An ARC-KV or Attention Matching press of this package (options such as ``tokenizer=``,
        ``progress=``; a compaction config with an id), not a kvpress press or the full cache."""
        return self.family in ("arckv", "am")


def _kvpress(cls: type[BasePress]) -> Callable[..., BasePress]:
    def build(ratio: float, **options: Any) -> BasePress:
        return cls(compression_ratio=kept_to_compression(ratio), **options)

    build.press_class = cls  # type: ignore[attr-defined]
    return build


def _arckv(selector: str) -> Callable[..., BasePress]:
    def build(ratio: float, **options: Any) -> BasePress:
        return ARCKVPress(ratio=ratio, selector=selector, **options)

    build.press_class = ARCKVPress  # type: ignore[attr-defined]
    return build


def _am(variant: str) -> Callable[..., BasePress]:
    def build(ratio: float, **options: Any) -> BasePress:
        return AttentionMatchingPress(ratio=ratio, variant=variant, **options)

    build.press_class = AttentionMatchingPress  # type: ignore[attr-defined]
    return build


def _none(ratio: float, **options: Any) -> None:
    if options:
        raise ValueError(f"method 'none' (full cache) takes no options, got {sorted(options)}")
    return None


_ENTRIES = [
    MethodSpec("arckv", "ARC-KV with the learned value-aware indexer (needs a trained indexer checkpoint)", _arckv("indexer"), "arckv", True),
    MethodSpec("arckv-ha", "ARC-KV with highest-attention anchors (training-free)", _arckv("ha"), "arckv"),
    MethodSpec("arckv-vi", "ARC-KV with value-influence anchors (training-free)", _arckv("vi"), "arckv"),
    MethodSpec("am-omp", "Attention Matching, OMP key selection + fitted beta/C_v", _am("omp"), "am"),
    MethodSpec("am-omp-fast", "Attention Matching, faster OMP variant", _am("omp-fast"), "am"),
    MethodSpec("am-ha", "Attention Matching, highest-attention keys + fitted beta/C_v", _am("ha"), "am"),
    MethodSpec("snapkv", "kvpress SnapKV: evict by attention from the context's last window", _kvpress(SnapKVPress), "kvpress"),
    MethodSpec("kvzip", "kvpress KVzip: evict by attention during context reconstruction", _kvpress(KVzipPress), "kvpress"),
    MethodSpec(
        "expected_attention", "kvpress Expected Attention: evict by attention expected from future queries",
        _kvpress(ExpectedAttentionPress), "kvpress",
    ),
    MethodSpec("knorm", "kvpress Knorm: evict the keys with the largest L2 norm", _kvpress(KnormPress), "kvpress"),
    MethodSpec("streaming_llm", "kvpress StreamingLLM: keep attention sinks and the most recent tokens", _kvpress(StreamingLLMPress), "kvpress"),
    MethodSpec("none", "full cache (no compression)", _none, "none"),
]

METHODS: dict[str, MethodSpec] = {spec.name: spec for spec in _ENTRIES}
METHOD_NAMES: tuple[str, ...] = tuple(METHODS)


def indexer_id(name: str, model_id: str, indexer: Any = None) -> str:
    """Content id (:func:`~arckv_press.indexer.checkpoint.checkpoint_id`) of the indexer checkpoint
    method ``name`` uses for ``model_id``: ``indexer`` (a checkpoint path) or the shipped one.

    ``""`` for methods without a learned indexer and when no checkpoint is found; ``"in-memory"``
    for a loaded indexer object. Results store it so that resumed runs never mix checkpoints.
    """
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; valid methods: {', '.join(METHOD_NAMES)}")
    if not METHODS[name].uses_indexer:
        return ""
    from pathlib import Path

    from arckv_press.indexer.checkpoint import checkpoint_id, default_indexer_path

    if indexer is not None and not isinstance(indexer, (str, Path)):
        return "in-memory"
    path = indexer if indexer is not None else default_indexer_path(model_id)
    return "" if path is None else checkpoint_id(path)


def method_config_id(name: str, **options: Any) -> str:
    """:func:`arckv_press.api.config_id` of method ``name``'s compaction options (press defaults plus
    ``options``), the same at every kept fraction; ``""`` for kvpress presses and ``none``.

    Results store it next to :func:`indexer_id`, so that after a default changes (say
    ``min_head_fraction``) resumed runs redo the affected methods instead of mixing configurations.
    """
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; valid methods: {', '.join(METHOD_NAMES)}")
    if not METHODS[name].ours:
        return ""
    from arckv_press.api import config_id

    return config_id(make_press(name, 1.0, **options).compaction_config())


def result_ids(name: str, model_id: str, **options: Any) -> dict[str, str]:
    """``{"indexer": indexer_id(...), "config_id": method_config_id(...)}``: what a stored result of
    method ``name`` (with press ``options``) must match to count as current."""
    return {"indexer": indexer_id(name, model_id, options.get("indexer")), "config_id": method_config_id(name, **options)}


def make_press(name: str, ratio: float, **options: Any) -> BasePress | None:
    """The press of method ``name`` keeping the fraction ``ratio`` in (0, 1] of the context.

    ``options`` go to the press constructor (e.g. ``lambda_m=`` for ARC-KV, ``window_size=`` for
    SnapKV). kvpress presses get ``compression_ratio = 1 - ratio``. ``none`` returns ``None``.
    Raises ValueError for an unknown name (listing the valid ones), a ratio outside (0, 1] or an
    option the press does not have.
    """
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; valid methods: {', '.join(METHOD_NAMES)}")
    ratio = resolve_kept_ratio(ratio, None)
    spec = METHODS[name]
    cls = getattr(spec.build, "press_class", None)
    if cls is not None:
        accepted = {f.name for f in dataclasses.fields(cls) if f.init}
        fixed = {"compression_ratio", "ratio"} | ({"selector"} if spec.family == "arckv" else set())
        fixed |= {"variant"} if spec.family == "am" else set()
        bad = sorted(set(options) - (accepted - fixed))
        if bad:
            raise ValueError(
                f"method {name!r} ({cls.__name__}) does not take option(s) {bad}; valid options: "
                f"{sorted(accepted - fixed)}"
            )
    return spec.build(ratio, **options)


def press_options(name: str, config_options: dict[str, Any] | None) -> dict[str, Any]:
    """The press arguments of method ``name`` that set the :class:`~arckv_press.api.CompactionConfig`
    fields ``config_options`` (the scripts' ``--option``): a field the press takes as an argument
    (e.g. ``lambda_m``) is passed as one, the others in its ``config_options``. ``{}`` for methods
    that are not ours (kvpress presses and ``none`` take no compaction options)."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; valid methods: {', '.join(METHOD_NAMES)}")
    if not METHODS[name].ours or not config_options:
        return {}
    arguments = {f.name for f in dataclasses.fields(METHODS[name].build.press_class) if f.init} - {"config_options"}
    direct = {k: v for k, v in config_options.items() if k in arguments}
    rest = {k: v for k, v in config_options.items() if k not in arguments}
    return {**direct, **({"config_options": rest} if rest else {})}


def describe_methods(indent: str = "  ") -> str:
    """One line per method, ``name: description`` (for ``--help`` and the README)."""
    width = max(len(n) for n in METHOD_NAMES)
    return "\n".join(f"{indent}{spec.name:<{width}}  {spec.description}" for spec in METHODS.values())


def prefill_with_press(model, press: BasePress | None, context_ids: torch.Tensor, cache=None):
    """Prefill ``context_ids`` into ``cache`` under ``press`` (as kvpress's pipeline does).

    Runs the decoder (no LM head) inside ``with press(model)`` under ``torch.inference_mode()``
    and returns the cache (a new ``DynamicCache`` when none is given). ``press=None`` prefills
    the full cache. Ask questions with the returned cache under ``torch.no_grad()`` or
    ``torch.inference_mode()``, with position ids continuing after the *original* context length
    as kvpress's pipeline does (evicting presses shorten the cache, so positions cannot be
    inferred from its length; a compact cache reports the original length).
    """
    cache = DynamicCache(config=model.config) if cache is None else cache
    with torch.inference_mode():
        if press is None:
            model.model(input_ids=context_ids.to(model.device), past_key_values=cache)
        else:
            with press(model):
                model.model(input_ids=context_ids.to(model.device), past_key_values=cache)
    return cache
