"""Random-weight Qwen2.5-VL folders, shaped like the published checkpoints but tiny.

What is kept, because rollout and training code depends on it: the 14-px patches with 2x2 spatial
merge and temporal patch 2 (an image of h x w pixels, both multiples of 28, becomes h*w/784
`<|image_pad|>` tokens and h*w/196 rows of 1176 pixel values), window attention with full-attention
blocks in the vision tower, M-RoPE over (temporal, height, width) with a 2:3:3 section split, the
Qwen2 byte-level tokenizer layout with the ChatML and vision special tokens, a ChatML chat template
with the default system prompt, and tied embeddings (as in Qwen2.5-VL-3B). What shrinks: widths,
depths, the vocabulary (see `stages.models.tokenizers.build_qwen2_tokenizer`) and the image pixel
budget (56x56 to 112x112 pixels, i.e. 4 to 16 image tokens).

The processor is `Qwen2_5_VLImageTextProcessor`: transformers' `Qwen2_5_VLProcessor` with
`QwenVLFramesVideoProcessor` in place of its video processor, which transformers can only build with
torchvision (not installed here; its PyPI wheels need the GPU build of torch). Importing this module
registers both classes so `AutoProcessor.from_pretrained` finds them by the names saved with the
folder; images are processed exactly as by the full processor, which also returns the
`mm_token_type_ids` the model needs for 3-D rope positions, and videos (lists of frames) in the same
patch layout as transformers' `Qwen2VLVideoProcessor`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from transformers import (
    AutoProcessor,
    GenerationConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
)
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize
from transformers.processing_utils import MODALITY_TO_AUTOPROCESSOR_MAPPING
from transformers.video_processing_utils import BatchFeature, VideoProcessorMixin

from stages.models.factory import choose_size, finish_model_dir, no_progress_bars, parameter_count, seeded
from stages.models.tokenizers import build_qwen2_tokenizer

FAMILY = "qwen2_5_vl"
PATCH_SIZE = 14
SPATIAL_MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
ROPE_THETA = 1_000_000.0
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."


def chat_template(default_system: str | None) -> str:
    """ChatML as the Qwen-VL models render it: a default system turn when the conversation has none
    (Qwen2.5-VL's; None: none, as Qwen3-VL), each image part as
    <|vision_start|><|image_pad|><|vision_end|> and each video part likewise with <|video_pad|> (the
    processor expands the pad), and `add_generation_prompt` opening the assistant turn."""
    system = (
        "{%- if messages[0].role != 'system' -%}"
        "{{- '<|im_start|>system\\n" + default_system + "<|im_end|>\\n' -}}"
        "{%- endif -%}"
        if default_system
        else ""
    )
    return (
        "{%- macro render(content) -%}"
        "{%- if content is string -%}{{- content -}}"
        "{%- else -%}{%- for part in content -%}"
        "{%- if part.type == 'image' or 'image' in part or 'image_url' in part -%}"
        "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
        "{%- elif part.type == 'video' or 'video' in part -%}"
        "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
        "{%- elif 'text' in part -%}{{- part.text -}}"
        "{%- endif -%}"
        "{%- endfor -%}{%- endif -%}"
        "{%- endmacro -%}" + system + "{%- for message in messages -%}"
        "{{- '<|im_start|>' + message.role + '\\n' + render(message.content) + '<|im_end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )


CHAT_TEMPLATE = chat_template(DEFAULT_SYSTEM_PROMPT)


class QwenVLFramesVideoProcessor(VideoProcessorMixin):
    """Qwen2-VL-style video processing on PIL frames with numpy (no torchvision): the frames of a video
    are resized to one size (`smart_resize` of the first frame within [min_pixels, max_pixels], both
    sides multiples of patch × merge), scaled to [0, 1], normalised with the CLIP mean/std, padded to a
    multiple of `temporal_patch_size` frames by repeating the last, and cut into patches of
    temporal_patch_size × patch × patch pixels ordered as transformers' `Qwen2VLVideoProcessor` orders
    them (merge windows contiguous). A video of T frames at h × w pixels gives grid
    (⌈T/tps⌉, h/patch, w/patch) and rows of 3·tps·patch² values.

    Frames are taken as given (no frame sampling: `stages.sample.vlm_data` samples video files);
    `video_metadata` is returned as passed, so the processor derives each video's
    `second_per_grid_ts` from its frame rate. The patch layout is the one every Qwen-VL-style model
    (Qwen2-VL, Qwen2.5-VL, the Qwen-Omni thinkers) reads; sizes come from the instance.
    """

    model_input_names: ClassVar[list[str]] = ["pixel_values_videos", "video_grid_thw"]

    def __init__(
        self,
        min_pixels: int = 56 * 56,
        max_pixels: int = 28 * 28 * 768,
        patch_size: int = PATCH_SIZE,
        temporal_patch_size: int = TEMPORAL_PATCH_SIZE,
        merge_size: int = SPATIAL_MERGE_SIZE,
        image_mean: list[float] | None = None,
        image_std: list[float] | None = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.patch_size, self.temporal_patch_size, self.merge_size = (
            patch_size,
            temporal_patch_size,
            merge_size,
        )
        self.image_mean = list(image_mean or OPENAI_CLIP_MEAN)
        self.image_std = list(image_std or OPENAI_CLIP_STD)

    def to_dict(self) -> dict[str, Any]:
        keys = ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size")
        return {
            **{k: getattr(self, k) for k in keys},
            "image_mean": self.image_mean,
            "image_std": self.image_std,
            "video_processor_type": type(self).__name__,
        }

    def patchify(self, frames: list[Any]) -> tuple[np.ndarray, list[int]]:
        """One video's PIL frames → its patch rows [grid_t·grid_h·grid_w, 3·tps·patch²] and grid."""
        from PIL import Image

        factor = self.patch_size * self.merge_size
        width, height = frames[0].size
        h, w = smart_resize(
            height, width, factor=factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels
        )
        mean, std = np.asarray(self.image_mean, np.float32), np.asarray(self.image_std, np.float32)
        video = np.stack(
            [
                (
                    np.asarray(f.convert("RGB").resize((w, h), Image.Resampling.BICUBIC), np.float32) / 255
                    - mean
                )
                / std
                for f in frames
            ]
        ).transpose(0, 3, 1, 2)  # [T, C, h, w]
        if pad := -len(video) % self.temporal_patch_size:
            video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
        tps, p, m = self.temporal_patch_size, self.patch_size, self.merge_size
        grid = [len(video) // tps, h // p, w // p]
        patches = video.reshape(grid[0], tps, 3, grid[1] // m, m, p, grid[2] // m, m, p)
        patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return patches.reshape(grid[0] * grid[1] * grid[2], 3 * tps * p * p), grid

    def preprocess(  # type: ignore[override]
        self,
        videos: list[list[Any]],
        video_metadata: Any = None,
        return_metadata: bool = False,
        return_tensors: str | None = None,
        **kwargs: Any,
    ) -> BatchFeature:
        """videos: a list of videos, each a list of PIL frames → pixel_values_videos and video_grid_thw."""
        rows, grids = zip(*(self.patchify(list(frames)) for frames in videos))
        data: dict[str, Any] = {
            "pixel_values_videos": np.concatenate(rows),
            "video_grid_thw": np.asarray(grids, dtype=np.int64),
        }
        out = BatchFeature(data=data, tensor_type=return_tensors)
        if return_metadata:
            out["video_metadata"] = video_metadata
        return out


class FramesVideoProcessing:
    """Processor mixin (list it before the transformers processor class): `QwenVLFramesVideoProcessor`
    as the `video_processor` component, or None in folders built before it. transformers checks and
    loads a video processor through `AutoVideoProcessor`, which needs torchvision; here it is checked
    against the frames class and built from the `video_processor` entry of processor_config.json, and
    every other component is loaded as transformers loads it."""

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        if argument_name != "video_processor":
            return super().check_argument_for_proper_class(argument_name, argument)  # type: ignore[misc]
        if argument is not None and not isinstance(argument, QwenVLFramesVideoProcessor):
            raise TypeError(
                f"video_processor must be a QwenVLFramesVideoProcessor, got {type(argument).__name__}"
            )
        return QwenVLFramesVideoProcessor

    @classmethod
    def _get_arguments_from_pretrained(
        cls, pretrained_model_name_or_path: Any, processor_dict: dict | None = None, **kwargs: Any
    ) -> list[Any]:
        """The components in `__init__` order: the tokenizer and other processors as transformers loads
        them, the video processor from processor_config.json (None when it names no frames processor)."""
        kwargs.pop("subfolder", None)
        args: list[Any] = []
        for name in cls.get_attributes():  # type: ignore[attr-defined]
            if name == "video_processor":
                config = dict((processor_dict or {}).get("video_processor") or {})
                frames = config.pop("video_processor_type", None) == QwenVLFramesVideoProcessor.__name__
                args.append(QwenVLFramesVideoProcessor(**config) if frames else None)
            elif name == "tokenizer":
                args.append(
                    cls._load_tokenizer_from_pretrained(name, pretrained_model_name_or_path, **kwargs)
                )  # type: ignore[attr-defined]
            else:
                auto = MODALITY_TO_AUTOPROCESSOR_MAPPING[name]
                args.append(auto.from_pretrained(pretrained_model_name_or_path, **kwargs))
        return args


class Qwen2_5_VLImageTextProcessor(FramesVideoProcessing, Qwen2_5_VLProcessor):
    """`Qwen2_5_VLProcessor` with `QwenVLFramesVideoProcessor` as its video processor (or none, in
    folders built before it): same prompt expansion, pixel values, grids and `mm_token_type_ids`, but
    it builds and loads without torchvision."""

    def __init__(
        self,
        image_processor: Any = None,
        tokenizer: Any = None,
        video_processor: Any = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ):
        super().__init__(
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=video_processor,
            chat_template=chat_template,
            **kwargs,
        )


# Keyed by a name rather than Qwen2_5_VLConfig, so real checkpoints keep resolving to transformers' own
# processor; `AutoProcessor` finds this class through the `processor_class` saved with the folder.
AutoProcessor.register("omnirl-qwen2_5_vl-image-text", Qwen2_5_VLImageTextProcessor, exist_ok=True)


@dataclass(frozen=True)
class Qwen2_5_VLSize:
    """Widths and depths of one size; `mrope_section` halves of the text head_dim, split 2:3:3 like the real model."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    mrope_section: tuple[int, int, int]
    max_positions: int
    vision_hidden: int
    vision_intermediate: int
    vision_depth: int
    vision_heads: int
    vision_window: int
    vision_full_attention_blocks: tuple[int, ...]
    min_pixels: int
    max_pixels: int
    # Published sizes: the real vocabulary (None: the local tokenizer's length); 7B unties its lm_head.
    vocab: int | None = None
    tie_embeddings: bool = True


# Both published sizes share the vision tower (675 M: 32 blocks of 1280, windows of 112 px, full
# attention in blocks 7, 15, 23, 31) and the 2:3:3 M-RoPE split of head_dim 128.
PUBLISHED_VISION = dict(
    mrope_section=(16, 24, 24),
    max_positions=128000,
    vision_hidden=1280,
    vision_intermediate=3420,
    vision_depth=32,
    vision_heads=16,
    vision_window=112,
    vision_full_attention_blocks=(7, 15, 23, 31),
    min_pixels=56 * 56,
    max_pixels=28 * 28 * 16384,
)

SIZES: dict[str, Qwen2_5_VLSize] = {
    # head_dim 16 -> mrope 8 = 2+3+3; window 56 px = 2x2 merged tokens; 56²..112² px -> 4..16 image tokens.
    "tiny": Qwen2_5_VLSize(
        hidden=64,
        intermediate=128,
        layers=2,
        heads=4,
        kv_heads=2,
        mrope_section=(2, 3, 3),
        max_positions=4096,
        vision_hidden=32,
        vision_intermediate=64,
        vision_depth=2,
        vision_heads=2,
        vision_window=56,
        vision_full_attention_blocks=(1,),
        min_pixels=56 * 56,
        max_pixels=112 * 112,
    ),
    # Qwen/Qwen2.5-VL-3B-Instruct and -7B-Instruct (config.json): 3.75 B and 8.29 B parameters.
    "3b": Qwen2_5_VLSize(
        **PUBLISHED_VISION, hidden=2048, intermediate=11008, layers=36, heads=16, kv_heads=2, vocab=151936
    ),
    "7b": Qwen2_5_VLSize(
        **PUBLISHED_VISION,
        hidden=3584,
        intermediate=18944,
        layers=28,
        heads=28,
        kv_heads=4,
        vocab=152064,
        tie_embeddings=False,
    ),
}
SIZES["full"] = SIZES["7b"]  # the size Qwen-Image encodes its prompts with


def load_model(model_dir: str | Path, dtype: torch.dtype) -> Qwen2_5_VLForConditionalGeneration:
    """A Qwen2.5-VL folder's model (local files only)."""
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=dtype, use_safetensors=True)


def load_processor(model_dir: str | Path) -> Qwen2_5_VLProcessor:
    """The processor of a Qwen2.5-VL folder, built here or published (`AutoProcessor`, local files only)."""
    return AutoProcessor.from_pretrained(str(model_dir), local_files_only=True)


def _config(spec: Qwen2_5_VLSize, tokenizer: Any) -> Qwen2_5_VLConfig:
    """Model config whose special-token ids are the tokenizer's and whose vocabulary is exactly its length."""
    ids = dict(
        zip(
            ("bos", "eos", "pad", "image", "video", "vision_start", "vision_end"),
            tokenizer.convert_tokens_to_ids(
                [
                    "<|endoftext|>",
                    "<|im_end|>",
                    "<|endoftext|>",
                    "<|image_pad|>",
                    "<|video_pad|>",
                    "<|vision_start|>",
                    "<|vision_end|>",
                ]
            ),
        )
    )
    return Qwen2_5_VLConfig(
        text_config={
            "vocab_size": spec.vocab or len(tokenizer),
            "hidden_size": spec.hidden,
            "intermediate_size": spec.intermediate,
            "num_hidden_layers": spec.layers,
            "num_attention_heads": spec.heads,
            "num_key_value_heads": spec.kv_heads,
            "max_position_embeddings": spec.max_positions,
            "max_window_layers": spec.layers,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": ROPE_THETA,
                "mrope_section": list(spec.mrope_section),
            },
            "bos_token_id": ids["bos"],
            "eos_token_id": ids["eos"],
            "pad_token_id": ids["pad"],
            "tie_word_embeddings": spec.tie_embeddings,
        },
        vision_config={
            "depth": spec.vision_depth,
            "hidden_size": spec.vision_hidden,
            "intermediate_size": spec.vision_intermediate,
            "num_heads": spec.vision_heads,
            "out_hidden_size": spec.hidden,
            "patch_size": PATCH_SIZE,
            "spatial_merge_size": SPATIAL_MERGE_SIZE,
            "temporal_patch_size": TEMPORAL_PATCH_SIZE,
            "window_size": spec.vision_window,
            "fullatt_block_indexes": list(spec.vision_full_attention_blocks),
        },
        image_token_id=ids["image"],
        video_token_id=ids["video"],
        vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"],
        tie_word_embeddings=spec.tie_embeddings,
    )


def make_qwen2_5_vl(size: str, seed: int, tokenizer: Any = None) -> Qwen2_5_VLForConditionalGeneration:
    """The `Qwen2_5_VLForConditionalGeneration` of `size` with seeded random weights and its generation
    config, its special-token ids those of `tokenizer` (default: the local Qwen2 tokenizer), built on the
    current default device (`torch.device("meta")`: the architecture alone, no memory)."""
    spec: Qwen2_5_VLSize = choose_size(FAMILY, size, SIZES)
    tokenizer = tokenizer or build_qwen2_tokenizer(spec.max_positions)
    config = _config(spec, tokenizer)
    with seeded(seed, "model"):
        model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        bos_token_id=config.text_config.bos_token_id,
        eos_token_id=[config.text_config.eos_token_id, config.text_config.pad_token_id],
        pad_token_id=config.text_config.pad_token_id,
    )
    return model


