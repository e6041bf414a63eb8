"""Audio prompts: every form of an `audios` entry becomes an audio file that decodes to the same samples,
placeholders pair with clips, a clip that does not decode names its row, and audio_list columns survive
both shard formats."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stages.errors import UserInputError
from stages.sample.vlm_audio import audio_bytes, decode_audio, wav_bytes
from stages.sample.vlm_data import read_vlm_prompts
from stages.shards.reader import ShardSet
from stages.shards.writer import ShardSetWriter


def wave(samples: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(samples) * 0.1).astype(np.float32)


def test_float_wav_round_trips_exactly_and_resamples_to_the_asked_rate() -> None:
    x = wave(8000)
    blob = wav_bytes(x, 16000)
    assert blob[:4] == b"RIFF" and blob[8:12] == b"WAVE" and len(blob) > 4 * len(x)
    assert np.array_equal(decode_audio(blob, 16000, "here"), x)
    assert np.array_equal(decode_audio(blob, None, "here"), x)  # None: the file's own rate
    stereo = np.stack([x, -x + 0.5])
    assert np.allclose(decode_audio(wav_bytes(stereo, 16000), 16000, "here"), 0.25, atol=1e-6)
    up = decode_audio(wav_bytes(x, 8000), 16000, "here")
    assert len(up) == 2 * len(x) and np.array_equal(up, decode_audio(wav_bytes(x, 8000), 16000, "here"))
    # a 100 Hz tone keeps its frequency through 8 kHz -> 16 kHz: its spectrum peaks at 100 Hz
    tone = np.sin(2 * np.pi * 100 * np.arange(8000) / 8000).astype(np.float32)
    spectrum = np.abs(np.fft.rfft(decode_audio(wav_bytes(tone, 8000), 16000, "here")))
    assert np.argmax(spectrum) * 16000 / (2 * len(spectrum) - 2) == pytest.approx(100, abs=1)


def test_every_entry_form_gives_the_same_audio_file(tmp_path: Path) -> None:
    x = wave(4000)
    blob = wav_bytes(x, 16000)
    (tmp_path / "clips").mkdir()
    (tmp_path / "clips" / "a.wav").write_bytes(blob)
    forms = [
        blob,
        memoryview(blob),
        "clips/a.wav",
        str(tmp_path / "clips" / "a.wav"),
        {"bytes": blob, "path": None},
        {"bytes": None, "path": "clips/a.wav"},
        {"array": x, "sampling_rate": 16000, "path": None},
        (x, 16000),
    ]
    for form in forms:
        assert audio_bytes(form, tmp_path, "row 0") == blob, type(form)
    with pytest.raises(UserInputError, match=r"^row 4: audio file 'missing.wav' not found"):
        audio_bytes("missing.wav", tmp_path, "row 4")
    with pytest.raises(UserInputError, match="positive integer sampling_rate"):
        audio_bytes({"array": x, "sampling_rate": None}, tmp_path, "row 4")


def _rows(audios: list, content: str) -> list[dict]:
    return [
        {
            "data_source": "sounds",
            "prompt": [{"role": "user", "content": content}],
            "images": [],
            "audios": audios,
            "reward_model": {"style": "rule", "ground_truth": "beep"},
            "extra_info": {"index": 0},
        }
    ]


def test_placeholders_take_the_clips_in_order(tmp_path: Path) -> None:
    a, b = wav_bytes(wave(1600, 1), 16000), wav_bytes(wave(3200, 2), 8000)
    path = tmp_path / "sounds.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            _rows([{"bytes": a, "path": None}, {"bytes": b, "path": None}], "First <audio> then <audio>?")
        ),
        path,
    )
    (p,) = read_vlm_prompts(path)
    assert p.audios == [a, b] and p.question == "First  then ?"
    assert p.messages[0]["content"] == [
        {"type": "text", "text": "First "},
        {"type": "audio"},
        {"type": "text", "text": " then "},
        {"type": "audio"},
        {"type": "text", "text": "?"},
    ]
    pq.write_table(pa.Table.from_pylist(_rows([{"bytes": a, "path": None}], "What is it?")), path)
    (p,) = read_vlm_prompts(path)  # no placeholder: the clip goes first
    assert p.messages[0]["content"] == [{"type": "audio"}, {"type": "text", "text": "What is it?"}]
    pq.write_table(pa.Table.from_pylist(_rows([{"bytes": a, "path": None}], "<audio><audio>?")), path)
    with pytest.raises(
        UserInputError, match="row 0: 2 <audio> placeholders but column 'audios' holds 1 audios"
    ):
        read_vlm_prompts(path)


def test_a_clip_that_does_not_decode_names_its_row(tmp_path: Path) -> None:
    good = {"bytes": wav_bytes(wave(1600), 16000), "path": None}
    rows = _rows([good], "<audio>?") + _rows([{"bytes": b"RIFF....not a wave", "path": None}], "<audio>?")
    path = tmp_path / "broken.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(UserInputError) as error:
        read_vlm_prompts(path)
    message = str(error.value)
    assert "\n" not in message and "row 1" in message and "broken.parquet" in message
    assert "does not decode" in message


@pytest.mark.parametrize("fmt", ["parquet", "webdataset"])
def test_audio_list_columns_round_trip(tmp_path: Path, fmt: str) -> None:
    clips = [[wav_bytes(wave(800, 1), 16000), b"fLaC-not-checked-here"], [], [wav_bytes(wave(400, 2), 8000)]]
    writer = ShardSetWriter(
        tmp_path / "set", num_shards=1, format=fmt, command="test", config={}, kinds={"audios": "audio_list"}
    )
    writer.write_shard(0, {"sample_id": ["a", "b", "c"], "audios": clips})
    writer.finalize()
    shard_set = ShardSet(tmp_path / "set")
    assert shard_set.columns["audios"].kind == "audio_list"
    assert shard_set.read_all()["audios"] == clips
    if fmt == "parquet":
        (part,) = (tmp_path / "set").glob("*.parquet")
        metadata = pq.read_schema(part).metadata or {}
        features = json.loads(metadata.get(b"huggingface", b"{}"))
        assert "audios" not in json.dumps(features)  # no datasets feature: Audio would decode with torchcodec
