"""`omnirl pretrain`: rectified-flow pretraining of a pipeline on captioned images."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from ..choices import VaeMode
from ..config import resolve
from ..console import emit_json, log, print_result, progress
from ..errors import handle_errors
from ..options import REQUIRED, ConfigOpt, JsonOpt, OverwriteOpt, SetOpt, model_opt

IO = "Input / output"
TRAIN = "Training"
VAE = "Pixel VAE"


@handle_errors
def pretrain(
    ctx: typer.Context,
    model: model_opt("Diffusers pipeline to start from, e.g. one `omnirl init-model` built", IO) = None,
    data: Annotated[
        Path | None,
        typer.Option(
            "--data",
            help="Folder of PNG images and one .jsonl of captions (`prompt`, `caption` or `text`; row i ↔ "
            "the i-th PNG by name, or each row's `file_name`). Synthetic shapes: python "
            "recipes/tasks/shapes.py --out DIR/captions.jsonl --num-prompts 4096 --images DIR. " + REQUIRED,
            rich_help_panel=IO,
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "-o",
            help=f"New folder for the pretrained pipeline (from_pretrained-loadable). {REQUIRED}",
            rich_help_panel=IO,
        ),
    ] = None,
    steps: Annotated[
        int, typer.Option("--steps", min=1, help="Optimizer steps.", rich_help_panel=TRAIN)
    ] = 1000,
    batch_size: Annotated[
        int, typer.Option("--batch-size", min=1, help="Images per step.", rich_help_panel=TRAIN)
    ] = 32,
    lr: Annotated[
        float, typer.Option("--lr", min=0.0, help="AdamW learning rate.", rich_help_panel=TRAIN)
    ] = 2e-3,
    weight_decay: Annotated[
        float, typer.Option("--weight-decay", min=0.0, help="AdamW weight decay.", rich_help_panel=TRAIN)
    ] = 0.0,
    max_grad_norm: Annotated[
        float, typer.Option("--max-grad-norm", help="Gradient-norm clip per step.", rich_help_panel=TRAIN)
    ] = 1.0,
    ema_decay: Annotated[
        float,
        typer.Option(
            "--ema-decay",
            help="The saved weights are this EMA of the trained ones (warm-up min(d, (1+k)/(10+k))).",
            rich_help_panel=TRAIN,
        ),
    ] = 0.998,
    caption_dropout: Annotated[
        float,
        typer.Option(
            "--caption-dropout",
            help='Share of captions replaced by "" (the unconditional branch CFG samples with).',
            rich_help_panel=TRAIN,
        ),
    ] = 0.1,
    resolution: Annotated[
        int | None,
        typer.Option(
            "--resolution",
            min=1,
            help="Image side the data is centre-cropped and resized to; default the model card's native "
            "resolution (an `init-model` folder), else the first image's width.",
            rich_help_panel=TRAIN,
        ),
    ] = None,
    text_length: Annotated[
        int | None,
        typer.Option(
            "--text-length",
            min=1,
            help="Text-encoder tokens (SD3: T5) per caption; default the model card's text_length, else 128. "
            "Sample with the same length.",
            rich_help_panel=TRAIN,
        ),
    ] = None,
    shift: Annotated[
        float | None,
        typer.Option(
            "--shift",
            help="Time shift s of uniform t: σ = s·t/(1+(s−1)·t); default the family scheduler's (SD3: 3).",
            rich_help_panel=TRAIN,
        ),
    ] = None,
    seed: Annotated[
        int,
        typer.Option(
            "--seed",
            min=0,
            help="Every random draw: the same seed, data, machine and thread count give the same bytes.",
            rich_help_panel=TRAIN,
        ),
    ] = 0,
    checkpoint_every: Annotated[
        int,
        typer.Option(
            "--checkpoint-every",
            min=0,
            help="Checkpoint every K steps of each phase and at its end, atomically, into the hidden folder "
            ".OUT.checkpoint beside --out (removed once --out is saved); 0: none. The same command re-run "
            "after a kill continues from the last checkpoint to the same bytes (same machine and threads).",
            rich_help_panel=TRAIN,
        ),
    ] = 500,
    vae: Annotated[
        VaeMode,
        typer.Option(
            "--vae",
            help="model: learn the model's own VAE latents. pixel: first fit the VAE as a pixel VAE (latent = "
            "the image average-pooled by the VAE factor, white 0, ×2.5) and learn those.",
            rich_help_panel=VAE,
        ),
    ] = "model",
    vae_steps: Annotated[
        int,
        typer.Option(
            "--vae-steps",
            min=0,
            help="Pixel VAE decoder steps (5000: ~3 min on one CPU thread for the demo size); 0 keeps the "
            "pixel VAE that an earlier --vae pixel run saved in --model.",
            rich_help_panel=VAE,
        ),
    ] = 5000,
    vae_encoder_steps: Annotated[
        int, typer.Option("--vae-encoder-steps", min=0, help="Pixel VAE encoder steps.", rich_help_panel=VAE)
    ] = 500,
    vae_batch_size: Annotated[
        int, typer.Option("--vae-batch-size", min=1, help="Images per pixel VAE step.", rich_help_panel=VAE)
    ] = 2,
    vae_lr: Annotated[
        float,
        typer.Option(
            "--vae-lr", min=0.0, help="Pixel VAE learning rate (cosine decay).", rich_help_panel=VAE
        ),
    ] = 2e-3,
    overwrite: OverwriteOpt = False,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Pretrain a pipeline's transformer, from scratch or further, on captioned images (rectified flow).

    x_σ = (1−σ)·x0 + σ·ε, target ε − x0, σ uniform under the family's time shift; EMA weights and caption
    dropout. Saves a complete pipeline folder that `omnirl sample --model OUT` and `from_pretrained` load,
    with an omnirl_model.json recording how it was made. Synthetic shapes data: python
    recipes/tasks/shapes.py --out data/shapes/captions.jsonl --num-prompts 4096 --images data/shapes

    Resumable: every --checkpoint-every steps the run saves all it depends on (weights, optimizer, EMA,
    random states, data order, losses) to .OUT.checkpoint beside --out; re-running the same command after
    a kill continues from there, and the output is byte-identical to an uninterrupted run's. A re-run with
    other options or other --model/--data files is refused, naming the first that differs (--overwrite
    discards the checkpoint and starts over).

    Example: [bold]omnirl pretrain --model models/demo --data data/shapes --vae pixel --out models/demo-shapes[/]
    """
    c = resolve(ctx, "pretrain", required=("model", "data", "out"))
    from stages.models.diffusion import FlowPolicy
    from stages.models.factory import native_resolution
    from stages.pretrain.flow_matching import (
        PretrainConfig,
        check_out,
        run_identity,
        save_pretrained_model,
    )
    from stages.pretrain.flow_matching import pretrain as run_pretrain
    from stages.pretrain.images import read_image_dataset
    from stages.pretrain.resume import Checkpoints

    from ..runtime import device

    cfg = PretrainConfig.from_options(c)
    cfg.validate()
    check_out(c["out"])
    started = time.monotonic()
    dataset = read_image_dataset(c["data"], c["resolution"] or native_resolution(c["model"]))
    cfg.validate(rows=dataset.source["rows"])
    checkpoints = Checkpoints(c["out"], run_identity(cfg, c["model"], dataset), c["checkpoint_every"])
    resume = checkpoints.prepare(overwrite=c["overwrite"])
    done = resume.steps_done(cfg.phases()) if resume else [0] * len(cfg.phases())
    if resume:
        log(f"resuming from {checkpoints.folder} at {resume.phase} step {resume.step}", quiet=json_)
    policy = FlowPolicy.load(c["model"], device=device())
    with progress() as bar:
        tasks = {
            name: bar.add_task(f"pretrain {name}", total=total, completed=completed, rate="")
            for (name, total), completed in zip(cfg.phases(), done)
        }

        def on_step(phase: str, step: int, loss: float) -> None:
            bar.update(tasks[phase], advance=1, rate=f"loss {loss:.4f}")

        result = run_pretrain(policy, dataset, cfg, on_step=on_step, checkpoints=checkpoints)
    summary = save_pretrained_model(policy, c["out"], data=dataset, cfg=cfg, result=result)
    checkpoints.remove()
    outcome = {
        "out": str(c["out"]),
        "steps": len(result.losses),
        "resumed_from": {"phase": resume.phase, "step": resume.step} if resume else None,
        "first_loss": result.first_loss,
        "final_loss": result.final_loss,
        "vae_fit": result.vae,
        "text_length": result.text_length,
        "shift": result.shift,
        "rows": dataset.source["rows"],
        "bytes": summary["bytes"],
        "seconds": round(time.monotonic() - started, 1),
    }
    if json_:
        emit_json(outcome)
    else:
        print_result(
            f"[green]pretrained[/] {len(result.losses)} steps on {dataset.source['rows']} images "
            f"(loss {result.first_loss:.4f} → {result.final_loss:.4f}) → {c['out']}; sample it with "
            f"--resolution {result.resolution}"
        )
