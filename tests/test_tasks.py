"""Tests of the lm-eval tasks in ``tasks/`` (QuALITY, RULER, LongBench): no model forward.

- every LongBench metric against hand-computed values (English and Chinese), official quirks
  included, and the official post-processing;
- the RULER generator: deterministic by seed, answers inside the document, RULER's answer prefixes,
  markers exactly once, lengths close to (and within) the target under the tokenizer;
- QuALITY parsing (gold indices checked by hand) and LongBench middle truncation (hand example);
- lm-eval 0.4.13 loads every task/group with ``TaskManager(include_path="tasks")``, beside its
  own ``ruler`` and ``longbench`` (no name is shared), builds the documents, and a full ``evaluate``
  with an oracle LM scores 1.0 (0.0 with an empty LM); the task names and the former names that
  stored results carry (``arckv_press.tasks.names``).

Tokenizer: the project's default (SmolLM2, via ``arckv_press.models.load_model``); if that cannot be
loaded here, a whitespace word tokenizer stands in (tests only; the tasks themselves never fall back).
"""

from __future__ import annotations

import collections
import difflib
import json
import os
import re
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

TASKS_DIR = Path(__file__).resolve().parents[1] / "tasks"
FIXTURES_LONGBENCH = Path(__file__).resolve().parent / "fixtures" / "longbench"


from arckv_press.tasks._common import doc_markers as markers  # noqa: E402
from arckv_press.tasks._common import resources  # noqa: E402
from arckv_press.tasks import names  # noqa: E402
from arckv_press.tasks.longbench import metrics as lb_metrics  # noqa: E402
from arckv_press.tasks.longbench import utils as lb_utils  # noqa: E402
from arckv_press.tasks.quality import utils as quality_utils  # noqa: E402
from arckv_press.tasks.ruler import generate  # noqa: E402
from arckv_press.tasks.ruler import utils as ruler_utils  # noqa: E402

SHARED = resources.SHARED_DATA_DIR
needs_shared_ruler = pytest.mark.skipif(not (SHARED / "ruler").is_dir(), reason="no shared RULER data")
needs_shared_quality = pytest.mark.skipif(
    not (SHARED / "quality" / "leval_quality.jsonl").is_file(), reason="no shared QuALITY data"
)
needs_shared_longbench = pytest.mark.skipif(not (SHARED / "longbench").is_dir(), reason="no shared LongBench data")


class WordTokenizer:
    """Stand-in tokenizer for the tests only: one token per whitespace-separated word, with offsets."""

    def __init__(self, bos: bool = False):
        self.bos = bos

    def __call__(self, text: str, add_special_tokens: bool = True, return_offsets_mapping: bool = False, **_: Any):
        spans = [m.span() for m in re.finditer(r"\S+", text)]
        ids = [hash(text[a:b]) % 50000 + 1 for a, b in spans]
        if self.bos and add_special_tokens:
            ids, spans = [0] + ids, [(0, 0)] + spans
        out = {"input_ids": ids}
        if return_offsets_mapping:
            out["offset_mapping"] = spans
        return out


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    try:
        return resources.load_tokenizer({})
    except (ImportError, OSError, ValueError) as e:  # no default model available here
        print(f"[test_tasks] default tokenizer unavailable ({e}); using the word-count stand-in")
        return WordTokenizer()


def _n_tokens(tok: Any, text: str) -> int:
    return len(tok(text)["input_ids"])


# --------------------------------------------------------------------------- document markers


def test_markers_wrap_locate_split():
    text = markers.wrap_document("Read this.\n\n", "the doc body", "\n\nQuestion: why?")
    assert text == "Read this.\n\n<document>\nthe doc body\n</document>\n\nQuestion: why?"
    start, end = markers.locate_document(text)
    assert text[start:end] == "the doc body"
    before, doc, after = markers.split_document(text)
    assert before + doc + after == text and doc == "the doc body"
    # a suffix that does not start with a newline is kept as is
    assert markers.wrap_document("", "d", "Q").endswith("\n</document>\nQ")
    # the document may quote the tags; the first start / last end rule still finds it
    quoting = markers.wrap_document("I: ", "a <document> b </document> c", " Q")
    assert markers.split_document(quoting)[1] == "a <document> b </document> c"


