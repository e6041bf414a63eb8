"""Qwen-Image-Edit (`QwenImageEditPipeline`) and Qwen-Image-Edit Plus (`QwenImageEditPlusPipeline`, the
2509/2511 releases with up to three reference images): the family adapters and tiny offline builders.

Both are Qwen-Image's MMDiT, VAE and Qwen2.5-VL text encoder (`stages.models.qwen_image`) made to edit:
the prompt is encoded by Qwen2.5-VL *with* the source image(s) in the chat (the vision tower sees them),
behind the edit system template (its first 64 tokens dropped), and each source's VAE latents, packed into
2×2 tokens, follow the generated image's tokens in the transformer, with one (1, rows, cols) rotary shape
per image; the output over them is dropped. Edit Plus names each reference "Picture k:" in the prompt and
gives the vision tower each one resized to a 384² px area. The σ schedule (dynamic shift from the
generated image's token count alone) and true CFG with per-token norm rescaling are Qwen-Image's.

The source enters the VAE at its own area, each side rounded to a multiple of 32 px as the pipelines'
`calculate_dimensions` rounds (the stock `__call__` resizes it to a 1024² px area first: the two agree for
sources of that area; resize a table's images to the training area beforehand, as the reference trainers'
edit datasets are).

The processor. The pipelines take a `Qwen2VLProcessor`, which transformers builds and loads only with
torchvision; `QwenImageEditProcessor` is that processor with omnirl's frames video processor
(`stages.models.qwen2_5_vl.FramesVideoProcessing`), and the adapters load the folder's `processor` with it
(`load_components`), while model_index.json names `Qwen2VLProcessor` as published folders do.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus
from transformers import Qwen2VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from stages.errors import UserInputError
from stages.models.factory import choose_size, save_pipeline
from stages.models.families import Condition, Tensors
from stages.models.qwen2_5_vl import (
    PATCH_SIZE,
    SPATIAL_MERGE_SIZE,
    TEMPORAL_PATCH_SIZE,
    FramesVideoProcessing,
    QwenVLFramesVideoProcessor,
)
from stages.models.qwen_image import (
    LATENT_CHANNELS,
    QWEN_IMAGE_LORA_TARGETS,
    SIZES,
    QwenImageAdapter,
    QwenImageSize,
    check_template_length,
    qwen_image_components,
)
from stages.models.tokenizers import build_qwen2_tokenizer

FAMILY = "qwen_image_edit"
PLUS_FAMILY = "qwen_image_edit_plus"
# The words of the edit pipelines' system template and Edit Plus's "Picture k:" labels, learned as whole
# tokens so the template's system turn tokenises to the 64 tokens the pipelines drop, as with the real
# tokenizer.
TEMPLATE_WORDS = (
    "system user assistant Picture Describe the key features of the input image (color, shape, size, "
    "texture, objects, background), then explain how the user's text instruction should alter or modify "
    "the image. Generate a new image that meets the user's requirements while maintaining consistency "
    "with the original input where appropriate."
)
SYSTEM_TURN_END = "<|im_start|>user\n"  # the dropped prefix ends here; the source's image tokens follow
# Edit Plus takes 1 to 3 references (Qwen-Image-Edit-2509's model card: "optimal" with 1 to 3)
PLUS_REFERENCES = 3
SIDE = 32  # `calculate_dimensions` rounds each side to a multiple of this


class QwenImageEditProcessor(FramesVideoProcessing, Qwen2VLProcessor):
    """`Qwen2VLProcessor` with `QwenVLFramesVideoProcessor` as its video processor: the same prompt
    expansion, pixel values and grids for the edit pipelines' source images, built and loaded without
    torchvision."""


def _make(size: str, seed: int, plus: bool) -> QwenImageEditPipeline | QwenImageEditPlusPipeline:
    """The `QwenImageEditPipeline` (`plus`: `QwenImageEditPlusPipeline`) of `size`: Qwen-Image's components
    of that size with seeded random weights, a tokenizer that keeps the edit template's token count, and a
    `QwenImageEditProcessor` with the text encoder's image pixel budget."""
    spec: QwenImageSize = choose_size(PLUS_FAMILY if plus else FAMILY, size, SIZES)
    tokenizer = build_qwen2_tokenizer(spec.text.max_positions, extra_text="\n" + TEMPLATE_WORDS + "\n")
    layout = {
        "patch_size": PATCH_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "merge_size": SPATIAL_MERGE_SIZE,
    }
    pixels = {"min_pixels": spec.text.min_pixels, "max_pixels": spec.text.max_pixels}
    processor = QwenImageEditProcessor(
        image_processor=Qwen2VLImageProcessorPil(**pixels, **layout),
        tokenizer=tokenizer,
        video_processor=QwenVLFramesVideoProcessor(**pixels, **layout),
    )
    pipeline_class = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    pipeline = pipeline_class(
        tokenizer=tokenizer, processor=processor, **qwen_image_components(spec, seed, tokenizer)
    )
    template = pipeline.prompt_template_encode
    check_template_length(pipeline, template[: template.index(SYSTEM_TURN_END) + len(SYSTEM_TURN_END)])
    return pipeline


