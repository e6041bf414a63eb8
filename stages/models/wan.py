"""Wan 2.1 / 2.2 text-to-video (`WanPipeline`): the family adapter, and random-weight pipelines shaped
like the three published variants but tiny.

The variants share one pipeline class and one adapter:
- `wan2_1`: Wan 2.1 T2V, one `WanTransformer3DModel` on 16-channel latents [C, F, h, w] of the
  causal 3-D VAE (8× spatial, 4× temporal: 4k+1 frames → k+1 latent frames).
- `wan2_2_5b`: Wan 2.2 TI2V-5B, the 48-channel VAE with residual blocks and a 2×2 pixel patch (16×
  spatial), and per-token timesteps (`expand_timesteps`: the timestep is given per latent token).
- `wan2_2_a14b`: Wan 2.2 A14B, two experts: `transformer` for timesteps t ≥ boundary_ratio·1000 (high
  noise), `transformer_2` below. Both are trained (each carries its own LoRA) because an SDE window
  may span the switch; both are saved and reloaded.

What is kept from the real models, because sampling and training code depends on it: the transformer's
(1, 2, 2) patches, 3-axis RoPE, timestep on the 0–1000 scale, the UMT5 encoder whose embeddings are cut
to each prompt's tokens and zero-padded to max_sequence_length (no text mask), the VAE's per-channel
latents_mean/latents_std, true CFG as two forwards, and a fixed-shift flow-matching σ schedule. Published
checkpoints ship a UniPC multistep scheduler with flow sigmas; RL takes Euler/SDE steps on its σ table
(flow_grpo's Wan trainer steps its SDE on the shipped scheduler's `sigmas`), so the adapter reads the σ
from whichever flow scheduler the checkpoint has. What shrinks: widths, depths, the vocabulary
(`stages.models.tokenizers.build_t5_tokenizer`) and the VAE's width.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
from transformers import UMT5Config, UMT5EncoderModel

from stages.errors import UserInputError
from stages.models.factory import choose_size, save_pipeline, seeded, zero_residual_branches
from stages.models.families import (
    Condition,
    FamilyAdapter,
    Resolution,
    Tensors,
    decode_3d,
    encode_3d,
    latent_grid,
    parse_resolution,
)
from stages.models.schedules import flow_match_sigmas
from stages.models.tokenizers import build_t5_tokenizer

NUM_TRAIN_TIMESTEPS = 1000
HIGH_NOISE, LOW_NOISE = "transformer", "transformer_2"


@dataclass(frozen=True)
class WanVariant:
    """What tells the published variants apart (the rest is the size)."""

    latent_channels: int
    residual_vae: bool  # Wan 2.2's VAE: residual up/down blocks and a 2×2 pixel patch
    expand_timesteps: bool  # one timestep per latent token (TI2V-5B)
    boundary_ratio: float | None  # two experts switching at t = ratio·1000 (A14B)
    shift: float  # the σ shift of the tiny build's scheduler

    @property
    def vae_patch(self) -> int:
        return 2 if self.residual_vae else 1


VARIANTS: dict[str, WanVariant] = {
    "wan2_1": WanVariant(16, residual_vae=False, expand_timesteps=False, boundary_ratio=None, shift=3.0),
    "wan2_2_5b": WanVariant(48, residual_vae=True, expand_timesteps=True, boundary_ratio=None, shift=5.0),
    # Wan2.2-T2V-A14B's model_index: boundary_ratio 0.875
    "wan2_2_a14b": WanVariant(
        16, residual_vae=False, expand_timesteps=False, boundary_ratio=0.875, shift=3.0
    ),
}


# The VAE keeps the real depth (dim_mult of 4: 8× spatial; temporal downsampling in the last two: 4×).
VAE_DIM_MULT = (1, 2, 2, 2)
VAE_TEMPORAL_DOWNSAMPLE = (False, True, True)
TEMPORAL_FACTOR = 4


@dataclass(frozen=True)
class WanSize:
    """Widths and depths of one size; the default clip is `frames` frames of `latent_side` × VAE factor
    pixels (or `image_size`). The transformer's head width splits into RoPE axes 2·(d//6) (h, w) and the rest (t)."""

    text_width: int
    text_layers: int
    text_heads: int
    text_ff: int
    text_length: int
    heads: int
    head_dim: int
    layers: int
    ffn: int
    freq_dim: int
    vae_base_dim: int
    latent_side: int
    frames: int
    # Published sizes: umT5-XXL's vocabulary (None: the local tokenizer's length), the VAE's real widths
    # and two resnets per block.
    text_vocab: int | None = None
    vae_dim_mult: tuple[int, ...] = VAE_DIM_MULT
    vae_res_blocks: int = 1
    # a published size's default clip (height, width) in px (None: latent_side × the VAE factor, square)
    image_size: tuple[int, int] | None = None