def test_markers_reject_tags_outside_the_document():
    with pytest.raises(ValueError, match="prefix"):
        markers.wrap_document("see <document>", "d", "q")
    with pytest.raises(ValueError, match="suffix"):
        markers.wrap_document("p", "d", "q </document>")
    with pytest.raises(TypeError, match="document"):
        markers.wrap_document("p", None, "q")
    with pytest.raises(ValueError, match="DOC_START"):
        markers.locate_document("no markers here")


# --------------------------------------------------------------------------- LongBench metrics


def test_normalizers():
    assert lb_metrics.normalize_answer("The  Cat, sat on A mat!") == "cat sat on mat"
    assert lb_metrics.normalize_zh_answer("厦门 大学。") == "厦门大学"
    # the official Chinese punctuation list has "》" but not "《"
    assert lb_metrics.normalize_zh_answer("《红楼梦》，Ok!") == "《红楼梦ok"


def test_qa_f1_score():
    # normalized: "cat sat" vs "cat sat down": P = 1, R = 2/3 -> F1 = 0.8
    assert lb_metrics.qa_f1_score("The cat sat.", "a cat sat down") == pytest.approx(0.8)
    assert lb_metrics.qa_f1_score("Paris", "London") == 0.0
    assert lb_metrics.qa_f1_score("Mara", "Mara") == 1.0
    # counts matter: pred "a a b" vs gold "a b b" -> common {a:1, b:1} = 2 -> P = R = 2/3
    assert lb_metrics.qa_f1_score("x x y", "x y y") == pytest.approx(2 / 3)


def test_qa_f1_zh_score():
    jieba = pytest.importorskip("jieba")
    assert list(jieba.cut("我爱北京天安门", cut_all=False)) == ["我", "爱", "北京", "天安门"]
    # [我, 爱, 北京, 天安门] vs [北京, 天安门]: P = 1/2, R = 1 -> F1 = 2/3
    assert lb_metrics.qa_f1_zh_score("我爱北京天安门", "北京天安门") == pytest.approx(2 / 3)
    # the trailing "。" is its own word, normalized to "" and dropped
    assert lb_metrics.qa_f1_zh_score("厦门大学。", "厦门大学") == 1.0
    assert lb_metrics.qa_f1_zh_score("上海", "北京") == 0.0


def test_rouge_score():
    pytest.importorskip("rouge")
    # LCS(police killed the gunman, police kill the gunman) = 3 of 4 words each side
    assert lb_metrics.rouge_score("police killed the gunman", "police kill the gunman") == pytest.approx(0.75, abs=1e-6)
    # LCS(a b c d e, a x c y e z) = a c e: P = 3/5, R = 3/6 -> F = 6/11
    assert lb_metrics.rouge_score("a b c d e", "a x c y e z") == pytest.approx(6 / 11, abs=1e-6)
    assert lb_metrics.rouge_score("", "anything") == 0.0  # the rouge package raises -> 0.0
    assert lb_metrics.rouge_score("Same words here", "Same words here") == pytest.approx(1.0, abs=1e-6)


def test_rouge_zh_score():
    pytest.importorskip("jieba")
    pytest.importorskip("rouge")
    # jieba words [我, 爱, 北京, 天安门] vs [北京, 天安门]: P = 1/2, R = 1 -> F = 2/3
    assert lb_metrics.rouge_zh_score("我爱北京天安门", "北京天安门") == pytest.approx(2 / 3, abs=1e-6)
    assert lb_metrics.rouge_zh_score("会议决定下个月发布", "会议决定下个月发布") == pytest.approx(1.0, abs=1e-6)
    assert lb_metrics.rouge_zh_score("", "会议") == 0.0


def test_classification_score():
    classes = ["City", "Country", "Individual"]
    assert lb_metrics.classification_score("City", "City", all_classes=classes) == 1.0
    assert lb_metrics.classification_score("City or Country", "City", all_classes=classes) == 0.5
    assert lb_metrics.classification_score("Individual", "City", all_classes=classes) == 0.0
    # official quirk: removing while iterating skips "B" after "A" is removed -> 1/2, not 1
    assert lb_metrics.classification_score("ABC", "ABC", all_classes=["A", "B", "ABC"]) == 0.5
    zh = ["财经", "科技", "体育"]
    assert lb_metrics.classification_score("体育", "体育", all_classes=zh) == 1.0
    assert lb_metrics.classification_score("财经和体育", "体育", all_classes=zh) == 0.5
    with pytest.raises(ValueError, match="all_classes"):
        lb_metrics.classification_score("x", "x", all_classes=None)


