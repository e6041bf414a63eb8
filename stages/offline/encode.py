"""VAE-encode the images of a shard set into `final_latent`, for offline DPO / NFT / AWM, and store the
prompts' conditioning once (`stages.models.conditioning`), so that `update` on the result loads no text
encoder."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stages.models.conditioning import Entries
from stages.models.diffusion import FlowPolicy
from stages.models.families import Resolution
from stages.precision import autocast
from stages.score.stage import decode_images


def encode_shard(
    policy: FlowPolicy,
    shard: dict[str, Any],
    *,
    resolution: Resolution,
    batch_size: int = 8,
    mixed_precision: str = "no",
    on_batch: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Columns sample_id and final_latent [N, C, h, w] of images resized and centre-cropped to
    `resolution` (a side or (height, width); the VAE posterior mode, SD3-scaled, float32);
    the VAE encoder runs under `mixed_precision`'s autocast (`stages.precision`)."""
    import torch

    ids = list(shard["sample_id"])
    latents = []
    for start in range(0, len(ids), batch_size):
        chunk = slice(start, start + batch_size)
        images = decode_images(shard["image"][chunk], ids[chunk])
        with autocast(mixed_precision, policy.device):
            latents.append(policy.encode_images(images, resolution).cpu())
        if on_batch:
            on_batch(len(images))
    return {"sample_id": ids, "final_latent": torch.cat(latents)}


def prompt_conditioning(
    policy: FlowPolicy,
    shard: dict[str, Any],
    *,
    max_sequence_length: int,
    batch_size: int = 8,
    mixed_precision: str = "no",
) -> Entries:
    """The conditioning of the shard's unique (prompt, negative prompt) at `max_sequence_length`, as the
    family adapter's `encode_prompts` gives it (both CFG branches, tensors without a batch dim), encoded
    `batch_size` prompts at a time under `mixed_precision`'s autocast: what `sample` stores for a rollout.
    A shard without a `negative_prompt` column has none ("")."""
    prompts = list(shard["prompt"])
    negatives = list(shard.get("negative_prompt") or [""] * len(prompts))
    keys = list(dict.fromkeys((p, n, max_sequence_length, "") for p, n in zip(prompts, negatives)))
    for start in range(0, len(keys), batch_size):
        chunk = keys[start : start + batch_size]
        with autocast(mixed_precision, policy.device):
            policy.encode([p for p, *_ in chunk], [n for _, n, *_ in chunk], False, max_sequence_length)
    return policy.conditioning(keys)
