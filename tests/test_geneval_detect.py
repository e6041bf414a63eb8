"""The detector-backed GenEval rewards (`geneval`, `geneval_strict`) on tiny random DETR / OWLv2 / CLIP.

The detectors are random, so what they find is arbitrary: every test checks the plumbing against an
independent path (the model and processor called here, `post_process_object_detection`, our own
label table, clamping and CLIP zero-shot colours, then `stages.score.geneval.evaluate`).
"""

from __future__ import annotations

import io
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import fails, run
from PIL import Image

from stages.errors import UserInputError
from stages.models.clip import build_tiny_clip
from stages.models.detector import COCO_ID2LABEL, build_tiny_detr, build_tiny_owlv2
from stages.score.geneval import Detection, evaluate, relative_position, tag_accuracy
from stages.score.geneval_detect import GENEVAL_CLASSES, GENEVAL_COLORS, geneval_class
from stages.score.registry import get_reward, reward_files

# DETR's COCO labels that GenEval spells otherwise (GenEval's object_names vs facebook/detr-resnet-50).
GENEVAL_SPELLING = {"mouse": "computer mouse", "remote": "tv remote", "keyboard": "computer keyboard"}
TEMPLATES = ("a photo of a {c} {o}", "a photo of a {c}-colored {o}", "a photo of a {c} object")