def test_retrieval_and_count_scores():
    assert lb_metrics.retrieval_score("Paragraph 2", "Paragraph 2") == 1.0
    assert lb_metrics.retrieval_score("Paragraph 2 or Paragraph 13", "Paragraph 2") == 0.5
    assert lb_metrics.retrieval_score("no idea", "Paragraph 2") == 0.0
    assert lb_metrics.retrieval_zh_score("段落3", "段落3") == 1.0
    assert lb_metrics.retrieval_zh_score("段落1和段落3", "段落3") == 0.5
    assert lb_metrics.count_score("There are 2 unique paragraphs.", "2") == 1.0
    assert lb_metrics.count_score("2 or 3", "2") == 0.5
    assert lb_metrics.count_score("many", "2") == 0.0
    with pytest.raises(ValueError, match="Paragraph N"):
        lb_metrics.retrieval_score("1", "first")


def test_code_sim_score():
    pytest.importorskip("fuzzywuzzy")
    # first line without a backquote, '#' or '//' after leading newlines
    assert lb_metrics.code_sim_score("\n# comment\n    return a * b\nx", "    return a * b") == 1.0
    # difflib ratio 2*M/T: "x = 1" vs "x = 2": M = 4, T = 10 -> 80 -> 0.8
    assert lb_metrics.code_sim_score("x = 1", "x = 2") == pytest.approx(0.8)
    for pred, gold in [("return foo(bar)", "return foo(baz, 1)"), ("self.x = y", "self.y = x + 1")]:
        expected = round(100 * difflib.SequenceMatcher(None, pred, gold).ratio()) / 100
        assert lb_metrics.code_sim_score(pred, gold) == pytest.approx(expected)
    assert lb_metrics.code_sim_score("// only comments", "x = 1") == 0.0


def test_score_prediction_postprocessing():
    classes = ["City", "Country", "Individual"]
    # trec keeps the first line only: "City" -> 1.0 (both lines would give 0.5)
    assert lb_metrics.score_prediction("trec", "\nCity\nCountry", ["City"], classes) == 1.0
    assert lb_metrics.classification_score("City\nCountry", "City", all_classes=classes) == 0.5
    # other datasets keep the whole prediction; max over the ground truths
    assert lb_metrics.score_prediction("narrativeqa", "Mara the girl", ["Tomas", "Mara, the girl"], None) == 1.0
    # "adam and more" vs "adam": P = 1/3, R = 1 -> F1 = 1/2
    assert lb_metrics.score_prediction("qasper", "Adam\nand more", ["Adam"], None) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="unknown LongBench dataset"):
        lb_metrics.score_prediction("nope", "x", ["x"], None)


# --------------------------------------------------------------------------- LongBench truncation


def test_middle_truncate_hand_example():
    text = "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10"
    tok = WordTokenizer()
    # 10 tokens, budget 4: keep the first 2 and the last 2 (official decode(first) + decode(last))
    assert lb_utils.middle_truncate(text, tok, 4) == "w1 w2w9 w10"
    assert lb_utils.middle_truncate(text, tok, 5) == "w1 w2w9 w10"  # half = int(5 / 2) = 2
    assert lb_utils.middle_truncate(text, tok, 10) == text
    # a BOS token counts in the budget and is dropped on decode: only w1 survives in front
    assert lb_utils.middle_truncate(text, WordTokenizer(bos=True), 4) == "w1w9 w10"
    with pytest.raises(ValueError, match="max_length"):
        lb_utils.middle_truncate(text, tok, 0)


def test_truncate_parts_matches_whole_prompt():
    tok = WordTokenizer()
    prefix, context, suffix = "Intro: ", "c1 c2 c3 c4 c5 c6", " Q: why?"
    whole = lb_utils.middle_truncate(prefix + context + suffix, tok, 4)
    p, c, s, cut = lb_utils.truncate_parts(prefix, context, suffix, tok, 4)
    assert (p, c, s, cut) == ("Intro: ", "c1", "Q: why?", True)
    assert p + c + s == whole
    # a budget smaller than instruction + question also cuts into them
    assert lb_utils.truncate_parts(prefix, context, suffix, tok, 2) == ("Intro:", "", "why?", True)
    assert lb_utils.truncate_parts(prefix, context, suffix, tok, 9) == (prefix, context, suffix, False)


