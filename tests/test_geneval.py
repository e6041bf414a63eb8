"""GenEval scoring (partial credit, strict, per-tag), the shapes detector and reward, and the shapes task.

The metadata dicts below are verbatim lines of GenEval's evaluation_metadata.jsonl; every expected
score is the mean of a credit list worked out by hand from Flow-GRPO's rules.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
from collections import deque
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from stages.errors import UserInputError
from stages.sample.prompts import read_prompts
from stages.score.geneval import (
    Detection,
    evaluate,
    has_include,
    overall_accuracy,
    relative_position,
    tag_accuracy,
)
from stages.score.geneval_shapes import PALETTE, detect_shapes, label_components
from stages.score.registry import get_reward

TASK = Path(__file__).resolve().parents[1] / "recipes" / "tasks" / "shapes.py"

WINE_GLASSES = {
    "tag": "counting",
    "include": [{"class": "wine glass", "count": 2}],
    "exclude": [{"class": "wine glass", "count": 3}],
    "prompt": "a photo of two wine glasses",
}
STOP_SIGNS = {
    "tag": "counting",
    "include": [{"class": "stop sign", "count": 4}],
    "exclude": [{"class": "stop sign", "count": 5}],
    "prompt": "a photo of four stop signs",
}
BOWL = {"tag": "single_object", "include": [{"class": "bowl", "count": 1}], "prompt": "a photo of a bowl"}
HANDBAG_SCISSORS = {
    "tag": "color_attr",
    "include": [
        {"class": "handbag", "count": 1, "color": "pink"},
        {"class": "scissors", "count": 1, "color": "black"},
    ],
    "prompt": "a photo of a pink handbag and a black scissors",
}
COW_RIGHT_OF_LAPTOP = {
    "tag": "position",
    "include": [{"class": "laptop", "count": 1}, {"class": "cow", "count": 1, "position": ["right of", 0]}],
    "prompt": "a photo of a cow right of a laptop",
}

LEFT, MIDDLE, RIGHT = (10.0, 40.0, 50.0, 80.0), (100.0, 40.0, 140.0, 80.0), (190.0, 40.0, 230.0, 80.0)


def det(label: str, box=MIDDLE, color: str | None = None, confidence: float = 0.95) -> Detection:
    return Detection(label, box, color, confidence)


def _task():
    spec = importlib.util.spec_from_file_location("omnirl_test_shapes_task", TASK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def task():
    return _task()


@pytest.fixture(scope="module")
def world(task):
    """200 generated rows and their ground-truth renders (64 px, seed = row index)."""
    rows = task.make_prompts(200, seed=7)
    return rows, [task.render(row, 64, seed=i) for i, row in enumerate(rows)]


# ---- partial credit, strict, exact on GenEval metadata -------------------------------------------


@pytest.mark.parametrize(
    ("confidences", "score", "strict"),
    [
        ([0.95, 0.95], 1.0, True),
        ([0.95, 0.95, 0.95], 1 - 1 / 2, False),  # one too many: the exclude clause (≥ 3) fails strict
        ([0.95], 1 - 1 / 2, False),  # one too few
        ([0.95, 0.95, 0.85], 1.0, True),  # 0.85 is under the counting threshold 0.9: not counted
        ([0.95] * 6, 1 - 4 / 2, False),  # far too many: negative credit
    ],
)
def test_counting_credit_and_exclude(confidences, score, strict):
    result = evaluate(WINE_GLASSES, [det("wine glass", confidence=c) for c in confidences])
    assert result.score == pytest.approx(score)
    assert result.strict is strict and result.exact is strict and result.tag == "counting"
    assert (not strict) == bool(result.reasons)


def test_thresholds_are_parameters_and_strictly_exceeded():
    glasses = [det("wine glass", confidence=c) for c in (0.95, 0.95, 0.85)]
    assert evaluate(WINE_GLASSES, glasses, counting_threshold=0.8).score == pytest.approx(0.5)
    # a non-counting tag uses 0.3, and a confidence of exactly 0.3 is dropped (GenEval keeps > 0.3)
    assert evaluate(BOWL, [det("bowl", confidence=0.3)]).credits == (0.0,)
    assert evaluate(BOWL, [det("bowl", confidence=0.31)]).credits == (1.0,)
    assert evaluate(BOWL, [det("bowl", confidence=0.31)], threshold=0.5).credits == (0.0,)


def test_count_credit_is_capped_by_max_objects():
    signs = [det("stop sign", confidence=0.95) for _ in range(20)]
    assert evaluate(STOP_SIGNS, signs).score == pytest.approx(1 - 12 / 4)  # 16 kept per class
    assert evaluate(STOP_SIGNS, signs, max_objects=32).score == pytest.approx(1 - 16 / 4)


def test_extra_objects_pass_geneval_strict_without_an_exclude_clause():
    result = evaluate(BOWL, [det("bowl"), det("bowl", LEFT), det("bowl", RIGHT)])
    assert result.credits == (1 - 2 / 1,) and result.score == -1.0
    assert result.strict and not result.exact  # GenEval asks for ≥ 1 bowl; the reward server for exactly 1


@pytest.mark.parametrize(
    ("detections", "credits", "strict"),
    [
        ([det("handbag", LEFT, "pink"), det("scissors", RIGHT, "black")], (1, 1, 1, 1), True),
        ([det("handbag", LEFT, "pink"), det("scissors", RIGHT, "white")], (1, 1, 1, 0), False),
        ([det("handbag", LEFT, "pink"), det("scissors", RIGHT, None)], (1, 1, 1, 0), False),
        # two handbags: count credit 0 plus one extra 0 for the colour; GenEval checks the top-1 only
        (
            [
                det("handbag", LEFT, "pink", 0.9),
                det("handbag", MIDDLE, "white", 0.8),
                det("scissors", RIGHT, "black"),
            ],
            (0, 0, 1, 1),
            True,
        ),
        (
            [
                det("handbag", LEFT, "white", 0.9),
                det("handbag", MIDDLE, "pink", 0.8),
                det("scissors", RIGHT, "black"),
            ],
            (0, 0, 1, 1),
            False,
        ),
        ([det("scissors", RIGHT, "black")], (0, 0, 1, 1), False),
    ],
)
def test_colour_credit(detections, credits, strict):
    result = evaluate(HANDBAG_SCISSORS, detections)
    assert result.credits == tuple(float(c) for c in credits)
    assert result.score == pytest.approx(sum(credits) / len(credits))
    assert result.strict is strict
    assert result.exact is (credits == (1, 1, 1, 1))


@pytest.mark.parametrize(
    ("detections", "credits", "strict"),
    [
        ([det("laptop", LEFT), det("cow", MIDDLE)], (1, 1, 1), True),
        ([det("laptop", MIDDLE), det("cow", LEFT)], (1, 1, 0, 1), False),  # failed relation: a 0 AND a 1
        ([det("cow", MIDDLE)], (0, 1, 0), False),  # no laptop: the cow has no target
        ([det("laptop", LEFT)], (1, 0, 0), False),  # no cow: one extra 0 for the position
        (
            [det("laptop", LEFT), det("cow", MIDDLE, confidence=0.9), det("cow", RIGHT, confidence=0.8)],
            (1, 0, 0),
            True,
        ),
        (
            [det("laptop", MIDDLE), det("cow", RIGHT, confidence=0.9), det("cow", LEFT, confidence=0.8)],
            (1, 0, 0),
            True,
        ),
        (
            [det("laptop", MIDDLE), det("cow", LEFT, confidence=0.9), det("cow", RIGHT, confidence=0.8)],
            (1, 0, 0),
            False,
        ),
    ],
)
def test_position_credit_and_the_failed_relation_quirk(detections, credits, strict):
    result = evaluate(COW_RIGHT_OF_LAPTOP, detections)
    assert result.credits == tuple(float(c) for c in credits)
    assert result.score == pytest.approx(sum(credits) / len(credits))
    assert result.strict is strict
    assert result.exact is (credits == (1, 1, 1))


def test_relative_position_by_hand():
    b = (0.0, 0.0, 20.0, 20.0)
    # offset (30, 0), margin 0.1·(20 + 20) = 4 per axis: (26, 0)/30
    assert relative_position((30, 0, 50, 20), b) == {"right of"}
    assert relative_position((-30, 0, -10, 20), b) == {"left of"}
    # offset (30, 30): (26, 26)/42.43 = 0.61 on both axes: two relations (image y grows downwards)
    assert relative_position((30, 30, 50, 50), b) == {"right of", "below"}
    assert relative_position((30, -30, 50, -10), b) == {"right of", "above"}
    # offset (30, 20): (26, 16)/36.06 = (0.72, 0.44): only "right of"
    assert relative_position((30, 20, 50, 40), b) == {"right of"}
    # offset (5, 0): (1, 0)/5 = 0.2: no relation; offset (3, 0) is swallowed by the margin
    assert relative_position((5, 0, 25, 20), b) == set()
    assert relative_position((3, 0, 23, 20), b) == set()
    assert relative_position(b, b) == set()
    # margin 0.5: offset 30 − 0.5·40 = 10, 10/30 < 0.5
    assert relative_position((30, 0, 50, 20), b, margin=0.5) == set()
    assert evaluate(COW_RIGHT_OF_LAPTOP, [det("laptop", (0, 0, 20, 20)), det("cow", (30, 0, 50, 20))]).strict
    result = evaluate(
        COW_RIGHT_OF_LAPTOP, [det("laptop", (0, 0, 20, 20)), det("cow", (30, 0, 50, 20))], position_margin=0.5
    )
    assert not result.strict and result.credits == (1, 1, 0, 1)


def test_tag_accuracy_and_overall():
    results = [
        evaluate(WINE_GLASSES, [det("wine glass"), det("wine glass", LEFT)]),  # counting 1
        evaluate(WINE_GLASSES, [det("wine glass")]),  # counting 0
        evaluate(WINE_GLASSES, [det("wine glass")] * 3),  # counting 0 (exclude)
        evaluate(BOWL, [det("bowl")]),  # single_object 1
        evaluate(COW_RIGHT_OF_LAPTOP, [det("laptop", MIDDLE), det("cow", LEFT)]),  # position 0
    ]
    per_tag = tag_accuracy(results)
    assert per_tag == {"counting": pytest.approx(1 / 3), "position": 0.0, "single_object": 1.0}
    assert list(per_tag) == sorted(per_tag)
    assert overall_accuracy(per_tag) == pytest.approx((1 / 3 + 0 + 1) / 3)
    with pytest.raises(ValueError):
        overall_accuracy({})


@pytest.mark.parametrize(
    ("include", "message"),
    [
        ([{"class": "cow", "count": 0}], "count"),
        ([{"class": "cow"}], "count"),
        ([{"count": 1}], "class"),
        ([{"class": "cow", "count": 1, "position": ["right of", 0]}], "earlier clause"),
        ([{"class": "a", "count": 1}, {"class": "b", "count": 1, "position": ["near", 0]}], "near"),
        ([{"class": "a", "count": 1}, {"class": "b", "count": 1, "position": "left of"}], "position"),
        ("cow", "list"),
    ],
)
def test_malformed_metadata_is_a_one_line_user_error(include, message):
    with pytest.raises(UserInputError, match=message) as info:
        evaluate({"tag": "x", "include": include, "prompt": "p"}, [])
    assert "\n" not in str(info.value) and "'p'" in str(info.value)


def test_metadata_without_include_has_nothing_to_score():
    assert not has_include({"tag": "single_object"}) and not has_include({"include": []})
    assert has_include(BOWL)
    with pytest.raises(UserInputError, match="no 'include'"):
        evaluate({"tag": "single_object"}, [])


# ---- shapes detector ----------------------------------------------------------------------------


def _bfs_labels(classes: np.ndarray) -> np.ndarray:
    """Reference 4-connected labelling by BFS; a component is labelled by its first pixel in raster order."""
    h, w = classes.shape
    labels = np.full((h, w), -1)
    for y in range(h):
        for x in range(w):
            if classes[y, x] < 0 or labels[y, x] >= 0:
                continue
            labels[y, x] = y * w + x
            queue = deque([(y, x)])
            while queue:
                a, b = queue.popleft()
                for u, v in ((a + 1, b), (a - 1, b), (a, b + 1), (a, b - 1)):
                    if 0 <= u < h and 0 <= v < w and labels[u, v] < 0 and classes[u, v] == classes[a, b]:
                        labels[u, v] = y * w + x
                        queue.append((u, v))
    return labels


def test_label_components_matches_breadth_first_search():
    rng = np.random.default_rng(0)
    for shape in [(23, 31), (1, 17), (17, 1), (40, 40)]:
        classes = rng.integers(-1, 3, size=shape)
        np.testing.assert_array_equal(label_components(classes), _bfs_labels(classes))
    snake = np.full((21, 21), -1)
    snake[::2, :] = 0
    snake[1::4, -1] = 0
    snake[3::4, 0] = 0
    labels = label_components(snake)
    assert len(np.unique(labels[labels >= 0])) == 1


def test_ground_truth_scores_one_and_shuffled_captions_score_low(world):
    rows, images = world
    truth = [evaluate(row, detect_shapes(image)) for row, image in zip(rows, images)]
    shuffled = [evaluate(row, detect_shapes(image)) for row, image in zip(rows, images[1:] + images[:1])]
    strict = np.mean([r.strict for r in truth])
    print(
        f"ground truth: strict {strict:.3f}, score {np.mean([r.score for r in truth]):.3f}; "
        f"shuffled: strict {np.mean([r.strict for r in shuffled]):.3f}, score "
        f"{np.mean([r.score for r in shuffled]):.3f}, per tag {tag_accuracy(shuffled)}"
    )
    assert strict >= 0.95
    assert np.mean([r.score for r in truth]) >= 0.97
    assert set(tag_accuracy(truth)) == {
        "single_object",
        "two_object",
        "counting",
        "colors",
        "position",
        "color_attr",
    }
    assert np.mean([r.strict for r in shuffled]) < 0.3
    assert np.mean([r.score for r in shuffled]) < 0.5


def test_detector_reads_the_palette_and_classes(task):
    meta = {
        "tag": "color_attr",
        "include": [
            {"class": s, "count": 1, "color": c} for s, c in zip(("circle", "square", "triangle"), PALETTE)
        ],
    }
    for seed in range(5):
        found = detect_shapes(task.render(meta, 96, seed=seed))
        assert sorted((d.label, d.color) for d in found) == [
            ("circle", "red"),
            ("square", "yellow"),
            ("triangle", "green"),
        ]
    for color in PALETTE:
        image = task.render(
            {"tag": "colors", "include": [{"class": "square", "count": 1, "color": color}]}, 64, 0
        )
        (found,) = detect_shapes(image)
        assert found.color == color and found.label == "square" and found.confidence == 1.0


def test_blank_and_grey_images_score_the_minimum(world):
    rows, images = world
    blank = Image.new("RGB", (64, 64), "white")
    results = [evaluate(row, detect_shapes(blank)) for row in rows]
    assert all(r.score == 0.0 and not r.strict and set(r.credits) == {0.0} for r in results)
    # no colour at all in a grey image: nothing is detected, whatever the shapes drawn
    grey = [evaluate(row, detect_shapes(image.convert("L"))) for row, image in zip(rows[:20], images[:20])]
    assert all(r.score == 0.0 and not r.strict for r in grey)


def test_image_modes(world):
    rows, images = world
    for row, image in zip(rows[:20], images[:20]):
        expected = detect_shapes(image)
        assert detect_shapes(image.convert("RGBA")) == expected
        assert detect_shapes(image.convert("P", palette=Image.Palette.ADAPTIVE)) == expected
        # transparent background with black RGB underneath: composited onto white, not read as black
        rgba = np.asarray(image.convert("RGBA")).copy()
        background = (rgba[..., :3].max(axis=-1) - rgba[..., :3].min(axis=-1)) < 10
        rgba[background] = (0, 0, 0, 0)
        assert [(d.label, d.color) for d in detect_shapes(Image.fromarray(rgba, "RGBA"))] == [
            (d.label, d.color) for d in expected
        ]
        assert evaluate(row, detect_shapes(image.convert("LA"))).score == 0.0


# ---- registered rewards -------------------------------------------------------------------------


def test_extra_shapes_pass_strict_but_not_exact(task):
    """GenEval's strict check looks at the most confident detection of a colour prompt; the reward
    server's exact check (`geneval_shapes_exact`) fails an image with one shape too many."""
    one = {"tag": "colors", "include": [{"class": "circle", "count": 1, "color": "red"}]}
    two = {"tag": "colors", "include": [{"class": "circle", "count": 2, "color": "red"}]}
    images = [task.render(two, 64, seed=0), task.render(one, 64, seed=0), Image.new("RGB", (64, 64), "white")]
    batch = (images, ["a photo of a red circle"] * 3, [one] * 3)
    assert [(d.label, d.color) for d in detect_shapes(images[0])] == [("circle", "red")] * 2
    assert get_reward("geneval_shapes_strict")(*batch) == [1.0, 1.0, 0.0]
    assert get_reward("geneval_shapes_exact")(*batch) == [0.0, 1.0, 0.0]


