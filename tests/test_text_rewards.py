"""Text rewards and metrics: golden values computed by hand from the published formulas."""

from __future__ import annotations

import math
import textwrap
from collections import Counter
from types import SimpleNamespace

import pytest

from stages.errors import UserInputError
from stages.score import registry, text_answers
from stages.score.registry import get_reward, register_reward, reward_kind
from stages.score.scoring import score_batch
from stages.score.text_answers import extract_answer, last_boxed, math_equal
from stages.score.text_metrics import (
    align_exact,
    bleu_score,
    count_chunks,
    lcs_length,
    meteor_score,
    rouge_l_score,
    tokenize,
)
from stages.score.text_rewards import (
    accuracy,
    bleu,
    format_boxed,
    format_think_answer,
    length_penalty,
    meteor,
    repetition_penalty,
    rouge_l,
    rouge_l_recall,
    text_similarity,
    trl_reward,
    verl_compute_score,
)


@pytest.fixture
def scratch_registry(monkeypatch):
    """A private copy of the registry (names, kinds, plugins) so test scorers do not leak."""
    registry.available_rewards()
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_KINDS", dict(registry._KINDS))
    monkeypatch.setattr(registry, "_PLUGINS", {})


def one(scorer, response, **meta):
    """Score a single response with meta keys given as keywords."""
    return scorer([response], ["prompt"], [meta])[0]


# --- metrics ---------------------------------------------------------------------------------------

CAND = tokenize("The cat sat on a mat. It was.")
REF = tokenize("The cat sat on the mat. It was happy.")


def test_tokenize_lowercases_and_drops_punctuation():
    assert CAND == ["the", "cat", "sat", "on", "a", "mat", "it", "was"]
    assert tokenize("Größe: 3,5 m!") == ["größe", "3", "5", "m"]


def test_bleu_two_sentences_by_hand():
    # c = 8, r = 9 → BP = exp(1 − 9/8). Unigrams: 7 of 8 match ("a" does not).
    # Bigrams: the-cat, cat-sat, sat-on, mat-it, it-was match; on-a, a-mat do not → 5/7.
    # Trigrams: the-cat-sat, cat-sat-on, mat-it-was → 3/6. 4-grams: the-cat-sat-on → 1/5.
    bp = math.exp(1 - 9 / 8)
    assert bleu_score(CAND, [REF], max_n=2) == pytest.approx(bp * math.sqrt(7 / 8 * 5 / 7), rel=1e-12)
    # (7/8 · 5/7 · 3/6 · 1/5)^(1/4) = (1/16)^(1/4) = 1/2
    assert bleu_score(CAND, [REF]) == pytest.approx(bp * 0.5, rel=1e-12)


def test_bleu_clipping_reference_choice_and_zero():
    the4 = ["the"] * 4
    # "the" appears twice in the reference: clipped precision 2/4; c = 4 < r = 5.
    assert bleu_score(the4, [tokenize("the cat on the mat")], max_n=1) == pytest.approx(
        0.5 * math.exp(1 - 5 / 4)
    )
    # two references of lengths 3 and 5 are equally close to c = 4: the shorter wins, so BP = 1
    refs = [["the", "x", "y"], ["the", "the", "a", "b", "c"]]
    assert bleu_score(the4, refs, max_n=1) == pytest.approx(0.5)
    assert bleu_score(["a", "b"], [["b", "a"]], max_n=2) == 0.0  # no shared bigram, no smoothing
    assert bleu_score(["a"], [["a"]], max_n=2) == 0.0  # no bigram at all
    assert bleu_score([], [["a"]]) == 0.0


def test_lcs_and_rouge_l_by_hand():
    assert lcs_length(list("ABCBDAB"), list("BDCABA")) == 4
    ref = tokenize("police killed the gunman")
    # LCS "police the gunman" = 3 of 4 on both sides
    assert rouge_l_score(tokenize("police kill the gunman"), ref) == pytest.approx((0.75, 0.75, 0.75))
    # LCS "the gunman" = 2
    assert rouge_l_score(tokenize("the gunman kill police"), ref).f == pytest.approx(0.5)
    cand, ref2 = tokenize("the cat was found under the bed"), tokenize("the cat was under the bed")
    # LCS 6: P = 6/7, R = 1; F1 = 2PR/(P+R) = 12/13; F_2 = 5PR/(R+4P) = 30/31
    assert rouge_l_score(cand, ref2) == pytest.approx((6 / 7, 1.0, 12 / 13))
    assert rouge_l_score(cand, ref2, beta=2.0).f == pytest.approx(30 / 31)
    assert rouge_l_score(["x"], ref2) == (0.0, 0.0, 0.0)


