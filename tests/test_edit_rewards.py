"""Edit rewards (stages/score/edit_rewards.py) on hand-made images, and the condition image reaching every
scorer of an editing rollout (`score`, `serve-reward`) in meta["condition_images"]."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import PROMPTS, fails, run, sample_args
from PIL import Image, ImageDraw, ImageFont

from stages.errors import UserInputError
from stages.models.condition_images import stored_condition_images
from stages.score import edit_rewards
from stages.score.edit_rewards import edit_preservation, ocr_edit, ocr_edit_reward, preservation
from stages.shards.reader import ShardSet, open_inputs

GREY = (200, 200, 200)


def scene(colour: tuple[int, int, int], *, stray: bool = False) -> Image.Image:
    """10×10 grey with a 4×4 square of `colour` at columns 2-5, rows 4-7; `stray` darkens the blue
    channel of pixel (x 9, y 0) by 51 (0.2 of the range)."""
    pixels = np.full((10, 10, 3), GREY, np.uint8)
    pixels[4:8, 2:6] = colour
    if stray:
        pixels[0, 9, 2] -= 51
    return Image.fromarray(pixels)


BOX = [0.2, 0.4, 0.6, 0.8]  # the square: x 2..6, y 4..8 of 10 px


def test_preservation_is_one_minus_the_mean_difference_outside_the_region(tmp_path: Path) -> None:
    source, edited = scene((255, 0, 0)), scene((0, 0, 255), stray=True)
    meta = {"condition_images": [source], "edit_boxes": [BOX]}
    # 84 kept pixels × 3 channels; one channel of one of them is 0.2 off; the recoloured square is not counted
    want = 1 - 0.2 / (84 * 3)
    assert edit_preservation([edited, source], ["make it blue"] * 2, [meta, meta]) == [
        pytest.approx(want, abs=1e-12),
        1.0,
    ]
    # the same region as a mask file (white = edited) scores the same
    mask = np.zeros((10, 10), np.uint8)
    mask[4:8, 2:6] = 255
    Image.fromarray(mask).save(tmp_path / "mask.png")
    by_mask = {"condition_images": [source], "edit_mask": str(tmp_path / "mask.png")}
    assert edit_preservation([edited], ["make it blue"], [by_mask]) == [pytest.approx(want, abs=1e-12)]
    # no region: the whole image is compared, the recoloured square too (16 pixels, red 1 and blue 1 off)
    whole = (16 * 2 + 0.2) / (100 * 3)
    assert edit_preservation([edited], ["x"], [{"condition_images": [source]}]) == [pytest.approx(1 - whole)]
    # a result of another size is compared at the source's (a flat grey one matches the background)
    flat = Image.new("RGB", (20, 20), GREY)
    assert preservation(flat, source, np.zeros((10, 10), bool)) == pytest.approx(
        1 - 16 * (55 + 200 + 200) / 255 / 300
    )


def test_preservation_refuses_what_it_cannot_score(tmp_path: Path) -> None:
    source = scene((255, 0, 0))
    everything = {"condition_images": [source], "edit_boxes": [[0, 0, 1, 1]]}
    assert edit_preservation([source], ["x"], [everything]) == [None]
    with pytest.raises(UserInputError, match="'make it blue' has 0 condition images"):
        edit_preservation([source], ["make it blue"], [{}])
    with pytest.raises(UserInputError, match=r"edit_boxes of prompt 'x' holds \[0, 0, 2, 1\]"):
        edit_preservation([source], ["x"], [{"condition_images": [source], "edit_boxes": [[0, 0, 2, 1]]}])
    with pytest.raises(UserInputError, match=r"edit_mask .*not a readable image"):
        edit_preservation(
            [source], ["x"], [{"condition_images": [source], "edit_mask": str(tmp_path / "no.png")}]
        )


def test_ocr_edit_reward_values() -> None:
    assert ocr_edit_reward("OPEN", "open", "closed") == 1.0
    assert ocr_edit_reward("OPEN CLOSED", "open", "closed") == 0.0  # the old text is still there
    assert ocr_edit_reward("OPEM", "open", "closed") == 0.75
    assert ocr_edit_reward("reopen", "reopen", "open") == 1.0  # an old text inside the new one is no fault
    assert ocr_edit_reward("", "open", "") == 0.0


def test_ocr_edit_reads_the_old_text_in_the_source(monkeypatch: pytest.MonkeyPatch) -> None:
    source, sign = scene((255, 0, 0)), scene((0, 0, 255))
    read = {source.tobytes(): "CLOSED", sign.tobytes(): "OPEN"}
    monkeypatch.setattr(edit_rewards, "_get_engine", lambda: object())
    monkeypatch.setattr(edit_rewards, "recognize_text", lambda image: read[image.convert("RGB").tobytes()])
    prompt = 'change the sign to "open"'
    meta = {"condition_images": [source]}
    # the source still says CLOSED: 0; the edit says OPEN: 1; a given source_text wins over the source's OCR
    assert ocr_edit([source, sign], [prompt] * 2, [meta, meta]) == [0.0, 1.0]
    assert ocr_edit([source], [prompt], [{"source_text": "shut"}]) == [
        0.0 + ocr_edit_reward("CLOSED", "open", "shut")
    ]


def _sign(text: str) -> Image.Image:
    image = Image.new("RGB", (512, 256), "white")
    fonts = (
        sorted(Path("/usr/share/fonts").rglob("DejaVuSans.ttf")) if Path("/usr/share/fonts").exists() else []
    )
    font = ImageFont.truetype(str(fonts[0]), 72) if fonts else ImageFont.load_default(size=72)
    ImageDraw.Draw(image).text((24, 80), text, fill="black", font=font)
    return image


def test_real_ocr_edit_on_rendered_signs() -> None:
    pytest.importorskip("rapidocr_onnxruntime")
    prompt = 'change the word to "SALE"'
    meta = {"condition_images": [_sign("OPEN")]}
    scores = ocr_edit([_sign("SALE"), _sign("OPEN"), _sign("SALE OPEN")], [prompt] * 3, [meta] * 3)
    assert scores == [1.0, 0.0, 0.0]


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def edit_rollout(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny FLUX.1 Kontext rollout of three edits (one per source), two samples each."""
    root = tmp_path_factory.mktemp("edit-rollout")
    model = root / "kontext"
    run("init-model", "--family", "flux_kontext", "--size", "tiny", str(model))
    rows = []
    for i, (prompt, colour) in enumerate(zip(PROMPTS, [(255, 0, 0), (0, 0, 255), (0, 200, 0)])):
        scene(colour).resize((32, 32), Image.Resampling.NEAREST).save(root / f"source{i}.png")
        rows.append({"prompt": prompt, "image": f"source{i}.png", "edit_boxes": [BOX]})
    table = root / "edits.jsonl"
    table.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run(
        "sample", "--model", str(model), "--prompts", str(table), "-n", "2", "--steps", "2",
        "--batch-size", "2", "--resolution", "32", "--out", str(root / "samples"),
    )  # fmt: skip
    return {"root": root, "model": model, "table": table, "samples": root / "samples"}


