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
import os
from dataclasses import dataclass
from typing import Any

# Help panels of `omnirl CMD --help`; options without one are listed under "Options".
IO = "Input / output"
TRACKING = "Tracking"

# The shard formats (`stages.shards.manifest`) and Accelerate's mixed-precision modes
# (`stages.precision`): closed sets, here so that declaring a knob never imports torch.
FORMATS = ("parquet", "webdataset")
MIXED_PRECISION_MODES = ("no", "bf16", "fp16")
DTYPES = ("fp32", "bf16", "fp16")  # storage dtypes of frozen weights (`stages.models.diffusion`)
STRATEGIES = ("auto", "ddp", "fsdp2")  # how a trained module spreads over ranks (`stages.update.parallel`)
SP_KINDS = ("ulysses", "ring", "unified")  # sequence-parallel attention (`stages.parallelism`)
# SDE-window strategies a user picks (`sample --window-strategy`); `stages.sample.windows` adds "all"
# (what --sde-window 0 means)
WINDOW_STRATEGIES = ("random", "progressive", "fixed")
# VLM forwards over packed sequences (`stages.models.vlm.VLMPolicy.use_packing`)
PACKING = ("auto", "on", "off")
# Where weights (--model, --adapter) may be (`stages.models.hub`), and how their knobs show the value.
WEIGHTS_FROM = (
    "a local path, or a Hub id ORG/NAME (or ORG/NAME@REVISION) the local Hugging Face cache holds "
    "(never downloaded)"
)
WEIGHTS_METAVAR = "PATH|ORG/NAME"
# What an adapter (--adapter) may be (`stages.models.folders` reads each kind).
ADAPTER_FROM = (
    "an `omnirl update` output, a diffusers LoRA folder (`save_lora_weights`) or a PEFT LoRA folder "
    f"(`save_pretrained`; a VLM takes PEFT only); {WEIGHTS_FROM}"
)


def launcher_mixed_precision(default: str = "no") -> str:
    """The launcher's mixed precision (`accelerate launch --mixed_precision` or the `accelerate config`
    file set ACCELERATE_MIXED_PRECISION), else `default`."""
    return os.environ.get("ACCELERATE_MIXED_PRECISION", default).lower()


@dataclass(frozen=True)
class Knob:
    """How one config field is set and shown: `help` (rich markup allowed), `flag` (default: the
    field's name with dashes), `short` (e.g. "-o"), `choices` (a closed set: any other value is refused
    from every source), `names` and `entry_points` (an open registry's built-ins and its entry-point
    group, offered by completion only), `low` / `high` bounds, `panel`, `envvar`, `metavar`, and
    `required` (some source must give it; checked once all sources are merged, so a preset can),
    `negative` (a bool knob whose default is on: a `--no-FLAG` turns it off) and `argument` (a
    positional argument the command line must give, `omnirl inspect PATH`; its field's default is
    only the dataclass's placeholder)."""

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
    negative: bool = False
    argument: bool = False


def knob(default: Any, help: str, **declared: Any) -> Any:
    """A config field with default `default` and the `Knob` built from `help` and `declared`."""
    return dataclasses.field(default=default, metadata={"knob": Knob(help=help, **declared)})


def knobs(config: type) -> list[tuple[dataclasses.Field, Knob]]:
    """The fields of dataclass `config` that are knobs, in declaration order, with their `Knob`."""
    return [(f, f.metadata["knob"]) for f in dataclasses.fields(config) if "knob" in f.metadata]


def flag_of(name: str, declared: Knob) -> str:
    """The long flag of knob `name`: its declared one, else `--` and the field's name with dashes."""
    return declared.flag or f"--{name.replace('_', '-')}"


def option_names(config: type) -> dict[str, str]:
    """Each knob of `config` by the name its option spells (`sde_window`, as a preset may key it) → its
    field's name (`window`)."""
    return {
        flag_of(field.name, declared)[2:].replace("-", "_"): field.name for field, declared in knobs(config)
    }


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


# Knobs of the sampling and training stages (and `omnirl plan`, which takes them to size a run).
SAMPLING = "Sampling"
OPTIMISATION = "Optimisation"
# Model parallelism of a diffusion transformer (`stages.parallelism.ModelParallel`) and its kernels
# (`stages.models.kernels.Kernels`). Not part of an output's identity: N ranks compute one process's
# numbers, and so do compiled and other-kernel forwards, to rounding (a quantized backend is recorded).
PARALLELISM = "Parallelism and kernels"
SERVER = "Server"
ENGINE = "Rollout engine"
# frames of one video sample: bounds `sample --frames` (and SampleConfig) and `omnirl serve`'s requests
MAX_FRAMES = 4096


