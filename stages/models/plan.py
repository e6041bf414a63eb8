"""A memory plan: what each stage holds on one device, per rank, before a run starts.

The architecture is built on the meta device (shapes, no memory, no weights read; `stages.models.plan_arch`):
from a model folder's configs (`model_index.json` and each component's config, a VLM's `config.json`, or
a BAGEL folder's two configs and weight-file headers), or from a family's published size
(`stages.models.factory.make_model`). From it and the run's settings the plan counts, per stage, what the
stage keeps resident today:

- sample: every module component of the pipeline at `--dtype` (it encodes the prompts and decodes the
  latents), plus the larger of one forward's activations and the VAE's decoding of the batch;
- logprob: the trained modules only: `FlowPolicy.for_rollout` takes the prompts' conditioning from the
  rollout (which `sample` stores) and replays latents, so no text encoder and no VAE load;
- update: the same modules, the trained parameters in fp32 (LoRA on the family's `lora_targets`, or the
  whole trained module with `--full`: `FlowPolicy.trainable_parameters` casts them to fp32, so they are
  their own master weights and no further copy is kept), fp32 gradients, AdamW's two fp32 moments, and the
  training activations;
- online: a sampler's pipeline and the trainer's, both resident at once (both stages' totals added).

Activations (bytes) are a per-block estimate. With s = latent tokens + source tokens + text tokens (an
editing model's condition images, `--references` of them at the output size, each adding its latent tokens
where the family appends them to the sequence: `FamilyAdapter.condition_tokens`), h the block's
hidden width, L the number of blocks, b the micro-batch times the CFG branches (2 when the guidance
runs an unconditional branch) and a the activation element size (2 under bf16/fp16 autocast or
weights, else 4), one block's stored activations are A = 17·s·h·a per sample (Korthikanti et al.'s
34·s·h bytes at 16 bits: the attention and MLP inputs and outputs with an MLP of 4·h, no s² score
matrix, which fused attention does not keep); a full fine-tune keeps 22·s·h·a (every linear layer's input
and the tensors the trained adaLN modulation multiplies, counted on the small SD3). Training keeps L·A·b;
with gradient checkpointing only each block's input, L·s·h·a·b, plus one block recomputed, A·b.
Inference keeps one block's A·b at a time. Latent tokens are the adapter's latent shape in 2×2 spatial
patches (every family patches so); a VLM's s is its text tokens. BAGEL (a Mixture-of-Transformers: two
experts a layer, `_experts`) counts as a diffusion family whose trained module is the whole model: its
latent tokens run through the generation expert, which its LoRA wraps, and s also counts the prompt's
tokens (whose keys and values the latents attend to); its blocks are its two-expert layers.

On the CPU (`cpu`) the device is the process's own memory: each stage adds the runtime a process holds
before any tensor (`CPU_RUNTIME`), and the total is the process's peak resident memory when the allocator
returns freed blocks (benchmarks/bench_plan.py; glibc's default keeps some for reuse, as an accelerator's
caching allocator does beyond `max_memory_allocated`, the figure the plan predicts there).

Strategies: DDP keeps everything on every rank, plus a gradient bucket per trained parameter (the
reducer's copy). FSDP2 shards the trained module (`stages.update.parallel`): its weights, gradients
and optimizer state divided by the world size, plus its largest block gathered whole twice (the
block computing and the one prefetched); the frozen components stay whole on every rank. CPU offload
(FSDP2) keeps the trained module's shards, gradients and optimizer state in host memory instead.

Model parallelism (`stages.parallelism`): under --sp-degree S each rank holds 1/S of every sequence, so
every activation term is divided by S; under --tp-degree T each rank holds 1/T of the trained module's
weights (diffusers' plan shards its attention and MLP projections; the small replicated norms and
modulations are counted as sharded too). FSDP2 still shards over all the ranks.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from stages.errors import UserInputError
from stages.models.config import GIB, PlanConfig
from stages.models.diffusion import DTYPES
from stages.models.factory import parameter_count
from stages.models.families import parse_resolution
from stages.models.plan_arch import Architecture
from stages.precision import MIXED_PRECISIONS, resolve_mixed_precision

FP32 = 4
ADAM_MOMENTS = 2
ACTIVATION_ELEMENTS_PER_HIDDEN = 17  # per token and block (module docstring)
# A full fine-tune also keeps what only trained weights need: every linear layer's input and the tensors
# the trained adaLN shift/scale/gate multiply. Counted with saved_tensors_hooks on the small SD3's forward
# (fp32, 4 samples at 128 px): 22.1 elements per token, hidden unit and block with --full, 12.6 with LoRA.
FULL_ACTIVATION_ELEMENTS_PER_HIDDEN = 22
PATCH_AREA = 4  # 2×2 latent patches per transformer token
GATHERED_BLOCKS = 2  # FSDP2: the block computing and the one prefetched
DECODE_WIDTHS = 6  # VAE decoding: three tensors of twice the output conv's width at full resolution (_decode)
# On the CPU the device is the process's own memory, which also holds its runtime: the interpreter and the
# libraries a stage imports (torch, diffusers, transformers, peft, accelerate, pyarrow, tokenizers) with
# their kernels initialised. Calibrated once (torch 2.13 CPU): the peak RSS of sample, logprob, update and
# update --full on the tiny SD3 (547, 521, 539 and 548 MiB; `benchmarks/bench_plan.py --size tiny`) less
# the 8-18 MiB of tensors the plan counts there.
CPU_RUNTIME = 526 * 2**20
# settings of `PlanConfig` the plan's JSON gives elsewhere: the model as `model`, the memory as
# `device_memory` (bytes), the model parallelism as settings.parallel
PLANNED_ELSEWHERE = ("model", "family", "size", "device_memory", "sp_degree", "sp_kind", "tp_degree")


# ------------------------------------------------------------------------------------------ counting
def _blocks(arch: Architecture) -> list[torch.nn.Module]:
    """The repeated blocks of the trained modules (the classes of their `_no_split_modules`, which FSDP2
    shards one by one); a VLM's are its language model's (the towers see no text tokens)."""
    found = []
    for part in arch.trained:
        module = arch.modules[part]
        names = set(getattr(module, "_no_split_modules", None) or [])
        if arch.kind == "vlm":  # a transformers VLM's, or BAGEL's own
            module = getattr(module, "model", module).language_model
        found += [m for m in module.modules() if type(m).__name__ in names]
    return found


def _hidden(block: torch.nn.Module) -> int:
    """A block's hidden width: the input width of its first linear layer."""
    for m in block.modules():
        if isinstance(m, torch.nn.Linear):
            return m.in_features
    raise UserInputError(f"{type(block).__name__} has no linear layer to read its width from")