def build_qwen2_5_vl(out_dir: str | Path, *, size: str, seed: int) -> dict[str, Any]:
    """Build and save a `Qwen2_5_VLForConditionalGeneration` folder of `size` ("tiny", or the published
    "3b" and "7b" = "full") into `out_dir`: weights, config, generation config, tokenizer, image processor
    and chat template.

    Returns the factory summary (see `stages.models.factory.init_model`).
    """
    spec: Qwen2_5_VLSize = choose_size(FAMILY, size, SIZES)
    out = Path(out_dir)
    tokenizer = build_qwen2_tokenizer(spec.max_positions)
    tokenizer.chat_template = CHAT_TEMPLATE
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=spec.min_pixels,
        max_pixels=spec.max_pixels,
        patch_size=PATCH_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        merge_size=SPATIAL_MERGE_SIZE,
    )
    video_processor = QwenVLFramesVideoProcessor(min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)
    processor = Qwen2_5_VLImageTextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )
    model = make_qwen2_5_vl(size, seed, tokenizer)
    config = model.config
    with no_progress_bars():
        model.save_pretrained(out, safe_serialization=True)
        processor.save_pretrained(out)
    return finish_model_dir(
        out,
        family=FAMILY,
        size=size,
        seed=seed,
        pipeline_class=type(model).__name__,
        parameters={
            "visual": parameter_count(model.model.visual),
            "language_model": parameter_count(model.model.language_model),
        },
        details={
            "processor_class": type(processor).__name__,
            "vocab_size": len(tokenizer),
            "image_token_id": config.image_token_id,
            "pixels_per_image_token": (PATCH_SIZE * SPATIAL_MERGE_SIZE) ** 2,
            "architecture": asdict(spec),
        },
    )
