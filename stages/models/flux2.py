"""FLUX.2 (`Flux2Pipeline`, FLUX.2 [dev]) and FLUX.2 [klein] (`Flux2KleinPipeline`): the family adapters and
tiny offline builders. One model generates from text alone or from text and reference images.

What the adapters reproduce from the diffusers pipelines, so sampling, replay and training compute the
pipelines' own numbers. The VAE (`AutoencoderKLFlux2`, 32 channels) is read in its 2×2-patchified,
batch-normalised form: a sample's latent is stored as [128, h, w] (h = height / (VAE factor × 2)), the
space the pipeline draws its noise in, and flattened row-major into h·w tokens of 128 around each
transformer call, with 4-axis RoPE ids (T, row, col, L) = (0, r, c, 0). The text condition is the padded
sequence of the text encoder's hidden states at three layers, concatenated per token (FLUX.2 [dev]: Mistral
Small 3.1 behind BFL's system message; klein: Qwen3 behind its chat template), with ids (0, 0, 0, l).
Reference images (a prompt row's `image` / `images`) are VAE-encoded at their own size (the pipelines'
checks: each side ≥ 64 px, aspect ≤ 8:1; above 1 MP resized to 1 MP; each side floored to a multiple of
the VAE factor × 2) and appended to the latent tokens with ids (10 + 10·k, r, c, 0) for the k-th; the
transformer's output over them is dropped. The σ schedule is linspace(1, 1/N, N) under FLUX.2's empirical
shift μ (a function of the token count and N). The timestep is σ·1000/1000, as the pipelines write it.

Guidance: FLUX.2 [dev] is guidance-distilled (the scale is a model input, one forward, no negative prompt);
klein base runs true CFG against the negative prompt ("" by default, as the pipeline), and a step-distilled
klein (`is_distilled` in model_index.json: FLUX.2 [klein] 4B / 9B) takes no guidance at all.

The builders keep what that code depends on (the double- and single-stream transformer with fused
single-block projections, the 32-channel VAE with its batch-norm statistics, text encoders deep enough for
the layers the pipelines read) and shrink widths, depths of the transformer and VAE, and vocabularies. The
tiny FLUX.2 [dev] text encoder is a `Mistral3ForConditionalGeneration` (its vision tower is never run for
text) under a bare tokenizer: the published `PixtralProcessor` needs torchvision, which omnirl does not
install, and `Flux2Pipeline` only calls the tokenizer's `apply_chat_template`, which a tokenizer has too.
"""

from __future__ import annotations

from collections.abc import Sequence
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
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

from stages.errors import UserInputError
from stages.models.factory import choose_size, save_pipeline, seeded, zero_residual_branches
from stages.models.families import (
    Condition,
    FamilyAdapter,
    Resolution,
    Tensors,
    latent_grid,
    parse_resolution,
)
from stages.models.schedules import flow_match_sigmas
from stages.models.tokenizers import QWEN3_CHAT_TEMPLATE, build_qwen2_tokenizer

FAMILY = "flux2"
KLEIN = "flux2_klein"
VAE_CHANNELS = 32
TOKEN_CHANNELS = 4 * VAE_CHANNELS  # a 2×2 patch of the VAE latent: the transformer's token width
# The pipelines' reference-image checks and cap (`Flux2ImageProcessor.check_image_input`, `__call__`).
REFERENCE_MAX_AREA = 1024 * 1024
# FLUX.2 [dev] takes up to 10 reference images (BFL's model card); diffusers sets no limit.
MAX_REFERENCES = 10
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

# Flow-Factory's default LoRA targets for FLUX.2 and klein (models/flux/flux2*.py, r64/α128): the
# double-stream attention and both feed-forwards, and the single-stream blocks' fused QKV+MLP input
# projection (its "attn.to_out.0" names no single-block module: their output projection is `attn.to_out`).
FLUX2_LORA_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.linear_in",
    "ff.linear_out",
    "ff_context.linear_in",
    "ff_context.linear_out",
    "attn.to_qkv_mlp_proj",
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
# single-stream blocks of 32 heads x 128 on Qwen3-8B (36 layers of 4096). (klein 4B: 5 + 20 blocks of 24
# heads on Qwen3-4B.)
KLEIN_SIZES: dict[str, Flux2Size] = {
    "tiny": SIZES["tiny"],
    "full": replace(
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
    ),
}


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


def pack_tokens(x: torch.Tensor) -> torch.Tensor:
    """[B, 128, h, w] → [B, h·w, 128]: each latent position a token, row-major (`_pack_latents`)."""
    return x.flatten(2).transpose(1, 2)


