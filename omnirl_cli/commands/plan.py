"""`omnirl plan`: what each stage holds on one device, from the model's configs, before a run."""

from __future__ import annotations

from typing import Any

from stages.models.config import GIB, PlanConfig

from ..console import emit_json, out, progress
from ..generate import config_command


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
    sources = f"{a['source_tokens']} source + " if a["source_tokens"] else ""
    out.print(
        f"activations: {a['latent_tokens']} latent + {sources}{a['text_tokens']} text tokens, "
        f"hidden {a['hidden']}, "
        f"{a['blocks']} blocks, {_gib(a['per_block_per_sample'])} GiB per block and sample"
    )
    params = Table(title="parameters", title_justify="left")
    params.add_column("component")
    params.add_column("parameters (B)", justify="right")
    for name, count in result["parameters"].items():
        params.add_row(name, f"{count / 1e9:.3f}")
    for name, count in (result["experts"] or {}).items():  # a Mixture-of-Transformers' trained module
        expert = " expert" if name in ("understanding", "generation") else ""
        params.add_row(f"  {name}{expert}", f"{count / 1e9:.3f}")
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


def run(c: PlanConfig, json_: bool) -> None:
    """Plan the memory of sample, logprob, update and online on one device, before a run.

    The model is built on the meta device, from a folder's configs (no weights read) or from a family's
    published dimensions (--family qwen_image --size full), and for each stage the plan counts, per rank:
    each resident component's weights at --dtype (sample loads the whole pipeline; logprob and update the
    trained transformer alone, since they read the rollout's stored prompt conditioning and replay
    latents), the trained parameters (LoRA on the family's reference targets, or the whole transformer
    with --full, in fp32), their fp32 gradients and AdamW moments, the activations for --resolution,
    --frames, the batch and gradient checkpointing (17·s·h elements per block and sample, 22·s·h with
    --full; s = latent + source + text tokens, the source tokens those of an editing model's --references
    condition images at the output size where it appends them to the sequence, h the block width; fused
    attention assumed; sample also the VAE's
    decoding of its batch), and the total under the strategy: DDP holds everything on every rank; FSDP2
    divides the trained module's weights, gradients and optimizer state by --num-processes, gathers its
    largest block twice, and with --cpu-offload keeps those shards in host memory; --sp-degree S divides
    every activation by S (each rank holds 1/S of the sequence), --tp-degree T the trained module's
    weights, gradients and optimizer state by T. `online` holds a sampler's pipeline beside the trainer's.
    With --cpu the total also counts the process's runtime and is the process's peak resident memory
    (checked within ±25% on the small build of every family: docs/real-checkpoints.md). The verdict
    compares each total with --device-memory. --json gives the parameters per component (`parameters`),
    a Mixture-of-Transformers' (BAGEL's) by expert (`experts`: understanding, generation, shared and
    `active`, what one token runs through) and the whole plan, in bytes.

    Example: [bold]omnirl plan --family qwen_image --size full --resolution 512 --lora-rank 64 --dtype bf16 \\
    --num-processes 8 --strategy fsdp2 --device-memory 80[/]
    """
    from stages.errors import UserInputError
    from stages.models.plan import plan as make_plan
    from stages.models.plan_arch import from_family, from_folder

    if (c.model is None) == (c.family is None):
        raise UserInputError("pass --model FOLDER or --family F (with --size), one of them")
    c.validate()
    what = c.model if c.model is not None else f"{c.family}/{c.size}"
    with progress() as bar:
        bar.add_task(f"building {what} on the meta device", total=None, rate="")
        if c.model is not None:
            arch = from_folder(c.model, c.understand)
        else:
            arch = from_family(c.family, c.size, c.understand)
        result = make_plan(arch, c)
    if json_:
        emit_json(result)
    else:
        _render(result)


plan = config_command(PlanConfig, "plan", run)