SIZES: dict[str, WanSize] = {
    # 5 frames at 32 px (64 px for the 5B's 16× VAE): latents [C, 2, 4, 4], 8 tokens per frame pair.
    "tiny": WanSize(
        text_width=32,
        text_layers=2,
        text_heads=4,
        text_ff=64,
        text_length=64,
        heads=2,
        head_dim=12,
        layers=2,
        ffn=48,
        freq_dim=32,
        vae_base_dim=8,
        latent_side=4,
        frames=5,
    ),
    # 9 frames at 64 px (128 px for the 5B): latents [C, 3, 8, 8].
    "small": WanSize(
        text_width=64,
        text_layers=2,
        text_heads=4,
        text_ff=128,
        text_length=64,
        heads=4,
        head_dim=24,
        layers=4,
        ffn=192,
        freq_dim=64,
        vae_base_dim=16,
        latent_side=8,
        frames=9,
    ),
}
# The published sizes of each variant (Wan-AI's Diffusers configs): umT5-XXL's encoder (5.7 B), the
# VAE (Wan 2.1: base 96; Wan 2.2's 48-channel residual VAE: base 160) and the DiT of head width 128;
# `full` is each variant's flagship. Default clip: 81 frames at 480x832 (`WanPipeline`'s default; 5B: 121
# frames at 704x1280, Wan2.2-TI2V-5B's model card).
UMT5_XXL = dict(
    text_width=4096, text_layers=24, text_heads=64, text_ff=10240, text_length=512, text_vocab=256384
)
WAN_14B = WanSize(
    **UMT5_XXL, heads=40, head_dim=128, layers=40, ffn=13824, freq_dim=256, vae_base_dim=96,
    latent_side=60, frames=81, vae_dim_mult=(1, 2, 4, 4), vae_res_blocks=2, image_size=(480, 832),
)  # fmt: skip
WAN_5B = replace(
    WAN_14B, heads=24, layers=30, ffn=14336, vae_base_dim=160, latent_side=44, frames=121, image_size=(704, 1280)
)  # fmt: skip
PUBLISHED: dict[str, dict[str, WanSize]] = {
    "wan2_1": {
        "full": WAN_14B,
        "1.3b": replace(WAN_14B, heads=12, layers=30, ffn=8960),
    },
    "wan2_2_5b": {"full": WAN_5B},
    "wan2_2_a14b": {"full": WAN_14B},  # two experts of this size
}


def _vae(variant: WanVariant, spec: WanSize, seed: int) -> AutoencoderKLWan:
    """A seeded `AutoencoderKLWan` of the variant's form; the decoder's residual branches are zeroed so
    decoded frames follow the latents (`zero_residual_branches`). The 48-channel VAE gets seeded
    per-channel statistics (the real ones are measured on data)."""
    stats: dict[str, Any] = {}
    if variant.latent_channels != 16:
        with seeded(seed, "vae_statistics"):
            stats = {
                "latents_mean": (0.5 * torch.randn(variant.latent_channels, device="cpu")).tolist(),
                "latents_std": (0.5 + torch.rand(variant.latent_channels, device="cpu")).tolist(),
            }
    with seeded(seed, "vae"):
        vae = AutoencoderKLWan(
            base_dim=spec.vae_base_dim,
            z_dim=variant.latent_channels,
            dim_mult=list(spec.vae_dim_mult),
            num_res_blocks=spec.vae_res_blocks,
            temperal_downsample=list(VAE_TEMPORAL_DOWNSAMPLE),
            is_residual=variant.residual_vae,
            in_channels=3 * variant.vae_patch**2,  # the pixel patch folds into channels (2.2: 12)
            out_channels=3 * variant.vae_patch**2,
            patch_size=variant.vae_patch if variant.residual_vae else None,
            scale_factor_temporal=TEMPORAL_FACTOR,
            scale_factor_spatial=variant.vae_patch * 2 ** (len(spec.vae_dim_mult) - 1),
            **stats,
        )
        zero_residual_branches(vae.decoder)
    return vae


def _transformer(variant: WanVariant, spec: WanSize, seed: int, component: str) -> WanTransformer3DModel:
    with seeded(seed, component):
        return WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=spec.heads,
            attention_head_dim=spec.head_dim,
            in_channels=variant.latent_channels,
            out_channels=variant.latent_channels,
            text_dim=spec.text_width,
            freq_dim=spec.freq_dim,
            ffn_dim=spec.ffn,
            num_layers=spec.layers,
        )


