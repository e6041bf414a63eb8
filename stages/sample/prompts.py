"""Prompts for diffusion sampling from any prompt source (`stages.sample.sources`): text (one per line),
JSONL, CSV, Parquet, verl-style Parquet, folders, globs, saved and Hub datasets.

Every row yields `Prompt(text, negative, meta, images)`: `meta` carries the row's other fields (an OCR
target, a GenEval spec, verl's `reward_model` / `extra_info` ...) to the scorers as `prompt_meta`;
`images` its condition images (column `image` or `images`, `stages.models.condition_images`) for an
editing model.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from stages.errors import UserInputError
from stages.models.condition_images import COLUMNS as IMAGE_COLUMNS
from stages.models.condition_images import row_images
from stages.sample.sources import PromptSource, SourceRow

T = TypeVar("T")

PROMPT_KEYS = ("prompt", "text", "caption", "problem")


@dataclass
class Prompt:
    text: str
    negative: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    images: list[bytes] = field(default_factory=list)  # condition images, encoded files (none: text only)


def _chat_text(messages: list[Any], where: str) -> str:
    """The user's text of a verl chat-message prompt (`[{role, content}, ...]`)."""
    texts = [
        m.get("content", "") for m in messages if isinstance(m, dict) and m.get("role", "user") == "user"
    ]
    texts = [t if isinstance(t, str) else json.dumps(t) for t in texts]
    if not texts:
        raise UserInputError(f"{where}: the prompt's chat messages have no user message")
    return "\n".join(texts)


def _from_record(rec: dict[str, Any], where: str, base: Path) -> Prompt:
    key = next((k for k in PROMPT_KEYS if k in rec), None)
    if key is None:
        raise UserInputError(f"{where}: no prompt column (expected one of {', '.join(PROMPT_KEYS)})")
    value = rec[key]
    if isinstance(value, list):
        text = _chat_text(value, where)
    elif isinstance(value, str):
        text = value
    else:
        raise UserInputError(
            f"{where}: column '{key}' must be text or chat messages, got {type(value).__name__}"
        )
    negative = rec.get("negative_prompt") or ""
    meta = {k: v for k, v in rec.items() if k not in (key, "negative_prompt", *IMAGE_COLUMNS)}
    return Prompt(text=text, negative=str(negative), meta=meta, images=row_images(rec, base, where))


def _prompt(row: SourceRow) -> Prompt:
    return _from_record(row.data, row.where, row.base)


def read_prompts(source: PromptSource | str | Path | Sequence[str | Path]) -> list[Prompt]:
    """Every prompt of a source (files, folders, globs, saved or Hub datasets: `stages.sample.sources`)."""
    return [p for _, p in pick_rows(source, None, 0, _prompt)]


def sample_prompts(
    source: PromptSource | str | Path | Sequence[str | Path], num: int | None, seed: int
) -> list[tuple[int, Prompt]]:
    """`pick_prompts` over a source, reading only the picked rows (a large Parquet set is streamed)."""
    return pick_rows(source, num, seed, _prompt)


def pick_indices(total: int, num: int | None, seed: int) -> list[int] | None:
    """`num` of `total` row indices drawn without replacement with `seed`, sorted (None: all rows)."""
    if num is None or num >= total:
        return None
    if num <= 0:
        raise UserInputError(f"--num-prompts {num}: must be positive")
    return sorted(random.Random(seed).sample(range(total), num))


def pick_rows(
    source: PromptSource | str | Path | Sequence[str | Path],
    num: int | None,
    seed: int,
    convert: Callable[[SourceRow], T],
) -> list[tuple[int, T]]:
    """(index in the source, `convert(row)`) for `num` rows drawn with `seed` (all, in order, when None)."""
    if not isinstance(source, PromptSource):
        source = PromptSource(source)
    total = source.num_rows
    if not total:
        raise UserInputError(f"--prompts {source.label}: holds no prompts")
    return [(row.index, convert(row)) for row in source.rows(pick_indices(total, num, seed))]


def pick_prompts(prompts: list[Prompt], num: int | None, seed: int) -> list[tuple[int, Prompt]]:
    """`num` prompts drawn without replacement with `seed` (all, in order, when `num` is None).

    Returns (index in the file, prompt) pairs so group ids stay stable across runs; the same draw as
    `sample_prompts` over the file.
    """
    picked = pick_indices(len(prompts), num, seed)
    return [(i, prompts[i]) for i in (range(len(prompts)) if picked is None else picked)]