def make_qwen_image_edit(size: str, seed: int) -> QwenImageEditPipeline:
    """The `QwenImageEditPipeline` of `size` with seeded random weights (`_make`)."""
    return _make(size, seed, plus=False)


def make_qwen_image_edit_plus(size: str, seed: int) -> QwenImageEditPlusPipeline:
    """The `QwenImageEditPlusPipeline` of `size` with seeded random weights (`_make`)."""
    return _make(size, seed, plus=True)


def _build(out_dir: str | Path, size: str, seed: int, plus: bool) -> dict[str, Any]:
    family = PLUS_FAMILY if plus else FAMILY
    spec: QwenImageSize = choose_size(family, size, SIZES)
    out = Path(out_dir)
    pipeline = _make(size, seed, plus)
    summary = save_pipeline(
        pipeline,
        out,
        family=family,
        size=size,
        seed=seed,
        details={
            "image_size": spec.image_size,
            "vae_scale_factor": spec.vae_scale_factor,
            "latent_shape": [LATENT_CHANNELS, spec.latent_size, spec.latent_size],
            "condition_images": [1, PLUS_REFERENCES if plus else 1],
        },
    )
    # the processor's class as published folders name it (the adapters load it with QwenImageEditProcessor)
    index_path = out / "model_index.json"
    index = json.loads(index_path.read_text())
    index["processor"] = ["transformers", Qwen2VLProcessor.__name__]
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    return summary


def build_qwen_image_edit(out_dir: str | Path, *, size: str, seed: int) -> dict[str, Any]:
    """Build and save a `QwenImageEditPipeline` folder of `size` ("tiny", "small" or "full" =
    Qwen-Image-Edit, Qwen-Image's architecture) into `out_dir`. Returns the factory summary."""
    return _build(out_dir, size, seed, plus=False)


def build_qwen_image_edit_plus(out_dir: str | Path, *, size: str, seed: int) -> dict[str, Any]:
    """Build and save a `QwenImageEditPlusPipeline` folder of `size` ("tiny", "small" or "full" =
    Qwen-Image-Edit-2509/2511) into `out_dir`. Returns the factory summary."""
    return _build(out_dir, size, seed, plus=True)


def vae_size(image: Any, family: str) -> tuple[int, int]:
    """(width, height) a source enters the VAE at: its own area, each side rounded to a multiple of 32 px
    by the pipelines' `calculate_dimensions`; a side under 32 px is a one-line UserInputError."""
    width, height = image.size
    if min(width, height) < SIDE:
        raise UserInputError(
            f"a condition image of {width}x{height} px: {family} needs each side at least {SIDE} px; "
            "resize the source"
        )
    return pipeline_qwenimage_edit_plus.calculate_dimensions(width * height, width / height)


