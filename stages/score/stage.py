"""The `score` stage: rewards for every sample of a shard set, written as their own column group.

An image rollout's scorers get the decoded images; a text-response rollout's (VLM `sample`) get the
response strings, with `response_length` (tokens) added to each row's meta for length rewards. Each
reward's declared kind (`registry.reward_kind`) must match the rollout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from stages.errors import UserInputError
from stages.sample.vlm_data import decode_image
from stages.score.registry import reward_kind
from stages.score.scoring import score_batch

BASE = ("sample_id", "prompt", "prompt_meta")


def output_column(columns: Any) -> str:
    """The column scorers read: `response_text` for a text rollout, else `image` (checked on the
    columns a shard was read with, which hold the output column but not the token ids)."""
    return "response_text" if "response_text" in columns else "image"


def needed_columns(columns: Any) -> list[str]:
    """The input columns `score_shard` reads from a rollout with these columns."""
    out = output_column(columns)
    return [*BASE, out, *(["response_length"] if out == "response_text" else [])]


def decode_images(blobs: Sequence[bytes], sample_ids: Sequence[str]) -> list[Any]:
    """PNG/JPEG bytes → RGB PIL images; an undecodable blob names its sample."""
    return [decode_image(blob, f"sample {sid!r}") for blob, sid in zip(blobs, sample_ids)]


def score_shard(
    shard: dict[str, Any],
    specs: list[tuple[str, float]],
    *,
    batch_size: int = 32,
    on_error: str = "fail",
    on_batch: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Columns sample_id, reward [N] and reward.<name> [N] for one shard's rows."""
    import torch

    missing = [c for c in needed_columns(shard) if c not in shard]
    if missing:
        raise UserInputError(
            f"--in: column '{missing[0]}' is missing; score reads the output of `omnirl sample`"
        )
    text = output_column(shard) == "response_text"
    want = "text" if text else "image"
    for name, _ in specs:
        if reward_kind(name) != want:
            raise UserInputError(
                f"--reward {name}: it scores {reward_kind(name)}s but this rollout has {want} outputs; "
                "pick a reward of the matching kind"
            )
    n = len(shard["sample_id"])
    parts: list[dict[str, Any]] = []
    for start in range(0, n, batch_size):
        stop = min(n, start + batch_size)
        ids = list(shard["sample_id"][start:stop])
        meta = [dict(m) if isinstance(m, dict) else {} for m in shard["prompt_meta"][start:stop]]
        if text:
            for row, length in zip(meta, shard["response_length"][start:stop].tolist()):
                row["response_length"] = int(length)
        outputs = (
            list(shard["response_text"][start:stop])
            if text
            else decode_images(shard["image"][start:stop], ids)
        )
        parts.append(
            score_batch(
                specs,
                outputs,
                list(shard["prompt"][start:stop]),
                meta,
                sample_ids=ids,
                on_error=on_error,
            )
        )
        if on_batch:
            on_batch(stop - start)
    out: dict[str, Any] = {"sample_id": list(shard["sample_id"])}
    for key in parts[0] if parts else ():
        out[key] = torch.cat([p[key] for p in parts])
    return out
