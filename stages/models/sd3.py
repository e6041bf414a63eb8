"""Random-weight Stable Diffusion 3.5-style pipelines, shaped like SD3.5-Medium but tiny.

What is kept from the real model, because sampling and training code depends on it: the MMDiT
with QK RMS-norm and dual attention in its first block(s), 16 latent channels with SD3's VAE
scaling/shift factors, two CLIP encoders with projections (pooled = both projections
concatenated), a T5 encoder whose width is the transformer's `joint_attention_dim` and at least
the two CLIP widths together (the pipeline zero-pads the CLIP states to it), and the flow-matching
Euler scheduler with shift 3 over 1000 training steps. What shrinks: widths, depths, vocabularies
(see `stages.models.tokenizers`) and the VAE's number of down blocks. The `demo` size departs from
SD3 on purpose where a model pretrained in minutes on a CPU needs it (4 latent channels, short text).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from transformers import CLIPTextConfig, CLIPTextModelWithProjection

from stages.errors import UserInputError
from stages.models.factory import autoencoder_kl, choose_size, save_pipeline, seeded, t5_encoder
from stages.models.families import (
    Condition,
    FamilyAdapter,
    Resolution,
    Tensors,
    format_resolution,
    latent_grid,
)
from stages.models.schedules import flow_match_sigmas
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
    # Defaults are SD3's own: 16 latent channels, its VAE normalisation, CLIP's 77 tokens and the 128 T5
    # tokens the samplers use; `text_length` is the T5 length a size is meant to be conditioned with.
    latent_channels: int = 16
    vae_scaling_factor: float = VAE_SCALING_FACTOR
    vae_shift_factor: float = VAE_SHIFT_FACTOR
    clip_length: int = CLIP_MAX_LENGTH
    text_length: int = 128
    # Published sizes: the second CLIP (CLIP-G) has its own depth and heads, and the encoders their
    # real vocabularies (None: the local tokenizer's length).
    clip_2_layers: int | None = None
    clip_2_heads: int | None = None
    clip_vocab: int | None = None
    t5_vocab: int | None = None

    def clip_depth(self, index: int) -> tuple[int, int]:
        """(layers, heads) of CLIP encoder `index` (0: CLIP-L, 1: CLIP-G)."""
        if index == 1:
            return (self.clip_2_layers or self.clip_layers, self.clip_2_heads or self.clip_heads)
        return (self.clip_layers, self.clip_heads)

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae_channels) - 1)

    @property
    def image_size(self) -> int:
        return self.sample_size * self.vae_scale_factor


# 64 px default: 4x VAE -> 16x16x16 latents -> 64 image tokens of width 64.
TINY = SD3Size(
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
)

SIZES: dict[str, SD3Size] = {
    "tiny": TINY,
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
    # 64 px, made for `omnirl pretrain --vae pixel` (demo-prototype.md): tiny's widths with 4 latent
    # channels (the 4x-pooled RGB image + one zero channel, scaled by 2.5), a positional table that
    # is exactly the 8x8 patch grid, and short text (24 CLIP + 32 T5 tokens hold every shapes caption)
    # instead of 77 + 128 tokens that would be ~3/4 padding.
    "demo": replace(
        TINY,
        pos_embed_max_size=8,
        latent_channels=4,
        vae_scaling_factor=2.5,
        vae_shift_factor=0.0,
        clip_length=24,
        text_length=32,
    ),
}
# The published SD3.5 sizes (stabilityai/stable-diffusion-3.5-{medium,large} configs): CLIP-L (768, 12
# layers) and CLIP-G (1280, 32 layers), T5-XXL's encoder, the 8x VAE with 2 resnets per block; `full` is
# Large (MMDiT 8.06 B), `medium` the MMDiT-X with dual attention in its first 13 blocks (2.24 B).
PUBLISHED_TEXT = dict(
    clip_widths=(768, 1280),
    clip_layers=12,
    clip_heads=12,
    clip_2_layers=32,
    clip_2_heads=20,
    clip_vocab=49408,
    t5_width=4096,
    t5_layers=24,
    t5_heads=64,
    t5_ff=10240,
    t5_vocab=32128,
    sample_size=128,
    vae_channels=(128, 256, 512, 512),
    vae_layers_per_block=2,
    vae_groups=32,
    text_length=256,
)
SIZES["full"] = SD3Size(
    **PUBLISHED_TEXT, heads=38, head_dim=64, layers=38, dual_attention_layers=(), pos_embed_max_size=192
)
SIZES["medium"] = SD3Size(
    **PUBLISHED_TEXT,
    heads=24,
    head_dim=64,
    layers=24,
    dual_attention_layers=tuple(range(13)),
    pos_embed_max_size=384,
)


def _clip(
    index: int, spec: SD3Size, vocab_size: int, special_ids: dict[str, int]
) -> CLIPTextModelWithProjection:
    """CLIP text tower `index` (0: CLIP-L, 1: CLIP-G) whose projection has the tower's width (as in both)."""
    width = spec.clip_widths[index]
    layers, heads = spec.clip_depth(index)
    config = CLIPTextConfig(
        vocab_size=spec.clip_vocab or vocab_size,
        hidden_size=width,
        intermediate_size=4 * width,
        projection_dim=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=spec.clip_length,
        hidden_act="gelu",
        **special_ids,
    )
    return CLIPTextModelWithProjection(config)


