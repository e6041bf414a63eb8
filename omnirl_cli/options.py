"""Option types shared by several commands, so every command spells them the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

IO = "Input / output"
# Where --model and --adapter weights may be (stages.models.hub).
WEIGHTS_FROM = (
    "a local path, or a Hub id ORG/NAME (or ORG/NAME@REVISION) the local Hugging Face cache holds "
    "(never downloaded)"
)
ADAPTER_HELP = (
    "an `omnirl update` output, a diffusers LoRA folder (`save_lora_weights`) or a PEFT LoRA folder "
    f"(`save_pretrained`; a VLM takes PEFT only); {WEIGHTS_FROM}"
)
RUN = "Run"

ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        help="YAML preset; top-level keys and a section named after the command fill options not given as flags.",
        rich_help_panel=RUN,
    ),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        help="Override a config value, e.g. --set steps=10 (repeatable). Flags win over --set, --set over YAML.",
        rich_help_panel=RUN,
    ),
]
JsonOpt = Annotated[
    bool,
    typer.Option(
        "--json",
        help="Print one JSON result object on stdout; progress and logs stay off.",
        rich_help_panel=RUN,
    ),
]
OutOpt = Annotated[Path, typer.Option("--out", "-o", help="Output shard-set directory.", rich_help_panel=IO)]
InOpt = Annotated[
    list[Path],
    typer.Option(
        "--in",
        "-i",
        help="Input shard set (repeatable): several sets of one rollout are zipped row by row.",
        rich_help_panel=IO,
    ),
]
FormatOpt = Annotated[
    str,
    typer.Option("--format", help="Shard format of the output: parquet or webdataset.", rich_help_panel=IO),
]
NumShardsOpt = Annotated[
    int | None,
    typer.Option(
        "--num-shards",
        min=1,
        help="Number of output shards (default: one per --shard-rows rows, whole groups each).",
        rich_help_panel=IO,
    ),
]
ShardRowsOpt = Annotated[
    int,
    typer.Option(
        "--shard-rows",
        min=1,
        help="Rows per shard when --num-shards is not given: a shard is the unit of resume, so a crash "
        "loses at most one shard's work.",
        rich_help_panel=IO,
    ),
]
OverwriteOpt = Annotated[
    bool,
    typer.Option(
        "--overwrite", help="Replace an output produced with a different config.", rich_help_panel=IO
    ),
]
