"""Video rollouts through `sample`, `score` and `report` with a stand-in video family (the tiny SD3
whose decode returns a list of frames per sample), and the video rewards: frame aggregation, temporal
consistency and video OCR against independent computations."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import PROMPTS, fails, run, sample_args
from PIL import Image, ImageOps
from test_shards import mp4_bytes

from stages.errors import UserInputError
from stages.media.video import decode_mp4
from stages.models.clip import build_tiny_clip
from stages.models.diffusion import FlowPolicy
from stages.report_sheets import KEY_FRAMES, LABEL_WIDTH, LINE_HEIGHT, contact_sheet, video_preview
from stages.score import registry
from stages.score.image_rewards import jpeg_size_kb
from stages.score.registry import (
    FrameAggregate,
    check_reward_args,
    get_reward,
    parse_reward_spec,
    reward_kind,
)
from stages.score.scoring import score_batch
from stages.shards import ShardSet, read_manifest
from stages.shards.writer import ShardSetWriter

FRAMES = 4


def as_video(image: Image.Image) -> list[Image.Image]:
    """A stand-in video family's output: four frames made from one decoded image."""
    return [image, ImageOps.mirror(image), ImageOps.flip(image), image.rotate(180)]


@pytest.fixture(scope="module")
def video_run(tiny_sd3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """run/it0/samples (with --save-frames) and run/it0/plain (without) of the stand-in video family."""
    root = tmp_path_factory.mktemp("video") / "run"
    prompts = root.parent / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    decode = FlowPolicy.decode
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(FlowPolicy, "decode", lambda self, x: [as_video(im) for im in decode(self, x)])
        run(*sample_args(tiny_sd3, prompts, root / "it0" / "samples", "--fps", "8", "--save-frames"))
        run(*sample_args(tiny_sd3, prompts, root / "it0" / "plain", "--fps", "8"))
    return root


def frames_of(png_lists: list[list[bytes]]) -> list[list[Image.Image]]:
    return [[Image.open(io.BytesIO(png)).convert("RGB") for png in row] for row in png_lists]


def test_sample_writes_an_mp4_video_column_for_frame_lists(video_run: Path) -> None:
    samples = ShardSet(video_run / "it0" / "samples")
    assert read_manifest(samples.path).extra["modality"] == "video"
    video = samples.columns["video"]
    assert (video.kind, video.shape, video.fps) == ("video", (FRAMES, 32, 32), 8.0)
    assert samples.columns["frames"].kind == "image_list" and "image" not in samples.columns
    data = samples.read_all()
    saved = frames_of(data["frames"])
    for frames, mp4 in zip(saved, data["video"]):
        # the saved frames are exactly the stand-in's output, the MP4 holds them within codec tolerance
        assert np.array_equal(np.asarray(frames[1]), np.asarray(ImageOps.mirror(frames[0])))
        decoded = decode_mp4(mp4)
        assert len(decoded.frames) == FRAMES and decoded.fps == 8.0
        diff = np.stack([np.asarray(a, float) - np.asarray(b, float) for a, b in zip(frames, decoded.frames)])
        # the tiny model's frames are close to noise, the hardest content for H.264: measured 22.7 dB
        assert 10 * np.log10(255**2 / np.mean(diff**2)) > 20
    plain = ShardSet(video_run / "it0" / "plain")
    assert "frames" not in plain.columns and plain.columns["video"] == video
    # the trajectory itself does not depend on how it is stored
    assert torch.equal(plain.read_all(["final_latent"])["final_latent"], data["final_latent"])


def test_frame_aggregations_score_the_stored_frames(video_run: Path, tmp_path: Path) -> None:
    specs = [f"jpeg_incompressibility@frames={how}" for how in ("mean", "min", "first", "last")]
    args = [arg for spec in specs for arg in ("--reward", spec)]
    for name, source in (("samples", "frames"), ("plain", "video")):
        out = tmp_path / name
        run("score", "--in", str(video_run / "it0" / name), *args, "--out", str(out))
        rewards = ShardSet(out).read_all()
        stored = ShardSet(video_run / "it0" / name).read_all([source])[source]
        videos = frames_of(stored) if source == "frames" else [decode_mp4(b).frames for b in stored]
        sizes = [[jpeg_size_kb(f) for f in frames] for frames in videos]
        want = {
            "mean": [sum(s) / len(s) for s in sizes],
            "min": [min(s) for s in sizes],
            "first": [s[0] for s in sizes],
            "last": [s[-1] for s in sizes],
        }
        for how, values in want.items():
            got = rewards[f"reward.jpeg_incompressibility@frames={how}"]
            assert got.tolist() == pytest.approx(values, rel=1e-6), (name, how)
        assert rewards["reward"].tolist() == pytest.approx([sum(v) for v in zip(*want.values())], rel=1e-6)


def test_an_image_reward_on_a_video_rollout_points_to_frames(video_run: Path, tmp_path: Path) -> None:
    fails(
        [
            "score",
            "--in",
            str(video_run / "it0" / "plain"),
            "--reward",
            "jpeg_compressibility",
            "--out",
            str(tmp_path / "r"),
        ],
        "jpeg_compressibility@frames=mean",
        "video outputs",
    )
    fails(
        [
            "score",
            "--in",
            str(video_run / "it0" / "plain"),
            "--reward",
            "ocr@frames=avg",
            "--out",
            str(tmp_path / "r"),
        ],
        "@frames=avg is not one of mean, min, first, last",
    )


def test_a_corrupt_mp4_in_a_shard_is_one_line_naming_shard_and_row(tmp_path: Path, monkeypatch) -> None:
    from stages.shards import schema

    good = mp4_bytes(0, 2)
    truncated = mp4_bytes(1, 2)[:300]
    # a writer that does not probe its videos (another tool) stored a truncated MP4 in row 1
    monkeypatch.setattr(
        schema, "_video_column", lambda name, rows: schema.Column(name, "video", shape=(2, 8, 8), fps=16.0)
    )
    writer = ShardSetWriter(
        tmp_path / "samples",
        num_shards=1,
        command="sample",
        config={},
        kinds={"video": "video", "prompt_meta": "json"},
    )
    writer.write_shard(
        0,
        {
            "sample_id": ["a", "b"],
            "group_id": ["g", "g"],
            "prompt": ["x", "y"],
            "prompt_meta": [{}, {}],
            "video": [good, truncated],
        },
    )
    writer.finalize(extra={"modality": "video"})
    monkeypatch.undo()
    line = fails(
        [
            "score",
            "--in",
            str(tmp_path / "samples"),
            "--reward",
            "jpeg_compressibility@frames=mean",
            "--out",
            str(tmp_path / "r"),
        ],
        "train-00000-of-00001.parquet",
        "column 'video' row 1 (sample 'b')",
        "truncated",
    )
    assert "row 0" not in line


def test_report_writes_contact_sheets_and_an_animated_preview(video_run: Path, tmp_path: Path) -> None:
    samples = video_run / "it0" / "samples"
    run(
        "score",
        "--in",
        str(samples),
        "--reward",
        "jpeg_compressibility@frames=last",
        "--out",
        str(video_run / "it0" / "rewards"),
    )
    sheet = contact_sheet(
        samples, video_run / "it0" / "rewards", tmp_path / "sheet.png", groups=3, per_group=2, cell=20
    )
    with Image.open(sheet) as image:
        assert image.size == (LABEL_WIDTH + 2 * KEY_FRAMES * 20, 3 * (20 + LINE_HEIGHT + 4))
        # the first sample's middle tile is its frame (4 - 1) // 2 = 1, the mirrored first frame
        frames = decode_mp4(ShardSet(samples).read_shard(0, ["video"])["video"][0]).frames
        tile = image.crop((LABEL_WIDTH + 20, LINE_HEIGHT, LABEL_WIDTH + 40, LINE_HEIGHT + 20))
        want = frames[1].resize((20, 20), Image.Resampling.NEAREST)
        assert np.array_equal(np.asarray(tile), np.asarray(want))
    preview = video_preview(samples, tmp_path / "preview.gif", count=6, columns=4, cell=16)
    with Image.open(preview) as gif:
        assert gif.size == (4 * 16, 2 * 16) and gif.n_frames == FRAMES and gif.is_animated
        # 1000 ms / 8 fps = 125 ms, stored in GIF's 10 ms units
        assert gif.info["duration"] == 120 and gif.info["loop"] == 0
    result = run("report", str(video_run))
    assert result["grids"] == [str(video_run / "it0" / "grid.png")]
    assert result["previews"] == [str(video_run / "it0" / "preview.gif")]


# --- rewards on frames ------------------------------------------------------------------------------


def flat(value: int) -> Image.Image:
    return Image.new("RGB", (8, 8), (value, 0, 0))


def red(images, prompts, meta):
    """A stand-in image reward: the red value of each (flat) image, None for red 0."""
    return [image.getpixel((0, 0))[0] or None for image in images]


def test_frame_aggregations_give_hand_computed_values(monkeypatch) -> None:
    registry.available_rewards()  # the built-ins are in the registry before it is copied
    monkeypatch.setattr(registry, "_PLUGINS", {})
    monkeypatch.setattr(registry, "_REGISTRY", {**registry._REGISTRY, "red": red})
    monkeypatch.setattr(registry, "_KINDS", {**registry._KINDS, "red": "image"})
    videos = [[flat(10), flat(40), flat(4)], [flat(7)], [flat(5), flat(0), flat(9)]]
    want = {
        "mean": [18.0, 7.0, None],
        "min": [4.0, 7.0, None],
        "first": [10.0, 7.0, 5.0],  # only the scored frame counts: frame 1's None does not
        "last": [4.0, 7.0, 9.0],
    }
    for how, values in want.items():
        name, weight = parse_reward_spec(f"red@frames={how}=2")
        assert (name, weight, reward_kind(name)) == (f"red@frames={how}", 2.0, "video")
        scorer = get_reward(name)
        assert isinstance(scorer, FrameAggregate) and scorer is get_reward(name)
        assert scorer(videos, ["p"] * 3, [{}] * 3) == values
    out = score_batch(
        [("red@frames=first", 0.5), ("red@frames=last", 1.0)],
        videos,
        ["p"] * 3,
        [{}] * 3,
        sample_ids=list("abc"),
    )
    assert out["reward"].tolist() == [0.5 * 10 + 4, 0.5 * 7 + 7, 0.5 * 5 + 9]
    with pytest.raises(UserInputError, match="scores texts"):
        reward_kind("accuracy@frames=mean")


def test_temporal_consistency_is_the_clip_cosine_of_consecutive_frames(tmp_path: Path) -> None:
    from transformers import CLIPModel, CLIPProcessor

    model_dir = tmp_path / "clip"
    build_tiny_clip(model_dir, seed=0)
    rng = np.random.default_rng(0)
    videos = [
        [Image.fromarray(rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)) for _ in range(n)]
        for n in (3, 2, 1)
    ]
    scorer = get_reward("temporal_consistency", {"model": str(model_dir), "batch_size": 2})
    got = scorer(videos, ["p"] * 3, [{}] * 3)
    model = CLIPModel.from_pretrained(model_dir, local_files_only=True).eval()
    processor = CLIPProcessor.from_pretrained(model_dir, local_files_only=True)
    for frames, value in zip(videos[:2], got[:2]):
        with torch.no_grad():
            pixels = processor(images=frames, return_tensors="pt")["pixel_values"]
            e = model.get_image_features(pixel_values=pixels)
            e = e if isinstance(e, torch.Tensor) else e.pooler_output
        e = e / e.norm(dim=-1, keepdim=True)
        cosines = [float(torch.dot(e[t], e[t + 1])) for t in range(len(frames) - 1)]
        assert value == pytest.approx(sum(cosines) / len(cosines), abs=1e-5)
    assert got[2] is None  # one frame: no consecutive pair
    assert reward_kind("temporal_consistency") == "video"
    # a CLIP image reward on frames takes its own arguments, and is its per-frame value aggregated
    resolved = check_reward_args(["clipscore@frames=min"], {"clipscore": {"model": str(model_dir)}})
    assert resolved == {"clipscore@frames=min": {"model": str(model_dir)}}
    per_frame = get_reward("clipscore", resolved["clipscore@frames=min"])
    mins = get_reward("clipscore@frames=min", resolved["clipscore@frames=min"])(
        videos, ["a", "b", "c"], [{}] * 3
    )
    for frames, prompt, value in zip(videos, "abc", mins):
        assert value == pytest.approx(
            min(per_frame(frames, [prompt] * len(frames), [{}] * len(frames))), abs=1e-6
        )