class QwenImageEditAdapter(QwenImageAdapter):
    """Qwen-Image-Edit: Qwen-Image with the source in the prompt's chat and its packed VAE latents after
    the latent tokens.

    Each prompt's conditioning adds "image_latents" [N, 64] (the packed source latents of all its images,
    in order) and "image_shapes" [R, 3] int64 ((1, rows, cols) of each image's tokens) to Qwen-Image's
    "embeds" [L, D], which here encode the prompt with its source(s); the negative prompt is encoded with
    the same source(s), as the pipelines do.
    """

    name = FAMILY
    lora_targets = QWEN_IMAGE_LORA_TARGETS
    condition_images = (1, 1)

    @classmethod
    def load_components(cls, model_path: Path, wanted: set[str]) -> dict[str, Any]:
        """The folder's `processor` as `QwenImageEditProcessor` (transformers' own needs torchvision)."""
        if "processor" not in wanted:
            return {}
        return {
            "processor": QwenImageEditProcessor.from_pretrained(
                model_path / "processor", local_files_only=True
            )
        }

    def vision_inputs(self, images: list[Any], sizes: list[tuple[int, int]]) -> Any:
        """What the pipeline's `encode_prompt` takes as `image`: Edit's one source at its VAE size."""
        return self.pipe.image_processor.resize(images[0], sizes[0][1], sizes[0][0])

    def vae_pixels(self, images: list[Any], sizes: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Each source as the VAE takes it, [1, 3, 1, H, W] in [−1, 1] (Edit: resized, then preprocessed)."""
        (width, height), processor = sizes[0], self.pipe.image_processor
        return [processor.preprocess(processor.resize(images[0], height, width), height, width).unsqueeze(2)]

    def encode_prompts(
        self,
        prompts: list[str],
        negatives: list[str],
        device: torch.device,
        max_sequence_length: int,
        images: list[list[Any]] | None = None,
    ) -> list[tuple[Tensors, Tensors]]:
        """Per prompt (the pipelines encode one at a time): the pipeline's `encode_prompt` of the prompt and
        of the negative with its source(s), each unpadded, and the sources' packed VAE latents (posterior
        mode, (z − mean)/std), as `__call__` and `prepare_latents` make them."""
        assert images is not None and len(images) == len(prompts)
        pipe, encoded = self.pipe, []
        for prompt, negative, sources in zip(prompts, negatives, images):
            sizes = [vae_size(image, self.name) for image in sources]
            vision = self.vision_inputs(sources, sizes)

            def embeds(text: str, vision: Any = vision) -> Tensors:
                return {"embeds": pipe.encode_prompt(prompt=[text], image=vision, device=device)[0][0]}

            pos, neg = embeds(prompt), embeds(negative)
            latents = []
            for pixels in self.vae_pixels(sources, sizes):
                z = pipe._encode_vae_image(pixels.to(device, pipe.vae.dtype), generator=None)
                latents.append(pipe._pack_latents(z, 1, z.shape[1], *z.shape[3:])[0])
            pos["image_latents"] = torch.cat(latents)
            factor = pipe.vae_scale_factor * 2
            pos["image_shapes"] = torch.tensor(
                [(1, height // factor, width // factor) for width, height in sizes], device=device
            )
            encoded.append((pos, neg))
        return encoded

    def collate(self, items: Sequence[Tensors]) -> Tensors:
        """Qwen-Image's padded embeds and mask, and the stacked sources of the positive branch; the sources
        of one batch must have one layout (the transformer takes one list of image shapes per batch)."""
        batch = super().collate(items)
        if "image_shapes" not in items[0]:  # the negative branch: its sources are the positive's
            return batch
        if len({tuple(item["image_shapes"].flatten().tolist()) for item in items}) > 1:
            raise UserInputError(
                f"condition images of several sizes in one batch; {self.name} samples a batch with one source "
                "size: resize the sources to one size, or pass --batch-size 1"
            )
        for name in ("image_latents", "image_shapes"):
            batch[name] = torch.stack([item[name] for item in items])
        return batch

    def source_tokens(self, cond: Condition) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """The batch's packed source latents [B, N, 64] and each source's (1, rows, cols)."""
        return cond.pos["image_latents"], [tuple(shape) for shape in cond.pos["image_shapes"][0].tolist()]


class QwenImageEditPlusAdapter(QwenImageEditAdapter):
    """Qwen-Image-Edit Plus (2509/2511): Edit with 1 to 3 references, each labelled "Picture k:" in the
    prompt, given to the vision tower at a 384² px area and to the VAE at its own."""

    name = PLUS_FAMILY
    condition_images = (1, PLUS_REFERENCES)

    def vision_inputs(self, images: list[Any], sizes: list[tuple[int, int]]) -> Any:
        """Each reference resized to the pipeline's `CONDITION_IMAGE_SIZE` area (as its `__call__`)."""
        resized = []
        for image in images:
            width, height = pipeline_qwenimage_edit_plus.calculate_dimensions(
                pipeline_qwenimage_edit_plus.CONDITION_IMAGE_SIZE, image.size[0] / image.size[1]
            )
            resized.append(self.pipe.image_processor.resize(image, height, width))
        return resized

    def vae_pixels(self, images: list[Any], sizes: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Each reference preprocessed straight to its VAE size, [1, 3, 1, H, W]."""
        return [
            self.pipe.image_processor.preprocess(image, height, width).unsqueeze(2)
            for image, (width, height) in zip(images, sizes)
        ]