def unpack_tokens(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of `pack_tokens`: [B, h·w, 128] → [B, 128, h, w]."""
    return tokens.transpose(1, 2).reshape(tokens.shape[0], -1, h, w)


def latent_ids(h: int, w: int, device: torch.device) -> torch.Tensor:
    """RoPE ids [h·w, 4] = (0, row, col, 0) of the generated image's tokens (`_prepare_latent_ids`)."""
    zero = torch.arange(1)
    return torch.cartesian_prod(zero, torch.arange(h), torch.arange(w), zero).to(device)


def text_ids(length: int, device: torch.device) -> torch.Tensor:
    """RoPE ids [L, 4] = (0, 0, 0, l) of the text tokens (`_prepare_text_ids`)."""
    zero = torch.arange(1)
    return torch.cartesian_prod(zero, zero, zero, torch.arange(length)).to(device)


class Flux2Adapter(FamilyAdapter):
    """FLUX.2 [dev]: text tokens, the generated image's tokens and any reference images' tokens in one
    sequence; distilled guidance.

    Each prompt's conditioning: "embeds" [L, 3·D] (the text encoder's three hidden-state layers), and with
    reference images "image_latents" [N, 128] (their tokens, all references in order) and "image_ids"
    [N, 4]. A batch shares one reference layout (count and sizes).
    """

    name = FAMILY
    lora_targets = FLUX2_LORA_TARGETS
    cfg_kind = "distilled"
    default_guidance = 4.0  # Flux2Pipeline's guidance_scale default
    text_length = 512  # the pipelines' max_sequence_length default
    condition_images = (0, MAX_REFERENCES)

    def _grid(self, resolution: Resolution) -> tuple[int, int]:
        """The token grid (h, w); each pixel side must be a positive multiple of the VAE factor × 2."""
        multiple = self.pipe.vae_scale_factor * 2
        return latent_grid(resolution, multiple, multiple, "VAE factor × the 2×2 patch")

    def latent_shape(self, resolution: Resolution, frames: int = 1) -> tuple[int, ...]:
        """(128, h, w): the patchified, batch-normalised VAE latent of an image of `resolution`."""
        return (self.pipe.transformer.config.in_channels, *self._grid(resolution))

    def sigmas(self, num_steps: int, resolution: Resolution) -> torch.Tensor:
        """linspace(1, 1/N, N) under the empirical shift μ(h·w, N), as the FLUX.2 pipelines set the scheduler."""
        h, w = self._grid(resolution)
        mu = compute_empirical_mu(image_seq_len=h * w, num_steps=num_steps)
        return flow_match_sigmas(self.pipe.scheduler, num_steps, mu=mu)

    def _text(self, prompts: list[str], device: torch.device, max_sequence_length: int) -> list[Tensors]:
        embeds, _ = self.pipe.encode_prompt(
            prompt=list(prompts), device=device, max_sequence_length=max_sequence_length
        )
        return [{"embeds": embeds[i]} for i in range(len(prompts))]

    def _negatives(
        self, negatives: list[str], device: torch.device, max_sequence_length: int
    ) -> list[Tensors]:
        """FLUX.2 [dev] has no negative branch: a non-empty negative prompt is refused, not ignored."""
        negative = next((n for n in negatives if n), None)
        if negative is not None:
            raise UserInputError(
                f"negative_prompt {negative!r}: {self.name}'s guidance is distilled into the model (one "
                "conditional forward, no negative branch); remove the negative_prompt field from --prompts"
            )
        return [{} for _ in negatives]

    def _references(self, images: list[Any], device: torch.device) -> Tensors:
        """The reference images' tokens [N, 128] and ids [N, 4], as the pipelines prepare them."""
        pipe = self.pipe
        multiple = pipe.vae_scale_factor * 2
        pixels = []
        for k, image in enumerate(images):
            try:
                pipe.image_processor.check_image_input(image)
            except ValueError as error:
                raise UserInputError(
                    f"condition image {k} ({image.size[0]}x{image.size[1]} px): {error}; resize it"
                ) from None
            if image.size[0] * image.size[1] > REFERENCE_MAX_AREA:
                image = pipe.image_processor._resize_to_target_area(image, REFERENCE_MAX_AREA)
            width, height = image.size[0] // multiple * multiple, image.size[1] // multiple * multiple
            pixels.append(
                pipe.image_processor.preprocess(image, height=height, width=width, resize_mode="crop")
            )
        tokens, ids = pipe.prepare_image_latents(
            images=pixels, batch_size=1, generator=None, device=device, dtype=pipe.vae.dtype
        )
        return {"image_latents": tokens[0], "image_ids": ids[0]}

    def encode_prompts(
        self,
        prompts: list[str],
        negatives: list[str],
        device: torch.device,
        max_sequence_length: int,
        images: list[list[Any]] | None = None,
    ) -> list[tuple[Tensors, Tensors]]:
        """The pipeline's `encode_prompt` for the prompts (and negatives, where the family runs them), each
        with its reference images' tokens."""
        positive = self._text(prompts, device, max_sequence_length)
        negative = self._negatives(negatives, device, max_sequence_length)
        for pos, given in zip(positive, images or [[] for _ in prompts]):
            if given:
                pos.update(self._references(given, device))
        return list(zip(positive, negative))

    def collate(self, items: Sequence[Tensors]) -> Tensors:
        """Stacked per-prompt tensors; the prompts of a batch must share one reference layout."""
        layouts = {tuple((k, tuple(v.shape)) for k, v in sorted(item.items())) for item in items}
        if len(layouts) > 1:
            raise UserInputError(
                f"{len(layouts)} reference-image layouts (counts or sizes) in one batch; {self.name} runs a batch "
                "of one layout: give every row the same number of references of one size, or take one row per "
                "forward (sample --batch-size 1, update --micro-batch 1)"
            )
        return super().collate(items)

    def _guidance(self, guidance: float, x: torch.Tensor) -> torch.Tensor | None:
        """The guidance embedding's input [B] (FLUX.2 [dev]: the scale itself)."""
        return torch.full((x.shape[0],), float(guidance), device=x.device, dtype=torch.float32)

    def velocity(
        self,
        transformer: torch.nn.Module,
        x: torch.Tensor,
        sigma: torch.Tensor,
        cond: Condition,
        guidance: float,
    ) -> torch.Tensor:
        """One forward per branch over [latent tokens, reference tokens], the output over the latent tokens
        (the FLUX.2 pipelines' loop); true CFG u + w(c − u) where the family runs a negative branch."""
        h, w = x.shape[-2:]
        tokens = pack_tokens(x.to(transformer.dtype))
        ids = latent_ids(h, w, x.device)
        pos = cond.pos
        if "image_latents" in pos:
            model_in = torch.cat([tokens, pos["image_latents"].to(tokens.dtype)], dim=1)
            ids = torch.cat([ids, pos["image_ids"][0].to(ids)])
        else:
            model_in = tokens
        timestep = (sigma * self.pipe.scheduler.config.num_train_timesteps).to(tokens.dtype) / 1000
        scale = self._guidance(guidance, x)

        def forward(embeds: torch.Tensor) -> torch.Tensor:
            out = transformer(
                hidden_states=model_in,
                timestep=timestep,
                guidance=scale,
                encoder_hidden_states=embeds,
                txt_ids=text_ids(embeds.shape[1], x.device),
                img_ids=ids,
                return_dict=False,
            )[0]
            return out[:, : tokens.shape[1]].float()

        v = forward(pos["embeds"])
        if self.needs_negative(guidance):
            assert cond.neg is not None
            uncond = self.unconditional(forward(cond.neg["embeds"]))
            v = uncond + guidance * (v - uncond)
        return unpack_tokens(v, h, w)

    def _normalisation(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE's batch-norm mean and std [1, 128, 1, 1] on `like`'s device and dtype."""
        vae = self.pipe.vae
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(
            like.device, like.dtype
        )
        return mean, std

    def decode(self, x0: torch.Tensor) -> list[Any]:
        """x·std + mean, un-patchified, VAE-decoded (the pipelines' decode)."""
        pipe = self.pipe
        z = x0.to(pipe.vae.dtype)
        mean, std = self._normalisation(z)
        image = pipe.vae.decode(pipe._unpatchify_latents(z * std + mean), return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="pil")

    def encode_images(self, images: list[Any], resolution: Resolution, device: torch.device) -> torch.Tensor:
        """PIL images → [B, 128, h, w] (resize + centre-crop to `resolution`), the inverse of `decode`: the VAE
        posterior mode, patchified and batch-normalised (`_encode_vae_image`)."""
        self.latent_shape(resolution)
        height, width = parse_resolution(resolution)
        pipe = self.pipe
        pixels = pipe.image_processor.preprocess(images, height=height, width=width, resize_mode="crop")
        return pipe._encode_vae_image(pixels.to(device, pipe.vae.dtype), generator=None).float()


class Flux2KleinAdapter(Flux2Adapter):
    """FLUX.2 [klein]: FLUX.2's transformer without guidance embedding on a Qwen3 text encoder. Klein base
    runs true CFG against the negative prompt; a step-distilled klein (`is_distilled`) runs one forward and
    takes --guidance 1 only."""

    name = KLEIN
    cfg_kind = "true"
    default_guidance = 1.0

    @property
    def distilled(self) -> bool:
        return bool(self.pipe.config.get("is_distilled", False))

    def needs_negative(self, guidance: float) -> bool:
        """True CFG above 1, except on a step-distilled klein."""
        return not self.distilled and guidance > 1.0

    def _negatives(
        self, negatives: list[str], device: torch.device, max_sequence_length: int
    ) -> list[Tensors]:
        """The negatives' embeddings ("" unless the prompt table gives one, as the pipeline); none for a
        step-distilled klein."""
        if self.distilled:
            return super()._negatives(negatives, device, max_sequence_length)
        return self._text(negatives, device, max_sequence_length)

    def _guidance(self, guidance: float, x: torch.Tensor) -> None:
        if self.distilled and guidance != 1.0:
            raise UserInputError(
                f"--guidance {guidance:g}: this FLUX.2 klein is step-distilled (is_distilled in model_index.json), "
                "so the pipeline ignores the scale; pass --guidance 1"
            )
        return None
