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
from stages.knobs import IO, WEIGHTS_FROM, WEIGHTS_METAVAR, Knob, flag_of
from stages.media.video import MAX_FRAMES

from .choices import Dtype, SpKind, Strategy, complete
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
    names = (flag_of(name, declared), *((declared.short,) if declared.short else ()))
    return Annotated[annotation, typer.Option(*names, **settings)]


def _shared(made: Field, name: str, annotation: Any) -> Any:
    """The option of a knob several stages share (`stages.knobs`), for a hand-written signature."""
    return option(name, made.metadata["knob"], annotation)


def model_opt(what: str, panel: str | None = None) -> Any:
    """The required `--model` option (also OMNIRL_MODEL, --config or --set) of a command taking `what`."""
    return Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            envvar="OMNIRL_MODEL",
            metavar=WEIGHTS_METAVAR,
            help=f"{what}: {WEIGHTS_FROM}. {REQUIRED}",
            rich_help_panel=panel,
        ),
    ]


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
NumShardsOpt = Annotated[
    int | None,
    typer.Option(
        "--num-shards",
        min=1,
        help="Number of output shards (default: one per --shard-rows rows, whole groups each, rounded up "
        "to a multiple of the launcher's ranks so that every rank works; later stages split by shard).",
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


# Settings of the sampling and training stages that `omnirl plan` takes too, so each is declared once.
SAMPLING = "Sampling"
OPTIMISATION = "Optimisation"
DtypeOpt = Annotated[
    Dtype,
    typer.Option(
        "--dtype",
        envvar="OMNIRL_DTYPE",
        help="Storage dtype of the frozen weights. Trained weights (LoRA, or all "
        "with --full) are always fp32 (diffusers' cast_training_params), so AdamW steps in fp32.",
    ),
]

StrategyOpt = Annotated[
    Strategy,
    typer.Option(
        "--strategy",
        help="How the trained module is spread over the launcher's processes: ddp (Accelerate's DDP), "
        "fsdp2 (torch fully_shard per block and at the root, with the accelerate config's CPU offload and "
        "reshard settings) or auto: the accelerate config's (fsdp_version 2 → fsdp2), else ddp over more "
        "than one process. DeepSpeed, Megatron-LM and FSDP1 configs are refused. Not part of the run's "
        "identity: 1 process and N ranks give the same update.",
        rich_help_panel=OPTIMISATION,
    ),
]

# Model parallelism of a diffusion transformer (`stages.parallelism.ModelParallel`), for the stages that
# run one and for `omnirl plan`, and its kernels (`stages.models.kernels.Kernels`). Not part of an
# output's identity: N ranks compute one process's numbers, and so do compiled and other-kernel forwards,
# to rounding (a quantized attention backend, sage, is recorded).
PARALLELISM = "Parallelism and kernels"
SpDegreeOpt = Annotated[
    int,
    typer.Option(
        "--sp-degree",
        min=1,
        help="Sequence parallelism (diffusers' context parallelism): this many consecutive ranks of the "
        "launch share each sample's tokens, so activations per rank shrink by it; the other ranks are "
        "data parallel (dp = ranks / sp). FLUX, Qwen-Image and Wan; needs a launcher (torchrun "
        "--nproc_per_node, accelerate launch) with a multiple of it as ranks.",
        rich_help_panel=PARALLELISM,
    ),
]
SpKindOpt = Annotated[
    SpKind,
    typer.Option(
        "--sp-kind",
        help="How --sp-degree ranks attend: ulysses (all-to-all over heads; heads must divide by it), ring "
        "(keys/values passed round; needs an attention backend returning the log-sum-exp, so an "
        "accelerator) or unified (ring × Ulysses).",
        rich_help_panel=PARALLELISM,
    ),
]
TpDegreeOpt = Annotated[
    int,
    typer.Option(
        "--tp-degree",
        min=1,
        help="Tensor parallelism (diffusers' _tp_plan): this many consecutive ranks each hold 1/N of the "
        "transformer's planned weights. FLUX and Qwen-Image, on accelerators, without LoRA layers; not "
        "with --sp-degree.",
        rich_help_panel=PARALLELISM,
    ),
]


def no_model_parallel_opt(flag: str, command: str, instead: str) -> Any:
    """`--sp-degree` / `--tp-degree` of a command whose work runs in no launcher ranks (online, serve):
    only 1, so that a degree from a habit or a shared preset is refused naming the commands that take it
    (`instead`; `ModelParallel.refuse`) rather than dropped."""
    return Annotated[
        int,
        typer.Option(
            flag,
            min=1,
            help=f"Only 1 ({command} runs in no launcher ranks); for {flag} > 1 run {instead} under a "
            "launcher (docs/scaling.md).",
            rich_help_panel=PARALLELISM,
        ),
    ]


AttentionBackendOpt = Annotated[
    str | None,
    typer.Option(
        "--attention-backend",
        help="diffusers' attention backend for the transformer: native (torch SDPA, the default), "
        "_native_cudnn, flash, sage, ... whichever is installed here (a missing one is refused with the "
        "list; *_hub kernels, which download, are not offered). Recorded in the output's identity only "
        "when quantized (sage*); the others agree to rounding.",
        rich_help_panel=PARALLELISM,
    ),
]
CompileOpt = Annotated[
    bool,
    typer.Option(
        "--compile",
        help="torch.compile the transformer: regional (each repeated block compiled once, diffusers' "
        "compile_repeated_blocks) where the model lists its blocks, else whole. The first forward pays "
        "the compilation; numbers agree to rounding, so not part of the output's identity.",
        rich_help_panel=PARALLELISM,
    ),
]

GradientCheckpointingOpt = Annotated[
    bool,
    typer.Option(
        "--gradient-checkpointing",
        help="Recompute the trained module's activations in the backward (diffusers / transformers "
        "checkpointing): less memory for one more forward per trained step; same numbers.",
        rich_help_panel=OPTIMISATION,
    ),
]

MicroBatchOpt = Annotated[
    int,
    typer.Option(
        "--micro-batch",
        help="Samples per forward (0: the sampling batch size).",
        rich_help_panel=OPTIMISATION,
    ),
]

LoraRankOpt = Annotated[
    int,
    typer.Option(
        "--lora-rank", help="LoRA rank of a new adapter (flow_grpo 32).", rich_help_panel=OPTIMISATION
    ),
]

FullOpt = Annotated[
    bool, typer.Option("--full", help="Full fine-tuning instead of LoRA.", rich_help_panel=OPTIMISATION)
]

BatchSizeOpt = Annotated[
    int,
    typer.Option(
        "--batch-size",
        min=1,
        help="Samples per forward pass (VLM: responses per generate call, whole groups).",
        rich_help_panel=SAMPLING,
    ),
]

GuidanceOpt = Annotated[
    float,
    typer.Option(
        "--guidance",
        help="Guidance as the family's pipeline defines it: SD3 and Qwen-Image true CFG (1 = off), "
        "Z-Image pos + w·(pos − neg) (0 = off), FLUX.1 distilled guidance (a model input, one forward).",
        rich_help_panel=SAMPLING,
    ),
]

ResolutionOpt = Annotated[
    str | None,
    typer.Option(
        "--resolution",
        metavar="SIDE|HxW",
        help="Sample size in pixels: a side (512) or HEIGHTxWIDTH (240x416, flow_grpo's Wan), each a "
        "multiple of the VAE factor × patch size (SD3: 16, Wan 2.1: 16, Wan 2.2 TI2V-5B: 32). Default: "
        "the native resolution an `init-model` or `pretrain` folder records, else 512.",
        rich_help_panel=SAMPLING,
    ),
]

FramesOpt = Annotated[
    int,
    typer.Option(
        "--frames",
        min=1,
        max=MAX_FRAMES,
        help="Frames per sample for a video family (Wan: 1 plus a multiple of 4, its pipeline's 81; "
        f"at most {MAX_FRAMES}); image families take 1.",
        rich_help_panel=SAMPLING,
    ),
]


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

SERVER = "Server"
HostOpt = Annotated[
    str,
    typer.Option(
        "--host",
        help="Address to bind: 127.0.0.1 (default) keeps it on this machine; 0.0.0.0 opens it.",
        rich_help_panel=SERVER,
    ),
]
PortOpt = Annotated[
    int,
    typer.Option(
        "--port", min=0, max=65535, help="Port to bind; 0 picks a free one (printed).", rich_help_panel=SERVER
    ),
]
TokenEnvOpt = Annotated[
    str | None,
    typer.Option(
        "--token-env",
        help="Environment variable holding a bearer token every request but GET /health must carry.",
        rich_help_panel=SERVER,
    ),
]
MaxRequestMbOpt = Annotated[
    int,
    typer.Option(
        "--max-request-mb", min=1, help="Largest request body, in MiB (413 above).", rich_help_panel=SERVER
    ),
]
MaxBatchOpt = Annotated[
    int,
    typer.Option(
        "--max-batch", min=1, help="Most samples in one request (413 above).", rich_help_panel=SERVER
    ),
]
# The serve commands' connection limits (`stages.web.ServerLimits`). The defaults are copies of the
# library's (importing stages.web, with http.server and urllib, would slow every command's start),
# held equal by tests/test_web.py.
MAX_CONNECTIONS, WORKERS, REQUEST_TIMEOUT_S = 256, 16, 60.0
MaxConnectionsOpt = Annotated[
    int,
    typer.Option(
        "--max-connections",
        min=1,
        help="Open connections at once, idle ones included; one more is answered 503 with Retry-After and "
        "closed at once. It is also the listen backlog when above 128.",
        rich_help_panel=SERVER,
    ),
]
WorkersOpt = Annotated[
    int,
    typer.Option(
        "--workers",
        min=1,
        help="Threads that read and answer requests (GET /health too). A connection between requests "
        "holds none; a request waits for a free one.",
        rich_help_panel=SERVER,
    ),
]
RequestTimeoutOpt = Annotated[
    float,
    typer.Option(
        "--request-timeout",
        min=1,
        help="Seconds from a request's first byte until its headers and body are read in full: a client "
        "that sends slower gets 408 and is disconnected. Raise it for large uploads over slow links.",
        rich_help_panel=SERVER,
    ),
]

ENGINE = "Rollout engine"
# How to reach a rollout server (`--engine remote`, VLM `--engine openai`): stages' EngineOptions.
ServerUrlOpt = Annotated[
    str | None,
    typer.Option(
        "--server-url",
        help="Base URL of the server: `omnirl serve`'s or `vllm serve --omni`'s http://host:port, or an "
        "OpenAI API root http://host:8000/v1 for a VLM.",
        rich_help_panel=ENGINE,
    ),
]
ServerTokenEnvOpt = Annotated[
    str | None,
    typer.Option(
        "--server-token-env",
        help="Environment variable holding the rollout server's bearer token (its --token-env).",
        rich_help_panel=ENGINE,
    ),
]
ServerTimeoutOpt = Annotated[
    float,
    typer.Option("--server-timeout", min=1, help="Seconds to wait for one reply.", rich_help_panel=ENGINE),
]
ServerStartupTimeoutOpt = Annotated[
    float,
    typer.Option(
        "--server-startup-timeout",
        min=0,
        help="Seconds to wait for the server's GET /health to answer 200, saying so on stderr every 30 s; "
        "connection refused counts as still starting (`omnirl serve` listens once its model is loaded), an "
        "unknown host or a 4xx does not. None within it: exit 2. Raise it for a server loading a big model.",
        rich_help_panel=ENGINE,
    ),
]
ServerRetriesOpt = Annotated[
    int,
    typer.Option(
        "--server-retries",
        min=0,
        help="Further tries of a batch after a connection error, 502, 503 or 504 (backoff with jitter, "
        "the same seeds; a 4xx is never retried).",
        rich_help_panel=ENGINE,
    ),
]
