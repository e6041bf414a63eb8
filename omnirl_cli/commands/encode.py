"""`omnirl encode`: VAE-encode a shard set's images into final latents."""

from __future__ import annotations

from stages.offline.config import EncodeConfig

from ..console import emit_json, print_result, progress
from ..generate import config_command


def run(c: EncodeConfig, json_: bool) -> None:
    """Encode every image with the model's VAE into `final_latent`, for offline DPO, NFT and AWM.

    It also stores each unique prompt's text conditioning once per shard (conditioning-*.safetensors,
    listed in the manifest, as `sample` does), so `update` on the output loads no text encoder
    (docs/real-checkpoints.md, "What each stage loads"); not when --in has no prompt column or already
    stores it (a rollout of the in-process engine). --json says which (`conditioning`).

    Example: [bold]omnirl encode --model models/sd3 --in data/pairs --resolution 512 --out data/latents[/]
    """
    from stages.offline.encode import run_encode

    with progress() as bar:
        result = run_encode(c, bar)
    if result is None:
        return
    if json_:
        emit_json(result)
    else:
        print_result(f"[green]encoded[/] {result['rows']} images → {c.out}")


encode = config_command(EncodeConfig, "encode", run)