def model(what: str, panel: str | None = None, *, required: bool = True) -> Any:
    """`--model`: the weights a command runs (OMNIRL_MODEL too), by default required once all sources
    are merged."""
    return knob(
        None,
        f"{what}: {WEIGHTS_FROM}.",
        short="-m",
        envvar="OMNIRL_MODEL",
        metavar=WEIGHTS_METAVAR,
        panel=panel,
        required=required,
    )


def adapter(
    what: str = "Adapter", after: str = " (default: the base model).", panel: str | None = None
) -> Any:
    """`--adapter`: LoRA (or full) weights on top of --model; `what` opens its help, `after` ends it."""
    return knob(None, f"{what}: {ADAPTER_FROM}{after}", metavar=WEIGHTS_METAVAR, panel=panel)


def dtype(trains: bool = True, panel: str | None = None) -> Any:
    """`--dtype`: storage dtype of the frozen weights (of a stage that `trains`, or of one that only runs
    the model)."""
    kept = (
        " Trained weights (LoRA, or all with --full) are always fp32 (diffusers' cast_training_params), so "
        "AdamW steps in fp32."
        if trains
        else ""
    )
    return knob(
        "fp32",
        f"Storage dtype of the {'frozen ' if trains else ''}weights.{kept}",
        choices=DTYPES,
        envvar="OMNIRL_DTYPE",
        panel=panel,
    )


def strategy() -> Any:
    """`--strategy`: DDP or FSDP2 over the launcher's ranks."""
    return knob(
        "auto",
        "How the trained module is spread over the launcher's processes: ddp (Accelerate's DDP), fsdp2 "
        "(torch fully_shard per block and at the root, with the accelerate config's CPU offload and reshard "
        "settings) or auto: the accelerate config's (fsdp_version 2 → fsdp2), else ddp over more than one "
        "process. DeepSpeed, Megatron-LM and FSDP1 configs are refused. Not part of the run's identity: 1 "
        "process and N ranks give the same update.",
        choices=STRATEGIES,
        panel=OPTIMISATION,
    )


# who the ranks of `--sp-degree` are, by command kind: (what the other ranks do, how many ranks it needs)
SP_RANKS = {
    "stage": ("the other ranks are data parallel (dp = ranks / sp)", "a multiple of it as ranks"),
    "server": ("rank 0 serves and the others run each batch with it", "exactly this many ranks"),
    "trainer": (
        "the other ranks are data parallel (dp = ranks / sp); the in-process sampler stays one process on "
        "rank 0's device (--engine remote to an `omnirl serve --sp-degree` splits the rollouts too)",
        "a multiple of it as ranks",
    ),
}


def sp_degree(ranks: str = "stage") -> Any:
    """`--sp-degree`: sequence parallelism of a staged command's ranks, a server's (`ranks` "server": its
    launch is exactly one group) or online's trainer ("trainer")."""
    others, launch = SP_RANKS[ranks]
    return knob(
        1,
        "Sequence parallelism (diffusers' context parallelism): this many consecutive ranks of the launch "
        f"share each sample's tokens, so activations per rank shrink by it; {others}. FLUX, Qwen-Image and "
        f"Wan; needs a launcher (torchrun --nproc_per_node, accelerate launch) with {launch}.",
        low=1,
        panel=PARALLELISM,
    )


def sp_kind() -> Any:
    """`--sp-kind`: how sequence-parallel ranks attend."""
    return knob(
        "ulysses",
        "How --sp-degree ranks attend: ulysses (all-to-all over heads; heads must divide by it), ring "
        "(keys/values passed round; needs an attention backend returning the log-sum-exp, so an "
        "accelerator) or unified (ring × Ulysses).",
        choices=SP_KINDS,
        panel=PARALLELISM,
    )


def tp_degree() -> Any:
    """`--tp-degree`: tensor parallelism."""
    return knob(
        1,
        "Tensor parallelism (diffusers' _tp_plan): this many consecutive ranks each hold 1/N of the "
        "transformer's planned weights. FLUX and Qwen-Image (accelerators or CPU gloo ranks), without LoRA "
        "layers; not with --sp-degree; update averages the groups over dp (DDP or FSDP2 over the dp ranks).",
        low=1,
        panel=PARALLELISM,
    )


def attention_backend() -> Any:
    """`--attention-backend`: diffusers' attention dispatch."""
    return knob(
        None,
        "diffusers' attention backend for the transformer: native (torch SDPA, the default), _native_cudnn, "
        "flash, sage, ... whichever is installed here (a missing one is refused with the list; *_hub "
        "kernels, which download, are not offered). Recorded in the output's identity only when quantized "
        "(sage*); the others agree to rounding.",
        panel=PARALLELISM,
    )


