"""verl-format Parquet and EasyR1-style rows read as VLM prompts, images kept as bytes."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from stages.errors import UserInputError
from stages.sample.vlm_data import read_vlm_prompts, unpack_images


def _png(colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (28, 28), colour).save(buf, format="PNG")
    return buf.getvalue()


def test_verl_parquet_rows_read_as_they_are(tmp_path: Path) -> None:
    rows = [
        {
            "data_source": "hiyouga/geometry3k",
            "prompt": [{"role": "user", "content": "<image>Find x. Put the answer in \\boxed{}."}],
            "images": [{"bytes": _png((255, 0, 0)), "path": None}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "12"},
            "extra_info": {"split": "train", "index": 7},
        }
    ]
    path = tmp_path / "geo3k.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    (p,) = read_vlm_prompts(path)
    assert p.question == "Find x. Put the answer in \\boxed{}."
    assert p.images == [rows[0]["images"][0]["bytes"]]
    assert p.meta == {
        "ground_truth": "12",
        "data_source": "hiyouga/geometry3k",
        "extra_info": {"split": "train", "index": 7},
    }


def test_easyr1_rows_and_placeholder_checks(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(_png((0, 255, 0)))
    path = tmp_path / "raw.jsonl"
    path.write_text(
        json.dumps({"problem": "<image>What colour?", "answer": "green", "images": ["a.png"]}) + "\n"
    )
    (p,) = read_vlm_prompts(path, layout="easyr1")
    assert (
        p.question == "What colour?" and p.meta["ground_truth"] == "green" and p.images[0][:4] == b"\x89PNG"
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"problem": "<image><image>Two?", "answer": "x", "images": ["a.png"]}) + "\n")
    with pytest.raises(UserInputError, match="2 <image> placeholders but column 'images' holds 1 images"):
        read_vlm_prompts(bad, layout="easyr1")
    with pytest.raises(UserInputError, match="no 'prompt' column"):
        read_vlm_prompts(path)


def test_packed_images_of_schema_1_unpack_and_every_cut_or_pad_is_a_one_line_error() -> None:
    images = [_png((255, 0, 0)), b"", _png((0, 0, 255))]
    # the version-1 blob, byte by byte: magic, count (u32 LE), lengths (u64 LE each), the files
    header = b"OMNIIMG1" + len(images).to_bytes(4, "little")
    blob = header + b"".join(len(b).to_bytes(8, "little") for b in images) + b"".join(images)
    assert unpack_images(blob, "s") == images
    assert unpack_images(b"OMNIIMG1" + bytes(4), "s") == []
    for cut in range(len(blob)):  # includes blobs shorter than the header their count announces
        with pytest.raises(UserInputError, match=r"^s: the (images column|packed images)"):
            unpack_images(blob[:cut], "s")
    with pytest.raises(UserInputError, match="truncated or padded"):
        unpack_images(blob + b"\0", "s")