def test_meteor_exact_formula_by_hand():
    cand = tokenize("the cat was sitting on the mat")
    ref = tokenize("the cat sat on the mat")
    # aligned: "on the mat" (cand 4-6 → ref 3-5), then "the cat" (0-1 → 0-1): m = 5, 2 chunks
    alignment = align_exact(cand, ref)
    assert alignment == [(0, 0), (1, 1), (4, 3), (5, 4), (6, 5)]
    assert count_chunks(alignment) == 2
    p, r = 5 / 7, 5 / 6
    f_mean = 10 * p * r / (r + 9 * p)  # = 50/61
    assert f_mean == pytest.approx(50 / 61)
    assert meteor_score(cand, ref) == pytest.approx(f_mean * (1 - 0.5 * (2 / 5) ** 3), rel=1e-12)


def test_meteor_fragmentation_of_a_permutation():
    # all 6 words match in 2 chunks ("on the mat" | "the cat sat"): penalty 0.5·(2/6)^3 = 1/54
    cand, ref = tokenize("on the mat the cat sat"), tokenize("the cat sat on the mat")
    assert align_exact(cand, ref) == [(0, 3), (1, 4), (2, 5), (3, 0), (4, 1), (5, 2)]
    assert meteor_score(cand, ref) == pytest.approx(53 / 54)
    assert meteor_score(ref, ref) == pytest.approx(1 - 0.5 / 6**3)  # one chunk of 6
    assert meteor_score(["x"], ref) == 0.0


def test_alignment_keeps_phrases_and_matches_maximally():
    # "the cat" aligns to the second "the cat" of the reference as one chunk, not "the"→first "the"
    assert align_exact(["the", "cat"], tokenize("the dog saw the cat")) == [(0, 3), (1, 4)]
    for a, b in [
        ("a b a b c a", "b a c a b b a"),
        ("x y z x y z x", "z y x z y x"),
        ("the of the of and the", "and the the of of"),
    ]:
        cand, ref = a.split(), b.split()
        pairs = align_exact(cand, ref)
        assert len(pairs) == sum((Counter(cand) & Counter(ref)).values())
        assert len({i for i, _ in pairs}) == len({j for _, j in pairs}) == len(pairs)
        assert all(cand[i] == ref[j] for i, j in pairs)


# --- format ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("<think>a</think><answer>b</answer>", 1.0),
        ("<think>step 1\nstep 2</think>\n\n<answer>\n42\n</answer>", 1.0),
        ("Sure. <think>a</think><answer>b</answer>", 0.0),  # text before
        ("<think>a</think><answer>b</answer> done", 0.0),  # text after
        ("<think>a</think> so <answer>b</answer>", 0.0),  # non-space between the blocks
        ("<answer>b</answer>", 0.0),
        ("<answer>b</answer><think>a</think>", 0.0),
        ("<think>a</think><answer>b", 0.0),  # truncated
    ],
)
def test_format_think_answer(response, expected):
    assert one(format_think_answer, response) == expected


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        (r"so x = \boxed{\frac{1}{2}}.", 1.0),
        (r"<think>..</think> \boxed{\{1, 2\}}", 1.0),
        (r"\boxed{3}, or rather \boxed{4", 0.0),  # the final box is truncated
        (r"\boxed{ }", 0.0),
        ("the answer is 3", 0.0),
    ],
)
def test_format_boxed(response, expected):
    assert one(format_boxed, response) == expected


def test_boxed_and_answer_extraction():
    assert last_boxed(r"\boxed{1} then \boxed{a{b}c} end") == "a{b}c"
    assert last_boxed(r"\boxed{\{1\}}") == r"\{1\}"
    assert last_boxed(r"\boxed{\\}") == "\\\\"  # a LaTeX line break does not escape the brace
    assert last_boxed(r"\boxed{x") is None
    assert extract_answer("<answer>1</answer> <answer> 2 </answer>") == "2"
    assert extract_answer(r"<answer>so \boxed{7}</answer>") == "7"
    assert extract_answer(r"thus \boxed{ 9 }") == "9"
    assert extract_answer("just 9") is None


