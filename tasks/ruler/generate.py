"""Offline generator for the 13 RULER tasks (Hsieh et al., 2024, "RULER: What's the Real Context
Size of Your Long-Context Language Models?", github.com/NVIDIA/RULER).

A re-implementation from RULER's public description and generator scripts
(``scripts/data/synthetic/{niah,variable_tracking,common_words_extraction,freq_words_extraction,qa}.py``,
``constants.py``, ``synthetic.yaml``): same task configurations, templates, answer prefixes,
``tokens_to_generate`` and metrics. Every sample is sized so that

    tokens(prompt + answer_prefix) + tokens_to_generate <= max_seq_length

under the evaluated model's tokenizer, as close to the bound as the haystack's unit allows.

Differences from the reference scripts (deliberate, for determinism and speed):

- Every random choice comes from a ``random.Random`` seeded by ``(seed, task, max_seq_length,
  sample index)``; the output does not depend on global RNG state or on the order tasks run in.
- The haystack size is found per sample by a galloping/binary search over nested haystacks
  (prefix of a fixed per-sample ordering) instead of RULER's linear increments.
- Sentences of the essay haystack are split by a regex (RULER uses NLTK ``sent_tokenize``).
- Needle keys ``adjective-noun`` are drawn as an adjective and a noun (RULER draws from the
  materialised product list); keys and values inside one sample are distinct, and the
  distractor needles of the ``needle`` haystack never reuse a real key.
- The in-context examples of ``vt`` and ``cwe`` are placed before the instruction (as in RULER)
  and are not part of the compacted document.
- QA: HotpotQA records without paragraphs are skipped; a record's supporting paragraphs are
  mandatory and its other paragraphs are the first distractors (RULER always keeps all 10, which
  is what happens whenever 10 fit; this also makes lengths below ~2K possible). All SQuAD files in
  ``squad/`` contribute distractor paragraphs; only answerable questions are asked, in file order.
- fwe: the budget includes the generated tokens as for every other task (RULER's fwe script
  fills ``max_seq_length`` with the input alone).
- Few-shot whitespace quirks of RULER (e.g. collapsing the example template) are not copied.

The prompt of a sample is ``wrap_document(prefix, context, question)`` (``tasks/_common/
doc_markers.py``): the compacted document is exactly the haystack ``context``; the instruction
(and in-context example) before it and the question after it stay outside the markers. The answer
prefix is returned separately (lm-eval ``gen_prefix``).
"""

from __future__ import annotations

import random
import re
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any


from arckv_press.tasks._common import records as data_files
from arckv_press.tasks._common.doc_markers import wrap_document

__all__ = [
    "RulerData",
    "RulerSample",
    "TASKS",
    "TaskSpec",
    "generate_task",
    "load_ruler_data",
    "split_sentences",
    "string_match_all",
    "string_match_part",
]

# --------------------------------------------------------------------------- task table

TOKENS_TO_GENERATE = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}


@dataclass(frozen=True)
class TaskSpec:
    """One RULER task: family (niah | vt | cwe | fwe | qa), its arguments and scoring rule."""

    name: str
    family: str
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_to_generate(self) -> int:
        return TOKENS_TO_GENERATE[self.family]

    @property
    def metric(self) -> str:
        """``"part"`` (string_match_part) for QA, ``"all"`` (string_match_all) otherwise."""
        return "part" if self.family == "qa" else "all"


def _niah(haystack: str, k: str, v: str, nk: int = 1, nv: int = 1, nq: int = 1) -> dict[str, Any]:
    return dict(type_haystack=haystack, type_needle_k=k, type_needle_v=v,
                num_needle_k=nk, num_needle_v=nv, num_needle_q=nq)


# RULER scripts/synthetic.yaml
TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec("niah_single_1", "niah", _niah("repeat", "words", "numbers")),
        TaskSpec("niah_single_2", "niah", _niah("essay", "words", "numbers")),
        TaskSpec("niah_single_3", "niah", _niah("essay", "words", "uuids")),
        TaskSpec("niah_multikey_1", "niah", _niah("essay", "words", "numbers", nk=4)),
        TaskSpec("niah_multikey_2", "niah", _niah("needle", "words", "numbers")),
        TaskSpec("niah_multikey_3", "niah", _niah("needle", "uuids", "uuids")),
        TaskSpec("niah_multivalue", "niah", _niah("essay", "words", "numbers", nv=4)),
        TaskSpec("niah_multiquery", "niah", _niah("essay", "words", "numbers", nq=4)),
        TaskSpec("vt", "vt", dict(num_chains=1, num_hops=4)),
        TaskSpec("cwe", "cwe", dict(freq_cw=30, freq_ucw=3, num_cw=10)),
        TaskSpec("fwe", "fwe", dict(alpha=2.0, coded_wordlen=6)),
        TaskSpec("qa_1", "qa", dict(dataset="squad")),
        TaskSpec("qa_2", "qa", dict(dataset="hotpotqa")),
    )
}

