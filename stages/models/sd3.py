"""Random-weight Stable Diffusion 3.5-style pipelines, shaped like SD3.5-Medium but tiny.

What is kept from the real model, because sampling and training code depends on it: the MMDiT
with QK RMS-norm and dual attention in its first block(s), 16 latent channels with SD3's VAE
scaling/shift factors, two CLIP encoders with projections (pooled = both projections
concatenated), a T5 encoder whose width is the transformer's `joint_attention_dim` and at least
the two CLIP widths together (the pipeline zero-pads the CLIP states to it), and the flow-matching
Euler scheduler with shift 3 over 1000 training steps. What shrinks: widths, depths, vocabularies
(see `stages.models.tokenizers`) and the VAE's number of down blocks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

from stages.models.factory import choose_size, finish_model_dir, no_progress_bars, parameter_count, seeded
from stages.models.tokenizers import build_clip_tokenizer, build_t5_tokenizer

FAMILY = "sd3"

# SD3/SD3.5 VAE latent normalisation: latents = (z - shift_factor) * scaling_factor.
VAE_SCALING_FACTOR = 1.5305
VAE_SHIFT_FACTOR = 0.0609
SCHEDULER_SHIFT = 3.0
NUM_TRAIN_TIMESTEPS = 1000
CLIP_MAX_LENGTH = 77


@dataclass(frozen=True)
class SD3Size:
    """Widths and depths of one size; `image_size` = transformer sample_size x VAE downsampling."""

    clip_widths: tuple[int, int]
    clip_layers: int
    clip_heads: int
    t5_width: int
    t5_layers: int
    t5_heads: int
    t5_ff: int
    heads: int
    head_dim: int
    layers: int
    dual_attention_layers: tuple[int, ...]
    sample_size: int
    pos_embed_max_size: int
    vae_channels: tuple[int, ...]
    vae_layers_per_block: int
    vae_groups: int

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae_channels) - 1)

    @property
    def image_size(self) -> int:
        return self.sample_size * self.vae_scale_factor


SIZES: dict[str, SD3Size] = {
    # 64 px default: 4x VAE -> 16x16x16 latents -> 64 image tokens of width 64.
    "tiny": SD3Size(
        clip_widths=(32, 48),
        clip_layers=2,
        clip_heads=4,
        t5_width=96,
        t5_layers=2,
        t5_heads=4,
        t5_ff=128,
        heads=4,
        head_dim=16,
        layers=2,
        dual_attention_layers=(0,),
        sample_size=16,
        pos_embed_max_size=32,
        vae_channels=(8, 16, 16),
        vae_layers_per_block=1,
        vae_groups=8,
    ),
    # 128 px default: 4x VAE -> 32x32x16 latents -> 256 image tokens of width 384; compute-bound on CPU.
    "small": SD3Size(
        clip_widths=(128, 192),
        clip_layers=4,
        clip_heads=4,
        t5_width=320,
        t5_layers=4,
        t5_heads=5,
        t5_ff=640,
        heads=6,
        head_dim=64,
        layers=8,
        dual_attention_layers=(0, 1, 2),
        sample_size=32,
        pos_embed_max_size=64,
        vae_channels=(32, 64, 64),
        vae_layers_per_block=1,
        vae_groups=16,
    ),
}


def _clip(
    width: int, spec: SD3Size, vocab_size: int, special_ids: dict[str, int]
) -> CLIPTextModelWithProjection:
    """CLIP text tower whose projection has the tower's width (as in CLIP-L and CLIP-G)."""
    config = CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=width,
        intermediate_size=4 * width,
        projection_dim=width,
        num_hidden_layers=spec.clip_layers,
        num_attention_heads=spec.clip_heads,
        max_position_embeddings=CLIP_MAX_LENGTH,
        hidden_act="gelu",
        **special_ids,
    )
    return CLIPTextModelWithProjection(config)


