"""Option types shared by several commands, so every command spells them the same way.

The common options also read OMNIRL_* environment variables (typer's `envvar=`, shown in --help):
OMNIRL_CONFIG, OMNIRL_MODEL, OMNIRL_DTYPE, OMNIRL_FORMAT, OMNIRL_QUIET, OMNIRL_VERBOSE. Precedence,
applied by `config.resolve`: flags > --set > OMNIRL_* > --config YAML > defaults.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import Field
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import typer

from stages import knobs
from stages.knobs import WEIGHTS_FROM, Knob, flag_of

from .choices import complete
from .console import QUIET, VERBOSE, set_verbosity

# --model and --adapter are typed as str so `config` sees them as written (a leading ./ marks a path,
# never a Hub id: `stages.models.hub.spelled_as_path`).
ADAPTER_HELP = (
    "an `omnirl update` output, a diffusers LoRA folder (`save_lora_weights`) or a PEFT LoRA folder "
    f"(`save_pretrained`; a VLM takes PEFT only); {WEIGHTS_FROM}"
)
RUN = "Run"
# Said by the help of an option that has no default but may come from a preset: required after
# resolution (`config.resolve(..., required=)`), not by typer, so --config can supply it.
REQUIRED = "Required (a flag, or --config / --set)."


def _with_choices(annotation: Any, choices: tuple[str, ...]) -> Any:
    """`annotation` with its `str` replaced by `Literal[choices]` (`str | None` → `Literal[...] | None`)."""
    if annotation is str:
        return Literal[choices]
    if get_origin(annotation) is not None and str in get_args(annotation):
        return Union[tuple(Literal[choices] if arg is str else arg for arg in get_args(annotation))]  # noqa: UP007
    raise TypeError(f"a knob with choices must be a str field, not {annotation}")


def option(name: str, declared: Knob, annotation: Any) -> Any:
    """The typer option of knob `name` of type `annotation` (`stages.knobs`), as an `Annotated` type:
    a `choices` knob's `str` becomes a `Literal` of its names (listed in --help, completed, checked),
    `names` are offered by completion, and a `required` knob's help says how to give it."""
    help_text = f"{declared.help} {REQUIRED}" if declared.required else declared.help
    settings: dict[str, Any] = {"help": help_text, "rich_help_panel": declared.panel}
    for key, value in (
        ("envvar", declared.envvar),
        ("metavar", declared.metavar),
        ("min", declared.low),
        ("max", declared.high),
    ):
        if value is not None:
            settings[key] = value
    if declared.names:
        settings["autocompletion"] = complete(declared.names, declared.entry_points)
    if declared.choices:
        annotation = _with_choices(annotation, declared.choices)
    long = flag_of(name, declared)
    names = (
        f"{long}/--no-{long[2:]}" if declared.negative else long,
        *((declared.short,) if declared.short else ()),
    )
    return Annotated[annotation, typer.Option(*names, **settings)]


def _shared(made: Field, name: str, annotation: Any) -> Any:
    """The option of a knob several stages share (`stages.knobs`), for a hand-written signature."""
    return option(name, made.metadata["knob"], annotation)


def model_opt(what: str, panel: str | None = None) -> Any:
    """The required `--model` option (also OMNIRL_MODEL, --config or --set) of a command taking `what`."""
    return _shared(knobs.model(what, panel), "model", str | None)


ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        envvar="OMNIRL_CONFIG",
        help="YAML preset; top-level keys and a section named after the command fill options not given as flags.",
        rich_help_panel=RUN,
    ),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        metavar="KEY=VALUE",
        help="Override a config value, e.g. --set steps=10. Flags > --set > OMNIRL_* variables > "
        "YAML > defaults.",
        rich_help_panel=RUN,
    ),
]
JsonOpt = Annotated[
    bool,
    typer.Option(
        "--json",
        help="Print one JSON result object on stdout instead of the summary lines; progress stays on stderr "
        "(-q turns it off).",
        rich_help_panel=RUN,
    ),
]
OutOpt = _shared(knobs.out(), "out", Path | None)
InOpt = _shared(knobs.inputs(), "inputs", list[Path])
FormatOpt = _shared(knobs.shard_format(), "fmt", str)
NumShardsOpt = _shared(knobs.num_shards(), "num_shards", int | None)
ShardRowsOpt = _shared(knobs.shard_rows(), "shard_rows", int)


def mixed_precision_opt(
    forwards: str,
    panel: str | None = None,
    *,
    fallback: str = "no",
    recorded: str = "Part of the output's identity.",
) -> Any:
    """--mixed-precision of a command whose `forwards` run under autocast (`stages.knobs.mixed_precision`)."""
    made = knobs.mixed_precision(forwards, panel, fallback=fallback, recorded=recorded)
    return _shared(made, "mixed_precision", str | None)


