"""Needle-in-a-haystack contexts for the demo and ``scripts/needle.py``.

The haystack is either a text file (e.g. the Paul Graham essays used by RULER) or, when none is
available, RULER's "noise" haystack (repeated filler sentences). The needle is inserted at a
sentence boundary at the requested depth; the context is cut to the requested token count.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Needle", "make_needle", "needle_context", "load_haystack", "default_haystack_path"]

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "

_CITIES = ["Paris", "Lisbon", "Nairobi", "Oslo", "Lima", "Hanoi", "Quito", "Dakar", "Riga", "Perth", "Seoul", "Accra"]


@dataclass(frozen=True)
class Needle:
    key: str
    value: str

    @property
    def sentence(self) -> str:
        return f" The special magic number for {self.key} is {self.value}. "

    @property
    def question(self) -> str:
        return f"What is the special magic number for {self.key} mentioned in the provided text?"

    answer_prefix: str = "The special magic number for {key} mentioned in the provided text is"

    def prefix(self) -> str:
        return self.answer_prefix.format(key=self.key)


def make_needle(seed: int) -> Needle:
    """A deterministic (city, 7-digit number) needle."""
    rng = random.Random(seed)
    return Needle(rng.choice(_CITIES), str(rng.randint(1_000_000, 9_999_999)))


def default_haystack_path() -> Path | None:
    """``../shared/data/ruler/pg_essays.txt`` relative to the working directory, if present."""
    for base in (Path.cwd(), Path(__file__).resolve().parents[1]):
        path = base.parent / "shared" / "data" / "ruler" / "pg_essays.txt"
        if path.exists():
            return path
    return None


def load_haystack(path: str | Path | None) -> str:
    """The haystack text: the file at ``path`` (or the default one), else the noise haystack."""
    path = Path(path) if path else default_haystack_path()
    if path is None:
        return NOISE * 2000
    if not path.exists():
        raise FileNotFoundError(f"haystack file not found: {path}")
    return path.read_text(encoding="utf-8")


def needle_context(tokenizer, haystack: str, n_tokens: int, depth: float, needle: Needle) -> str:
    """About ``n_tokens`` tokens of haystack with ``needle`` at fractional ``depth`` (0 = start)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    needle_len = len(tokenizer.encode(needle.sentence, add_special_tokens=False))
    budget = max(1, n_tokens - needle_len)
    ids = tokenizer.encode(haystack[: budget * 8], add_special_tokens=False)
    if len(ids) < budget:
        raise ValueError(f"haystack has only {len(ids)} tokens, {budget} needed")
    text = tokenizer.decode(ids[:budget])
    cut = int(len(text) * depth)
    # move the insertion point to the next sentence boundary (or keep it at the ends)
    if 0 < cut < len(text):
        dot = text.find(". ", cut)
        cut = dot + 1 if dot != -1 else len(text)
    return text[:cut] + needle.sentence + text[cut:]
