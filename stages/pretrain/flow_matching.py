"""Rectified-flow pretraining of a pipeline's trained module on captioned images, and the pixel VAE.

Pretraining teaches a (tiny) pipeline to draw a dataset, so that RL afterwards starts from a model
whose samples a reward can tell apart. The loss is the flow-matching one every family samples with:
x_σ = (1 − σ)·x0 + σ·ε, target velocity ε − x0, mean squared error over all latent dimensions; σ is
uniform t pushed through the family's time shift, σ = s·t / (1 + (s − 1)·t) (SD3: s = 3). Captions are
dropped (replaced by "") with a probability so classifier-free guidance has an unconditional branch
to use, and the saved weights are an exponential moving average of the trained ones. An editing
model learns edit pairs (`stages.pretrain.images`): the loss is on the result, conditioned on the
instruction and the source image (a dropped caption keeps its source, so the unconditional branch is
"the source, no instruction").

The pixel VAE (`vae="pixel"`) is what made a model learn within minutes on a CPU in the prototype
(reference/demo-prototype.md): the latent is *defined* as the image average-pooled by the VAE's
factor, in [−1, 0] with white = 0, plus zero channels up to the VAE's latent channels; the
AutoencoderKL's decoder is fitted to map it back to the image and its encoder regressed onto it, and
the latents the transformer learns are those exact pooled images scaled by 2.5 (shift 0). The
fitted VAE is saved with the pipeline, so sampling and `encode_images` use it like any other.

Everything random is drawn from one CPU generator seeded with `PretrainConfig.seed`: the same seed,
data, machine and number of torch threads give the same weights, byte for byte (another thread count
or CPU changes the float rounding of the reductions, hence the bytes). Text conditioning is cached per
unique caption, so memory grows with the number of distinct captions. With `Checkpoints` a run saves
checkpoints that a killed run's re-run continues from, to the same bytes (`stages.pretrain.resume`).
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image

from stages.errors import UserInputError
from stages.finite import MODEL_HINT, check_finite
from stages.models.diffusion import FlowPolicy
from stages.models.factory import default_text_length, model_details, read_model_card, save_pipeline
from stages.models.families import Condition
from stages.models.schedules import dynamic_shift_mu
from stages.pretrain.config import PretrainConfig
from stages.pretrain.images import ImageDataset, to_signed
from stages.pretrain.resume import Checkpoints, IndexStream, OnStep, TrainingRun

PIXEL_SCALING_FACTOR = 2.5
PIXEL_SHIFT_FACTOR = 0.0
LOSS_WINDOW = 20  # first/final loss: the mean over this many steps, as one step's loss is noisy


@dataclass
class PretrainResult:
    """What a run measured: the loss of every transformer step, the pixel VAE's fit (or None), and
    the settings it resolved (time shift, text length, resolution)."""

    losses: list[float]
    shift: float
    text_length: int
    resolution: int
    vae: dict[str, float] | None = None
    first_loss: float = field(init=False)
    final_loss: float = field(init=False)

    def __post_init__(self) -> None:
        window = min(LOSS_WINDOW, len(self.losses))
        self.first_loss = sum(self.losses[:window]) / window
        self.final_loss = sum(self.losses[-window:]) / window


# ------------------------------------------------------------------------------------- pixel VAE
def pixel_latents(pixels: torch.Tensor, factor: int, channels: int) -> torch.Tensor:
    """The pixel VAE's latent z [B, channels, H/f, W/f] of images [B, 3, H, W] in [−1, 1]: the f×f
    average of (x + 1)/2 − 1 (white 0, black −1) in the first three channels, zeros in the others."""
    pooled = F.avg_pool2d((pixels.float() + 1.0) / 2.0 - 1.0, factor)
    zeros = pooled.new_zeros(pooled.shape[0], channels - 3, *pooled.shape[2:])
    return torch.cat([pooled, zeros], dim=1)


def vae_geometry(vae: Any, resolution: int) -> tuple[int, int]:
    """(downsampling factor, latent channels) of an AutoencoderKL-shaped VAE, checked for a pixel VAE."""
    config = getattr(vae, "config", None)
    if not all(hasattr(vae, part) for part in ("encoder", "decoder")) or "block_out_channels" not in (
        config or {}
    ):
        raise UserInputError(
            f"--vae pixel: needs an AutoencoderKL-shaped VAE, this model has {type(vae).__name__}"
        )
    factor = 2 ** (len(config.block_out_channels) - 1)
    channels = int(config.latent_channels)
    if channels < 3:
        raise UserInputError(
            f"--vae pixel: the VAE has {channels} latent channels; it needs at least 3 (RGB)"
        )
    if resolution % factor:
        raise UserInputError(
            f"--vae pixel: the image side {resolution} is not a multiple of the VAE factor {factor}"
        )
    return factor, channels


def _fit(
    run: TrainingRun,
    params: list[torch.nn.Parameter],
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    *,
    steps: int,
    batches: IndexStream,
    lr: float,
    phase: str,
) -> float | None:
    """AdamW with cosine decay from `lr` on `params` for `steps` batches of `loss_of(indices)`, as phase
    `phase` of `run`; the mean loss of the last steps (None for no steps)."""
    if steps == 0:
        return None
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)

    def take_step(step: int, indices: torch.Tensor) -> float:
        loss = loss_of(indices)
        check_finite(
            {"loss": loss.detach().reshape(1)}, None, hint=MODEL_HINT, where=f"pretrain {phase} step {step}"
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for group in optimizer.param_groups:
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * (step - 1) / steps))
        optimizer.step()
        return float(loss.detach())

    losses = run.phase(phase, steps, optimizer, batches, take_step)
    for p in params:
        p.requires_grad_(False)
    window = min(LOSS_WINDOW, len(losses))
    return sum(losses[-window:]) / window


def fit_pixel_vae(vae: Any, pixels: torch.Tensor, cfg: PretrainConfig, run: TrainingRun) -> dict[str, float]:
    """Make `vae` a pixel VAE for uint8 images [N, 3, S, S]: fit its decoder so decode(z) ≈ x for
    z = `pixel_latents`(x) (`cfg.vae_steps`), then its encoder's posterior mean onto z
    (`cfg.vae_encoder_steps`), MSE each, as the phases "vae decoder" and "vae encoder" of `run`, and set
    its scaling factor 2.5 and shift 0. Returns the mean squared errors of the last steps of both (None
    for a phase of 0 steps) and the steps."""
    factor, channels = vae_geometry(vae, pixels.shape[-1])
    device = next(vae.parameters()).device
    vae.train()

    def batch(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = to_signed(pixels[indices]).to(device)
        return x, pixel_latents(x, factor, channels)

    def decoder_loss(indices: torch.Tensor) -> torch.Tensor:
        x, z = batch(indices)
        return F.mse_loss(vae.decode(z.to(vae.dtype)).sample.float(), x)

    def encoder_loss(indices: torch.Tensor) -> torch.Tensor:
        x, z = batch(indices)
        return F.mse_loss(vae.encode(x.to(vae.dtype)).latent_dist.mean.float(), z)

    def parts(*names: str) -> list[torch.nn.Parameter]:
        modules = [getattr(vae, name, None) for name in names]
        return [p for m in modules if m is not None for p in m.parameters()]

    batches = IndexStream(pixels.shape[0], cfg.vae_batch_size, run.generator)
    decoder = _fit(
        run, parts("post_quant_conv", "decoder"), decoder_loss, steps=cfg.vae_steps, batches=batches,
        lr=cfg.vae_lr, phase="vae decoder",
    )  # fmt: skip
    encoder = _fit(
        run, parts("encoder", "quant_conv"), encoder_loss, steps=cfg.vae_encoder_steps, batches=batches,
        lr=cfg.vae_lr, phase="vae encoder",
    )  # fmt: skip
    vae.eval()
    vae.register_to_config(scaling_factor=PIXEL_SCALING_FACTOR, shift_factor=PIXEL_SHIFT_FACTOR)
    return {
        "decoder_mse": decoder,
        "encoder_mse": encoder,
        "decoder_steps": cfg.vae_steps,
        "encoder_steps": cfg.vae_encoder_steps,
    }


# ------------------------------------------------------------------------------------ flow matching
def shift_sigmas(t: torch.Tensor, shift: float) -> torch.Tensor:
    """σ = s·t / (1 + (s − 1)·t): the flow-matching time shift of uniform t ∈ [0, 1] (s = 1: σ = t)."""
    return shift * t / (1 + (shift - 1) * t)


def family_shift(policy: FlowPolicy, resolution: int) -> float:
    """The time shift the family's scheduler samples `resolution`² images with: its fixed `shift`
    (SD3: 3), or exp(μ) of the resolution-dependent μ for dynamic shifting (FLUX.1, Qwen-Image,
    Z-Image; 2×2-patch token count)."""
    config = policy.pipe.scheduler.config
    if config.get("use_dynamic_shifting", False):
        h, w = policy.latent_shape(resolution)[-2:]
        return math.exp(dynamic_shift_mu((h // 2) * (w // 2), config))
    return float(config.get("shift", 1.0))


def flow_matching_loss(
    policy: FlowPolicy,
    x0: torch.Tensor,
    noise: torch.Tensor,
    sigma: torch.Tensor,
    cond: Condition,
    guidance: float,
) -> torch.Tensor:
    """Rectified-flow loss: mean over all elements of (v(x_σ, σ) − (ε − x0))², x_σ = (1 − σ)·x0 + σ·ε.

    x0, noise [B, *latent_shape]; sigma [B]; `guidance` as the family trains (no CFG branch)."""
    s = sigma.reshape(-1, *([1] * (x0.dim() - 1))).to(x0)
    x_sigma = (1 - s) * x0 + s * noise
    velocity = policy.velocity(x_sigma, sigma, cond, guidance)
    return (velocity - (noise - x0)).pow(2).mean()


@torch.no_grad()
def dataset_latents(
    policy: FlowPolicy, data: ImageDataset, pixel: bool, batch_size: int = 32
) -> torch.Tensor:
    """Latents [N, *latent_shape] (float32, CPU) the transformer learns: the exact pixel latents ×
    scaling factor for a pixel VAE, else the model's own VAE encoding (`FlowPolicy.encode_images`)."""
    vae = policy.pipe.vae
    if pixel:
        factor, channels = vae_geometry(vae, data.resolution)
        z = pixel_latents(to_signed(data.pixels), factor, channels)
        return (z - vae.config.shift_factor) * vae.config.scaling_factor
    out = []
    for start in range(0, data.pixels.shape[0], batch_size):
        chunk = data.pixels[start : start + batch_size]
        images = [Image.fromarray(p.permute(1, 2, 0).numpy()) for p in chunk]
        out.append(policy.encode_images(images, data.resolution).cpu())
    return torch.cat(out)