def test_registered_rewards(world, caplog):
    rows, images = world
    metas = [{k: v for k, v in row.items() if k != "prompt"} for row in rows[:2]]
    blank = Image.new("RGB", (64, 64), "white")
    batch = [images[0], blank, images[1]]
    prompts = [rows[0]["prompt"], "no metadata here", rows[1]["prompt"]]
    meta = [metas[0], {"tag": "single_object"}, metas[1]]
    with caplog.at_level(logging.WARNING, logger="stages.score.geneval_shapes"):
        assert get_reward("geneval_shapes")(batch, prompts, meta) == [1.0, None, 1.0]
        assert get_reward("geneval_shapes_strict")([blank, blank, images[1]], prompts, meta) == [
            0.0,
            None,
            1.0,
        ]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and all("'no metadata here'" in w and "include" in w for w in warnings)
    with pytest.raises(UserInputError, match="'dog' is not a shape"):
        get_reward("geneval_shapes")(
            [blank], ["a dog"], [{"tag": "single_object", "include": [{"class": "dog", "count": 1}]}]
        )
    with pytest.raises(UserInputError, match="'pink' is not in the shapes palette"):
        get_reward("geneval_shapes")(
            [blank], ["p"], [{"tag": "colors", "include": [{"class": "circle", "count": 1, "color": "pink"}]}]
        )