def _blocks(seed: int, height: int, width: int) -> Image.Image:
    """A light image with four coloured squares."""
    rng = np.random.default_rng(seed)
    pixels = np.full((height, width, 3), 230, np.uint8)
    for _ in range(4):
        y, x = rng.integers(0, height - 8), rng.integers(0, width - 8)
        pixels[y : y + height // 3, x : x + width // 4] = rng.integers(0, 256, 3)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("geneval_models")
    build_tiny_detr(root / "detr", seed=0)
    build_tiny_owlv2(root / "owlv2", seed=0)
    build_tiny_clip(root / "clip", seed=0)
    return {"detr": root / "detr", "owlv2": root / "owlv2", "clip": root / "clip"}


@pytest.fixture(scope="module")
def clip_ref(models):
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(models["clip"], local_files_only=True).eval()
    return model, CLIPProcessor.from_pretrained(models["clip"], local_files_only=True)


def _features(output) -> torch.Tensor:
    features = output if isinstance(output, torch.Tensor) else output.pooler_output
    return torch.nn.functional.normalize(features.float(), dim=-1)


@torch.no_grad()
def _manual_colors(clip_ref, image: Image.Image, detections: list[Detection]) -> list[Detection]:
    """GenEval's colour classifier by hand: crop each box (PIL rounding, ≥ 1 pixel), CLIP image
    features · per-colour mean of the three normalised template embeddings, renormalised; argmax."""
    model, processor = clip_ref
    out = []
    for d in detections:
        x0, y0, x1, y1 = (round(v) for v in d.box)
        x0, y0 = min(x0, image.width - 1), min(y0, image.height - 1)
        crop = image.crop((x0, y0, max(x1, x0 + 1), max(y1, y0 + 1)))
        pixels = processor(images=[crop], return_tensors="pt")["pixel_values"]
        image_feature = _features(model.get_image_features(pixel_values=pixels))[0]
        texts = [t.format(c=c, o=d.label) for c in GENEVAL_COLORS for t in TEMPLATES]
        tokens = processor.tokenizer(texts, padding=True, return_tensors="pt")
        text = _features(model.get_text_features(**tokens)).view(10, 3, -1).mean(1)
        text = text / text.norm(dim=-1, keepdim=True)
        out.append(
            Detection(d.label, d.box, GENEVAL_COLORS[int((text @ image_feature).argmax())], d.confidence)
        )
    return out


def _clamped(box: list[float], width: int, height: int) -> tuple[float, float, float, float]:
    x0, y0, x1, y1 = np.clip(box, 0, [width, height, width, height]).tolist()
    return (x0, y0, x1, y1)


@torch.no_grad()
def _manual_detr(models, clip_ref, images: list[Image.Image]) -> list[list[Detection]]:
    """Each image alone through DETR and its processor; every detection of a real label, coloured."""
    from transformers import AutoImageProcessor, DetrForObjectDetection

    model = DetrForObjectDetection.from_pretrained(models["detr"], local_files_only=True).eval()
    processor = AutoImageProcessor.from_pretrained(models["detr"], local_files_only=True)
    found = []
    for image in images:
        outputs = model(**processor(images=[image], return_tensors="pt"))
        result = processor.post_process_object_detection(
            outputs, threshold=0.0, target_sizes=[(image.height, image.width)]
        )[0]
        detections = []
        for score, label, box in zip(result["scores"], result["labels"], result["boxes"], strict=True):
            name = model.config.id2label[int(label)]
            if name != "N/A":
                name = GENEVAL_SPELLING.get(name, name)
                detections.append(
                    Detection(name, _clamped(box.tolist(), image.width, image.height), None, float(score))
                )
        found.append(_manual_colors(clip_ref, image, detections))
    return found


def _count(detections: list[Detection], label: str, cutoff: float) -> int:
    return sum(d.label == label and d.confidence > cutoff for d in detections)


# --- labels and the tiny models -----------------------------------------------------------------------


def test_coco_labels_map_to_genevals_80_class_names():
    names = [geneval_class(label) for label in COCO_ID2LABEL.values()]
    assert len(COCO_ID2LABEL) == 91 and names.count(None) == 11  # DETR's unused "N/A" slots
    assert sorted(n for n in names if n is not None) == sorted(GENEVAL_CLASSES)
    assert len(set(GENEVAL_CLASSES)) == 80
    assert {geneval_class(k): v for k, v in GENEVAL_SPELLING.items()} == {
        v: v for v in GENEVAL_SPELLING.values()
    }
    for same in ("dining table", "potted plant", "tv", "couch", "hair drier", "donut", "motorcycle"):
        assert geneval_class(same) == same and same in GENEVAL_CLASSES
    voc = {"tvmonitor": "tv", "diningtable": "dining table", "pottedplant": "potted plant", "sofa": "couch"}
    for label, name in {
        **voc,
        "Dining_Table": "dining table",
        "hair-dryer": "hair drier",
        "N/A": None,
    }.items():
        assert geneval_class(label) == name


def test_tiny_detr_loads_offline_with_coco_labels_and_varied_detections(models, tmp_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(models["detr"], local_files_only=True)
    assert config.model_type == "detr" and config.backbone_config.model_type == "resnet"
    assert {int(k): v for k, v in config.id2label.items()} == COCO_ID2LABEL
    again = tmp_path / "again"
    build_tiny_detr(again, seed=0)
    assert (again / "model.safetensors").read_bytes() == (models["detr"] / "model.safetensors").read_bytes()
    with pytest.raises(UserInputError, match="not an empty directory"):
        build_tiny_detr(again, seed=1)
    reward = get_reward(
        "geneval", {"detector": str(models["detr"]), "clip": str(models["clip"]), "device": "cpu"}
    )
    found = reward.detect([_blocks(0, 48, 64)], [[]])[0]
    assert len({d.label for d in found}) >= 2 and len({d.box for d in found}) == len(found)
    assert min(d.confidence for d in found) < 0.9 < max(d.confidence for d in found)


# --- the colour classifier -----------------------------------------------------------------------------


def test_color_classifier_is_clip_zero_shot_on_the_crops(models, clip_ref, monkeypatch):
    reward = get_reward(
        "geneval", {"detector": str(models["detr"]), "clip": str(models["clip"]), "device": "cpu"}
    )
    image = _blocks(3, 48, 64)
    boxes = [
        (0.4, 0.6, 20.5, 17.2),
        (10.0, 5.0, 40.0, 30.0),
        (63.6, 20.0, 64.0, 48.0),
        (30.2, 47.8, 50.0, 48.0),
    ]
    detections = [Detection("cat", box, None, 0.95) for box in boxes]
    detections += [Detection("cat", boxes[0], None, 0.2), Detection("dog", boxes[1], None, 0.99)]
    meta = {"tag": "colors", "include": [{"class": "cat", "count": 1, "color": "red"}]}
    crops: list[Image.Image] = []
    embed = reward.clip.image_embeddings
    monkeypatch.setattr(reward.clip, "image_embeddings", lambda images: crops.extend(images) or embed(images))
    colored = reward.color_detections([image], [meta], [detections])[0]
    expected = _manual_colors(clip_ref, image, detections[:4])
    assert [d.color for d in colored[:4]] == [d.color for d in expected]
    assert colored[4].color is None and colored[5].color is None  # below 0.3; a class no colour clause names
    manual_crops = [
        image.crop(b) for b in [(0, 1, 20, 17), (10, 5, 40, 30), (63, 20, 64, 48), (30, 47, 50, 48)]
    ]
    assert [np.asarray(c).tolist() for c in crops] == [np.asarray(c).tolist() for c in manual_crops]

    model, processor = clip_ref
    with torch.no_grad():
        tokens = processor.tokenizer(
            ["a photo of a pink cat", "a photo of a pink-colored cat", "a photo of a pink object"],
            padding=True,
            return_tensors="pt",
        )
        pink = _features(model.get_text_features(**tokens)).mean(0)
    assert torch.allclose(reward.color_classifier("cat")[6], pink / pink.norm(), atol=1e-5)
    # The argmax names the colour of the winning row: feed each crop one classifier row as its embedding.
    rows = reward.color_classifier("cat")
    monkeypatch.setattr(reward.clip, "image_embeddings", lambda images: rows[[9, 0, 4, 6]])
    colored = reward.color_detections([image], [meta], [detections])[0]
    assert [d.color for d in colored[:4]] == ["white", "red", "blue", "pink"]


# --- the rewards against the independent path -----------------------------------------------------------


def test_detr_rewards_equal_geneval_on_independent_detections(models, clip_ref):
    images = [_blocks(seed, 48, 64) for seed in (0, 2, 3, 7)]
    manual = _manual_detr(models, clip_ref, images)
    labels = [Counter(d.label for d in found if d.confidence > 0.3).most_common() for found in manual]
    # colour_attr: the commonest class at its exact count (so its colour credit is computed), the
    # next one at a wrong count
    (a0, n0), (b0, _) = labels[0][0], labels[0][1]
    top = max((d for d in manual[0] if d.label == a0), key=lambda d: d.confidence)
    # counting: a class with fewer detections above 0.9 than above 0.3, at its count above 0.9
    counted = next(label for label, _ in labels[1] if _count(manual[1], label, 0.9) >= 1)
    k = _count(manual[1], counted, 0.9)
    assert k != _count(manual[1], counted, 0.3)  # so the counting cut-off decides the verdict
    # position: a class found once as the target, another at its exact count; the relation is the
    # one the most confident pair has (if any), so whether every pair has it decides
    target = next(label for label, n in labels[2] if n == 1)
    subject, n2 = next((label, n) for label, n in labels[2] if label != target)
    pair = [
        max((d for d in manual[2] if d.label == c), key=lambda d: d.confidence) for c in (subject, target)
    ]
    relation = sorted(relative_position(pair[0].box, pair[1].box) or {"left of"})[0]
    meta = [
        {
            "tag": "color_attr",
            "include": [
                {"class": a0, "count": n0, "color": top.color},
                {"class": b0, "count": 1, "color": "blue"},
            ],
        },
        {
            "tag": "counting",
            "include": [{"class": counted, "count": k}],
            "exclude": [{"class": counted, "count": k + 1}],
        },
        {
            "tag": "position",
            "include": [
                {"class": target, "count": 1},
                {"class": subject, "count": n2, "position": [relation, 0]},
            ],
        },
        {
            "tag": "two_object",
            "include": [
                {"class": "zebra", "count": 1},
                {"class": labels[3][-1][0], "count": labels[3][-1][1]},
            ],
        },
        {"tag": "single_object", "prompt": "no clauses"},
    ]
    prompts = [f"prompt {i}" for i in range(5)]
    images.append(_blocks(9, 48, 64))
    args = {"detector": str(models["detr"]), "clip": str(models["clip"]), "device": "cpu", "batch_size": 3}
    reward, strict = get_reward("geneval", args), get_reward("geneval_strict", args)
    got = reward.evaluate_batch(images, prompts, meta)
    expected = [evaluate(m, found) for m, found in zip(meta[:4], manual, strict=True)]
    assert got[4] is None
    for g, e in zip(got[:4], expected, strict=True):
        assert (g.tag, g.strict, g.exact, g.reasons) == (e.tag, e.strict, e.exact, e.reasons)
        assert g.credits == pytest.approx(e.credits) and g.score == pytest.approx(e.score)
    assert got[1].strict and got[1].score == 1.0
    for found, mine in zip(reward.detect(images[:4], [[]] * 4), manual, strict=True):
        kept = [d for d in mine if d.confidence > 0.3]
        assert [d.label for d in found] == [d.label for d in kept]
        numbers = [[d.confidence, *d.box] for d in found]
        assert np.allclose(numbers, [[d.confidence, *d.box] for d in kept], atol=1e-4)
    assert any(min(b) == 0.0 or b[2] == 64 or b[3] == 48 for found in manual for b in (d.box for d in found))
    assert len({g.score for g in got[:4]}) >= 3  # the verdicts differ, so the comparison can fail
    assert reward(images, prompts, meta) == pytest.approx([e.score for e in expected] + [None])
    assert strict(images, prompts, meta) == [float(e.strict) for e in expected] + [None]
    exact = get_reward("geneval_exact", args)
    assert exact(images, prompts, meta) == [float(e.exact) for e in expected] + [None]
    extra_object = evaluate(  # GenEval's strict passes a second bowl; the reward server's exact does not
        {"tag": "single_object", "include": [{"class": "bowl", "count": 1}]},
        [Detection("bowl", (0, 0, 9, 9), None, 0.9), Detection("bowl", (20, 20, 29, 29), None, 0.8)],
    )
    assert (strict.value(extra_object), exact.value(extra_object)) == (1.0, 0.0)
    assert tag_accuracy(got[:4]) == tag_accuracy(expected)
    one_by_one = get_reward("geneval", {**args, "batch_size": 1})(images, prompts, meta)
    assert one_by_one == pytest.approx(reward(images, prompts, meta))


@torch.no_grad()
def test_owlv2_queries_are_each_prompts_classes(models, clip_ref):
    """OWLv2 queries "a photo of a {class}" per image; a batch pads the query lists, and each image's
    boxes are still labelled among its own queries only (checked against one image per forward)."""
    from transformers import Owlv2ForObjectDetection, Owlv2Processor

    images = [_blocks(0, 24, 32), _blocks(1, 32, 20), _blocks(2, 32, 32)]
    meta = [
        {
            "tag": "color_attr",
            "include": [
                {"class": "cat", "count": 1, "color": "red"},
                {"class": "tv remote", "count": 1, "color": "blue"},
            ],
        },
        {
            "tag": "counting",
            "include": [{"class": "giraffe", "count": 2}],
            "exclude": [{"class": "giraffe", "count": 3}],
        },
        {
            "tag": "position",
            "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1, "position": ["above", 0]}],
            "exclude": [{"class": "kite", "count": 1}],
        },
    ]
    queries = [["cat", "tv remote"], ["giraffe"], ["dog", "cat", "kite"]]
    model = Owlv2ForObjectDetection.from_pretrained(models["owlv2"], local_files_only=True).eval()
    processor = Owlv2Processor.from_pretrained(models["owlv2"], local_files_only=True)
    expected = []
    for image, item, names in zip(images, meta, queries, strict=True):
        inputs = processor(text=[[f"a photo of a {n}" for n in names]], images=[image], return_tensors="pt")
        result = processor.image_processor.post_process_object_detection(
            model(**inputs), threshold=0.0, target_sizes=[(image.height, image.width)]
        )[0]
        detections = [
            Detection(
                names[int(label)], _clamped(box.tolist(), image.width, image.height), None, float(score)
            )
            for score, label, box in zip(result["scores"], result["labels"], result["boxes"], strict=True)
        ]
        expected.append(
            evaluate(item, _manual_colors(clip_ref, image, detections), threshold=0.5, counting_threshold=0.5)
        )
    args = {"detector": str(models["owlv2"]), "clip": str(models["clip"]), "device": "cpu"}
    args |= {"threshold": "0.5", "counting_threshold": "0.5"}
    got = get_reward("geneval", args).evaluate_batch(images, ["p"] * 3, meta)
    for g, e in zip(got, expected, strict=True):
        assert (g.strict, g.reasons) == (e.strict, e.reasons)
        assert g.credits == pytest.approx(e.credits)
    assert len({g.credits for g in got}) == 3


# --- arguments and errors -------------------------------------------------------------------------------


def test_arguments_are_checked_in_one_line(models, tmp_path):
    detr, clip = str(models["detr"]), str(models["clip"])
    with pytest.raises(UserInputError, match=r"--reward-arg geneval\.detector=PATH"):
        get_reward("geneval", {"clip": clip})
    with pytest.raises(UserInputError, match=r"--reward-arg geneval_strict\.clip=PATH"):
        get_reward("geneval_strict", {"detector": detr})
    with pytest.raises(UserInputError, match="model_type 'clip', not one of detr, owlv2"):
        get_reward("geneval", {"detector": clip, "clip": clip})
    with pytest.raises(UserInputError, match=r"threshold=1\.5 must be in \[0, 1\)"):
        get_reward("geneval", {"detector": detr, "clip": clip, "threshold": "1.5"})
    reward = get_reward("geneval", {"detector": detr, "clip": clip, "device": "cpu"})
    assert reward_files("geneval", {"detector": detr, "clip": clip, "device": "cpu"}) == {
        "detector": models["detr"],
        "clip": models["clip"],
    }
    image = [_blocks(0, 48, 64)]
    with pytest.raises(UserInputError, match="'unicorn' is not a label of detector"):
        reward(image, ["p"], [{"tag": "single_object", "include": [{"class": "unicorn", "count": 1}]}])
    with pytest.raises(UserInputError, match="colour 'gray' is not one of red, orange"):
        reward(image, ["p"], [{"tag": "colors", "include": [{"class": "cat", "count": 1, "color": "gray"}]}])


@pytest.fixture(scope="module")
def geneval_set(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Image.Image], list[dict]]:
    """A 2-row image rollout whose prompt_meta carries GenEval clauses."""
    from stages.shards.writer import ShardSetWriter

    out = tmp_path_factory.mktemp("geneval_set") / "samples"
    images = [_blocks(5, 48, 64), _blocks(6, 48, 64)]
    meta = [
        {"tag": "single_object", "include": [{"class": "bus", "count": 1}]},
        {"tag": "colors", "include": [{"class": "sheep", "count": 2, "color": "red"}]},
    ]
    writer = ShardSetWriter(
        out, num_shards=1, command="sample", config={}, kinds={"image": "image", "prompt_meta": "json"}
    )
    blobs = []
    for image in images:
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        blobs.append(buffer.getvalue())
    writer.write_shard(
        0,
        {
            "sample_id": ["s0", "s1"],
            "prompt": ["a bus", "two red sheep"],
            "prompt_meta": meta,
            "image": blobs,
        },
    )
    writer.finalize(extra={"modality": "image"})
    return out, images, meta


def test_score_cli_runs_geneval_and_refuses_a_missing_detector(models, geneval_set, tmp_path):
    from stages.shards.reader import ShardSet

    samples, images, meta = geneval_set
    base = ["score", "--in", str(samples), "--reward", "geneval", "--out", str(tmp_path / "r")]
    fails(base, "reward 'geneval' needs its detector", "--reward-arg geneval.detector=PATH")
    fails([*base, "--reward-arg", f"geneval.detector={models['detr']}"], "--reward-arg geneval.clip=PATH")
    assert not (tmp_path / "r").exists()
    args = [f"geneval.detector={models['detr']}", f"geneval.clip={models['clip']}", "geneval.device=cpu"]
    run(*base, *[item for arg in args for item in ("--reward-arg", arg)])
    expected = get_reward(
        "geneval", {"detector": str(models["detr"]), "clip": str(models["clip"]), "device": "cpu"}
    )(images, ["a bus", "two red sheep"], meta)
    assert ShardSet(tmp_path / "r").read_all()["reward.geneval"].tolist() == pytest.approx(expected, abs=1e-6)
    recorded = ShardSet(tmp_path / "r").manifest.config
    assert set(recorded["reward_args_sha256"]) == {"geneval.detector", "geneval.clip"}
    assert recorded["reward_args"]["geneval"]["device"] == "cpu"