class _Captions:
    """Conditioning of training batches through the policy's per-prompt cache (`FlowPolicy.encode`): the
    captions, and for edit pairs (`ImageDataset.conditioned`) each row's source images too.

    A text encoder run on a batch does not give a caption the same float bits in batches of other
    sizes, so every batch that encoded new conditioning is logged (`state`: its captions, for edit pairs
    [caption, row] pairs): a resumed run encodes the same batches again (`restore`) and conditions on
    the very same bytes as an uninterrupted one."""

    def __init__(self, policy: FlowPolicy, text_length: int, data: ImageDataset) -> None:
        self.policy, self.text_length = policy, text_length
        self.conditions = data.conditions if data.conditioned else None
        self.seen: set[Any] = set()
        self.log: list[list[Any]] = []

    def __call__(self, prompts: list[str], rows: list[int]) -> Condition:
        images = None if self.conditions is None else [self.conditions[i] for i in rows]
        keys = prompts if images is None else list(zip(prompts, rows))
        if not self.seen.issuperset(keys):
            self.seen.update(keys)
            self.log.append(prompts if images is None else [list(key) for key in keys])
        return self.policy.encode(prompts, None, False, self.text_length, images=images)

    def state(self) -> list[list[Any]]:
        return self.log

    def restore(self, state: list[list[Any]]) -> None:
        for entry in state:
            if self.conditions is None:
                self(entry, [])
            else:
                self([prompt for prompt, _ in entry], [row for _, row in entry])