def test_overcrowded_image_scores_negative(task):
    meta = {"tag": "single_object", "include": [{"class": "circle", "count": 1}]}
    many = {"tag": "counting", "include": [{"class": "circle", "count": 4}]}
    image = task.render(many, 96, seed=3)
    (score,) = get_reward("geneval_shapes")([image], ["a photo of a circle"], [meta])
    assert score == pytest.approx(1 - 3 / 1)


# ---- the shapes task ----------------------------------------------------------------------------


def test_prompts_are_deterministic_and_prefix_stable(task):
    rows = task.make_prompts(50, seed=1)
    assert rows == task.make_prompts(50, seed=1)
    assert rows[:10] == task.make_prompts(10, seed=1)
    assert rows != task.make_prompts(50, seed=2)
    narrowed = task.make_prompts(40, seed=1, tags=["counting"])
    assert {r["tag"] for r in narrowed} == {"counting"}
    counts = {r["include"][0]["count"] for r in narrowed}
    assert counts == {1, 2, 3, 4}
    for row in narrowed:
        n = row["include"][0]["count"]
        assert row["exclude"] == [{"class": row["include"][0]["class"], "count": n + 1}]
        assert row["prompt"].startswith(f"a photo of {task.NUMBER_WORDS[n]} ")
    for row in task.make_prompts(100, seed=3):
        classes = [c["class"] for c in row["include"]]
        assert len(set(classes)) == len(classes)  # two clauses never name the same shape
        assert all(c.get("color") in (None, *PALETTE) for c in row["include"])
    with pytest.raises(ValueError, match="unknown tag"):
        task.make_prompts(3, seed=0, tags=["spatial"])
    # --shapes narrows the shapes named; the default draws the rows drawn before it existed (their
    # digest taken with the task generator of commit 574108f)
    assert task.make_prompts(50, seed=1, shapes=["circle", "square", "triangle"]) == rows
    digest = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()
    assert digest == "50870e696ea25092f8aed42dd8b6882e6b7140cfb17926a641702825086a5c50"
    circles = task.make_prompts(40, seed=1, tags=["counting", "colors"], shapes=["circle"])
    assert {c["class"] for r in circles for c in r["include"]} == {"circle"}
    assert {r["tag"] for r in circles} == {"counting", "colors"}
    pairs = task.make_prompts(30, seed=1, tags=["two_object"], shapes=["circle", "square"])
    assert all(sorted(c["class"] for c in r["include"]) == ["circle", "square"] for r in pairs)
    with pytest.raises(ValueError, match="'position' names two different shapes"):
        task.make_prompts(3, seed=0, tags=["position"], shapes=["circle"])
    with pytest.raises(ValueError, match="unknown shape 'star'"):
        task.make_prompts(3, seed=0, shapes=["star"])
    with pytest.raises(ValueError, match="'two_object' names two different shapes"):
        task.make_row(0, seed=0, tags=["two_object"], shapes=["circle"])


