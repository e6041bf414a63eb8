"""`omnirl encode`: VAE-encode a shard set's images into final latents."""

from __future__ import annotations

from dataclasses import asdict, replace

from stages.offline.config import EncodeConfig
from stages.outputs import check_format, finalize, map_shards, open_inputs, policy_info, run_config

from ..console import emit_json, print_result, progress
from ..generate import config_command
from ..runtime import device


def run(c: EncodeConfig, json_: bool) -> None:
    """Encode every image with the model's VAE into `final_latent`, for offline DPO, NFT and AWM.

    It also stores each unique prompt's text conditioning once per shard (conditioning-*.safetensors,
    listed in the manifest, as `sample` does), so `update` on the output loads no text encoder
    (docs/real-checkpoints.md, "What each stage loads"); not when --in has no prompt column or already
    stores it (a rollout of the in-process engine). --json says which (`conditioning`).

    Example: [bold]omnirl encode --model models/sd3 --in data/pairs --resolution 512 --out data/latents[/]
    """
    from stages.models.conditioning import (
        CONDITIONING,
        conditioning_file,
        conditioning_record,
        write_conditioning,
    )
    from stages.models.diffusion import FlowPolicy
    from stages.models.families import resolution_identity
    from stages.offline.encode import encode_shard, prompt_conditioning
    from stages.precision import resolve_mixed_precision
    from stages.sample.rollout import text_length_of
    from stages.shards.writer import ShardSetWriter

    c = replace(
        c,
        mixed_precision=resolve_mixed_precision(c.mixed_precision),  # the launcher's enters the identity
        resolution=resolution_identity(c.resolution),
    )

    src = open_inputs(c.inputs)
    if "image" not in src.columns:
        from stages.errors import UserInputError

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

        with progress() as bar:
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
                display=bar,
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
        return
    result = {"out": str(c.out), "rows": src.num_rows, "conditioning": conditioning}
    if json_:
        emit_json(result)
    else:
        print_result(f"[green]encoded[/] {src.num_rows} images → {c.out}")


encode = config_command(EncodeConfig, "encode", run)
