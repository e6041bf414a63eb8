"""The `make demo-omni` task: rows cycle through text, image and audio, each asking for the same kind of
digit, the sound holds exactly k beeps, the bytes depend only on the seed, and the reward loads by path."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from stages.plugins import load_object
from stages.sample.vlm_audio import decode_audio
from stages.sample.vlm_data import read_vlm_prompts

TASK = Path(__file__).resolve().parents[1] / "recipes" / "tasks" / "omni_count.py"


def _build(out: Path, seed: int) -> None:
    load_object(f"{TASK}:build", "task")(out, num_prompts=6, seed=seed)


def test_rows_cycle_through_the_modes_and_hold_their_answer(tmp_path: Path) -> None:
    _build(tmp_path / "a.parquet", 0)
    _build(tmp_path / "b.parquet", 0)
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()
    rows = pq.read_table(tmp_path / "a.parquet").to_pylist()
    assert [r["ability"] for r in rows] == ["text", "image", "audio"] * 2
    for row, prompt in zip(rows, read_vlm_prompts(tmp_path / "a.parquet")):
        k = int(row["reward_model"]["ground_truth"])
        assert 1 <= k <= 9
        if row["ability"] == "text":
            a, b = map(int, re.findall(r"\d+", row["prompt"][0]["content"]))
            assert a + b == k and not prompt.images and not prompt.audios
        elif row["ability"] == "image":
            assert Image.open(io.BytesIO(prompt.images[0])).size == (64, 64) and not prompt.audios
        else:
            wave = decode_audio(prompt.audios[0], 16000, "row")
            loud = np.abs(wave).reshape(-1, 160).max(-1) > 0.1  # 10 ms windows
            onsets = int(np.sum(loud[1:] & ~loud[:-1])) + int(loud[0])
            assert onsets == k and len(wave) == k * 3200
            assert prompt.messages[0]["content"][0] == {"type": "audio"}


def test_reward_is_the_dense_digit_reward_by_path() -> None:
    reward = load_object(f"{TASK}:reward", "reward")
    assert reward.reward_kind == "text"
    meta = [
        {"ground_truth": "7", "data_source": "omnirl/omni_count", "extra_info": {"index": i}}
        for i in range(4)
    ]
    assert reward(["7", "77", "a7", ""], ["q"] * 4, meta) == pytest.approx([1.0, 0.8, 0.4, 0.0])
