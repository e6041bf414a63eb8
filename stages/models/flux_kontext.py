"""FLUX.1 Kontext (`FluxKontextPipeline`): image editing on FLUX.1's MMDiT, the family adapter and a tiny
offline builder.

Kontext is FLUX.1-dev's transformer trained to read a source image beside the noisy latents: the source's
VAE latents (FLUX's normalisation) are packed into 2×2 tokens and appended to the latent sequence, with
position ids (1, row, col), the first id 1 telling them from the generated image's (0, row, col); the
transformer's output over them is dropped. Text (CLIP pooled + T5), the σ schedule (dynamic shift from the
generated image's token count alone), the distilled guidance and the VAE are FLUX.1's (`stages.models.flux`).

The source enters at its own size, each side rounded down to a multiple of the VAE factor × 2, as
`FluxKontextPipeline.__call__` with `_auto_resize=False`: the adapter never resizes it to Kontext's
preferred ~1 MP buckets, so a prompt table decides the source size (resize sources to the training
resolution beforehand, as the reference trainers' edit datasets are).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from diffusers import FluxKontextPipeline

from stages.errors import UserInputError
from stages.models.factory import choose_size, save_pipeline
from stages.models.families import Condition, Tensors
from stages.models.flux import (
    FLUX_LORA_TARGETS,
    LATENT_CHANNELS,
    SIZES,
    FluxAdapter,
    FluxSize,
    image_ids,
    make_flux,
)
from stages.models.packing import pack

FAMILY = "flux_kontext"
# flow_grpo's LoRA targets for Kontext (scripts/train_flux_kontext.py, r64/α128): FLUX.1's list plus the
# single-stream blocks' MLP input `proj_mlp`.
KONTEXT_LORA_TARGETS = (*FLUX_LORA_TARGETS, "proj_mlp")


def make_flux_kontext(size: str, seed: int) -> FluxKontextPipeline:
    """The `FluxKontextPipeline` of `size`: FLUX.1's components (`make_flux`, guidance embedding, as
    FLUX.1 Kontext [dev] has) with seeded random weights."""
    flux = make_flux(size, seed)
    return FluxKontextPipeline(**{name: flux.components[name] for name in flux.components})


def build_flux_kontext(out_dir: str | Path, *, size: str, seed: int) -> dict[str, Any]:
    """Build and save a `FluxKontextPipeline` folder of `size` ("tiny", "small" or "full" = FLUX.1 Kontext
    [dev], FLUX.1-dev's architecture) into `out_dir`. Returns the factory summary."""
    spec: FluxSize = choose_size(FAMILY, size, SIZES)
    return save_pipeline(
        make_flux_kontext(size, seed),
        Path(out_dir),
        family=FAMILY,
        size=size,
        seed=seed,
        details={
            "image_size": spec.image_size,
            "vae_scale_factor": spec.vae_scale_factor,
            "latent_shape": [LATENT_CHANNELS, spec.sample_size, spec.sample_size],
        },
    )


class FluxKontextAdapter(FluxAdapter):
    """FLUX.1 Kontext: FLUX.1 with one source image's packed latents appended to the latent tokens.

    Each prompt's conditioning adds "image_latents" [N, 64] (the packed source latents) and "image_ids"
    [N, 3] (their position ids) to FLUX.1's T5 embeds and CLIP pooled output. The velocity is FLUX.1's over
    [latent tokens, source tokens] (`FluxAdapter.source_tokens`), its output over the latent tokens only.
    """

    name = FAMILY
    lora_targets = KONTEXT_LORA_TARGETS
    condition_images = (1, 1)

    def encode_prompts(
        self,
        prompts: list[str],
        negatives: list[str],
        device: torch.device,
        max_sequence_length: int,
        images: list[list[Any]] | None = None,
    ) -> list[tuple[Tensors, Tensors]]:
        """FLUX.1's text conditioning of the prompts, each with its source image's packed VAE latents and
        ids, as `FluxKontextPipeline.prepare_latents` makes them (the VAE posterior mode, then
        (z − shift)·scale)."""
        assert images is not None and len(images) == len(prompts)
        encoded = super().encode_prompts(prompts, negatives, device, max_sequence_length)
        pipe = self.pipe
        multiple = pipe.vae_scale_factor * 2
        for (pos, _), (image,) in zip(encoded, images):
            width, height = image.size
            height, width = height // multiple * multiple, width // multiple * multiple
            if not height or not width:
                raise UserInputError(
                    f"a condition image of {image.size[0]}x{image.size[1]} px: {self.name} needs each side at "
                    f"least {multiple} px"
                )
            pixels = pipe.image_processor.preprocess(
                pipe.image_processor.resize(image, height, width), height, width
            )
            z = pipe._encode_vae_image(pixels.to(device, pipe.vae.dtype), generator=None)
            pos["image_latents"] = pack(z)[0]
            pos["image_ids"] = image_ids(*z.shape[-2:], device, z.dtype)
            pos["image_ids"][:, 0] = 1
        return encoded

    def collate(self, items: Sequence[Tensors]) -> Tensors:
        """Stacked per-prompt tensors; the sources of one batch must have one size (one token count)."""
        sizes = {tuple(item["image_latents"].shape) for item in items}
        if len(sizes) > 1:
            raise UserInputError(
                f"condition images of several sizes in one batch ({len(sizes)} token counts); {self.name} "
                "samples a batch with one source size: resize the sources to one size, or pass --batch-size 1"
            )
        return super().collate(items)

    def source_tokens(self, cond: Condition) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's packed source latents [B, N, 64] and their ids [N, 3] (one source size per batch)."""
        return cond.pos["image_latents"], cond.pos["image_ids"][0]
