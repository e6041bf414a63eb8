"""Prompt files in every accepted format, verl's chat-message layout, and seeded prompt picking."""

from __future__ import annotations

import codecs
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stages.errors import UserInputError
from stages.sample.prompts import pick_prompts, read_prompts


def test_every_format_gives_text_negative_and_meta(tmp_path: Path) -> None:
    (tmp_path / "p.txt").write_text('a cat\n\na sign that says "hi"\n')
    assert [p.text for p in read_prompts(tmp_path / "p.txt")] == ["a cat", 'a sign that says "hi"']
    rows = [
        {"prompt": "a dog", "negative_prompt": "blurry", "tag": "counting", "include": [{"class": "dog"}]}
    ]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + '\n"a bare string"\n')
    got = read_prompts(tmp_path / "p.jsonl")
    assert (got[0].text, got[0].negative) == ("a dog", "blurry")
    assert (
        got[0].meta == {"tag": "counting", "include": [{"class": "dog"}]} and got[1].text == "a bare string"
    )
    (tmp_path / "p.csv").write_text("caption,ocr_text\na shop sign,OPEN\n")
    (csv_prompt,) = read_prompts(tmp_path / "p.csv")
    assert csv_prompt.text == "a shop sign" and csv_prompt.meta == {"ocr_text": "OPEN"}
    verl = [
        {
            "data_source": "ocr",
            "prompt": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": 'draw "omnirl"'},
            ],
            "reward_model": {"ground_truth": "omnirl"},
        }
    ]
    pq.write_table(pa.Table.from_pylist(verl), tmp_path / "verl.parquet")
    (v,) = read_prompts(tmp_path / "verl.parquet")
    assert v.text == 'draw "omnirl"' and v.meta["reward_model"] == {"ground_truth": "omnirl"}


def test_bad_prompt_files_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match="no such folder/file"):
        read_prompts(tmp_path / "missing.txt")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(UserInputError, match="line 1 is not valid JSON"):
        read_prompts(tmp_path / "bad.jsonl")
    (tmp_path / "nokey.jsonl").write_text(json.dumps({"title": "x"}) + "\n")
    with pytest.raises(UserInputError, match="no prompt column"):
        read_prompts(tmp_path / "nokey.jsonl")
    (tmp_path / "p.yaml").write_text("a: b\n")
    with pytest.raises(UserInputError, match="unknown prompt format"):
        read_prompts(tmp_path / "p.yaml")


@pytest.mark.parametrize(
    ("name", "text", "last"),
    [
        ("p.txt", "a cat\ncafé au lait\n", "café au lait"),
        ("p.jsonl", '{"prompt": "a cat"}\n{"prompt": "café"}\n', "café"),
        ("p.csv", "prompt\ncafé\n", "café"),
    ],
)
def test_text_prompt_files_must_be_utf8_and_may_open_with_a_bom(
    tmp_path: Path, name: str, text: str, last: str
) -> None:
    path = tmp_path / name
    path.write_bytes(text.encode("latin-1"))  # é is the single byte 0xe9, on line 2
    message = f"--prompts {path}: line 2 is not UTF-8 text (byte 0xe9); save the file as UTF-8"
    with pytest.raises(UserInputError, match=re.escape(message)):
        read_prompts(path)
    path.write_bytes(codecs.BOM_UTF8 + text.encode("utf-8"))  # as Excel and Notepad save UTF-8
    assert [p.text for p in read_prompts(path)][-1] == last


def test_a_csv_row_the_csv_reader_refuses_is_a_one_line_error(tmp_path: Path) -> None:
    path = tmp_path / "long.csv"
    path.write_text("prompt\na cat\n" + "x" * 200_000 + "\n")  # past the csv module's field limit
    with pytest.raises(UserInputError, match=re.escape(f"--prompts {path}: line 3 is not valid CSV")):
        read_prompts(path)


def test_pick_prompts_is_seeded_and_keeps_file_indices(tmp_path: Path) -> None:
    (tmp_path / "p.txt").write_text("\n".join(f"prompt {i}" for i in range(20)))
    prompts = read_prompts(tmp_path / "p.txt")
    a, b = pick_prompts(prompts, 5, seed=3), pick_prompts(prompts, 5, seed=3)
    assert a == b and len(a) == 5 and [i for i, _ in a] == sorted(i for i, _ in a)
    assert all(p.text == f"prompt {i}" for i, p in a)
    assert pick_prompts(prompts, 5, seed=4) != a
    assert len(pick_prompts(prompts, None, seed=0)) == 20