def zero_residual_branches(decoder: torch.nn.Module) -> None:
    """Zero-initialise the last layer of every residual branch of an untrained VAE decoder.

    Each resnet then starts as the identity, so the decoded image follows the latent's structure
    instead of the texture of random convolutions: an image reward (e.g. JPEG compressibility)
    responds to what the policy generates, which lets the demo and end-to-end tests learn.
    """
    with torch.no_grad():
        for name, module in decoder.named_modules():
            if name.endswith(("conv2", "to_out.0")):
                module.weight.zero_()
                if module.bias is not None:
                    module.bias.zero_()


def build_sd3(out_dir: str | Path, *, size: str, seed: int) -> dict[str, Any]:
    """Build and save a `StableDiffusion3Pipeline` folder of `size` ("tiny" or "small") into `out_dir`.

    Returns the factory summary (see `stages.models.factory.init_model`).
    """
    spec: SD3Size = choose_size(FAMILY, size, SIZES)
    out = Path(out_dir)
    tokenizer = build_clip_tokenizer(CLIP_MAX_LENGTH)
    tokenizer_3 = build_t5_tokenizer()
    clip_ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    with seeded(seed, "text_encoder"):
        text_encoder = _clip(spec.clip_widths[0], spec, len(tokenizer), clip_ids)
    with seeded(seed, "text_encoder_2"):
        text_encoder_2 = _clip(spec.clip_widths[1], spec, len(tokenizer), clip_ids)
    with seeded(seed, "text_encoder_3"):
        text_encoder_3 = T5EncoderModel(
            T5Config(
                vocab_size=len(tokenizer_3),
                d_model=spec.t5_width,
                d_kv=spec.t5_width // spec.t5_heads,
                d_ff=spec.t5_ff,
                num_layers=spec.t5_layers,
                num_heads=spec.t5_heads,
                feed_forward_proj="gated-gelu",
                pad_token_id=tokenizer_3.pad_token_id,
                eos_token_id=tokenizer_3.eos_token_id,
                decoder_start_token_id=tokenizer_3.pad_token_id,
            )
        )
    with seeded(seed, "transformer"):
        transformer = SD3Transformer2DModel(
            sample_size=spec.sample_size,
            patch_size=2,
            in_channels=16,
            out_channels=16,
            num_layers=spec.layers,
            attention_head_dim=spec.head_dim,
            num_attention_heads=spec.heads,
            joint_attention_dim=spec.t5_width,
            caption_projection_dim=spec.heads * spec.head_dim,
            pooled_projection_dim=sum(spec.clip_widths),
            pos_embed_max_size=spec.pos_embed_max_size,
            dual_attention_layers=spec.dual_attention_layers,
            qk_norm="rms_norm",
        )
    with seeded(seed, "vae"):
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * len(spec.vae_channels),
            up_block_types=("UpDecoderBlock2D",) * len(spec.vae_channels),
            block_out_channels=spec.vae_channels,
            layers_per_block=spec.vae_layers_per_block,
            latent_channels=16,
            norm_num_groups=spec.vae_groups,
            sample_size=spec.image_size,
            scaling_factor=VAE_SCALING_FACTOR,
            shift_factor=VAE_SHIFT_FACTOR,
            use_quant_conv=False,
            use_post_quant_conv=False,
        )
        zero_residual_branches(vae.decoder)
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=NUM_TRAIN_TIMESTEPS, shift=SCHEDULER_SHIFT
    )
    pipeline = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=build_clip_tokenizer(CLIP_MAX_LENGTH),
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )
    with no_progress_bars():
        pipeline.save_pretrained(out, safe_serialization=True)
    components = {
        "transformer": transformer,
        "vae": vae,
        "text_encoder": text_encoder,
        "text_encoder_2": text_encoder_2,
        "text_encoder_3": text_encoder_3,
    }
    return finish_model_dir(
        out,
        family=FAMILY,
        size=size,
        seed=seed,
        pipeline_class=type(pipeline).__name__,
        parameters={name: parameter_count(module) for name, module in components.items()},
        details={
            "image_size": spec.image_size,
            "vae_scale_factor": spec.vae_scale_factor,
            "latent_shape": [16, spec.sample_size, spec.sample_size],
            "architecture": asdict(spec),
        },
    )