# --------------------------------------------------------------------------- templates (RULER constants.py)

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
REPEAT_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
VT_NOISE = REPEAT_NOISE + "\n"

NIAH_PREFIX = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it."
    " I will quiz you about the {type_needle_v} afterwards.\n"
)
NIAH_QUESTION = "\nWhat are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
NIAH_ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"

VT_PREFIX = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
VT_QUESTION = "\nQuestion: Find all variables that are assigned the value {query} in the text above."
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables"
    " are assgined the value {query}, they are: "
)

CWE_PREFIX = (
    "Below is a numbered list of words. In these words, some appear more often than others."
    " Memorize the ones that appear most often.\n"
)
CWE_QUESTION = "\nQuestion: What are the 10 most common words in the above list?"
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"

FWE_PREFIX = (
    "Read the following coded text and track the frequency of each coded word."
    " Find the three most frequently appeared coded words. "
)
FWE_QUESTION = (
    "\nQuestion: Do not provide any explanation. Please ignore the dots '....'."
    " What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"

QA_PREFIX = (
    "Answer the question based on the given documents. Only give me the answer and do not output any"
    " other words.\n\nThe following are given documents.\n\n"
)
QA_QUESTION = (
    "\n\nAnswer the question based on the given documents. Only give me the answer and do not output"
    " any other words.\n\nQuestion: {query}"
)
QA_ANSWER_PREFIX = " Answer:"
QA_DOCUMENT = "Document {i}:\n{document}"

# Needle depths in percent (RULER: np.round(np.linspace(0, 100, 40)); no .5 ties occur).
DEPTHS = [round(100 * i / 39) for i in range(40)]
VT_ICL_MAX_LENGTH = 500  # RULER sizes the variable-tracking example to 500 tokens

# --------------------------------------------------------------------------- metrics (RULER eval)


def postprocess_prediction(prediction: str) -> str:
    """RULER's ``postprocess_pred``: strip, map control characters to newlines, strip again."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Fraction of references found (case-insensitive substring) in the prediction."""
    if not references:
        raise ValueError("string_match_all: empty reference list")
    pred = prediction.lower()
    return sum(1.0 for r in references if r.lower() in pred) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1.0 if any reference is found (case-insensitive substring) in the prediction, else 0.0."""
    if not references:
        raise ValueError("string_match_part: empty reference list")
    pred = prediction.lower()
    return max(1.0 if r.lower() in pred else 0.0 for r in references)


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class QAData:
    """RULER QA pool: questions with gold/related paragraph indices into ``docs``."""

    docs: tuple[str, ...]
    questions: tuple[dict[str, Any], ...]  # {"query", "outputs", "context": [idx], "more_context": [idx]}


@dataclass
class RulerData:
    """Inputs of the generators; each field is loaded only when a task needs it."""

    root: Path | None
    _essay_words: list[str] | None = None
    _qa: dict[str, QAData] = field(default_factory=dict)

    def essay_words(self) -> list[str]:
        if self._essay_words is None:
            self._essay_words = _essay_words(self.root)
        return self._essay_words

    def qa(self, dataset: str) -> QAData:
        if dataset not in self._qa:
            if dataset == "squad":
                self._qa[dataset] = _read_squad(self.root)
            elif dataset == "hotpotqa":
                self._qa[dataset] = _read_hotpotqa(self.root)
            else:
                raise ValueError(f"unknown RULER QA dataset {dataset!r}; expected 'squad' or 'hotpotqa'")
        return self._qa[dataset]


def load_ruler_data(root: str | Path | None) -> RulerData:
    """Data handle for a local RULER folder, or for the Hugging Face Hub when ``root`` is None."""
    if root is not None:
        root = Path(root)
        if not root.is_dir():
            raise FileNotFoundError(f"RULER data folder not found: {root}")
    return RulerData(root=root)


@lru_cache(maxsize=2)
def _essay_words(root: Path | None) -> list[str]:
    if root is None:
        text = _hub_essays()
    elif (root / "PaulGrahamEssays.json").is_file():
        path = root / "PaulGrahamEssays.json"
        text = data_files.check_fields(data_files.read_json(path, expect=dict), {"text": str}, str(path))["text"]
    elif (root / "pg_essays.txt").is_file():
        text = data_files.read_text(root / "pg_essays.txt")
    else:
        raise FileNotFoundError(f"no PaulGrahamEssays.json or pg_essays.txt in the RULER folder {root}")
    # RULER: haystack = re.sub(r'\s+', " ", essay).split(" ")
    return re.sub(r"\s+", " ", text).strip().split(" ")


def _hub_essays() -> str:  # pragma: no cover - needs network
    import datasets

    rows = datasets.load_dataset("baber/paul_graham_essays", split="train")["text"]
    return " ".join(rows)


def _json_files(root: Path, sub: str) -> list[Path]:
    files = sorted((root / sub).glob("*.json"))
    if not files:
        raise FileNotFoundError(f"no {sub}/*.json in the RULER folder {root}")
    return files


@lru_cache(maxsize=2)
def _read_squad(root: Path | None) -> QAData:
    """RULER ``read_squad``: unique paragraphs (sorted) and the answerable questions."""
    if root is None:
        articles = _hub_squad_articles()
    else:
        articles = []
        # the answer-less test half (*noanswers*) is the value-aware indexer's training text:
        # keep it out of every evaluation context
        for path in [p for p in _json_files(root, "squad") if "noanswers" not in p.name]:
            articles.extend(_check_squad(data_files.read_json(path, expect=dict), path))
    docs = sorted({p["context"] for a in articles for p in a["paragraphs"]})
    index = {c: i for i, c in enumerate(docs)}
    questions = []
    for article in articles:
        article_docs = [index[p["context"]] for p in article["paragraphs"]]
        for p in article["paragraphs"]:
            gold = index[p["context"]]
            for qa in p.get("qas", []):
                answers = [a["text"] for a in qa.get("answers", [])]
                if qa.get("is_impossible", False) or not answers:
                    continue
                questions.append({
                    "query": qa["question"],
                    "outputs": answers,
                    "context": [gold],
                    "more_context": [i for i in article_docs if i != gold],
                })
    if not questions:
        raise ValueError("SQuAD data has no answerable question (needs 'answers' / 'is_impossible')")
    return QAData(tuple(docs), tuple(questions))


def _check_squad(obj: dict[str, Any], path: Path) -> list[dict[str, Any]]:
    """The ``data`` articles of a SQuAD file, every field :func:`_read_squad` reads checked
    (:class:`~arckv_press.tasks._common.records.DataFileError` naming the file, the JSON path and
    the field)."""
    check = data_files.check_fields
    articles = check(obj, {"data": [dict]}, str(path))["data"]
    for a, article in enumerate(articles):
        for p, para in enumerate(check(article, {"paragraphs": [dict]}, f"{path}, data[{a}]")["paragraphs"]):
            where = f"{path}, data[{a}].paragraphs[{p}]"
            check(para, {"context": str}, where)
            for q, qa in enumerate(check(para, {"qas": [dict]}, where)["qas"] if "qas" in para else []):
                at = f"{where}.qas[{q}]"
                check(qa, {"question": str}, at)
                if "answers" in qa:
                    for i, answer in enumerate(check(qa, {"answers": [dict]}, at)["answers"]):
                        check(answer, {"text": str}, f"{at}.answers[{i}]")
    return articles


def _check_hotpotqa(records: list[Any], path: Path) -> list[dict[str, Any]]:
    """The records of a HotpotQA file, every field :func:`_read_hotpotqa` reads checked: ``context``
    is a list of ``[title, [sentence, ...]]`` pairs, ``supporting_facts`` (optional) of
    ``[title, sentence index]`` pairs."""
    for i, r in enumerate(records):
        where = f"{path}, [{i}]"
        data_files.check_fields(r, {"question": str, "answer": str, "context": [list]}, where)
        for j, pair in enumerate(r["context"]):
            if len(pair) != 2 or not isinstance(pair[0], str) or not isinstance(pair[1], list) or not all(
                    isinstance(s, str) for s in pair[1]):
                raise data_files.DataFileError(f"{where}: field 'context'[{j}] must be [title, [sentence, ...]], "
                                               f"got {str(pair)[:80]}")
        for j, fact in enumerate(r.get("supporting_facts") or []):
            if not isinstance(fact, list) or not fact or not isinstance(fact[0], str):
                raise data_files.DataFileError(f"{where}: field 'supporting_facts'[{j}] must be [title, sentence "
                                               f"index], got {str(fact)[:80]}")
    return records


def _hub_squad_articles() -> list[dict[str, Any]]:  # pragma: no cover - needs network
    import datasets

    rows = datasets.load_dataset("rajpurkar/squad_v2", split="validation")
    articles: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        paragraphs = articles.setdefault(row["title"], {})
        para = paragraphs.setdefault(row["context"], {"context": row["context"], "qas": []})
        texts = list(row["answers"]["text"])
        para["qas"].append({
            "question": row["question"],
            "answers": [{"text": t} for t in texts],
            "is_impossible": not texts,
        })
    return [{"paragraphs": list(p.values())} for p in articles.values()]


@lru_cache(maxsize=2)
def _read_hotpotqa(root: Path | None) -> QAData:
    """RULER ``read_hotpotqa``: a paragraph is its title, a newline and its joined sentences; records without
    paragraphs are skipped (their answer could not be supported).

    RULER always keeps the record's 10 paragraphs; here the supporting paragraphs are mandatory and
    the record's other paragraphs are the first distractors, which gives the same documents
    whenever 10 or more fit and still works at short lengths."""
    if root is None:
        records = _hub_hotpot_records()
    else:
        records = []
        for path in _json_files(root, "hotpotqa"):
            records.extend(_check_hotpotqa(data_files.read_json(path, expect=list), path))
    records = [r for r in records if r["context"]]
    docs = sorted({f"{t}\n{''.join(p)}" for r in records for t, p in r["context"]})
    index = {c: i for i, c in enumerate(docs)}
    questions = []
    for r in records:
        paragraphs = list(dict.fromkeys(index[f"{t}\n{''.join(p)}"] for t, p in r["context"]))
        support = {fact[0] for fact in r.get("supporting_facts") or []}
        gold = list(dict.fromkeys(
            index[f"{t}\n{''.join(p)}"] for t, p in r["context"] if t in support
        )) or paragraphs
        questions.append({
            "query": r["question"],
            "outputs": [r["answer"]],
            "context": gold,
            "more_context": [i for i in paragraphs if i not in gold],
        })
    if not questions:
        raise ValueError("HotpotQA data has no record with paragraphs")
    return QAData(tuple(docs), tuple(questions))


def _hub_hotpot_records() -> list[dict[str, Any]]:  # pragma: no cover - needs network
    import datasets

    rows = datasets.load_dataset("hotpotqa/hotpot_qa", "distractor", split="validation")
    return [
        {
            "question": r["question"],
            "answer": r["answer"],
            "context": [[t, s] for t, s in zip(r["context"]["title"], r["context"]["sentences"])],
            "supporting_facts": [[t, i] for t, i in zip(r["supporting_facts"]["title"], r["supporting_facts"]["sent_id"])],
        }
        for r in rows
    ]


@lru_cache(maxsize=1)
def _wonderwords_lists() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    try:
        from wonderwords import random_word
    except ImportError as e:
        raise ImportError(
            "RULER tasks need the 'wonderwords' package for needle keys and word lists: pip install wonderwords"
        ) from e
    nouns = random_word._get_words_from_text_file("nounlist.txt")
    adjs = random_word._get_words_from_text_file("adjectivelist.txt")
    verbs = random_word._get_words_from_text_file("verblist.txt")
    return tuple(sorted(set(nouns))), tuple(sorted(set(adjs))), tuple(sorted(set(verbs)))


@lru_cache(maxsize=1)
def _cwe_words() -> tuple[str, ...]:
    nouns, adjs, verbs = _wonderwords_lists()
    return tuple(sorted(set(nouns) | set(adjs) | set(verbs)))


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[.!?][\"')\]])\s+")


def split_sentences(text: str) -> list[str]:
    """Split at whitespace that follows ``.``, ``!`` or ``?`` (optionally followed by a closing
    quote/bracket). A regex stand-in for NLTK's ``sent_tokenize`` (no model download)."""
    return [s for s in _SENTENCE_END.split(text.strip()) if s]


# --------------------------------------------------------------------------- samples


@dataclass(frozen=True)
class RulerSample:
    """One generated example. ``prompt`` = ``wrap_document(prefix, context, question)``."""

    task: str
    index: int
    max_seq_length: int
    prefix: str
    context: str
    question: str
    answer_prefix: str
    outputs: tuple[str, ...]
    length: int  # tokens(prompt + answer_prefix) + tokens_to_generate

    @property
    def prompt(self) -> str:
        return wrap_document(self.prefix, self.context, self.question)

    def to_doc(self) -> dict[str, Any]:
        """The lm-eval document (``input`` is the prompt, ``answer_prefix`` the generation prefix)."""
        return {
            "task": self.task,
            "index": self.index,
            "max_length": self.max_seq_length,
            "length": self.length,
            "input": self.prompt,
            "answer_prefix": self.answer_prefix,
            "outputs": list(self.outputs),
        }


@dataclass(frozen=True)
class _Parts:
    prefix: str
    context: str
    question: str
    answer_prefix: str
    outputs: tuple[str, ...]


Tokenizer = Callable[..., Any]


def _n_tokens(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer(text)["input_ids"])


def _largest_fitting(fits: Callable[[int], bool], lo: int, hi: int, hint: int | None) -> int | None:
    """Largest ``n`` in ``[lo, hi]`` with ``fits(n)``, for a ``fits`` that is True then False;
    ``None`` if ``fits(lo)`` is False. Galloping search from ``hint`` then bisection."""
    if hi < lo or not fits(lo):
        return None
    start = lo if hint is None else min(max(hint, lo), hi)
    if fits(start):
        good, step = start, max(1, start // 32)
        bad = None
        while good < hi:
            cand = min(hi, good + step)
            if fits(cand):
                good, step = cand, step * 2
            else:
                bad = cand
                break
        if bad is None:
            return good
    else:
        bad, step = start, max(1, start // 32)
        good = lo
        while True:
            cand = max(lo, bad - step)
            if cand == lo or fits(cand):
                good = cand
                break
            bad, step = cand, step * 2
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def _sample_rng(seed: int, task: str, max_seq_length: int, index: int) -> random.Random:
    return random.Random(f"ruler|{seed}|{task}|{max_seq_length}|{index}")


def _random_value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    if kind == "words":
        nouns, adjs, _ = _wonderwords_lists()
        return f"{rng.choice(adjs)}-{rng.choice(nouns)}"
    raise ValueError(f"unknown needle type {kind!r}; expected numbers, words or uuids")


def _distinct(rng: random.Random, kind: str, count: int, exclude: set[str]) -> list[str]:
    out: list[str] = []
    seen = set(exclude)
    while len(out) < count:
        value = _random_value(rng, kind)
        if value not in seen:
            seen.add(value)
            out.append(value)
    return out


def _singular(template: str) -> str:
    """RULER's rewrite of the NIAH template when a single value is asked for."""
    return (template.replace("Some", "A").replace("are all", "is").replace("are", "is")
            .replace("answers", "answer"))


class _Builder:
    """Per-sample plan: the random choices are fixed once; ``render(n)`` builds the sample with a
    haystack of ``n`` units (the haystack for ``n`` contains the one for ``n - 1``), for ``n`` in
    ``[lo, hi()]``."""

    lo: int = 1

    def hi(self) -> int:
        raise NotImplementedError

    def render(self, n: int) -> _Parts:
        raise NotImplementedError


class _NiahBuilder(_Builder):
    def __init__(self, spec: TaskSpec, rng: random.Random, data: RulerData, max_seq_length: int):
        a = spec.args
        self.kind = a["type_haystack"]
        self.type_k, self.type_v = a["type_needle_k"], a["type_needle_v"]
        num_q = a["num_needle_q"]
        num_k = max(a["num_needle_k"], num_q)
        num_v = a["num_needle_v"]
        keys = _distinct(rng, self.type_k, num_k, set())
        flat = _distinct(rng, self.type_v, num_k * num_v, set(keys))
        values = [flat[i * num_v:(i + 1) * num_v] for i in range(num_k)]
        self.needles = [
            NEEDLE.format(type_needle_v=self.type_v, key=k, value=v)
            for k, vs in zip(keys, values) for v in vs
        ]
        rng.shuffle(self.needles)
        if self.kind == "essay":
            self.words = data.essay_words()
            self.depths = rng.sample(DEPTHS, len(self.needles))  # distinct depths, as RULER
        elif self.kind in ("repeat", "needle"):
            self.fractions = [rng.random() for _ in self.needles]
        else:
            raise ValueError(f"unknown RULER haystack {self.kind!r}; expected essay, repeat or needle")
        self._distractor_rng = random.Random(rng.getrandbits(64))
        self._distractors: list[str] = []
        self._real_keys = set(keys)
        self.max_seq_length = max_seq_length

        chosen = rng.sample(range(num_k), num_q)
        queries = [keys[i] for i in chosen]
        self.outputs = tuple(v for i in chosen for v in values[i])
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        templates = (NIAH_PREFIX, NIAH_QUESTION, NIAH_ANSWER_PREFIX)
        type_v = self.type_v
        if num_q * num_v == 1:
            templates = tuple(_singular(t) for t in templates)
            type_v = type_v[:-1]
        self.prefix, self.question, self.answer_prefix = (
            t.format(type_needle_v=type_v, query=query) for t in templates
        )

    def hi(self) -> int:
        return len(self.words) if self.kind == "essay" else self.max_seq_length

    def _distractor_list(self, n: int) -> list[str]:
        while len(self._distractors) < n:
            key = _random_value(self._distractor_rng, self.type_k)
            if key in self._real_keys:
                continue
            value = _random_value(self._distractor_rng, self.type_v)
            self._distractors.append(NEEDLE.format(type_needle_v=self.type_v, key=key, value=value))
        return self._distractors[:n]

    def render(self, n: int) -> _Parts:
        if self.kind == "essay":
            sentences = split_sentences(" ".join(self.words[:n]))
            positions = sorted(int(len(sentences) * d / 100) for d in self.depths)
            pieces, last = [], 0
            for pos, needle in zip(positions, self.needles):
                chunk = " ".join(sentences[last:pos])
                if chunk:
                    pieces.append(chunk)
                pieces.append(needle)
                last = pos
            tail = " ".join(sentences[last:])
            if tail:
                pieces.append(tail)
            context = " ".join(pieces)
        else:
            sentences = [REPEAT_NOISE] * n if self.kind == "repeat" else list(self._distractor_list(n))
            order = sorted(zip((int(f * n) for f in self.fractions), range(len(self.needles))), reverse=True)
            for pos, i in order:
                sentences.insert(pos, self.needles[i])
            context = "\n".join(sentences)
        return _Parts(self.prefix, context, self.question, self.answer_prefix, self.outputs)


def _vt_chains(rng: random.Random, num_chains: int, num_hops: int, name_len: int) -> tuple[list[list[str]], list[list[str]]]:
    names = _distinct_names(rng, num_chains * (num_hops + 1), name_len)
    variables, chains = [], []
    for c in range(num_chains):
        these = names[c * (num_hops + 1):(c + 1) * (num_hops + 1)]
        chain = [f"VAR {these[0]} = {rng.randint(10000, 99998)}"]
        chain += [f"VAR {these[j + 1]} = VAR {these[j]} " for j in range(num_hops)]
        variables.append(these)
        chains.append(chain)
    return variables, chains


def _distinct_names(rng: random.Random, count: int, length: int) -> list[str]:
    out: list[str] = []
    while len(out) < count:
        name = "".join(rng.choices(string.ascii_uppercase, k=length))
        if name not in out:
            out.append(name)
    return out


class _VTBuilder(_Builder):
    """Variable tracking: ``num_chains`` chains of ``num_hops`` assignments hidden in noise."""

    def __init__(self, num_chains: int, num_hops: int, rng: random.Random, max_seq_length: int,
                 name_len: int = 5, head: str = ""):
        self.variables, self.chains = _vt_chains(rng, num_chains, num_hops, name_len)
        self.fractions = [[rng.random() for _ in chain] for chain in self.chains]
        self.max_seq_length = max_seq_length
        value = self.chains[0][0].split("=")[-1].strip()
        self.outputs = tuple(self.variables[0])
        self.prefix = head + VT_PREFIX
        self.question = VT_QUESTION.format(query=value)
        self.answer_prefix = VT_ANSWER_PREFIX.format(num_v=num_hops + 1, query=value)

    def hi(self) -> int:
        return self.max_seq_length

    def render(self, n: int) -> _Parts:
        sentences = [VT_NOISE] * n
        for chain, fracs in zip(self.chains, self.fractions):
            positions = sorted(int(f * len(sentences)) for f in fracs)
            for j, (pos, stmt) in enumerate(zip(positions, chain)):
                sentences.insert(pos + j, stmt)
        context = " ".join(sentences).replace(". \n", ".\n")
        return _Parts(self.prefix, context, self.question, self.answer_prefix, self.outputs)


class _CWEBuilder(_Builder):
    """Common words extraction: ``num_cw`` words repeated ``freq_cw`` times among words repeated
    ``freq_ucw`` times, as a numbered list; one solved example before the instruction."""

    def __init__(self, freq_cw: int, freq_ucw: int, num_cw: int, rng: random.Random, max_seq_length: int,
                 tag: str):
        words = _cwe_words()
        self.num_cw, self.tag = num_cw, tag
        if max_seq_length < 4096:  # RULER: shorter example and lower repeats below 4K
            ex_words, ex_cw, ex_ucw = 20, 3, 1
            self.freq_cw, self.freq_ucw = 6, 1
        else:
            ex_words, ex_cw, ex_ucw = 40, 10, 3
            self.freq_cw, self.freq_ucw = freq_cw, freq_ucw
        ex_context, ex_common = self._word_list(rng.sample(words, ex_words), ex_cw, ex_ucw, random.Random(f"{tag}|ex"))
        example = (CWE_PREFIX + ex_context + CWE_QUESTION + CWE_ANSWER_PREFIX + " "
                   + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_common)))
        self.order = rng.sample(words, len(words))
        self.lo = num_cw
        self.prefix = example + "\n" + CWE_PREFIX
        self.outputs = tuple(self.order[:num_cw])

    def _word_list(self, words: Sequence[str], rep_cw: int, rep_ucw: int, rng: random.Random) -> tuple[str, list[str]]:
        common, uncommon = list(words[: self.num_cw]), list(words[self.num_cw:])
        items = common * rep_cw + uncommon * rep_ucw
        rng.shuffle(items)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items)), common

    def hi(self) -> int:
        return len(self.order)

    def render(self, n: int) -> _Parts:
        context, _ = self._word_list(self.order[:n], self.freq_cw, self.freq_ucw, random.Random(f"{self.tag}|{n}"))
        return _Parts(self.prefix, context, CWE_QUESTION, CWE_ANSWER_PREFIX, self.outputs)