def test_render_is_deterministic(task, world):
    rows, images = world
    assert task.render(rows[0], 64, seed=0).tobytes() == images[0].tobytes()
    assert task.render(rows[0], 64, seed=1).tobytes() != images[0].tobytes()
    assert images[0].mode == "RGB" and images[0].size == (64, 64)
    with pytest.raises(ValueError, match="cannot draw 'dog'"):
        task.render({"include": [{"class": "dog", "count": 1}]}, 64, 0)


def test_prompt_file_round_trip_through_the_cli_entry(task, tmp_path):
    out = tmp_path / "shapes.jsonl"
    task.main(["--out", str(out), "--num-prompts", "12", "--seed", "4", "--images", str(tmp_path / "img")])
    rows = task.make_prompts(12, seed=4)
    prompts = read_prompts(out)
    assert [p.text for p in prompts] == [r["prompt"] for r in rows]
    assert [p.meta for p in prompts] == [{k: v for k, v in r.items() if k != "prompt"} for r in rows]
    scores = get_reward("geneval_shapes")(
        [Image.open(tmp_path / "img" / f"{i:05d}.png") for i in range(12)],
        [p.text for p in prompts],
        [p.meta for p in prompts],
    )
    assert scores == [1.0] * 12
    with pytest.raises(SystemExit):
        task.main(["--out", str(tmp_path / "x.parquet"), "--num-prompts", "2"])


