"""MP4 video media: encode/decode within codec tolerance, frame count and fps, corrupt bytes, and the
`video` column kind in both shard formats (geometry and fps in the manifest, shown by `inspect`)."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
from fractions import Fraction

import numpy as np
import pytest
from helpers import run
from PIL import Image
from test_shards import mp4_bytes, write_set

from stages.errors import UserInputError
from stages.media import media_columns, output_modality, video
from stages.media.video import MediaDecodeError, decode_mp4, encode_mp4, encode_mp4s, probe_mp4
from stages.shards import ShardSet


def smooth_frames(count: int, width: int = 48, height: int = 32) -> list[Image.Image]:
    """Colourful frames that change smoothly in space and time (what a video model decodes)."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float64)
    frames = []
    for t in range(count):
        r = 128 + 90 * np.sin(xx / 9 + t / 3) * np.cos(yy / 11)
        g = 128 + 90 * np.cos(xx / 13 - t / 4)
        b = 60 + 2 * xx + yy + 5 * t
        frames.append(Image.fromarray(np.stack([r, g, b], -1).clip(0, 255).astype(np.uint8)))
    return frames


def psnr_and_max_abs(a: list[Image.Image], b: list[Image.Image]) -> tuple[float, float]:
    diff = np.stack([np.asarray(x, np.float64) - np.asarray(y, np.float64) for x, y in zip(a, b)])
    return 10 * np.log10(255**2 / np.mean(diff**2)), float(np.abs(diff).max())


def test_mp4_decodes_back_to_the_frames_within_codec_tolerance() -> None:
    frames = smooth_frames(9)
    video = decode_mp4(encode_mp4(frames, 16))
    assert len(video.frames) == 9 and video.fps == 16.0
    assert all(f.size == (48, 32) and f.mode == "RGB" for f in video.frames)
    psnr, max_abs = psnr_and_max_abs(frames, video.frames)
    # measured 37.6 dB and 19 at crf 18: yuv420p halves the chroma resolution, so not lossless
    assert psnr > 35 and max_abs <= 32, (psnr, max_abs)
    # flat colour survives up to the RGB↔YUV rounding (measured max |Δ| 2)
    flat = [Image.new("RGB", (16, 16), (200, 30, 90))] * 3
    assert psnr_and_max_abs(flat, decode_mp4(encode_mp4(flat, 8)).frames)[1] <= 3


@pytest.mark.parametrize(("count", "fps"), [(1, 16.0), (5, 24.0), (17, 30000 / 1001), (4, 8.0)])
def test_mp4_has_the_requested_frame_count_and_fps(count: int, fps: float) -> None:
    data = encode_mp4(smooth_frames(count, 16, 8), fps)
    info = probe_mp4(data)
    assert (info.frames, info.width, info.height) == (count, 16, 8)
    assert info.fps == pytest.approx(fps, rel=1e-9)
    video = decode_mp4(data)
    assert len(video.frames) == count and video.fps == pytest.approx(fps, rel=1e-9)


