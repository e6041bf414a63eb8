"""Row tables and text files users bring (Parquet, JSONL, text) and the images they reference, read
with clear errors."""

from __future__ import annotations

import codecs
import io
import json
from pathlib import Path
from typing import Any

from stages.errors import UserInputError


def read_text(path: Path, option: str) -> str:
    """A user's text file decoded as UTF-8 (a leading byte-order mark is dropped, as Excel writes one).

    Other encodings (Latin-1, UTF-16 ...) are a one-line error naming the file and the first bad line.
    """
    data = path.read_bytes().removeprefix(codecs.BOM_UTF8)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise UserInputError(
            f"{option} {path}: line {line} is not UTF-8 text (byte 0x{data[exc.start]:02x}); "
            "save the file as UTF-8"
        ) from None


def read_rows(path: Path, option: str) -> list[dict[str, Any]]:
    """All rows of a .parquet or .jsonl table as dicts; `option` names the flag in error messages."""
    if not path.is_file():
        raise UserInputError(f"{option} {path}: no such file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as exc:
            raise UserInputError(f"{option} {path}: not a readable Parquet file ({exc})") from None
    if path.suffix in (".jsonl", ".json"):
        rows = []
        for i, line in enumerate(read_text(path, option).splitlines()):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    raise UserInputError(f"{option} {path}: line {i + 1} is not valid JSON") from None
        return rows
    raise UserInputError(f"{option} {path}: use a .parquet or .jsonl table")


def png_bytes(image: Any) -> bytes:
    """A PIL image as lossless PNG bytes."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def image_bytes(value: Any, base: Path, where: str) -> bytes:
    """Encoded image bytes from raw bytes, an HF {bytes, path} struct, or a path relative to `base`."""
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str) and value:
        file = Path(value) if Path(value).is_absolute() else base / value
        if not file.is_file():
            raise UserInputError(f"{where}: image file {file} not found")
        return file.read_bytes()
    raise UserInputError(f"{where}: an image must be bytes, a {{bytes, path}} struct or a file path")