class _FWEBuilder(_Builder):
    """Frequent words extraction: coded words with Zipf(alpha) counts; '...' is the top-ranked noise."""

    def __init__(self, alpha: float, coded_wordlen: int, rng: random.Random, max_seq_length: int, tag: str):
        from scipy.special import zeta

        vocab_size = max_seq_length // 50  # RULER default (vocab_size = -1)
        if vocab_size < 5:
            raise ValueError(f"fwe: max_seq_length={max_seq_length} gives a vocabulary of {vocab_size} < 5 words")
        vocab: set[str] = set()
        while len(vocab) < vocab_size:
            vocab.add("".join(rng.choices(string.ascii_lowercase, k=coded_wordlen)))
        self.vocab = sorted(vocab)
        rng.shuffle(self.vocab)
        self.vocab[0] = "..."
        self.alpha, self.zeta, self.tag = alpha, float(zeta(alpha)), tag
        self.max_seq_length = max_seq_length
        self.outputs = tuple(self.vocab[1:4])
        # smallest n with strictly decreasing, positive counts for ranks 1..5 (well-defined top 3)
        self.lo = next(n for n in range(1, 10**6) if self._strict(self._counts(n)))

    def _counts(self, n: int) -> list[int]:
        return [int(n * (k ** -self.alpha) / self.zeta) for k in range(1, len(self.vocab) + 1)]

    @staticmethod
    def _strict(counts: list[int]) -> bool:
        head = counts[:5]
        return head[-1] >= 1 and all(a > b for a, b in zip(head, head[1:]))

    def hi(self) -> int:
        return 4 * self.max_seq_length

    def render(self, n: int) -> _Parts:
        words = [w for w, c in zip(self.vocab, self._counts(n)) for _ in range(c)]
        random.Random(f"{self.tag}|{n}").shuffle(words)
        return _Parts(FWE_PREFIX, " ".join(words), FWE_QUESTION, FWE_ANSWER_PREFIX, self.outputs)