def run_identity(cfg: PretrainConfig, model: str | Path, data: ImageDataset) -> dict[str, dict[str, Any]]:
    """What a checkpoint must match to be resumed (`Checkpoints`): the config by option name, the
    content digests of --model and --data and the side its images were resized to."""
    from stages.models.folders import check_pipeline_folder
    from stages.shards.digest import content_digest

    model = check_pipeline_folder(model)  # before hashing: any folder could be walked otherwise
    return {
        "settings": cfg.recorded(),
        "inputs": {
            "model": content_digest(model, "--model"),
            "data": data.source["sha256"],
            "resolution": data.resolution,
        },
    }


def pretrain(
    policy: FlowPolicy,
    data: ImageDataset,
    cfg: PretrainConfig,
    *,
    on_step: OnStep | None = None,
    checkpoints: Checkpoints | None = None,
) -> PretrainResult:
    """Pretrain `policy`'s trained module (all of its weights) on `data` with the rectified-flow loss;
    with `cfg.vae == "pixel"` first make the VAE a pixel VAE. On return the policy holds the EMA
    weights (decay min(ema_decay, (1 + k)/(10 + k)) at update k, so early updates are not swamped by
    the random initial weights) and the VAE its fitted ones; `on_step(phase, step, loss)` follows it.
    `checkpoints` saves checkpoints and, once prepared (`Checkpoints.prepare`), continues the run its
    checkpoint stopped (an fp32 policy, as `FlowPolicy.load` gives, restores exactly).
    """
    cfg.validate(rows=len(data.captions))
    resolution = data.resolution
    policy.latent_shape(resolution)  # a side the family cannot take fails here, naming --resolution
    text_length = cfg.text_length or default_text_length(policy.model_path)
    shift = cfg.shift or family_shift(policy, resolution)
    modules = {"transformer": policy.module, **({"vae": policy.pipe.vae} if cfg.vae == "pixel" else {})}
    run = TrainingRun(
        torch.Generator("cpu").manual_seed(cfg.seed),
        on_step,
        phases=[name for name, _ in cfg.phases()],
        modules=modules,
        checkpoints=checkpoints,
    )
    vae_fit = None
    if cfg.vae == "pixel":
        if not cfg.vae_steps and "pixel_vae" not in model_details(policy.model_path):
            raise UserInputError(
                f"--vae-steps 0 keeps a fitted pixel VAE, but --model {policy.model_path} has none (no "
                "pixel_vae in its omnirl_model.json); give --vae-steps N to fit one"
            )
        vae_fit = fit_pixel_vae(policy.pipe.vae, data.pixels, cfg, run)
    latents = dataset_latents(policy, data, cfg.vae == "pixel")
    check_finite({"latents": latents}, None, hint=MODEL_HINT, where="pretrain: the VAE encoding of --data")

    guidance = policy.family.default_guidance
    params = policy.trainable_parameters(full=True)
    ema = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    captions = _Captions(policy, text_length, data)
    policy.module.train()

    def take_step(step: int, indices: torch.Tensor) -> float:
        x0 = latents[indices]
        dropped = torch.rand(len(indices), generator=run.generator) < cfg.caption_dropout
        prompts = ["" if drop else data.captions[i] for i, drop in zip(indices.tolist(), dropped.tolist())]
        sigma = shift_sigmas(torch.rand(len(indices), generator=run.generator), shift)
        noise = torch.randn(x0.shape, generator=run.generator)
        device = policy.device
        loss = flow_matching_loss(
            policy,
            x0.to(device),
            noise.to(device),
            sigma.to(device),
            captions(prompts, indices.tolist()),
            guidance,
        )
        check_finite({"loss": loss.detach().reshape(1)}, None, hint=MODEL_HINT, where=f"pretrain step {step}")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        optimizer.step()
        k = step - 1  # earlier updates
        decay = min(cfg.ema_decay, (1 + k) / (10 + k))
        with torch.no_grad():
            for average, p in zip(ema, params):
                average.lerp_(p, 1 - decay)
        return float(loss.detach())

    batches = IndexStream(latents.shape[0], cfg.batch_size, run.generator)
    losses = run.phase("transformer", cfg.steps, optimizer, batches, take_step, ema=ema, journal=captions)
    with torch.no_grad():
        for p, average in zip(params, ema):
            p.copy_(average)
            p.requires_grad_(False)
    policy.module.eval()
    return PretrainResult(losses, shift, text_length, resolution, vae_fit)