def _lora_parameters(arch: Architecture, rank: int) -> int:
    """LoRA parameters r·(in + out) of every linear layer the trainer wraps: PEFT's suffix match of the
    family's `lora_targets` in each trained module, or the VLM regex over the model's names."""
    total = 0
    for part in arch.trained:
        for name, m in arch.modules[part].named_modules():
            if not isinstance(m, torch.nn.Linear):
                continue
            if isinstance(arch.lora_targets, str):
                hit = re.fullmatch(arch.lora_targets, name) is not None
            else:
                hit = any(name == t or name.endswith("." + t) for t in arch.lora_targets)
            if hit:
                total += rank * (m.in_features + m.out_features)
    return total


def _full_parameters(arch: Architecture) -> int:
    """Everything of the trained modules (a VLM's towers stay frozen, `VLMPolicy.trainable_parameters`)."""
    if arch.kind == "vlm":
        from stages.models.vlm import TOWERS

        return sum(
            p.numel()
            for n, p in arch.modules["model"].named_parameters()
            if not any(t in f".{n}" for t in TOWERS)
        )
    return sum(parameter_count(arch.modules[part]) for part in arch.trained)


def _experts(arch: Architecture) -> dict[str, int] | None:
    """A Mixture-of-Transformers trained module's parameters by expert (BAGEL: every layer's `_moe_gen`
    weights are the generation expert's, their namesakes without it the understanding expert's) and what
    one token runs through (`active`: one expert and the rest); None for a module without experts."""
    counts = {"understanding": 0, "generation": 0, "shared": 0}
    for part in arch.trained:
        names = {n: p.numel() for n, p in arch.modules[part].named_parameters()}
        twins = {n.replace("_moe_gen", "") for n in names if "_moe_gen" in n}
        for n, count in names.items():
            expert = "generation" if "_moe_gen" in n else "understanding" if n in twins else "shared"
            counts[expert] += count
    if not counts["generation"]:
        return None
    return {**counts, "active": counts["shared"] + counts["understanding"]}


def _references(arch: Architecture, cfg: PlanConfig) -> int:
    """The condition images per prompt planned for: `cfg.references`, or the fewest the family takes; a
    count it does not take is a one-line error."""
    if arch.kind == "vlm":
        if cfg.references:
            raise UserInputError(
                f"--references {cfg.references}: {arch.name} is a VLM; count its image tokens in --text-tokens"
            )
        return 0
    fewest, most = arch.adapter.condition_images
    if cfg.references is None:
        return fewest
    if not fewest <= cfg.references <= most:
        takes = f"{fewest}" if fewest == most else f"{fewest} to {most}"
        raise UserInputError(
            f"--references {cfg.references}: {arch.name} takes {takes} condition image(s) per prompt"
        )
    return cfg.references