def test_score_gives_every_reward_the_rows_source(edit_rollout: dict[str, Path]) -> None:
    samples = edit_rollout["samples"]
    out = edit_rollout["root"] / "rewards"
    run("score", "--in", str(samples), "--reward", "edit_preservation", "--out", str(out))
    rows = open_inputs([samples, out]).read_all(
        ["group_id", "image", "prompt_meta", "reward.edit_preservation"]
    )
    src = ShardSet(samples)
    sources = stored_condition_images([samples], [src.manifest])
    assert len(set(rows["group_id"])) == 3
    for group, image, meta, value in zip(
        rows["group_id"], rows["image"], rows["prompt_meta"], rows["reward.edit_preservation"].tolist()
    ):
        source = Image.open(io.BytesIO(sources[group][0])).convert("RGB")
        edited = edit_rewards.edited_region(meta, source.size, "")
        want = preservation(Image.open(io.BytesIO(image)), source, edited)
        assert value == pytest.approx(want, abs=1e-6) and 0.0 < value < 1.0


def test_a_text_to_image_rollout_has_no_source_for_an_edit_reward(tiny_sd3: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    run(*sample_args(tiny_sd3, prompts, tmp_path / "samples", "--steps", "2"))
    args = [
        "score",
        "--in",
        str(tmp_path / "samples"),
        "--reward",
        "edit_preservation",
        "--out",
        str(tmp_path / "r"),
    ]
    fails(args, "reward 'edit_preservation'", "0 condition images", "'image' column")


def test_the_reward_server_receives_the_source() -> None:
    from stages.score.remote import _wire_meta
    from stages.score.reward_server import RewardService

    source, edited = scene((255, 0, 0)), scene((0, 0, 255), stray=True)
    meta = {"condition_images": [source], "edit_boxes": [BOX]}
    service = RewardService([("edit_preservation", 1.0)])
    body = {
        "images": [base64.b64encode(_png(edited)).decode()],
        "prompts": ["make it blue"],
        "meta": [_wire_meta(meta)],
    }
    reply = service.score("/edit_preservation", json.dumps(body).encode())
    assert reply["rewards"]["edit_preservation"] == [pytest.approx(1 - 0.2 / (84 * 3), abs=1e-12)]


def test_online_scores_edits_against_their_sources(edit_rollout: dict[str, Path], tmp_path: Path) -> None:
    """`online`'s scorer gets each row's source as `score` does: the same edit_preservation values."""
    preset = tmp_path / "preset.yaml"
    preset.write_text(
        "sample: {steps: 2, resolution: 32, sampler: sde, group_size: 2, batch_size: 2}\n"
        "update: {algo: flow_grpo, lr: 1.0e-3, clip_range: 0.2, lora_rank: 4, lora_alpha: 8}\n"
    )
    out = tmp_path / "run"
    run(
        "online", "--config", str(preset), "--model", str(edit_rollout["model"]), "--prompts",
        str(edit_rollout["table"]), "--reward", "edit_preservation", "--iterations", "1", "--save-trajectories",
        "--out", str(out),
    )  # fmt: skip
    saved = open_inputs([out / "it0" / "samples", out / "it0" / "rewards"]).read_all(
        ["sample_id", "reward.edit_preservation"]
    )
    run(
        "score",
        "--in",
        str(out / "it0" / "samples"),
        "--reward",
        "edit_preservation",
        "--out",
        str(tmp_path / "r"),
    )
    again = ShardSet(tmp_path / "r").read_all(["sample_id", "reward.edit_preservation"])
    assert saved["sample_id"] == again["sample_id"] and len(saved["sample_id"]) == 6
    assert saved["reward.edit_preservation"].tolist() == again["reward.edit_preservation"].tolist()
