"""FLUX.1 (`FluxPipeline`): the family adapter and a tiny offline builder.

What the adapter reproduces from the diffusers pipeline, so sampling, replay and training compute the
pipeline's own numbers: latents are stored unpacked [16, h, w] and packed into 2×2 patches
[B, h/2·w/2, 64] around each transformer call, with image position ids (0, row, col) and all-zero text
ids; the timestep is σ in [0, 1], written (σ·1000)/1000 as the pipeline computes it; the σ schedule is
linspace(1, 1/N, N) under the dynamic time shift μ that is linear in the packed sequence length; guidance
is *distilled*: the scale is a model input (one conditional forward), not a negative branch. The VAE
normalisation is SD3's form with FLUX's constants, x = (z − shift)·scale.

The builder keeps what that code depends on (the double- and single-stream MMDiT with guidance
embedding, 16 latent channels with FLUX's VAE factors, a CLIP text tower whose pooled output is the
pooled projection, a T5 encoder whose width is `joint_attention_dim`, the FLUX.1-dev scheduler config)
and shrinks widths, depths, vocabularies and the VAE's number of down blocks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from transformers import CLIPTextConfig, CLIPTextModel

from stages.errors import UserInputError
from stages.models.factory import autoencoder_kl, choose_size, save_pipeline, seeded, t5_encoder
from stages.models.families import Condition, FamilyAdapter, Resolution, Tensors, latent_grid
from stages.models.packing import pack, unpack
from stages.models.schedules import dynamic_shift_mu, flow_match_sigmas
from stages.models.tokenizers import build_clip_tokenizer, build_t5_tokenizer

FAMILY = "flux"

# FLUX.1 VAE latent normalisation: latents = (z - shift_factor) * scaling_factor.
VAE_SCALING_FACTOR = 0.3611
VAE_SHIFT_FACTOR = 0.1159
LATENT_CHANNELS = 16
CLIP_MAX_LENGTH = 77
# FLUX.1-dev's scheduler: dynamic shift μ linear in the packed sequence length, 0.5 at 256 and 1.15 at 4096.
SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "base_shift": 0.5,
    "max_shift": 1.15,
}


@dataclass(frozen=True)
class FluxSize:
    """Widths and depths of one size; `image_size` is the default side (sample_size × VAE downsampling)."""

    clip_width: int
    clip_layers: int
    clip_heads: int
    t5_width: int
    t5_layers: int
    t5_heads: int
    t5_ff: int
    heads: int
    head_dim: int
    axes_dims_rope: tuple[int, int, int]
    layers: int
    single_layers: int
    sample_size: int
    vae_channels: tuple[int, ...]
    vae_groups: int
    # Published size: two resnets per VAE block and the encoders' real vocabularies (None: the local
    # tokenizer's length).
    vae_layers_per_block: int = 1
    clip_vocab: int | None = None
    t5_vocab: int | None = None

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae_channels) - 1)

    @property
    def image_size(self) -> int:
        return self.sample_size * self.vae_scale_factor


SIZES: dict[str, FluxSize] = {
    # 64 px default: 4x VAE -> 16x16x16 latents -> 64 packed tokens of width 64.
    "tiny": FluxSize(
        clip_width=32,
        clip_layers=2,
        clip_heads=4,
        t5_width=64,
        t5_layers=2,
        t5_heads=4,
        t5_ff=128,
        heads=4,
        head_dim=16,
        axes_dims_rope=(4, 6, 6),
        layers=1,
        single_layers=2,
        sample_size=16,
        vae_channels=(8, 16, 16),
        vae_groups=8,
    ),
    # 128 px default: 4x VAE -> 32x32x16 latents -> 256 packed tokens of width 384; compute-bound on CPU.
    "small": FluxSize(
        clip_width=128,
        clip_layers=4,
        clip_heads=4,
        t5_width=256,
        t5_layers=4,
        t5_heads=4,
        t5_ff=512,
        heads=6,
        head_dim=64,
        axes_dims_rope=(16, 24, 24),
        layers=4,
        single_layers=8,
        sample_size=32,
        vae_channels=(32, 64, 64),
        vae_groups=16,
    ),
    # FLUX.1-dev as published (black-forest-labs/FLUX.1-dev configs): 19 double- and 38 single-stream
    # blocks of 24 heads x 128 (11.90 B), CLIP-L (123 M) and T5-XXL's encoder (4.76 B), the 8x VAE.
    "full": FluxSize(
        clip_width=768,
        clip_layers=12,
        clip_heads=12,
        t5_width=4096,
        t5_layers=24,
        t5_heads=64,
        t5_ff=10240,
        heads=24,
        head_dim=128,
        axes_dims_rope=(16, 56, 56),
        layers=19,
        single_layers=38,
        sample_size=128,
        vae_channels=(128, 256, 512, 512),
        vae_groups=32,
        vae_layers_per_block=2,
        clip_vocab=49408,
        t5_vocab=32128,
    ),
}


def make_flux(size: str, seed: int) -> FluxPipeline:
    """The `FluxPipeline` of `size` with seeded random weights and guidance embedding (FLUX.1-dev, the model
    flow_grpo and DanceGRPO train), built on the current default device (`torch.device("meta")`: the
    architecture alone, no memory)."""
    spec: FluxSize = choose_size(FAMILY, size, SIZES)
    tokenizer = build_clip_tokenizer(CLIP_MAX_LENGTH)
    tokenizer_2 = build_t5_tokenizer()
    with seeded(seed, "text_encoder"):
        text_encoder = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=spec.clip_vocab or len(tokenizer),
                hidden_size=spec.clip_width,
                intermediate_size=4 * spec.clip_width,
                projection_dim=spec.clip_width,
                num_hidden_layers=spec.clip_layers,
                num_attention_heads=spec.clip_heads,
                max_position_embeddings=CLIP_MAX_LENGTH,
                hidden_act="quick_gelu",
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        )
    text_encoder_2 = t5_encoder(
        seed, "text_encoder_2", tokenizer_2, width=spec.t5_width, heads=spec.t5_heads, ff=spec.t5_ff,
        layers=spec.t5_layers, vocab=spec.t5_vocab,
    )  # fmt: skip
    with seeded(seed, "transformer"):
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=4 * LATENT_CHANNELS,
            num_layers=spec.layers,
            num_single_layers=spec.single_layers,
            attention_head_dim=spec.head_dim,
            num_attention_heads=spec.heads,
            joint_attention_dim=spec.t5_width,
            pooled_projection_dim=spec.clip_width,
            guidance_embeds=True,
            axes_dims_rope=spec.axes_dims_rope,
        )
    vae = autoencoder_kl(
        seed,
        channels=spec.vae_channels,
        groups=spec.vae_groups,
        layers_per_block=spec.vae_layers_per_block,
        latent_channels=LATENT_CHANNELS,
        scaling_factor=VAE_SCALING_FACTOR,
        shift_factor=VAE_SHIFT_FACTOR,
        sample_size=spec.image_size,
    )
    components = {
        "transformer": transformer,
        "vae": vae,
        "text_encoder": text_encoder,
        "text_encoder_2": text_encoder_2,
    }
    for module in components.values():
        module.eval()  # T5's dropout must not act if this pipeline object is ever run before a reload
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )


def build_flux(out_dir: str | Path, *, size: str, seed: int) -> dict[str, Any]:
    """Build and save a `FluxPipeline` folder of `size` ("tiny", "small" or "full" = FLUX.1-dev) into
    `out_dir` (`make_flux`).

    Returns the factory summary (see `stages.models.factory.init_model`).
    """
    spec: FluxSize = choose_size(FAMILY, size, SIZES)
    return save_pipeline(
        make_flux(size, seed),
        Path(out_dir),
        family=FAMILY,
        size=size,
        seed=seed,
        details={
            "image_size": spec.image_size,
            "vae_scale_factor": spec.vae_scale_factor,
            "latent_shape": [LATENT_CHANNELS, spec.sample_size, spec.sample_size],
            "architecture": asdict(spec),
        },
    )


# flow_grpo's LoRA targets for FLUX.1 (scripts/train_flux.py, r64/α128; families.md): the double-stream
# attention and both feed-forwards; attn.to_q/k/v also match the single-stream blocks.
FLUX_LORA_TARGETS = (
    "attn.to_k",
    "attn.to_q",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
)


def image_ids(h: int, w: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """RoPE position ids of the packed tokens of an h×w latent: [h/2·w/2, 3] = (0, row, col)."""
    rows = torch.arange(h // 2).repeat_interleave(w // 2)
    cols = torch.arange(w // 2).repeat(h // 2)
    ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=1)
    return ids.to(device=device, dtype=dtype)


class FluxAdapter(FamilyAdapter):
    """FLUX.1: MMDiT on packed 2×2 latent tokens, CLIP pooled + T5 embeds, distilled guidance.

    The guidance scale enters the model through its guidance embedding (one forward, no negative
    prompt), as `FluxPipeline` runs FLUX.1-dev with `guidance_scale`; the pipeline's optional true CFG
    (`true_cfg_scale` with a negative prompt) is not offered, as no reference RL trainer uses it.
    """

    name = FAMILY
    lora_targets = FLUX_LORA_TARGETS
    cfg_kind = "distilled"

    @property
    def default_guidance(self) -> float:  # type: ignore[override]
        """FluxPipeline's `guidance_scale` default (3.5, FLUX.1-dev); 1 for a model without the embedding."""
        return 3.5 if self.pipe.transformer.config.guidance_embeds else 1.0

    def _grid(self, resolution: Resolution) -> tuple[int, int]:
        """The unpacked latent (h, w); each side must be a positive multiple of 2 × the VAE factor."""
        factor = self.pipe.vae_scale_factor
        return latent_grid(resolution, factor, 2 * factor, "VAE factor × the 2×2 packing")

    def latent_shape(self, resolution: Resolution, frames: int = 1) -> tuple[int, ...]:
        """(16, h, w) of an image of `resolution`, stored unpacked."""
        return (self.pipe.transformer.config.in_channels // 4, *self._grid(resolution))

    def sigmas(self, num_steps: int, resolution: Resolution) -> torch.Tensor:
        """linspace(1, 1/N, N) under the time shift μ of this resolution's packed sequence length
        (h/2·w/2), as `FluxPipeline` sets the scheduler (μ from the scheduler config's base/max lengths
        and shifts)."""
        h, w = self._grid(resolution)
        mu = dynamic_shift_mu((h // 2) * (w // 2), self.pipe.scheduler.config)
        return flow_match_sigmas(self.pipe.scheduler, num_steps, mu=mu)

    def encode_prompts(
        self, prompts: list[str], negatives: list[str], device: torch.device, max_sequence_length: int
    ) -> list[tuple[Tensors, Tensors]]:
        """T5 embeds [L, D] and the CLIP pooled output [P] per prompt; no negative branch, so a non-empty
        negative prompt is refused rather than silently ignored."""
        negative = next((n for n in negatives if n), None)
        if negative is not None:
            raise UserInputError(
                f"negative_prompt {negative!r}: FLUX.1's guidance is distilled into the model (one conditional "
                "forward, no negative branch); remove the negative_prompt field from --prompts"
            )
        embeds, pooled, _ = self.pipe.encode_prompt(
            prompt=list(prompts),
            prompt_2=list(prompts),
            device=device,
            max_sequence_length=max_sequence_length,
        )
        return [({"embeds": embeds[i], "pooled": pooled[i]}, {}) for i in range(len(prompts))]

    def velocity(
        self,
        transformer: torch.nn.Module,
        x: torch.Tensor,
        sigma: torch.Tensor,
        cond: Condition,
        guidance: float,
    ) -> torch.Tensor:
        """One forward on the packed latents with the guidance embedding (`FluxPipeline`'s loop)."""
        if transformer.config.guidance_embeds:
            scale = torch.full((x.shape[0],), float(guidance), device=x.device, dtype=torch.float32)
        elif guidance != 1.0:
            raise UserInputError(
                f"--guidance {guidance}: this FLUX model has no guidance embedding (guidance-free, like "
                "FLUX.1-schnell), so the scale would be ignored; pass --guidance 1"
            )
        else:
            scale = None
        h, w = x.shape[-2:]
        latents = pack(x.to(transformer.dtype))
        ids = image_ids(h, w, x.device, latents.dtype)
        source = self.source_tokens(cond)
        model_in = latents if source is None else torch.cat([latents, source[0].to(latents.dtype)], dim=1)
        ids = ids if source is None else torch.cat([ids, source[1].to(ids.dtype)])
        timestep = (sigma * self.pipe.scheduler.config.num_train_timesteps).to(latents.dtype) / 1000
        embeds = cond.pos["embeds"]
        out = transformer(
            hidden_states=model_in,
            timestep=timestep,
            guidance=scale,
            pooled_projections=cond.pos["pooled"],
            encoder_hidden_states=embeds,
            txt_ids=torch.zeros(embeds.shape[1], 3, device=x.device, dtype=latents.dtype),
            img_ids=ids,
            return_dict=False,
        )[0]
        return unpack(out[:, : latents.shape[1]].float(), h, w)

    def source_tokens(self, cond: Condition) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Tokens appended to the packed latents, [B, N, 64], with their position ids [N, 3], whose output
        is dropped (FLUX.1 Kontext's source image, `stages.models.flux_kontext`); None: FLUX.1 has none."""
        return None