@pytest.mark.skipif(shutil.which("ffprobe") is None, reason="ffprobe not installed")
def test_mp4_is_h264_yuv420p_for_ffprobe(tmp_path) -> None:
    path = tmp_path / "v.mp4"
    path.write_bytes(encode_mp4(smooth_frames(7), 24))
    out = subprocess.run(
        ["ffprobe", "-v", "error", "-count_frames", "-show_streams", "-of", "json", str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    (stream,) = json.loads(out.stdout)["streams"]
    assert (stream["codec_name"], stream["pix_fmt"]) == ("h264", "yuv420p")
    assert (stream["width"], stream["height"]) == (48, 32)
    assert int(stream["nb_read_frames"]) == 7 and Fraction(stream["avg_frame_rate"]) == 24


def test_mp4_bytes_are_deterministic_and_need_even_sizes() -> None:
    frames = smooth_frames(3)
    assert encode_mp4(frames, 16) == encode_mp4(frames, 16)
    with pytest.raises(ValueError, match="even width and height"):
        encode_mp4([Image.new("RGB", (15, 8))], 16)
    with pytest.raises(ValueError, match="frame 1"):
        encode_mp4([Image.new("RGB", (16, 8)), Image.new("RGB", (8, 8))], 16)
    with pytest.raises(UserInputError, match="--fps"):
        encode_mp4(frames, 0)


def test_mp4_bytes_do_not_depend_on_the_hosts_cpu_count(monkeypatch) -> None:
    frames = smooth_frames(9, 128, 128)  # x264 with one thread encodes this clip to other bytes
    here = encode_mp4(frames, 16)
    for cpus in (1, 2, 16):
        monkeypatch.setattr(video.os, "sched_getaffinity", lambda _pid, n=cpus: set(range(n)))
        assert video.x264_threads() == max(2, cpus * 3 // 2)
        assert encode_mp4(frames, 16) == here


def test_concurrent_batch_encoding_gives_each_clips_own_bytes_in_order() -> None:
    clips = [smooth_frames(3 + i, 16 + 8 * i, 8) for i in range(5)]  # distinct lengths and sizes
    alone = [encode_mp4(frames, 16) for frames in clips]
    assert len(set(alone)) == 5
    assert encode_mp4s(clips, 16) == alone
    assert media_columns(clips, 16) == {"video": alone}
    assert encode_mp4s(clips[:1], 16) == alone[:1] and encode_mp4s([], 16) == []


def test_corrupt_and_truncated_mp4_raise_media_decode_error() -> None:
    data = encode_mp4(smooth_frames(6), 16)
    cases = {
        "no 'ftyp'": b"not a video at all, just some bytes",
        "truncated": data[: len(data) // 2],
        "'moov' box needs": data[:-10],  # the index at the end cut short
        "stray bytes": data + b"\x00\x01",
    }
    for needle, bad in cases.items():
        with pytest.raises(MediaDecodeError, match=needle):
            decode_mp4(bad)
    with pytest.raises(MediaDecodeError, match="ftyp"):
        probe_mp4(b"")


def test_media_columns_of_images_and_frame_lists() -> None:
    images = [Image.new("RGB", (8, 8), (i, 0, 0)) for i in range(2)]
    assert list(media_columns(images, 16)) == ["image"]
    videos = [smooth_frames(3, 16, 8), smooth_frames(3, 16, 8)]
    out = media_columns(videos, 12, save_frames=True)
    assert list(out) == ["video", "frames"]
    assert [probe_mp4(v).frames for v in out["video"]] == [3, 3]
    assert probe_mp4(out["video"][0]).fps == 12
    # the saved frames are lossless PNGs of what decode returned
    first = Image.open(io.BytesIO(out["frames"][1][2]))
    assert np.array_equal(np.asarray(first), np.asarray(videos[1][2]))
    with pytest.raises(ValueError, match="mixes"):
        media_columns([images[0], videos[0]], 16)
    assert output_modality(["string", "video"]) == "video" and output_modality(["image"]) == "image"


@pytest.mark.parametrize("fmt", ["parquet", "webdataset"])
def test_video_column_round_trip_with_geometry_and_fps(tmp_path, fmt: str) -> None:
    shards = [
        {
            "sample_id": [f"s{s}-{r}" for r in range(3)],
            "video": [mp4_bytes(10 * s + r, 3, 16) for r in range(3)],
        }
        for s in range(2)
    ]
    write_set(tmp_path / "set", shards, fmt, kinds={"video": "video"})
    shard_set = ShardSet(tmp_path / "set")
    column = shard_set.columns["video"]
    assert (column.kind, column.shape, column.fps) == ("video", (3, 16, 16), 16.0)
    got = shard_set.read_all()
    assert got["video"] == [v for s in shards for v in s["video"]]
    assert [len(decode_mp4(v).frames) for v in got["video"]] == [3] * 6
    info = run("inspect", str(tmp_path / "set"))
    (video,) = [c for c in info["columns"] if c["name"] == "video"]
    assert video == {"name": "video", "kind": "video", "dtype": None, "shape": [3, 16, 16], "fps": 16.0}


def test_video_column_rows_share_one_geometry(tmp_path) -> None:
    batch = {"sample_id": ["a", "b"], "video": [mp4_bytes(0, 2), mp4_bytes(1, 3)]}
    with pytest.raises(
        UserInputError, match=r"column 'video' row 1 is 3 frames of 8×8 at 16 fps, row 0 2 frames"
    ):
        write_set(tmp_path / "set", [batch], "parquet", kinds={"video": "video"})
    batch = {"sample_id": ["a"], "video": [b"\x00\x00\x00\x10ftypisom\x00\x00\x00\x00"]}
    with pytest.raises(UserInputError, match="column 'video' row 0: not a readable MP4"):
        write_set(tmp_path / "bad", [batch], "parquet", kinds={"video": "video"})