# --- accuracy --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "gt", "expected"),
    [
        ("<answer>48</answer>", "48", 1.0),
        (r"\boxed{48.0000001}", "48", 1.0),  # |Δ| = 1e-7 ≤ 1e-6·48
        (r"\boxed{48.001}", "48", 0.0),
        (r"\boxed{$48^\circ$.}", "48", 1.0),
        (r"\boxed{1000000.5}", "1000000", 1.0),  # tolerance 1e-6·|gold| = 1
        (r"\boxed{1000002}", "1000000", 0.0),
        (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"\boxed{2/4}", r"\dfrac{1}{2}", 1.0),
        (r"\boxed{-\frac{3}{4}}", "-0.75", 1.0),
        (r"\boxed{1/3}", "0.333", 0.0),
        (r"\boxed{\sqrt{2}}", r"\sqrt{ 2 }", 1.0),
        (r"\boxed{x+1}", "x+2", 0.0),
        ("the answer is 48", "48", 0.0),  # no <answer> and no \boxed
        ("<answer>48</answer>", 48, 1.0),
        ("<answer>forty-eight</answer>", ["48", "forty-eight"], 1.0),
        ("<answer>48</answer>", r"<answer>\boxed{48}</answer>", 1.0),
    ],
)
def test_accuracy_math_fallback(monkeypatch, response, gt, expected):
    monkeypatch.setattr(text_answers, "_load_math_verify", lambda: None)
    assert one(accuracy, response, ground_truth=gt) == expected


@pytest.mark.parametrize(
    ("response", "gt", "expected"),
    [
        ("<answer>(B)</answer>", "B", 1.0),
        ("<answer>B. 12 cm</answer>", "B", 1.0),
        ("<answer>C</answer>", "B", 0.0),
        ("<answer>Because</answer>", "B", 0.0),
        (r"\boxed{C}", "(C)", 1.0),
        ("<answer>D) 3</answer>", "D.", 1.0),
    ],
)
def test_accuracy_multiple_choice(response, gt, expected):
    assert one(accuracy, response, ground_truth=gt) == expected


def test_accuracy_iou_and_threshold():
    gt = [0, 0, 10, 10]
    # intersection 5·5 = 25, union 100 + 100 − 25 = 175
    assert one(accuracy, "<answer>[5, 5, 15, 15]</answer>", ground_truth=gt) == pytest.approx(1 / 7)
    assert one(accuracy, "<answer>[5,5,15,15]</answer>", ground_truth="[0, 0, 10, 10]") == pytest.approx(
        1 / 7
    )
    assert one(accuracy, "<answer>[5,5,15,15]</answer>", ground_truth=gt, iou_threshold=0.5) == 0.0
    # IoU = 80/100 = 0.8
    assert one(accuracy, "<answer>[0,0,10,8]</answer>", ground_truth=gt) == pytest.approx(0.8)
    assert one(accuracy, "<answer>[0,0,10,8]</answer>", ground_truth=gt, iou_threshold=0.5) == 1.0
    assert one(accuracy, "<answer>top left</answer>", ground_truth=gt) == 0.0
    assert one(accuracy, "<answer>[20,20,30,30]</answer>", ground_truth=gt) == 0.0
    with pytest.raises(UserInputError, match="iou_threshold"):
        one(accuracy, "<answer>[0,0,1,1]</answer>", ground_truth=gt, iou_threshold=1.5)
    with pytest.raises(UserInputError, match="not a box"):
        one(accuracy, "<answer>[0,0,1,1]</answer>", ground_truth="the cat", answer_type="box")


def test_accuracy_meta_handling():
    assert accuracy([None, "<answer>3</answer>"], ["p", "p"], [{"ground_truth": "3"}] * 2) == [None, 1.0]
    assert one(accuracy, "<answer>3</answer>", reward_model={"ground_truth": "3"}) == 1.0
    with pytest.raises(UserInputError, match="no 'ground_truth'"):
        one(accuracy, "<answer>3</answer>")
    with pytest.raises(UserInputError, match="answer_type"):
        one(accuracy, "<answer>3</answer>", ground_truth="3", answer_type="regex")
    # an explicit type overrides detection: "A" as a math answer compares as a string
    assert one(accuracy, "<answer>A.</answer>", ground_truth="A", answer_type="math") == 1.0
    with pytest.raises(UserInputError, match="response strings"):
        accuracy([["msg"]], ["p"], [{"ground_truth": "3"}])


