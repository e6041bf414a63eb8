"""FLUX.2 [dev] and FLUX.2 [klein] pipelines with seeded random weights: the offline builders of
`init-model` (the tiny test models and the published sizes); flux2.py holds the family adapters.

The builders keep what the adapters depend on (the double- and single-stream transformer with fused
single-block projections, the 32-channel VAE with its batch-norm statistics, text encoders deep enough for
the layers the pipelines read) and shrink widths, depths of the transformer and VAE, and vocabularies. The
tiny FLUX.2 [dev] text encoder is a `Mistral3ForConditionalGeneration` (its vision tower is never run for
text) under a bare tokenizer: the published `PixtralProcessor` needs torchvision, which omnirl does not
install, and `Flux2Pipeline` only calls the tokenizer's `apply_chat_template`, which a tokenizer has too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKLFlux2,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Pipeline,
    Flux2Transformer2DModel,
)
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

from stages.models.factory import choose_size, save_pipeline, seeded, zero_residual_branches
from stages.models.flux2 import FAMILY, KLEIN, TOKEN_CHANNELS, VAE_CHANNELS
from stages.models.tokenizers import QWEN3_CHAT_TEMPLATE, build_qwen2_tokenizer

# FLUX.2-dev's scheduler: dynamic shift (μ is computed by the pipeline, `compute_empirical_mu`).
SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "time_shift_type": "exponential",
}
# Mistral's special tokens, and a chat template rendering FLUX.2 [dev]'s turns (system, user) as Mistral
# Small 3.1's does: <s>[SYSTEM_PROMPT]…[/SYSTEM_PROMPT][INST]…[/INST].
MISTRAL_SPECIAL_TOKENS = (
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]", "[IMG_BREAK]",
    "[IMG_END]",
)  # fmt: skip
MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message.content is string -%}{%- set text = message.content -%}"
    "{%- else -%}{%- set text = message.content | selectattr('type', 'equalto', 'text') | map(attribute='text')"
    " | join('') -%}{%- endif -%}"
    "{%- if message.role == 'system' -%}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' -}}"
    "{%- elif message.role == 'user' -%}{{- '[INST]' + text + '[/INST]' -}}"
    "{%- else -%}{{- text + eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
)


@dataclass(frozen=True)
class Flux2Size:
    """Widths and depths of one size; `image_size` is the default side (sample_size × VAE factor × 2)."""

    text_hidden: int
    text_intermediate: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    heads: int
    head_dim: int
    axes_dims_rope: tuple[int, int, int, int]
    layers: int
    single_layers: int
    timestep_channels: int
    sample_size: int
    vae_channels: tuple[int, ...]
    vae_groups: int
    text_length: int
    # Published sizes: the text encoder's head width (None: text_hidden // text_heads) and vocabulary (None:
    # the local tokenizer's), two resnets per VAE block, and FLUX.2 [dev]'s Pixtral vision tower as (width,
    # MLP width, layers, heads, image size, patch) (None: a one-layer tower of the text encoder's width).
    text_head_dim: int | None = None
    text_vocab: int | None = None
    text_tied: bool = True  # the text encoder's LM head shares the embedding (Mistral Small, Qwen3-8B: no)
    vae_layers_per_block: int = 1
    vision: tuple[int, int, int, int, int, int] | None = None

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae_channels) - 1)

    @property
    def image_size(self) -> int:
        return self.sample_size * self.vae_scale_factor * 2


SIZES: dict[str, Flux2Size] = {
    # 32 px default: 4x VAE, 2x2 patches -> 128x4x4 latents -> 16 tokens of width 128. The text encoders
    # keep the depth the pipelines read (hidden states 10, 20, 30 of FLUX.2 [dev]; 9, 18, 27 of klein).
    "tiny": Flux2Size(
        text_hidden=32,
        text_intermediate=64,
        text_layers=30,
        text_heads=4,
        text_kv_heads=2,
        heads=2,
        head_dim=16,
        axes_dims_rope=(4, 4, 4, 4),
        layers=1,
        single_layers=2,
        timestep_channels=32,
        sample_size=4,
        vae_channels=(8, 16, 16),
        vae_groups=8,
        text_length=64,
    ),
    # black-forest-labs/FLUX.2-dev as published: 8 double- and 48 single-stream blocks of 48 heads x 128
    # (32 B) on Mistral Small 3.1 (24 B: 40 layers of 5120, Pixtral's 24-layer vision tower), the 8x VAE.
    "full": Flux2Size(
        text_hidden=5120,
        text_intermediate=32768,
        text_layers=40,
        text_heads=32,
        text_kv_heads=8,
        heads=48,
        head_dim=128,
        axes_dims_rope=(32, 32, 32, 32),
        layers=8,
        single_layers=48,
        timestep_channels=256,
        sample_size=64,
        vae_channels=(128, 256, 512, 512),
        vae_groups=32,
        text_length=512,
        text_head_dim=128,
        text_vocab=131072,
        text_tied=False,
        vae_layers_per_block=2,
        vision=(1024, 4096, 24, 16, 1540, 14),
    ),
}
# klein: the tiny build as FLUX.2's; full = black-forest-labs/FLUX.2-klein-9B as published: 8 double- and 24
# single-stream blocks of 32 heads x 128 on Qwen3-8B (36 layers of 4096); 4b = FLUX.2-klein-4B: 5 double- and
# 20 single-stream blocks of 24 heads x 128 on Qwen3-4B (36 layers of 2560, its embedding tied to the LM head).
KLEIN_9B = replace(
    SIZES["full"],
    text_hidden=4096,
    text_intermediate=12288,
    text_layers=36,
    text_heads=32,
    text_kv_heads=8,
    text_vocab=151936,
    heads=32,
    single_layers=24,
    vision=None,
)
KLEIN_SIZES: dict[str, Flux2Size] = {
    "tiny": SIZES["tiny"],
    "full": KLEIN_9B,
    "4b": replace(
        KLEIN_9B,
        text_hidden=2560,
        text_intermediate=9728,
        text_tied=True,
        heads=24,
        layers=5,
        single_layers=20,
    ),
}
# The sizes `plan --family` reads beside `SIZES` (FLUX.2 [dev]'s), by family.
PUBLISHED: dict[str, dict[str, Flux2Size]] = {KLEIN: KLEIN_SIZES}


def _transformer(spec: Flux2Size, seed: int, *, guidance_embeds: bool) -> Flux2Transformer2DModel:
    with seeded(seed, "transformer"):
        return Flux2Transformer2DModel(
            in_channels=TOKEN_CHANNELS,
            num_layers=spec.layers,
            num_single_layers=spec.single_layers,
            attention_head_dim=spec.head_dim,
            num_attention_heads=spec.heads,
            joint_attention_dim=3 * spec.text_hidden,  # three hidden-state layers side by side
            timestep_guidance_channels=spec.timestep_channels,
            axes_dims_rope=spec.axes_dims_rope,
            guidance_embeds=guidance_embeds,
        )


def _vae(spec: Flux2Size, seed: int) -> AutoencoderKLFlux2:
    """The 32-channel VAE with seeded batch-norm statistics (the published ones are far from 0 and 1, so the
    normalisation is exercised), its decoder's residual branches zeroed as the factory's other VAEs."""
    with seeded(seed, "vae"):
        vae = AutoencoderKLFlux2(
            down_block_types=("DownEncoderBlock2D",) * len(spec.vae_channels),
            up_block_types=("UpDecoderBlock2D",) * len(spec.vae_channels),
            block_out_channels=spec.vae_channels,
            layers_per_block=spec.vae_layers_per_block,
            latent_channels=VAE_CHANNELS,
            norm_num_groups=spec.vae_groups,
            sample_size=spec.image_size,
        )
        zero_residual_branches(vae.decoder)
        with torch.no_grad():
            vae.bn.running_mean.normal_(0.0, 0.1)
            vae.bn.running_var.uniform_(0.5, 1.5)
    return vae


def _modules(*modules: torch.nn.Module) -> None:
    for module in modules:
        module.eval()


def make_flux2(size: str, seed: int) -> Flux2Pipeline:
    """The `Flux2Pipeline` (FLUX.2 [dev]) of `size` with seeded random weights: a Mistral3 text encoder
    under a bare Mistral-style tokenizer (see the module docstring), guidance embedding."""
    from transformers import (
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        MistralConfig,
        PixtralVisionConfig,
    )

    spec: Flux2Size = choose_size(FAMILY, size, SIZES)
    tokenizer = build_qwen2_tokenizer(spec.text_length, SYSTEM_MESSAGE, special_tokens=MISTRAL_SPECIAL_TOKENS)
    tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token = "<s>", "</s>", "<unk>"
    tokenizer.chat_template = MISTRAL_CHAT_TEMPLATE
    vision = spec.vision or (spec.text_hidden, spec.text_intermediate, 1, spec.text_heads, 64, 4)
    with seeded(seed, "text_encoder"):
        text_encoder = Mistral3ForConditionalGeneration(
            Mistral3Config(
                vision_config=PixtralVisionConfig(
                    hidden_size=vision[0],
                    intermediate_size=vision[1],
                    num_hidden_layers=vision[2],
                    num_attention_heads=vision[3],
                    head_dim=vision[0] // vision[3],
                    image_size=vision[4],
                    patch_size=vision[5],
                ),
                text_config=MistralConfig(
                    vocab_size=spec.text_vocab or len(tokenizer),
                    hidden_size=spec.text_hidden,
                    intermediate_size=spec.text_intermediate,
                    num_hidden_layers=spec.text_layers,
                    num_attention_heads=spec.text_heads,
                    num_key_value_heads=spec.text_kv_heads,
                    head_dim=spec.text_head_dim or spec.text_hidden // spec.text_heads,
                    max_position_embeddings=spec.text_length,
                    pad_token_id=tokenizer.pad_token_id,
                    bos_token_id=tokenizer.bos_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                ),
                image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
                spatial_merge_size=2,
                multimodal_projector_bias=False,
                tie_word_embeddings=spec.text_tied,
            )
        )
    transformer = _transformer(spec, seed, guidance_embeds=True)
    vae = _vae(spec, seed)
    _modules(text_encoder, transformer, vae)
    return Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )


def make_flux2_klein(size: str, seed: int) -> Flux2KleinPipeline:
    """The `Flux2KleinPipeline` (klein base: true CFG, not step-distilled) of `size` with seeded random
    weights: a Qwen3 text encoder behind Qwen3's chat template, no guidance embedding."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    spec: Flux2Size = choose_size(KLEIN, size, KLEIN_SIZES)
    tokenizer = build_qwen2_tokenizer(spec.text_length)
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    with seeded(seed, "text_encoder"):
        text_encoder = Qwen3ForCausalLM(
            Qwen3Config(
                vocab_size=spec.text_vocab or len(tokenizer),
                hidden_size=spec.text_hidden,
                intermediate_size=spec.text_intermediate,
                num_hidden_layers=spec.text_layers,
                num_attention_heads=spec.text_heads,
                num_key_value_heads=spec.text_kv_heads,
                head_dim=spec.text_head_dim or spec.text_hidden // spec.text_heads,
                max_position_embeddings=spec.text_length,
                tie_word_embeddings=spec.text_tied,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        )
    transformer = _transformer(spec, seed, guidance_embeds=False)
    vae = _vae(spec, seed)
    _modules(text_encoder, transformer, vae)
    return Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=False,
    )


