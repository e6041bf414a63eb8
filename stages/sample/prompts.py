"""Prompt files: text (one per line), JSONL, CSV, Parquet, and verl-style Parquet.

Every format yields `Prompt(text, negative, meta)`: `meta` carries the row's other fields (an OCR
target, a GenEval spec, verl's `reward_model` / `extra_info` ...) to the scorers as `prompt_meta`.
"""

from __future__ import annotations

import csv
import io
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stages.errors import UserInputError
from stages.tables import read_rows, read_text

PROMPT_KEYS = ("prompt", "text", "caption", "problem")


@dataclass
class Prompt:
    text: str
    negative: str = ""
    meta: dict[str, Any] = field(default_factory=dict)


def _chat_text(messages: list[Any], path: Path, row: int) -> str:
    """The user's text of a verl chat-message prompt (`[{role, content}, ...]`)."""
    texts = [
        m.get("content", "") for m in messages if isinstance(m, dict) and m.get("role", "user") == "user"
    ]
    texts = [t if isinstance(t, str) else json.dumps(t) for t in texts]
    if not texts:
        raise UserInputError(f"{path}: row {row}: the prompt's chat messages have no user message")
    return "\n".join(texts)


def _from_record(rec: dict[str, Any], path: Path, row: int) -> Prompt:
    key = next((k for k in PROMPT_KEYS if k in rec), None)
    if key is None:
        raise UserInputError(
            f"{path}: row {row}: no prompt column (expected one of {', '.join(PROMPT_KEYS)})"
        )
    value = rec[key]
    if isinstance(value, list):
        text = _chat_text(value, path, row)
    elif isinstance(value, str):
        text = value
    else:
        raise UserInputError(
            f"{path}: row {row}: column '{key}' must be text or chat messages, got {type(value).__name__}"
        )
    negative = rec.get("negative_prompt") or ""
    meta = {k: v for k, v in rec.items() if k not in (key, "negative_prompt")}
    return Prompt(text=text, negative=str(negative), meta=meta)


def read_prompts(path: str | Path) -> list[Prompt]:
    """Read a prompt file; the format follows the suffix (.txt, .jsonl, .json, .csv, .parquet)."""
    path = Path(path)
    if not path.is_file():
        raise UserInputError(f"--prompts {path}: no such file")
    suffix = path.suffix.lower()
    if suffix in (".txt", ".text", ""):
        lines = read_text(path, "--prompts").splitlines()
        prompts = [Prompt(line.strip()) for line in lines if line.strip()]
    elif suffix in (".jsonl", ".json", ".parquet"):
        rows = read_rows(path, "--prompts")
        prompts = [
            _from_record(r if isinstance(r, dict) else {"prompt": r}, path, i) for i, r in enumerate(rows)
        ]
    elif suffix == ".csv":
        reader = csv.DictReader(io.StringIO(read_text(path, "--prompts"), newline=""))
        try:
            prompts = [_from_record(rec, path, i) for i, rec in enumerate(reader)]
        except csv.Error as exc:
            raise UserInputError(
                f"--prompts {path}: line {reader.line_num + 1} is not valid CSV ({exc})"
            ) from None
    else:
        raise UserInputError(
            f"--prompts {path}: unknown prompt format '{suffix}' (use .txt, .jsonl, .csv or .parquet)"
        )
    if not prompts:
        raise UserInputError(f"--prompts {path}: the file holds no prompts")
    return prompts


def pick_prompts(prompts: list[Prompt], num: int | None, seed: int) -> list[tuple[int, Prompt]]:
    """`num` prompts drawn without replacement with `seed` (all, in order, when `num` is None).

    Returns (index in the file, prompt) pairs so group ids stay stable across runs.
    """
    indexed = list(enumerate(prompts))
    if num is None or num >= len(prompts):
        return indexed
    if num <= 0:
        raise UserInputError(f"--num-prompts {num}: must be positive")
    return sorted(random.Random(seed).sample(indexed, num), key=lambda t: t[0])