# Settings of the sampling and training stages that `omnirl plan` takes too (`stages.knobs`).
DtypeOpt = _shared(knobs.dtype(), "dtype", str)
StrategyOpt = _shared(knobs.strategy(), "strategy", str)
SpDegreeOpt = _shared(knobs.sp_degree(), "sp_degree", int)
SpKindOpt = _shared(knobs.sp_kind(), "sp_kind", str)
TpDegreeOpt = _shared(knobs.tp_degree(), "tp_degree", int)


def no_model_parallel_opt(flag: str, command: str, instead: str) -> Any:
    """`--sp-degree` / `--tp-degree` of a command that runs in no launcher ranks (`stages.knobs`)."""
    return _shared(knobs.no_model_parallel(flag, command, instead), flag[2:].replace("-", "_"), int)


AttentionBackendOpt = _shared(knobs.attention_backend(), "attention_backend", str | None)
CompileOpt = _shared(knobs.compile(), "compile", bool)
GradientCheckpointingOpt = _shared(knobs.gradient_checkpointing(), "gradient_checkpointing", bool)
MicroBatchOpt = _shared(knobs.micro_batch(), "micro_batch", int)
PackingOpt = _shared(knobs.packing(), "packing", str)
BalanceTokensOpt = _shared(knobs.balance_tokens(), "balance_tokens", bool)
LoraRankOpt = _shared(knobs.lora_rank(), "lora_rank", int)
FullOpt = _shared(knobs.full(), "full", bool)
BatchSizeOpt = _shared(knobs.batch_size(), "batch_size", int)
GuidanceOpt = _shared(knobs.guidance(), "guidance", float)
ResolutionOpt = _shared(knobs.resolution(), "resolution", str | None)
FramesOpt = _shared(knobs.frames(), "frames", int)


OverwriteOpt = _shared(knobs.overwrite(), "overwrite", bool)
ReportToOpt = _shared(knobs.report_to(), "report_to", list[str] | None)
RunNameOpt = _shared(knobs.run_name(), "run_name", str | None)


def _set_level(level: int) -> Callable[[bool], None]:
    def apply(value: bool) -> None:
        if value:
            set_verbosity(level)

    return apply


QuietOpt = Annotated[
    bool,
    typer.Option(
        "--quiet",
        "-q",
        envvar="OMNIRL_QUIET",
        expose_value=False,
        callback=_set_level(QUIET),
        help="No progress, no log lines (omnirl's loggers at ERROR): results and errors only.",
        rich_help_panel=RUN,
    ),
]
VerboseOpt = Annotated[
    bool,
    typer.Option(
        "--verbose",
        "-v",
        envvar="OMNIRL_VERBOSE",
        expose_value=False,
        callback=_set_level(VERBOSE),
        help="Also omnirl's info and debug log records (e.g. remote-reward retries), with logger names.",
        rich_help_panel=RUN,
    ),
]

# A server's settings (`stages.knobs`); the port and request limits differ per server.
HostOpt = _shared(knobs.host(), "host", str)
TokenEnvOpt = _shared(knobs.token_env(), "token_env", str | None)
MaxConnectionsOpt = _shared(knobs.max_connections(), "max_connections", int)
WorkersOpt = _shared(knobs.workers(), "workers", int)
RequestTimeoutOpt = _shared(knobs.request_timeout(), "request_timeout", float)


def port_opt(default: int) -> Any:
    """`--port` of a server whose default port is `default`."""
    return _shared(knobs.port(default), "port", int)


def max_request_mb_opt(default: int) -> Any:
    """`--max-request-mb` of a server whose default limit is `default`."""
    return _shared(knobs.max_request_mb(default), "max_request_mb", int)


def max_batch_opt(default: int) -> Any:
    """`--max-batch` of a server whose default limit is `default`."""
    return _shared(knobs.max_batch(default), "max_batch", int)


# How to reach a rollout server (`--engine remote`, VLM `--engine openai`; `stages.knobs`).
ServerUrlOpt = _shared(knobs.server_url(), "server_url", str | None)
ServerTokenEnvOpt = _shared(knobs.server_token_env(), "server_token_env", str | None)
ServerTimeoutOpt = _shared(knobs.server_timeout(), "server_timeout", float)
ServerStartupTimeoutOpt = _shared(knobs.server_startup_timeout(), "server_startup_timeout", float)
ServerRetriesOpt = _shared(knobs.server_retries(), "server_retries", int)