def _save(pipeline: Any, out_dir: str | Path, family: str, size: str, seed: int) -> dict[str, Any]:
    spec: Flux2Size = choose_size(family, size, KLEIN_SIZES if family == KLEIN else SIZES)
    return save_pipeline(
        pipeline,
        Path(out_dir),
        family=family,
        size=size,
        seed=seed,
        details={
            "image_size": spec.image_size,
            "vae_scale_factor": spec.vae_scale_factor,
            "latent_shape": [TOKEN_CHANNELS, spec.sample_size, spec.sample_size],
            "text_length": spec.text_length,
            "architecture": asdict(spec),
        },
    )


def build_flux2(out_dir: str | Path, *, size: str, seed: int) -> dict[str, Any]:
    """Build and save a `Flux2Pipeline` folder of `size` ("tiny", or "full" = FLUX.2 [dev]) into `out_dir`; the
    factory summary."""
    return _save(make_flux2(size, seed), out_dir, FAMILY, size, seed)


def build_flux2_klein(out_dir: str | Path, *, size: str, seed: int) -> dict[str, Any]:
    """Build and save a `Flux2KleinPipeline` (klein base) folder of `size` ("tiny", or "full" = FLUX.2 [klein]
    9B) into `out_dir`; the factory summary."""
    return _save(make_flux2_klein(size, seed), out_dir, KLEIN, size, seed)