def _tokens(arch: Architecture, cfg: PlanConfig) -> tuple[int, int, int]:
    """(latent tokens, source tokens, text tokens) of one sample: the condition images' latent tokens
    (each at the output size) where the family appends them to the sequence."""
    text = cfg.text_tokens if cfg.text_tokens is not None else arch.text_tokens
    references = _references(arch, cfg)
    if arch.kind == "vlm":
        return 0, 0, text
    resolution = parse_resolution(cfg.resolution if cfg.resolution is not None else arch.resolution)
    shape = arch.adapter.latent_shape(resolution, cfg.frames)
    cells = 1
    for side in shape[1:]:
        cells *= side
    latent = cells // PATCH_AREA
    return latent, latent * references if arch.adapter.condition_tokens else 0, text


def _decode(arch: Architecture, cfg: PlanConfig, element: int) -> int:
    """Peak bytes of the VAE decoding one sampling batch (no autograd). It peaks at full resolution, where
    the last upsampler's input and output and the next block's normalised input (each twice the width w
    of the decoder's output conv) are alive at once: DECODE_WIDTHS·w per pixel, frame and sample. A video
    VAE decodes one latent frame (its temporal factor's pixel frames) at a time."""
    vae = arch.modules.get("vae")
    if vae is None or not hasattr(vae, "decoder"):
        return 0
    convs = [m for m in vae.decoder.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d))]
    height, width = parse_resolution(cfg.resolution if cfg.resolution is not None else arch.resolution)
    temporal = getattr(arch.adapter.pipe, "vae_scale_factor_temporal", None)
    frames = min(cfg.frames, temporal) if temporal else cfg.frames
    return DECODE_WIDTHS * convs[-1].in_channels * height * width * frames * cfg.batch_size * element


def _branches(arch: Architecture, cfg: PlanConfig) -> int:
    """2 when the guidance runs an unconditional branch beside the conditional one, else 1."""
    if arch.kind == "vlm":
        return 1
    return 2 if arch.adapter.needs_negative(cfg.guidance) else 1


@dataclass
class StagePlan:
    """Bytes one rank holds on its device in one stage; `host` is what CPU offload keeps off it."""

    weights: dict[str, int] = field(default_factory=dict)
    trainable_parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    ddp_buckets: int = 0
    gathered: int = 0
    activations: int = 0
    host: int = 0
    runtime: int = 0  # on the CPU: the process's interpreter and libraries (`CPU_RUNTIME`)

    @property
    def total(self) -> int:
        return (
            self.runtime
            + sum(self.weights.values())
            + self.gradients
            + self.optimizer
            + self.ddp_buckets
            + self.gathered
            + self.activations
        )

    def as_dict(self, device_memory: int | None) -> dict[str, Any]:
        out = asdict(self)
        out["total"] = self.total
        out["fits"] = None if device_memory is None else self.total <= device_memory
        return out