def make_wan(family: str, size: str, seed: int) -> WanPipeline:
    """The `WanPipeline` of the `family` variant (`VARIANTS`) and `size` (`SIZES`, or the variant's
    `PUBLISHED` sizes) with seeded random weights, built on the current default device
    (`torch.device("meta")`: the architecture alone, no memory)."""
    variant = VARIANTS[family]
    spec: WanSize = choose_size(family, size, {**SIZES, **PUBLISHED[family]})
    tokenizer = build_t5_tokenizer()
    with seeded(seed, "text_encoder"):
        text_encoder = UMT5EncoderModel(
            UMT5Config(
                vocab_size=spec.text_vocab or len(tokenizer),
                d_model=spec.text_width,
                d_kv=spec.text_width // spec.text_heads,
                d_ff=spec.text_ff,
                num_layers=spec.text_layers,
                num_heads=spec.text_heads,
                feed_forward_proj="gated-gelu",
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                decoder_start_token_id=tokenizer.pad_token_id,
            )
        ).eval()
    experts = variant.boundary_ratio is not None
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=_vae(variant, spec, seed),
        scheduler=FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=NUM_TRAIN_TIMESTEPS, shift=variant.shift
        ),
        transformer=_transformer(variant, spec, seed, HIGH_NOISE),
        transformer_2=_transformer(variant, spec, seed, LOW_NOISE) if experts else None,
        boundary_ratio=variant.boundary_ratio,
        expand_timesteps=variant.expand_timesteps,
    )


def build_wan(out_dir: str | Path, *, family: str, size: str, seed: int) -> dict[str, Any]:
    """Build and save a `WanPipeline` folder of the `family` variant and `size` (`make_wan`)."""
    variant = VARIANTS[family]
    spec: WanSize = choose_size(family, size, {**SIZES, **PUBLISHED[family]})
    pipeline = make_wan(family, size, seed)
    factor = pipeline.vae.config.scale_factor_spatial
    return save_pipeline(
        pipeline,
        Path(out_dir),
        family=family,
        size=size,
        seed=seed,
        details={
            "image_size": spec.latent_side * factor,
            "frames": spec.frames,
            "vae_scale_factor": factor,
            "latent_shape": [
                variant.latent_channels,
                (spec.frames - 1) // TEMPORAL_FACTOR + 1,
                spec.latent_side,
                spec.latent_side,
            ],
            "text_length": spec.text_length,
            "architecture": {**asdict(spec), **asdict(variant)},
        },
    )


build_wan2_1 = partial(build_wan, family="wan2_1")
build_wan2_2_5b = partial(build_wan, family="wan2_2_5b")
build_wan2_2_a14b = partial(build_wan, family="wan2_2_a14b")
make_wan2_1 = partial(make_wan, "wan2_1")
make_wan2_2_5b = partial(make_wan, "wan2_2_5b")
make_wan2_2_a14b = partial(make_wan, "wan2_2_a14b")


# flow_grpo's train_wan2_1.py (r32/α64): the attention projections; in the text-to-video transformer
# these are attn1 (self) and attn2 (cross) q/k/v/out of every block (no add_* layers without image input).
WAN_LORA_TARGETS = (
    "add_k_proj",
    "add_q_proj",
    "add_v_proj",
    "to_add_out",
    "to_k",
    "to_out.0",
    "to_q",
    "to_v",
)


