"""`omnirl pretrain`: rectified-flow pretraining of a pipeline on captioned images."""

from __future__ import annotations

import time

from stages.pretrain.config import PretrainConfig

from ..console import emit_json, log, print_result, progress
from ..generate import config_command


def run(c: PretrainConfig, json_: bool) -> None:
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
    from stages.models.diffusion import FlowPolicy
    from stages.models.factory import native_resolution
    from stages.pretrain.flow_matching import check_out, run_identity, save_pretrained_model
    from stages.pretrain.flow_matching import pretrain as run_pretrain
    from stages.pretrain.images import read_image_dataset
    from stages.pretrain.resume import Checkpoints

    from ..runtime import device

    c.validate()
    check_out(c.out)
    started = time.monotonic()
    dataset = read_image_dataset(c.data, c.resolution or native_resolution(c.model))
    c.validate(rows=dataset.source["rows"])
    checkpoints = Checkpoints(c.out, run_identity(c, c.model, dataset), c.checkpoint_every)
    resume = checkpoints.prepare(overwrite=c.overwrite)
    done = resume.steps_done(c.phases()) if resume else [0] * len(c.phases())
    if resume:
        log(f"resuming from {checkpoints.folder} at {resume.phase} step {resume.step}", quiet=json_)
    policy = FlowPolicy.load(c.model, device=device())
    with progress() as bar:
        tasks = {
            name: bar.add_task(f"pretrain {name}", total=total, completed=completed, rate="")
            for (name, total), completed in zip(c.phases(), done)
        }

        def on_step(phase: str, step: int, loss: float) -> None:
            bar.update(tasks[phase], advance=1, rate=f"loss {loss:.4f}")

        result = run_pretrain(policy, dataset, c, on_step=on_step, checkpoints=checkpoints)
    summary = save_pretrained_model(policy, c.out, data=dataset, cfg=c, result=result)
    checkpoints.remove()
    outcome = {
        "out": str(c.out),
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
            f"(loss {result.first_loss:.4f} → {result.final_loss:.4f}) → {c.out}; sample it with "
            f"--resolution {result.resolution}"
        )


pretrain = config_command(PretrainConfig, "pretrain", run)