def test_build_prompt_budget_includes_markers():
    tok = WordTokenizer()
    row = {"input": "who?", "context": " ".join(f"x{i}" for i in range(100))}
    prompt, truncated = lb_utils.build_prompt("Read.\n\n{context}\n\nQuestion: {input}\nAnswer:", row, tok, 20)
    assert truncated
    assert _n_tokens(tok, prompt) <= 20
    before, doc, after = markers.split_document(prompt)
    assert before == "Read.\n\n<document>\n" and after == "\n</document>\n\nQuestion: who?\nAnswer:"
    words = doc.split()
    assert words[:3] == ["x0", "x1", "x2"] and words[-1] == "x99"


# --------------------------------------------------------------------------- RULER generator

EXPECTED_ANSWER_PREFIX = {
    "niah_single_1": r"^ The special magic number for [\w-]+ mentioned in the provided text is$",
    "niah_single_2": r"^ The special magic number for [\w-]+ mentioned in the provided text is$",
    "niah_single_3": r"^ The special magic uuid for [\w-]+ mentioned in the provided text is$",
    "niah_multikey_1": r"^ The special magic number for [\w-]+ mentioned in the provided text is$",
    "niah_multikey_2": r"^ The special magic number for [\w-]+ mentioned in the provided text is$",
    "niah_multikey_3": r"^ The special magic uuid for [\w-]+ mentioned in the provided text is$",
    "niah_multivalue": r"^ The special magic numbers for [\w-]+ mentioned in the provided text are$",
    "niah_multiquery": r"^ The special magic numbers for [\w-]+, [\w-]+, [\w-]+, and [\w-]+ mentioned in the provided text are$",
    "vt": r"^ Answer: According to the chain\(s\) of variable assignment in the text above, 5 variables are assgined the value \d{5}, they are: $",
    "cwe": r"^ Answer: The top 10 words that appear most often in the list are:$",
    "fwe": r"^ Answer: According to the coded text above, the three most frequently appeared words are:$",
    "qa_1": r"^ Answer:$",
    "qa_2": r"^ Answer:$",
}
N_OUTPUTS = {"niah_multivalue": 4, "niah_multiquery": 4, "vt": 5, "cwe": 10, "fwe": 3}


@pytest.fixture(scope="module")
def ruler_data():
    if not (SHARED / "ruler").is_dir():
        pytest.skip("no shared RULER data")
    return generate.load_ruler_data(SHARED / "ruler")


@pytest.fixture(scope="module")
def ruler_4k(tokenizer, ruler_data):
    return {t: generate.generate_task(t, tokenizer, 4096, 2, seed=7, data=ruler_data) for t in generate.TASKS}


def test_ruler_task_table_matches_ruler():
    assert list(generate.TASKS) == list(EXPECTED_ANSWER_PREFIX)
    assert {t: s.tokens_to_generate for t, s in generate.TASKS.items()} == {
        **{t: 128 for t in generate.TASKS if t.startswith("niah")}, "vt": 30, "cwe": 120, "fwe": 50, "qa_1": 32, "qa_2": 32,
    }
    assert {t for t, s in generate.TASKS.items() if s.metric == "part"} == {"qa_1", "qa_2"}
    assert generate.DEPTHS[:4] == [0, 3, 5, 8] and generate.DEPTHS[-1] == 100 and len(generate.DEPTHS) == 40


def test_ruler_samples_structure(ruler_4k, tokenizer):
    for task, samples in ruler_4k.items():
        spec = generate.TASKS[task]
        for s in samples:
            prompt = s.prompt
            assert prompt.count("<document>") == 1 and prompt.count("</document>") == 1, task
            before, doc, after = markers.split_document(prompt)
            assert doc == s.context
            assert re.match(EXPECTED_ANSWER_PREFIX[task], s.answer_prefix), (task, s.answer_prefix)
            assert len(s.outputs) == N_OUTPUTS.get(task, 1) or task.startswith("qa"), task
            if task != "qa_2":  # HotpotQA answers (e.g. "yes") need not be spans of the text
                for answer in s.outputs:
                    assert answer in s.context, (task, answer)
            # length: recount independently; within the budget and close to it
            recount = _n_tokens(tokenizer, prompt + s.answer_prefix) + spec.tokens_to_generate
            assert recount == s.length <= 4096, task
            floor = 0.90 if spec.family == "qa" else 0.97
            assert s.length >= floor * 4096, (task, s.length)