def test_accuracy_uses_math_verify_when_installed(monkeypatch):
    calls = []

    def parse(text):
        calls.append(text)
        return [text]

    def verify(gold, prediction):
        return gold == [r"\boxed{x+x}"] and prediction == [r"\boxed{2x}"]

    fake = SimpleNamespace(parse=parse, verify=verify)
    monkeypatch.setattr(text_answers, "_load_math_verify", lambda: fake)
    assert one(accuracy, r"\boxed{2x}", ground_truth="x+x") == 1.0
    assert calls == [r"\boxed{x+x}", r"\boxed{2x}"]
    monkeypatch.setattr(text_answers, "_load_math_verify", lambda: None)
    assert one(accuracy, r"\boxed{2x}", ground_truth="x+x") == 0.0

    def broken(text):
        calls.append(text)
        raise TimeoutError("parse timed out")

    calls.clear()
    monkeypatch.setattr(
        text_answers, "_load_math_verify", lambda: SimpleNamespace(parse=broken, verify=verify)
    )
    assert one(accuracy, r"\boxed{2x}", ground_truth="x+x") == 0.0  # a failing math_verify is "not equal"
    assert calls == [r"\boxed{x+x}"]
    assert one(accuracy, r"\boxed{0.5}", ground_truth="1/2") == 1.0  # the fallback decides first


def test_accuracy_with_the_real_math_verify():
    """math_verify (a dev dependency) settles symbolic equivalence the string fallback cannot."""
    assert text_answers._load_math_verify() is not None
    assert text_answers.math_equal("2x", "x+x") is False
    assert one(accuracy, r"<think>..</think> \boxed{2x}", ground_truth="x+x") == 1.0
    assert one(accuracy, r"\boxed{\sqrt{2}/2}", ground_truth=r"\frac{1}{\sqrt{2}}") == 1.0
    assert one(accuracy, r"\boxed{2x+1}", ground_truth="x+x") == 0.0
    assert one(accuracy, r"\boxed{x^2-1}", ground_truth="(x-1)(x+1)") == 1.0


def test_math_equal_normalisation():
    assert math_equal(r"\left( 1, 2 \right)", "(1,2)")
    assert math_equal("3.", "3")
    assert not math_equal("1/0", "1")


# --- similarity rewards ----------------------------------------------------------------------------


def test_similarity_rewards_on_answers():
    gt = "The cat sat on the mat. It was happy."
    response = "<think>the mat?</think><answer>The cat sat on a mat. It was.</answer>"
    assert one(bleu, response, ground_truth=gt) == pytest.approx(math.exp(-1 / 8) * math.sqrt(5 / 8))
    police = "police killed the gunman"
    assert one(rouge_l, "<answer>Police, kill the gunman!</answer>", ground_truth=police) == pytest.approx(
        0.75
    )
    # untagged: the response without its <think> block is compared
    assert one(rouge_l, "<think>gunman</think>police kill the gunman", ground_truth=police) == pytest.approx(
        0.75
    )
    assert one(
        rouge_l_recall, "the cat was found under the bed", ground_truth="the cat was under the bed"
    ) == pytest.approx(1.0)
    # best of several references
    refs = ["a completely different thing", police]
    assert one(rouge_l, "police kill the gunman", ground_truth=refs) == pytest.approx(0.75)
    m = one(meteor, "the cat was sitting on the mat", ground_truth="the cat sat on the mat")
    assert m == pytest.approx(50 / 61 * (1 - 0.5 * (2 / 5) ** 3))


def test_text_similarity_weights():
    cand, gt = "the cat was sitting on the mat", "the cat sat on the mat"
    b = bleu_score(tokenize(cand), [tokenize(gt)], max_n=2)
    r = rouge_l_score(tokenize(cand), tokenize(gt)).f
    m = meteor_score(tokenize(cand), tokenize(gt))
    # bleu: p1 = 5/7, bigrams the-cat, on-the, the-mat = 3/6, BP = 1 (7 > 6); rouge: LCS 5 → F1 = 10/13
    assert b == pytest.approx(math.sqrt(5 / 7 * 3 / 6))
    assert r == pytest.approx(10 / 13)
    assert one(text_similarity, cand, ground_truth=gt) == pytest.approx((b + r + m) / 3)
    weighted = one(text_similarity, cand, ground_truth=gt, similarity_weights={"bleu": 1, "meteor": 3})
    assert weighted == pytest.approx((b + 3 * m) / 4)
    for bad, match in [
        ({"cider": 1}, "unknown metric"),
        ({"bleu": -1}, "≥ 0"),
        ({"bleu": 0}, "all be 0"),
        ([1, 2], "non-empty dict"),
    ]:
        with pytest.raises(UserInputError, match=match):
            one(text_similarity, cand, ground_truth=gt, similarity_weights=bad)