class WanAdapter(FamilyAdapter):
    """Wan 2.1 / 2.2: latents [C, F, h, w], timestep σ·1000 (per latent token for TI2V-5B), UMT5 text
    zero-padded to max_sequence_length, true CFG as two forwards (cond, then uncond) combined
    u + w(c − u). A14B: rows whose σ·1000 ≥ boundary_ratio·1000 run `transformer`, the others
    `transformer_2`, which combines with --guidance-2 (the pipeline's guidance_scale_2; default --guidance)."""

    name = "wan2_1"
    media = "video"
    lora_targets = WAN_LORA_TARGETS
    text_length = 512  # WanPipeline's max_sequence_length (flow_grpo's Wan trainer encodes 512 too)

    def __init__(self, pipe: Any) -> None:
        super().__init__(pipe)
        config = pipe.config
        two = pipe.transformer_2 is not None and config.boundary_ratio is not None
        self.boundary = config.boundary_ratio * NUM_TRAIN_TIMESTEPS if two else None
        self.name = self.variant_name(config)

    @classmethod
    def variant_name(cls, config: Mapping[str, Any]) -> str:
        """`wan2_2_a14b` with a `boundary_ratio`, `wan2_2_5b` with `expand_timesteps`, else `wan2_1`."""
        if config.get("boundary_ratio") is not None:
            return "wan2_2_a14b"
        return "wan2_2_5b" if config.get("expand_timesteps") else "wan2_1"

    @classmethod
    def images_instead(cls, name: str) -> str:
        """TI2V-5B's released folder names `WanPipeline`, yet its weights are `wan2_2_5b_i2v`'s too: the step
        that saves them as `WanImageToVideoPipeline`; the other variants' weights take no image."""
        if name != "wan2_2_5b":
            return "drop the 'image' column, or pass an image-to-video model (wan2_1_i2v, wan2_2_a14b_i2v)"
        step = "from diffusers import WanImageToVideoPipeline as P; P.from_pretrained('MODEL').save_pretrained('OUT')"
        return (
            "Wan2.2-TI2V-5B-Diffusers' model_index.json names WanPipeline; its weights generate from an image "
            f'as WanImageToVideoPipeline (wan2_2_5b_i2v): save that once, python -c "{step}", and pass --model OUT'
        )

    def trained_modules(self) -> tuple[str, ...]:
        """Both experts for A14B (an SDE window may span the switch), else the one transformer."""
        return (HIGH_NOISE, LOW_NOISE) if self.boundary is not None else (HIGH_NOISE,)

    def sigmas(self, num_steps: int, resolution: Resolution) -> torch.Tensor:
        """The checkpoint scheduler's σ table [N+1]: flow-matching Euler's fixed-shift schedule, or a
        published UniPC scheduler's flow sigmas (`use_flow_sigmas`: linspace(1, 1/1000, N+1)[:-1] shifted
        by its `flow_shift`, then 0); the model is fed σ·1000 either way (UniPC's own timesteps are those
        truncated to integers)."""
        scheduler = self.pipe.scheduler
        if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
            return flow_match_sigmas(scheduler, num_steps)
        if not scheduler.config.get("use_flow_sigmas", False):
            raise UserInputError(
                f"--model: its scheduler {type(scheduler).__name__} has no flow-matching σ (use_flow_sigmas); "
                "give the pipeline folder a FlowMatchEulerDiscreteScheduler or UniPC with use_flow_sigmas"
            )
        if num_steps < 1:
            raise UserInputError(f"--steps {num_steps}: the number of sampling steps must be at least 1")
        scheduler.set_timesteps(num_steps)
        sigmas = scheduler.sigmas.to(dtype=torch.float32).clone()
        # UniPC lowers σ_0 = 1 by 1e-6 for its own log-SNR; an Euler/SDE step starts from pure noise
        # (the SDE's σ = 1 guard then applies, instead of a noise scale of √(σ/(1 − σ)) ≈ 1000)
        if abs(float(sigmas[0]) - 1.0) < 1e-5:
            sigmas[0] = 1.0
        return sigmas

    def latent_shape(self, resolution: Resolution, frames: int = 1) -> tuple[int, ...]:
        """(C, F', h, w) of `frames` frames of `resolution` (C: the VAE's channels, the transformer's output;
        image-to-video adds its condition's to the input): F' = (frames − 1)/4 + 1 latent frames, each side
        a multiple of the VAE factor × 2 (the transformer's patch), as `WanPipeline` requires."""
        pipe = self.pipe
        spatial, temporal = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal
        multiple = spatial * pipe.transformer.config.patch_size[1]
        h, w = latent_grid(resolution, spatial, multiple, f"VAE factor {spatial} × 2×2 patches")
        if frames < 1 or (frames - 1) % temporal:
            raise UserInputError(
                f"--frames {frames}: must be 1 plus a multiple of {temporal} for this model (the VAE's "
                f"temporal factor), e.g. {4 * temporal + 1}"
            )
        return (pipe.transformer.config.out_channels, (frames - 1) // temporal + 1, h, w)

    def encode_prompts(
        self, prompts: list[str], negatives: list[str], device: torch.device, max_sequence_length: int
    ) -> list[tuple[Tensors, Tensors]]:
        """The pipeline's `encode_prompt`: UMT5 states of each prompt's tokens, zero-padded to
        max_sequence_length ("embeds" [L, D]), for the prompts and the negatives."""
        pos, neg = self.pipe.encode_prompt(
            prompt=list(prompts),
            negative_prompt=list(negatives),
            do_classifier_free_guidance=True,
            max_sequence_length=max_sequence_length,
            device=device,
        )
        return [({"embeds": p}, {"embeds": n}) for p, n in zip(pos, neg)]

    def velocity(
        self,
        transformer: torch.nn.Module,
        x: torch.Tensor,
        sigma: torch.Tensor,
        cond: Condition,
        guidance: float,
        guidance_2: float | None = None,
    ) -> torch.Tensor:
        """Guided velocity [B, C, F, h, w] in fp32. With two experts each row runs the expert of its own
        σ (a batch whose rows all sit on one side, as in sampling, runs whole), the low-noise one combining
        with `guidance_2` (None: `guidance`); as in `WanPipeline`, whether CFG runs at all follows
        `guidance` (> 1) for both experts, so a `guidance_2` without it is a one-line error."""
        timestep = sigma * NUM_TRAIN_TIMESTEPS
        cfg = self.needs_negative(guidance)
        if guidance_2 is not None and not cfg:
            raise UserInputError(
                f"--guidance-2 {guidance_2:g}: WanPipeline runs CFG only when --guidance > 1 (for both experts); "
                "raise --guidance or drop --guidance-2"
            )
        if self.boundary is None:
            return self._guided(transformer, x, timestep, cond, guidance, cfg)
        scales = {HIGH_NOISE: guidance, LOW_NOISE: guidance if guidance_2 is None else guidance_2}
        high = timestep >= self.boundary
        if bool(high.all()) or not bool(high.any()):
            name = HIGH_NOISE if bool(high.all()) else LOW_NOISE
            return self._guided(
                partial(transformer, name), x, timestep, cond, scales[name], cfg, transformer.dtype
            )
        v = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        for name, rows in ((HIGH_NOISE, high), (LOW_NOISE, ~high)):
            index = rows.nonzero().flatten()
            v[index] = self._guided(
                partial(transformer, name),
                x[index],
                timestep[index],
                cond.select(index),
                scales[name],
                cfg,
                transformer.dtype,
            )
        return v

    def _guided(
        self,
        run: Any,
        x: torch.Tensor,
        timestep: torch.Tensor,
        cond: Condition,
        guidance: float,
        cfg: bool,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """One expert's prediction, as `WanPipeline.__call__` computes it: the conditional forward, and with
        `cfg` the unconditional one, u + w(c − u) for w = `guidance`; timestep [B], or [B, F'·h/2·w/2] per
        token (5B). `run` is the expert (or a call of it); `dtype` its weights' (default: `run.dtype`)."""
        model_in = self.model_input(x, cond).to(dtype or run.dtype)
        image = self.image_input(cond)
        timestep = self.model_timestep(timestep, x)

        def forward(branch: Tensors) -> torch.Tensor:
            return run(
                hidden_states=model_in,
                timestep=timestep,
                encoder_hidden_states=branch["embeds"],
                **image,
                return_dict=False,
            )[0].float()

        v = forward(cond.pos)
        if cfg:
            assert cond.neg is not None
            uncond = self.unconditional(forward(cond.neg))
            v = uncond + guidance * (v - uncond)
        return v

    def model_input(self, x: torch.Tensor, cond: Condition) -> torch.Tensor:
        """The transformer's `hidden_states` for latents x: x itself (image-to-video adds its condition)."""
        return x

    def model_timestep(self, timestep: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The transformer's timestep for latents x [B, C, F', h, w]: timestep [B] itself, or with
        `expand_timesteps` (TI2V-5B) one per latent token in 2×2 patches, [B, F'·h/2·w/2]."""
        if not self.pipe.config.expand_timesteps:
            return timestep
        frames, h, w = x.shape[2:]
        return timestep[:, None].expand(-1, frames * (h // 2) * (w // 2))

    def image_input(self, cond: Condition) -> dict[str, torch.Tensor]:
        """Extra transformer inputs from the prompt's image (none for text-to-video)."""
        return {}

    def decode(self, x0: torch.Tensor) -> list[Any]:
        """Latents [B, C, F', h, w] → per sample the list of its PIL frames, after z = x/std⁻¹ + mean,
        as the pipeline decodes."""
        return self.pipe.video_processor.postprocess_video(decode_3d(self.pipe.vae, x0), output_type="pil")

    def encode_images(self, images: list[Any], resolution: Resolution, device: torch.device) -> torch.Tensor:
        """PIL images → one-frame latents [B, C, 1, h, w] (resize + centre-crop, VAE posterior mode, then
        (z − mean)/std per channel): the inverse of `decode` for --frames 1."""
        self.latent_shape(resolution)
        height, width = parse_resolution(resolution)
        pixels = self.pipe.video_processor.preprocess(images, height=height, width=width, resize_mode="crop")
        return encode_3d(self.pipe.vae, pixels.to(device).unsqueeze(2))
