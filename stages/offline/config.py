"""The settings of `omnirl pairs` and `omnirl encode` as typed configs; torch-free.

`PairsConfig` and `EncodeConfig` are the single declarations of their commands' options (help,
bounds, panel), from which the CLI generates them (`omnirl_cli.generate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stages import knobs
from stages.knobs import knob


@dataclass
class PairsConfig:
    """Every setting of `omnirl pairs`: the preference table and the shard set it becomes."""

    table: Path | None = knob(
        None,
        "Parquet/JSONL: prompt, chosen, rejected (+ scores), or Pick-a-Pic's caption, jpg_0, jpg_1, label_0.",
        flag="--pairs",
        required=True,
    )
    out: Path | None = knobs.out()
    num_shards: int | None = knobs.num_shards()
    shard_rows: int = knobs.shard_rows()
    fmt: str = knobs.shard_format()
    overwrite: bool = knobs.overwrite()


@dataclass
class EncodeConfig:
    """Every setting of `omnirl encode`: the images to VAE-encode, the model and how."""

    # first, so that a missing --model is named before a missing --out
    model: str | None = knobs.model("Diffusers pipeline (its VAE encodes)")
    inputs: list[Path] | None = knobs.inputs()
    out: Path | None = knobs.out()
    resolution: str = knob(
        "512",
        "Images are resized and centre-cropped to this size in pixels: a side (512) or "
        "HEIGHTxWIDTH (240x416), each a multiple of the VAE factor × patch size (SD3: 16).",
    )
    batch_size: int = knob(8, "Images per VAE call.", low=1)
    dtype: str = knobs.dtype(trains=False)
    mixed_precision: str | None = knobs.mixed_precision("the VAE encoder's forward")
    fmt: str = knobs.shard_format()
    overwrite: bool = knobs.overwrite()
