"""Z-Image (`ZImagePipeline`): the family adapter, and random-weight pipelines shaped like Z-Image but tiny.

What is kept from the real model, because sampling and training code depends on it: the single-stream
S3-DiT taking *lists* of latents [C, 1, h, w] and of variable-length caption features [L_i, D], with
noise and context refiner blocks, 2×2 patches padded inside the model to multiples of 32 tokens with
learned pad embeddings, 3-axis RoPE (caption index, row, column) and a reversed timestep t = 1 − σ; a
Qwen3 text encoder read at `hidden_states[-2]` behind the Qwen3 chat template (`enable_thinking=True`,
only the masked-in tokens kept); the FLUX.1 autoencoder form (16 latent channels, (z − 0.1159)·0.3611);
and Z-Image-Turbo's published scheduler (flow-matching Euler, shift 3, no dynamic shifting). What
shrinks: widths, depths, the vocabulary (`stages.models.tokenizers.build_qwen2_tokenizer`) and the VAE's
number of down blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
from torch.nn.utils.rnn import pad_sequence
from transformers import Qwen3Config, Qwen3Model

from stages.errors import UserInputError
from stages.models.factory import autoencoder_kl, choose_size, save_pipeline, seeded
from stages.models.families import Condition, FamilyAdapter, Resolution, Tensors, latent_grid
from stages.models.schedules import dynamic_shift_mu
from stages.models.tokenizers import QWEN3_CHAT_TEMPLATE, build_qwen2_tokenizer

FAMILY = "z_image"

# FLUX.1 VAE latent normalisation (Z-Image reuses that autoencoder): latents = (z − shift)·scale.
VAE_SCALING_FACTOR = 0.3611
VAE_SHIFT_FACTOR = 0.1159
SCHEDULER_SHIFT = 3.0
NUM_TRAIN_TIMESTEPS = 1000
LATENT_CHANNELS = 16
ROPE_AXES_LENS = (1024, 512, 512)
TEXT_ROPE_THETA = 1_000_000.0


@dataclass(frozen=True)
class ZImageSize:
    """Widths and depths of one size; the DiT head width `dim // heads` equals sum(axes_dims)."""

    text_hidden: int
    text_intermediate: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    dim: int
    heads: int
    layers: int
    refiner_layers: int
    axes_dims: tuple[int, int, int]
    vae_channels: tuple[int, ...]
    vae_groups: int
    # Published size: Qwen3's head width (None: text_hidden // text_heads), its real vocabulary (None:
    # the local tokenizer's length) and two resnets per VAE block.
    text_head_dim: int | None = None
    text_vocab: int | None = None
    vae_layers_per_block: int = 1

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae_channels) - 1)


SIZES: dict[str, ZImageSize] = {
    # 32 px: 4x VAE -> 16x8x8 latents -> 16 image tokens (padded to 32 inside the DiT) of width 64.
    "tiny": ZImageSize(
        text_hidden=32,
        text_intermediate=64,
        text_layers=2,
        text_heads=4,
        text_kv_heads=2,
        dim=64,
        heads=2,
        layers=2,
        refiner_layers=1,
        axes_dims=(8, 12, 12),
        vae_channels=(8, 16, 16),
        vae_groups=8,
    ),
    # 128 px: 4x VAE -> 16x32x32 latents -> 256 image tokens of width 256; compute-bound on CPU.
    "small": ZImageSize(
        text_hidden=128,
        text_intermediate=256,
        text_layers=4,
        text_heads=4,
        text_kv_heads=2,
        dim=256,
        heads=4,
        layers=6,
        refiner_layers=2,
        axes_dims=(16, 24, 24),
        vae_channels=(32, 64, 64),
        vae_groups=16,
    ),
    # Tongyi-MAI/Z-Image-Turbo as published: the 30-block S3-DiT of width 3840 (6.15 B) on Qwen3-4B
    # (4.02 B), FLUX.1's 8x VAE.
    "full": ZImageSize(
        text_hidden=2560,
        text_intermediate=9728,
        text_layers=36,
        text_heads=32,
        text_kv_heads=8,
        dim=3840,
        heads=30,
        layers=30,
        refiner_layers=2,
        axes_dims=(32, 48, 48),
        vae_channels=(128, 256, 512, 512),
        vae_groups=32,
        text_head_dim=128,
        text_vocab=151936,
        vae_layers_per_block=2,
    ),
}


def make_z_image(size: str, seed: int) -> ZImagePipeline:
    """The `ZImagePipeline` of `size` with seeded random weights, built on the current default device
    (`torch.device("meta")`: the architecture alone, no memory)."""
    spec: ZImageSize = choose_size(FAMILY, size, SIZES)
    tokenizer = build_qwen2_tokenizer()
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE  # Z-Image renders it with enable_thinking=True
    with seeded(seed, "text_encoder"):
        text_encoder = Qwen3Model(
            Qwen3Config(
                vocab_size=spec.text_vocab or len(tokenizer),
                hidden_size=spec.text_hidden,
                intermediate_size=spec.text_intermediate,
                num_hidden_layers=spec.text_layers,
                num_attention_heads=spec.text_heads,
                num_key_value_heads=spec.text_kv_heads,
                head_dim=spec.text_head_dim or spec.text_hidden // spec.text_heads,
                max_position_embeddings=tokenizer.model_max_length,
                rope_parameters={"rope_type": "default", "rope_theta": TEXT_ROPE_THETA},
                tie_word_embeddings=True,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        )
    with seeded(seed, "transformer"):
        transformer = ZImageTransformer2DModel(
            in_channels=LATENT_CHANNELS,
            dim=spec.dim,
            n_layers=spec.layers,
            n_refiner_layers=spec.refiner_layers,
            n_heads=spec.heads,
            n_kv_heads=spec.heads,
            cap_feat_dim=spec.text_hidden,
            axes_dims=list(spec.axes_dims),
            axes_lens=list(ROPE_AXES_LENS),
        )
        # The pad embeddings fill each sequence up to a multiple of 32 tokens, which attention sees. Some
        # diffusers versions allocate them with torch.empty: give them seeded values, as the other weights.
        with torch.no_grad():
            transformer.x_pad_token.normal_(std=0.02)
            transformer.cap_pad_token.normal_(std=0.02)
    vae = autoencoder_kl(
        seed,
        channels=spec.vae_channels,
        groups=spec.vae_groups,
        layers_per_block=spec.vae_layers_per_block,
        latent_channels=LATENT_CHANNELS,
        scaling_factor=VAE_SCALING_FACTOR,
        shift_factor=VAE_SHIFT_FACTOR,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=NUM_TRAIN_TIMESTEPS, shift=SCHEDULER_SHIFT, use_dynamic_shifting=False
    )
    return ZImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )


def build_z_image(out_dir: str | Path, *, size: str, seed: int) -> dict[str, Any]:
    """Build and save a `ZImagePipeline` folder of `size` ("tiny", "small" or "full" = Z-Image 6B) into
    `out_dir` (`make_z_image`).

    Returns the factory summary (see `stages.models.factory.init_model`).
    """
    spec: ZImageSize = choose_size(FAMILY, size, SIZES)
    return save_pipeline(
        make_z_image(size, seed),
        Path(out_dir),
        family=FAMILY,
        size=size,
        seed=seed,
        details={
            "vae_scale_factor": spec.vae_scale_factor,
            "resolution_multiple": 2 * spec.vae_scale_factor,
            "latent_channels": LATENT_CHANNELS,
            "architecture": asdict(spec),
        },
    )


# diffusers' Z-Image LoRA trainer (examples/dreambooth/train_dreambooth_lora_z_image.py, its default
# --lora_layers): the attention projections of every block, refiners included. There is no RL reference
# trainer for Z-Image (families.md).
Z_IMAGE_LORA_TARGETS = ("to_k", "to_q", "to_v", "to_out.0")


class ZImageAdapter(FamilyAdapter):
    """Z-Image (base and Turbo): a single-stream DiT on lists of unpacked latents [C, 1, h, w] and
    variable-length Qwen3 caption features, timestep 1 − σ, predicting −v. CFG is `pos + w·(pos − neg)`
    (w = 0 is off, any w > 0 runs the negative branch), with both branches in one list of 2B as the
    diffusers pipeline runs them; the pipeline's optional `cfg_normalization` and `cfg_truncation` are
    left at their defaults (off)."""

    name = FAMILY
    lora_targets = Z_IMAGE_LORA_TARGETS
    default_guidance = 0.0  # w = 0: CFG off

    def needs_negative(self, guidance: float) -> bool:
        """Z-Image runs the negative branch for any w > 0; a negative w is refused."""
        if guidance < 0:
            raise UserInputError(
                f"--guidance {guidance}: Z-Image's CFG scale w combines pos + w·(pos − neg) and must be "
                ">= 0 (0 turns CFG off)"
            )
        return guidance > 0

    def sigmas(self, num_steps: int, resolution: Resolution) -> torch.Tensor:
        """σ = linspace(1, 1/N, N) in float32, shifted by the scheduler (by `mu` of the image's patch
        count when it shifts dynamically), then 0: the list `ZImagePipeline` passes to `set_timesteps`."""
        if num_steps < 1:
            raise UserInputError(f"--steps {num_steps}: the number of sampling steps must be at least 1")
        _, h, w = self.latent_shape(resolution)
        scheduler = self.pipe.scheduler
        mu = dynamic_shift_mu((h // 2) * (w // 2), scheduler.config)
        scheduler.set_timesteps(sigmas=torch.linspace(1.0, 1 / num_steps, num_steps).tolist(), mu=mu)
        return scheduler.sigmas.to(dtype=torch.float32).clone()

    def latent_shape(self, resolution: Resolution, frames: int = 1) -> tuple[int, ...]:
        """(C, h, w) of an image of `resolution`; each side must be a positive multiple of twice the VAE
        factor (2×2 patches), as `ZImagePipeline` requires."""
        factor = self.pipe.vae_scale_factor
        return (self.pipe.transformer.config.in_channels, *latent_grid(resolution, factor, 2 * factor))

    def encode_prompts(
        self, prompts: list[str], negatives: list[str], device: torch.device, max_sequence_length: int
    ) -> list[tuple[Tensors, Tensors]]:
        """Caption features [L_i, D] per prompt (its chat-templated, unpadded tokens). The pipeline
        rewrites the prompt lists it is given in place, so it gets copies."""
        pos, neg = self.pipe.encode_prompt(
            prompt=list(prompts),
            negative_prompt=list(negatives),
            do_classifier_free_guidance=True,
            device=device,
            max_sequence_length=max_sequence_length,
        )
        return [({"embeds": p}, {"embeds": n}) for p, n in zip(pos, neg)]

    def collate(self, items: Sequence[Tensors]) -> Tensors:
        """Caption features → embeds [B, L_max, D] zero-padded, and each row's length [B]."""
        embeds = [item["embeds"] for item in items]
        lengths = torch.tensor([len(e) for e in embeds], device=embeds[0].device)
        return {"embeds": pad_sequence(embeds, batch_first=True), "length": lengths}

    @staticmethod
    def _captions(batch: Tensors) -> list[torch.Tensor]:
        """The per-row caption features [L_i, D] the transformer takes (padding cut off)."""
        return [e[:n] for e, n in zip(batch["embeds"], batch["length"].tolist())]

    def velocity(
        self,
        transformer: torch.nn.Module,
        x: torch.Tensor,
        sigma: torch.Tensor,
        cond: Condition,
        guidance: float,
    ) -> torch.Tensor:
        """v = −model output, the model fed t = (1000 − σ·1000)/1000 as the pipeline computes it."""
        timestep = (1000 - sigma * self.pipe.scheduler.config.num_train_timesteps) / 1000
        model_in = x.to(transformer.dtype).unsqueeze(2)  # [B, C, 1, h, w]: one frame
        captions = self._captions(cond.pos)
        guided = self.needs_negative(guidance)
        if guided:
            assert cond.neg is not None
            model_in = torch.cat([model_in, model_in])
            timestep = torch.cat([timestep, timestep])
            captions = captions + self._captions(cond.neg)
        out = transformer(list(model_in.unbind(0)), timestep, captions, return_dict=False)[0]
        pred = torch.stack([o.float() for o in out]).squeeze(2)
        if guided:
            pos, neg = pred.chunk(2)
            pred = pos + guidance * (pos - self.unconditional(neg))
        return -pred