# --- length and repetition -------------------------------------------------------------------------


def words(n: int) -> str:
    return " ".join(["w"] * n)


@pytest.mark.parametrize(("length", "expected"), [(50, 0.0), (80, 0.0), (90, -0.5), (100, -1.0), (110, -1.0)])
def test_soft_overlong_penalty(length, expected):
    assert one(length_penalty, words(length), max_response_length=100, overlong_cache=20) == pytest.approx(
        expected
    )


def test_length_penalty_options():
    # default cache ⌊0.2·100⌋ = 20; factor scales the ramp; response_length overrides the word count
    assert one(length_penalty, words(90), max_response_length=100) == pytest.approx(-0.5)
    assert one(length_penalty, words(90), max_response_length=100, overlong_factor=0.5) == pytest.approx(
        -0.25
    )
    assert one(length_penalty, "short", max_response_length=100, response_length=95) == pytest.approx(-0.75)
    assert one(length_penalty, words(100), max_response_length=100, overlong_cache=0) == 0.0
    assert one(length_penalty, words(101), max_response_length=100, overlong_cache=0) == -1.0
    with pytest.raises(UserInputError, match="max_response_length"):
        one(length_penalty, "x")
    with pytest.raises(UserInputError, match="exceeds"):
        one(length_penalty, "x", max_response_length=10, overlong_cache=20)
    with pytest.raises(UserInputError, match="integer"):
        one(length_penalty, "x", max_response_length=10.5)


def test_repetition_penalty():
    # bigrams ab, ba, ab, ba, ab: 2 distinct of 5 → −(1 − 2/5)
    assert one(repetition_penalty, "a b a b a b", repetition_ngram=2) == pytest.approx(-0.6)
    # trigrams abc, bca, cab, abc: 3 distinct of 4; lower-cased first
    assert one(repetition_penalty, "A b c a B c") == pytest.approx(-0.25)
    assert one(repetition_penalty, "A b c a B c", repetition_max_penalty=-0.5) == pytest.approx(-0.125)
    assert one(repetition_penalty, "a a") == 0.0  # fewer words than n
    assert one(repetition_penalty, "one two three four") == 0.0
    with pytest.raises(UserInputError, match="≤ 0"):
        one(repetition_penalty, "a b c", repetition_max_penalty=1.0)


# --- registry, scoring and adapters ----------------------------------------------------------------


def test_text_rewards_are_registered_as_text():
    for name in ["format_think_answer", "format_boxed", "accuracy", "bleu", "rouge_l", "meteor"]:
        assert reward_kind(name) == "text"
    assert reward_kind("text_similarity") == reward_kind("length_penalty") == "text"
    assert reward_kind("jpeg_compressibility") == reward_kind("ocr") == "image"
    with pytest.raises(ValueError, match="kind"):
        register_reward("some_audio_reward", kind="audio")


def test_score_batch_combines_text_rewards():
    responses = [r"<think>x</think> \boxed{48}", r"\boxed{47}", r"<think>x</think> \boxed{48"]
    meta = [{"ground_truth": "48"}] * 3
    out = score_batch(
        [("accuracy", 0.9), ("format_boxed", 0.1)],
        responses,
        ["p"] * 3,
        meta,
        sample_ids=["s0", "s1", "s2"],
    )
    assert out["reward.accuracy"].tolist() == [1.0, 0.0, 0.0]
    assert out["reward.format_boxed"].tolist() == [1.0, 1.0, 0.0]
    assert out["reward"].tolist() == pytest.approx([1.0, 0.1, 0.0])


def _compute_score(data_source, solution_str, ground_truth, extra_info=None):
    score = float(solution_str.strip() == ground_truth) * extra_info["scale"]
    if data_source == "dict_source":
        return {"score": score, "acc": score > 0}
    return score