def compile() -> Any:
    """`--compile`: torch.compile of the transformer."""
    return knob(
        False,
        "torch.compile the transformer: regional (each repeated block compiled once, diffusers' "
        "compile_repeated_blocks) where the model lists its blocks, else whole. The first forward pays the "
        "compilation; numbers agree to rounding, so not part of the output's identity.",
        panel=PARALLELISM,
    )


def gradient_checkpointing() -> Any:
    """`--gradient-checkpointing`."""
    return knob(
        False,
        "Recompute the trained module's activations in the backward (diffusers / transformers "
        "checkpointing): less memory for one more forward per trained step; same numbers.",
        panel=OPTIMISATION,
    )


def packing() -> Any:
    """`--packing`: VLM forwards over packed sequences (`stages.models.vlm.VLMPolicy.use_packing`)."""
    return knob(
        "auto",
        "VLM: run each forward over prompt + response on the real tokens only, every sequence back to back "
        "(no padding; the M-RoPE positions of the padded batch, a block-diagonal mask), as verl's "
        "use_remove_padding. Same values to float rounding, less compute and memory where lengths differ "
        "(docs/vlm.md). auto: where the model can (Qwen2.5-VL, Qwen3-VL; not the Qwen3-Omni thinker) and "
        "attends with a flash-attention (variable-length) kernel; sdpa and eager attend over a dense mask "
        "of the packed row, which costs more than the padding saves. on: pack whatever the kernel (refused "
        "for a model that cannot); off: padded.",
        choices=PACKING,
        panel=OPTIMISATION,
    )


def balance_tokens() -> Any:
    """`--balance-tokens`: micro-batches dealt by token count (`stages.update.balance`)."""
    return knob(
        False,
        "VLM: deal each optimizer step's rows over its micro-batches (and so over the ranks) by token "
        "count, longest first to the lightest, instead of --micro-batch rows each (verl's dynamic batch "
        "size and sequence balancing): the slowest rank waits less. The loss stays the step's exact "
        "token- or sequence-mean.",
        panel=OPTIMISATION,
    )


def micro_batch_tokens() -> Any:
    """`--micro-batch-tokens`: a token budget per VLM micro-batch (`stages.update.balance.budget_bins`)."""
    return knob(
        None,
        "VLM: at most N tokens (prompt + response) per forward, verl's use_dynamic_bsz with "
        "ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu. update: each rank's rows of an "
        "optimizer step (--micro-batch × --grad-accum, dealt as without it) go into as few micro-batches "
        "as fit N, longest first to the lightest, and every rank runs as many as the busiest so the "
        "collectives line up; the loss stays the step's exact token- or sequence-mean. logprob: each "
        "shard's rows, instead of the rollout's sampling batches (same values to float rounding). A row "
        "longer than N is a micro-batch of its own (a warning says so). Default: off (fixed row counts).",
        low=1,
        metavar="N",
        panel=OPTIMISATION,
    )


def micro_batch() -> Any:
    """`--micro-batch`: samples per training/replay forward."""
    return knob(0, "Samples per forward (0: the sampling batch size).", low=0, panel=OPTIMISATION)


def lora_rank() -> Any:
    """`--lora-rank` of a new adapter."""
    return knob(32, "LoRA rank of a new adapter (flow_grpo 32).", low=1, panel=OPTIMISATION)


def full() -> Any:
    """`--full`: full fine-tuning."""
    return knob(False, "Full fine-tuning instead of LoRA.", panel=OPTIMISATION)


def batch_size() -> Any:
    """`--batch-size` of the sampling stages."""
    return knob(
        8,
        "Samples per forward pass (VLM: responses per generate call, whole groups).",
        low=1,
        panel=SAMPLING,
    )


def guidance() -> Any:
    """`--guidance`, as the family's pipeline defines it."""
    return knob(
        4.5,
        "Guidance as the family's pipeline defines it: SD3 and Qwen-Image true CFG (1 = off), Z-Image "
        "pos + w·(pos − neg) (0 = off), FLUX.1 distilled guidance (a model input, one forward).",
        panel=SAMPLING,
    )


def resolution() -> Any:
    """`--resolution`: a side or HEIGHTxWIDTH."""
    return knob(
        None,
        "Sample size in pixels: a side (512) or HEIGHTxWIDTH (240x416, flow_grpo's Wan), each a multiple of "
        "the VAE factor × patch size (SD3: 16, Wan 2.1: 16, Wan 2.2 TI2V-5B: 32). Default: the native "
        "resolution an `init-model` or `pretrain` folder records, else 512.",
        metavar="SIDE|HxW",
        panel=SAMPLING,
    )


