"""`omnirl encode`: VAE-encode a shard set's images into final latents."""

from __future__ import annotations

from typing import Annotated

import typer

from ..choices import Dtype
from ..config import resolve
from ..console import emit_json, log
from ..errors import handle_errors
from ..options import (
    ConfigOpt,
    FormatOpt,
    InOpt,
    JsonOpt,
    OutOpt,
    OverwriteOpt,
    SetOpt,
    mixed_precision_opt,
    model_opt,
)
from ..runtime import check_format, device, finalize, map_shards, open_inputs, policy_info, run_config


@handle_errors
def encode(
    ctx: typer.Context,
    inputs: InOpt = None,
    out: OutOpt = None,
    model: model_opt("Diffusers pipeline (its VAE encodes)") = None,
    resolution: Annotated[
        str,
        typer.Option(
            "--resolution",
            help="Images are resized and centre-cropped to this size in pixels: a side (512) or "
            "HEIGHTxWIDTH (240x416), each a multiple of the VAE factor × patch size (SD3: 16).",
        ),
    ] = "512",
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Images per VAE call.")] = 8,
    dtype: Annotated[Dtype, typer.Option("--dtype", envvar="OMNIRL_DTYPE", help="Weights dtype.")] = "fp32",
    mixed_precision: mixed_precision_opt("the VAE encoder's forward") = None,
    fmt: FormatOpt = "parquet",
    overwrite: OverwriteOpt = False,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Encode every image with the model's VAE into `final_latent`, for offline DPO, NFT and AWM.

    Example: [bold]omnirl encode --model models/sd3 --in data/pairs --resolution 512 --out data/latents[/]
    """
    c = resolve(ctx, "encode", required=("model", "out"))
    from stages.models.diffusion import FlowPolicy
    from stages.models.families import resolution_identity
    from stages.offline.encode import encode_shard
    from stages.precision import resolve_mixed_precision
    from stages.shards.writer import ShardSetWriter

    c["mixed_precision"] = resolve_mixed_precision(c["mixed_precision"])  # the launcher's enters the identity
    c["resolution"] = resolution_identity(c["resolution"])

    src = open_inputs(c["inputs"])
    if "image" not in src.columns:
        from stages.errors import UserInputError

        raise UserInputError("--in: no 'image' column to encode")
    writer = ShardSetWriter(
        c["out"],
        num_shards=src.num_shards,
        format=check_format(c["fmt"]),
        command="encode",
        config=run_config(c),
        parents=list(src.paths),
        policy=policy_info(c["model"], None),
        overwrite=c["overwrite"],
    )
    if not writer.complete:
        policy = FlowPolicy.load(c["model"], device=device(), dtype=c["dtype"])
        map_shards(
            src,
            writer,
            "encoding",
            ["sample_id", "image"],
            lambda shard, advance: encode_shard(
                policy,
                shard,
                resolution=c["resolution"],
                batch_size=c["batch_size"],
                mixed_precision=c["mixed_precision"],
                on_batch=advance,
            ),
        )
    if not finalize(writer):
        return
    result = {"out": str(c["out"]), "rows": src.num_rows}
    if json_:
        emit_json(result)
    else:
        log(f"[green]encoded[/] {src.num_rows} images → {c['out']}")