def test_ruler_niah_needles(ruler_4k):
    for task in [t for t in generate.TASKS if t.startswith("niah")]:
        for s in ruler_4k[task]:
            for value in s.outputs:
                needle = re.findall(r"One of the special magic \w+ for ([\w-]+) is: " + re.escape(value) + r"\.", s.context)
                assert len(needle) == 1, (task, value)  # inserted once
                assert needle[0] in s.question and needle[0] in s.answer_prefix
            if task == "niah_multikey_2":  # haystack of distractor needles with other keys
                keys = re.findall(r"One of the special magic numbers for ([\w-]+) is", s.context)
                assert len(keys) > 50 and keys.count(needle[0]) == 1


def test_ruler_aggregation_tasks_have_correct_answers(ruler_4k):
    for s in ruler_4k["cwe"]:
        words = re.findall(r"\d+\. (\S+)", s.context)
        counts = collections.Counter(words)
        top = sorted(counts, key=lambda w: -counts[w])[:10]
        assert set(top) == set(s.outputs) and min(counts[w] for w in s.outputs) == 30
        assert max(c for w, c in counts.items() if w not in s.outputs) == 3
        assert re.fullmatch(r"\d+\. \S+( \d+\. \S+)*", s.context)
    for s in ruler_4k["fwe"]:
        counts = collections.Counter(s.context.split())
        ranked = [w for w, _ in counts.most_common() if w != "..."]
        assert tuple(ranked[:3]) == s.outputs and counts["..."] > counts[s.outputs[0]]
        assert counts[s.outputs[2]] > counts[ranked[3]]
    for s in ruler_4k["vt"]:
        value = re.search(r"assigned the value (\d+)", s.question).group(1)
        assert s.context.count(f" = {value}") == 1 and f"VAR {s.outputs[0]} = {value}" in s.context
        for a, b in zip(s.outputs, s.outputs[1:]):  # the chain, hop by hop
            assert s.context.count(f"VAR {b} = VAR {a} ") == 1
        assert len(re.findall(r"VAR \w+ = ", s.context)) == 5  # one chain of 4 hops, nothing else
        # the solved in-context example comes before the instruction, outside the document
        assert s.prefix.count("Memorize and track") == 2 and s.prefix.count(" = ") == 5


def test_ruler_qa_gold_documents(ruler_4k, ruler_data):
    for task, dataset in (("qa_1", "squad"), ("qa_2", "hotpotqa")):
        qa = ruler_data.qa(dataset)
        for s in ruler_4k[task]:
            q = qa.questions[s.index]
            assert s.question.endswith("Question: " + q["query"])
            for i in q["context"]:
                assert qa.docs[i] in s.context
            assert re.match(r"Document 1:\n", s.context)


def test_ruler_deterministic_by_seed(tokenizer, ruler_data):
    for task in ("niah_multikey_1", "vt", "qa_2"):
        a = generate.generate_task(task, tokenizer, 1024, 2, seed=3, data=ruler_data)
        b = generate.generate_task(task, tokenizer, 1024, 2, seed=3, data=ruler_data)
        c = generate.generate_task(task, tokenizer, 1024, 2, seed=4, data=ruler_data)
        assert [x.to_doc() for x in a] == [x.to_doc() for x in b]
        assert [x.prompt for x in a] != [x.prompt for x in c]
        assert a[0].prompt != a[1].prompt


def test_ruler_bad_arguments(tokenizer, ruler_data):
    with pytest.raises(ValueError, match="unknown RULER task"):
        generate.generate_task("niah_single_9", tokenizer, 4096, 1, data=ruler_data)
    with pytest.raises(ValueError, match="max_seq_length"):
        generate.generate_task("vt", tokenizer, 0, 1, data=ruler_data)
    with pytest.raises(ValueError, match="too small"):
        generate.generate_task("niah_single_2", tokenizer, 150, 1, data=ruler_data)