def frames() -> Any:
    """`--frames` per video sample."""
    return knob(
        1,
        "Frames per sample for a video family (Wan: 1 plus a multiple of 4, its pipeline's 81; at most "
        f"{MAX_FRAMES}); image families take 1.",
        low=1,
        high=MAX_FRAMES,
        panel=SAMPLING,
    )


def num_shards() -> Any:
    """`--num-shards` of an output that a stage splits itself."""
    return knob(
        None,
        "Number of output shards (default: one per --shard-rows rows, whole groups each, rounded up to a "
        "multiple of the launcher's ranks so that every rank works; later stages split by shard).",
        low=1,
        panel=IO,
    )


def shard_rows() -> Any:
    """`--shard-rows`: rows per shard when --num-shards is not given."""
    return knob(
        256,
        "Rows per shard when --num-shards is not given: a shard is the unit of resume, so a crash loses at "
        "most one shard's work.",
        low=1,
        panel=IO,
    )


# A server's limits (`stages.web.server.ServerLimits` takes its defaults from here).
MAX_CONNECTIONS, WORKERS, REQUEST_TIMEOUT_S = 256, 16, 60.0


def host() -> Any:
    """`--host` a server binds."""
    return knob(
        "127.0.0.1",
        "Address to bind: 127.0.0.1 (default) keeps it on this machine; 0.0.0.0 opens it.",
        panel=SERVER,
    )


def port(default: int) -> Any:
    """`--port` a server binds."""
    return knob(default, "Port to bind; 0 picks a free one (printed).", low=0, high=65535, panel=SERVER)


def token_env() -> Any:
    """`--token-env`: the server's bearer token's variable."""
    return knob(
        None,
        "Environment variable holding a bearer token every request but GET /health must carry.",
        panel=SERVER,
    )


def max_request_mb(default: int) -> Any:
    """`--max-request-mb`: largest request body."""
    return knob(default, "Largest request body, in MiB (413 above).", low=1, panel=SERVER)


def max_batch(default: int) -> Any:
    """`--max-batch`: most samples in one request."""
    return knob(default, "Most samples in one request (413 above).", low=1, panel=SERVER)


def max_connections() -> Any:
    """`--max-connections` a server holds open."""
    return knob(
        MAX_CONNECTIONS,
        "Open connections at once, idle ones included; one more is answered 503 with Retry-After and closed "
        "at once. It is also the listen backlog when above 128.",
        low=1,
        panel=SERVER,
    )


def workers() -> Any:
    """`--workers`: a server's request threads."""
    return knob(
        WORKERS,
        "Threads that read and answer requests (GET /health too). A connection between requests holds "
        "none; a request waits for a free one.",
        low=1,
        panel=SERVER,
    )


def request_timeout() -> Any:
    """`--request-timeout`: seconds to read one request."""
    return knob(
        REQUEST_TIMEOUT_S,
        "Seconds from a request's first byte until its headers and body are read in full: a client that "
        "sends slower gets 408 and is disconnected. Raise it for large uploads over slow links.",
        low=1,
        panel=SERVER,
    )


# How to reach a rollout server (`--engine remote`, VLM `--engine openai`): stages' EngineOptions.
def server_url() -> Any:
    """`--server-url` of a rollout server."""
    return knob(
        None,
        "Base URL of the server: `omnirl serve`'s or `vllm serve --omni`'s http://host:port, or an OpenAI "
        "API root http://host:8000/v1 for a VLM.",
        panel=ENGINE,
    )


def server_token_env() -> Any:
    """`--server-token-env`."""
    return knob(
        None,
        "Environment variable holding the rollout server's bearer token (its --token-env).",
        panel=ENGINE,
    )


def server_timeout() -> Any:
    """`--server-timeout`: seconds per reply."""
    return knob(600.0, "Seconds to wait for one reply.", low=1, panel=ENGINE)


def server_startup_timeout() -> Any:
    """`--server-startup-timeout`."""
    return knob(
        120.0,
        "Seconds to wait for the server's GET /health to answer 200, saying so on stderr every 30 s; "
        "connection refused counts as still starting (`omnirl serve` listens once its model is loaded), an "
        "unknown host or a 4xx does not. None within it: exit 2. Raise it for a server loading a big model.",
        low=0,
        panel=ENGINE,
    )


def server_retries() -> Any:
    """`--server-retries`."""
    return knob(
        8,
        "Further tries of a batch after a connection error, 502, 503 or 504 (backoff with jitter, the same "
        "seeds; a 4xx is never retried).",
        low=0,
        panel=ENGINE,
    )