def plan(arch: Architecture, cfg: PlanConfig) -> dict[str, Any]:
    """The memory plan of `arch` under `cfg`: per stage, each resident component's weights, trainable
    parameters, gradients, optimizer state, activations and the total per rank (bytes), and whether it
    fits `cfg.device_memory` GiB (default: the visible accelerator's memory; no verdict without one).
    The mixed precision is `cfg`'s, else the launcher's, else none. JSON-able."""
    cfg.validate()
    if cfg.full and not arch.trains_full:
        raise UserInputError(f"--full: {arch.name} trains a LoRA only; drop --full and pass --lora-rank")
    kind = cfg.kind()
    world = cfg.num_processes
    weight_bytes = DTYPES[cfg.dtype].itemsize
    mixed = resolve_mixed_precision(cfg.mixed_precision)
    autocast = MIXED_PRECISIONS[mixed]
    memory = accelerator_memory() if cfg.device_memory is None else int(cfg.device_memory * GIB)
    act_bytes = 2 if weight_bytes == 2 or autocast is not None else 4
    params = {name: parameter_count(module) for name, module in arch.modules.items()}
    latent, source, text = _tokens(arch, cfg)
    seq = latent + source + text
    branches = _branches(arch, cfg)
    blocks = _blocks(arch)
    if not blocks:
        raise UserInputError(
            f"{arch.name}: its trained module has no repeated blocks to estimate activations by"
        )
    hidden = max(_hidden(b) for b in blocks)
    sp, tp = cfg.parallel.sp_degree, cfg.parallel.tp_degree
    # A, one sample, one branch, on one rank: its 1/sp of the sequence
    per_block = -(-ACTIVATION_ELEMENTS_PER_HIDDEN * seq * hidden * act_bytes // sp)
    trained_names = arch.trained if arch.kind == "diffusion" else ("model",)

    runtime = CPU_RUNTIME if cfg.cpu else 0
    # sample: every component at --dtype (the trained module's 1/tp; it encodes the prompts and decodes
    # the latents), one block's activations for the sampling batch
    every = {n: -(-c * weight_bytes // (tp if n in trained_names else 1)) for n, c in params.items()}
    forward = per_block * cfg.batch_size * branches
    decode = _decode(arch, cfg, act_bytes)
    sample = StagePlan(weights=every, activations=max(forward, decode), runtime=runtime)
    # logprob: the trained modules only (`FlowPolicy.for_rollout`: the rollout's stored conditioning
    # stands for the text encoders, and latents need no VAE), the same forwards as the sampler's
    logprob = StagePlan(weights={n: every[n] for n in trained_names}, activations=forward, runtime=runtime)

    # update: + trained parameters (fp32), gradients, AdamW moments, training activations
    trainable = _full_parameters(arch) if cfg.full else _lora_parameters(arch, cfg.lora_rank)
    train = StagePlan(weights=dict(logprob.weights), trainable_parameters=trainable, runtime=runtime)
    if cfg.full:
        for name in trained_names:
            frozen = params[name] * weight_bytes
            trained_here = _full_parameters(arch) if arch.kind == "vlm" else params[name]
            train.weights[name] = -(-(frozen + trained_here * (FP32 - weight_bytes)) // tp)
    else:
        train.weights["lora"] = trainable * FP32
    train.gradients = -(-trainable * FP32 // tp)
    train.optimizer = -(-trainable * FP32 * ADAM_MOMENTS // tp)
    micro = (cfg.micro_batch or cfg.batch_size) * branches
    trained_block = per_block
    if cfg.full:
        trained_block = -(-FULL_ACTIVATION_ELEMENTS_PER_HIDDEN * seq * hidden * act_bytes // sp)
    if cfg.gradient_checkpointing:
        kept = -(-len(blocks) * seq * hidden * act_bytes // sp) + trained_block
    else:
        kept = len(blocks) * trained_block
    train.activations = kept * micro
    if kind == "ddp":
        train.ddp_buckets = train.gradients
    elif kind == "fsdp2":
        for name in (*trained_names, "lora"):
            if name in train.weights:
                train.weights[name] = -(-train.weights[name] // world)
        train.gradients = -(-train.gradients // world)
        train.optimizer = -(-train.optimizer // world)
        largest = max(
            sum(p.numel() * (FP32 if cfg.full else weight_bytes) for p in b.parameters()) for b in blocks
        )
        train.gathered = largest * GATHERED_BLOCKS
        if cfg.cpu_offload:
            shards = sum(train.weights.pop(n, 0) for n in (*trained_names, "lora"))
            train.host = shards + train.gradients + train.optimizer
            train.gradients = train.optimizer = 0

    online = StagePlan(
        weights={
            n: sample.weights.get(n, 0) + train.weights.get(n, 0) for n in {**sample.weights, **train.weights}
        },
        trainable_parameters=trainable,
        gradients=train.gradients,
        optimizer=train.optimizer,
        ddp_buckets=train.ddp_buckets,
        gathered=train.gathered,
        activations=sample.activations + train.activations,
        host=train.host,
        runtime=sample.runtime + train.runtime,  # the sampler's process and the trainer's
    )
    stages = {"sample": sample, "logprob": logprob, "update": train, "online": online}
    return {
        "model": arch.name,
        "kind": arch.kind,
        "parameters": arch.parameters(),
        "experts": _experts(arch),
        "trained": list(arch.trained),
        "settings": {
            **{k: v for k, v in asdict(cfg).items() if k not in PLANNED_ELSEWHERE},
            "parallel": asdict(cfg.parallel),
            "mixed_precision": mixed,
            "resolution": None
            if arch.kind == "vlm"
            else list(parse_resolution(cfg.resolution if cfg.resolution is not None else arch.resolution)),
            "text_tokens": text,
            "references": _references(arch, cfg),
            "strategy": kind,
        },
        "activations": {
            "latent_tokens": latent,
            "source_tokens": source,
            "text_tokens": text,
            "sequence": seq,
            "hidden": hidden,
            "blocks": len(blocks),
            "cfg_branches": branches,
            "bytes_per_element": act_bytes,
            "per_block_per_sample": per_block,
            "vae_decode": decode,
        },
        "device_memory": memory,
        "stages": {name: stage.as_dict(memory) for name, stage in stages.items()},
    }


def accelerator_memory() -> int | None:
    """Total memory of the visible accelerator (`torch.accelerator`), None without one."""
    if not torch.accelerator.is_available():
        return None
    return int(torch.accelerator.get_memory_info()[1])