def test_video_ocr_is_flow_grpos_frame_sampled_definition(monkeypatch) -> None:
    import stages.score.ocr as ocr_module

    # frame i reads TEXT[i]; the target is "hello" (5 letters)
    text = ["hello", "x", "x", "x", "hxllo", "x", "x", "x", "zzzzz", "x", "hello world"]
    frames = [flat(i + 1) for i in range(len(text))]
    monkeypatch.setattr(ocr_module, "_get_engine", lambda: object())
    monkeypatch.setattr(ocr_module, "recognize_text", lambda image: text[image.getpixel((0, 0))[0] - 1])
    scorer = get_reward("video_ocr")
    # frames 0, 4, 8: r = 1, 1 − 1/5, 0 (dropped: r > 0 only) → mean(1, 0.8) = 0.9
    assert scorer([frames], ['a sign that says "hello"'], [{}]) == [pytest.approx(0.9)]
    # every 5th: frames 0, 5, 10: 1, 0 (dropped), "helloworld" is 5 edits from "hello" → 0 (dropped)
    assert get_reward("video_ocr", {"frame_interval": 5})([frames], ['say "hello"'], [{}]) == [1.0]
    # nothing read on any sampled frame: 0, as flow_grpo
    assert scorer([frames[1:4]], ['say "hello"'], [{}]) == [0.0]

    def broken(image):
        raise RuntimeError("engine crashed")

    monkeypatch.setattr(ocr_module, "recognize_text", broken)
    assert scorer([frames], ['say "hello"'], [{}]) == [None]
    assert reward_kind("video_ocr") == "video"