class _QABuilder(_Builder):
    """QA: the gold paragraph(s) among distractors (same-article paragraphs first, then others)."""

    def __init__(self, qa: QAData, index: int, rng: random.Random, tag: str):
        if index >= len(qa.questions):
            raise ValueError(f"qa: sample index {index} >= {len(qa.questions)} available questions")
        q = qa.questions[index]
        gold, more = list(q["context"]), list(q["more_context"])
        rng.shuffle(more)
        taken = set(gold) | set(more)
        others = [i for i in range(len(qa.docs)) if i not in taken]
        rng.shuffle(others)
        self.order = gold + more + others
        self.docs, self.tag = qa.docs, tag
        self.lo = len(gold)
        self.question = QA_QUESTION.format(query=q["query"])
        self.outputs = tuple(q["outputs"])
        self.gold_docs = tuple(qa.docs[i] for i in gold)

    def hi(self) -> int:
        return len(self.order)

    def render(self, n: int) -> _Parts:
        chosen = [self.docs[i] for i in self.order[:n]]
        random.Random(f"{self.tag}|{n}").shuffle(chosen)
        context = "\n\n".join(QA_DOCUMENT.format(i=i + 1, document=d) for i, d in enumerate(chosen))
        return _Parts(QA_PREFIX, context, self.question, QA_ANSWER_PREFIX, self.outputs)


