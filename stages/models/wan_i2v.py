"""Wan image-to-video (`WanImageToVideoPipeline`): Wan 2.1 I2V, Wan 2.2 I2V A14B and Wan 2.2 TI2V-5B with an
image, the family adapter and tiny offline builders.

Wan 2.1 I2V is Wan 2.1's DiT reading, beside the noisy latents, the first frame's conditioning, built as
`WanImageToVideoPipeline.__call__` builds it: the image followed by F − 1 black frames at the output size,
through the causal 3-D VAE (posterior mode, (z − mean)·std⁻¹), with a 4-channel mask marking latent frame 0
as given; [latents, mask, condition] enter as 36 channels. The image also enters through the CLIP vision
tower (its penultimate hidden states, `encode_image`), read by each block's image cross-attention
(`add_k_proj`/`add_v_proj`). Text, σ schedule, true CFG (the unconditional branch keeps the image) and the
VAE are Wan 2.1's (`stages.models.wan`).

Wan 2.2 I2V A14B is the same conditioning without the CLIP tower (its blocks have no image
cross-attention), on Wan 2.2 A14B's two experts (`transformer` at σ·1000 ≥ boundary_ratio·1000, 0.9 for
I2V, `transformer_2` below; both trained, as `wan2_2_a14b`).

Wan 2.2 TI2V-5B with an image (`expand_timesteps`) conditions otherwise, as the pipeline runs it: the image
alone through the 48-channel VAE is latent frame 0, which replaces frame 0 of x in the transformer's input,
with timestep 0 on that frame's tokens (the others get σ·1000); no mask channels, no CLIP. The transformer
is TI2V-5B's text-to-video one (`wan2_2_5b`: the same weights do both). The pipeline lets its sampler move
x's frame 0 by whatever the model predicts there and puts the condition back at the end; here the given
frame's velocity is 0, so it is no action of the policy (its log-density terms do not depend on the
weights and no gradient reaches them), and `finish` puts the condition back: the sample is the pipeline's.

The condition is encoded once per prompt, when its frame count is not known yet: for `CONDITION_FRAMES`
frames (81, the pipeline's default and Wan 2.1 I2V's training length), cut to a sample's latent frames.
The VAE is causal (each latent frame is encoded from its frames and the ones before), so the cut equals
what the pipeline encodes for that frame count, as tested. The image enters at its own size: sample at
--resolution equal to the images' size (a one-line error otherwise), as the pipeline resizes it to the
output size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import torch
from diffusers import WanImageToVideoPipeline, WanPipeline, WanTransformer3DModel
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

from stages.errors import UserInputError
from stages.models import wan
from stages.models.factory import choose_size, save_pipeline, seeded
from stages.models.families import Condition, Tensors, encode_3d
from stages.models.wan import (
    HIGH_NOISE,
    LOW_NOISE,
    SIZES,
    TEMPORAL_FACTOR,
    VARIANTS,
    WanAdapter,
    WanSize,
    make_wan,
)

FAMILY = "wan2_1_i2v"
A14B = "wan2_2_a14b_i2v"
TI2V = "wan2_2_5b_i2v"
# The text-to-video variant (`stages.models.wan.VARIANTS`) each family's VAE, text encoder and scheduler are.
BASE = {FAMILY: "wan2_1", A14B: "wan2_1", TI2V: "wan2_2_5b"}
# Published sizes beside `SIZES`: TI2V-5B's transformer is Wan 2.2 5B's (Wan2.2-TI2V-5B-Diffusers).
PUBLISHED: dict[str, dict[str, WanSize]] = {TI2V: {"full": wan.PUBLISHED["wan2_2_5b"]["full"]}}
# Wan2.2-I2V-A14B-Diffusers' model_index: the experts switch at t = 0.9·1000 (T2V: 0.875)
A14B_BOUNDARY = 0.9
CONDITION_FRAMES = 81
MASK_CHANNELS = TEMPORAL_FACTOR  # the first frame's mask, one channel per frame of a latent frame
# Flow-Factory's default LoRA targets for Wan I2V (models/wan/wan2_i2v.py): self- and cross-attention
# q/k/v/out and the feed-forward of every block (not the image cross-attention's add_k/add_v).
WAN_I2V_LORA_TARGETS = (
    "attn1.to_q",
    "attn1.to_k",
    "attn1.to_v",
    "attn1.to_out.0",
    "attn2.to_q",
    "attn2.to_k",
    "attn2.to_v",
    "attn2.to_out.0",
    "ffn.net.0.proj",
    "ffn.net.2",
)
# The tiny CLIP vision tower: 32 px crops in 8 px patches, 17 tokens (Wan 2.1 I2V: ViT-H/14 at 224, 257).
CLIP_TINY = {"hidden": 32, "layers": 2, "heads": 4, "image_size": 32, "patch": 8}


def _transformer(spec: WanSize, seed: int, component: str, image_dim: int | None) -> WanTransformer3DModel:
    """A Wan DiT taking [latents, mask, condition] (36 channels); with `image_dim`, image cross-attention."""
    channels = VARIANTS["wan2_1"].latent_channels
    with seeded(seed, component):
        return WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=spec.heads,
            attention_head_dim=spec.head_dim,
            in_channels=2 * channels + MASK_CHANNELS,
            out_channels=channels,
            text_dim=spec.text_width,
            freq_dim=spec.freq_dim,
            ffn_dim=spec.ffn,
            num_layers=spec.layers,
            image_dim=image_dim,
            added_kv_proj_dim=None if image_dim is None else spec.heads * spec.head_dim,
        )


def _sizes(family: str) -> dict[str, WanSize]:
    return {**SIZES, **PUBLISHED.get(family, {})}


def make_wan_i2v(family: str, size: str, seed: int) -> WanImageToVideoPipeline:
    """The `WanImageToVideoPipeline` of `family` (`wan2_1_i2v`: one DiT with image cross-attention and a
    CLIP vision tower; `wan2_2_a14b_i2v`: two experts, no CLIP; both 36-channel; `wan2_2_5b_i2v`: TI2V-5B's
    own 48-channel DiT with `expand_timesteps`) and `size`: the text encoder, VAE and scheduler of its
    text-to-video variant (`make_wan`), seeded random weights, on the current default device."""
    spec: WanSize = choose_size(family, size, _sizes(family))
    base = make_wan(BASE[family], size, seed)
    parts: dict[str, Any] = {}
    if family == TI2V:
        parts["transformer"] = base.transformer
        parts["expand_timesteps"] = True
    elif family == FAMILY:
        with seeded(seed, "image_encoder"):
            parts["image_encoder"] = CLIPVisionModel(
                CLIPVisionConfig(
                    hidden_size=CLIP_TINY["hidden"],
                    intermediate_size=4 * CLIP_TINY["hidden"],
                    num_hidden_layers=CLIP_TINY["layers"],
                    num_attention_heads=CLIP_TINY["heads"],
                    image_size=CLIP_TINY["image_size"],
                    patch_size=CLIP_TINY["patch"],
                )
            ).eval()
        side = CLIP_TINY["image_size"]
        parts["image_processor"] = CLIPImageProcessor(
            size={"shortest_edge": side}, crop_size={"height": side, "width": side}
        )
        parts["transformer"] = _transformer(spec, seed, HIGH_NOISE, CLIP_TINY["hidden"])
    else:
        parts["transformer"] = _transformer(spec, seed, HIGH_NOISE, None)
        parts["transformer_2"] = _transformer(spec, seed, LOW_NOISE, None)
        parts["boundary_ratio"] = A14B_BOUNDARY
    return WanImageToVideoPipeline(
        tokenizer=base.tokenizer,
        text_encoder=base.text_encoder,
        vae=base.vae,
        scheduler=base.scheduler,
        **parts,
    )


def build_wan_i2v(out_dir: str | Path, *, family: str, size: str, seed: int) -> dict[str, Any]:
    """Build and save a `WanImageToVideoPipeline` folder of `family` and `size` (`make_wan_i2v`)."""
    spec: WanSize = choose_size(family, size, _sizes(family))
    pipeline = make_wan_i2v(family, size, seed)
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
                VARIANTS[BASE[family]].latent_channels,
                (spec.frames - 1) // TEMPORAL_FACTOR + 1,
                spec.latent_side,
                spec.latent_side,
            ],
            "text_length": spec.text_length,
            "architecture": {**asdict(spec), "clip": CLIP_TINY if family == FAMILY else None},
        },
    )


build_wan2_1_i2v = partial(build_wan_i2v, family=FAMILY)
build_wan2_2_a14b_i2v = partial(build_wan_i2v, family=A14B)
build_wan2_2_5b_i2v = partial(build_wan_i2v, family=TI2V)
make_wan2_1_i2v = partial(make_wan_i2v, FAMILY)
make_wan2_2_a14b_i2v = partial(make_wan_i2v, A14B)
make_wan2_2_5b_i2v = partial(make_wan_i2v, TI2V)


class WanI2VAdapter(WanAdapter):
    """Wan 2.1 I2V, Wan 2.2 I2V A14B and TI2V-5B with an image: Wan conditioned on a first frame.

    Each prompt's positive conditioning adds "condition" [16, F'max, h, w] (the first frame then black
    frames through the VAE, `CONDITION_FRAMES` frames) and, for Wan 2.1, "image_embeds" [T, D] (CLIP's
    penultimate hidden states); the velocity is Wan's (A14B: each row's expert) over [x, mask, condition
    cut to x's F'] with the image embeddings as `encoder_hidden_states_image`, in both CFG branches.
    TI2V-5B: "condition" [48, 1, h, w] (the image alone through the VAE) replaces x's latent frame 0, whose
    tokens get timestep 0 and whose velocity is 0 (the module docstring says why).
    """

    name = FAMILY
    lora_targets = WAN_I2V_LORA_TARGETS
    condition_images = (1, 1)
    condition_tokens = False  # the first frame enters as channels (TI2V-5B: as latent frame 0)

    @classmethod
    def variant_name(cls, config: Mapping[str, Any]) -> str:
        """`wan2_2_a14b_i2v` with a `boundary_ratio`, `wan2_2_5b_i2v` with `expand_timesteps`, else `wan2_1_i2v`."""
        if config.get("boundary_ratio") is not None:
            return A14B
        return TI2V if config.get("expand_timesteps") else FAMILY

    @property
    def given_frame(self) -> bool:
        """Whether the image is latent frame 0 itself (TI2V-5B's `expand_timesteps`), not extra channels."""
        return bool(self.pipe.config.expand_timesteps)

    def encode_prompts(
        self,
        prompts: list[str],
        negatives: list[str],
        device: torch.device,
        max_sequence_length: int,
        images: list[list[Any]] | None = None,
    ) -> list[tuple[Tensors, Tensors]]:
        """Wan's text conditioning of the prompts, each with its first frame's VAE condition and CLIP
        embeddings (TI2V-5B: the image alone through the VAE), as `WanImageToVideoPipeline` makes them."""
        assert images is not None and len(images) == len(prompts)
        pipe = self.pipe

        def text(texts: list[str]) -> torch.Tensor:
            # WanPipeline's T5 encoding, the same function as this pipeline's except that diffusers 0.42's
            # image-to-video copy calls ftfy even where it is not installed (WanPipeline applies it if it is)
            return WanPipeline._get_t5_prompt_embeds(
                pipe, prompt=list(texts), max_sequence_length=max_sequence_length, device=device
            )

        encoded = [({"embeds": p}, {"embeds": n}) for p, n in zip(text(prompts), text(negatives))]
        multiple = pipe.vae_scale_factor_spatial * pipe.transformer.config.patch_size[1]
        for (pos, _), (image,) in zip(encoded, images):
            width, height = image.size
            if width % multiple or height % multiple:
                raise UserInputError(
                    f"a condition image of {width}x{height} px: {self.name} conditions on the first frame at the "
                    f"output size, so each side must be a multiple of {multiple}; resize it to the --resolution "
                    "you sample at"
                )
            if pipe.transformer.config.image_dim is not None:  # Wan 2.1's image cross-attention
                pos["image_embeds"] = pipe.encode_image(image, device)[0]
            pixels = pipe.video_processor.preprocess(image, height=height, width=width).to(
                device, torch.float32
            )
            # the frame, then black frames up to CONDITION_FRAMES (TI2V-5B: the frame alone)
            black = pixels.new_zeros(1, 3, 0 if self.given_frame else CONDITION_FRAMES - 1, height, width)
            pos["condition"] = encode_3d(pipe.vae, torch.cat([pixels.unsqueeze(2), black], dim=2))[0]
        return encoded

    def model_input(self, x: torch.Tensor, cond: Condition) -> torch.Tensor:
        """[x, mask, condition] along channels: the mask 1 on latent frame 0 (the given frame), the
        condition cut to x's latent frames (TI2V-5B: x with latent frame 0 replaced by the condition); the
        condition's size must be x's."""
        condition = cond.pos["condition"]
        frames, h, w = x.shape[2:]
        if tuple(condition.shape[-2:]) != (h, w):
            factor = self.pipe.vae_scale_factor_spatial
            raise UserInputError(
                f"--resolution {h * factor}x{w * factor}: the condition images are "
                f"{condition.shape[-1] * factor}x{condition.shape[-2] * factor} px (width x height), and "
                f"{self.name} conditions on the first frame at the output size; sample at the images' size or "
                "resize them"
            )
        if self.given_frame:
            return torch.cat([condition.to(x.dtype), x[:, :, 1:]], dim=2)
        if frames > condition.shape[2]:
            raise UserInputError(
                f"--frames: {self.name} encodes its first-frame condition for up to {CONDITION_FRAMES} frames; "
                f"pass --frames {CONDITION_FRAMES} or fewer"
            )
        mask = torch.zeros(x.shape[0], MASK_CHANNELS, *x.shape[2:], device=x.device, dtype=x.dtype)
        mask[:, :, 0] = 1
        return torch.cat([x, mask, condition[:, :, :frames].to(x.dtype)], dim=1)

    def model_timestep(self, timestep: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Wan's timestep; TI2V-5B's per-token one is 0 on the given frame's tokens (the first h/2·w/2)."""
        timestep = super().model_timestep(timestep, x)
        if not self.given_frame:
            return timestep
        given = (x.shape[3] // 2) * (x.shape[4] // 2)
        return torch.cat([timestep.new_zeros(timestep.shape[0], given), timestep[:, given:]], dim=1)

    def velocity(
        self,
        transformer: torch.nn.Module,
        x: torch.Tensor,
        sigma: torch.Tensor,
        cond: Condition,
        guidance: float,
        guidance_2: float | None = None,
    ) -> torch.Tensor:
        """Wan's guided velocity [B, C, F', h, w]; TI2V-5B's is 0 on the given latent frame 0."""
        v = super().velocity(transformer, x, sigma, cond, guidance, guidance_2)
        if not self.given_frame:
            return v
        return torch.cat([torch.zeros_like(v[:, :, :1]), v[:, :, 1:]], dim=2)

    def finish(self, x0: torch.Tensor, cond: Condition) -> torch.Tensor:
        """TI2V-5B: x0 with latent frame 0 the condition, as the pipeline returns it; else x0."""
        if not self.given_frame:
            return x0
        return torch.cat([cond.pos["condition"].to(x0.device, x0.dtype), x0[:, :, 1:]], dim=2)

    def image_input(self, cond: Condition) -> dict[str, torch.Tensor]:
        """The CLIP embeddings for the blocks' image cross-attention (both CFG branches); none for A14B."""
        if "image_embeds" not in cond.pos:
            return {}
        return {"encoder_hidden_states_image": cond.pos["image_embeds"]}
