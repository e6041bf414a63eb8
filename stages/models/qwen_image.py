"""Qwen-Image: the family adapter and a random-weight `QwenImagePipeline` builder, shaped like Qwen-Image
but tiny.

What is kept from the real model, because sampling and training code depends on it: the MMDiT on 2×2
packed tokens of 16 latent channels (64 wide) with 3-axis RoPE from `img_shapes`, the Qwen2.5-VL text
encoder whose last hidden state behind the pipeline's system template is the condition (the first 34
template tokens dropped, then padded with a mask), the Wan-style 3-D VAE with per-channel
`latents_mean`/`latents_std`, and the published scheduler: flow-matching Euler with dynamic
(resolution-dependent, exponential) shift and terminal σ 0.02. What shrinks: widths, depths, the
vocabulary (see `stages.models.tokenizers`) and the VAE's downsampling (4× instead of 8×).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import Qwen2_5_VLForConditionalGeneration

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
from stages.models.packing import PATCH, pack, unpack
from stages.models.qwen2_5_vl import SIZES as TEXT_SIZES
from stages.models.qwen2_5_vl import Qwen2_5_VLSize, _config
from stages.models.schedules import dynamic_shift_mu, flow_match_sigmas
from stages.models.tokenizers import build_qwen2_tokenizer
from stages.parallelism import sequence_shards

FAMILY = "qwen_image"
LATENT_CHANNELS = 16
# Qwen/Qwen-Image scheduler_config.json: dynamic exponential shift, mu linear in the image token count
# between (256, 0.5) and (8192, 0.9), the schedule stretched to end at σ = 0.02 before the final 0.
SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
}
# The words of the pipeline's system template (`prompt_template_encode`): learned as whole tokens, so the
# template tokenises to the count the pipeline drops (`prompt_template_encode_start_idx`), as with the
# real tokenizer.
TEMPLATE_WORDS = (
    "system user assistant Describe the image by detailing the color, shape, size, texture, quantity, "
    "text, spatial relationships of the objects and background:"
)


@dataclass(frozen=True)
class QwenImageSize:
    """Widths and depths of one size; `image_size` = default resolution (latent side × VAE factor)."""

    text: Qwen2_5_VLSize
    heads: int
    head_dim: int
    layers: int
    axes_dims_rope: tuple[int, int, int]
    vae_base_dim: int
    vae_dim_mult: tuple[int, ...]
    vae_res_blocks: int
    latent_size: int

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae_dim_mult) - 1)

    @property
    def image_size(self) -> int:
        return self.latent_size * self.vae_scale_factor


SIZES: dict[str, QwenImageSize] = {
    # 32 px default: 4x VAE -> 8x8x16 latents -> 16 packed tokens of width 64; text width 64.
    "tiny": QwenImageSize(
        text=TEXT_SIZES["tiny"],
        heads=4,
        head_dim=16,
        layers=2,
        axes_dims_rope=(4, 6, 6),
        vae_base_dim=16,
        vae_dim_mult=(1, 2, 2),
        vae_res_blocks=1,
        latent_size=8,
    ),
    # 128 px default: 4x VAE -> 32x32x16 latents -> 256 packed tokens; transformer width 384, text 128.
    "small": QwenImageSize(
        text=Qwen2_5_VLSize(
            **{
                **asdict(TEXT_SIZES["tiny"]),
                **{"hidden": 128, "intermediate": 256, "layers": 4, "heads": 4, "mrope_section": (4, 6, 6)},
            }
        ),
        heads=6,
        head_dim=64,
        layers=6,
        axes_dims_rope=(16, 24, 24),
        vae_base_dim=32,
        vae_dim_mult=(1, 2, 2),
        vae_res_blocks=1,
        latent_size=32,
    ),
    # Qwen/Qwen-Image as published: the 60-block MMDiT of 24 heads x 128 (20.43 B) on Qwen2.5-VL-7B
    # (8.29 B), the 8x 3-D VAE (base 96, two resnets per block); 1024 px default.
    "full": QwenImageSize(
        text=TEXT_SIZES["7b"],
        heads=24,
        head_dim=128,
        layers=60,
        axes_dims_rope=(16, 56, 56),
        vae_base_dim=96,
        vae_dim_mult=(1, 2, 4, 4),
        vae_res_blocks=2,
        latent_size=128,
    ),
}


def qwen_image_components(spec: QwenImageSize, seed: int, tokenizer: Any) -> dict[str, Any]:
    """The scheduler, VAE, text encoder (its special-token ids `tokenizer`'s) and transformer of a Qwen-Image
    pipeline of `spec`, with seeded random weights (the editing pipelines share them)."""
    with seeded(seed, "text_encoder"):
        text_encoder = Qwen2_5_VLForConditionalGeneration(_config(spec.text, tokenizer)).eval()
    with seeded(seed, "transformer"):
        transformer = QwenImageTransformer2DModel(
            patch_size=PATCH,
            in_channels=LATENT_CHANNELS * PATCH * PATCH,
            out_channels=LATENT_CHANNELS,
            num_layers=spec.layers,
            attention_head_dim=spec.head_dim,
            num_attention_heads=spec.heads,
            joint_attention_dim=spec.text.hidden,
            axes_dims_rope=spec.axes_dims_rope,
        )
    with seeded(seed, "vae"):
        vae = AutoencoderKLQwenImage(
            base_dim=spec.vae_base_dim,
            z_dim=LATENT_CHANNELS,
            dim_mult=list(spec.vae_dim_mult),
            num_res_blocks=spec.vae_res_blocks,
            temperal_downsample=[False] + [True] * (len(spec.vae_dim_mult) - 2),  # as the real [F, T, T]
        )
        zero_residual_branches(vae.decoder)
    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        "vae": vae,
        "text_encoder": text_encoder,
        "transformer": transformer,
    }


def check_template_length(pipeline: Any, prefix: str) -> None:
    """The tiny tokenizer must split a pipeline's template `prefix` into the count of tokens the pipeline
    drops (`prompt_template_encode_start_idx`), as the real tokenizer does."""
    if len(pipeline.tokenizer(prefix).input_ids) != pipeline.prompt_template_encode_start_idx:
        raise RuntimeError(
            f"the tiny tokenizer splits the {type(pipeline).__name__} template into another count"
        )


def make_qwen_image(size: str, seed: int) -> QwenImagePipeline:
    """The `QwenImagePipeline` of `size` with seeded random weights, built on the current default device
    (`torch.device("meta")`: the architecture alone, no memory)."""
    spec: QwenImageSize = choose_size(FAMILY, size, SIZES)
    tokenizer = build_qwen2_tokenizer(spec.text.max_positions, extra_text="\n" + TEMPLATE_WORDS + "\n")
    pipeline = QwenImagePipeline(tokenizer=tokenizer, **qwen_image_components(spec, seed, tokenizer))
    check_template_length(pipeline, pipeline.prompt_template_encode.split("{}")[0])
    return pipeline


def build_qwen_image(out_dir: str | Path, *, size: str, seed: int) -> dict[str, Any]:
    """Build and save a `QwenImagePipeline` folder of `size` ("tiny", "small" or "full" = Qwen-Image 20B)
    into `out_dir` (`make_qwen_image`).

    Returns the factory summary (see `stages.models.factory.init_model`).
    """
    spec: QwenImageSize = choose_size(FAMILY, size, SIZES)
    return save_pipeline(
        make_qwen_image(size, seed),
        Path(out_dir),
        family=FAMILY,
        size=size,
        seed=seed,
        details={
            "image_size": spec.image_size,
            "vae_scale_factor": spec.vae_scale_factor,
            "latent_shape": [LATENT_CHANNELS, spec.latent_size, spec.latent_size],
            "architecture": asdict(spec),
        },
    )


# verl-omni's Qwen-Image recipes (FlowGRPO, NFT, DPO, DPPO; r64/α128): attention of both streams and both
# MLPs (shared/reference/families.md).
QWEN_IMAGE_LORA_TARGETS = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    "img_mlp.net.0.proj",
    "img_mlp.net.2",
    "txt_mlp.net.0.proj",
    "txt_mlp.net.2",
)


class QwenImageAdapter(FamilyAdapter):
    """Qwen-Image: MMDiT on 2×2 packed tokens (stored unpacked [C, h, w]), timestep σ in [0, 1] as
    (σ·1000)/1000, variable-length Qwen2.5-VL text padded with a mask per batch, and true CFG as two
    forwards whose combination is rescaled per token to the conditional prediction's norm."""

    name = FAMILY
    lora_targets = QWEN_IMAGE_LORA_TARGETS

    def _grid(self, resolution: Resolution) -> tuple[int, int]:
        """The unpacked latent (h, w); each side must be a positive multiple of the VAE factor × 2."""
        factor = self.pipe.vae_scale_factor
        return latent_grid(resolution, factor, factor * PATCH, f"VAE factor {factor} × 2×2 packing")

    def sigmas(self, num_steps: int, resolution: Resolution) -> torch.Tensor:
        """Linear σ from 1 to 1/N shifted by mu, the pipeline's linear map of the packed token count
        (h/2·w/2) between the scheduler's (base_image_seq_len, base_shift) and (max_image_seq_len,
        max_shift), then stretched to `shift_terminal`; 0 appended."""
        h, w = self._grid(resolution)
        mu = dynamic_shift_mu((h // PATCH) * (w // PATCH), self.pipe.scheduler.config)
        return flow_match_sigmas(self.pipe.scheduler, num_steps, mu=mu)

    def latent_shape(self, resolution: Resolution, frames: int = 1) -> tuple[int, ...]:
        """(16, h, w) of an image of `resolution`: each side a multiple of the VAE factor × 2."""
        return (self.pipe.transformer.config.out_channels, *self._grid(resolution))

    def encode_prompts(
        self, prompts: list[str], negatives: list[str], device: torch.device, max_sequence_length: int
    ) -> list[tuple[Tensors, Tensors]]:
        """The pipeline's `encode_prompt` for the prompts and, in a second call, the negatives (as its
        `__call__` does); each kept unpadded ("embeds" [L_i, D])."""

        def unpadded(texts: list[str]) -> list[Tensors]:
            embeds, mask = self.pipe.encode_prompt(
                prompt=list(texts), device=device, max_sequence_length=max_sequence_length
            )
            lengths = [embeds.shape[1]] * len(texts) if mask is None else mask.sum(dim=1).tolist()
            return [{"embeds": embeds[i, :n]} for i, n in enumerate(lengths)]

        return list(zip(unpadded(prompts), unpadded(negatives)))

    def collate(self, items: Sequence[Tensors]) -> Tensors:
        """Zero-pad the per-prompt embeddings to the longest: "embeds" [B, L, D], "mask" [B, L] (int64,
        1 for real tokens), as the pipeline pads a batch."""
        length = max(item["embeds"].shape[0] for item in items)
        embeds = torch.stack(
            [
                torch.nn.functional.pad(item["embeds"], (0, 0, 0, length - item["embeds"].shape[0]))
                for item in items
            ]
        )
        mask = torch.zeros(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        for i, item in enumerate(items):
            mask[i, : item["embeds"].shape[0]] = 1
        return {"embeds": embeds, "mask": mask}

    def velocity(
        self,
        transformer: torch.nn.Module,
        x: torch.Tensor,
        sigma: torch.Tensor,
        cond: Condition,
        guidance: float,
    ) -> torch.Tensor:
        """One forward per branch on the packed latents (followed by the source tokens of an editing
        family, `source_tokens`, whose output is dropped); true CFG u + w(c − u) rescaled per token to ‖c‖
        over the 64 packed channels, as `QwenImagePipeline.__call__` does; fp32 [B, C, h, w]."""
        batch, _, h, w = x.shape
        tokens = pack(x.to(transformer.dtype))
        count = tokens.shape[1]
        timestep = (sigma * 1000).to(tokens.dtype) / 1000
        shapes = [(1, h // PATCH, w // PATCH)]
        source = self.source_tokens(cond)
        if source is not None:
            tokens = torch.cat([tokens, source[0].to(tokens.dtype)], dim=1)
            shapes += source[1]
        img_shapes = [shapes] * batch

        def forward(branch: Tensors) -> torch.Tensor:
            embeds, mask = branch["embeds"], branch["mask"]
            extra = -embeds.shape[1] % sequence_shards(transformer)
            if extra:  # sequence parallelism splits the text too: pad it with masked-out tokens
                embeds = torch.nn.functional.pad(embeds, (0, 0, 0, extra))
                mask = torch.nn.functional.pad(mask, (0, extra))
            return transformer(
                hidden_states=tokens,
                timestep=timestep,
                encoder_hidden_states=embeds,
                encoder_hidden_states_mask=None if bool(mask.all()) else mask,
                img_shapes=img_shapes,
                return_dict=False,
            )[0][:, :count].float()

        v = forward(cond.pos)
        if self.needs_negative(guidance):
            assert cond.neg is not None
            uncond = self.unconditional(forward(cond.neg))
            combined = uncond + guidance * (v - uncond)
            v = combined * (torch.norm(v, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))
        return unpack(v, h, w)

    def source_tokens(self, cond: Condition) -> tuple[torch.Tensor, list[tuple[int, int, int]]] | None:
        """Packed tokens [B, N, 64] appended to the latent tokens, and the (frames, rows, cols) of each image
        they hold, for the rotary positions; None (Qwen-Image) or an editing family's source images."""
        return None

    def encode_images(self, images: list[Any], resolution: Resolution, device: torch.device) -> torch.Tensor:
        """VAE posterior mode of one-frame videos, then (z − mean)/std per channel, the inverse of `decode`."""
        self.latent_shape(resolution)
        height, width = parse_resolution(resolution)
        pixels = self.pipe.image_processor.preprocess(images, height=height, width=width, resize_mode="crop")
        return encode_3d(self.pipe.vae, pixels.to(device).unsqueeze(2))[:, :, 0]

    def decode(self, x0: torch.Tensor) -> list[Any]:
        """Latents [B, C, h, w] → one-frame VAE decode after z = x/std⁻¹ + mean, as the pipeline does."""
        image = decode_3d(self.pipe.vae, x0.unsqueeze(2))[:, :, 0]
        return self.pipe.image_processor.postprocess(image, output_type="pil")
