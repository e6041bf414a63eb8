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
TRACKING = "Tracking"
ReportToOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--report-to",
        metavar="NAME[,NAME]",
        help="Experiment trackers to log to, comma-separated or repeated: tensorboard, wandb, trackio, "
        "mlflow, comet_ml, aim, clearml, dvclive, swanlab (Accelerate's trackers), all (every installed one) "
        "or none (default). Every process of a run logs into one tracker run named after the run directory "
        "(runs/x/it3/policy → x); TensorBoard logs go to RUN/tracking/tensorboard/NAME. Only rank 0 logs.",
        rich_help_panel=TRACKING,
    ),
]
RunNameOpt = Annotated[
    str | None,
    typer.Option(
        "--run-name",
        help="Name of the tracker run (default: the run directory's name); give every command of the run "
        "the same one.",
        rich_help_panel=TRACKING,
    ),
]
