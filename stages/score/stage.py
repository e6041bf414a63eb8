"""The `score` stage: rewards for every sample of a shard set, written as their own column group."""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any

from stages.errors import UserInputError
from stages.score.scoring import score_batch

NEEDED = ("sample_id", "prompt", "prompt_meta", "image")


def decode_images(blobs: Sequence[bytes], sample_ids: Sequence[str]) -> list[Any]:
    """PNG/JPEG bytes → RGB PIL images; an undecodable blob names its sample."""
    from PIL import Image

    images = []
    for blob, sid in zip(blobs, sample_ids):
        try:
            images.append(Image.open(io.BytesIO(blob)).convert("RGB"))
        except Exception:
            raise UserInputError(
                f"sample {sid!r}: its image bytes are not a readable image; re-run `omnirl sample`"
            ) from None
    return images


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

    missing = [c for c in NEEDED if c not in shard]
    if missing:
        raise UserInputError(
            f"--in: column '{missing[0]}' is missing; score reads the output of `omnirl sample`"
        )
    n = len(shard["sample_id"])
    parts: list[dict[str, Any]] = []
    for start in range(0, n, batch_size):
        stop = min(n, start + batch_size)
        ids = list(shard["sample_id"][start:stop])
        meta = [m if isinstance(m, dict) else {} for m in shard["prompt_meta"][start:stop]]
        parts.append(
            score_batch(
                specs,
                decode_images(shard["image"][start:stop], ids),
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
