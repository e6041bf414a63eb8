"""Knobs: a stage's settings declared once, as fields of its typed config (a dataclass).

A knob is a dataclass field whose metadata holds a `Knob`: its help, its flag, the closed set of
names it takes (`choices`) or the built-ins an open registry offers (`names`, plugins accepted beside
them), its bounds, help panel and environment variable. The CLI generates each command's options from
its config (`omnirl_cli.generate`), and YAML presets, `--set`, OMNIRL_* variables and flags resolve into
an instance of that same config (`omnirl_cli.config.resolve_config`).

This module and every config module never import torch, so `omnirl CMD --help` and shell completion
stay fast. It also declares the knobs several stages share (input / output shard sets, mixed precision,
tracking) and the closed sets they take.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# Help panels of `omnirl CMD --help`; options without one are listed under "Options".
IO = "Input / output"
TRACKING = "Tracking"

# The shard formats (`stages.shards.manifest`) and Accelerate's mixed-precision modes
# (`stages.precision`): closed sets, here so that declaring a knob never imports torch.
FORMATS = ("parquet", "webdataset")
MIXED_PRECISION_MODES = ("no", "bf16", "fp16")
# Where weights (--model, --adapter) may be (`stages.models.hub`), and how their knobs show the value.
WEIGHTS_FROM = (
    "a local path, or a Hub id ORG/NAME (or ORG/NAME@REVISION) the local Hugging Face cache holds "
    "(never downloaded)"
)
WEIGHTS_METAVAR = "PATH|ORG/NAME"


@dataclass(frozen=True)
class Knob:
    """How one config field is set and shown: `help` (rich markup allowed), `flag` (default: the
    field's name with dashes), `short` (e.g. "-o"), `choices` (a closed set: any other value is refused
    from every source), `names` and `entry_points` (an open registry's built-ins and its entry-point
    group, offered by completion only), `low` / `high` bounds, `panel`, `envvar`, `metavar`, and
    `required` (some source must give it; checked once all sources are merged, so a preset can)."""

    help: str
    flag: str | None = None
    short: str | None = None
    choices: tuple[str, ...] | None = None
    names: tuple[str, ...] = ()
    entry_points: str | None = None
    low: float | None = None
    high: float | None = None
    panel: str | None = None
    envvar: str | None = None
    metavar: str | None = None
    required: bool = False


def knob(default: Any, help: str, **declared: Any) -> Any:
    """A config field with default `default` and the `Knob` built from `help` and `declared`."""
    return dataclasses.field(default=default, metadata={"knob": Knob(help=help, **declared)})


def knobs(config: type) -> list[tuple[dataclasses.Field, Knob]]:
    """The fields of dataclass `config` that are knobs, in declaration order, with their `Knob`."""
    return [(f, f.metadata["knob"]) for f in dataclasses.fields(config) if "knob" in f.metadata]


def flag_of(name: str, declared: Knob) -> str:
    """The long flag of knob `name`: its declared one, else `--` and the field's name with dashes."""
    return declared.flag or f"--{name.replace('_', '-')}"


# The knobs every shard-set stage shares: one declaration each, whichever command takes them.
def inputs() -> Any:
    """`--in`: the input shard sets."""
    return knob(
        None,
        "Input shard set; several sets of one rollout are zipped row by row.",
        flag="--in",
        short="-i",
        panel=IO,
    )


def out() -> Any:
    """`--out`: the output shard set, required once all sources are merged."""
    return knob(
        None,
        "Output shard-set directory. A shard set being written is locked by its writer (pid and host): "
        "a second run onto it is refused, naming the first; a killed run's lock is free.",
        short="-o",
        panel=IO,
        required=True,
    )


def shard_format() -> Any:
    """`--format`: the output's shard format (field `fmt`)."""
    return knob(
        "parquet",
        "Shard format of the output.",
        flag="--format",
        choices=FORMATS,
        envvar="OMNIRL_FORMAT",
        panel=IO,
    )


def overwrite() -> Any:
    """`--overwrite`: replace an output written under another config."""
    return knob(False, "Replace an output produced with a different config.", panel=IO)


def mixed_precision(
    forwards: str,
    panel: str | None = None,
    *,
    fallback: str = "no",
    recorded: str = "Part of the output's identity.",
) -> Any:
    """`--mixed-precision` of a stage whose `forwards` (model calls) run under autocast: no, bf16 or
    fp16 as Accelerate names them; default the launcher's, else `fallback`, resolved by
    `stages.precision`. `recorded` says where the resolved value is kept."""
    return knob(
        None,
        f"Autocast of {forwards}. Default: the launcher's (accelerate launch --mixed_precision, "
        f"ACCELERATE_MIXED_PRECISION), else {fallback}. {recorded}",
        choices=MIXED_PRECISION_MODES,
        panel=panel,
    )


def report_to() -> Any:
    """`--report-to`: the experiment trackers (`stages.tracking`)."""
    return knob(
        None,
        "Experiment trackers to log to, comma-separated or repeated: tensorboard, wandb, trackio, "
        "mlflow, comet_ml, aim, clearml, dvclive, swanlab (Accelerate's trackers), all (every installed one) "
        "or none (default). Every process of a run logs into one tracker run named after the run directory "
        "(runs/x/it3/policy → x); TensorBoard logs go to RUN/tracking/tensorboard/NAME. Only rank 0 logs.",
        metavar="NAME[,NAME]",
        panel=TRACKING,
    )


def run_name() -> Any:
    """`--run-name`: the tracker run's name."""
    return knob(
        None,
        "Name of the tracker run (default: the run directory's name); give every command of the run "
        "the same one.",
        panel=TRACKING,
    )
