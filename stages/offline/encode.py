"""VAE-encode the images of a shard set into `final_latent`, for offline DPO / NFT / AWM, and store the
prompts' conditioning once (`stages.models.conditioning`), so that `update` on the result loads no text
encoder."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from stages.dist import device
from stages.errors import UserInputError
from stages.models.conditioning import (
    CONDITIONING,
    Entries,
    conditioning_file,
    conditioning_record,
    write_conditioning,
)
from stages.models.diffusion import FlowPolicy
from stages.models.families import Resolution, resolution_identity
from stages.offline.config import EncodeConfig
from stages.outputs import check_format, finalize, map_shards, open_inputs, policy_info, run_config
from stages.precision import autocast, resolve_mixed_precision
from stages.sample.rollout import text_length_of
from stages.score.stage import decode_images
from stages.shards.writer import ShardSetWriter


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


def run_encode(c: EncodeConfig, display: Any) -> dict[str, Any] | None:
    """Encode `c.inputs`' images with `c.model`'s VAE into `c.out` (final_latent per row, and the
    prompts' conditioning per shard unless --in has no prompt column or stores it already), advancing
    the progress `display` (`stages.outputs.map_shards`); a finished `c.out` is left as it is. Returns
    the result this process reports (out, rows, where the conditioning is), or None on a rank of a
    launch that does not report."""
    c = replace(
        c,
        mixed_precision=resolve_mixed_precision(c.mixed_precision),  # the launcher's enters the identity
        resolution=resolution_identity(c.resolution),
    )

    src = open_inputs(c.inputs)
    if "image" not in src.columns:
        raise UserInputError("--in: no 'image' column to encode")
    writer = ShardSetWriter(
        c.out,
        num_shards=src.num_shards,
        format=check_format(c.fmt),
        command="encode",
        config=run_config(asdict(c)),
        parents=list(src.paths),
        policy=policy_info(c.model, None),
        overwrite=c.overwrite,
    )
    # the prompts' conditioning, at the text length `update` encodes these rows at, unless --in has it
    if "prompt" not in src.columns:
        conditioning = "none: --in has no prompt column"
    elif any(CONDITIONING in (m.extra or {}) for m in src.manifests):
        conditioning = "in --in: its rollout stores it"
    else:
        conditioning = "stored"
    stores = conditioning == "stored"
    text_length = text_length_of(src.manifests)
    prompts = [k for k in ("prompt", "negative_prompt") if k in src.columns] if stores else []
    extra = None
    if not writer.complete:
        policy = FlowPolicy.load(c.model, device=device(), dtype=c.dtype)

        def store(shard_index: int, shard: dict) -> None:
            entries = prompt_conditioning(
                policy,
                shard,
                max_sequence_length=text_length,
                batch_size=c.batch_size,
                mixed_precision=c.mixed_precision,
            )
            path = writer.out_dir / conditioning_file(shard_index, writer.num_shards)
            writer.out_dir.mkdir(parents=True, exist_ok=True)
            write_conditioning(path, entries, writer.content_id)

        map_shards(
            src,
            writer,
            "encoding",
            ["sample_id", "image", *prompts],
            lambda shard, advance: encode_shard(
                policy,
                shard,
                resolution=c.resolution,
                batch_size=c.batch_size,
                mixed_precision=c.mixed_precision,
                on_batch=advance,
            ),
            display=display,
            before_write=store if stores else None,
        )
        if stores:
            extra = conditioning_record(
                writer.out_dir,
                writer.num_shards,
                writer.content_id,
                model=c.model,
                dtype=c.dtype,
                max_sequence_length=text_length,
            )
    if not finalize(writer, extra):
        return None
    return {"out": str(c.out), "rows": src.num_rows, "conditioning": conditioning}