def test_ruler_string_match():
    assert generate.string_match_all("the values are 123 and 456", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert generate.string_match_all("ABC-def", ["abc-DEF"]) == 1.0
    assert generate.string_match_part("France", ["France", "the French"]) == 1.0
    assert generate.string_match_part("Spain", ["France", "the French"]) == 0.0
    assert generate.postprocess_prediction("  12\x00 34\n") == "12\n 34"
    assert ruler_utils.aggregate_length([1.0, -1.0, 0.0, -1.0]) == 0.5
    assert ruler_utils.aggregate_length([-1.0]) == -1.0


# --------------------------------------------------------------------------- QuALITY


def test_quality_parse_question_and_gold():
    text = "Why?\n\n (A) one \n (B) two\n (C) three  \n (D) four (really)"
    stem, options = quality_utils.parse_question(text)
    assert stem == "Why?" and options == ["one", "two", "three", "four (really)"]
    assert quality_utils.gold_index("(C) three", options) == 2
    with pytest.raises(ValueError, match="does not match"):
        quality_utils.gold_index("(C) two", options)
    with pytest.raises(ValueError, match=r"\(A\)\.\.\(D\)"):
        quality_utils.parse_question("Why?\n (A) one\n (B) two")
    assert quality_utils.predicted_letter(" (B) two") == "B"
    assert quality_utils.predicted_letter("C.") == "C"
    assert quality_utils.predicted_letter("Answer: B") is None


@needs_shared_quality
def test_quality_shared_file_gold_indices():
    with open(SHARED / "quality" / "leval_quality.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    docs = quality_utils.parse_leval_records(records)
    assert len(docs) == 130
    by_id = {d["doc_id"]: d for d in docs}
    # checked by hand against the file
    assert by_id["quality-a0-q0"]["gold"] == 1 and by_id["quality-a0-q0"]["options"][1].startswith("Their subconscious")
    assert by_id["quality-a0-q1"]["gold"] == 0 and "drug hypnosis" in by_id["quality-a0-q1"]["options"][0]
    assert by_id["quality-a1-q0"]["gold"] == 2 and by_id["quality-a1-q0"]["question"].startswith("Why did people say")
    assert by_id["quality-a1-q2"]["gold"] == 0 and by_id["quality-a1-q2"]["options"][0].startswith("They suspected it but did not want")
    # questions of one article are consecutive, in file order
    article_ids = [d["article_id"] for d in docs]
    assert article_ids == sorted(article_ids)
    for a in set(article_ids):
        assert [d["question_id"] for d in docs if d["article_id"] == a] == list(range(article_ids.count(a)))
    text = quality_utils.doc_to_text(docs[0])
    assert text.count("<document>") == 1 and text.endswith("(D) " + docs[0]["options"][3] + "\nAnswer:")


# --------------------------------------------------------------------------- lm-eval integration


@pytest.fixture(scope="module")
def task_manager():
    """``TaskManager(include_path=tasks/)`` beside lm-eval's own ``ruler`` and ``longbench`` folders,
    the built-ins closest to our tasks (indexing only those two keeps the test fast: the full
    built-in index takes 15 s or more; a default TaskManager is tested in tests/test_lm_eval.py)."""
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    builtin = Path(lm_eval.tasks.__file__).parent
    return TaskManager(
        include_defaults=False,
        include_path=[str(builtin / "ruler"), str(builtin / "longbench"), str(TASKS_DIR)],
        metadata={"max_seq_lengths": [1024], "num_samples": 2, "max_length": 2000},
    )


@pytest.fixture
def use_tokenizer(monkeypatch, tokenizer):
    """The tasks get the module's tokenizer (the real one unless it is unavailable here)."""
    monkeypatch.setattr(resources, "load_tokenizer", lambda metadata: tokenizer)
    monkeypatch.setenv(resources.LONGBENCH_ENV, str(FIXTURES_LONGBENCH))


class OracleLM:
    """An lm-eval LM that answers every request correctly (or emptily), checking the prompt contract."""

    def __new__(cls, empty: bool = False):
        from lm_eval.api.model import LM

        class _Oracle(LM):
            def loglikelihood(self, requests, disable_tqdm=False):
                out = []
                for r in requests:
                    context, continuation = r.args
                    markers.split_document(context)
                    gold = r.doc["options"][r.doc["gold"]]
                    is_gold = continuation.strip() == gold.strip()
                    out.append((0.0 if is_gold != empty else -1.0, False))  # empty: gold ranks last
                return out

            def generate_until(self, requests, disable_tqdm=False):
                out = []
                for r in requests:
                    context, _ = r.args
                    assert context.count("<document>") == 1 and context.count("</document>") == 1
                    doc = r.doc
                    if "outputs" in doc:  # RULER: the answer prefix ends the context
                        assert context.endswith(doc["answer_prefix"])
                        answer = " " + ", ".join(doc["outputs"])
                    elif "answers" in doc:
                        answer = doc["answers"][0]
                    else:
                        answer = " " + doc["gold_letter"]
                    out.append("" if empty else answer)
                return out

            def loglikelihood_rolling(self, requests, disable_tqdm=False):
                raise NotImplementedError

        return _Oracle()


def _our_index():
    from lm_eval.tasks._index import TaskIndex

    return TaskIndex.build([TASKS_DIR])


def test_every_name_is_the_packages_own():
    """Every task, group and tag of ours is ``arckv_*``, except QuALITY's two tasks, which lm-eval
    0.4.13 does not define (whether a name also exists among the built-ins: tests/test_lm_eval.py)."""
    ours = set(_our_index())
    assert {n for n in ours if not n.startswith(names.PREFIX)} == {"quality", "quality_gen"}
    assert {names.RULER_GROUP, names.LONGBENCH_GROUP} <= ours
    assert {names.ruler_task(t) for t in generate.TASKS} | {names.longbench_task(d) for d in lb_metrics.DATASET2METRIC} <= ours


def test_lm_evals_own_ruler_and_longbench_stay_beside_ours(task_manager):
    import lm_eval.tasks

    builtin = Path(lm_eval.tasks.__file__).parent
    index = task_manager.task_index
    for name in ("ruler", "niah_single_1", "longbench", "longbench_qasper"):
        assert Path(index[name].yaml_path).is_relative_to(builtin), name
    for name in ("arckv_ruler", "arckv_niah_single_1", "arckv_longbench", "arckv_longbench_qasper", "quality"):
        assert Path(index[name].yaml_path).is_relative_to(TASKS_DIR), name


def test_former_task_names_map_to_todays():
    ours = set(_our_index())
    assert names.current_task_name("ruler") == "arckv_ruler" and names.current_task_name("longbench") == "arckv_longbench"
    assert names.current_task_name("niah_single_1") == "arckv_niah_single_1" == names.ruler_task("niah_single_1")
    assert names.current_task_name("qa_2") == "arckv_qa_2"
    assert names.current_task_name("longbench_repobench-p") == "arckv_longbench_repobench-p"
    for current in ours:  # today's names, and names that are not the package's, are left alone
        assert names.current_task_name(current) == current
    for other in ("mmlu", "longbench_nope", "ruler_cwe", "niah"):
        assert names.current_task_name(other) == other
    with pytest.raises(ValueError, match="unknown RULER task 'niah_single_9'"):
        names.ruler_task("niah_single_9")
    with pytest.raises(ValueError, match="unknown LongBench dataset 'nope'"):
        names.longbench_task("nope")


def test_every_stored_result_names_a_task_of_today():
    """Each task of every lm-eval results file under leaderboards/ (most stored before the rename)
    is, through current_task_name, a task or group of ours."""
    stored = sorted((TASKS_DIR.parent / "leaderboards").rglob("results.json"))
    if not stored:
        pytest.skip("no stored lm-eval results in this checkout")
    ours = set(_our_index())
    unknown = {}
    for path in stored:
        data = json.loads(path.read_text(encoding="utf-8"))
        for task in [*data.get("results", {}), *data.get("group_subtasks", {})]:
            if names.current_task_name(task) not in ours:
                unknown.setdefault(task, path)
    assert not unknown, unknown


@needs_shared_quality
@needs_shared_ruler
def test_lm_eval_loads_all_tasks(task_manager, use_tokenizer):
    loaded = task_manager.load(["quality", "quality_gen", "arckv_ruler", "arckv_longbench"])
    tasks, groups = loaded["tasks"], loaded["groups"]
    assert set(groups) == {"arckv_ruler", "arckv_longbench"}
    ruler_names = {f"arckv_{t}" for t in generate.TASKS}
    longbench_names = {f"arckv_longbench_{t}" for t in lb_metrics.DATASET2METRIC}
    assert set(tasks) == {"quality", "quality_gen"} | ruler_names | longbench_names
    assert all(str(TASKS_DIR) in t.config.metadata["config_source"] for t in tasks.values())
    # the renamed tasks carry version 2 (their names changed), QuALITY's stay at 1
    assert {name: t.VERSION for name, t in tasks.items()} == {
        **dict.fromkeys(ruler_names | longbench_names, 2.0), "quality": 1.0, "quality_gen": 1.0}
    assert {name: float(g.version) for name, g in groups.items()} == {"arckv_ruler": 2.0, "arckv_longbench": 2.0}
    for name, task in tasks.items():
        docs = list(task.test_docs())
        assert docs, name
        text = task.doc_to_text(docs[0])
        assert text.count("<document>") == 1 and text.count("</document>") == 1, name
        if name in ruler_names:
            assert len(docs) == 2 and docs[0]["max_length"] == 1024 and docs[0]["length"] <= 1024
            assert task.doc_to_prefix(docs[0]) == docs[0]["answer_prefix"]
            assert task.config.generation_kwargs["max_gen_toks"] == generate.TASKS[docs[0]["task"]].tokens_to_generate
            assert name == names.ruler_task(docs[0]["task"])
        if name in longbench_names:
            assert docs[0]["answers"] and name == names.longbench_task(docs[0]["dataset"])
    assert len(list(tasks["quality"].test_docs())) == 130


@needs_shared_quality
@needs_shared_ruler
@pytest.mark.parametrize("empty", [False, True])
def test_lm_eval_evaluate_with_oracle(task_manager, use_tokenizer, empty):
    from lm_eval.evaluator import evaluate

    loaded = task_manager.load(["quality", "quality_gen", "arckv_ruler", "arckv_longbench"])
    results = evaluate(OracleLM(empty=empty), loaded, limit=2, bootstrap_iters=0, log_samples=False)["results"]
    expected = 0.0 if empty else 1.0
    assert results["quality"]["acc,none"] == expected
    assert results["quality_gen"]["exact_match,none"] == expected
    assert results["arckv_ruler"]["score,none"] == pytest.approx(expected)
    assert results["arckv_ruler"]["1024,none"] == pytest.approx(expected)
    assert results["arckv_ruler"]["4096,none"] == -1.0
    assert results["arckv_niah_multivalue"]["score,none"] == pytest.approx(expected)
    assert results["arckv_longbench"]["score,none"] == pytest.approx(expected, abs=1e-6)
    assert results["arckv_longbench_lcc"]["score,none"] == pytest.approx(expected)


def test_longbench_yaml_copies_match_official_config():
    from lm_eval.tasks._yaml_loader import load_yaml

    config = SHARED / "longbench" / "config"
    if not config.is_dir():
        pytest.skip("no shared LongBench config")
    prompts = json.loads((config / "dataset2prompt.json").read_text(encoding="utf-8"))
    maxlen = json.loads((config / "dataset2maxlen.json").read_text(encoding="utf-8"))
    metric = json.loads((config / "dataset2metric.json").read_text(encoding="utf-8"))
    assert set(prompts) == set(lb_metrics.DATASET2METRIC)
    for name in prompts:
        cfg = load_yaml(TASKS_DIR / "longbench" / f"{name}.yaml", resolve_func=False)
        assert cfg["dataset_kwargs"]["official_prompt"] == prompts[name], name
        assert cfg["dataset_kwargs"]["official_max_gen_toks"] == maxlen[name] == cfg["generation_kwargs"]["max_gen_toks"]
        assert lb_metrics.DATASET2METRIC[name].__name__ == metric[name]


@needs_shared_longbench
def test_longbench_local_chinese_task_truncated(monkeypatch, tokenizer):
    monkeypatch.delenv(resources.LONGBENCH_ENV, raising=False)
    monkeypatch.setattr(resources, "load_tokenizer", lambda metadata: tokenizer)
    prompts = json.loads((SHARED / "longbench" / "config" / "dataset2prompt.json").read_text(encoding="utf-8"))
    template = prompts["passage_retrieval_zh"]
    with open(SHARED / "longbench" / "data" / "passage_retrieval_zh.jsonl", encoding="utf-8") as f:
        first = json.loads(f.readline())
    full = _n_tokens(tokenizer, template.format(context=first["context"], input=first["input"]))
    budget = full // 2
    ds = lb_utils.load_longbench(
        longbench_dataset="passage_retrieval_zh", official_prompt=template, official_max_gen_toks=32, max_length=budget,
    )["test"]
    assert len(ds) == 200 and ds[0]["truncated"]
    for doc in ds.select(range(20)):
        assert _n_tokens(tokenizer, doc["prompt"]) <= budget + 2  # +2: merges at the cut and the markers
    doc = ds[0]
    before, context, after = markers.split_document(doc["prompt"])
    assert before.startswith("以下是若干段落文字") and context.startswith("段落1：")
    assert first["context"].startswith(context[: len(context) // 3])
    assert after.endswith("答案是：") and re.fullmatch(r"段落\d+", doc["answers"][0])
    with pytest.raises(ValueError, match="max_gen_toks|generated tokens"):
        lb_utils.load_longbench(longbench_dataset="passage_retrieval_zh", official_prompt=template,
                                official_max_gen_toks=64, max_length=budget)
