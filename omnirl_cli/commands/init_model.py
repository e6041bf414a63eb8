"""`omnirl init-model`: build a tiny model offline and save it as a loadable pipeline folder."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..choices import FAMILIES, ModelSize, complete
from ..console import emit_json, print_result, progress
from ..errors import handle_errors
from ..options import JsonOpt


@handle_errors
def init_model(
    out: Annotated[Path, typer.Argument(help="Directory to write the model folder to.")],
    family: Annotated[
        str,
        typer.Option(
            "--family",
            autocompletion=complete(FAMILIES),
            help=f"Model family: {', '.join(FAMILIES)}.",
        ),
    ] = "sd3",
    size: Annotated[
        ModelSize,
        typer.Option(
            "--size",
            help="tiny (fast tests), small (benchmarks), for sd3 demo (the pixel-VAE shape `omnirl pretrain` "
            "trains for the demo: 4 latent channels, 64 px at most, 24 CLIP + 32 T5 tokens), or a published "
            "size with random weights, for GPU benchmarks: full (each family's flagship: SD3.5 Large, FLUX.1-dev, "
            "Qwen-Image 20B, Z-Image, Wan 2.1 T2V 14B, Wan 2.2 5B / A14B, Qwen2.5-VL 7B, Qwen3-VL 8B, the "
            "Qwen3-Omni thinker), sd3 medium, wan2_1 1.3b, qwen2_5_vl 3b / 7b, qwen3_vl 8b. `omnirl plan --family F --size S` says "
            "what a size needs.",
        ),
    ] = "tiny",
    seed: Annotated[
        int, typer.Option("--seed", help="Weight seed: the same seed gives the same weights.")
    ] = 0,
    json_: JsonOpt = False,
) -> None:
    """Build a tiny model of a family from its config, with locally built tokenizers, and save it.

    The folder loads with the family's own `from_pretrained(OUT)` and no network, so tests and demos
    exercise the same loading path as real checkpoints.

    Example: [bold]omnirl init-model --family sd3 --size tiny --seed 0 models/sd3-tiny[/]
    """
    from stages.models.factory import init_model as build

    with progress() as bar:
        bar.add_task(f"building {size} {family} model", total=None, rate="")
        summary = build(family, out, size=size, seed=seed)
    if json_:
        emit_json(summary)
    else:
        print_result(f"[green]wrote[/] {family}/{size} model (seed {seed}) to {out}")
