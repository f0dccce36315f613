"""Needle-in-a-haystack contexts for the demo and ``scripts/needle.py``.

The haystack is either a text file (e.g. the Paul Graham essays used by RULER) or, when none is
available, RULER's "noise" haystack (repeated filler sentences). The needle is inserted at a
sentence boundary at the requested depth; the context is cut to the requested token count.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Needle", "FRAMINGS", "RULER_INSTRUCTION", "make_needle", "load_articles", "article_for_seed", "needle_context", "load_haystack", "default_haystack_path"]

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "

_CITIES = ["Paris", "Lisbon", "Nairobi", "Oslo", "Lima", "Hanoi", "Quito", "Dakar", "Riga", "Perth", "Seoul", "Accra"]
_PLACES = ["north gate", "server room", "archive vault", "east warehouse", "boiler room", "west wing", "loading dock",
           "records office", "garden shed", "control tower"]

#: Needle framings: ``ruler`` (RULER's magic-number needle, its instruction before the haystack and
#: its answer prefix) and ``pipeline`` (a fact as a user of kvpress's pipeline plants and asks it: an
#: access code, a plain question after a blank line, as a user writes it below a document, and
#: ``answer_prefix="Answer:"``, no instruction, in articles: :func:`load_articles`). kvpress's
#: pipeline joins the question to the context with nothing in between, so the blank line is the
#: question's own (``docs/studies/needle_end.md``: without it the full cache itself misses).
FRAMINGS = ("ruler", "pipeline")
#: RULER's instruction, put before the haystack in the ``ruler`` framing (the demo, the needle grid
#: and the needle probe).
RULER_INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n"
)
_TEMPLATES = {
    "ruler": (" The special magic number for {key} is {value}. ",
              "What is the special magic number for {key} mentioned in the provided text?",
              "The special magic number for {key} mentioned in the provided text is"),
    "pipeline": (" The access code for the {key} is {value}.",
                 "\n\nWhat is the access code for the {key}? Answer with the number only.",
                 "Answer:"),
}


@dataclass(frozen=True)
class Needle:
    key: str
    value: str
    framing: str = "ruler"

    def __post_init__(self) -> None:
        if self.framing not in FRAMINGS:
            raise ValueError(f"framing must be one of {FRAMINGS}, got {self.framing!r}")

    @property
    def sentence(self) -> str:
        return _TEMPLATES[self.framing][0].format(key=self.key, value=self.value)

    @property
    def question(self) -> str:
        return _TEMPLATES[self.framing][1].format(key=self.key)

    def prefix(self) -> str:
        """The answer prefix kvpress's pipeline appends after the question."""
        return _TEMPLATES[self.framing][2].format(key=self.key)


def make_needle(seed: int, framing: str = "ruler") -> Needle:
    """A deterministic (key, 7-digit number) needle: a city for ``ruler``, a place for ``pipeline``."""
    rng = random.Random(seed)
    keys = _CITIES if framing == "ruler" else _PLACES
    return Needle(rng.choice(keys), str(rng.randint(1_000_000, 9_999_999)), framing)


def _shared_data_file(*parts: str) -> Path | None:
    """``../shared/data/<parts>`` relative to the working directory or the checkout, if present."""
    for base in (Path.cwd(), Path(__file__).resolve().parents[1]):
        path = base.parent.joinpath("shared", "data", *parts)
        if path.exists():
            return path
    return None


def default_haystack_path() -> Path | None:
    """``../shared/data/ruler/pg_essays.txt`` relative to the working directory, if present."""
    return _shared_data_file("ruler", "pg_essays.txt")


def load_haystack(path: str | Path | None) -> str:
    """The haystack text: the file at ``path`` (or the default one), else the noise haystack."""
    path = Path(path) if path else default_haystack_path()
    if path is None:
        return NOISE * 2000
    if not path.exists():
        raise FileNotFoundError(f"haystack file not found: {path}")
    return path.read_text(encoding="utf-8")


def default_articles_path() -> Path | None:
    """``../shared/data/quality/leval_quality.jsonl`` (relative to the working directory or the checkout), if present."""
    return _shared_data_file("quality", "leval_quality.jsonl")


def load_articles(path: str | Path | None = None) -> list[str]:
    """The articles of a JSON-lines file with an ``input`` text per line (QuALITY's, by default): the
    ``pipeline`` framing's haystacks, one article per seed (:func:`article_for_seed`)."""
    import json

    path = Path(path) if path else default_articles_path()
    if path is None or not path.exists():
        raise FileNotFoundError(f"articles file not found: {path or 'shared/data/quality/leval_quality.jsonl'}")
    articles = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}, line {number}: not JSON ({err.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("input"), str) or not record["input"].strip():
                raise ValueError(f"{path}, line {number}: no 'input' article text")
            articles.append(record["input"])
    if not articles:
        raise ValueError(f"{path}: no articles")
    return articles


def article_for_seed(articles: list[str], seed: int) -> str:
    """Seed ``s`` reads article ``s`` (cyclically), so each seed's needle sits in another text."""
    return articles[seed % len(articles)]


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
