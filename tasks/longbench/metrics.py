"""LongBench v1 metrics, re-implemented from THUDM/LongBench ``LongBench/metrics.py`` and ``eval.py``.

Behaviour is kept identical to the official code, quirks included:

- ``classification_score`` removes items from the list it iterates over (so a partial match that
  directly follows another removed one survives), exactly as the official loop does;
- ``code_sim_score`` keeps the first line (after leading newlines) without a backquote, ``#`` or
  ``//`` and scores it with ``fuzzywuzzy.fuzz.ratio`` / 100. fuzzywuzzy without
  ``python-Levenshtein`` (the official requirements) uses ``difflib.SequenceMatcher``; with
  ``python-Levenshtein`` installed it switches to Levenshtein ratios and scores shift slightly;
- ``rouge_score`` is the ROUGE-L F of the ``rouge`` package (``Rouge().get_scores``), 0.0 when that
  package raises (e.g. empty hypothesis);
- the Chinese metrics segment with ``jieba`` (precise mode).

:func:`score_prediction` applies the official post-processing of ``eval.py``: first line only for
trec/triviaqa/samsum/lsht, maximum over the ground truths. Scores are in [0, 1] (the official
tables multiply by 100).

Packages: ``rouge``, ``jieba``, ``fuzzywuzzy`` (imported lazily, with an install hint).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

__all__ = [
    "DATASET2METRIC",
    "FIRST_LINE_DATASETS",
    "classification_score",
    "code_sim_score",
    "count_score",
    "normalize_answer",
    "normalize_zh_answer",
    "qa_f1_score",
    "qa_f1_zh_score",
    "retrieval_score",
    "retrieval_zh_score",
    "rouge_score",
    "rouge_zh_score",
    "score_prediction",
]

CN_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟"
    "〰〾〿–—‘’‛“”„‟…‧﹏."
)
FIRST_LINE_DATASETS = frozenset({"trec", "triviaqa", "samsum", "lsht"})


def _require(module: str) -> Any:
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as e:
        raise ImportError(
            f"LongBench metrics need the '{module}' package (official LongBench requirements): "
            "pip install rouge jieba fuzzywuzzy"
        ) from e


def _jieba_cut(text: str) -> list[str]:
    jieba = _require("jieba")
    return list(jieba.cut(text, cut_all=False))


@lru_cache(maxsize=1)
def _rouge() -> Any:
    return _require("rouge").Rouge()


def normalize_answer(s: str) -> str:
    """Lower case, remove ASCII punctuation, articles (a/an/the) and extra whitespace (SQuAD style)."""
    s = s.lower()
    exclude = set(string.punctuation)
    s = "".join(ch for ch in s if ch not in exclude)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def normalize_zh_answer(s: str) -> str:
    """Lower case, remove ASCII and Chinese punctuation and all whitespace."""
    s = s.lower()
    punctuation = set(string.punctuation + CN_PUNCTUATION)
    s = "".join(ch for ch in s if ch not in punctuation)
    return "".join(s.split())


def _f1(prediction: Sequence[str], ground_truth: Sequence[str]) -> float:
    common = Counter(prediction) & Counter(ground_truth)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction)
    recall = num_same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Token F1 after :func:`normalize_answer` (whitespace tokens)."""
    return _f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Token F1 over jieba words, each normalized by :func:`normalize_zh_answer` (empty dropped)."""
    pred = [t for t in (normalize_zh_answer(w) for w in _jieba_cut(prediction)) if t]
    gold = [t for t in (normalize_zh_answer(w) for w in _jieba_cut(ground_truth)) if t]
    return _f1(pred, gold)


def rouge_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """ROUGE-L F of the ``rouge`` package; 0.0 when it raises (empty or punctuation-only text)."""
    try:
        scores = _rouge().get_scores([prediction], [ground_truth], avg=True)
    except Exception:  # noqa: BLE001 - the official code returns 0.0 on any failure
        return 0.0
    return float(scores["rouge-l"]["f"])


def rouge_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """:func:`rouge_score` on jieba words joined by spaces."""
    return rouge_score(" ".join(_jieba_cut(prediction)), " ".join(_jieba_cut(ground_truth)))


def classification_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """1/k if the gold class is among the k class names found in the prediction (after dropping
    names that are strict substrings of the gold), else 0. Needs ``all_classes``."""
    all_classes = kwargs.get("all_classes")
    if not all_classes:
        raise ValueError("classification_score needs a non-empty all_classes list")
    matches = [c for c in all_classes if c in prediction]
    for term in matches:  # official quirk: removes from the list being iterated
        if term in ground_truth and term != ground_truth:
            matches.remove(term)
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _number_match(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(1 for n in numbers if n == target) / len(numbers)


def count_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Fraction of the numbers in the prediction equal to the gold count."""
    return _number_match(prediction, str(ground_truth))


def retrieval_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Fraction of the numbers in the prediction equal to N of the gold ``"Paragraph N"``."""
    found = re.findall(r"Paragraph (\d+)", ground_truth)
    if not found:
        raise ValueError(f"retrieval_score: ground truth {ground_truth!r} has no 'Paragraph N'")
    return _number_match(prediction, found[0])


def retrieval_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Fraction of the numbers in the prediction equal to N of the gold ``"段落N"``."""
    found = re.findall(r"段落(\d+)", ground_truth)
    if not found:
        raise ValueError(f"retrieval_zh_score: ground truth {ground_truth!r} has no '段落N'")
    return _number_match(prediction, found[0])


def code_sim_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """``fuzz.ratio`` / 100 between the first code line of the prediction and the gold line."""
    fuzz = _require("fuzzywuzzy.fuzz")
    line = ""
    for candidate in prediction.lstrip("\n").split("\n"):
        if "`" not in candidate and "#" not in candidate and "//" not in candidate:
            line = candidate
            break
    return fuzz.ratio(line, ground_truth) / 100


# LongBench/eval.py dataset2metric
DATASET2METRIC: dict[str, Callable[..., float]] = {
    "narrativeqa": qa_f1_score,
    "qasper": qa_f1_score,
    "multifieldqa_en": qa_f1_score,
    "multifieldqa_zh": qa_f1_zh_score,
    "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score,
    "musique": qa_f1_score,
    "dureader": rouge_zh_score,
    "gov_report": rouge_score,
    "qmsum": rouge_score,
    "multi_news": rouge_score,
    "vcsum": rouge_zh_score,
    "trec": classification_score,
    "triviaqa": qa_f1_score,
    "samsum": rouge_score,
    "lsht": classification_score,
    "passage_retrieval_en": retrieval_score,
    "passage_count": count_score,
    "passage_retrieval_zh": retrieval_zh_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}


def score_prediction(dataset: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None) -> float:
    """Official per-sample score (``LongBench/eval.py`` ``scorer``): first line only for
    trec/triviaqa/samsum/lsht, then the maximum of the dataset's metric over the ground truths."""
    if dataset not in DATASET2METRIC:
        raise ValueError(f"unknown LongBench dataset {dataset!r}; expected one of {sorted(DATASET2METRIC)}")
    if isinstance(answers, str) or not answers:
        raise ValueError(f"{dataset}: answers must be a non-empty list of strings, got {answers!r}")
    if dataset in FIRST_LINE_DATASETS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = DATASET2METRIC[dataset]
    score = 0.0
    for ground_truth in answers:
        score = max(score, metric(prediction, ground_truth, all_classes=all_classes))
    return float(score)