def _vt_example(spec: TaskSpec, rng: random.Random, tokenizer: Tokenizer) -> str:
    """RULER's in-context example for vt: 3-letter names, sized to ``VT_ICL_MAX_LENGTH`` tokens."""
    builder = _VTBuilder(spec.args["num_chains"], min(10, spec.args["num_hops"]), rng, VT_ICL_MAX_LENGTH, name_len=3)
    budget = VT_ICL_MAX_LENGTH - spec.tokens_to_generate

    def text(n: int) -> str:
        p = builder.render(n)
        return p.prefix + p.context + p.question + p.answer_prefix + " ".join(p.outputs)

    n = _largest_fitting(lambda k: _n_tokens(tokenizer, text(k)) <= budget, 1, VT_ICL_MAX_LENGTH, None)
    return text(n if n is not None else 1) + "\n\n"


def _make_builder(spec: TaskSpec, rng: random.Random, data: RulerData, tokenizer: Tokenizer,
                  max_seq_length: int, index: int, tag: str) -> _Builder:
    a = spec.args
    if spec.family == "niah":
        return _NiahBuilder(spec, rng, data, max_seq_length)
    if spec.family == "vt":
        head = _vt_example(spec, random.Random(rng.getrandbits(64)), tokenizer)
        return _VTBuilder(a["num_chains"], a["num_hops"], rng, max_seq_length, head=head)
    if spec.family == "cwe":
        return _CWEBuilder(a["freq_cw"], a["freq_ucw"], a["num_cw"], rng, max_seq_length, tag)
    if spec.family == "fwe":
        return _FWEBuilder(a["alpha"], a["coded_wordlen"], rng, max_seq_length, tag)
    if spec.family == "qa":
        return _QABuilder(data.qa(a["dataset"]), index, rng, tag)
    raise ValueError(f"unknown RULER family {spec.family!r}")


