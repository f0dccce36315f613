"""The methods: one definition of every method name the package, its presses and its benchmarks use.

A :class:`Method` says what a name is: its family (ARC-KV, Attention Matching, a kvpress press or
the full cache), its anchor selector (ARC-KV, paper App. C.1) or key-selection variant (Attention
Matching), the press class that runs it (imported only when asked for, so this module stays at the
bottom layer) and whether its results depend on the learned indexer. Everything else looks names
up here: :func:`method` for a name, :func:`arckv_method` / :func:`am_method` for a press's
selector or variant.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

__all__ = ["Method", "METHODS", "METHOD_NAMES", "COMPACTION_METHODS", "method", "arckv_method", "am_method"]

FAMILIES = ("arckv", "am", "kvpress", "none")


@dataclass(frozen=True)
class Method:
    """One method.

    Attributes:
        name: the name users pass (``press=`` of ``hf-arckv``, ``--methods`` of the scripts).
        family: ``"arckv"``, ``"am"`` (Attention Matching), ``"kvpress"`` or ``"none"``.
        description: one line for ``--help`` and the README.
        selector: ARC-KV anchor selector: ``"indexer"`` (learned), ``"ha"`` or ``"vi"``.
        variant: Attention Matching key selection: ``"omp"``, ``"omp-fast"`` or ``"ha"``.
        press: ``"module:Class"`` of the press that runs it (``None`` for the full cache).
        uses_indexer: its results depend on the learned indexer checkpoint.
    """

    name: str
    family: str
    description: str
    selector: str | None = None
    variant: str | None = None
    press: str | None = None
    uses_indexer: bool = False

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        if (self.selector is not None) != (self.family == "arckv") or (self.variant is not None) != (self.family == "am"):
            raise ValueError(f"{self.name}: ARC-KV methods have a selector and Attention Matching ones a variant, "
                             "no other method has either")

    @property
    def ours(self) -> bool:
        """An ARC-KV or Attention Matching method: compacted by this package (a compaction config
        with an id, :func:`arckv_press.config.config_id`), not a kvpress press or the full cache."""
        return self.family in ("arckv", "am")

    def press_arguments(self) -> dict[str, str]:
        """The press arguments that make its press this method (``selector`` / ``variant``)."""
        return {k: v for k, v in (("selector", self.selector), ("variant", self.variant)) if v is not None}

    def press_class(self) -> type | None:
        """The press class (imported now); ``None`` for the full cache."""
        if self.press is None:
            return None
        module, _, name = self.press.partition(":")
        return getattr(importlib.import_module(module), name)


_ARCKV_PRESS = "arckv_press.presses:ARCKVPress"
_AM_PRESS = "arckv_press.presses:AttentionMatchingPress"

METHODS: dict[str, Method] = {m.name: m for m in (
    Method("arckv", "arckv", "ARC-KV with the learned value-aware indexer (needs a trained indexer checkpoint)",
           selector="indexer", press=_ARCKV_PRESS, uses_indexer=True),
    Method("arckv-ha", "arckv", "ARC-KV with highest-attention anchors (training-free)", selector="ha", press=_ARCKV_PRESS),
    Method("arckv-vi", "arckv", "ARC-KV with value-influence anchors (training-free)", selector="vi", press=_ARCKV_PRESS),
    Method("am-omp", "am", "Attention Matching, OMP key selection + fitted beta/C_v", variant="omp", press=_AM_PRESS),
    Method("am-omp-fast", "am", "Attention Matching, faster OMP variant", variant="omp-fast", press=_AM_PRESS),
    Method("am-ha", "am", "Attention Matching, highest-attention keys + fitted beta/C_v", variant="ha", press=_AM_PRESS),
    Method("snapkv", "kvpress", "kvpress SnapKV: evict by attention from the context's last window",
           press="kvpress:SnapKVPress"),
    Method("kvzip", "kvpress", "kvpress KVzip: evict by attention during context reconstruction", press="kvpress:KVzipPress"),
    Method("expected_attention", "kvpress", "kvpress Expected Attention: evict by attention expected from future queries",
           press="kvpress:ExpectedAttentionPress"),
    Method("knorm", "kvpress", "kvpress Knorm: evict the keys with the largest L2 norm", press="kvpress:KnormPress"),
    Method("streaming_llm", "kvpress", "kvpress StreamingLLM: keep attention sinks and the most recent tokens",
           press="kvpress:StreamingLLMPress"),
    Method("none", "none", "full cache (no compression)"),
)}
METHOD_NAMES: tuple[str, ...] = tuple(METHODS)
COMPACTION_METHODS: tuple[str, ...] = tuple(name for name, m in METHODS.items() if m.ours)


def method(name: str, ours: bool = False) -> Method:
    """The method called ``name``; a ValueError listing the valid names otherwise (with ``ours``,
    only ARC-KV and Attention Matching methods are valid)."""
    valid = COMPACTION_METHODS if ours else METHOD_NAMES
    if name not in valid:
        raise ValueError(f"unknown method {name!r}; valid methods: {', '.join(valid)}")
    return METHODS[name]


def _by(attribute: str, value: str, label: str) -> Method:
    found = [m for m in METHODS.values() if getattr(m, attribute) == value]
    if not found:
        choices = sorted({getattr(m, attribute) for m in METHODS.values()} - {None})
        raise ValueError(f"unknown {label} {value!r}; expected one of {choices}")
    return found[0]


def arckv_method(selector: str) -> Method:
    """The ARC-KV method with anchor selector ``selector`` (``indexer``, ``ha`` or ``vi``)."""
    return _by("selector", selector, "ARC-KV selector")


def am_method(variant: str) -> Method:
    """The Attention Matching method with key selection ``variant`` (``omp``, ``omp-fast``, ``ha``)."""
    return _by("variant", variant, "Attention-Matching variant")