def make_sd3(size: str, seed: int) -> StableDiffusion3Pipeline:
    """The `StableDiffusion3Pipeline` of `size` with seeded random weights, built on the current default
    device (`torch.device("meta")` builds the architecture alone, with no memory)."""
    spec: SD3Size = choose_size(FAMILY, size, SIZES)
    tokenizer = build_clip_tokenizer(spec.clip_length)
    tokenizer_3 = build_t5_tokenizer()
    clip_ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    with seeded(seed, "text_encoder"):
        text_encoder = _clip(0, spec, len(tokenizer), clip_ids)
    with seeded(seed, "text_encoder_2"):
        text_encoder_2 = _clip(1, spec, len(tokenizer), clip_ids)
    text_encoder_3 = t5_encoder(
        seed, "text_encoder_3", tokenizer_3, width=spec.t5_width, heads=spec.t5_heads, ff=spec.t5_ff,
        layers=spec.t5_layers, vocab=spec.t5_vocab,
    )  # fmt: skip
    with seeded(seed, "transformer"):
        transformer = SD3Transformer2DModel(
            sample_size=spec.sample_size,
            patch_size=2,
            in_channels=spec.latent_channels,
            out_channels=spec.latent_channels,
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
    vae = autoencoder_kl(
        seed,
        channels=spec.vae_channels,
        groups=spec.vae_groups,
        layers_per_block=spec.vae_layers_per_block,
        latent_channels=spec.latent_channels,
        scaling_factor=spec.vae_scaling_factor,
        shift_factor=spec.vae_shift_factor,
        sample_size=spec.image_size,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=NUM_TRAIN_TIMESTEPS, shift=SCHEDULER_SHIFT
    )
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=build_clip_tokenizer(spec.clip_length),
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )


def build_sd3(out_dir: str | Path, *, size: str, seed: int) -> dict[str, Any]:
    """Build and save a `StableDiffusion3Pipeline` folder of `size` (`SIZES`: "tiny", "small", "demo", or
    the published "medium" and "full" = SD3.5 Large) into `out_dir`.

    Returns the factory summary (see `stages.models.factory.init_model`).
    """
    spec: SD3Size = choose_size(FAMILY, size, SIZES)
    return save_pipeline(
        make_sd3(size, seed),
        Path(out_dir),
        family=FAMILY,
        size=size,
        seed=seed,
        details={
            "image_size": spec.image_size,
            "vae_scale_factor": spec.vae_scale_factor,
            "latent_shape": [spec.latent_channels, spec.sample_size, spec.sample_size],
            "text_length": spec.text_length,
            "architecture": asdict(spec),
        },
    )


# flow_grpo's LoRA targets for SD3 (diffusion-rl.md §1.5).
SD3_LORA_TARGETS = (
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "attn.to_k",
    "attn.to_out.0",
    "attn.to_q",
    "attn.to_v",
)


class SD3Adapter(FamilyAdapter):
    """Stable Diffusion 3 / 3.5: MMDiT on unpacked latents [C, h, w], timestep σ·1000, true CFG with
    the unconditional and conditional branches in one batch of 2B (as the diffusers pipeline runs it),
    two CLIP encoders plus T5 (embeds [L, D], pooled [P])."""

    name = FAMILY
    lora_targets = SD3_LORA_TARGETS

    def sigmas(self, num_steps: int, resolution: Resolution) -> torch.Tensor:
        """The scheduler's fixed-shift schedule (shift 3 for SD3.5)."""
        return flow_match_sigmas(self.pipe.scheduler, num_steps)

    def latent_shape(self, resolution: Resolution, frames: int = 1) -> tuple[int, ...]:
        """(C, h, w) of an image of `resolution`; each side must be a positive multiple of the VAE factor
        × the transformer's patch size, as the diffusers SD3 pipeline requires, and fit its positional
        table."""
        factor = self.pipe.vae_scale_factor
        config = self.pipe.transformer.config
        multiple = factor * config.patch_size
        h, w = latent_grid(resolution, factor, multiple)
        largest = (config.pos_embed_max_size or 0) * multiple
        if largest and max(h, w) * factor > largest:
            raise UserInputError(
                f"--resolution {format_resolution(resolution)}: this model's positional table covers at most "
                f"{largest} px a side"
            )
        return (config.in_channels, h, w)

    def encode_prompts(
        self, prompts: list[str], negatives: list[str], device: torch.device, max_sequence_length: int
    ) -> list[tuple[Tensors, Tensors]]:
        emb, neg_emb, pooled, neg_pooled = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=prompts,
            prompt_3=prompts,
            negative_prompt=negatives,
            negative_prompt_2=negatives,
            negative_prompt_3=negatives,
            do_classifier_free_guidance=True,
            device=device,
            max_sequence_length=max_sequence_length,
        )
        return [
            ({"embeds": emb[i], "pooled": pooled[i]}, {"embeds": neg_emb[i], "pooled": neg_pooled[i]})
            for i in range(len(prompts))
        ]

    def velocity(
        self,
        transformer: torch.nn.Module,
        x: torch.Tensor,
        sigma: torch.Tensor,
        cond: Condition,
        guidance: float,
    ) -> torch.Tensor:
        timestep = sigma * 1000
        model_in = x.to(transformer.dtype)
        if self.needs_negative(guidance):
            assert cond.neg is not None
            out = transformer(
                hidden_states=torch.cat([model_in, model_in]),
                timestep=torch.cat([timestep, timestep]),
                encoder_hidden_states=torch.cat([cond.neg["embeds"], cond.pos["embeds"]]),
                pooled_projections=torch.cat([cond.neg["pooled"], cond.pos["pooled"]]),
                return_dict=False,
            )[0]
            uncond, text = out.float().chunk(2)
            uncond = self.unconditional(uncond)
            return uncond + guidance * (text - uncond)
        out = transformer(
            hidden_states=model_in,
            timestep=timestep,
            encoder_hidden_states=cond.pos["embeds"],
            pooled_projections=cond.pos["pooled"],
            return_dict=False,
        )[0]
        return out.float()