def generate_task(
    task: str,
    tokenizer: Tokenizer,
    max_seq_length: int,
    num_samples: int,
    seed: int = 42,
    data: RulerData | None = None,
) -> list[RulerSample]:
    """Generate ``num_samples`` samples of a RULER task sized to ``max_seq_length`` tokens.

    Args:
        task: one of :data:`TASKS`.
        tokenizer: callable ``tokenizer(text)`` returning a mapping with ``"input_ids"`` (a Hugging
            Face tokenizer); the length counted is that of the full prompt plus answer prefix.
        max_seq_length: token budget of prompt + answer prefix + ``tokens_to_generate``.
        num_samples: number of samples (>= 1).
        seed: base seed; the output is a deterministic function of all arguments.
        data: inputs (essays, SQuAD, HotpotQA) from :func:`load_ruler_data`.

    Raises:
        ValueError: unknown task, bad sizes, or a budget too small for even the smallest haystack.
    """
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; expected one of {sorted(TASKS)}")
    if isinstance(max_seq_length, bool) or not isinstance(max_seq_length, int) or max_seq_length <= 0:
        raise ValueError(f"max_seq_length must be a positive int, got {max_seq_length!r}")
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples <= 0:
        raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    spec = TASKS[task]
    if data is None:
        data = load_ruler_data(None)
    budget = max_seq_length - spec.tokens_to_generate
    samples, hint = [], None
    for index in range(num_samples):
        tag = f"ruler|{seed}|{task}|{max_seq_length}|{index}"
        builder = _make_builder(spec, _sample_rng(seed, task, max_seq_length, index), data, tokenizer,
                                max_seq_length, index, tag)
        lengths: dict[int, int] = {}

        def length_of(n: int, b: _Builder = builder, cache: dict[int, int] = lengths) -> int:
            if n not in cache:
                p = b.render(n)
                cache[n] = _n_tokens(tokenizer, wrap_document(p.prefix, p.context, p.question) + p.answer_prefix)
            return cache[n]

        n = _largest_fitting(lambda k: length_of(k) <= budget, builder.lo, builder.hi(), hint)
        if n is None:
            raise ValueError(
                f"RULER {task}: max_seq_length={max_seq_length} is too small: the smallest haystack "
                f"already needs {length_of(builder.lo) + spec.tokens_to_generate} tokens "
                f"(including {spec.tokens_to_generate} generated tokens)"
            )
        hint = n
        parts = builder.render(n)
        samples.append(RulerSample(
            task=task, index=index, max_seq_length=max_seq_length,
            prefix=parts.prefix, context=parts.context, question=parts.question,
            answer_prefix=parts.answer_prefix, outputs=parts.outputs,
            length=length_of(n) + spec.tokens_to_generate,
        ))
    return samples