def test_verl_compute_score_adapter():
    scorer = verl_compute_score(_compute_score)
    meta = [
        {"data_source": "geo", "ground_truth": "7", "extra_info": {"scale": 2.0}},
        {"data_source": "dict_source", "reward_model": {"ground_truth": "7"}, "extra_info": {"scale": 0.5}},
        {"data_source": "geo", "ground_truth": "8", "extra_info": {"scale": 1.0}},
    ]
    assert scorer([" 7", "7", "7"], ["p"] * 3, meta) == [2.0, 0.5, 0.0]
    assert scorer([None], ["p"], meta[:1]) == [None]
    assert scorer.reward_kind == "text"
    missing = verl_compute_score(lambda **kwargs: {"acc": 1.0})
    with pytest.raises(UserInputError, match="without 'score'"):
        missing(["7"], ["p"], meta[:1])


def test_trl_reward_adapter():
    seen = {}

    def matches_solution(completions, solution, **kwargs):
        seen.update(kwargs)
        return [float(c == s) for c, s in zip(completions, solution)]

    scorer = trl_reward(matches_solution)
    meta = [{"ground_truth": "a", "level": 1}, {"ground_truth": "b"}]
    assert scorer(["a", "c"], ["p0", "p1"], meta) == [1.0, 0.0]
    assert seen == {"prompts": ["p0", "p1"], "ground_truth": ["a", "b"], "level": [1, None]}
    assert scorer.reward_kind == "text"

    def content_length(completions, **kwargs):
        return [None if c[0]["content"] == "" else len(c[0]["content"]) for c in completions]

    assert trl_reward(content_length, conversational=True)(["abc", ""], ["p", "p"], [{}, {}]) == [3.0, None]


