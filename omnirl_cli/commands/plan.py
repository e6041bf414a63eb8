"""`omnirl plan`: what each stage holds on one device, from the model's configs, before a run."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from stages.knobs import OPTIMISATION, WEIGHTS_METAVAR

from ..choices import FAMILIES, ModelSize, complete
from ..config import resolve
from ..console import emit_json, out, progress
from ..errors import handle_errors
from ..options import (
    WEIGHTS_FROM,
    BatchSizeOpt,
    ConfigOpt,
    DtypeOpt,
    FramesOpt,
    FullOpt,
    GradientCheckpointingOpt,
    GuidanceOpt,
    JsonOpt,
    LoraRankOpt,
    MicroBatchOpt,
    ResolutionOpt,
    SetOpt,
    SpDegreeOpt,
    SpKindOpt,
    StrategyOpt,
    TpDegreeOpt,
    mixed_precision_opt,
)

MODEL = "Model"
DEVICE = "Devices"
GIB = 2**30


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}" if n else ""


def _render(result: dict[str, Any]) -> None:
    """The plan as tables on stdout: parameters per component, then bytes per stage (GiB)."""
    from rich.table import Table

    s, a = result["settings"], result["activations"]
    where = "1 process" if s["strategy"] == "none" else f"{s['num_processes']} ranks, {s['strategy']}"
    where += ", CPU offload" if s["cpu_offload"] else ""
    for kind in ("sp", "tp"):
        where += f", {kind} {s['parallel'][f'{kind}_degree']}" if s["parallel"][f"{kind}_degree"] > 1 else ""
    trained = f"full ({s['dtype']} frozen, fp32 trained)" if s["full"] else f"LoRA rank {s['lora_rank']}"
    size = (
        ""
        if s["resolution"] is None
        else f"{'x'.join(map(str, s['resolution']))} px, {s['frames']} frame(s), "
    )
    out.print(
        f"[bold]{result['model']}[/]: {trained}, {where}; {size}batch {s['batch_size']}, micro-batch "
        f"{s['micro_batch'] or s['batch_size']}, {a['cfg_branches']} CFG branch(es), "
        f"mixed precision {s['mixed_precision']}, gradient checkpointing {'on' if s['gradient_checkpointing'] else 'off'}"
    )
    out.print(
        f"activations: {a['latent_tokens']} latent + {a['text_tokens']} text tokens, hidden {a['hidden']}, "
        f"{a['blocks']} blocks, {_gib(a['per_block_per_sample'])} GiB per block and sample"
    )
    params = Table(title="parameters", title_justify="left")
    params.add_column("component")
    params.add_column("parameters (B)", justify="right")
    for name, count in result["parameters"].items():
        params.add_row(name, f"{count / 1e9:.3f}")
    out.print(params)
    stages = result["stages"]
    table = Table(title="GiB per rank", title_justify="left")
    table.add_column("")
    for name in stages:
        table.add_column(name, justify="right")
    components = list(dict.fromkeys(c for st in stages.values() for c in st["weights"]))
    for c in components:
        table.add_row(
            f"weights {c}", *(_gib(st["weights"][c]) if c in st["weights"] else "" for st in stages.values())
        )
    for key in (
        "gradients",
        "optimizer",
        "ddp_buckets",
        "gathered",
        "activations",
        "runtime",
        "total",
        "host",
    ):
        table.add_row(key.replace("_", " "), *(_gib(st[key]) for st in stages.values()))
    table.add_row(
        "trainable (M)",
        *(f"{n / 1e6:.1f}" if (n := st["trainable_parameters"]) else "" for st in stages.values()),
    )
    memory = result["device_memory"]
    verdict = ["fits" if st["fits"] else "[red]does not fit[/]" for st in stages.values()]
    table.add_row(
        f"fits {_gib(memory)} GiB?" if memory else "fits?", *(verdict if memory else ["?"] * len(stages))
    )
    out.print(table)
    if not memory:
        out.print("no accelerator visible: pass --device-memory GIB for a fits / does-not-fit verdict")


@handle_errors
def plan(
    ctx: typer.Context,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            metavar=WEIGHTS_METAVAR,
            envvar="OMNIRL_MODEL",
            help=f"Model folder whose configs are read (no weights): {WEIGHTS_FROM}. Or --family.",
            rich_help_panel=MODEL,
        ),
    ] = None,
    family: Annotated[
        str | None,
        typer.Option(
            "--family",
            autocompletion=complete(FAMILIES),
            help=f"A built-in architecture instead of --model: {', '.join(FAMILIES)}.",
            rich_help_panel=MODEL,
        ),
    ] = None,
    size: Annotated[
        ModelSize,
        typer.Option(
            "--size",
            help="Size of --family: full (its flagship: Qwen-Image 20B, FLUX.1-dev, Wan 2.1 T2V 14B, SD3.5 "
            "Large, ...), another published size (sd3 medium, wan2_1 1.3b, qwen2_5_vl 3b / 7b) or tiny / small.",
            rich_help_panel=MODEL,
        ),
    ] = "full",
    dtype: DtypeOpt = "fp32",
    mixed_precision: mixed_precision_opt(
        "the forwards (activations in 16 bits under bf16 / fp16)", OPTIMISATION, recorded="Planned for."
    ) = None,
    resolution: ResolutionOpt = None,
    frames: FramesOpt = 1,
    guidance: GuidanceOpt = 4.5,
    batch_size: BatchSizeOpt = 8,
    micro_batch: MicroBatchOpt = 0,
    text_tokens: Annotated[
        int | None,
        typer.Option(
            "--text-tokens",
            min=1,
            help="Text tokens per sample (default: the model's text length; VLM: 1024, prompt and response).",
        ),
    ] = None,
    lora_rank: LoraRankOpt = 32,
    full: FullOpt = False,
    gradient_checkpointing: GradientCheckpointingOpt = False,
    strategy: StrategyOpt = "auto",
    num_processes: Annotated[
        int,
        typer.Option(
            "--num-processes",
            min=1,
            help="Ranks the stages run on (accelerate launch --num_processes, torchrun --nproc_per_node).",
            rich_help_panel=DEVICE,
        ),
    ] = 1,
    sp_degree: SpDegreeOpt = 1,
    sp_kind: SpKindOpt = "ulysses",
    tp_degree: TpDegreeOpt = 1,
    cpu_offload: Annotated[
        bool,
        typer.Option(
            "--cpu-offload",
            help="FSDP2 with the accelerate config's fsdp_offload_params: the trained module's shards, "
            "gradients and optimizer state in host memory.",
            rich_help_panel=DEVICE,
        ),
    ] = False,
    cpu: Annotated[
        bool,
        typer.Option(
            "--cpu",
            help="Plan a run on the CPU: the device is the process's own memory, so each stage's total also "
            "counts the process's runtime (interpreter, torch and the libraries: 0.51 GiB, measured on the tiny builds), a row "
            "of its own; the total is then the process's peak resident memory.",
            rich_help_panel=DEVICE,
        ),
    ] = False,
    device_memory: Annotated[
        float | None,
        typer.Option(
            "--device-memory",
            min=0,
            metavar="GIB",
            help="Memory of one device in GiB, for the verdict (default: the visible accelerator's, "
            "torch.accelerator; none on a CPU-only machine).",
            rich_help_panel=DEVICE,
        ),
    ] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Plan the memory of sample, logprob, update and online on one device, before a run.

    The model is built on the meta device, from a folder's configs (no weights read) or from a family's
    published dimensions (--family qwen_image --size full), and for each stage the plan counts, per rank:
    each resident component's weights at --dtype (sample loads the whole pipeline; logprob and update the
    trained transformer alone, since they read the rollout's stored prompt conditioning and replay
    latents), the trained parameters (LoRA on the family's reference targets, or the whole transformer
    with --full, in fp32), their fp32 gradients and AdamW moments, the activations for --resolution,
    --frames, the batch and gradient checkpointing (17·s·h elements per block and sample, 22·s·h with
    --full; s = latent + text tokens, h the block width; fused attention assumed; sample also the VAE's
    decoding of its batch), and the total under the strategy: DDP holds everything on every rank; FSDP2
    divides the trained module's weights, gradients and optimizer state by --num-processes, gathers its
    largest block twice, and with --cpu-offload keeps those shards in host memory; --sp-degree S divides
    every activation by S (each rank holds 1/S of the sequence), --tp-degree T the trained module's
    weights, gradients and optimizer state by T. `online` holds a sampler's pipeline beside the trainer's.
    With --cpu the total also counts the process's runtime and is the process's peak resident memory
    (checked within ±25% on the small build of every family: docs/real-checkpoints.md). The verdict
    compares each total with --device-memory. --json gives the parameters per component (`parameters`)
    and the whole plan, in bytes.

    Example: [bold]omnirl plan --family qwen_image --size full --resolution 512 --lora-rank 64 --dtype bf16 \\
    --num-processes 8 --strategy fsdp2 --device-memory 80[/]
    """
    c = resolve(ctx, "plan")
    from stages.errors import UserInputError
    from stages.models.plan import PlanConfig, accelerator_memory, from_family, from_folder
    from stages.models.plan import plan as make_plan
    from stages.precision import resolve_mixed_precision

    if (c["model"] is None) == (c["family"] is None):
        raise UserInputError("pass --model FOLDER or --family F (with --size), one of them")
    memory = accelerator_memory() if c["device_memory"] is None else int(c["device_memory"] * GIB)
    mixed = resolve_mixed_precision(c["mixed_precision"])
    cfg = PlanConfig.from_options({**c, "mixed_precision": mixed, "device_memory": memory})
    cfg.validate()
    what = c["model"] if c["model"] is not None else f"{c['family']}/{c['size']}"
    with progress() as bar:
        bar.add_task(f"building {what} on the meta device", total=None, rate="")
        arch = from_folder(c["model"]) if c["model"] is not None else from_family(c["family"], c["size"])
        result = make_plan(arch, cfg)
    if json_:
        emit_json(result)
    else:
        _render(result)