def test_reward_statistics_report_genevals_per_tag_accuracy_and_overall_score():
    """score's statistics of a strict 0/1 column grouped by the prompts' tags equal GenEval's own
    per-tag accuracy and overall score (computed from the verdicts by `tag_accuracy`)."""
    from stages.reporting import reward_statistics

    cases = [
        (WINE_GLASSES, [det("wine glass"), det("wine glass", LEFT)]),
        (WINE_GLASSES, [det("wine glass")]),
        (WINE_GLASSES, [det("wine glass")] * 3),
        (BOWL, [det("bowl")]),
        (COW_RIGHT_OF_LAPTOP, [det("laptop", MIDDLE), det("cow", LEFT)]),
    ]
    results = [evaluate(meta, found) for meta, found in cases]
    strict = torch.tensor([float(r.strict) for r in results])
    stats = reward_statistics(
        {"reward": strict, "reward.geneval_strict": strict}, [meta for meta, _ in cases]
    )
    per_tag = tag_accuracy(results)
    for tag, accuracy in per_tag.items():
        assert stats[f"reward.geneval_strict/tag/{tag}/mean"] == pytest.approx(accuracy)
    assert stats["reward.geneval_strict/tag_mean"] == pytest.approx(overall_accuracy(per_tag))
    assert stats["reward/mean"] == pytest.approx(2 / 5)
    assert not any("/tag" in k for k in reward_statistics({"reward": strict}, [{}] * 5))