def test_adapted_plugin_is_a_text_reward(tmp_path, monkeypatch, scratch_registry):
    (tmp_path / "omnirl_test_text_plugin.py").write_text(
        textwrap.dedent(
            """
            from stages.score.text_rewards import verl_compute_score

            @verl_compute_score
            def exact(data_source, solution_str, ground_truth, extra_info=None):
                return float(solution_str == ground_truth)

            def plain(images, prompts, meta):
                return [0.0] * len(images)

            def odd(responses, prompts, meta):
                return [0.0] * len(responses)

            odd.reward_kind = "audio"
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert reward_kind("omnirl_test_text_plugin:exact") == "text"
    assert get_reward("omnirl_test_text_plugin:exact")(["1"], ["p"], [{"ground_truth": "1"}]) == [1.0]
    assert reward_kind("omnirl_test_text_plugin:plain") == "image"
    with pytest.raises(UserInputError, match="reward_kind 'audio'"):
        reward_kind("omnirl_test_text_plugin:odd")
    register_reward("scratch_text", kind="text")(lambda responses, prompts, meta: [])
    assert reward_kind("scratch_text") == "text"


# --- OmniRL's scheme --------------------------------------------------------------------------------

OMNI_GT = {"ground_truth": "the cat is on the mat"}
OMNI_RESPONSE = "<think>look</think><answer>The cat sat on the mat.</answer>"


def test_rouge_n_counts_clipped_ngram_overlap() -> None:
    from stages.score.text_metrics import rouge_n_score

    cand, ref = tokenize("the cat sat on the mat"), tokenize("the cat is on the mat")
    # unigrams: the×2, cat, on, mat shared (5 of 6 on each side); bigrams: the cat, on the, the mat (3 of 5)
    assert rouge_n_score(cand, ref) == pytest.approx((5 / 6, 5 / 6, 5 / 6))
    assert rouge_n_score(cand, ref, 2) == pytest.approx((3 / 5, 3 / 5, 3 / 5))
    # clipping: "the the the" against "the cat" shares one "the": P 1/3, R 1/2, F1 0.4
    assert rouge_n_score(["the"] * 3, ["the", "cat"]) == pytest.approx((1 / 3, 1 / 2, 0.4))
    assert rouge_n_score(["x"], ref) == (0.0, 0.0, 0.0)


def test_omnirl_accuracy_weighs_bleu_rouge_and_meteor() -> None:
    scorer = get_reward("omnirl_accuracy")
    bleu2 = math.sqrt(5 / 6 * 3 / 5)  # p1 5/6, p2 3/5, equal lengths: no brevity penalty
    rouge1 = 5 / 6
    # METEOR: 5 matches in 2 chunks (the cat | on the mat): F_mean 5/6, penalty 0.5·(2/5)³
    meteor_value = 5 / 6 * (1 - 0.5 * (2 / 5) ** 3)
    no_tag = "The cat sat on the mat."
    assert scorer([OMNI_RESPONSE, no_tag, None], ["q"] * 3, [OMNI_GT] * 3) == pytest.approx(
        [0.5 * bleu2 + 0.5 * rouge1, 0.0, None]
    )
    weighted = get_reward("omnirl_accuracy", {"bleu": "0.2", "rouge": "0.3", "meteor": "0.5"})
    assert weighted([OMNI_RESPONSE], ["q"], [OMNI_GT]) == pytest.approx(
        [0.2 * bleu2 + 0.3 * rouge1 + 0.5 * meteor_value]
    )
    loose = get_reward("omnirl_accuracy", {"require_answer": "false", "rouge": "1", "bleu": "0"})
    assert loose([no_tag], ["q"], [OMNI_GT]) == pytest.approx([rouge1])
    assert reward_kind("omnirl_accuracy") == reward_kind("omnirl_length") == "text"
    with pytest.raises(UserInputError, match="must not all be 0"):
        get_reward("omnirl_accuracy", {"bleu": "0", "rouge": "0"})
    with pytest.raises(UserInputError, match=r"meteor=-1\.0 must be a finite number"):
        get_reward("omnirl_accuracy", {"meteor": "-1"})


def test_omnirl_length_follows_its_formula() -> None:
    from stages.score.text_rewards import omnirl_length_value

    # ℓ ≤ L: ℓ·(1 + sin(πℓ/2L)) · (½ + ½d) / 500, no decay below L
    assert omnirl_length_value(250, 0) == pytest.approx(250 * (1 + math.sin(math.pi / 4)) * 0.5 / 500)
    assert omnirl_length_value(500, 0) == pytest.approx(0.9)  # 2L · 0.9¹ · ½ / 500
    assert omnirl_length_value(1000, 0) == pytest.approx((1000 + math.log(501)) * 0.81 * 0.5 / 500)
    assert omnirl_length_value(10, 2) == pytest.approx(10 * (1 + math.sin(math.pi / 100)) * 0.6 / 500)
    assert omnirl_length_value(0, 0) == 0.0
    scorer = get_reward("omnirl_length")
    text = "a, b. c; d! " * 10  # 120 characters, 40 of them marks
    assert scorer([text], ["q"], [{}]) == pytest.approx([omnirl_length_value(120, 40)])
    short = get_reward("omnirl_length", {"target": "100", "decay": "0.5", "scale": "100"})
    assert short([text], ["q"], [{}]) == pytest.approx(
        [(200 + math.log(21)) * 0.5 * (0.5 + 0.5 * 40 / 120) / 100]
    )
    with pytest.raises(UserInputError, match="decay in"):
        get_reward("omnirl_length", {"decay": "1.5"})


def test_truncated_responses_get_format_zero_and_are_counted(tmp_path) -> None:
    """The score stage marks responses cut at the sampling cap; format rewards give them 0, the other
    rewards score them as usual."""
    import torch

    from stages.score.stage import score_shard, truncated_rows

    good = "<think>a</think><answer>b c</answer>"
    shard = {
        "sample_id": ["s0", "s1", "s2"],
        "prompt": ["q"] * 3,
        "prompt_meta": [{"ground_truth": "b c", "max_response_length": 8}] * 3,
        "response_text": [good, good, "\\boxed{2}"],
        "response_length": torch.tensor([5, 8, 8]),
        "truncated": torch.tensor([False, True, False]),  # s2 ended with a stop token at the cap
    }
    specs = [("format_think_answer", 1.0), ("format_boxed", 1.0), ("omnirl_accuracy", 1.0)]
    out = score_shard(shard, specs, modality="text")
    assert out["reward.format_think_answer"].tolist() == [1.0, 0.0, 0.0]
    assert out["reward.format_boxed"].tolist() == [0.0, 0.0, 1.0]
    assert out["reward.omnirl_accuracy"].tolist() == [1.0, 1.0, 0.0]  # BLEU, ROUGE of "b c" vs "b c"
    assert truncated_rows(shard) == [False, True, False]
    # a rollout written before the column: a response as long as the cap counts as truncated
    old = {k: v for k, v in shard.items() if k != "truncated"}
    assert truncated_rows(old) == [False, True, True]
