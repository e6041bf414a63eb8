"""FLUX.2 (`Flux2Pipeline`, FLUX.2 [dev]) and FLUX.2 [klein] (`Flux2KleinPipeline`): the family adapters. One
model generates from text alone or from text and reference images.

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

The offline builders (the tiny models and the published sizes, random weights) are flux2_build.py's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

from stages.errors import UserInputError
from stages.models.families import (
    Condition,
    FamilyAdapter,
    Resolution,
    Tensors,
    latent_grid,
    parse_resolution,
)
from stages.models.schedules import flow_match_sigmas

FAMILY = "flux2"
KLEIN = "flux2_klein"
VAE_CHANNELS = 32
TOKEN_CHANNELS = 4 * VAE_CHANNELS  # a 2×2 patch of the VAE latent: the transformer's token width
# The pipelines' reference-image checks and cap (`Flux2ImageProcessor.check_image_input`, `__call__`).
REFERENCE_MAX_AREA = 1024 * 1024
# FLUX.2 [dev] takes up to 10 reference images (BFL's model card); diffusers sets no limit.
MAX_REFERENCES = 10

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
