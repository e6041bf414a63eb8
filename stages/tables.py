"""Row tables users bring (Parquet or JSONL) and the images they reference, read with clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stages.errors import UserInputError


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
        for i, line in enumerate(path.read_text().splitlines()):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    raise UserInputError(f"{option} {path}: line {i + 1} is not valid JSON") from None
        return rows
    raise UserInputError(f"{option} {path}: use a .parquet or .jsonl table")


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
