"""`pretrain`'s settings as one typed config, and the names its knobs take; torch-free.

`PretrainConfig` is the single declaration of every `omnirl pretrain` option (help, bounds, panel),
from which the CLI generates its options (`omnirl_cli.generate`), and what `stages.pretrain.flow_matching`
trains by.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stages import knobs
from stages.errors import UserInputError
from stages.knobs import IO, knob

VAE_MODES = ("model", "pixel")
TRAIN = "Training"
VAE = "Pixel VAE"
# Where the run reads and writes and how it saves progress: not how it trains, so neither in a
# checkpoint's identity nor in the model card (--data and --model enter both by content, the image
# side --resolution gives by the data's).
NOT_RECORDED = ("model", "data", "out", "resolution", "checkpoint_every", "overwrite")


@dataclass(frozen=True)
class PretrainConfig:
    """Every setting of `omnirl pretrain`. `text_length` None: the model card's `text_length`, else 128;
    `shift` None: the family scheduler's time shift at the data's resolution; `resolution` None: the
    model card's native resolution, else the first image's width."""

    model: str | None = knobs.model(
        "Diffusers pipeline to start from, e.g. one `omnirl init-model` built", IO
    )
    data: Path | None = knob(
        None,
        "Folder of PNG images and one .jsonl of captions (`prompt`, `caption` or `text`; row i ↔ "
        "the i-th PNG by name, or each row's `file_name`). Synthetic shapes: python "
        "recipes/tasks/shapes.py --out DIR/captions.jsonl --num-prompts 4096 --images DIR. An editing "
        "model (flux_kontext) learns edit pairs: each row's `image` column names its source (relative to DIR), "
        "its image file is the result, its caption the instruction (recipes/tasks/shape_edits.py --targets).",
        panel=IO,
        required=True,
    )
    out: Path | None = knob(
        None,
        "New folder for the pretrained pipeline (from_pretrained-loadable).",
        short="-o",
        panel=IO,
        required=True,
    )
    steps: int = knob(1000, "Optimizer steps.", low=1, panel=TRAIN)
    batch_size: int = knob(32, "Images per step.", low=1, panel=TRAIN)
    lr: float = knob(2e-3, "AdamW learning rate.", low=0.0, panel=TRAIN)
    weight_decay: float = knob(0.0, "AdamW weight decay.", low=0.0, panel=TRAIN)
    max_grad_norm: float = knob(1.0, "Gradient-norm clip per step.", panel=TRAIN)
    ema_decay: float = knob(
        0.998,
        "The saved weights are this EMA of the trained ones (warm-up min(d, (1+k)/(10+k))).",
        panel=TRAIN,
    )
    caption_dropout: float = knob(
        0.1, 'Share of captions replaced by "" (the unconditional branch CFG samples with).', panel=TRAIN
    )
    resolution: int | None = knob(
        None,
        "Image side the data is centre-cropped and resized to; default the model card's native "
        "resolution (an `init-model` folder), else the first image's width.",
        low=1,
        panel=TRAIN,
    )
    text_length: int | None = knob(
        None,
        "Text-encoder tokens (SD3: T5) per caption; default the model card's text_length, else 128. "
        "Sample with the same length.",
        low=1,
        panel=TRAIN,
    )
    shift: float | None = knob(
        None,
        "Time shift s of uniform t: σ = s·t/(1+(s−1)·t); default the family scheduler's (SD3: 3).",
        panel=TRAIN,
    )
    seed: int = knob(
        0,
        "Every random draw: the same seed, data, machine and thread count give the same bytes.",
        low=0,
        panel=TRAIN,
    )
    checkpoint_every: int = knob(
        500,
        "Checkpoint every K steps of each phase and at its end, atomically, into the hidden folder "
        ".OUT.checkpoint beside --out (removed once --out is saved); 0: none. The same command re-run "
        "after a kill continues from the last checkpoint to the same bytes (same machine and threads).",
        low=0,
        panel=TRAIN,
    )
    vae: str = knob(
        "model",
        "model: learn the model's own VAE latents. pixel: first fit the VAE as a pixel VAE (latent = "
        "the image average-pooled by the VAE factor, white 0, ×2.5) and learn those.",
        choices=VAE_MODES,
        panel=VAE,
    )
    vae_steps: int = knob(
        5000,
        "Pixel VAE decoder steps (5000: ~3 min on one CPU thread for the demo size); 0 keeps the "
        "pixel VAE that an earlier --vae pixel run saved in --model.",
        low=0,
        panel=VAE,
    )
    vae_encoder_steps: int = knob(500, "Pixel VAE encoder steps.", low=0, panel=VAE)
    vae_batch_size: int = knob(2, "Images per pixel VAE step.", low=1, panel=VAE)
    vae_lr: float = knob(2e-3, "Pixel VAE learning rate (cosine decay).", low=0.0, panel=VAE)
    overwrite: bool = knobs.overwrite()

    def recorded(self) -> dict[str, Any]:
        """The settings that decide the trained weights (not `NOT_RECORDED`): a checkpoint's identity
        and the model card's `pretrain.config`."""
        return {k: v for k, v in asdict(self).items() if k not in NOT_RECORDED}

    def validate(self, rows: int | None = None) -> None:
        """One-line `UserInputError` naming the option of the first bad value; with `rows` (the images
        of --data) also a batch size beyond them."""
        checks = [
            (self.steps >= 1, f"--steps {self.steps}: must be at least 1"),
            (self.batch_size >= 1, f"--batch-size {self.batch_size}: must be at least 1"),
            (self.lr > 0, f"--lr {self.lr}: must be > 0"),
            (self.weight_decay >= 0, f"--weight-decay {self.weight_decay}: must be >= 0"),
            (self.max_grad_norm > 0, f"--max-grad-norm {self.max_grad_norm}: must be > 0"),
            (0 <= self.ema_decay < 1, f"--ema-decay {self.ema_decay}: must be in [0, 1)"),
            (0 <= self.caption_dropout < 1, f"--caption-dropout {self.caption_dropout}: must be in [0, 1)"),
            (self.text_length is None or self.text_length >= 1, f"--text-length {self.text_length}: must be >= 1"),
            (self.shift is None or self.shift > 0, f"--shift {self.shift}: must be > 0"),
            (self.vae in VAE_MODES, f"--vae {self.vae}: choose one of {', '.join(VAE_MODES)}"),
            (self.vae_steps >= 0, f"--vae-steps {self.vae_steps}: must be >= 0"),
            (self.vae_encoder_steps >= 0, f"--vae-encoder-steps {self.vae_encoder_steps}: must be >= 0"),
            (self.vae_batch_size >= 1, f"--vae-batch-size {self.vae_batch_size}: must be at least 1"),
            (self.vae_lr > 0, f"--vae-lr {self.vae_lr}: must be > 0"),
            *(
                (size <= rows, f"{option} {size}: more than the {rows} images of --data; give at most {rows}")
                for option, size in (("--batch-size", self.batch_size), ("--vae-batch-size", self.vae_batch_size))
                if rows is not None
            ),
        ]  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise UserInputError(message)

    def phases(self) -> list[tuple[str, int]]:
        """(phase, steps) in the order `pretrain` runs them, for progress displays."""
        vae = [("vae decoder", self.vae_steps), ("vae encoder", self.vae_encoder_steps)]
        fitted = [(name, steps) for name, steps in vae if self.vae == "pixel" and steps]
        return [*fitted, ("transformer", self.steps)]