# ------------------------------------------------------------------------------------------- saving
def check_out(out: str | Path) -> Path:
    """`out` as a Path, refused unless it is new or an empty folder (checked before training starts)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserInputError(f"--out {out} already exists and is not an empty directory; choose a new --out")
    return out


def save_pretrained_model(
    policy: FlowPolicy,
    out: str | Path,
    *,
    data: ImageDataset,
    cfg: PretrainConfig,
    result: PretrainResult,
) -> dict[str, Any]:
    """Save the policy's pipeline (with its pretrained weights) as a `from_pretrained` folder at `out`.

    Its `omnirl_model.json` keeps the base model's details and records `text_length` (what to encode
    prompts with), `pixel_vae` (the fit, when the VAE is a pixel VAE) and `pretrain`: the base model,
    the data (path, rows, sha256), the config, the time shift and the losses, with the base model's
    own `pretrain` record as `previous`. Written into a hidden sibling folder and renamed into place,
    so `out` never holds half a model. Returns the model card summary (see `finish_model_dir`).
    """
    out = check_out(out)
    base = read_model_card(policy.model_path) or {}
    details = dict(base.get("details", {}))
    previous = details.pop("pretrain", None)
    if result.vae is not None and result.vae["decoder_mse"] is not None:
        details["pixel_vae"] = result.vae
    details.update(
        image_size=result.resolution,
        latent_shape=list(policy.latent_shape(result.resolution)),
        text_length=result.text_length,
        pretrain={
            "base_model": policy.model_path,
            "base_size": base.get("size"),
            "base_seed": base.get("seed"),
            "data": data.source,
            "config": cfg.recorded(),
            "shift": result.shift,
            "steps": len(result.losses),
            "first_loss": result.first_loss,
            "final_loss": result.final_loss,
            "vae_fit": result.vae,
            "previous": previous,
        },
    )
    staging = out.parent / f".{out.name}.partial"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    summary = save_pipeline(
        policy.pipe,
        staging,
        family=policy.family.name,
        size=str(base.get("size", "custom")),
        seed=int(base.get("seed", cfg.seed)),
        details=details,
    )
    if out.exists():
        out.rmdir()
    os.replace(staging, out)
    return {**summary, "out_dir": str(out)}
